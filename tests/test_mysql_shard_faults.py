"""A shard that fails: its server stopped, restarted under load, or hung, with
OPTIONS["IGNORE_EXCEPTIONS"] on (misses and no-ops, logged once per episode, counted,
skipped while marked down) and off (every call raises).

The failing shard is a MariaDB of the test's own (the ``mariadb_server`` fixture), the
healthy one a MariaDB of this module's own: both are registered as DATABASES aliases at
run time. A hung server is simulated by a listener that accepts connections and never
answers (the only fake server here).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable, Iterator

import MySQLdb
import pytest
from django.db import OperationalError, connections

from django_kvcache import outdated

from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.forks import Registry
from django_kvcache.mysql import cluster as cluster_module
from django_kvcache.mysql.errors import ShardDown, is_unreachable
from tests.mysql_support import (
    register_alias,
    registered_alias,
    sent_statements,
    unregister_alias,
    wait_for,
)
from tests.servers import MariaDBServer

pytestmark = pytest.mark.once  # servers failing, not Django's API

OWN = "kvcache_shard_faults"
HEALTHY = "kvcache_shard_healthy"
TABLE = "kvcache_shard_faults"


def with_timeouts(entry: dict[str, Any]) -> dict[str, Any]:
    """The recommended cache alias: bounded connect, read and write waits."""
    options = {**entry["OPTIONS"], "connect_timeout": 2, "read_timeout": 5, "write_timeout": 5}
    return {**entry, "OPTIONS": options}


@pytest.fixture(autouse=True)
def new_shard_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no record of missed writes: they are process-wide per table,
    alias and key prefix, and tests here share all three (a clean-up another test left
    owing, or a flush, would be this test's)."""
    monkeypatch.setattr(cluster_module, "_missed_writes", Registry())
    monkeypatch.setattr(cluster_module, "_clusters", Registry())


@pytest.fixture(scope="module")
def healthy_shard(django_db_blocker) -> Iterator[MariaDBServer]:
    server = MariaDBServer()
    server.start()
    register_alias(HEALTHY, with_timeouts(server.connection_settings()))
    try:
        yield server
    finally:
        with django_db_blocker.unblock():
            unregister_alias(HEALTHY)
        server.remove()


@pytest.fixture
def own_shard(healthy_shard, mariadb_server, django_db_blocker) -> Iterator[Any]:
    register_alias(OWN, with_timeouts(mariadb_server.connection_settings()))
    try:
        with django_db_blocker.unblock():
            yield mariadb_server
    finally:
        unregister_alias(OWN)


def make_cache(ignore: bool, **options: Any) -> MySQLCache:
    cache = MySQLCache(TABLE, {"OPTIONS": {
        "DATABASES": [HEALTHY, OWN], "IGNORE_EXCEPTIONS": ignore, "CULL_PROBABILITY": 0,
        # Per test: health records are process-wide per (alias, threshold, retry window).
        "RETRY_TIMEOUT": options.pop("RETRY_TIMEOUT", 0.3),
        **options,
    }})
    if not cache.table_exists():
        cache.create_table()
    cache.clear()
    return cache


def keys_by_shard(cache: MySQLCache, count: int = 40) -> tuple[list[str], list[str]]:
    """Caller keys on the healthy shard and on the test's own shard."""
    healthy, own = [], []
    for i in range(count):
        key = f"key{i}"
        (healthy if cache._shard_for(cache.make_key(key)).alias == HEALTHY else own).append(key)
    return healthy, own


def ignored_lines(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(f"Ignored MySQL failure on shard {OWN!r} of ")]


def logged(caplog: Any, start: str, *parts: str) -> bool:
    """Whether a line starts with ``start`` and has each of ``parts``."""
    return any(r.getMessage().startswith(start) and all(p in r.getMessage() for p in parts)
               for r in caplog.records)


# --- IGNORE_EXCEPTIONS on -------------------------------------------------------------------


