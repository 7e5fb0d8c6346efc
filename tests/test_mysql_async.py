"""MySQLCache's native async API: the same plans on the event loop's own connections.

The contract suite (tests/contract.py, test_mysql_contract) runs every contract test on
the async API too — one database, shards, a replica. This module covers what only the
async driver has: no thread hop, per-loop pools of its own connections built from the
DATABASES entry, never Django's connection or a caller's transaction, read_timeout on
the loop, cancellation, restarts and the shared failure policy.
"""
from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator

import asgiref.sync
import MySQLdb
import pytest
from django.conf import settings
from django.db import OperationalError, connections, transaction

import django_kvcache.base
from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.mysql import errors, pools
from tests.mysql_support import make_cache, registered_alias
from tests.test_memcached_async import run_on_a_fresh_loop

TABLE = "kvcache_async"
SHARDS = list(settings.SHARD_ALIASES)
REPLICA = "shard2_replica"

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", *SHARDS, REPLICA])

#: Every async method of MySQLCache, as a call on a cache and two keys.
NATIVE: dict[str, Callable[[MySQLCache, str, str], Awaitable[Any]]] = {
    "aget": lambda c, k, other: c.aget(k),
    "aset": lambda c, k, other: c.aset(k, "x" * 200_000),  # more than a socket buffer
    "aadd": lambda c, k, other: c.aadd(k, 1),
    "atouch": lambda c, k, other: c.atouch(k),
    "adelete": lambda c, k, other: c.adelete(k),
    "ahas_key": lambda c, k, other: c.ahas_key(k),
    "aincr": lambda c, k, other: c.aincr(k),
    "adecr": lambda c, k, other: c.adecr(k),
    "attl": lambda c, k, other: c.attl(k),
    "aget_many": lambda c, k, other: c.aget_many([k, other]),
    "aset_many": lambda c, k, other: c.aset_many({k: 1, other: 2}),
    "adelete_many": lambda c, k, other: c.adelete_many([k, other]),
    "aget_or_set": lambda c, k, other: c.aget_or_set(other, 1),
    "aincr_version": lambda c, k, other: c.aincr_version(other),
    "adecr_version": lambda c, k, other: c.adecr_version(other, version=2),
    "akeys_with_prefix": lambda c, k, other: c.akeys_with_prefix(""),
    "aget_with_prefix": lambda c, k, other: c.aget_with_prefix(""),
    "adelete_with_prefix": lambda c, k, other: c.adelete_with_prefix("gone"),
    "acull": lambda c, k, other: c.acull(),
    "aclear": lambda c, k, other: c.aclear(),
    "aclose": lambda c, k, other: c.aclose(),
    "adisconnect_all": lambda c, k, other: c.adisconnect_all(),
}


def build(**options: Any) -> MySQLCache:
    return make_cache(TABLE, OPTIONS=options)


@pytest.fixture
def cache() -> Iterator[MySQLCache]:
    cache = build()
    cache.clear()
    yield cache
    cache.clear()


CONFIGURATIONS = {
    "one database": {},
    "shards and a replica": {"DATABASES": SHARDS, "REPLICAS": {"shard2": REPLICA}},
    "herd protection": {"LEASE_TIMEOUT": 2, "STALE_TIMEOUT": 30, "CULL_PROBABILITY": 1},
}


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_no_async_method_hops_to_a_thread(configuration, monkeypatch):
    if "DATABASES" in CONFIGURATIONS[configuration] and len(SHARDS) < 3:
        pytest.skip("needs KVCACHE_MYSQL_SHARD_PORTS")
    cache = build(**CONFIGURATIONS[configuration])
    cache.clear()
    hops: list[Any] = []

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def sync_to_async(*args: Any, **kwargs: Any) -> Any:
            hops.append(args)
            return original(*args, **kwargs)
        return sync_to_async

    monkeypatch.setattr(asgiref.sync, "sync_to_async", counting(asgiref.sync.sync_to_async))
    monkeypatch.setattr(
        django_kvcache.base, "sync_to_async", counting(django_kvcache.base.sync_to_async)
    )
    cache.set("n", 1)
    threads_before = {thread.ident for thread in threading.enumerate()}
    before = {alias: connections[alias].connection for alias in connections}

    async def every_method() -> None:
        for name, call in NATIVE.items():
            await call(cache, "n" if "cr" in name else "k", "other")

        async def compute() -> str:
            return "awaited"

        assert await cache.aget_or_set("made", compute, 60) == "awaited"  # an async default
        assert await cache.aget("made") == "awaited"

    run_on_a_fresh_loop(every_method())
    assert hops == []
    assert {thread.ident for thread in threading.enumerate()} == threads_before
    # Django's connections of this thread were neither opened nor used by the loop.
    assert {alias: connections[alias].connection for alias in connections} == before
    cache.clear()


