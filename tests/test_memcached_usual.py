"""The usual calls (``memcached.usual``): ``aset``, ``aadd``, ``adelete`` and
``atouch`` of one key, REPLICAS 1, the node up, a connection free and nothing owed, await
their one request on the node's exchange without a plan, and a sync ``get`` sends and
reads its own in place — and keep every rule of the plan's: a cancellation mid-send, a
killed node, a hung one.

Real memcached processes of the tests' own; a paused node is SIGSTOPped.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from typing import Any, Iterator

import pytest
from django.core.cache.backends.base import DEFAULT_TIMEOUT

from django_kvcache.backends.memcached import MemcachedCache, ignored_failures
from django_kvcache.memcached import NodeError, aio
from django_kvcache.memcached.exchange import ASYNCIO, BLOCKING
from django_kvcache.memcached.replicas import OneReplica, Replicas
from django_kvcache.steps import arun, run
from tests.servers import MemcachedNode
from tests.test_faults_memcached import pause, resume

IO_TIMEOUT = 0.5
MARGIN = 1.0  # seconds on top of IO_TIMEOUT a call may take: a bound, not a speed test
#: More than the kernel's socket buffers hold on both sides (loopback's grow to several
#: MB): the send itself waits. Its node takes items that large (``-I``).
LARGE = 24 << 20
LARGE_ITEMS = ("-m", "256", "-I", "64m")


def build(locations: list[str], **options: Any) -> MemcachedCache:
    # Health is process-wide per (node, FAILURE_THRESHOLD, RETRY_TIMEOUT): a retry time a
    # hair different per cache keeps each cache's health its own.
    options = {
        "IGNORE_EXCEPTIONS": False,
        "IO_TIMEOUT": IO_TIMEOUT,
        "CONNECT_TIMEOUT": IO_TIMEOUT,
        "FAILURE_THRESHOLD": 100,
        "RETRY_TIMEOUT": 30 + random.random() / 1000,
        "COMPRESSOR": None,
        **options,
    }
    return MemcachedCache(locations, {"OPTIONS": options})


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The single-key write plans started during a test, by name (each goes through a
    replica policy's ``write``)."""
    started: list[str] = []
    for owner, name in [(MemcachedCache, "_set"), (MemcachedCache, "_delete"),
                        (MemcachedCache, "_touch"), (MemcachedCache, "_add"),
                        (OneReplica, "write"), (Replicas, "write"), (OneReplica, "add"),
                        (Replicas, "add"), (Replicas, "add_request")]:
        plan = getattr(owner, name, None)
        if plan is None:  # (not on the old code)
            continue

        def counted(*args: Any, __plan: Any = plan, __name: str = name, **kwargs: Any) -> Any:
            started.append(__name)
            return __plan(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return started


def pool_of(cache: MemcachedCache) -> aio.AsyncPool:
    """The running loop's pool for the cache's (only) node."""
    return aio.pool_of(cache._nodes[0])


def test_the_usual_writes_run_no_plan(memcached_node_factory, plans):
    """No plan generator is made for the usual aset, aadd, adelete and atouch; each does
    what the plan does (the reply, the node's op count, the connection back in the pool)."""
    node = memcached_node_factory()
    cache = build([node.address])

    async def scenario() -> None:
        await cache.aset("k", "v")
        assert await cache.aget("k") == "v"
        assert await cache.atouch("k", 60) is True
        assert await cache.adelete("k") is True
        assert await cache.adelete("k") is False
        assert await cache.atouch("k") is False
        assert await cache.aadd("k", "added") is True
        assert await cache.aadd("k", "lost") is False
        assert await cache.aget("k") == "added"
        pool = pool_of(cache)
        assert len(pool.idle) == pool.size == 1

    asyncio.run(scenario())
    assert plans == []
    assert cache.metrics()[node.address]["ops"] == 9


def test_an_unusual_write_goes_through_the_plan(memcached_node_factory, plans):
    """A node that owes a clean-up of copies it missed is repaired by the plan first; a
    write that finds no connection free waits for one in the plan; REPLICAS > 1 writes
    every replica: the plan's, whatever the call."""
    node = memcached_node_factory()
    cache = build([node.address])

    async def owing() -> None:
        await cache.aset("missed", "old")
        cache._nodes[0].outdated.add((cache.make_key("missed"),))
        await cache.aset("k", "v")
        assert plans == ["write"]
        cache._nodes[0].outdated.add((cache.make_key("missed"),))
        assert await cache.aadd("k", "lost") is False
        assert plans == ["write", "add_request"]
        assert await cache.aget("missed") is None  # cleaned up before the writes went

    asyncio.run(owing())
    plans.clear()
    one_connection = build([node.address], MAX_POOL_SIZE=1)

    async def busy() -> None:  # the second finds the only connection taken: it waits
        await asyncio.gather(one_connection.aset("a", 1), one_connection.aset("b", 2))
        assert await one_connection.aget("a") == 1 and await one_connection.aget("b") == 2

    asyncio.run(busy())
    assert plans == ["write"]
    plans.clear()
    replicated = build([node.address, memcached_node_factory().address], REPLICAS=2)
    asyncio.run(replicated.aset("k", "v"))
    assert plans == ["write"]


def cancelled_while_paused(cache: MemcachedCache, node: Any, value: bytes,
                           plans: list[str]) -> None:
    """An ``aset`` of ``value`` on the usual path, cancelled while the paused node reads
    nothing; then the node resumes. The write is settled before anything else is sent:
    it lands (its rest and a fence are sent), the next write comes after it, and every
    reply read afterwards is the right one's."""

    async def scenario() -> None:
        await cache.aset("warm", 0)  # a pooled connection: the usual path
        pool = pool_of(cache)
        connection = pool.idle[-1]
        pause(node)
        try:
            task = asyncio.ensure_future(cache.aset("key", value))
            await asyncio.sleep(0.2)  # sent (or sending), no reply: the node is stopped
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert plans == []  # the usual path was cancelled, not a plan
            (late,) = cache._nodes[0].unsettled.connections  # kept to be settled
            # Cut short mid-send (the rest still here) only when the buffers cannot hold it.
            assert bool(late.unsent) == (len(value) >= LARGE)
            assert connection not in pool.idle  # never reused mid-reply
            assert pool.size == len(pool.idle)  # nothing left checked out
        finally:
            resume(node)
        assert await cache.aget("key") == value  # settled first: it landed
        await cache.aset("key", "after")
        assert not cache._nodes[0].unsettled.pending
        for index in range(20):  # each reply is its own request's
            await cache.aset(f"other-{index}", index)
            assert await cache.aget(f"other-{index}") == index
        assert await cache.aget("key") == "after"

    asyncio.run(scenario())
    metrics = cache.metrics()[node.address]
    assert metrics["errors"] == 0 and metrics["down"] is False  # cancelled: not the node's fault


@pytest.fixture
def large_items_node() -> Iterator[MemcachedNode]:
    node = MemcachedNode(extra_args=LARGE_ITEMS)
    node.start()
    yield node
    node.kill()


@pytest.mark.parametrize("size", [64, LARGE], ids=["small", "larger than a socket buffer"])
def test_a_cancelled_usual_aset_is_settled_and_blames_nobody(large_items_node, plans, size):
    cache = build([large_items_node.address], IO_TIMEOUT=30, FAILURE_THRESHOLD=1)
    cancelled_while_paused(cache, large_items_node, os.urandom(size), plans)


def outcome(call: Any) -> tuple[str, str]:
    """What an awaitable did: its result or its error, as text."""
    try:
        return "returned", repr(asyncio.run(call))
    except Exception as exc:
        return type(exc).__name__, str(exc)


def node_record(cache: MemcachedCache) -> dict[str, Any]:
    metrics = cache.metrics()[cache._nodes[0].name]
    return {name: metrics[name] for name in (
        "ops", "errors", "timeouts", "ignored", "down", "consecutive_failures",
        "outdated_keys")}


WRITES = {
    "aset": (lambda cache, key: cache.aset(key, "v"),
             lambda cache, key: cache._set(key, "v", DEFAULT_TIMEOUT, None, ASYNCIO)),
    "adelete": (lambda cache, key: cache.adelete(key),
                lambda cache, key: cache._delete(key, None, ASYNCIO)),
    "aadd": (lambda cache, key: cache.aadd(key, "v"),
             lambda cache, key: cache._add(key, "v", DEFAULT_TIMEOUT, None, ASYNCIO)),
    "atouch": (lambda cache, key: cache.atouch(key),
               lambda cache, key: cache._touch(key, DEFAULT_TIMEOUT, None, ASYNCIO)),
}


@pytest.mark.parametrize("ignore_exceptions", [False, True], ids=["strict", "fail-open"])
@pytest.mark.parametrize("write", list(WRITES))
def test_a_killed_node_fails_the_usual_write_as_the_plan_does(
    memcached_node_factory, plans, write, ignore_exceptions, caplog
):
    """The same call on two caches of the same node (each its own health): the usual
    path on one, the plan on the other. Killed, the node fails both alike: the same
    error (or, failing open, the same answer and log), the same counts, the key
    remembered as missed."""
    node = memcached_node_factory()
    usual, planned = (build([node.address], IGNORE_EXCEPTIONS=ignore_exceptions)
                      for _ in range(2))
    node.kill()
    usual_call, plan_call = WRITES[write]
    ignored_failures.episodes.clear()
    with caplog.at_level(logging.WARNING, "django_kvcache"):
        by_usual = outcome(usual_call(usual, "key"))
        assert plans == []
        usual_log = [record.getMessage() for record in caplog.records]
        caplog.clear()
        ignored_failures.episodes.clear()  # the node's failure logged anew, not summarized
        by_plan = outcome(arun(plan_call(planned, "key")))
        plan_log = [record.getMessage() for record in caplog.records]
    assert by_usual == by_plan
    assert by_usual[0] == ("returned" if ignore_exceptions else "NodeError")
    assert node_record(usual) == node_record(planned)
    assert node_record(usual)["errors"] == 1 and node_record(usual)["outdated_keys"] == 1
    assert usual_log == plan_log


@pytest.mark.parametrize("ignore_exceptions", [False, True], ids=["strict", "fail-open"])
def test_io_timeout_bounds_a_hung_nodes_usual_aset(memcached_node_factory, plans,
                                                    ignore_exceptions):
    """A node that stops answering: the usual aset waits IO_TIMEOUT, not more; the node
    is blamed (a timeout), the write kept to be settled and the key remembered as
    missed; once the node answers again, the key is deleted before it serves."""
    node = memcached_node_factory()
    cache = build([node.address], IGNORE_EXCEPTIONS=ignore_exceptions)

    async def scenario() -> None:
        await cache.aset("key", "old")
        pause(node)
        try:
            started = time.monotonic()
            if ignore_exceptions:
                assert await cache.aset("key", "new") is None
            else:
                with pytest.raises(NodeError, match="did not answer within IO_TIMEOUT"):
                    await cache.aset("key", "new")
            assert time.monotonic() - started < IO_TIMEOUT + MARGIN
            assert plans == []
            assert cache._nodes[0].unsettled.pending
        finally:
            resume(node)
        assert await cache.aget("key", "missing") == "missing"  # never "old"

    asyncio.run(scenario())
    metrics = cache.metrics()[node.address]
    assert metrics["timeouts"] == 1 and metrics["errors"] == 1
    assert metrics["ignored"] == (1 if ignore_exceptions else 0)



# --- the usual sync get ---------------------------------------------------------------------


@pytest.fixture
def read_plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The single-key read plans started during a test, by name."""
    started: list[str] = []
    for owner, name in [(MemcachedCache, "_read"), (OneReplica, "read"), (Replicas, "read")]:
        plan = getattr(owner, name)

        def counted(*args: Any, __plan: Any = plan, __name: str = name, **kwargs: Any) -> Any:
            started.append(__name)
            return __plan(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return started


def test_the_usual_get_runs_no_plan(memcached_node_factory, read_plans):
    """A sync get of one key on a node that is up, with a connection free, makes no plan
    generator: its request is sent and read in place, and it does what the plan does (the
    value, the node's counts, the connection back in the pool)."""
    node = memcached_node_factory()
    cache = build([node.address])
    cache.set("key", {"a": 1})
    pool = cache._nodes[0].pool
    before = cache.metrics()[node.address]
    assert cache.get("key") == {"a": 1}
    assert cache.get("missing", "default") == "default"
    assert read_plans == []
    after = cache.metrics()[node.address]
    assert (after["ops"] - before["ops"], after["hits"] - before["hits"],
            after["misses"] - before["misses"]) == (2, 1, 1)
    assert len(pool.idle) == pool.size == 1


@pytest.mark.parametrize("ignore_exceptions", [False, True], ids=["strict", "fail-open"])
def test_a_killed_node_fails_the_usual_get_as_the_plan_does(
    memcached_node_factory, read_plans, ignore_exceptions, caplog
):
    """Killed, the node fails the usual get and the plan's alike: the same error (or,
    failing open, the default and the same log), the same counts."""
    node = memcached_node_factory()
    usual, planned = (build([node.address], IGNORE_EXCEPTIONS=ignore_exceptions)
                      for _ in range(2))
    for cache in (usual, planned):
        cache.set("key", "v")  # a pooled connection each, which the kill leaves stale
    node.kill()

    def outcome_of(call: Any) -> tuple[str, str]:
        try:
            return "returned", repr(call())
        except Exception as exc:
            return type(exc).__name__, str(exc)

    ignored_failures.episodes.clear()
    with caplog.at_level(logging.WARNING, "django_kvcache"):
        by_usual = outcome_of(lambda: usual.get("key", "default"))
        assert read_plans == []  # (the stale connection goes once more: the exchange's)
        usual_log = [record.getMessage() for record in caplog.records]
        caplog.clear()
        ignored_failures.episodes.clear()
        by_plan = outcome_of(lambda: run(planned._read(planned.make_key("key"), "default",
                                                       BLOCKING)))
        plan_log = [record.getMessage() for record in caplog.records]
    assert by_usual == by_plan
    assert by_usual[0] == ("returned" if ignore_exceptions else "NodeError")
    assert node_record(usual) == node_record(planned)
    assert usual_log == plan_log


def test_io_timeout_bounds_a_hung_nodes_usual_get(memcached_node_factory, read_plans):
    """A node that stops answering: the usual get waits IO_TIMEOUT, not more, blames the
    node, and closes the connection (a read holds nothing to settle)."""
    node = memcached_node_factory()
    cache = build([node.address])
    cache.set("key", "v")
    pause(node)
    try:
        started = time.monotonic()
        with pytest.raises(NodeError, match="did not answer within IO_TIMEOUT"):
            cache.get("key")
        assert time.monotonic() - started < IO_TIMEOUT + MARGIN
        assert read_plans == []
    finally:
        resume(node)
    assert cache.get("key") == "v"
    metrics = cache.metrics()[node.address]
    assert metrics["timeouts"] == 1 and metrics["errors"] == 1


def test_a_lone_aget_runs_no_plan(memcached_node_factory, read_plans):
    """An aget with no other gets going to its node (no company to join) goes alone on a
    free connection of the loop's pool, without a plan, as the sync get does."""
    node = memcached_node_factory()
    cache = build([node.address])
    cache.set("key", [1, 2])

    async def scenario() -> tuple[Any, Any]:
        return await cache.aget("key"), await cache.aget("missing", "default")

    assert asyncio.run(scenario()) == ([1, 2], "default")
    assert read_plans == []
    metrics = cache.metrics()[node.address]
    assert (metrics["hits"], metrics["misses"]) == (1, 1)