def test_a_stopped_shard_gives_misses_and_no_ops(own_shard, caplog):
    caplog.set_level(logging.WARNING)
    cache = make_cache(True, RETRY_TIMEOUT=60)
    healthy, own = keys_by_shard(cache)
    items = {key: key.upper() for key in healthy + own}
    assert cache.set_many(items) == []
    # The counters are the process's, per table and alias: other tests' calls count too.
    before = {alias: cache.metrics()["shards"][alias] for alias in (OWN, HEALTHY)}
    own_shard.stop()

    assert cache.get(own[0], "default") == "default"
    assert cache.get_many(items) == {key: items[key] for key in healthy}
    assert sorted(cache.set_many(items)) == sorted(own)  # the down shard's keys failed
    assert cache.has_key(own[0]) is False
    assert cache.add(own[1], 1) is False
    assert cache.touch(own[0]) is False
    assert cache.delete(own[0]) is False
    cache.set(own[0], "lost")  # a no-op
    cache.delete_many(items)  # the healthy shard's keys go
    cache.clear()
    with pytest.raises(ValueError):  # as for a missing key, as on memcached
        cache.incr(own[0])
    assert cache.keys_with_prefix("key") == []
    assert cache.get_many(items) == {}

    assert len(ignored_lines(caplog)) == 1  # one line for the whole episode
    assert any(f"MySQL shard {OWN} is down" in r.getMessage() for r in caplog.records)
    now = cache.metrics()["shards"][OWN]
    shard = {name: now[name] - before[OWN][name] for name in ("errors", "skipped", "ignored")}
    assert now["down"] is True
    assert shard["errors"] == 2  # FAILURE_THRESHOLD: every later call was skipped
    assert shard["skipped"] >= 10
    assert shard["ignored"] == shard["errors"] + shard["skipped"]  # incr's ValueError too
    assert cache.metrics()["shards"][HEALTHY]["errors"] == before[HEALTHY]["errors"]

    # One database (OPTIONS["DATABASE"]) fails open the same way, sharing the health record.
    single = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": OWN, "IGNORE_EXCEPTIONS": True,
                                            "RETRY_TIMEOUT": 60}})
    assert single.get("x", "default") == "default"
    assert single.set_many({"x": 1}) == ["x"]
    assert len(ignored_lines(caplog)) == 1