def test_async_writes_are_read_by_the_sync_api_and_back(cache):
    awkward = {"it's": 1, 'say"hi"': [2], "back\\slash": b"\x00\xff", "été😀": "ok", "%s%%": 5}

    async def write() -> None:
        assert await cache.aset_many(awkward) == []
        assert await cache.aincr("it's", 41) == 42

    asyncio.run(write())
    assert cache.get_many(awkward) == {**awkward, "it's": 42}
    cache.set("from-sync", {"a": 1})
    assert asyncio.run(cache.aget("from-sync")) == {"a": 1}


# --- the event loop's own connections -------------------------------------------------------


ALIAS = "kvcache_async_options"


@pytest.fixture
def options_alias(django_db_blocker) -> Iterator[str]:
    """The default database's entry with session settings of its own: a strict, ANSI,
    no-backslash sql_mode and a one-second read_timeout."""
    entry = dict(connections.settings["default"])
    mode = "STRICT_ALL_TABLES,ANSI_QUOTES,NO_BACKSLASH_ESCAPES"
    options = {"charset": "utf8mb4", "read_timeout": 1,
               "init_command": f"SET SESSION sql_mode = '{mode}'"}
    with registered_alias(ALIAS, {**entry, "TEST": {}, "OPTIONS": options}, django_db_blocker):
        yield ALIAS


def test_own_connections_honour_the_alias_options(options_alias):
    cache = build(DATABASE=options_alias)
    cache.clear()

    async def session() -> tuple[Any, ...]:
        awkward = {"back\\slash": "\\", "quote'": "'", 'double"': '"'}
        await cache.aset_many(awkward)
        found = await cache.aget_many(awkward)
        pool = pools.loop_pool(options_alias, cache.cluster.connections)
        connection = await pool.checkout()
        try:
            connection.query(b"SELECT @@SESSION.sql_mode, @@SESSION.autocommit, "
                             b"@@SESSION.tx_isolation")
            row = connection.store_result().fetch_row()[0]
            charset = connection.character_set_name()
        finally:
            pool.checkin(connection)
        return found == awkward, row, charset

    same, (mode, autocommit, isolation), charset = asyncio.run(session())
    assert same
    assert {"ANSI_QUOTES", "NO_BACKSLASH_ESCAPES"} <= set(mode.split(","))
    assert autocommit == 1 and isolation == "READ-COMMITTED" and charset == "utf8mb4"
    assert cache.get("back\\slash") == "\\"  # the sync path reads what the async one wrote
    cache.clear()


