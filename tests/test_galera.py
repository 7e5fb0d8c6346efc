"""MySQLCache on a MariaDB Galera cluster: every node takes writes.

Runs against the 3-node cluster `scripts/services.py galera up` starts (`make
test-galera` starts it, runs this group and stops it); skipped when none is up. Each test
here is in the ``galera`` group (``pytest -m galera``).

* Django's cache contract through each node (one alias per node).
* Writers on every node on the same keys, counters through every node, ``add`` races
  across nodes, culling on one node while the others write, a node killed.

Galera aborts a transaction that conflicts with one committed on another node at its
commit, with error 1213 (a certification failure: nothing was applied). The backend
runs such a statement again (``mysql/errors.py``: CONFLICT), so none reaches the caller:
the hammering tests count the reruns (conflicts did happen) and the errors (none), and
check that every node ends with the same entries and each counter with the increments
made.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
from django.conf import settings
from django.core.checks import Error
from django.db import OperationalError, connections
from django.test.utils import override_settings

from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.checks import check_engine_on_galera, is_galera_node
from django_kvcache.mysql import blocking, budget, pools
from django_kvcache.mysql.errors import error_code
from django_kvcache.mysql.server import forget_server
from tests.contract import CacheContract
from tests.mysql_support import BACKEND, register_alias, unregister_alias
from tests.servers import GaleraNode, services

NODES = list(settings.GALERA_ALIASES)
CLUSTER_UP = len(NODES) >= 3 and all(
    services.galera_state(int(connections.settings[alias]["PORT"])) == "Synced"
    for alias in NODES
)
TABLE = "kvcache_galera"
CERTIFICATION_FAILURE = 1213

pytestmark = [
    pytest.mark.galera,
    pytest.mark.skipif(not CLUSTER_UP, reason="no Galera cluster: `scripts/services.py "
                       "galera up` (or `make test-galera`) starts one"),
]
#: Commits for real, on every node (the node-loss test reaches a node of its own instead).
on_the_nodes = pytest.mark.django_db(transaction=True, databases=NODES if CLUSTER_UP else [])


def node_cache(alias: str, table: str = TABLE, **options: Any) -> MySQLCache:
    return MySQLCache(table, {"OPTIONS": {"DATABASE": alias, "CULL_PROBABILITY": 0, **options}})


@contextmanager
def causal_reads(alias: str) -> Iterator[None]:
    """Reads on ``alias`` — this thread's through Django's connection, and the cache's on
    its own (every idle connection of its pool: the next call takes one) — wait until the
    node has applied every commit the cluster had when they started (wsrep_sync_wait):
    what another node wrote is seen."""
    set_sync_wait(alias, 1)
    try:
        yield
    finally:
        set_sync_wait(alias, 0)


def set_sync_wait(alias: str, value: int) -> None:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SET SESSION wsrep_sync_wait = {value}")
    pool = pools.process_pool(alias)
    if not pool.idle:
        blocking.query(alias, "SELECT 1")  # one connection, idle now
    for raw in list(pool.idle):
        raw.query(f"SET SESSION wsrep_sync_wait = {value}".encode())


def everywhere(read: Callable[[MySQLCache], Any], table: str = TABLE) -> list[Any]:
    """``read(cache)`` through each node, causally: one answer per node."""
    answers = []
    for alias in NODES:
        with causal_reads(alias):
            answers.append(read(node_cache(alias, table)))
    return answers


@pytest.fixture(scope="module")
def galera_table(django_db_setup: Any, django_db_blocker: Any) -> Iterator[str]:
    """The table, created through the first node, once every node has it."""
    with django_db_blocker.unblock():
        cache = node_cache(NODES[0])
        if not cache.table_exists():
            cache.create_table()
        for alias in NODES:
            with causal_reads(alias):
                assert node_cache(alias).table_exists(alias)
        yield TABLE
        with connections[NODES[0]].cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS `{TABLE}`, `{cache.lock_table}`")


@pytest.fixture
def cache(galera_table: str) -> Iterator[MySQLCache]:
    cache = node_cache(NODES[0])
    cache.clear()
    yield cache
    cache.clear()


class Calls:
    """What the calls of many threads returned or raised, counted exactly."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.returned: list[tuple[int, Any]] = []  # (worker, result)
        self.raised: list[Exception] = []

    def attempt(self, worker: int, method: Callable[..., Any], *args: Any) -> Any:
        try:
            result = method(*args)
        except OperationalError as exc:
            with self.lock:
                self.raised.append(exc)
            return None
        with self.lock:
            self.returned.append((worker, result))
        return result

    @property
    def total(self) -> int:
        return len(self.returned) + len(self.raised)

    def check_no_conflict(self) -> None:
        """No call raised: neither a certification failure nor anything else."""
        conflicts = [exc for exc in self.raised if error_code(exc) == CERTIFICATION_FAILURE]
        assert not conflicts, f"{len(conflicts)} of {self.total} calls raised 1213: {conflicts[0]}"
        assert not self.raised, f"{len(self.raised)} calls raised, e.g. {self.raised[:3]}"


