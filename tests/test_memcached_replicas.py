"""MemcachedCache with OPTIONS['REPLICAS']: each key on its first N nodes in rendezvous
order. What every operation guarantees (docs/memcached.rst, Replicas), and nodes that
die, pause and return under load without a lost entry or a stale read.

Django's contract with replicas runs in tests/test_memcached_contract.py.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import wire
from django_kvcache.memcached.lease import meta_stale_key
from tests.contract import CacheFixture, api  # noqa: F401  (fixture)
from tests.test_faults_memcached import (
    RETRY,
    THREADS,
    Load,
    build,
    keys_by_node,
    pause,
    resume,
    value_of,
)

MEMCACHED = "django_kvcache.backends.memcached.MemcachedCache"


@pytest.fixture
def three_nodes(memcached_node_factory):
    return [memcached_node_factory() for _ in range(3)]


def replicated(nodes, replicas: int = 2, **options: Any) -> MemcachedCache:
    return build([node.address for node in nodes], REPLICAS=replicas, **options)


def held(cache: MemcachedCache, key: str) -> dict[str, Any]:
    """What each node holds under the caller's ``key``, read on the node itself."""
    stored = cache.make_key(key)
    found = {}
    for node in cache.cluster.nodes:
        reply = node.call(wire.get_one(stored.encode()))
        if reply is not None:
            found[node.name] = cache.decode(reply[0], reply[1], stored)
    return found


def replica_names(cache: MemcachedCache, key: str) -> list[str]:
    return [node.name for node in cache.cluster.replica_set(cache.make_key(key))]


# --- the option ------------------------------------------------------------------------


@pytest.mark.parametrize("junk", [0, -1, 4, "two", True, None, 2.5], ids=repr)
def test_replicas_must_be_a_whole_number_up_to_the_servers_naming_cache_and_option(junk):
    configured = {"BACKEND": MEMCACHED, "LOCATION": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"],
                  "OPTIONS": {"REPLICAS": junk}}
    with override_settings(CACHES={"mc": configured}):
        with pytest.raises(ImproperlyConfigured) as raised:
            caches["mc"]
    assert str(raised.value).startswith("CACHES['mc']['OPTIONS']['REPLICAS'] must be")
    assert repr(junk) in str(raised.value)


def test_replicas_default_to_one_and_read_numeric_strings():
    nowhere = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert MemcachedCache(nowhere, {}).cluster.replicas == 1
    assert MemcachedCache(nowhere, {"OPTIONS": {"REPLICAS": "3"}}).cluster.replicas == 3


def test_a_key_s_replicas_are_its_first_nodes_in_rendezvous_order():
    nowhere = [f"127.0.0.1:{port}" for port in range(1, 9)]
    single = MemcachedCache(nowhere, {})
    cache = MemcachedCache(nowhere, {"OPTIONS": {"REPLICAS": 3}})
    for index in range(200):
        key = cache.make_key(f"k{index}")
        ranking = cache.cluster.router.ranking(key)
        assert [n.name for n in cache.cluster.replica_set(key)] == [nowhere[i] for i in ranking[:3]]
        # the first replica is where the key lives without replicas
        assert cache.cluster.replica_set(key)[0] is cache.cluster.nodes[ranking[0]]
        assert single.cluster.home(key).name == cache.cluster.replica_set(key)[0].name


# --- what each operation does with replicas -----------------------------------------------


def test_writes_reach_every_replica_and_no_other_node(three_nodes, api):  # noqa: F811
    raw = replicated(three_nodes)
    cache = api(raw)
    cache.set("a", 1)
    cache.set_many({"b": 2, "c": 3})
    assert cache.add("d", 4) is True
    for key, value in (("a", 1), ("b", 2), ("c", 3), ("d", 4)):
        assert held(raw, key) == dict.fromkeys(replica_names(raw, key), value)
    assert cache.touch("a", 100) is True
    cache.delete("a")
    cache.delete_many(["b", "c"])
    assert [held(raw, key) for key in "abc"] == [{}, {}, {}]