def test_a_statement_waits_on_the_loop_and_gives_up_after_read_timeout(options_alias):
    """The statement waits for a table lock: the loop keeps running other work meanwhile,
    and after read_timeout (the alias's: no IO_TIMEOUT in the cache's OPTIONS) the call
    fails, not sent again (a rerun would wait as long); its connection is closed."""
    cache = build(DATABASE=options_alias, IGNORE_EXCEPTIONS=False)
    cache.set("locked", 1)
    locker = MySQLdb.connect(**observer(options_alias))
    locker.query(f"LOCK TABLES `{TABLE}` WRITE".encode())

    async def scenario() -> tuple[int, float, BaseException | None, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        started = time.monotonic()
        try:
            await cache.aget("locked")
            error = None
        except OperationalError as exc:
            error = exc
        stop.set()
        await ticking
        pool = pools.loop_pool(options_alias, cache.cluster.connections)
        return ticks, time.monotonic() - started, error, pool.size

    try:
        ticks, waited, error, pool_size = asyncio.run(scenario())
    finally:
        locker.query(b"UNLOCK TABLES")
        locker.close()
    assert error is not None and errors.classify(error) is errors.TIMED_OUT
    assert error.args[0] == 2013  # as mysqlclient's own read timeout reports it
    assert 0.9 <= waited < 2  # read_timeout, once
    assert ticks > 50  # the loop ran the ticker all along
    assert pool_size == 0  # the connection with an unanswered statement was closed
    assert cache.get("locked") == 1
    cache.clear()


def observer(alias: str) -> dict[str, Any]:
    entry = connections[alias].settings_dict
    return {"host": entry["HOST"], "port": int(entry["PORT"]), "user": entry["USER"],
            "password": entry["PASSWORD"], "database": entry["NAME"]}


def test_a_cancelled_call_leaves_no_unread_reply_behind(cache):
    cache.set("k", "v")
    locker = MySQLdb.connect(**observer("default"))
    locker.query(f"LOCK TABLES `{TABLE}` WRITE".encode())

    async def scenario() -> tuple[int, Any]:
        call = asyncio.create_task(cache.aget("k"))
        await asyncio.sleep(0.3)  # sent, waiting for the lock
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        pool = pools.loop_pool("default", cache.cluster.connections)
        size = pool.size  # the connection with the unread reply was closed, not kept
        locker.query(b"UNLOCK TABLES")
        return size, await cache.aget("k")

    try:
        size, value = asyncio.run(scenario())
    finally:
        locker.close()
    assert size == 0 and value == "v"


def test_each_loop_has_its_own_pool_closed_with_the_loop(cache):
    loop_pools: list[Any] = []
    failures: list[BaseException] = []

    async def work() -> None:
        await asyncio.gather(*(cache.aset(f"k{i}", i) for i in range(8)))
        assert await cache.aget_many([f"k{i}" for i in range(8)]) == {f"k{i}": i for i in range(8)}
        loop_pools.append(pools.loop_pool("default", cache.cluster.connections))

    def in_a_thread() -> None:
        try:
            asyncio.run(work())
        except BaseException as exc:  # reported below
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=in_a_thread) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    assert len({id(pool) for pool in loop_pools}) == 3
    assert all(pool.idle == [] and pool.size == 0 for pool in loop_pools)


def test_concurrent_coroutines_share_a_bounded_pool(cache):
    bounded = build(MAX_POOL_SIZE=3, POOL_TIMEOUT=5)

    async def scenario() -> int:
        await bounded.aset("k", "v")
        assert await asyncio.gather(*(bounded.aget("k") for _ in range(200))) == ["v"] * 200
        return pools.loop_pool("default", bounded.cluster.connections).connects

    assert asyncio.run(scenario()) <= 3


@contextmanager
def row_locked(*keys: str) -> Iterator[Any]:
    """``keys``' rows locked by a transaction of another connection (yielded: ROLLBACK on
    it lets go), so a write of one holds its pooled connection until then."""
    locker = MySQLdb.connect(**observer("default"))
    listed = ", ".join(f"'{key}'" for key in keys)
    try:
        locker.query(b"BEGIN")
        locker.query(f"SELECT * FROM `{TABLE}` WHERE `cache_key` IN ({listed}) FOR UPDATE"
                     .encode())
        locker.store_result()
        yield locker
    finally:
        locker.close()


def test_an_exhausted_pool_says_so(cache):
    bounded = build(MAX_POOL_SIZE=1, POOL_TIMEOUT=0.2, IGNORE_EXCEPTIONS=False)
    cache.set("k", 1)

    async def scenario(locker: Any) -> None:
        holding = asyncio.create_task(bounded.aset("k", 2))  # waits for the lock
        await asyncio.sleep(0.2)
        with pytest.raises(errors.PoolExhausted, match="MAX_POOL_SIZE"):
            await bounded.aget("k")
        locker.query(b"ROLLBACK")
        await holding

    with row_locked(":1:k") as locker:
        asyncio.run(scenario(locker))
    assert cache.get("k") == 2


def test_each_waiter_has_its_own_pool_timeout(cache):
    """The pool keeps one timer for its oldest waiter: a coroutine that started waiting
    later still waits its whole POOL_TIMEOUT, and one that gave up (cancelled) leaves
    the others' deadlines alone."""
    bounded = build(MAX_POOL_SIZE=1, POOL_TIMEOUT=0.3, IGNORE_EXCEPTIONS=False)
    cache.set("k", 1)

    async def scenario(locker: Any) -> list[float]:
        loop = asyncio.get_running_loop()
        holding = asyncio.create_task(bounded.aset("k", 2))  # holds the one connection
        await asyncio.sleep(0.05)

        async def waited(delay: float) -> float:
            await asyncio.sleep(delay)
            started = loop.time()
            with pytest.raises(errors.PoolExhausted):
                await bounded.aget("k")
            return loop.time() - started

        given_up = asyncio.create_task(bounded.aget("k"))
        await asyncio.sleep(0.05)
        given_up.cancel()
        waits = await asyncio.gather(waited(0), waited(0.2))
        locker.query(b"ROLLBACK")
        await holding
        return waits

    with row_locked(":1:k") as locker:
        waits = asyncio.run(scenario(locker))
    assert all(0.29 <= wait < 2 for wait in waits), waits
    assert cache.get("k") == 2