def reruns() -> int:
    """Statements this process sent again after an error, on every node, so far."""
    return sum(node_cache(alias).metrics()["shards"][alias]["reruns"] for alias in NODES)


def on_every_node(
    work: Callable[[MySQLCache, int, Calls], None],
    per_node: int = 2,
    aliases: list[str] | None = None,
    **options: Any,
) -> Calls:
    """``work(cache, worker, calls)`` in ``per_node`` threads per node, all at once, each
    with its own cache instance and connection to its node."""
    aliases = aliases or NODES
    calls = Calls()
    workers = [(alias, index) for index, alias in
               enumerate(alias for alias in aliases for _ in range(per_node))]
    start = threading.Barrier(len(workers))
    failures: list[BaseException] = []

    def run(alias: str, worker: int) -> None:
        try:
            cache = node_cache(alias, **options)
            cache.get("warm-up")  # connected before the start
            start.wait(60)
            work(cache, worker, calls)
        except BaseException as exc:  # not a call's error: the harness's, fails the test
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=worker) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not failures, failures
    assert not any(thread.is_alive() for thread in threads), "a worker hangs"
    return calls


# --- the contract, through each node --------------------------------------------------------


@on_the_nodes
class GaleraNodeContract(CacheContract):
    clock_resolution = 0.001  # expires in milliseconds

    alias = ""

    @pytest.fixture(autouse=True)
    def _table(self, galera_table: str) -> None:
        pass

    def backend_params(self) -> dict[str, Any]:
        # A table per node: no other node writes it while the contract runs.
        return {"BACKEND": BACKEND, "LOCATION": f"kvcache_contract_{self.alias}",
                "OPTIONS": {"DATABASE": self.alias}}

    def prepare(self, cache: MySQLCache) -> None:
        if not cache.table_exists():
            cache.create_table()


class TestContractThroughNode1(GaleraNodeContract):
    alias = "galera1"


class TestContractThroughNode2(GaleraNodeContract):
    alias = "galera2"


class TestContractThroughNode3(GaleraNodeContract):
    alias = "galera3"


