"""MemcachedCache's native async API: no thread, per-loop pools, and the same failure
behaviour as the sync path (node killed, node silent, pool exhausted, late writes).

The contract suite (tests/contract.py) already runs every contract test on the async
API, and test_faults_memcached runs every operation against a silent node on both APIs;
this module covers what only the async transport has.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from typing import Any, Awaitable, Callable

import asgiref.sync
import pytest
from django.core.cache.backends.memcached import PyMemcacheCache

import django_kvcache.base
from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import NodeDown, NodeError, PoolExhausted, aio, wire
from django_kvcache.memcached.connection import Connection
from tests.test_faults_memcached import (
    IO_TIMEOUT,
    SilentServer,
    build,
    keys_by_node,
    pause,
    resume,
    silent_cache,
)

#: Every async method the issue asks to be native, as a call on a cache and two keys.
NATIVE: dict[str, Callable[[MemcachedCache, str, str], Awaitable[Any]]] = {
    "aget": lambda c, k, other: c.aget(k),
    "aset": lambda c, k, other: c.aset(k, "x" * 100_000),  # more than a socket buffer
    "aadd": lambda c, k, other: c.aadd(k, 1),
    "atouch": lambda c, k, other: c.atouch(k),
    "adelete": lambda c, k, other: c.adelete(k),
    "ahas_key": lambda c, k, other: c.ahas_key(k),
    "aincr": lambda c, k, other: c.aincr(k),
    "adecr": lambda c, k, other: c.adecr(k),
    "aget_many": lambda c, k, other: c.aget_many([k, other]),
    "aset_many": lambda c, k, other: c.aset_many({k: 1, other: 2}),
    "adelete_many": lambda c, k, other: c.adelete_many([k, other]),
    "aget_or_set": lambda c, k, other: c.aget_or_set(k, 1),
}


class NoExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, failing if anything hands it work."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an executor was used")


def run_on_a_fresh_loop(coroutine: Awaitable[Any]) -> Any:
    """``asyncio.run`` with an executor that fails if anything hands work to a thread."""
    async def guarded() -> Any:
        asyncio.get_running_loop().set_default_executor(NoExecutor())
        return await coroutine

    return asyncio.run(guarded())


@pytest.fixture
def node(memcached_node_factory):
    return memcached_node_factory()


@pytest.fixture
def cache(node):
    cache = MemcachedCache([node.address], {"OPTIONS": {"IO_TIMEOUT": 1.0,
                                                        "IGNORE_EXCEPTIONS": False}})
    yield cache
    cache.clear()


def test_no_async_method_hops_to_a_thread(cache, monkeypatch):
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
    threads_before = {thread.ident for thread in threading.enumerate()}

    async def every_method() -> None:
        cache.set("n", 1)
        for name, call in NATIVE.items():
            await call(cache, "n" if "cr" in name else "k", "other")
        async def compute() -> str:
            return "awaited"

        assert await cache.aget_or_set("made", compute) == "awaited"  # an async default
        assert await cache.aget("made") == "awaited"
        assert await cache.aget_or_set("made2", lambda: asyncio.sleep(0, "cb")) == "cb"
        await cache.aclear()
        await cache.aclose()
        await cache.adisconnect_all()

    run_on_a_fresh_loop(every_method())
    assert hops == []
    assert {thread.ident for thread in threading.enumerate()} == threads_before


def test_async_results_match_the_sync_api(cache):
    async def scenario() -> None:
        assert await cache.aset("k", "v") is None
        assert await cache.aadd("k", "w") is False
        assert await cache.aget("k") == "v"
        assert await cache.aset_many({"a": 1, "b": [2]}) == []
        assert await cache.aget_many(iter(["a", "b", "missing"])) == {"a": 1, "b": [2]}
        assert await cache.aincr("a", 10) == 11
        assert await cache.adecr("a", 20) == -9  # below zero: the compare-and-swap path
        with pytest.raises(ValueError):
            await cache.aincr("missing")
        assert await cache.atouch("a", 60) is True
        assert await cache.adelete("k") is True and await cache.adelete("k") is False
        assert await cache.adelete_many(["a", "b"]) is None
        assert await cache.ahas_key("a") is False

    run_on_a_fresh_loop(scenario())
    assert cache.get("a") is None


def test_values_written_async_are_read_by_django_pymemcache_and_back(node):
    ours = MemcachedCache([node.address], {"OPTIONS": {"HASHING": "pymemcache"}})
    theirs = PyMemcacheCache(node.address, {})
    try:
        asyncio.run(ours.aset("ours", {"from": "async"}))
        assert theirs.get("ours") == {"from": "async"}
        theirs.set("theirs", ["from", "pymemcache"])
        assert asyncio.run(ours.aget("theirs")) == ["from", "pymemcache"]
    finally:
        theirs.close()


def test_meta_commands_on_a_live_node(node):
    cache = MemcachedCache([node.address], {})
    cache.set_many({"a": 1, "c": 3})  # integers are stored as decimal text
    client = Connection(cache._nodes[0].pool.address, cache._nodes[0].pool.settings)
    try:
        assert client.round_trip(wire.meta_probe()) is True  # memcached >= 1.6.6
        found = client.round_trip(wire.meta_sequence([b"mg :1:a v\r\n", b"mg :1:b v\r\n"], False))
        assert [(reply.code, reply.value) for reply in found] == [(b"VA", b"1"), (b"EN", None)]
    finally:
        client.close()

    async def same_on_the_loop() -> list:
        connection = aio.AsyncConnection(client.address, client.settings)
        try:
            return await connection.round_trip(wire.meta_sequence([b"mg :1:c v\r\n"], False))
        finally:
            connection.close()

    assert [reply.value for reply in asyncio.run(same_on_the_loop())] == [b"3"]


# --- event loops and pools ---------------------------------------------------------------


def test_each_loop_has_its_own_pool_closed_with_the_loop(node):
    # What is tested is which pool each loop uses, not the deadlines: with the defaults
    # (1 s, fail-open) a connect that four loops' threads made late on a loaded machine
    # dropped an aset without a word, and the read-back missed it (CI, once).
    cache = MemcachedCache([node.address], {"OPTIONS": {
        "CONNECT_TIMEOUT": 30, "IO_TIMEOUT": 30, "IGNORE_EXCEPTIONS": False}})
    pools: list[Any] = []
    errors: list[BaseException] = []

    async def work() -> None:
        await asyncio.gather(*(cache.aset(f"k{i}", i) for i in range(8)))
        assert await cache.aget_many([f"k{i}" for i in range(8)]) == {f"k{i}": i for i in range(8)}
        pools.append(aio.pool_of(cache._nodes[0]))

    def in_a_thread() -> None:
        try:
            asyncio.run(work())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=in_a_thread) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert len({id(pool) for pool in pools}) == 4  # one pool per loop, none shared
    for pool in pools:
        assert pool.idle == [] and pool.size == 0  # closed when their loop shut down
    assert cache._nodes[0].pool.size == 0  # and the blocking pool was never used


def test_concurrent_coroutines_share_a_bounded_pool(node):
    cache = MemcachedCache([node.address], {"OPTIONS": {"MAX_POOL_SIZE": 3}})

    async def scenario() -> aio.AsyncPool:
        await cache.aset("k", "v")
        results = await asyncio.gather(*(cache.aget("k") for _ in range(200)))
        assert results == ["v"] * 200
        return aio.pool_of(cache._nodes[0])

    pool = asyncio.run(scenario())
    assert pool.connects <= 3



# --- faults on the async path ---------------------------------------------------------------


@pytest.fixture
def silent_server():
    server = SilentServer()
    yield server
    server.close()


def test_aget_many_waits_for_all_silent_nodes_at_once(memcached_node_factory):
    servers = [SilentServer() for _ in range(3)]
    try:
        cache = build([server.address for server in servers], FAILURE_THRESHOLD=1000)
        placed = keys_by_node(cache, 1, prefix="fan")
        keys = [keys[0] for keys in placed.values()]
        started = time.monotonic()
        with pytest.raises(NodeError):
            asyncio.run(cache.aget_many(keys))
        # One IO_TIMEOUT in all, not one per node: every request was out before any wait.
        assert time.monotonic() - started < 2 * IO_TIMEOUT
        assert all(cache.metrics()[server.address]["timeouts"] == 1 for server in servers)
    finally:
        for server in servers:
            server.close()


def test_killed_node_async_raises_then_skips_then_recovers(memcached_node_factory):
    victim, live = memcached_node_factory(), memcached_node_factory()
    cache = build([victim.address, live.address])
    ignoring = build([victim.address, live.address], IGNORE_EXCEPTIONS=True)
    key = keys_by_node(cache, 1, prefix="killed")[victim.address][0]

    async def scenario() -> None:
        await cache.aset(key, "before")
        victim.kill()
        for _ in range(2):  # FAILURE_THRESHOLD
            with pytest.raises(NodeError) as raised:
                await cache.aget(key)
            assert not isinstance(raised.value, NodeDown)
        with pytest.raises(NodeDown):
            await cache.aget(key)
        assert await ignoring.aget(key, "default") == "default"
        victim.start()
        deadline = time.monotonic() + 5
        while True:  # the next probe after RETRY_TIMEOUT finds the node back
            try:
                assert await cache.aget(key) is None  # a restarted node is empty
                break
            except NodeDown:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        assert cache.metrics()[victim.address]["down"] is False

    asyncio.run(scenario())


def test_async_pool_exhausted_raises_pool_exhausted(silent_server, memcached_node_factory):
    live = memcached_node_factory().address
    cache, key, _ = silent_cache(
        silent_server, live, FAILURE_THRESHOLD=1000, MAX_POOL_SIZE=1, POOL_TIMEOUT=0.1
    )

    async def scenario() -> list[Any]:
        return await asyncio.gather(cache.aget(key), cache.aget(key), return_exceptions=True)

    first, second = asyncio.run(scenario())
    assert isinstance(first, NodeError) and "did not answer within IO_TIMEOUT" in str(first)
    assert isinstance(second, PoolExhausted)


def test_a_cancelled_call_leaves_no_connection_checked_out(silent_server, memcached_node_factory):
    live = memcached_node_factory().address
    cache, key, other = silent_cache(silent_server, live, FAILURE_THRESHOLD=1000)

    async def scenario() -> list[Any]:
        for call in (cache.aget(key), cache.aget_many([key, other]), cache.aset(key, 1)):
            task = asyncio.ensure_future(call)
            await asyncio.sleep(0.05)  # the request is out, the reply never comes
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return [aio.pool_of(node) for node in cache._nodes]

    for pool in asyncio.run(scenario()):
        assert pool.size == len(pool.idle) == 0  # all closed with the loop, none leaked


def test_a_timed_out_async_write_is_settled_before_its_clean_up(memcached_node_factory):
    """A paused node times out an aset: the write may still land when it resumes, so
    its connection is kept and settled (rest of the request, fence) before the outdated
    key is deleted — never deleted first and then overwritten by the late write."""
    paused, live = memcached_node_factory(), memcached_node_factory()
    cache = build([paused.address, live.address], FAILURE_THRESHOLD=1000)
    key = keys_by_node(cache, 1, prefix="late")[paused.address][0]
    big = os.urandom(900_000)  # incompressible, under memcached's item size

    async def scenario() -> None:
        await cache.aset(key, "old")
        open_files = len(os.listdir("/proc/self/fd"))
        pause(paused)
        try:
            with pytest.raises(NodeError):
                await cache.aset(key, big)
            metrics = cache.metrics()[paused.address]
            assert metrics["late_writes"] == 1 and metrics["outdated_keys"] == 1
            await asyncio.sleep(0)  # the loop closes what it was told to close
            # The write's socket moved to the late writes: its transport is closed, so it
            # can neither leak nor send its buffered rest a second time.
            assert len(os.listdir("/proc/self/fd")) == open_files
        finally:
            resume(paused)
        assert await cache.aget(key) is None  # settled, then the outdated copy deleted
        metrics = cache.metrics()[paused.address]
        assert metrics["late_writes"] == 0 and metrics["outdated_keys"] == 0
        assert await cache.aget(key) is None  # and nothing landed after the clean-up

    asyncio.run(scenario())
    stats = cache.server_stats()[paused.address]
    # Each request reached the server exactly once: the old value, the late one, the
    # fence's ``version`` and the clean-up's ``delete`` — nothing sent twice, no garbage.
    assert stats["cmd_set"] == 2 and stats["delete_hits"] == 1


def test_a_checkout_that_times_out_as_it_is_handed_a_connection_gives_it_back(node):
    """From Python 3.12 ``asyncio.wait_for`` may raise TimeoutError after its future got
    a result. Here the loop is blocked past both the hand-over and POOL_TIMEOUT; when it
    wakes, the connection handed to the waiter must not be lost with a PoolExhausted —
    with MAX_POOL_SIZE 1 every later checkout would fail."""
    cache = MemcachedCache([node.address], {"OPTIONS": {
        "MAX_POOL_SIZE": 1, "POOL_TIMEOUT": 0.05, "IGNORE_EXCEPTIONS": False}})

    async def scenario() -> list[Any]:
        pool = aio.pool_of(cache._nodes[0])
        held = await pool.checkout()
        waiting = asyncio.ensure_future(pool.checkout())
        await asyncio.sleep(0)  # the waiter queues
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, time.sleep, 0.1)  # the loop stalls past POOL_TIMEOUT...
        loop.call_later(0.03, pool.checkin, held)  # ...and the hand-over, both due together
        outcome = await asyncio.gather(waiting, return_exceptions=True)
        got = outcome[0]
        if not isinstance(got, BaseException):
            pool.checkin(got)
        later = [await cache.aset(f"k{i}", i) for i in range(3)]  # the pool still works
        return [got, later, pool.size, len(pool.idle)]

    got, later, size, idle = asyncio.run(scenario())
    assert later == [None, None, None]
    assert size == idle == 1  # nothing leaked: the one connection is back


# --- reply deadlines: one timer per loop ------------------------------------------------------


def test_concurrent_replies_share_one_timer(node):
    """Every reply awaited on the loop has its IO_TIMEOUT, kept by one timer of the loop
    (not a timer per request, made and cancelled on the loop's heap each time)."""
    cache = MemcachedCache([node.address], {"OPTIONS": {"AUTOBATCH": False}})
    timers = []

    async def scenario() -> list[Any]:
        await cache.aset("k", "v")
        await asyncio.gather(*(cache.aget("k") for _ in range(50)))  # connections open
        loop = asyncio.get_running_loop()
        call_at = loop.call_at

        def counted(*args: Any, **kwargs: Any) -> Any:
            timers.append(args[0])
            return call_at(*args, **kwargs)

        loop.call_at = counted  # type: ignore[method-assign]
        try:
            return await asyncio.gather(*(cache.aget("k") for _ in range(50)))
        finally:
            del loop.call_at

    assert asyncio.run(scenario()) == ["v"] * 50
    assert len(timers) <= 2  # the first wait's, perhaps one set again as it fires


def test_a_shorter_io_timeout_on_the_same_loop_is_kept(silent_server, memcached_node_factory):
    """Two caches on one loop, a silent node: the wait with the shorter IO_TIMEOUT,
    queued after one with a longer IO_TIMEOUT, still times out at its own deadline."""
    patient = build([silent_server.address], IO_TIMEOUT=20 * IO_TIMEOUT, FAILURE_THRESHOLD=100,
                    IGNORE_EXCEPTIONS=False)
    hasty = build([silent_server.address], IO_TIMEOUT=IO_TIMEOUT, FAILURE_THRESHOLD=100,
                  IGNORE_EXCEPTIONS=False)

    async def scenario() -> float:
        slow = asyncio.ensure_future(patient.aget("k"))
        await asyncio.sleep(0.01)  # its reply wait is queued first
        started = time.monotonic()
        try:
            with pytest.raises(NodeError):
                await hasty.aget("k")
            return time.monotonic() - started
        finally:
            slow.cancel()
            await asyncio.gather(slow, return_exceptions=True)

    assert asyncio.run(scenario()) < IO_TIMEOUT + 1.0


def test_a_shorter_io_timeout_after_a_longer_ones_answer_is_kept(silent_server, node):
    """A wait with a long IO_TIMEOUT answered, then one with a short IO_TIMEOUT on a
    silent node, on the same loop: the second still times out at its own deadline (not
    at the first one's)."""
    patient = build([node.address], IO_TIMEOUT=20 * IO_TIMEOUT, IGNORE_EXCEPTIONS=False)
    hasty = build([silent_server.address], IO_TIMEOUT=IO_TIMEOUT, FAILURE_THRESHOLD=100,
                  IGNORE_EXCEPTIONS=False)

    async def scenario() -> float:
        await patient.aget("k")
        started = time.monotonic()
        with pytest.raises(NodeError):
            await asyncio.wait_for(hasty.aget("k"), 10 * IO_TIMEOUT)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < IO_TIMEOUT + 1.0
