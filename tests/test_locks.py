"""``cache.lock()`` / ``cache.alock()`` with fencing tokens, on both backends, real servers.

:class:`LockContract` is what every backend's locks do (the redis-py API, tokens, expiry,
waiting, the async API, cancellation, fork); it runs on MySQLCache, on MemcachedCache
with the meta commands and with the classic ones. The slow guarantees (``once``: many
processes and threads, a stalled holder) and the server faults follow.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import MySQLdb
import pytest
from django.conf import settings
from django.db import OperationalError, connections, transaction

from django_kvcache import steps
from django_kvcache.locks import (
    AsyncLock,
    Lock,
    LockError,
    LockNotOwned,
    LockNotOwnedError,
    afenced_update,
    fenced_update,
)
from django_kvcache.memcached import NodeError
from tests.concurrency import FORK, WORKER_TIMEOUT, run_processes
from tests.contract import CacheFixture
from tests.models import FencedRecord
from tests.mysql_support import BACKEND as MYSQL_BACKEND, ensure_table, register_alias, \
    sent_statements, unregister_alias
from tests.servers import MemcachedNode

MEMCACHED_BACKEND = "django_kvcache.backends.memcached.MemcachedCache"
#: Seconds a short lease lives. memcached keeps it ceil(timeout) + 1 seconds at most.
SHORT = 1.0


def holder_token(lock: Lock | AsyncLock) -> Any:
    return steps.run(lock.store.holder_token())


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (the signal is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


class LockContract(CacheFixture):
    #: Seconds past a lease's timeout before the backend has surely ended it.
    expiry_margin = 0.2

    def past_expiry(self, timeout: float = SHORT) -> None:
        time.sleep(timeout + self.expiry_margin)

    # --- the redis-py API ------------------------------------------------------------------

    def test_acquire_release_and_the_token(self, cache):
        lock = cache.lock("job", timeout=10)
        assert lock.token is None and not lock.locked()
        assert lock.acquire() is True
        assert isinstance(lock.token, int) and lock.token > 0
        assert lock.locked() and lock.owned()
        lock.release()
        assert lock.token is None
        assert not lock.locked() and not lock.owned()

    def test_every_grant_has_a_larger_token(self, cache):
        tokens = []
        for _ in range(5):
            with cache.lock("job", timeout=10) as lock:
                tokens.append(lock.token)
        assert tokens == sorted(set(tokens))

    def test_a_held_lock_is_not_granted_again(self, cache):
        first = cache.lock("job", timeout=10)
        assert first.acquire()
        other = cache.lock("job", timeout=10)
        assert other.acquire(blocking=False) is False
        assert other.token is None and not other.owned()
        assert first.owned() and other.locked()
        released = first.token
        first.release()
        assert other.acquire(blocking=False) and other.token > released
        other.release()

    def test_names_are_keys_of_the_cache(self, cache):
        """KEY_PREFIX and version make names distinct, as for any key."""
        with cache.lock("job", timeout=10):
            assert cache.lock("job", version=2, timeout=10).acquire(blocking=False)
            prefixed = self.build(KEY_PREFIX="other")
            assert prefixed.lock("job", timeout=10).acquire(blocking=False)
            assert not cache.lock("job", version=1, timeout=10).acquire(blocking=False)

    def test_blocking_timeout_bounds_the_wait(self, cache):
        holder = cache.lock("job", timeout=10)
        holder.acquire()
        waiter = cache.lock("job", timeout=10, sleep=0.05)
        started = time.monotonic()
        assert waiter.acquire(blocking_timeout=0.3) is False
        waited = time.monotonic() - started
        assert 0.3 <= waited < 2.0
        with pytest.raises(LockError, match="Unable to acquire"):
            with cache.lock("job", timeout=10, blocking_timeout=0.1):
                pass
        holder.release()

    def test_a_waiter_gets_the_lock_once_it_is_released(self, cache):
        holder = cache.lock("job", timeout=10, thread_local=False)  # released by a timer
        holder.acquire()
        threading.Timer(0.2, in_thread, (holder.release,)).start()
        waiter = cache.lock("job", timeout=10, sleep=0.02)
        started = time.monotonic()
        assert waiter.acquire(blocking_timeout=5)
        assert 0.15 < time.monotonic() - started < 2.0
        waiter.release()

    def test_an_expired_lock_is_granted_to_the_next(self, cache):
        stalled = cache.lock("job", timeout=SHORT)
        stalled.acquire()
        self.past_expiry()
        assert not stalled.locked()
        successor = cache.lock("job", timeout=10)
        assert successor.acquire(blocking=False)
        assert successor.token > stalled.token
        assert not stalled.owned()
        # The stalled holder learns it on release, which leaves the successor's grant.
        with pytest.raises(LockNotOwned, match="no longer owned"):
            stalled.release()
        assert successor.owned() and successor.locked()
        assert LockNotOwnedError is LockNotOwned  # redis-py's name for it
        successor.release()

    def test_an_expired_holder_cannot_extend(self, cache):
        stalled = cache.lock("job", timeout=SHORT)
        stalled.acquire()
        self.past_expiry()
        with pytest.raises(LockNotOwned):
            stalled.extend(10)
        with pytest.raises(LockNotOwned):
            stalled.reacquire()

    def test_release_of_an_unheld_lock_is_an_error(self, cache):
        lock = cache.lock("job", timeout=10)
        with pytest.raises(LockError, match="unlocked"):
            lock.release()
        with pytest.raises(LockError, match="unlocked"):
            lock.extend(1)

    def test_extend_and_reacquire_keep_the_grant_alive(self, cache):
        lock = cache.lock("job", timeout=SHORT)
        lock.acquire()
        token = lock.token
        assert lock.extend(10) is True
        self.past_expiry()
        assert lock.owned() and lock.token == token  # same grant, same token
        assert lock.extend(SHORT, replace_ttl=True)
        assert lock.reacquire() is True
        assert lock.owned()
        self.past_expiry()
        assert not lock.locked()  # replaced, not added to: it ended

    def test_a_lock_without_timeout_cannot_be_extended_and_lasts(self, cache):
        lock = cache.lock("forever")
        lock.acquire()
        with pytest.raises(LockError, match="no timeout"):
            lock.extend(1)
        assert cache.lock("forever").acquire(blocking=False) is False
        lock.release()

    def test_bad_arguments_are_refused(self, cache):
        for kwargs in ({"timeout": 0}, {"timeout": -1}, {"timeout": "10"}, {"sleep": -1},
                       {"blocking_timeout": -1}, {"timeout": 0.05, "sleep": 0.1}):
            with pytest.raises(LockError):
                cache.lock("job", **kwargs)

    def test_the_grant_belongs_to_its_thread(self, cache):
        lock = cache.lock("job", timeout=10)
        lock.acquire()
        seen: list[Any] = []

        def other_thread() -> None:
            seen.append(lock.owned())
            try:
                lock.release()
            except LockError as exc:
                seen.append(exc)

        in_thread(other_thread)
        assert seen[0] is False and "unlocked" in str(seen[1])
        assert lock.owned()
        lock.release()
        shared = cache.lock("job", timeout=10, thread_local=False)
        shared.acquire()
        in_thread(shared.release)
        assert not shared.locked()

    def test_a_forked_child_does_not_own_its_parents_grant(self, cache):
        lock = cache.lock("job", timeout=10)
        lock.acquire()

        def child(index: int) -> Any:
            own = self.build()
            outcome = [lock.token, lock.owned()]
            try:
                lock.release()
            except LockError as exc:
                outcome.append(str(exc))
            theirs = own.lock("job", timeout=10)
            outcome.append(theirs.acquire(blocking=False))
            return outcome

        assert run_processes(1, child) == [[None, False, "Cannot release an unlocked lock",
                                            False]]
        assert lock.owned()  # the child released nothing
        lock.release()

    def test_what_lives_in_the_cache_does_not_touch_locks(self, cache):
        lock = cache.lock("job", timeout=10)
        lock.acquire()
        cache.set("job", "a value")
        cache.delete("job")
        cache.delete_many(["job"])
        assert lock.owned()
        lock.release()

    # --- the fence ----------------------------------------------------------------------

    @pytest.mark.django_db(transaction=True)
    def test_the_fence_refuses_a_write_with_an_older_token(self, cache):
        record = FencedRecord.objects.create(name="feed")
        first = cache.lock("feed", timeout=SHORT)
        first.acquire()
        records = FencedRecord.objects.filter(pk=record.pk)
        assert fenced_update(records, first.token, value=1) == 1
        assert fenced_update(records, first.token, value=2) == 1  # the same grant again
        self.past_expiry()
        second = cache.lock("feed", timeout=10)
        second.acquire()
        assert fenced_update(records, second.token, value=3) == 1
        assert fenced_update(records, first.token, value=99) == 0  # refused
        record.refresh_from_db()
        assert (record.value, record.fencing_token) == (3, second.token)
        assert asyncio.run(afenced_update(records, first.token, value=99)) == 0
        with pytest.raises(TypeError):
            fenced_update(records, str(second.token), value=4)
        second.release()

    # --- the async API ------------------------------------------------------------------

    def test_async_acquire_release_and_context(self, cache):
        async def main() -> list[Any]:
            lock = cache.alock("job", timeout=10)
            assert await lock.acquire()
            token = lock.token
            other = cache.alock("job", timeout=10)
            busy = await other.acquire(blocking=False)
            assert await lock.locked() and await lock.owned()
            assert await lock.extend(5) and await lock.reacquire()
            await lock.release()
            async with cache.alock("job", timeout=10) as again:
                later = again.token
            with pytest.raises(LockError, match="Unable to acquire"):
                async with cache.alock("forever-held", timeout=10):
                    async with cache.alock("forever-held", timeout=10, blocking=False):
                        pass
            return [busy, later > token, await cache.alock("job").locked()]

        assert asyncio.run(main()) == [False, True, False]

    def test_a_cancelled_waiter_holds_nothing(self, cache):
        holder = cache.lock("job", timeout=10)
        holder.acquire()

        async def main() -> None:
            waiter = cache.alock("job", timeout=10, sleep=0.02)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(waiter.acquire(), 0.2)
            assert waiter.token is None
            task = asyncio.ensure_future(cache.alock("job", timeout=10).acquire())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        assert holder.owned()
        holder.release()
        assert not cache.lock("job").locked()  # no waiter took it on its way out

    def test_a_cancelled_holder_releases_its_own_grant_only(self, cache):
        async def main() -> tuple[bool, bool]:
            entered = asyncio.Event()

            async def hold() -> None:
                async with cache.alock("job", timeout=10):
                    entered.set()
                    await asyncio.sleep(30)

            task = asyncio.ensure_future(hold())
            await entered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            freed = not await cache.alock("job").locked()
            # An expired holder cancelled in its block leaves the successor's grant.
            stalled_entered = asyncio.Event()
            successor = cache.alock("job", timeout=10)

            async def stall() -> None:
                async with cache.alock("job", timeout=SHORT):
                    stalled_entered.set()
                    await asyncio.sleep(30)

            stalled = asyncio.ensure_future(stall())
            await stalled_entered.wait()
            await asyncio.sleep(SHORT + self.expiry_margin)
            assert await successor.acquire(blocking=False)
            stalled.cancel()
            with pytest.raises(LockNotOwned):  # its release found the grant gone
                await stalled
            return freed, await successor.owned()

        assert asyncio.run(main()) == (True, True)

    def test_coroutines_wait_without_blocking_the_loop(self, cache):
        async def main() -> int:
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            holder = cache.alock("job", timeout=10)
            await holder.acquire()
            ticking = asyncio.ensure_future(ticker())
            waiter = cache.alock("job", timeout=10, sleep=0.05)
            assert not await waiter.acquire(blocking_timeout=0.5)
            ticking.cancel()
            await holder.release()
            return ticks

        assert asyncio.run(main()) >= 20  # the loop ran all along


def in_thread(work: Callable[[], Any]) -> None:
    """``work()`` in a thread of its own (which closes its database connections)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not errors, errors