@pytest.fixture(scope="module", autouse=True)
def drop_contract_tables(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    yield
    with django_db_blocker.unblock(), connections[NODES[0]].cursor() as cursor:
        for alias in NODES:
            cursor.execute(f"DROP TABLE IF EXISTS `kvcache_contract_{alias}`")


# --- one cache, every node ------------------------------------------------------------------


@on_the_nodes
def test_every_node_is_a_galera_node_of_one_cluster():
    sizes = set()
    for alias in NODES:
        assert is_galera_node(connections[alias])
        with connections[alias].cursor() as cursor:
            cursor.execute("SHOW STATUS LIKE 'wsrep_cluster_size'")
            sizes.add(int(cursor.fetchone()[1]))
    assert sizes == {len(NODES)}


@on_the_nodes
def test_what_one_node_writes_the_others_read(cache):
    cache.set("page", "<html>…</html>")
    cache.set_many({"a": 1, "b": [2]})
    assert everywhere(lambda c: c.get_many(["page", "a", "b"])) == [
        {"page": "<html>…</html>", "a": 1, "b": [2]}] * len(NODES)
    node_cache(NODES[1]).delete("a")
    assert everywhere(lambda c: sorted(c.get_many(["page", "a", "b"]))) == [["b", "page"]] * 3


HOT_KEYS = ["hot0", "hot1", "hot2", "hot3"]


def check_nodes_agree_on_the_hot_keys() -> None:
    seen = everywhere(lambda c: c.get_many(HOT_KEYS))
    assert seen[0] == seen[1] == seen[2] and sorted(seen[0]) == HOT_KEYS
    assert all(isinstance(value, tuple) and len(value) == 2 for value in seen[0].values())


@on_the_nodes
def test_writers_on_every_node_hammering_the_same_keys(cache):
    keys = HOT_KEYS
    reruns_before = reruns()

    def work(cache: MySQLCache, worker: int, calls: Calls) -> None:
        for round in range(60):
            calls.attempt(worker, cache.set, keys[round % len(keys)], (worker, round))
            calls.attempt(worker, cache.set_many, {key: (worker, round) for key in keys})

    calls = on_every_node(work)
    calls.check_no_conflict()
    assert reruns() > reruns_before  # the nodes did conflict: the calls were rerun
    check_nodes_agree_on_the_hot_keys()  # and hold values that were written


@on_the_nodes
def test_coroutines_on_every_node_hammering_the_same_keys(cache):
    """The same through the asyncio driver: each node's cache on one event loop, two
    coroutines per node (each on a connection of its own from the loop's pool)."""
    reruns_before = reruns()
    caches = [node_cache(alias) for alias in NODES]
    raised: list[BaseException] = []

    async def writer(cache: MySQLCache, worker: int) -> None:
        for round in range(60):
            try:
                await cache.aset(HOT_KEYS[round % len(HOT_KEYS)], (worker, round))
                await cache.aset_many({key: (worker, round) for key in HOT_KEYS})
            except OperationalError as exc:
                raised.append(exc)

    async def main() -> None:
        await asyncio.gather(*(writer(cache, worker) for worker, cache in
                               enumerate(cache for cache in caches for _ in range(2))))
        for cache in caches:
            await cache.aclose()

    asyncio.run(main())
    assert not raised, f"{len(raised)} calls raised, e.g. {raised[:3]}"
    assert reruns() > reruns_before
    check_nodes_agree_on_the_hot_keys()


@on_the_nodes
def test_counters_through_every_node(cache):
    cache.set("hits", 0, timeout=None)
    everywhere(lambda c: c.get("hits"))  # every node has the row before the race

    def work(cache: MySQLCache, worker: int, calls: Calls) -> None:
        for _ in range(60):
            calls.attempt(worker, cache.incr, "hits")

    calls = on_every_node(work)
    calls.check_no_conflict()
    succeeded = [value for _, value in calls.returned]
    # Each increment applied exactly once, reruns included.
    assert everywhere(lambda c: c.get("hits")) == [len(succeeded)] * len(NODES)
    assert len(set(succeeded)) == len(succeeded)  # no two saw the same new value


@on_the_nodes
def test_add_races_across_nodes_have_exactly_one_winner(cache):
    rounds = 25
    next_round = threading.Barrier(len(NODES) * 2)

    def work(cache: MySQLCache, worker: int, calls: Calls) -> None:
        for round in range(rounds):
            next_round.wait(60)
            calls.attempt(worker, cache.add, f"race{round}", worker)

    calls = on_every_node(work)
    assert not calls.raised, calls.raised[:3]
    winners = [worker for worker, added in calls.returned if added]
    assert len(winners) == rounds  # one per round
    keys = [f"race{round}" for round in range(rounds)]
    stored = everywhere(lambda c: c.get_many(keys))
    assert stored[0] == stored[1] == stored[2]
    added_by = {key: worker for key, worker in stored[0].items()}
    assert sorted(added_by.values()) == sorted(winners)  # each round's value is its winner's


@on_the_nodes
def test_culling_on_one_node_while_the_others_write(cache):
    limit = 100

    def work(cache: MySQLCache, worker: int, calls: Calls) -> None:
        if worker < 2:  # the first node's threads: every write may cull
            cache = node_cache(NODES[0], MAX_ENTRIES=limit, CULL_PROBABILITY=1)
        for round in range(150):
            calls.attempt(worker, cache.set, f"w{worker}.{round}", round)

    calls = on_every_node(work)
    assert not calls.raised, calls.raised[:3]
    assert calls.total == 6 * 150
    culler = node_cache(NODES[0], MAX_ENTRIES=limit)
    with causal_reads(NODES[0]):
        culler.cull()  # what the others wrote since the last cull
    counts = everywhere(lambda c: count_rows(c))
    assert counts[0] == counts[1] == counts[2] <= limit


def count_rows(cache: MySQLCache) -> int:
    with connections[cache.database].cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM `{cache.table}`")
        return cursor.fetchone()[0]


@on_the_nodes
def test_reads_on_another_node_see_a_write_with_wsrep_sync_wait(cache):
    writer, reader = node_cache(NODES[0]), node_cache(NODES[1])
    with causal_reads(NODES[1]):
        for round in range(50):
            writer.set("seen", round)
            assert reader.get("seen") == round


# --- a node lost --------------------------------------------------------------------------


KILLED = "galera_killed"


@pytest.fixture
def fourth_node(galera_table: str, django_db_blocker: Any) -> Iterator[GaleraNode]:
    """A node of the test's own that joined the cluster (with the test database and the
    table, by SST); the test may use every node. Removed afterwards."""
    node = GaleraNode()
    node.start()
    database = connections.settings[NODES[0]]["NAME"]  # the test database
    register_alias(KILLED, {**node.connection_settings(database),
                            "OPTIONS": {"charset": "utf8mb4", "connect_timeout": 2}})
    try:
        with django_db_blocker.unblock():
            yield node
            node_cache(NODES[0]).clear()
    finally:
        node.kill()
        node.remove_data()
        unregister_alias(KILLED)
        forget_server(KILLED)


def test_a_node_killed_the_others_serve_a_cache_on_it_fails_open(fourth_node):
    doomed = node_cache(KILLED, IGNORE_EXCEPTIONS=True)
    strict = node_cache(KILLED, IGNORE_EXCEPTIONS=False)
    doomed.set("before", 1)
    assert everywhere(lambda c: c.get("before")) == [1] * len(NODES)
    fourth_node.kill()
    # The cache on the dead node fails open: misses and no-ops, no exception.
    assert doomed.get("before") is None
    assert doomed.get_many(["before"]) == {}
    assert doomed.set("after", 2) is None
    assert doomed.add("after", 2) is False
    with pytest.raises(OperationalError):
        strict.get("before")
    # The others serve once they have dropped the dead node from the cluster. Until then
    # (evs.suspect_timeout, 5 s) their commits wait, longer than IO_TIMEOUT (2 s): the
    # writes meanwhile fail open, and a node may be skipped for RETRY_TIMEOUT after.
    for alias in NODES:
        survivor = node_cache(alias)

        def serves(survivor: MySQLCache = survivor, alias: str = alias) -> bool:
            survivor.set(f"after.{alias}", alias)
            return survivor.get(f"after.{alias}") == alias

        wait_for(serves)
        assert survivor.get("before") == 1
    assert everywhere(lambda c: sorted(c.get_many([f"after.{a}" for a in NODES]))) == [
        sorted(f"after.{a}" for a in NODES)] * len(NODES)


def cluster_status(alias: str) -> str:
    with connections[alias].cursor() as cursor:
        cursor.execute("SHOW STATUS LIKE 'wsrep_cluster_status'")
        return cursor.fetchone()[1]


def test_a_node_cut_off_from_the_cluster_fails_open_and_serves_again(fourth_node):
    """A node that loses the cluster (a network partition: here it stops talking to the
    others) leaves the primary component and refuses statements with 1047 ("WSREP has not
    yet prepared node for application use"): that is an unreachable server, not a failed
    statement. Once it rejoins, the cache uses it again."""
    doomed = node_cache(KILLED, IGNORE_EXCEPTIONS=True, RETRY_TIMEOUT=0.2)
    strict = node_cache(KILLED, IGNORE_EXCEPTIONS=False)
    doomed.set("before", 1)
    doomed.set("during", 0)
    with connections[KILLED].cursor() as cursor:
        cursor.execute("SET GLOBAL wsrep_provider_options = 'gmcast.isolate=1'")
    try:
        wait_for(lambda: cluster_status(KILLED) != "Primary")
        assert doomed.get("before") is None
        assert doomed.get_many(["before"]) == {}
        assert doomed.set("during", 2) is None
        assert doomed.add("during", 2) is False
        assert doomed.metrics()["shards"][KILLED]["errors"] >= 1
        with pytest.raises(OperationalError) as raised:
            strict.get("before")
        assert error_code(raised.value) == 1047
    finally:
        with connections[KILLED].cursor() as cursor:
            cursor.execute("SET GLOBAL wsrep_provider_options = 'gmcast.isolate=0'")
    wait_for(lambda: services.galera_state(fourth_node.port) == "Synced")
    # RETRY_TIMEOUT has passed: asked again, it answers; the key whose write it missed
    # was owed a delete: its older value (0) is gone, not served again.
    wait_for(lambda: doomed.get("before") == 1)
    assert doomed.get("during") is None
    doomed.set("after", 3)
    assert everywhere(lambda c: c.get("after")) == [3] * len(NODES)


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


# --- the system check ---------------------------------------------------------------------


@on_the_nodes
def test_check_refuses_a_non_innodb_engine_on_a_galera_node(galera_table):
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "myisam": {"BACKEND": BACKEND, "LOCATION": "kvcache_galera_myisam",
                   "OPTIONS": {"DATABASE": NODES[1], "ENGINE": "MyISAM"}},
        "innodb": {"BACKEND": BACKEND, "LOCATION": TABLE, "OPTIONS": {"DATABASE": NODES[2]}},
    }
    with override_settings(CACHES=caches):
        assert check_engine_on_galera() == []  # no database access unless allowed
        (error,) = check_engine_on_galera(databases=[NODES[0]])
    assert isinstance(error, Error) and error.id == "kvcache.E010"
    assert "CACHES['myisam']" in error.msg and "MyISAM" in error.msg and f"'{NODES[1]}'" in error.msg