def test_a_shard_marked_down_is_skipped_without_waiting(healthy_shard, django_db_blocker):
    """A hung server (accepts, never answers) costs CONNECT_TIMEOUT until it is marked
    down; from then on calls skip it at once."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    entry = {**healthy_shard.connection_settings(), "PORT": str(listener.getsockname()[1]),
             "OPTIONS": {"charset": "utf8mb4", "connect_timeout": 1}}
    register_alias(OWN, entry)
    blocker = django_db_blocker.unblock()
    blocker.__enter__()
    try:
        cache = MySQLCache(TABLE, {"OPTIONS": {
            "DATABASES": [HEALTHY, OWN], "IGNORE_EXCEPTIONS": True, "RETRY_TIMEOUT": 60,
            "FAILURE_THRESHOLD": 1, "CULL_PROBABILITY": 0,
        }})
        _, own = keys_by_shard(cache, 100)
        started = time.monotonic()
        assert cache.get(own[0]) is None  # waits for the connect timeout, once
        first = time.monotonic() - started
        skipped_before = cache.metrics()["shards"][OWN]["skipped"]  # counters are per process
        started = time.monotonic()
        for key in own[:20]:
            assert cache.get(key) is None
        skipping = time.monotonic() - started
        assert first >= 0.9
        assert skipping < 0.5  # 20 calls, no connection attempt
        assert cache.metrics()["shards"][OWN]["skipped"] - skipped_before == 20
        skipped_before = cache.metrics()["shards"][OWN]["skipped"]
        with pytest.raises(ValueError):  # skipped too, and answered as a missing key
            cache.incr(own[0])
        assert cache.metrics()["shards"][OWN]["skipped"] == skipped_before + 1
    finally:
        stop.set()
        acceptor.join(5)
        for connection in held:
            connection.close()
        listener.close()
        unregister_alias(OWN)
        blocker.__exit__(None, None, None)


def test_a_restarted_shard_serves_again_after_the_retry_window(own_shard, caplog):
    caplog.set_level(logging.WARNING)
    cache = make_cache(True, RETRY_TIMEOUT=0.5)
    healthy, own = keys_by_shard(cache)
    cache.set_many({key: 1 for key in own})
    own_shard.stop()
    assert cache.get_many(own) == {}
    assert cache.get_many(own) == {}  # marked down now
    own_shard.start()
    assert wait_for(lambda: cache.get_many(own) == {key: 1 for key in own})
    assert cache.metrics()["shards"][OWN]["down"] is False
    assert any(f"MySQL shard {OWN} is back up" in r.getMessage() for r in caplog.records)
    assert logged(caplog, f"MySQL shard {OWN!r} of ", " answers again: ")


# --- a shard failing in the middle of a *_many -------------------------------------------


def waiting_on(server: Any, statement_start: str) -> bool:
    """Whether ``server`` is running a statement starting with ``statement_start``."""
    observer = MySQLdb.connect(**observer_params(server))
    try:
        observer.query(b"SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE "
                       + observer.string_literal((statement_start + "%").encode()))
        return observer.store_result().fetch_row()[0][0] > 0
    finally:
        observer.close()


def observer_params(server: Any) -> dict[str, Any]:
    entry = server.connection_settings()
    return {"host": entry["HOST"], "port": int(entry["PORT"]), "user": entry["USER"],
            "password": entry["PASSWORD"], "database": entry["NAME"], "charset": "utf8mb4"}


@pytest.mark.parametrize("ignore", [True, False])
def test_a_shard_that_dies_with_a_statement_in_flight(own_shard, ignore):
    """Both shards have their SELECT; the own shard's waits for a table lock, then its
    server dies (killed: a server stopping cleanly may still take the rerun of the
    SELECT on a new connection, and answer it). Under IGNORE_EXCEPTIONS its keys are
    misses and the healthy shard's rows are returned; without, the call raises. The
    healthy shard's connection is usable afterwards either way: its reply was read."""
    cache = make_cache(ignore, RETRY_TIMEOUT=59)  # a health record of its own
    healthy, own = keys_by_shard(cache)
    items = {key: key.upper() for key in healthy + own}
    assert cache.set_many(items) == []
    locker = MySQLdb.connect(**observer_params(own_shard))
    locker.query(f"LOCK TABLES `{TABLE}` WRITE".encode())
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append(cache.get_many(items))
        except Exception as exc:  # checked below
            outcome.append(exc)
        try:  # the same thread's connection to the healthy shard
            outcome.append(MySQLCache(TABLE, {"OPTIONS": {"DATABASE": HEALTHY}}).get_many(healthy))
        finally:
            connections.close_all()

    thread = threading.Thread(target=call)
    thread.start()
    try:
        assert wait_for(lambda: waiting_on(own_shard, "SELECT `cache_key`"))
    finally:
        own_shard.crash()
        thread.join(30)
    got, afterwards = outcome
    if ignore:
        assert got == {key: items[key] for key in healthy}
    else:
        assert isinstance(got, OperationalError) and is_unreachable(got)
    assert afterwards == {key: items[key] for key in healthy}
    assert cache.metrics()["shards"][HEALTHY]["errors"] == 0


# --- writes a shard missed while it could not be reached ---------------------------------


@pytest.mark.parametrize("ignore", [True, False])
def test_a_write_missed_while_down_is_not_served_after_restart(own_shard, ignore, caplog):
    caplog.set_level(logging.WARNING)
    cache = make_cache(ignore, RETRY_TIMEOUT=0.3)
    healthy, own = keys_by_shard(cache)
    items = {key: "old" for key in healthy + own}
    cache.set_many(items)
    own_shard.stop()
    changed, deleted, batch, untouched = own[0], own[1], own[2:5], own[5:]

    def write(call: Callable[[], Any]) -> None:
        try:
            call()
        except OperationalError:  # without IGNORE_EXCEPTIONS each write raises
            assert not ignore

    write(lambda: cache.set(changed, "new"))
    write(lambda: cache.delete(deleted))
    write(lambda: cache.set_many({key: "new" for key in batch + healthy}))
    if ignore:
        assert cache.metrics()["shards"][OWN]["outdated_keys"] == 5
    own_shard.start()
    expected = {key: "new" for key in healthy} | dict.fromkeys(untouched, "old")
    assert wait_for(lambda: got_without_error(cache, items) == expected)
    assert cache.metrics()["shards"][OWN]["outdated_keys"] == 0
    assert logged(caplog, f"MySQL shard {OWN!r} of ", " answers again: deleted the 5 key")
    cache.set(changed, "newer")  # the shard serves again as usual
    assert cache.get(changed) == "newer"