def test_reads_of_a_hot_key_divide_over_its_replicas(three_nodes, api):  # noqa: F811
    raw = replicated(three_nodes)
    cache = api(raw)
    cache.set("hot", "v")
    before = {node.name: node.hits for node in raw.cluster.nodes}
    for _ in range(20):
        assert cache.get("hot") == "v"
        assert cache.get_many(["hot"]) == {"hot": "v"}
    hits = {node.name: node.hits - before[node.name] for node in raw.cluster.nodes}
    assert {name for name, count in hits.items() if count} == set(replica_names(raw, "hot"))
    assert sorted(hits[name] for name in replica_names(raw, "hot")) == [20, 20]


def test_add_has_one_winner_across_replicas(three_nodes):
    caches_ = [replicated(three_nodes) for _ in range(8)]
    for round_ in range(5):
        key = f"contended-{round_}"
        won: list[int] = []
        barrier = threading.Barrier(len(caches_))

        def contend(index: int) -> None:
            barrier.wait()
            if caches_[index].add(key, index):
                won.append(index)

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(caches_))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(won) == 1
        assert held(caches_[0], key) == dict.fromkeys(replica_names(caches_[0], key), won[0])


def test_add_loses_to_a_value_another_replica_already_has(three_nodes):
    """The copy after an ``add`` the decider stored is an ``add`` too: a replica that
    holds a live value (a concurrent ``set`` that reached it first, or a decider that
    lost the key) makes the ``add`` lose, and that value is given back to the decider."""
    cache = replicated(three_nodes)
    stored = cache.make_key("k")
    primary, other = cache.cluster.replica_set(stored)
    data, flags = cache.encode("theirs", stored)
    other.call(wire.store(b"set", stored.encode(), data, flags, 0))
    assert cache.add("k", "mine") is False  # the decider did not have it; its partner did
    assert held(cache, "k") == {primary.name: "theirs", other.name: "theirs"}
    cache.set("k", "next")
    assert held(cache, "k") == {primary.name: "next", other.name: "next"}


def test_add_loses_to_the_value_a_replica_kept_when_the_decider_lost_it(
    three_nodes, api  # noqa: F811
):
    """The decider lost the key (evicted, or restarted unnoticed) while its partner kept
    it: the value is live, so the add loses, and the decider has it back."""
    raw = replicated(three_nodes)
    cache = api(raw)
    cache.set("k", "old", timeout=600)
    stored = raw.make_key("k")
    primary, other = raw.cluster.replica_set(stored)
    primary.call(wire.delete(stored.encode()))  # evicted on the decider only
    assert cache.add("k", "new") is False
    assert held(raw, "k") == {primary.name: "old", other.name: "old"}
    assert 590 < cache.ttl("k") <= 600  # its lifetime came back with it
    assert {cache.get("k") for _ in range(6)} == {"old"}  # reads turn over both


def test_counters_are_counted_by_every_replica(three_nodes, api):  # noqa: F811
    raw = replicated(three_nodes, replicas=3)
    cache = api(raw)
    cache.set("n", 10)
    assert cache.incr("n", 5) == 15
    assert cache.decr("n", 20) == -5  # below zero: compare-and-swap on each replica
    assert cache.incr("n", 2) == -3
    assert held(raw, "n") == dict.fromkeys(replica_names(raw, "n"), -3)
    with pytest.raises(ValueError):
        cache.incr("missing")


def test_get_or_set_computes_once_across_replicas(three_nodes):
    caches_ = [replicated(three_nodes, LEASE_TIMEOUT=5, STALE_TIMEOUT=30) for _ in range(8)]
    calls = []

    def compute():
        calls.append(1)
        time.sleep(0.2)
        return "computed"

    results: list[Any] = []
    threads = [threading.Thread(target=lambda c=c: results.append(c.get_or_set("k", compute, 60)))
               for c in caches_]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and results == ["computed"] * 8
    assert held(caches_[0], "k") == dict.fromkeys(replica_names(caches_[0], "k"), "computed")
    stale = meta_stale_key(caches_[0].make_key("k"))
    for node in caches_[0].cluster.replica_set(caches_[0].make_key("k")):
        assert node.call(wire.get_one(stale.encode())) is not None  # the copy rides along
    caches_[0].set("k", "newer")  # and goes with the entry's next write, everywhere
    for node in caches_[0].cluster.nodes:
        assert node.call(wire.get_one(stale.encode())) is None