# --- locks (cache.lock(): django_kvcache.mysql.locks) ----------------------------------------


def certification_aborts() -> int:
    """Transactions the nodes aborted so far because a write committed on another node
    conflicted with them (at certification, or while being applied)."""
    total = 0
    for alias in NODES:
        with connections[alias].cursor() as cursor:
            cursor.execute("SHOW STATUS WHERE Variable_name IN "
                           "('wsrep_local_cert_failures', 'wsrep_local_bf_aborts')")
            total += sum(int(value) for _, value in cursor.fetchall())
    return total


@on_the_nodes
def test_lock_grants_on_two_nodes_are_decided_by_certification(cache):
    """Workers on every node race for one lock at once, round after round: each round
    has exactly one holder, however the nodes' grants collided (certification aborts
    the later of two conflicting grants: it runs again and finds the lock held)."""
    rounds = 30
    next_round = threading.Barrier(len(NODES) * 2)
    conflicts_before = certification_aborts() + reruns()

    def work(cache: MySQLCache, worker: int, calls: Calls) -> None:
        for round in range(rounds):
            lock = cache.lock(f"race{round}", timeout=60)
            next_round.wait(60)
            if calls.attempt(worker, lock.acquire, False):
                calls.attempt(worker, lambda: (round, lock.token))

    calls = on_every_node(work)
    assert not calls.raised, calls.raised[:3]
    held = sorted(result for _, result in calls.returned if isinstance(result, tuple))
    assert [round for round, _ in held] == list(range(rounds))  # one holder per round
    collided = certification_aborts() + reruns() - conflicts_before
    print(f"certification aborts and reruns: {collided}")
    assert collided > 0  # the grants did collide