def got_without_error(cache: MySQLCache, keys: Any) -> Any:
    try:
        return cache.get_many(keys)
    except OperationalError:
        return None


def test_a_missed_clear_or_too_many_missed_writes_clear_the_shard(own_shard, monkeypatch):
    monkeypatch.setattr(outdated, "LIMIT", 3)
    make_cache(True)  # the table, emptied
    cache = MySQLCache(TABLE, {"KEY_PREFIX": "mine", "OPTIONS": {
        "DATABASES": [HEALTHY, OWN], "IGNORE_EXCEPTIONS": True, "RETRY_TIMEOUT": 0.3}})
    healthy, own = keys_by_shard(cache)
    cache.set_many(dict.fromkeys(healthy + own, "old"))
    other = MySQLCache(TABLE, {"KEY_PREFIX": "other", "OPTIONS": {"DATABASE": OWN}})
    other.set("kept", "other cache")
    own_shard.stop()
    for key in own[:4]:  # one over the limit: the record gives up listing keys
        cache.set(key, "new")
    assert cache.metrics()["shards"][OWN]["flush_pending"] is True
    own_shard.start()
    *listed, probe = own
    assert wait_for(lambda: serves(cache, probe))  # its first call cleared it
    assert cache.get_many(listed) == {}  # even the keys not written during the outage
    assert cache.get_many(healthy) == dict.fromkeys(healthy, "old")
    assert other.get("kept") == "other cache"  # only this cache's keys (its KEY_PREFIX)

    cache.set_many(dict.fromkeys(own, "old"))
    own_shard.stop()
    cache.clear()  # the healthy shard is cleared, the stopped one missed it
    own_shard.start()
    assert wait_for(lambda: serves(cache, probe))
    assert cache.get_many(listed) == {}


def serves(cache: MySQLCache, key: str) -> bool:
    """Whether the shard of ``key`` stores and returns a value (not marked down)."""
    try:
        cache.set(key, "probe")
        return cache.get(key) == "probe"
    except OperationalError:
        return False


# --- under load, both policies --------------------------------------------------------------


class Load:
    """A thread doing set/get rounds over keys of both shards; records every outcome."""

    def __init__(self, cache_factory: Callable[[], MySQLCache]) -> None:
        self.cache_factory = cache_factory
        self.outcomes: list[tuple[float, str, str, BaseException | None]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.work)

    def work(self) -> None:
        cache = self.cache_factory()  # this thread's instance, as Django gives one per thread
        healthy, own = keys_by_shard(cache, 20)
        round_ = 0
        while not self.stopping.is_set():
            round_ += 1
            for shard, key in (("healthy", healthy[round_ % len(healthy)]),
                               ("own", own[round_ % len(own)])):
                result, error = self.attempt(cache, key, round_)
                self.outcomes.append((time.monotonic(), shard, result, error))  # when it ended
        connections.close_all()

    @staticmethod
    def attempt(cache: MySQLCache, key: str, value: int) -> tuple[str, BaseException | None]:
        """``set`` then ``get``: "ok", "miss" (nothing read back), "stale" (an older value:
        the set was skipped while the shard was down, the get was its first probe) or
        "error"."""
        try:
            cache.set(key, value)
            got = cache.get(key)
        except Exception as exc:  # recorded; the tests check which ones may happen
            return "error", exc
        if got == value:
            return "ok", None
        return ("miss" if got is None else "stale"), None

    def __enter__(self) -> "Load":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopping.set()
        self.thread.join(30)


