"""AUTOBATCH: the gets one loop issues for one node in one iteration go out as one request.

On real memcached processes; a paused node (SIGSTOP) is a node that fails mid-batch: the
batch is on the wire and its reply never comes. The contract suite also runs with
AUTOBATCH on (tests/test_memcached_contract.py). The async pools' figures in
``metrics()`` are checked here too.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import NodeError, aio, autobatch
from tests.test_faults_memcached import IO_TIMEOUT, build, keys_by_node, pause, resume


def autobatched(nodes: list[Any], **options: Any) -> MemcachedCache:
    return build([node.address for node in nodes], AUTOBATCH=True, **options)


@pytest.fixture
def two_nodes(memcached_node_factory):
    return [memcached_node_factory() for _ in range(2)]


def test_one_iterations_gets_are_one_request_per_node(two_nodes):
    """Hits, misses and the same key twice, from agets and an aget_many at once: each
    caller gets its own answer. Per node the first caller goes alone (nothing to share
    with yet), everyone after it shares one request."""
    cache = autobatched(two_nodes)
    placed = keys_by_node(cache, 3)
    first, second = (placed[node.address] for node in two_nodes)
    cache.set_many({first[0]: "a0", first[1]: "a1", second[0]: "b0"})

    async def scenario() -> tuple[list[Any], list[int]]:
        flushes = [autobatch.gets_of(node).flushes for node in cache._nodes]
        answers = await asyncio.gather(
            cache.aget(first[0]), cache.aget(first[2], "missing"), cache.aget(first[0]),
            cache.aget(second[0]), cache.aget(second[1]),
            cache.aget_many([first[1], first[2], second[0], second[2]]),
            cache.ahas_key(second[2]),
        )
        return answers, [autobatch.gets_of(n).flushes - f for n, f in zip(cache._nodes, flushes)]

    answers, requests = asyncio.run(scenario())
    assert answers == ["a0", "missing", "a0", "b0", None,
                       {first[1]: "a1", second[0]: "b0"}, False]
    assert requests == [1, 1]  # batched requests: one per node
    ops = sum(counters["ops"] for counters in cache.metrics().values())
    assert ops == 3 + 10  # the set_many's and one per key asked
    stats = cache.metrics()
    assert sum(counters["hits"] for counters in stats.values()) == 5
    assert sum(counters["misses"] for counters in stats.values()) == 5


@pytest.mark.parametrize("ignore_exceptions", [False, True])
def test_a_node_failing_mid_batch_fails_each_of_its_callers(two_nodes, ignore_exceptions):
    """The requests are sent and the node stops answering: every caller with a key there
    gets the node's error (or, with IGNORE_EXCEPTIONS, its default); the other node's
    callers are answered; the node counts one failure per request: the first caller's,
    sent alone, and the batch of the others."""
    cache = autobatched(two_nodes, IGNORE_EXCEPTIONS=ignore_exceptions, FAILURE_THRESHOLD=5)
    placed = keys_by_node(cache, 2)
    down, up = two_nodes
    cache.set_many({key: key for keys in placed.values() for key in keys})
    errors_before = cache.metrics()[down.address]["errors"]

    async def scenario() -> list[Any]:
        return await asyncio.gather(
            cache.aget(placed[down.address][0], "default"),
            cache.aget(placed[down.address][1], "default"),
            cache.aget(placed[up.address][0]),
            cache.aget_many(placed[down.address] + placed[up.address][1:]),
            return_exceptions=True,
        )

    pause(down)
    try:
        answers = asyncio.run(scenario())
    finally:
        resume(down)
    up_key, other_up_key = placed[up.address]
    if ignore_exceptions:
        assert answers == ["default", "default", up_key, {other_up_key: other_up_key}]
    else:
        assert [type(answer) for answer in answers[:2]] == [NodeError, NodeError]
        assert answers[2] == up_key
        assert isinstance(answers[3], NodeError) and answers[3].node == down.address
    assert cache.metrics()[down.address]["errors"] == errors_before + 2
    assert cache.get(placed[down.address][0]) == placed[down.address][0]  # it answers again


def test_a_cancelled_caller_leaves_the_batch_to_the_others(two_nodes):
    cache = autobatched(two_nodes)
    node = two_nodes[0]
    keys = keys_by_node(cache, 3)[node.address]
    cache.set_many({key: key for key in keys})

    async def scenario() -> tuple[list[Any], dict[str, Any]]:
        tasks = [asyncio.create_task(cache.aget(key)) for key in keys]
        tasks.append(asyncio.create_task(cache.aget_many(keys)))
        await asyncio.sleep(IO_TIMEOUT / 3)  # the batch is on the wire, unanswered
        tasks[1].cancel()
        tasks[3].cancel()
        resume(node)
        answers = await asyncio.gather(*tasks, return_exceptions=True)
        return answers, cache.metrics()[node.address]

    pause(node)
    try:
        answers, counters = asyncio.run(scenario())
    finally:
        resume(node)
    assert answers[0] == keys[0] and answers[2] == keys[2]
    assert isinstance(answers[1], asyncio.CancelledError)
    assert isinstance(answers[3], asyncio.CancelledError)
    assert counters["async_pool_idle"] == counters["async_pool_size"] == 2  # alone, batch
    assert counters["errors"] == 0


def test_autobatch_is_a_boolean_option(two_nodes):
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="AUTOBATCH"):
        build([two_nodes[0].address], AUTOBATCH="yes")


# --- the async pools in metrics() ---------------------------------------------------------


def test_metrics_show_the_async_pools_of_every_loop(memcached_node_factory):
    """Open, idle and waiting, summed over the loops alive: one in a thread of its own,
    one here; a loop that finished has closed its pool and drops out."""
    node = memcached_node_factory()
    cache = build([node.address], MAX_POOL_SIZE=1, POOL_TIMEOUT=5.0)
    cache.set("k", "v")
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(cache.aget("k"), other).result(timeout=5)

        async def scenario() -> list[dict[str, Any]]:
            seen = [cache.metrics()[node.address]]  # the thread's loop only
            pause(node)
            try:
                writes = [asyncio.create_task(cache.aset(f"w{i}", i)) for i in range(3)]
                await asyncio.sleep(IO_TIMEOUT / 3)  # one holds the connection, two wait
                seen.append(cache.metrics()[node.address])
            finally:
                resume(node)
            await asyncio.gather(*writes)
            seen.append(cache.metrics()[node.address])
            return seen

        before, busy, after = asyncio.run(scenario())
        finished = cache.metrics()[node.address]
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join()
        other.run_until_complete(other.shutdown_asyncgens())
        other.close()
    figures = ("async_loops", "async_pool_size", "async_pool_idle", "async_pool_waiters")
    assert [before[f] for f in figures] == [1, 1, 1, 0]
    assert [busy[f] for f in figures] == [2, 2, 1, 2]
    assert [after[f] for f in figures] == [2, 2, 2, 0]
    assert busy["async_pool_waits"] == 2
    assert [finished[f] for f in figures] == [1, 1, 1, 0]  # asyncio.run's loop closed its pool
    assert cache.metrics()[node.address]["async_loops"] == 0
    assert finished["pool_size"] >= 1  # the blocking pool's figures are still there


def requests_to(node: Any) -> int:
    """Requests sent to ``node`` on the running loop (each takes a pooled connection)."""
    figures = aio.pool_of(node).figures()
    return figures["connects"] + figures["reuses"]


def test_while_requests_serve_company_the_first_get_of_an_iteration_joins_too(two_nodes):
    """Eight gets at a time on a node: the loop's first caller goes alone (nothing shows
    company yet) and the seven others share a request; from then on one request per
    round, the first caller's keys in it too (it went alone every round: two requests per
    round, and the node's connections multiplied)."""
    cache = autobatched(two_nodes[:1])
    cache.set("k", "v")
    node = cache._nodes[0]

    async def scenario() -> list[int]:
        sent = []
        for _ in range(4):
            before = requests_to(node)
            assert await asyncio.gather(*(cache.aget("k") for _ in range(8))) == ["v"] * 8
            sent.append(requests_to(node) - before)
        return sent

    assert asyncio.run(scenario()) == [2, 1, 1, 1]


def test_a_lone_caller_goes_alone_until_company_shows_and_after_it_left(two_nodes):
    """One get at a time: each sends its own request, with no batching detour. Eight at
    a time: batched (one request a round once company showed). One at a time again: once
    the node's requests have served a caller each for a while, gets go alone again."""
    cache = autobatched(two_nodes[:1])
    cache.set("k", "v")
    node = cache._nodes[0]

    async def scenario() -> tuple[list[int], list[int], list[int]]:
        gets = autobatch.gets_of(node)

        async def rounds(count: int, callers: int) -> list[int]:
            batched = []
            for _ in range(count):
                before = gets.flushes
                answers = await asyncio.gather(*(cache.aget("k") for _ in range(callers)))
                assert answers == ["v"] * callers
                batched.append(gets.flushes - before)
            return batched

        return await rounds(3, 1), await rounds(3, 8), await rounds(16, 1)

    alone, together, alone_again = asyncio.run(scenario())
    assert alone == [0, 0, 0]  # their own requests
    assert together == [1, 1, 1]
    assert alone_again[-3:] == [0, 0, 0] and alone_again[0] == 1