@on_the_nodes
def test_holders_through_every_node_take_turns(cache):
    """Holders on every node, each lock held briefly: no two hold it at once, and each
    grant's token is larger than the one before (checked through the intervals)."""
    intervals: list[tuple[int, int, int]] = []
    guard = threading.Lock()

    def work(cache: MySQLCache, worker: int, calls: Calls) -> None:
        for _ in range(10):
            with cache.lock("turns", timeout=60, sleep=0.005) as lock:
                started = time.monotonic_ns()
                time.sleep(0.002)
                with guard:
                    intervals.append((started, time.monotonic_ns(), lock.token))

    on_every_node(work)
    ordered = sorted(intervals)
    assert len(ordered) == len(NODES) * 2 * 10
    for before, after in zip(ordered, ordered[1:]):
        assert before[1] <= after[0] and before[2] < after[2], (before, after)


def test_a_node_cut_off_holds_no_lock_and_grants_none(fourth_node):
    """A partition: a node outside the primary component refuses lock calls (1047, as
    unreachable: a non-blocking acquire answers False, the others raise, whatever
    IGNORE_EXCEPTIONS says); the nodes of the primary component still see the grant
    made through it before the cut, until it expires, then grant the lock with a larger
    token; once back, its old holder finds its grant gone."""
    cut_off = node_cache(KILLED, IGNORE_EXCEPTIONS=True, RETRY_TIMEOUT=0.2)
    cut_off.lock("warm-up").locked()
    held_there = cut_off.lock("feed", timeout=8)
    assert held_there.acquire()
    survivor = node_cache(NODES[0])
    wait_for(lambda: survivor.lock("feed").locked())  # replicated
    with connections[KILLED].cursor() as cursor:
        cursor.execute("SET GLOBAL wsrep_provider_options = 'gmcast.isolate=1'")
    try:
        wait_for(lambda: cluster_status(KILLED) != "Primary")
        other_there = cut_off.lock("feed", timeout=60)
        assert other_there.acquire(blocking=False) is False
        with pytest.raises(OperationalError) as raised:
            other_there.acquire()
        assert error_code(raised.value) == 1047
        with pytest.raises(OperationalError):
            held_there.extend(10)
        successor = survivor.lock("feed", timeout=60, sleep=0.05)
        assert successor.acquire(blocking=False) is False  # the cut-off node's grant lives
        assert successor.acquire(blocking_timeout=20)  # ...until it expires
        assert successor.token > held_there.token
    finally:
        with connections[KILLED].cursor() as cursor:
            cursor.execute("SET GLOBAL wsrep_provider_options = 'gmcast.isolate=0'")
    wait_for(lambda: services.galera_state(fourth_node.port) == "Synced")
    wait_for(lambda: cut_off.lock("feed").locked())  # it sees the successor's grant
    assert not held_there.owned()
    successor.release()