# --- MySQLCache ---------------------------------------------------------------------------------


MYSQL_TABLE = "kvcache_locks_test"


@pytest.mark.django_db(transaction=True)
class TestMySQLLocks(LockContract):
    def backend_params(self) -> dict[str, Any]:
        return {"BACKEND": MYSQL_BACKEND, "LOCATION": MYSQL_TABLE,
                "OPTIONS": {"CULL_PROBABILITY": 0}}

    def prepare(self, cache) -> None:
        ensure_table(cache)

    @pytest.fixture
    def cache(self):
        cache = self.build()
        with connections["default"].cursor() as cursor:
            cursor.execute(f"DELETE FROM `{cache.lock_table}`")
        yield cache
        cache.clear()

    def lock_rows(self, cache) -> dict[str, tuple[int, int]]:
        with connections["default"].cursor() as cursor:
            cursor.execute(f"SELECT `name`, `token`, `expires` FROM `{cache.lock_table}`")
            return {name: (token, expires) for name, token, expires in cursor.fetchall()}

    def test_a_grant_is_one_statement(self, cache):
        lock = cache.lock("job", timeout=10)
        lock.locked()  # (the server's flavour is known from here on)
        with sent_statements() as sent:
            lock.acquire()
        assert len(sent) == 1 and sent[0].startswith("INSERT INTO `kvcache_locks_test_locks`")
        with sent_statements() as sent:
            lock.release()
        assert len(sent) == 1 and sent[0].startswith("UPDATE")

    def test_released_rows_stay_and_culling_clear_and_prefixes_leave_them(self, cache):
        with cache.lock("job", timeout=10):
            cache.set("job", 1)
            cache.clear()
            assert cache.delete_with_prefix("") == 0
            cache.cull()
            assert cache.lock("job").locked()
        rows = self.lock_rows(cache)
        assert len(rows) == 1 and list(rows.values())[0][1] == 0  # released: kept, expired

    def test_the_token_still_grows_after_the_row_is_lost(self, cache):
        """A restored backup, a replica promoted before it caught up, the table dropped:
        a grant made after its row is gone still gets a larger token (the clock)."""
        with cache.lock("job", timeout=10) as lock:
            before = lock.token
        with connections["default"].cursor() as cursor:
            cursor.execute(f"DELETE FROM `{cache.lock_table}`")
        with cache.lock("job", timeout=10) as lock:
            assert lock.token > before

    def test_expiry_follows_the_server_clock_in_microseconds(self, cache):
        lock = cache.lock("job", timeout=0.3, sleep=0.01)
        lock.acquire()
        (token, expires), = self.lock_rows(cache).values()
        assert expires - token == 300_000  # a new row: the token is the clock at the grant
        waiter = cache.lock("job", timeout=10, sleep=0.01)
        started = time.monotonic()
        assert waiter.acquire(blocking_timeout=5)
        assert 0.15 < time.monotonic() - started < 1.0
        waiter.release()

    @pytest.mark.django_db(transaction=True, databases=["default", *settings.SHARD_ALIASES])
    def test_a_name_lives_on_the_shard_its_key_routes_to(self, cache):
        sharded = self.build(OPTIONS={"DATABASES": settings.SHARD_ALIASES,
                                      "CULL_PROBABILITY": 0})
        names = [f"job{i}" for i in range(12)]
        locks = [sharded.lock(name, timeout=10) for name in names]
        assert all(lock.acquire(blocking=False) for lock in locks)
        where = {sharded.cluster.shard_for(sharded.make_and_validate_key(n)).primary()
                 for n in names}
        assert len(where) > 1
        for alias in settings.SHARD_ALIASES:
            with connections[alias].cursor() as cursor:
                cursor.execute(f"SELECT `name` FROM `{sharded.lock_table}` WHERE `expires` > 0")
                found = {row[0] for row in cursor.fetchall()}
            assert found == {sharded.make_and_validate_key(n) for n in names
                             if sharded.cluster.shard_for(
                                 sharded.make_and_validate_key(n)).primary() == alias}
        for lock in locks:
            lock.release()

    def test_a_lock_taken_inside_a_transaction_commits_on_its_own(self, cache):
        """The cache's statements run on its own connections: a grant made inside the
        caller's atomic() is seen by everyone at once and outlives a rollback."""
        lock = cache.lock("job", timeout=10)
        with pytest.raises(RuntimeError):
            with transaction.atomic():
                assert lock.acquire()
                assert self.lock_rows(cache)  # committed: another connection sees it
                raise RuntimeError("rolled back")
        assert lock.owned() and not cache.lock("job").acquire(blocking=False)
        lock.release()

    def test_a_missing_lock_table_is_named(self, cache):
        from django_kvcache.mysql.errors import CacheTableMissing

        other = self.build(LOCATION="kvcache_locks_missing")
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute(f"DROP TABLE `{other.lock_table}`")
            with pytest.raises(CacheTableMissing, match="kvcache_locks_missing_locks"):
                other.lock("job", timeout=10).acquire()
            assert other.missing_tables("default") == ["kvcache_locks_missing_locks"]
        finally:
            with connections["default"].cursor() as cursor:
                cursor.execute("DROP TABLE IF EXISTS `kvcache_locks_missing`, "
                               "`kvcache_locks_missing_locks`")

    def test_a_cancelled_grant_in_flight_is_released(self, cache):
        """The grant statement waits on a row lock (another connection holds the row),
        and the coroutine is cancelled meanwhile: the statement still goes through once
        the row is free, and the cancelled acquire's clean-up releases what it granted."""
        with cache.lock("job", timeout=0.1) as lock:  # a row, expired at once
            before = lock.token
        settings = connections["default"].get_connection_params()
        blocker = MySQLdb.connect(**settings)
        blocker.autocommit(False)
        blocker.cursor().execute(f"SELECT 1 FROM `{cache.lock_table}` FOR UPDATE")

        async def main() -> None:
            task = asyncio.ensure_future(cache.alock("job", timeout=60).acquire())
            await asyncio.sleep(0.3)  # its statement now waits for the row
            task.cancel()
            asyncio.get_running_loop().call_later(0.3, blocker.commit)
            with pytest.raises(asyncio.CancelledError):
                await task

        try:
            asyncio.run(main())
        finally:
            blocker.close()
        (token, expires), = self.lock_rows(cache).values()
        assert token > before  # it was granted...
        assert not cache.lock("job").locked()  # ...and released by its owner