def restart_under(load: Load, server: Any) -> tuple[float, float]:
    time.sleep(0.3)
    down = time.monotonic()
    server.stop()
    time.sleep(0.5)
    server.start()
    back = time.monotonic()
    assert wait_for(lambda: any(t > back and s == "own" and r == "ok"
                                for t, s, r, _ in load.outcomes[-50:]))
    return down, back


def test_restart_under_load_with_exceptions_ignored(own_shard):
    with Load(lambda: make_cache(True, RETRY_TIMEOUT=0.3)) as load:
        down, back = restart_under(load, own_shard)
        time.sleep(0.2)
    assert [error for _, _, result, error in load.outcomes if result == "error"] == []
    assert {result for _, shard, result, _ in load.outcomes if shard == "healthy"} == {"ok"}
    own_misses = [t for t, shard, result, _ in load.outcomes if shard == "own" and result != "ok"]
    assert own_misses and all(down <= t for t in own_misses)
    # A set skipped while the shard was down is deleted there before it serves again.
    assert "stale" not in {result for _, _, result, _ in load.outcomes}
    assert any(s == "healthy" and down < t < back for t, s, _, _ in load.outcomes)


def test_restart_under_load_with_exceptions_raised(own_shard):
    with Load(lambda: make_cache(False)) as load:
        down, back = restart_under(load, own_shard)
        time.sleep(0.2)
    failures = [(t, shard, error) for t, shard, result, error in load.outcomes if result == "error"]
    assert failures, "calls made while the server was down must raise"
    for t, shard, error in failures:  # only the stopped shard, only connection errors
        assert shard == "own" and isinstance(error, OperationalError) and is_unreachable(error)
        assert not isinstance(error, ShardDown)  # not skipped: every call tried and raised
        assert down <= t
    assert {result for _, _, result, _ in load.outcomes} == {"ok", "error"}
    last_failure = max(t for t, _, _ in failures)
    assert last_failure < back + 1.0  # every call once it is back succeeds


# --- one failure policy on every path (issue 21) ---------------------------------------------


def dead_first(ignore: bool, **options: Any) -> MySQLCache:
    """A cache whose first shard is the test's own (stopped by the test), so a policy that
    stops at the first failure never reaches the healthy one."""
    make_cache(ignore)  # the table on both shards, emptied
    return MySQLCache(TABLE, {"OPTIONS": {
        "DATABASES": [OWN, HEALTHY], "IGNORE_EXCEPTIONS": ignore, "CULL_PROBABILITY": 0,
        "RETRY_TIMEOUT": options.pop("RETRY_TIMEOUT", 0.3), **options}})


def own_first(cache: MySQLCache, healthy: list[str], own: list[str]) -> list[str]:
    """The caller keys in an order whose first key lives on the stopped shard."""
    return own + healthy


@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("operation", ["set_many", "delete_many"])
def test_a_many_call_reaches_every_shard(own_shard, operation, ignore):
    """Defect 1: one shard down must not keep the others' older values; the keys of the
    down shard are remembered as missed."""
    cache = dead_first(ignore)
    healthy, own = keys_by_shard(cache)
    keys = own_first(cache, healthy, own)
    cache.set_many(dict.fromkeys(keys, "old"))
    own_shard.stop()
    call = {"set_many": lambda: cache.set_many(dict.fromkeys(keys, "new")),
            "delete_many": lambda: cache.delete_many(keys)}[operation]
    if ignore:
        result = call()
        if operation == "set_many":
            assert sorted(result) == sorted(own)
    else:
        with pytest.raises(OperationalError):
            call()
    expected = dict.fromkeys(healthy, "new") if operation == "set_many" else {}
    assert MySQLCache(TABLE, {"OPTIONS": {"DATABASE": HEALTHY}}).get_many(healthy) == expected
    assert cache.metrics()["shards"][OWN]["outdated_keys"] == len(own)


