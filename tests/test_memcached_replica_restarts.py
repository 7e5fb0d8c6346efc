"""REPLICAS 2 on real memcached whose deciding replica (the key's first in rendezvous
order) is killed with SIGKILL and restarted empty while its partner keeps the entries:
``add`` keeps one winner and loses to a live value, counters, ``ttl`` and ``get_or_set``
find what the partner holds, two processes agree on the decider, and a cancelled async
write leaves no replica apart (docs/memcached.rst, Replicas).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from django_kvcache.memcached import wire
from django_kvcache.memcached.exchange import ASYNCIO
from django_kvcache.steps import arun
from tests.test_faults_memcached import keys_by_node, pause, resume
from tests.test_memcached_replicas import held, replicated


@pytest.fixture
def three_nodes(memcached_node_factory):
    return [memcached_node_factory() for _ in range(3)]


def decided_by(cache, node, count: int) -> list[str]:
    """``count`` keys whose first replica (the one that decides) is ``node``."""
    return keys_by_node(cache, count)[node.address]


def restart_empty(node) -> None:
    node.kill()
    node.start()


# --- 1. add after its decider restarted ------------------------------------------------


@pytest.mark.parametrize("ignore_exceptions", [False, True])
def test_add_loses_to_the_value_the_partner_holds_after_the_decider_restarted(
    three_nodes, ignore_exceptions
):
    cache = replicated(three_nodes, IGNORE_EXCEPTIONS=ignore_exceptions)
    keys = decided_by(cache, three_nodes[0], 5)
    assert [cache.add(key, "holder") for key in keys] == [True] * 5
    restart_empty(three_nodes[0])
    assert [cache.add(key, "thief") for key in keys] == [False] * 5
    assert cache.get_many(keys) == dict.fromkeys(keys, "holder")
    for key in keys:
        assert set(held(cache, key).values()) == {"holder"}


def test_async_add_loses_to_the_value_the_partner_holds_after_the_decider_restarted(
    three_nodes,
):
    cache = replicated(three_nodes)
    keys = decided_by(cache, three_nodes[0], 5)

    async def add_all(value: str) -> list[bool]:
        return [await cache.aadd(key, value) for key in keys]

    async def scenario() -> list[bool]:
        assert await add_all("holder") == [True] * 5
        restart_empty(three_nodes[0])  # the loop's pooled connections are now stale
        return await add_all("thief")

    assert asyncio.run(scenario()) == [False] * 5
    for key in keys:
        assert set(held(cache, key).values()) == {"holder"}


def test_after_the_restart_a_free_key_still_has_one_winner(three_nodes):
    cache = replicated(three_nodes)
    keys = decided_by(cache, three_nodes[0], 5)
    cache.get_many(keys)  # pooled connections, stale after the restart
    restart_empty(three_nodes[0])
    assert [cache.add(key, "first") for key in keys] == [True] * 5
    assert [cache.add(key, "second") for key in keys] == [False] * 5
    for key in keys:
        assert held(cache, key) == {n.address: "first" for n in three_nodes
                                     if n.address in _replicas(cache, key)}


def _replicas(cache, key: str) -> list[str]:
    return [node.name for node in cache.cluster.replica_set(cache.make_key(key))]


# --- 2. incr and decr --------------------------------------------------------------------


def test_incr_and_decr_count_on_the_partner_after_the_decider_restarted(three_nodes):
    cache = replicated(three_nodes)
    keys = decided_by(cache, three_nodes[0], 4)
    cache.set_many(dict.fromkeys(keys, 10))
    restart_empty(three_nodes[0])
    assert [cache.incr(key) for key in keys] == [11] * 4
    assert [cache.decr(key, 3) for key in keys] == [8] * 4
    assert cache.get_many(keys) == dict.fromkeys(keys, 8)


def test_async_incr_counts_on_the_partner_after_the_decider_restarted(three_nodes):
    cache = replicated(three_nodes)
    keys = decided_by(cache, three_nodes[0], 4)
    cache.set_many(dict.fromkeys(keys, 10))

    async def scenario() -> list[int]:
        await cache.aget_many(keys)  # the loop's connections, stale after the restart
        restart_empty(three_nodes[0])
        return [await cache.aincr(key, 2) for key in keys]

    assert asyncio.run(scenario()) == [12] * 4


# --- 3. ttl and get_or_set with leases ---------------------------------------------------


def test_ttl_reads_the_partner_after_the_decider_restarted(three_nodes):
    cache = replicated(three_nodes)
    keys = decided_by(cache, three_nodes[0], 3)
    cache.set_many(dict.fromkeys(keys, "v"), timeout=600)
    restart_empty(three_nodes[0])
    for key in keys:
        assert 0 < cache.ttl(key) <= 600


def test_get_or_set_with_leases_returns_the_partner_s_value(three_nodes):
    cache = replicated(three_nodes, LEASE_TIMEOUT=5)
    keys = decided_by(cache, three_nodes[0], 3)
    cache.set_many(dict.fromkeys(keys, "held"))
    restart_empty(three_nodes[0])
    computed = []

    def compute() -> str:
        computed.append(1)
        return "recomputed"

    assert [cache.get_or_set(key, compute) for key in keys] == ["held"] * 3

    async def aget_or_set() -> list[Any]:
        return [await cache.aget_or_set(key, compute) for key in keys]

    assert asyncio.run(aget_or_set()) == ["held"] * 3
    assert computed == []
    for key in keys:
        assert "recomputed" not in held(cache, key).values()


# --- 4. two processes, one decider -------------------------------------------------------

RACER = r"""
import json, sys
import django
from django.conf import settings
settings.configure()
django.setup()
from django_kvcache.backends.memcached import MemcachedCache
locations, keys = json.loads(sys.argv[1]), json.loads(sys.argv[2])
cache = MemcachedCache(locations, {"TIMEOUT": None, "OPTIONS": {"REPLICAS": 2}})
cache.get_many(keys)  # pooled connections to every node
print("ready", flush=True)
sys.stdin.readline()  # the node may restart now
sys.stdin.readline()  # go
print(json.dumps([key for key in keys if cache.add(key, "won")]), flush=True)
"""


def test_two_processes_racing_add_after_a_restart_have_one_winner_per_key(three_nodes):
    """One process connected before the decider restarted (it finds its connections
    stale), one after: they must still ask the same replica first."""
    cache = replicated(three_nodes)
    keys = decided_by(cache, three_nodes[0], 200)
    locations = json.dumps([node.address for node in three_nodes])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    started: list[subprocess.Popen] = []

    def racer() -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", RACER, locations, json.dumps(keys)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        started.append(process)
        assert process.stdout.readline().strip() == "ready"
        return process

    try:
        before = racer()
        restart_empty(three_nodes[0])
        after = racer()
        for process in (before, after):
            process.stdin.write("restarted\ngo\n")
            process.stdin.flush()
        won = []
        for process in (before, after):
            out, _ = process.communicate(timeout=60)
            won.append(set(json.loads(out)))
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert won[0] | won[1] == set(keys)
    assert won[0] & won[1] == set()
    for key in keys:
        assert set(held(cache, key).values()) == {"won"}


# --- 5. a cancelled async write between the replicas -------------------------------------


def _raw_value(cache, node, key: str) -> Any:
    stored = cache.make_key(key)
    reply = cache.cluster.by_name[node.address].call(wire.get_one(stored.encode()))
    return None if reply is None else cache.decode(reply[0], reply[1], stored)


def _cancel_between_replicas(cache, three_nodes, key: str, write, landed) -> None:
    """Run ``write`` (a coroutine function) and cancel it once the decider has applied it
    (``landed()``) while the partner's only connection is held by a request the paused
    partner does not answer: the partner's share is not sent yet."""
    partner = next(n for n in three_nodes if n.address == _replicas(cache, key)[1])
    partner_node = cache.cluster.by_name[partner.address]

    async def scenario() -> None:
        pause(partner)
        try:
            blocker = asyncio.ensure_future(arun(partner_node.request(wire.stats(), ASYNCIO)))
            await asyncio.sleep(0)
            task = asyncio.ensure_future(write())
            while not await asyncio.to_thread(landed):
                await asyncio.sleep(0.01)
            assert not task.done()
            task.cancel()
            blocker.cancel()
            await asyncio.gather(task, blocker, return_exceptions=True)
        finally:
            resume(partner)

    asyncio.run(scenario())