# --- MemcachedCache -----------------------------------------------------------------------------


@pytest.mark.once  # memcached's whole-second expiry makes these slow: one Django version
class MemcachedLocks(LockContract):
    expiry_margin = 2.1  # memcached's whole seconds: a lease lives up to ceil(t) + 1

    @pytest.fixture(autouse=True)
    def _nodes(self, private_memcached_nodes):
        self.locations = private_memcached_nodes

    def backend_params(self) -> dict[str, Any]:
        return {"BACKEND": MEMCACHED_BACKEND, "LOCATION": self.locations}

    @pytest.fixture
    def cache(self):
        cache = self.build()
        cache.clear()
        yield cache
        cache.clear()

    def test_clear_releases_every_lock_and_tokens_still_grow(self, cache):
        lock = cache.lock("job", timeout=10)
        lock.acquire()
        cache.clear()  # flush_all: memcached cannot spare the locks
        assert not lock.locked()
        successor = cache.lock("job", timeout=10)
        assert successor.acquire(blocking=False)
        assert successor.token > lock.token  # the counter started again from the clock
        with pytest.raises(LockNotOwned):
            lock.release()
        successor.release()

    def test_failover_never_moves_a_lock_and_ignore_exceptions_never_hides_a_failure(
        self, memcached_node_factory
    ):
        dead = memcached_node_factory()
        alive = memcached_node_factory()
        cache = self.build(LOCATION=[dead.address, alive.address],
                           OPTIONS={"FAILOVER": True, "IGNORE_EXCEPTIONS": True,
                                    "RETRY_TIMEOUT": 60, "CONNECT_TIMEOUT": 0.5})
        name = next(n for n in (f"job{i}" for i in range(100))
                    if cache._lock_store(n, None, False).home.name == dead.address)
        dead.kill()
        lock = cache.lock(name, timeout=10)
        with pytest.raises(NodeError):
            lock.acquire()  # blocking: raised, whatever IGNORE_EXCEPTIONS says
        assert lock.acquire(blocking=False) is False  # non-blocking: not acquired
        with pytest.raises(NodeError):
            lock.locked()
        cache.set(name, "served by the failover node")  # plain keys do fail over
        assert cache.get(name) == "served by the failover node"