def test_calls_never_run_inside_the_caller_s_transaction(cache):
    """Inside a sync atomic() (reached through async_to_sync), both APIs write on the
    cache's own connections: committed at once, not rolled back with the caller's work."""
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            cache.set("sync", 1)
            asgiref.sync.async_to_sync(cache.aset)("async", 1)
            raise RuntimeError("the view failed")
    assert cache.get("sync") == 1
    assert cache.get("async") == 1


# --- faults: the same policy as the sync path -----------------------------------------------


FAULTY = "kvcache_async_faulty"


@pytest.fixture
def own_server(mariadb_server, django_db_blocker) -> Iterator[Any]:
    entry = mariadb_server.connection_settings()
    options = {**entry["OPTIONS"], "connect_timeout": 2, "read_timeout": 5}
    with registered_alias(FAULTY, {**entry, "OPTIONS": options}, django_db_blocker):
        yield mariadb_server


def test_first_async_call_after_a_restart_succeeds_and_add_is_never_sent_twice(own_server):
    cache = build(DATABASE=FAULTY)

    async def scenario() -> list[Any]:
        await cache.aset_many({"key": "value", "n": 1})
        own_server.restart()  # the loop's pooled connection is gone
        got = await cache.aget("key")
        own_server.restart()
        added = await cache.aadd("fresh", 1)
        own_server.restart()
        counted = await cache.aincr("n", 2)
        return [got, added, counted]

    assert asyncio.run(scenario()) == ["value", True, 3]
    assert cache.get_many(["key", "fresh", "n"]) == {"key": "value", "fresh": 1, "n": 3}


def test_a_stopped_shard_under_ignore_exceptions_on_the_async_api(own_server, caplog):
    if len(SHARDS) < 3:
        pytest.skip("needs KVCACHE_MYSQL_SHARD_PORTS")
    cache = build(DATABASES=["shard2", FAULTY], IGNORE_EXCEPTIONS=True, RETRY_TIMEOUT=60,
                  FAILURE_THRESHOLD=1)
    cache.clear()
    keys = [f"key{i}" for i in range(30)]
    on_faulty = [k for k in keys if cache._shard_for(cache.make_key(k)).alias == FAULTY]
    healthy = [k for k in keys if k not in on_faulty]

    async def scenario() -> None:
        assert await cache.aset_many(dict.fromkeys(keys, "old")) == []
        own_server.stop()
        assert sorted(await cache.aset_many(dict.fromkeys(keys, "new"))) == sorted(on_faulty)
        assert await cache.aget_many(keys) == dict.fromkeys(healthy, "new")
        assert await cache.aget(on_faulty[0], "default") == "default"
        with pytest.raises(ValueError):  # as for a missing key, as on memcached
            await cache.aincr(on_faulty[0])

    asyncio.run(scenario())
    shard = cache.metrics()["shards"][FAULTY]
    assert shard["down"] is True and shard["skipped"] >= 2
    assert shard["outdated_keys"] == len(on_faulty)  # deleted there before it serves again
    own_server.start()
    cache.clear()


# --- found by review -------------------------------------------------------------------------