# --- nodes that die, pause and return ------------------------------------------------


def test_a_killed_node_loses_no_entry_and_fails_no_call(three_nodes):
    """Strict (IGNORE_EXCEPTIONS False), under load: with two replicas a dead node costs
    no miss of a key written before, no error, and no wrong value; restarted empty, it
    serves again, its misses asked of the other replica."""
    cache = replicated(three_nodes)
    placed = keys_by_node(cache, 40)
    everything = [key for keys in placed.values() for key in keys]
    assert cache.set_many({key: value_of(key) for key in everything}) == []
    victim = three_nodes[0]
    with Load(cache, everything) as load:
        time.sleep(0.3)
        victim.kill()
        killed = time.monotonic()
        time.sleep(RETRY * 3)
        restarting = time.monotonic()
        victim.start()
        back = load.wait_for(lambda call: call.started > restarting and any(
            victim.address in replica_names(cache, key) for key in call.hit), timeout=RETRY + 5)
    assert [call.error for call in load.calls if call.error] == []
    assert [call.wrong for call in load.calls if call.wrong] == []
    assert [call.missed for call in load.calls if call.missed] == []  # no miss, no failed write
    assert any(c.started > killed and c.ended < restarting for c in load.calls)
    assert cache.cluster.by_name[victim.address].errors  # the load did meet the dead node
    assert back
    assert cache.get_many(everything) == {key: value_of(key) for key in everything}


class VersionedLoad:
    """Threads that each own their keys and write them with rising versions (set and
    set_many), reading them back (get and get_many) in between: a read older than the
    version its thread last had acknowledged is stale. Every call is recorded."""

    def __init__(self, cache: MemcachedCache, keys: list[str]) -> None:
        self.cache = cache
        share = len(keys) // THREADS
        self.owned = [keys[i * share:(i + 1) * share] for i in range(THREADS)]
        self.acknowledged: dict[str, int] = dict.fromkeys(keys, 0)
        self.stale: list[tuple[str, int, int]] = []
        self.missed: list[str] = []
        self.errors: list[BaseException] = []
        self.calls = 0
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.work, args=(n,)) for n in range(THREADS)]

    def __enter__(self) -> "VersionedLoad":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in self.threads)

    def work(self, index: int) -> None:
        rng = random.Random(index)
        keys, cache, acknowledged = self.owned[index], self.cache, self.acknowledged
        while not self.stopping.is_set():
            chosen = rng.sample(keys, 4)
            choice = rng.random()
            try:
                if choice < 0.15:
                    key = chosen[0]
                    cache.set(key, acknowledged[key] + 1)
                    acknowledged[key] += 1
                elif choice < 0.25:
                    failed = cache.set_many({key: acknowledged[key] + 1 for key in chosen})
                    for key in chosen:
                        if key not in failed:
                            acknowledged[key] += 1
                        else:  # not acknowledged: it may or may not have landed
                            self.missed.append(key)
                elif choice < 0.6:
                    self.check({chosen[0]: cache.get(chosen[0])})
                else:
                    self.check(cache.get_many(chosen), chosen)
            except Exception as exc:  # recorded; the test decides whether it was allowed
                self.errors.append(exc)
            self.calls += 1

    def check(self, found: dict[str, Any], asked: list[str] | None = None) -> None:
        for key in asked or list(found):
            version = found.get(key)
            if version is None:
                self.missed.append(key)
            elif version < self.acknowledged[key]:
                self.stale.append((key, version, self.acknowledged[key]))