class TestMemcachedMetaLocks(MemcachedLocks):
    def test_a_grant_is_one_request(self, cache):
        lock = cache.lock("job", timeout=10)
        node = lock.store.home
        assert not lock.locked()  # (asks whether the node speaks meta, once)
        ops = node.ops
        lock.acquire()
        assert node.ops - ops == 1  # ma + ms in one request (the meta probe came before)
        lock.release()
        assert node.ops - ops == 3  # mg (is the lease still ours?), then md with its CAS

    def test_a_server_without_cas_is_refused(self):
        node = MemcachedNode(extra_args=("-C",))
        node.start()
        try:
            cache = self.build(LOCATION=[node.address])
            with pytest.raises(LockError, match="without CAS"):
                cache.lock("job", timeout=10).acquire()
        finally:
            node.kill()


class TestMemcachedClassicLocks(MemcachedLocks):
    """The classic protocol (a server or proxy without meta commands): incr + add, gets
    and cas."""

    @pytest.fixture(autouse=True)
    def _classic(self, _nodes):
        nodes = self.build().cluster.nodes
        for node in nodes:
            node.meta = False
        yield
        for node in nodes:
            node.meta = None


@pytest.mark.once
@pytest.mark.skipif(not settings.TWEMPROXY, reason="no twemproxy (KVCACHE_TWEMPROXY)")
class TestTwemproxyLocks(LockContract):
    """Through twemproxy, as large sites run memcached: no meta commands (found once),
    so the classic ones — and the proxy routes the lease and the counter of a name as
    it routes any key."""

    expiry_margin = 2.1

    def backend_params(self) -> dict[str, Any]:
        return {"BACKEND": MEMCACHED_BACKEND, "LOCATION": settings.TWEMPROXY}

    @pytest.fixture
    def cache(self):
        from tests.test_memcached_proxy import empty

        empty(settings.TWEMPROXY_SERVERS)  # the proxy forwards no flush_all
        cache = self.build()
        yield cache
        assert cache.cluster.nodes[0].meta is False  # found out, and remembered
        empty(settings.TWEMPROXY_SERVERS)