@pytest.mark.parametrize("sign", [1, -1], ids=["aincr", "adecr"])
def test_a_cancelled_aincr_leaves_no_replica_below_an_acknowledged_value(three_nodes, sign):
    cache = replicated(three_nodes, MAX_POOL_SIZE=1, POOL_TIMEOUT=5, IO_TIMEOUT=5)
    key = decided_by(cache, three_nodes[0], 1)[0]
    cache.set(key, 100)

    async def step() -> int:
        return await (cache.aincr(key, 5) if sign > 0 else cache.adecr(key, 5))

    _cancel_between_replicas(cache, three_nodes, key, step,
                             lambda: _raw_value(cache, three_nodes[0], key) == 100 + 5 * sign)
    acknowledged = asyncio.run(step())
    assert acknowledged == 100 + 10 * sign
    for _ in range(6):
        assert cache.get(key) in (acknowledged, None)
    assert set(held(cache, key).values()) <= {acknowledged}


def test_a_cancelled_aset_many_leaves_the_replicas_alike(three_nodes):
    cache = replicated(three_nodes, MAX_POOL_SIZE=1, POOL_TIMEOUT=5, IO_TIMEOUT=5)
    key = decided_by(cache, three_nodes[0], 1)[0]
    cache.set(key, "old")

    async def write() -> Any:
        return await cache.aset_many({key: "new"})

    _cancel_between_replicas(cache, three_nodes, key, write,
                             lambda: _raw_value(cache, three_nodes[0], key) == "new")
    assert "old" not in {cache.get(key) for _ in range(6)}
    assert "old" not in held(cache, key).values()
    cache.set(key, "next")
    assert set(held(cache, key).values()) == {"next"}