def test_nodes_that_die_pause_and_return_under_load_serve_nothing_stale(three_nodes):
    """Strict, under load, with two replicas: a node paused and resumed, then — as soon as
    it serves again — another killed and started again empty, so the keys the two share
    are read from the one that missed writes while paused. No call fails, no read is
    older than the last write its thread had acknowledged, and only those shared keys
    may miss (both their replicas were hit)."""
    cache = replicated(three_nodes, IGNORE_EXCEPTIONS=False)
    keys = [key for group in keys_by_node(cache, 100).values() for key in group]
    assert cache.set_many(dict.fromkeys(keys, 0)) == []
    paused, killed = (cache.cluster.by_name[node.address] for node in three_nodes[:2])
    with VersionedLoad(cache, keys) as load:
        time.sleep(0.2)
        pause(three_nodes[0])  # timeouts, then marked down: the writes it misses are kept
        time.sleep(RETRY * 3)
        resume(three_nodes[0])  # late writes settle, then the missed keys are deleted
        deadline = time.monotonic() + 5
        while paused.health.down:  # until the load's probe finds it back
            assert time.monotonic() < deadline
            time.sleep(0.01)
        three_nodes[1].kill()
        time.sleep(RETRY * 2)
        three_nodes[1].start()  # empty: its misses are asked of the other replica
        time.sleep(RETRY * 3)
    assert load.calls > 100
    assert load.errors == []
    assert load.stale == []
    shared = {key for key in keys
              if {paused, killed} <= set(cache.cluster.replica_set(cache.make_key(key)))}
    assert set(load.missed) <= shared
    for name in (three_nodes[0].address, three_nodes[1].address):
        assert cache.cluster.by_name[name].errors  # both outages were met by the load
    final = cache.get_many(keys)
    assert {key: final.get(key, load.acknowledged[key]) for key in keys} == load.acknowledged
    assert set(keys) - set(final) <= shared


@pytest.mark.parametrize("ignore_exceptions", [False, True])
def test_a_paused_replica_never_serves_a_value_older_than_the_last_write(
    three_nodes, ignore_exceptions
):
    """A partition: the paused replica keeps v1, and writes that timed out there may land
    when it resumes. Every write is acknowledged by the other replica; afterwards every
    read, from either replica, is the last value written."""
    cache = replicated(three_nodes, IGNORE_EXCEPTIONS=ignore_exceptions)
    key = keys_by_node(cache, 1)[three_nodes[0].address][0]
    cache.set(key, "v1")
    paused = cache.cluster.by_name[three_nodes[0].address]
    assert paused in cache.cluster.replica_set(cache.make_key(key))
    pause(three_nodes[0])
    try:
        for version in ("v2", "v3", "v4"):  # timeouts, then skipped while it is down
            cache.set(key, version)
            assert cache.get(key) == version
        assert cache.get_many([key]) == {key: "v4"}
    finally:
        resume(three_nodes[0])
    time.sleep(RETRY + 0.1)
    for _ in range(10):  # reads alternate between the replicas
        assert cache.get(key) == "v4"
        assert cache.get_many([key]) == {key: "v4"}
    # Asked directly (through the exchange, as any read of it): deleted, or the last value.
    assert held(cache, key).get(paused.name, "v4") == "v4"


def test_a_replica_that_missed_a_delete_never_serves_the_deleted_value(three_nodes):
    cache = replicated(three_nodes, IGNORE_EXCEPTIONS=True)
    key = keys_by_node(cache, 1)[three_nodes[0].address][0]
    cache.set(key, "v1")
    pause(three_nodes[0])
    try:
        assert cache.delete(key) is True  # the other replica had it
        assert cache.add(key, "v2") is True
        cache.delete(key)
    finally:
        resume(three_nodes[0])
    time.sleep(RETRY + 0.1)
    for _ in range(10):
        assert cache.get(key) is None
        assert cache.get_many([key]) == {}
    assert held(cache, key) == {}


def test_a_node_restarted_between_calls_loses_no_entry(three_nodes, api):  # noqa: F811
    """A restart nobody saw fail (between two calls): the node answers, empty. Its pooled
    connection was closed by the restart, which marks it behind: its misses are asked of
    the other replica."""
    raw = replicated(three_nodes)
    cache = api(raw)
    keys = keys_by_node(raw, 20)[three_nodes[0].address]
    cache.set_many({key: value_of(key) for key in keys})
    three_nodes[0].kill()
    three_nodes[0].start()
    for key in keys:
        assert cache.get(key) == value_of(key)
    assert cache.get_many(keys) == {key: value_of(key) for key in keys}


def test_without_replicas_the_same_restart_loses_the_node_s_entries(three_nodes):
    """The same as above with REPLICAS 1: what the test above would see without them."""
    cache = replicated(three_nodes, replicas=1)
    keys = keys_by_node(cache, 20)[three_nodes[0].address]
    cache.set_many({key: value_of(key) for key in keys})
    three_nodes[0].kill()
    three_nodes[0].start()
    assert cache.get_many(keys) == {}