# --- the slow guarantees, on every backend ------------------------------------------------------

#: Grants each thread asks for in the exclusion test (4 processes x 8 threads).
ROUNDS = 4


def holding(lock: Lock, counter: Path) -> tuple[int, int, int]:
    """Inside ``lock``: the counter file read, a pause, the counter written back plus one
    (a lost update if anyone else ran meanwhile); the interval and the token."""
    with lock:
        started = time.monotonic_ns()
        value = int(counter.read_text())
        time.sleep(0.001)
        counter.write_text(str(value + 1))
        ended = time.monotonic_ns()
        return started, ended, lock.token


def check_exclusive(intervals: list[tuple[int, int, int]]) -> None:
    """No two holders overlap, and each holder's token is larger than its predecessor's."""
    ordered = sorted(intervals)
    for before, after in zip(ordered, ordered[1:]):
        assert before[1] <= after[0], f"two holders at once: {before} and {after}"
        assert before[2] < after[2], f"a later grant with a smaller token: {before}, {after}"


#: Coroutines that take turns on one lock, each with a connection of its own.
COROUTINES = 64


class ExclusionContract(CacheFixture):
    @pytest.fixture
    def counter(self, tmp_path: Path) -> Path:
        counter = tmp_path / "counter"
        counter.write_text("0")
        return counter

    def test_processes_and_threads_take_turns(self, cache, counter):
        def work(index: int) -> list[tuple[int, int, int]]:
            own = self.build()
            intervals: list[tuple[int, int, int]] = []
            failures: list[BaseException] = []

            def thread() -> None:
                try:
                    for _ in range(ROUNDS):
                        intervals.append(holding(own.lock("counter", timeout=30, sleep=0.01),
                                                 counter))
                except BaseException as exc:
                    failures.append(exc)
                finally:
                    connections.close_all()

            threads = [threading.Thread(target=thread) for _ in range(8)]
            for each in threads:
                each.start()
            for each in threads:
                each.join(WORKER_TIMEOUT)
            assert not failures, failures
            return intervals

        intervals = [i for per_process in run_processes(4, work) for i in per_process]
        assert int(counter.read_text()) == len(intervals) == 4 * 8 * ROUNDS
        check_exclusive(intervals)

    def test_coroutines_take_turns(self, cache, counter):
        # A connection per coroutine: each holds at most one at a time, so none waits for
        # the pool (with four coroutines a connection, a loaded machine kept some waiting
        # past POOL_TIMEOUT: PoolExhausted).
        options = {**self.backend_params().get("OPTIONS", {}), "MAX_POOL_SIZE": COROUTINES}
        cache = self.build(OPTIONS=options)

        async def coroutine() -> tuple[int, int, int]:
            async with cache.alock("counter", timeout=30, sleep=0.01) as lock:
                started = time.monotonic_ns()
                value = int(counter.read_text())
                await asyncio.sleep(0)  # every other coroutine may run here
                counter.write_text(str(value + 1))
                return started, time.monotonic_ns(), lock.token

        async def main() -> list[tuple[int, int, int]]:
            return await asyncio.gather(*(coroutine() for _ in range(COROUTINES)))

        intervals = asyncio.run(main())
        assert int(counter.read_text()) == COROUTINES
        check_exclusive(intervals)

    @pytest.mark.django_db(transaction=True)
    def test_a_stalled_holder_is_fenced_off_and_releases_nothing(self, cache):
        """A holder SIGSTOPped past its timeout; a second one takes the lock and writes;
        the first resumes: its fenced write is refused, its release raises and leaves
        the second's grant."""
        record = FencedRecord.objects.create(name="feed")
        to_child, from_parent = FORK.Pipe()

        def stalled(index: int) -> Any:
            own = self.build()
            lock = own.lock("feed", timeout=SHORT)
            assert lock.acquire()
            records = FencedRecord.objects.filter(pk=record.pk)
            assert fenced_update(records, lock.token, value=1) == 1
            from_parent.send(lock.token)
            assert from_parent.poll(WORKER_TIMEOUT)  # stopped here for a while
            from_parent.recv()
            token = lock.token
            late_write = fenced_update(records, token, value=666)
            try:
                lock.release()
                released = "released"
            except LockNotOwned as exc:
                released = str(exc)
            return token, late_write, released

        results: list[Any] = []
        child = threading.Thread(target=lambda: results.extend(run_processes(1, stalled)))
        child.start()
        assert to_child.poll(WORKER_TIMEOUT)
        stalled_token = to_child.recv()
        pid = next(p.pid for p in FORK.active_children())
        stop_process(pid)
        try:
            time.sleep(SHORT + self.expiry_margin)
            successor = cache.lock("feed", timeout=30)
            assert successor.acquire(blocking=False)
            assert successor.token > stalled_token
            assert fenced_update(FencedRecord.objects.filter(pk=record.pk), successor.token,
                                 value=2) == 1
        finally:
            os.kill(pid, signal.SIGCONT)
        to_child.send("go on")
        child.join(WORKER_TIMEOUT)
        assert results == [(stalled_token, 0, "Cannot release a lock that's no longer owned")]
        record.refresh_from_db()
        assert (record.value, record.fencing_token) == (2, successor.token)
        assert successor.owned()
        successor.release()