@pytest.mark.parametrize("ignore", [False, True])
def test_clear_and_delete_with_prefix_reach_every_shard(own_shard, ignore):
    """Defect 2: a shard that fails a clear() or delete_with_prefix() leaves the others
    done, and is flushed when it returns."""
    cache = dead_first(ignore)
    healthy, own = keys_by_shard(cache)
    on_healthy = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": HEALTHY}})
    for operation in (cache.clear, lambda: cache.delete_with_prefix("key")):
        own_shard.start()
        assert wait_for(lambda: serves(cache, own[0]))
        cache.set_many(dict.fromkeys(healthy + own, "old"))
        own_shard.stop()
        if ignore:
            operation()
        else:
            with pytest.raises(OperationalError):
                operation()
        assert on_healthy.get_many(healthy) == {}
        assert cache.metrics()["shards"][OWN]["flush_pending"] is True


def expired_rows(alias: str, count: int) -> None:
    past = int(time.time() * 1000) - 60_000
    with connections[alias].cursor() as cursor:
        cursor.executemany(f"INSERT INTO `{TABLE}` VALUES (%s, 'x', 0, %s)",
                           [(f":1:expired{i}", past) for i in range(count)])


def rows_on(alias: str) -> int:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM `{TABLE}`")
        return cursor.fetchone()[0]


def test_cull_culls_the_shards_that_answer(own_shard):
    """Defect 2: cull() tries every shard; under IGNORE_EXCEPTIONS a failing one is
    logged and counted, not raised; without, it raises once the others are culled."""
    for ignore in (True, False):
        cache = dead_first(ignore)
        expired_rows(HEALTHY, 5)
        own_shard.stop()
        if ignore:
            assert cache.cull() == 5
        else:
            with pytest.raises(OperationalError):
                cache.cull()
        assert rows_on(HEALTHY) == 0
        own_shard.start()


def test_cull_all_culls_every_cache_before_raising(own_shard, settings):
    """Defect 2: kvcache_cull from cron culls every other cache when one fails."""
    fine_table = "kvcache_shard_fine"
    fine = MySQLCache(fine_table, {"OPTIONS": {"DATABASE": HEALTHY}})
    if not fine.table_exists():
        fine.create_table()
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "broken": {"BACKEND": "django_kvcache.backends.mysql.MySQLCache", "LOCATION": TABLE,
                   "OPTIONS": {"DATABASE": OWN, "RETRY_TIMEOUT": 0.3}},
        "fine": {"BACKEND": "django_kvcache.backends.mysql.MySQLCache",
                 "LOCATION": fine_table, "OPTIONS": {"DATABASE": HEALTHY}},
    }
    from django_kvcache.maintenance import cull_all

    past = int(time.time() * 1000) - 60_000
    with connections[HEALTHY].cursor() as cursor:
        cursor.executemany(f"INSERT INTO `{fine_table}` VALUES (%s, 'x', 0, %s)",
                           [(f":1:expired{i}", past) for i in range(4)])
        own_shard.stop()
        with pytest.raises(OperationalError):
            cull_all()
        cursor.execute(f"SELECT COUNT(*) FROM `{fine_table}`")
        assert cursor.fetchone() == (0,)  # culled although "broken" came first
        cursor.execute(f"DROP TABLE `{fine_table}`")


# --- owed clean-up: bounded, and never a reason to mark a shard down (defect 4) ------------


@pytest.fixture
def slow_own_shard(healthy_shard, mariadb_server, django_db_blocker) -> Iterator[Any]:
    """The test's own shard with the read_timeout the docs recommend: 1 s."""
    entry = mariadb_server.connection_settings()
    options = {**entry["OPTIONS"], "connect_timeout": 2, "read_timeout": 1, "write_timeout": 5}
    with registered_alias(OWN, {**entry, "OPTIONS": options}, django_db_blocker):
        yield mariadb_server