# --- MAX_SIZE (django_kvcache.mysql.budget) ---------------------------------------------------

BUDGET_TABLE = "kvcache_galera_budget"


@on_the_nodes
def test_budgeted_writes_of_their_own_keys_on_every_node_never_conflict(galera_table):
    """MAX_SIZE keeps nothing per write (its estimate reads a sample): writers of their
    own keys on every node certify without a conflict, as without a budget. (The
    triggers' totals rows of the earlier design were written by every write, and every
    node's.)"""
    budgeted = node_cache(NODES[0], BUDGET_TABLE, MAX_SIZE="10MB")
    budgeted.create_table()
    try:
        for alias in NODES:
            with causal_reads(alias):
                assert node_cache(alias, BUDGET_TABLE, MAX_SIZE="10MB").table_exists(alias)
        conflicts_before = certification_aborts() + reruns()
        rng = random.Random(41)
        values = [rng.randbytes(rng.randrange(1000, 4000)) for _ in range(300)]

        def work(cache: MySQLCache, worker: int, calls: Calls) -> None:
            for i, value in enumerate(values):  # 1 check in about 100 writes
                calls.attempt(worker, cache.set, f"w{worker}-{i}", value, 3600)

        calls = on_every_node(work, table=BUDGET_TABLE, MAX_SIZE="10MB")
        calls.check_no_conflict()
        assert certification_aborts() + reruns() == conflicts_before
        summed = (f"SELECT SUM(LENGTH(`cache_key`) + LENGTH(`value`)), COUNT(*) "
                  f"FROM `{BUDGET_TABLE}`")
        for alias in NODES:
            with causal_reads(alias):
                held = budget.server_estimate(alias, BUDGET_TABLE)
                size, rows = blocking.query(alias, summed)[0]
            assert held == (size, rows, True)
            assert rows == len(NODES) * 2 * len(values)
    finally:
        with connections[NODES[0]].cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS `{BUDGET_TABLE}`, `{budgeted.lock_table}`")