@pytest.mark.once
@pytest.mark.django_db(transaction=True)
class TestMySQLExclusion(ExclusionContract):
    expiry_margin = 0.2

    def backend_params(self) -> dict[str, Any]:
        return {"BACKEND": MYSQL_BACKEND, "LOCATION": MYSQL_TABLE,
                "OPTIONS": {"CULL_PROBABILITY": 0}}

    def prepare(self, cache) -> None:
        ensure_table(cache)


@pytest.mark.once
class TestMemcachedExclusion(ExclusionContract):
    expiry_margin = 2.1

    @pytest.fixture(autouse=True)
    def _nodes(self, private_memcached_nodes):
        self.locations = private_memcached_nodes

    def backend_params(self) -> dict[str, Any]:
        return {"BACKEND": MEMCACHED_BACKEND, "LOCATION": self.locations}


# --- server faults ------------------------------------------------------------------------------


@pytest.mark.once
@pytest.mark.django_db(transaction=True)
def test_memcached_node_restarted_mid_hold(memcached_node_factory):
    """The node holding a lease and its token counter restarts (both lost): the holder
    learns it on release; the next grant's token is still larger (the counter starts
    again from the clock), so the fence refuses the old holder's writes."""
    node = memcached_node_factory()
    from django_kvcache.backends.memcached import MemcachedCache

    cache = MemcachedCache([node.address], {"OPTIONS": {"RETRY_TIMEOUT": 0.2,
                                                        "CONNECT_TIMEOUT": 0.5}})
    record = FencedRecord.objects.create(name="feed")
    records = FencedRecord.objects.filter(pk=record.pk)
    holder = cache.lock("feed", timeout=30)
    assert holder.acquire()
    assert fenced_update(records, holder.token, value=1) == 1
    node.kill()
    other = cache.lock("feed", timeout=30)
    assert other.acquire(blocking=False) is False  # down: not acquired (logged)
    with pytest.raises(NodeError):
        other.acquire()  # blocking: raised
    node.start()
    time.sleep(0.3)  # past RETRY_TIMEOUT
    assert not holder.owned()  # the lease died with the node
    assert other.acquire(blocking_timeout=5)
    assert other.token > holder.token
    assert fenced_update(records, other.token, value=2) == 1
    assert fenced_update(records, holder.token, value=666) == 0
    with pytest.raises(LockNotOwned):
        holder.release()
    assert other.owned()
    other.release()