def test_counters_survive_a_dead_replica(three_nodes):
    cache = replicated(three_nodes, IGNORE_EXCEPTIONS=False)
    key = keys_by_node(cache, 1)[three_nodes[0].address][0]
    cache.set(key, 1)
    three_nodes[0].kill()
    for expected in range(2, 6):
        assert cache.incr(key) == expected
    assert cache.get(key) == 5
    three_nodes[0].start()
    time.sleep(RETRY + 0.1)
    for _ in range(6):
        assert cache.get(key) == 5  # the restarted replica misses; its partner answers
    assert cache.incr(key) == 6


def test_a_failed_decider_hands_over_to_a_replica_that_failed_before(three_nodes):
    """The partner failed once a while ago (it is behind, not down): when the decider
    then times out, the partner decides the ``incr`` and ``add`` — the call does not ask
    the replica that just failed it again (one failure does not make a node down)."""
    cache = replicated(three_nodes, FAILURE_THRESHOLD=5)
    key = keys_by_node(cache, 1)[three_nodes[0].address][0]
    _, partner = cache.cluster.replica_set(cache.make_key(key))
    partner_node = next(node for node in three_nodes if node.address == partner.name)
    cache.set(key, 1)
    elsewhere = keys_by_node(cache, 1)[partner.name][0]  # the key itself stays written there
    pause(partner_node)
    try:
        cache.set(elsewhere, 1)  # answered by its other replica; timed out on the partner
    finally:
        resume(partner_node)
    assert partner.behind_since and not partner.health.down_until
    pause(three_nodes[0])
    try:
        assert cache.incr(key) == 2
        fresh = next(k for k in keys_by_node(cache, 20)[three_nodes[0].address]
                     if k != key and cache.cluster.replica_set(cache.make_key(k))[1] is partner)
        assert cache.add(fresh, "won") is True
    finally:
        resume(three_nodes[0])


@pytest.mark.parametrize("ignore_exceptions", [False, True])
def test_add_is_decided_by_the_next_replica_when_the_first_dies(three_nodes, ignore_exceptions):
    cache = replicated(three_nodes, IGNORE_EXCEPTIONS=ignore_exceptions)
    keys = keys_by_node(cache, 3)[three_nodes[0].address]  # the dead node decides them
    three_nodes[0].kill()
    assert [cache.add(key, "first") for key in keys] == [True] * 3
    assert [cache.add(key, "second") for key in keys] == [False] * 3  # one winner
    assert cache.get_many(keys) == dict.fromkeys(keys, "first")


class TestAsyncReplicaFaults(CacheFixture):
    """The same read path on the event loop: a dead replica costs nothing."""

    def test_async_reads_fall_over_to_the_other_replica(self, three_nodes):
        import asyncio

        cache = replicated(three_nodes)
        keys = keys_by_node(cache, 10)[three_nodes[0].address]
        cache.set_many({key: value_of(key) for key in keys})
        three_nodes[0].kill()

        async def reads() -> list[Any]:
            single = [await cache.aget(key) for key in keys]
            return [single, await cache.aget_many(keys)]

        single, many = asyncio.run(reads())
        assert single == [value_of(key) for key in keys]
        assert many == {key: value_of(key) for key in keys}


def test_a_down_replica_counts_one_error_per_get_many_not_one_per_key(three_nodes):
    """Keys whose other replica restarted empty (behind, so its misses are asked on) and
    whose first is down: the down one is counted once per call, not once per key."""
    cache = replicated(three_nodes, IGNORE_EXCEPTIONS=True)
    keys = keys_by_node(cache, 20)[three_nodes[0].address]
    cache.set_many(dict.fromkeys(keys, 1))
    three_nodes[0].kill()
    down = cache.cluster.by_name[three_nodes[0].address]
    while not down.health.down_until:
        cache.set(keys[0], 1)  # every replica is written: the dead one fails
    for node in three_nodes[1:]:
        node.kill()
        node.start()  # empty
    before = down.errors
    for _ in range(3):
        assert cache.get_many(keys) == {}  # lost with both replicas
    assert 1 <= down.errors - before <= 3