def test_a_cancelled_aset_leaves_no_older_value_on_a_replica(three_nodes):
    cache = replicated(three_nodes, MAX_POOL_SIZE=1, POOL_TIMEOUT=5, IO_TIMEOUT=5)
    key = decided_by(cache, three_nodes[0], 1)[0]
    cache.set(key, "old")

    async def write() -> Any:
        return await cache.aset(key, "new")

    _cancel_between_replicas(cache, three_nodes, key, write,
                             lambda: _raw_value(cache, three_nodes[0], key) == "new")
    assert "old" not in {cache.get(key) for _ in range(6)}
    assert "old" not in held(cache, key).values()


def test_a_cancelled_aadd_leaves_the_replicas_alike(three_nodes):
    cache = replicated(three_nodes, MAX_POOL_SIZE=1, POOL_TIMEOUT=5, IO_TIMEOUT=5)
    key = decided_by(cache, three_nodes[0], 1)[0]

    decider = cache.cluster.by_name[three_nodes[0].address]
    sent = decider.bytes_sent  # credited once the decider's reply is read: then copying

    async def add() -> Any:
        return await cache.aadd(key, "added")

    _cancel_between_replicas(cache, three_nodes, key, add,
                             lambda: decider.bytes_sent > sent
                             and _raw_value(cache, three_nodes[0], key) == "added")
    seen = {cache.get(key) for _ in range(6)}
    assert len(seen) == 1
    assert len(set(held(cache, key).values())) <= 1