KILLED_ALIAS = "kvcache_locks_killed"


@pytest.mark.once
def test_mariadb_killed_mid_hold(mariadb_server, django_db_blocker):
    """MariaDB is killed (SIGKILL) while a lock is held: calls fail (a non-blocking
    acquire answers False), IGNORE_EXCEPTIONS or not; the committed grant survives the
    restart, its holder still owns it and releases it, and tokens go on growing."""
    register_alias(KILLED_ALIAS, {**mariadb_server.connection_settings(),
                                  "OPTIONS": {"charset": "utf8mb4", "connect_timeout": 2}})
    try:
        with django_db_blocker.unblock():
            cache = TestMySQLLocks().build(OPTIONS={"DATABASE": KILLED_ALIAS,
                                                    "IGNORE_EXCEPTIONS": True,
                                                    "RETRY_TIMEOUT": 0.2,
                                                    "CULL_PROBABILITY": 0})
            holder = cache.lock("feed", timeout=60)
            assert holder.acquire()
            os.kill(mariadb_server.process.pid, signal.SIGKILL)
            mariadb_server.process.wait(30)
            mariadb_server.process = None
            other = cache.lock("feed", timeout=60)
            assert other.acquire(blocking=False) is False
            time.sleep(0.3)  # past RETRY_TIMEOUT: tried again, and failing
            with pytest.raises(OperationalError):
                other.acquire()
            with pytest.raises(OperationalError):
                holder.locked()
            mariadb_server.start()
            time.sleep(0.3)
            assert holder.owned()  # the grant was committed: it survived the crash
            assert other.acquire(blocking=False) is False
            holder_token = holder.token
            holder.release()
            assert other.acquire(blocking=False)
            assert other.token > holder_token
            other.release()
    finally:
        unregister_alias(KILLED_ALIAS)


# --- the rules alone (django_kvcache.locks), with a scripted store ------------------------------