def test_an_owed_flush_that_times_out_does_not_mark_its_shard_down(slow_own_shard, caplog):
    """After a missed clear(), the shard owes a flush. A row of it is locked (any slow
    DELETE would do: 1.2 M rows take longer than read_timeout too), so the clean-up
    times out: that is maintenance failing, not the shard. The call that found the work
    owed is served, the shard is neither counted as failing nor marked down, and the
    keys the flush still owes are misses, never old values."""
    caplog.set_level(logging.WARNING)
    cache = MySQLCache(TABLE, {"KEY_PREFIX": "mine", "OPTIONS": {
        "DATABASES": [HEALTHY, OWN], "IGNORE_EXCEPTIONS": True, "RETRY_TIMEOUT": 0.3,
        "FAILURE_THRESHOLD": 1, "CULL_PROBABILITY": 0}})
    if not cache.table_exists():
        cache.create_table()
    cache.clear()
    healthy, own = keys_by_shard(cache)
    cache.set_many(dict.fromkeys(own, "old"))
    slow_own_shard.stop()
    cache.clear()  # missed by the stopped shard: a flush is owed
    slow_own_shard.start()
    assert wait_for(lambda: ping(OWN))
    time.sleep(0.4)  # past RETRY_TIMEOUT: the next call probes the shard
    locker = MySQLdb.connect(**observer_params(slow_own_shard))
    try:
        locker.query(b"BEGIN")
        first = min(cache.make_key(key) for key in own)  # the first row any flush deletes
        locker.query(f"SELECT * FROM `{TABLE}` WHERE `cache_key` = '{first}' FOR UPDATE".encode())
        locker.store_result()
        probe, *others = [key for key in own if cache.make_key(key) != first]
        errors_before = cache.metrics()["shards"][OWN]["errors"]
        cache.set(probe, "new")
        assert cache.get(probe) == "new"
        assert cache.metrics()["shards"][OWN]["down"] is False
        assert cache.metrics()["shards"][OWN]["errors"] == errors_before
        assert cache.get_many(others) == {}  # owed: never the old values
        assert logged(caplog, f"Ignored MySQL maintenance failure on shard {OWN!r} of ",
                      ": Owed clean-up")
    finally:
        locker.query(b"ROLLBACK")
        locker.close()


def ping(alias: str) -> bool:
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except OperationalError:
        connections[alias].close()
        return False


def test_an_owed_flush_runs_in_bounded_steps_a_few_per_call(own_shard, monkeypatch):
    """Defect 4: the flush owed after a missed clear() is DELETE ... LIMIT batches, at
    most a budget of them per call (the rest by later calls or cull()); meanwhile the
    keys it owes are misses."""
    from django_kvcache.mysql import cluster

    monkeypatch.setattr(cluster, "OWED_BATCH_ROWS", 100, raising=False)
    cache = MySQLCache(TABLE, {"KEY_PREFIX": "mine", "OPTIONS": {
        "DATABASES": [HEALTHY, OWN], "IGNORE_EXCEPTIONS": True, "RETRY_TIMEOUT": 0.3,
        "CULL_PROBABILITY": 0}})
    make_cache(True)
    healthy, own = keys_by_shard(cache, 1200)
    cache.set_many(dict.fromkeys(own, "old"))
    assert len(own) > 300
    own_shard.stop()
    cache.clear()
    own_shard.start()
    assert wait_for(lambda: ping(OWN))
    with sent_statements(OWN) as first_call:
        assert cache.get_many(own[:50]) == {}
    deletes = [sql for sql in first_call if sql.startswith("DELETE")]
    flush_batches = [sql for sql in deletes if " LIKE " in sql]
    by_key = [sql for sql in deletes if " IN (" in sql]  # the call's own keys, 50
    assert len(flush_batches) == 1 and flush_batches[0].endswith(" LIMIT 100")  # one step
    assert len(by_key) == 1 and by_key[0].count(", ") == 49
    assert len(deletes) == 2
    assert cache.get_many(own) == {}
    assert cache.metrics()["shards"][OWN]["flush_pending"] is True
    cache.cull()  # finishes what is owed
    assert cache.metrics()["shards"][OWN]["flush_pending"] is False
    assert rows_on(OWN) == 0