def test_waiting_for_one_shard_does_not_spin_on_another_that_answered():
    """A round over two shards awaits their replies in order: while the first shard's
    statement waits (here for a row lock, 1 s), the second shard's reply is already
    there. The loop must not wake for it on every turn (its socket stays readable until
    it is read): it costs next to no CPU, as waiting for one shard does."""
    if len(SHARDS) < 3:
        pytest.skip("needs KVCACHE_MYSQL_SHARD_PORTS")
    cache = build(DATABASES=["shard2", "shard3"])
    cache.clear()
    keys = [f"spin{i}" for i in range(40)]
    on = {alias: [k for k in keys if cache._shard_for(cache.make_key(k)).alias == alias]
          for alias in ("shard2", "shard3")}
    slow, fast = on["shard2"][0], on["shard3"][0]
    cache.set_many({slow: 1, fast: 1})
    locker = MySQLdb.connect(**observer("shard2"))
    try:
        locker.query(b"BEGIN")
        locker.query(f"SELECT * FROM `{TABLE}` WHERE `cache_key` = "
                     f"'{cache.make_key(slow)}' FOR UPDATE".encode())
        locker.store_result()
        release = threading.Timer(1.0, lambda: locker.query(b"ROLLBACK"))

        async def scenario() -> tuple[Any, float, float]:
            await cache.aget("warm-up")
            release.start()
            started, cpu = time.monotonic(), time.process_time()
            failed = await cache.aset_many({slow: 2, fast: 2})  # shard2's first: awaited first
            return failed, time.monotonic() - started, time.process_time() - cpu

        failed, wall, cpu = asyncio.run(scenario())
        release.join()
    finally:
        locker.close()
    assert failed == [] and wall >= 0.9
    assert cpu < 0.2 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s"
    assert cache.get_many([slow, fast]) == {slow: 2, fast: 2}
    cache.clear()


def test_a_connection_closed_while_idle_is_discarded_once(own_server):
    """The server went away while the pool's one connection sat idle (MAX_POOL_SIZE 1),
    before the loop saw the socket close: a statement that must not run twice finds out
    before sending, and the connection opened in its place fails (the server is still
    down). The pool must count that connection once: it discarded it twice (size -1),
    and then held two connections with a maximum of one."""
    cache = build(DATABASE=FAULTY, MAX_POOL_SIZE=1, POOL_TIMEOUT=2)

    async def scenario() -> tuple[int, int, int]:
        await cache.aset("k", 1)
        pool = pools.loop_pool(FAULTY, cache.cluster.connections)
        own_server.stop()  # no await since: the loop has not seen the close
        assert await cache.aadd("fresh", 1) is False  # failed open: no server
        after_failure = pool.size
        own_server.start()
        await asyncio.gather(*(cache.aget("k") for _ in range(3)))
        return after_failure, pool.size, len(pool.idle)

    after_failure, size, idle = asyncio.run(scenario())
    assert after_failure == 0
    assert size <= 1 and idle <= 1


# --- issue 39 ----------------------------------------------------------------------------------


def test_each_cache_s_pool_options_hold_on_the_event_loop(cache):
    """Two caches on one alias with different MAX_POOL_SIZE and POOL_TIMEOUT: the first
    on a loop used to fix both for every cache on that alias and loop, so the second's
    concurrent writes waited for the first's one connection, gave up after its
    POOL_TIMEOUT and were dropped (failed open, with a PoolExhausted naming options the
    second was never given)."""
    small = build(MAX_POOL_SIZE=1, POOL_TIMEOUT=0.05)
    wide = build()  # 16 connections, 1 s
    keys = ["a", "b", "c"]
    cache.set_many(dict.fromkeys(keys, 0))

    async def scenario(locker: Any) -> None:
        await small.aget("warm-up")  # the first cache on this loop and alias
        writes = [asyncio.create_task(wide.aset(key, 1)) for key in keys]
        await asyncio.sleep(0.3)  # each holds a connection, waiting for its row
        locker.query(b"ROLLBACK")
        await asyncio.gather(*writes)

    with row_locked(*(f":1:{key}" for key in keys)) as locker:
        asyncio.run(scenario(locker))
    assert cache.get_many(keys) == dict.fromkeys(keys, 1)


def test_an_error_reply_keeps_the_connection_on_the_event_loop_as_on_threads(cache):
    """An error reply (here the server's 1146, no such table) leaves the connection in
    step: both drivers keep it. The asyncio driver closed it on every error reply and
    opened a new one for the next call: five failing calls, five connections."""
    missing = MySQLCache("kvcache_async_no_such_table", {})

    def fail_five(call: Callable[[], Any]) -> None:
        for _ in range(5):
            with pytest.raises(errors.CacheTableMissing):
                call()

    async def scenario() -> int:
        for _ in range(5):
            with pytest.raises(errors.CacheTableMissing):
                await missing.aget("k")
        return missing.metrics()["shards"]["default"]["async_pool_connects"]

    before = missing.metrics()["shards"]["default"].get("pool_connects", 0)
    fail_five(lambda: missing.get("k"))
    assert missing.metrics()["shards"]["default"]["pool_connects"] - before <= 1
    assert run_on_a_fresh_loop(scenario()) == 1