class ScriptedStore:
    """A lock store in memory that records what the rules asked of it: for the waiting
    and interruption rules, which no server makes reproducible."""

    where = "scripted store"

    def __init__(self, busy_for: float = 0.0, interrupt: BaseException | None = None) -> None:
        self.free_at = time.monotonic() + busy_for
        self.holder: bytes | None = None
        self.grants = 0
        self.tries: list[float] = []
        self.released: list[bytes] = []
        self.interrupt = interrupt

    def unreachable(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)

    def grant(self, grant, seconds):
        self.tries.append(time.monotonic())
        if self.interrupt is not None:  # the request went out, then the caller was stopped
            self.holder, interrupt, self.interrupt = grant.owner, self.interrupt, None
            raise interrupt
        yield steps.Sleep(0)
        if time.monotonic() < self.free_at or self.holder is not None:
            return False
        self.grants += 1
        self.holder, grant.token = grant.owner, self.grants
        return True

    def release(self, grant):
        yield steps.Sleep(0)
        self.released.append(grant.owner)
        if self.holder != grant.owner:
            return False
        self.holder = None
        return True

    def extend(self, grant, seconds, replace):
        yield steps.Sleep(0)
        return self.holder == grant.owner

    def peek(self):
        yield steps.Sleep(0)
        return self.holder


def test_a_waiting_acquire_pauses_and_never_spins():
    store = ScriptedStore(busy_for=0.6)
    lock = Lock(store, "job", timeout=10, sleep=0.1)
    assert lock.acquire(blocking_timeout=5)
    pauses = [b - a for a, b in zip(store.tries, store.tries[1:])]
    # 2, 4, 8... ms, then every 50-100 ms (a busy loop would try thousands of times);
    # the bounds leave room for a loaded machine's late wake-ups.
    assert len(store.tries) <= 25
    assert pauses[0] < 0.05 and max(pauses) < 0.1 + 0.1


def test_blocking_timeout_makes_one_last_try_when_it_runs_out():
    store = ScriptedStore(busy_for=60)
    lock = Lock(store, "job", timeout=10, sleep=0.05)
    started = time.monotonic()
    assert not lock.acquire(blocking_timeout=0.3)
    assert 0.3 <= store.tries[-1] - started < 0.3 + 0.2  # at the deadline, not a pause later


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), asyncio.CancelledError()])
def test_an_interrupted_grant_is_released_by_its_owner(interrupt):
    store = ScriptedStore(interrupt=interrupt)
    lock = Lock(store, "job", timeout=10)
    with pytest.raises(type(interrupt)):
        lock.acquire()
    assert store.holder is None and len(store.released) == 1  # the grant it may have made
    assert lock.token is None


def test_an_unreachable_store_answers_a_non_blocking_acquire_and_raises_otherwise(caplog):
    class Down(ScriptedStore):
        def grant(self, grant, seconds):
            raise ConnectionError("refused")
            yield  # pragma: no cover

    lock = Lock(Down(), "job", timeout=10)
    assert lock.acquire(blocking=False) is False
    assert "lock 'job' not acquired: the server could not be reached" in caplog.text
    with pytest.raises(ConnectionError):
        lock.acquire()


def test_an_unreachable_lock_server_is_logged_naming_the_cache(caplog):
    """A non-blocking acquire on a memcached node nobody listens on: the log line names
    the node and the cache alias (it named the node alone)."""
    from django.core.cache import caches
    from django.test import override_settings

    from tests.servers import free_port

    closed = f"127.0.0.1:{free_port()}"
    configured = {"locks": {"BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
                            "LOCATION": [closed]}}
    with override_settings(CACHES=configured), caplog.at_level(logging.WARNING):
        assert caches["locks"].lock("job", timeout=10).acquire(blocking=False) is False
    assert (f"Ignored lock failure on memcached node {closed} of CACHES['locks']: lock 'job' "
            "not acquired") in caplog.text


def test_an_async_holder_and_waiter_share_the_rules():
    store = ScriptedStore()

    async def main() -> list[Any]:
        holder = AsyncLock(store, "job", timeout=10)
        waiter = AsyncLock(store, "job", timeout=10, sleep=0.01)
        assert await holder.acquire()
        waiting = asyncio.ensure_future(waiter.acquire(blocking_timeout=5))
        await asyncio.sleep(0.05)
        await holder.release()
        return [await waiting, waiter.token, holder.token]

    assert asyncio.run(main()) == [True, 2, None]


def test_a_memcached_lock_extended_in_its_last_second_keeps_its_expiry_exact(
        private_memcached_nodes):
    """``extend`` adds to what is left: a lease in its last second (memcached's ``t`` of
    1) extended by one second is sent for two, not three (the second ``wire.exptime``
    adds is taken off what memcached reports, and not given back twice)."""
    from django_kvcache.backends.memcached import MemcachedCache
    from django_kvcache.memcached import wire

    cache = MemcachedCache(private_memcached_nodes[:1], {})
    lock = cache.lock("last-second", timeout=1)
    assert lock.acquire()
    node = cache.cluster.nodes[0]
    lease_key = lock.store.lease_key
    deadline = time.monotonic() + 5
    while node.call(wire.meta_ttl(lease_key)) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert lock.extend(1)
    assert node.call(wire.meta_ttl(lease_key)) == 2