def owing_cache(own_shard: Any, monkeypatch: Any) -> tuple[MySQLCache, list[str], list[str]]:
    """A cache whose own shard missed a set_many of its keys (so they are owed: deleted
    before they are read), in batches of 100 rows; back and serving."""
    monkeypatch.setattr(cluster_module, "OWED_BATCH_ROWS", 100, raising=False)
    cache = MySQLCache(TABLE, {"KEY_PREFIX": "owing", "OPTIONS": {
        "DATABASES": [HEALTHY, OWN], "RETRY_TIMEOUT": 0.3, "FAILURE_THRESHOLD": 1,
        "CULL_PROBABILITY": 0}})
    if not cache.table_exists():
        cache.create_table()
    cache.clear()
    healthy, own = keys_by_shard(cache, 1200)
    cache.set_many(dict.fromkeys(healthy + own, "old"))
    own_shard.stop()
    assert sorted(cache.set_many(dict.fromkeys(healthy + own, "new"))) == sorted(own)
    own_shard.start()
    assert wait_for(lambda: ping(OWN))
    time.sleep(0.4)  # past RETRY_TIMEOUT: the next call probes the shard
    assert cache.metrics()["shards"][OWN]["outdated_keys"] == len(own) > 300
    return cache, healthy, own


@pytest.mark.parametrize("operation", ["get_with_prefix", "keys_with_prefix",
                                       "delete_with_prefix"])
def test_a_prefix_call_takes_one_bounded_step_of_what_is_owed(own_shard, monkeypatch,
                                                                operation):
    """A prefix call cannot list its keys, so it ran everything the shard owed before
    its own statement (here 6 DELETEs of 100 rows; a flush of a large table, minutes).
    Now it takes one bounded step, as every call does, and what is still owed is never
    read: a miss, not the value the missed write should have replaced."""
    cache, healthy, own = owing_cache(own_shard, monkeypatch)
    with sent_statements(OWN) as sent:
        found = getattr(cache, operation)("key")
    deletes = [s for s in sent if s.startswith("DELETE") and " IN (" in s]
    assert len(deletes) == 1
    if operation == "get_with_prefix":
        assert found == dict.fromkeys(healthy, "new")  # none of the own shard's "old"
    elif operation == "keys_with_prefix":
        assert sorted(found) == sorted(healthy)
    else:
        assert cache.get_many(healthy + own) == {}
    assert cache.metrics()["shards"][OWN]["outdated_keys"] <= len(own) - 100


def test_a_prefix_call_whose_owed_step_fails_is_served_and_the_shard_stays_up(
    slow_own_shard, monkeypatch, caplog
):
    """The owed step of a prefix call that times out (a locked row) is maintenance that
    failed: logged, never held against the shard; the call is served."""
    caplog.set_level(logging.WARNING)
    cache, healthy, own = owing_cache(slow_own_shard, monkeypatch)
    locker = MySQLdb.connect(**observer_params(slow_own_shard))
    try:
        locker.query(b"BEGIN")
        first = min(cache.make_key(key) for key in own)  # in the first owed batch
        locker.query(f"SELECT * FROM `{TABLE}` WHERE `cache_key` = '{first}' FOR UPDATE".encode())
        locker.store_result()
        assert cache.get_with_prefix("key") == dict.fromkeys(healthy, "new")
        shard = cache.metrics()["shards"][OWN]
        assert shard["down"] is False and shard["consecutive_failures"] == 0
        assert logged(caplog, f"Ignored MySQL maintenance failure on shard {OWN!r} of ",
                      ": Owed clean-up")
    finally:
        locker.query(b"ROLLBACK")
        locker.close()


def test_cull_deletes_what_is_owed_within_its_own_budget(own_shard, monkeypatch):
    """cull(max_batches=N) runs at most N owed clean-up statements first (it ran them
    all); without a bound, as kvcache_cull runs it, it finishes them."""
    cache, healthy, own = owing_cache(own_shard, monkeypatch)
    with sent_statements(OWN) as sent:
        cache.cull(max_batches=1)
    assert len([s for s in sent if s.startswith("DELETE") and " IN (" in s]) == 1
    cache.cull()  # (and evicts down to MAX_ENTRIES)
    assert cache.metrics()["shards"][OWN]["outdated_keys"] == 0
    assert "old" not in cache.get_many(healthy + own).values()
