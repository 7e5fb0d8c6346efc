"""get_or_set's herd protection on memcached's meta commands (``memcached.lease``) and
``ttl()``, on real servers: what plain reads see while leases and stale copies exist,
early recomputation, the fallback on a server without meta commands, ttl values.

The behaviour both backends share (one computation, stale answers, dead holders) is
tested by ``tests/test_stampede.py``'s contract, which runs on this store too."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from typing import Any

import pytest
from django.core.cache.backends.memcached import PyMemcacheCache

from django_kvcache import stampede, steps
from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached.wire import THIRTY_DAYS
from django_kvcache.memcached import NodeError, wire
from django_kvcache.memcached.lease import MetaCommandsMissing, MetaLeaseStore
from tests.lost_reply_proxy import LostReplyProxy, chunks, close, send
from tests.servers import free_port
from tests.test_stampede import Computation, in_threads, while_recomputed

pytestmark = pytest.mark.once  # leases and stale copies on the wire, not Django's API

LEASE = {"LEASE_TIMEOUT": 2}


@pytest.fixture
def nodes(private_memcached_nodes):
    """The module's nodes, emptied: a test that left "k" behind (a while_recomputed
    stores "recomputed") must not answer the next test's get_or_set."""
    from tests.test_memcached_proxy import empty

    empty(private_memcached_nodes)
    return private_memcached_nodes


def build(location: Any, **options: Any) -> MemcachedCache:
    """Strict unless a test says otherwise: some tests are about what raises."""
    return MemcachedCache(location, {"OPTIONS": {"IGNORE_EXCEPTIONS": False, **options}})


@pytest.fixture
def cache(nodes):
    cache = build(nodes, **LEASE)
    cache.clear()
    yield cache
    cache.clear()


def read(store) -> stampede.Read:
    return steps.run(store.read())


def node_of(cache: MemcachedCache, key: str):
    return cache._node(cache.make_and_validate_key(key))


# --- the store chosen, and what it costs ------------------------------------------------


def test_the_meta_store_takes_its_lease_in_a_side_item(cache):
    store = cache._lease_store("k", 60, None)
    assert isinstance(store, MetaLeaseStore)
    assert read(store) == stampede.Read(stampede.MISSING, False, True)
    assert store.fallback is None  # a meta node: no add-based lease
    node = node_of(cache, "k")
    assert node.call(wire.meta_ttl(store.lease_key)) > 0  # the vivified lease item
    assert read(cache._lease_store("k", 60, None)).won is False  # Z: someone else's
    steps.run(store.release())
    assert node.call(wire.meta_ttl(store.lease_key)) is None


def test_a_hit_costs_one_round_trip_and_a_stale_answer_two(cache, nodes):
    guarded = build(nodes, **LEASE, STALE_TIMEOUT=30)
    guarded.get_or_set("k", "old", timeout=60)
    node = node_of(guarded, "k")
    before = node.ops
    assert read(guarded._lease_store("k", 60, None)) == stampede.Read("old", True, False)
    assert node.ops - before == 1  # one mg, as a plain get
    node.call(wire.delete(b":1:k"))  # gone, as if expired: only the stale copy is left
    holder = guarded._lease_store("k", 60, None)
    assert read(holder).won
    before = node.ops
    assert read(guarded._lease_store("k", 60, None)) == stampede.Read("old", False, False)
    assert node.ops - before == 2  # mg of the entry, then one request: lease, entry, stale
    steps.run(holder.release())


def test_a_released_lease_of_someone_else_is_left_alone(cache, nodes):
    """A holder whose lease expired (it was too slow) must not delete the lease that a
    new winner took meanwhile: the delete is conditional on the lease's CAS."""
    short = build(nodes, LEASE_TIMEOUT=1)
    slow = short._lease_store("k", 60, None)
    assert read(slow).won
    deadline = time.monotonic() + 5
    while not read(fresh := short._lease_store("k", 60, None)).won:
        assert time.monotonic() < deadline
        time.sleep(0.05)  # the slow holder's lease has not expired yet
    steps.run(slow.release())  # too late: not its lease any more
    assert read(short._lease_store("k", 60, None)).won is False  # the new one's holds
    steps.run(fresh.release())
    assert read(short._lease_store("k", 60, None)).won


# --- plain Django semantics around leases and stale copies ----------------------------


def test_plain_reads_and_writes_never_see_a_lease(cache, nodes):
    holder = cache._lease_store("k", 60, None)
    assert read(holder).won  # the lease is held; the entry is still missing
    assert cache.get("k") is None
    assert cache.get("k", "default") == "default"
    assert cache.get_many(["k", "other"]) == {}
    assert cache.has_key("k") is False
    with pytest.raises(ValueError):
        cache.incr("k")
    assert cache.ttl("k") == 0

    async def async_reads():
        return (await cache.aget("k"), await cache.aget_many(["k"]),
                await cache.ahas_key("k"), await cache.attl("k"))

    assert asyncio.run(async_reads()) == (None, {}, False, 0)
    django_cache = PyMemcacheCache(nodes[0], {})  # another client, same routing on one node
    single = build(nodes[0], **LEASE)
    assert read(single._lease_store("one-node", 60, None)).won
    assert django_cache.get("one-node") is None  # no empty placeholder under the key
    assert cache.add("k", "added") is True  # add over a held lease, as over a miss
    assert cache.get("k") == "added"
    steps.run(holder.store("computed"))  # the winner's set still lands
    assert cache.get("k") == "computed"


def test_an_expired_entry_with_a_stale_copy_is_a_miss_to_plain_calls(nodes):
    cache = build(nodes, **LEASE, STALE_TIMEOUT=30)
    cache.clear()
    assert cache.get_or_set("k", "old", timeout=1) == "old"
    assert 0 < cache.ttl("k") <= 1
    time.sleep(2.3)  # expired (memcached counts whole seconds); the stale copy lives on
    assert cache.get("k") is None and cache.get_many(["k"]) == {}
    assert cache.has_key("k") is False
    assert cache.ttl("k") == 0  # documented: a stale entry has no ttl
    holder = cache._lease_store("k", 60, None)
    assert read(holder).won
    assert read(cache._lease_store("k", 60, None)).value == "old"  # get_or_set's stale
    assert cache.add("k", "new") is True
    assert cache.get("k") == "new"
    steps.run(holder.release())


def test_values_written_by_django_s_pymemcache_read_the_same(nodes):
    django_cache = PyMemcacheCache(nodes[0], {})
    ours = build(nodes[0], **LEASE)
    ours.clear()
    values = {"text": "ünïcode", "bytes": b"raw", "int": 42, "dict": {"a": [1, 2]},
              "none": None, "empty": b""}
    django_cache.set_many(values, timeout=60)
    compute = Computation()
    assert {key: ours.get_or_set(key, compute) for key in values} == values
    assert compute.calls == 0
    assert 58 <= ours.ttl("int") <= 60


# --- early recomputation ----------------------------------------------------------------


def test_early_recomputation_keeps_a_hot_key_fresh_with_one_computation_at_a_time(nodes):
    options = {**LEASE, "EARLY_RECOMPUTE": 2}
    cache = build(nodes, **options)
    cache.clear()
    running, most, generations = [0], [0], []
    lock = threading.Lock()

    def compute() -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            generations.append(len(generations))
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return len(generations)

    # EARLY_RECOMPUTE is bounded by a quarter of the timeout, on memcached's whole-second
    # clock a second less: a 1 s window here (a 4 s entry would have none).
    timeout = 8
    cache.get_or_set("hot", compute, timeout=timeout)
    misses_before = sum(node.misses for node in cache._nodes)
    duration = 1.8 * timeout  # past the expiry time of the first two values
    stop = time.monotonic() + duration

    def caller(index: int) -> int:
        own = build(nodes, **options)
        calls = 0
        while time.monotonic() < stop:
            own.get("hot")
            own.get_or_set("hot", compute, timeout=timeout)
            calls += 1
            time.sleep(0.01)
        return calls

    calls = sum(in_threads(8, caller))
    # Nobody — plain get or get_or_set — ever found the key missing, so nobody waited:
    # every value was replaced before it expired.
    assert sum(node.misses for node in cache._nodes) == misses_before
    assert most[0] == 1  # exactly one caller recomputes at a time
    # About one computation per (timeout - window) seconds, not one per caller.
    assert 2 <= len(generations) <= duration / (timeout - 2) + 2
    assert calls > 50 * len(generations)


def test_an_early_recomputation_holds_the_lease(nodes):
    """The early winner (``W`` on the entry) also takes the lease: a reader that finds the
    entry expired while that recomputation still runs waits for it instead of computing
    a second time."""
    options = {"LEASE_TIMEOUT": 10, "EARLY_RECOMPUTE": 30}  # longer than the computation
    cache = build(nodes, **options)
    cache.clear()
    cache.set("hot", "old", timeout=2)  # inside the window of a 60 s entry
    slow = Computation("new", seconds=5)  # outlives the entry (2 to 3 s: whole seconds)
    first = threading.Thread(target=lambda: cache.get_or_set("hot", slow, timeout=60))
    first.start()
    deadline = time.monotonic() + 5
    while not slow.calls:  # the early winner has started
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(3.2)  # the entry has expired, the recomputation still runs
    other = Computation("other", seconds=0)
    assert build(nodes, **options).get_or_set("hot", other, timeout=60) == "new"
    first.join(10)
    assert (slow.calls, other.calls) == (1, 0)


# --- a server without meta commands --------------------------------------------------


class ClassicOnlyProxy(LostReplyProxy):
    """A memcached that predates the meta commands (a fault simulated in front of a real
    one): every meta command is answered ``ERROR``, the rest forwarded."""

    META = (b"mn", b"mg ", b"ms ", b"md ", b"ma ", b"me ")

    def client_to_server(self, client: socket.socket, server: socket.socket, pair: dict) -> None:
        for chunk in chunks(client):
            if chunk.startswith(self.META):  # our client sends these alone
                if not send(client, b"ERROR\r\n" * chunk.count(b"\r\n")):
                    break
            elif not send(server, chunk):
                break
        close(client, server)


@pytest.fixture
def classic_only(memcached_node_factory):
    host, port = memcached_node_factory().address.rsplit(":", 1)
    proxy = ClassicOnlyProxy(host, int(port))
    yield f"127.0.0.1:{proxy.port}"
    proxy.stop()


def test_a_node_without_meta_commands_falls_back_to_add_leases(classic_only):
    cache = build(classic_only, **LEASE, STALE_TIMEOUT=30)
    store = cache._lease_store("k", 60, None)
    assert read(store).won
    assert isinstance(store.fallback, stampede.AddLeaseStore)
    assert cache._nodes[0].meta is False  # probed once, remembered
    steps.run(store.release())
    compute = Computation()
    results = in_threads(16, lambda i: build(classic_only, **LEASE).get_or_set("hot", compute))
    assert compute.calls == 1 and results == ["fresh"] * 16


def test_without_meta_commands_a_holder_never_releases_a_successor_s_lease(classic_only):
    """The add-based lease's release reads the lease and then deletes it; a successor
    that took the lease between the two (the holder's expired) must keep it: the delete
    is conditional on the lease being unchanged since the read (its CAS)."""
    cache = build(classic_only, LEASE_TIMEOUT=1)
    holder = cache._lease_store("k", 60, None)
    assert read(holder).won
    release = holder.release()
    step = next(release)  # the release's read of the lease: still the holder's
    answer = step.run()
    deadline = time.monotonic() + 5
    while not read(successor := cache._lease_store("k", 60, None)).won:
        assert time.monotonic() < deadline  # the holder's lease has not expired yet
        time.sleep(0.05)
    with pytest.raises(StopIteration):
        while True:  # the rest of the release, after the successor took the lease
            answer = release.send(answer).run()
    assert read(cache._lease_store("k", 60, None)).won is False  # the successor's holds
    steps.run(successor.release())
    assert read(cache._lease_store("k", 60, None)).won


@pytest.fixture
def two_classic_only(memcached_node_factory):
    """Two nodes without meta commands (as ``classic_only``)."""
    proxies = []
    for _ in range(2):
        host, port = memcached_node_factory().address.rsplit(":", 1)
        proxies.append(ClassicOnlyProxy(host, int(port)))
    yield [f"127.0.0.1:{proxy.port}" for proxy in proxies]
    for proxy in proxies:
        proxy.stop()


@pytest.mark.parametrize("deletion", ["delete", "adelete_many"])
@pytest.mark.parametrize("layout", ["same node", "another node"])
def test_without_meta_commands_delete_removes_the_stale_copy_on_its_node(
    classic_only, two_classic_only, layout, deletion
):
    """The add-based store's stale copy is a key of its own, which may live on another
    node than the entry: ``delete`` removes it there too (in the same round), so no
    caller is served the deleted value while the lease holder recomputes."""
    location = classic_only if layout == "same node" else two_classic_only
    cache = build(location, **LEASE, STALE_TIMEOUT=30)
    key = next(
        candidate for candidate in (f"k{i}" for i in range(1000))
        if (cache._home(cache.make_and_validate_key(candidate))
            is cache._home(cache.make_and_validate_key(stampede.side_key("stale", candidate))))
        == (layout == "same node")
    )
    assert cache.get_or_set(key, "deleted", timeout=60) == "deleted"
    assert all(node.meta is False for node in cache._nodes if node.meta is not None)
    if deletion == "delete":
        assert cache.delete(key) is True
    else:
        asyncio.run(cache.adelete_many([key]))
    assert cache.get(stampede.side_key("stale", key)) is None
    waiter = build(location, **LEASE, STALE_TIMEOUT=30)
    assert while_recomputed(cache, key, lambda: waiter.get_or_set(key, "no", 60)) == "recomputed"


def deletes(cache: MemcachedCache) -> dict[str, int]:
    """The deletes each node has served (its own stats, hits and misses)."""
    return {node: stats["delete_hits"] + stats["delete_misses"]
            for node, stats in cache.server_stats().items()}


def test_delete_without_stale_timeout_sends_the_entry_s_delete_alone(cache, nodes):
    """Without STALE_TIMEOUT there are no stale copies: delete costs what it always did."""
    cache.set("k", "v")
    node = node_of(cache, "k")
    before, ops = deletes(cache), node.ops
    assert cache.delete("k") is True
    assert node.ops == ops + 1
    before[node.name] += 1
    assert deletes(cache) == before


@pytest.mark.parametrize("deletion", ["delete", "adelete"])
def test_delete_sends_the_stale_copy_s_delete_in_the_entry_s_request(nodes, deletion):
    """With STALE_TIMEOUT, on a meta node the stale copy lives beside the entry: its delete
    goes to that node in the entry's request (one op), and to no other node."""
    cache = build(nodes, **LEASE, STALE_TIMEOUT=30)
    cache.clear()  # the module's nodes: an earlier test may have left "k"
    assert cache.get_or_set("k", "v", 60) == "v"
    node = node_of(cache, "k")
    stale = cache._lease_store("k", 60, None).stale_key
    assert node.call(wire.meta_ttl(stale)) is not None  # the copy is there
    before, ops = deletes(cache), node.ops
    if deletion == "delete":
        assert cache.delete("k") is True
    else:
        assert asyncio.run(cache.adelete("k")) is True
    assert node.ops == ops + 1  # one op: the caller's delete
    before[node.name] += 2
    assert deletes(cache) == before  # the entry's and its copy's, on its node alone
    assert node.call(wire.meta_ttl(stale)) is None


def test_ttl_on_a_node_without_meta_commands_says_so(classic_only):
    for options in ({}, {"IGNORE_EXCEPTIONS": True}):
        cache = build(classic_only, **options)
        cache.set("k", 1)
        with pytest.raises(MetaCommandsMissing, match="ttl.. cannot know"):
            cache.ttl("k")
        with pytest.raises(NotImplementedError):
            asyncio.run(cache.attl("k"))


# --- ttl --------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["sync", "async"])
def test_ttl_values(cache, api):
    def ttl(key: str, **kwargs: Any) -> Any:
        if api == "sync":
            return cache.ttl(key, **kwargs)
        return asyncio.run(cache.attl(key, **kwargs))

    cache.set("forever", 1, timeout=None)
    cache.set("minute", 1, timeout=60)
    cache.set("month", 1, timeout=THIRTY_DAYS + 100)  # sent as a Unix time
    cache.set("versioned", 1, timeout=30, version=2)
    assert ttl("missing") == 0
    assert ttl("forever") is None
    assert 58 <= ttl("minute") <= 60
    # A Unix time is counted on memcached's clock, which lags ours by up to 2 s.
    assert THIRTY_DAYS + 90 <= ttl("month") <= THIRTY_DAYS + 102
    assert 28 <= ttl("versioned", version=2) <= 30
    assert ttl("versioned") == 0
    cache.touch("minute", 10)
    assert 8 <= ttl("minute") <= 10


def test_ttl_of_a_down_node(caplog):
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(NodeError):
        build(dead).ttl("k")
    ignoring = build(dead, IGNORE_EXCEPTIONS=True)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert ignoring.ttl("k") == 0  # like a miss
        assert asyncio.run(ignoring.attl("k")) == 0
    assert "memcached" in caplog.text


def test_a_down_node_under_ignore_exceptions_computes_without_protection(caplog):
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(NodeError):
        build(dead, **LEASE).get_or_set("k", "v")
    ignoring = build(dead, **LEASE, STALE_TIMEOUT=10, IGNORE_EXCEPTIONS=True)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        started = time.monotonic()
        assert ignoring.get_or_set("k", lambda: "computed") == "computed"
        assert asyncio.run(ignoring.aget_or_set("k", lambda: "async")) == "async"
        assert time.monotonic() - started < 1  # no wait for a lease nobody can take
    assert "memcached" in caplog.text


# --- the wire additions, sans IO -----------------------------------------------------


def test_a_refused_command_in_a_sequence_keeps_the_replies_in_step():
    op = wire.meta_sequence([b"mg a N3 c\r\n", b"ms b 1\r\nx\r\n", b"mg c v f\r\n"], True)
    reply = op.make_reply()
    buffer = wire.Buffer()
    buffer.feed(b"VA 0 c7 W\r\n\r\nSERVER_ERROR out of memory storing object\r\nVA 2 f")
    assert reply.parse(buffer) is False  # the last value has not all arrived
    buffer.feed(b"1\r\nhi\r\nMN\r\n")
    assert reply.parse(buffer) is True
    lease, stored, value = op.result(reply)
    assert (lease.code, lease.number(b"c"), b"W" in lease.flags) == (b"VA", 7, True)
    assert (stored.code, stored.value) == (b"SERVER_ERROR", b"out of memory storing object")
    assert (value.code, value.value, value.number(b"f")) == (b"VA", b"hi", 1)
    assert len(buffer) == len(b"MN\r\n")  # what follows them is not theirs


def test_meta_get_fresh_and_meta_ttl_replies():
    def answer(op, data: bytes):
        reply = op.make_reply()
        buffer = wire.Buffer()
        buffer.feed(data)
        assert reply.parse(buffer)
        return op.result(reply)

    assert wire.meta_get_fresh(b"k").request == b"mg k v f\r\n"
    assert wire.meta_get_fresh(b"k", 5).request == b"mg k v f R5\r\n"
    assert answer(wire.meta_get_fresh(b"k", 5), b"VA 1 f2 W\r\n7\r\n") == (b"7", 2, True)
    assert answer(wire.meta_get_fresh(b"k", 5), b"VA 1 f2 Z\r\n7\r\n") == (b"7", 2, False)
    assert answer(wire.meta_get_fresh(b"k"), b"EN\r\n") is None
    assert wire.meta_ttl(b"k").request == b"mg k t\r\n"
    assert answer(wire.meta_ttl(b"k"), b"HD t-1\r\n") == -1
    assert answer(wire.meta_ttl(b"k"), b"HD t30\r\n") == 30
    assert answer(wire.meta_ttl(b"k"), b"EN\r\n") is None


# --- found by review ---------------------------------------------------------------------


def get_or_set(cache: MemcachedCache, api: str, key: str, default: Any, timeout: Any) -> Any:
    """``get_or_set`` on the sync API, or ``aget_or_set`` (native) with an async default."""
    if api == "sync":
        return cache.get_or_set(key, default, timeout)

    async def compute() -> Any:
        return default()

    return asyncio.run(cache.aget_or_set(key, compute, timeout))


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_winner_whose_value_is_refused_releases_the_lease(cache, api):
    """The winner's value is one memcached refuses: the caller gets it all the same (a
    refused value fails no call), and the lease is released, so the next caller computes
    at once instead of waiting LEASE_TIMEOUT."""
    too_large = os.urandom(2 << 20)  # incompressible: over the 1 MiB item limit
    assert get_or_set(cache, api, "big", lambda: too_large, 60) == too_large
    started = time.monotonic()
    assert get_or_set(cache, api, "big", lambda: "small", 60) == "small"
    assert time.monotonic() - started < 1  # LEASE_TIMEOUT is 2


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_failed_early_recomputation_serves_the_present_value(nodes, caplog, api):
    early = build(nodes, LEASE_TIMEOUT=2, EARLY_RECOMPUTE=30)
    early.set("e", "cached", 20)  # inside the early window of a 300 s entry

    def fails() -> str:
        raise RuntimeError("database down")

    with caplog.at_level(logging.WARNING, logger="django_kvcache.stampede"):
        assert get_or_set(early, api, "e", fails, 300) == "cached"  # as a hit, no error
    # Naming the cache (it named nothing): built outside CACHES, by what it is and where.
    assert f"Early recomputation failed in {early.cache_name};" in caplog.text
    assert early.cache_name.startswith("a MemcachedCache with LOCATION")
    early.delete("e")


def test_without_cas_a_holder_never_releases_another_s_lease(memcached_node_factory):
    """memcached -C hands every item CAS 0, and ``md <lease> C0`` would delete whichever
    lease is there: a holder then leaves its lease to expire instead."""
    from tests.servers import MemcachedNode

    node = MemcachedNode(extra_args=("-C",))
    node.start()
    try:
        cache = build([node.address], **LEASE)
        holder = cache._lease_store("k", 60, None)
        assert read(holder).won and holder.cas is None
        steps.run(holder.release())  # would have deleted the lease with md C0
        assert not read(cache._lease_store("k", 60, None)).won  # still held
    finally:
        node.kill()


# --- a stale copy is never older than the last write; one expiry conversion ----------------


def locations(kind: str, nodes: list[str], classic_only: str) -> Any:
    """Nodes that speak the meta commands, or one that does not (the add-based store)."""
    return nodes if kind == "meta" else classic_only


@pytest.mark.parametrize("kind", ["meta", "classic"])
@pytest.mark.parametrize("write", ["set", "set_many", "aset", "add"])
def test_a_write_after_get_or_set_leaves_no_older_stale_copy(nodes, classic_only, kind, write):
    """get_or_set keeps a stale copy of what it stored; a later plain write replaces the
    entry. Once that value expires, a waiter must not be served the older copy for
    STALE_TIMEOUT (MySQLCache serves the last value written): the write removes the copy
    in its own request."""
    location = locations(kind, nodes, classic_only)
    cache = build(location, **LEASE, STALE_TIMEOUT=30)
    cache.clear()
    assert cache.get_or_set("k", "older", timeout=60) == "older"
    if write == "set":
        cache.set("k", "newer", timeout=1)
    elif write == "set_many":
        assert cache.set_many({"k": "newer", "other": 1}, timeout=1) == []
    elif write == "aset":
        asyncio.run(cache.aset("k", "newer", timeout=1))
    else:  # the entry expired (deleted alone here); its copy lives on
        node_of(cache, "k").call(wire.delete(cache.make_and_validate_key("k").encode()))
        assert cache.add("k", "newer", timeout=1) is True
    assert cache.get("k") == "newer"
    time.sleep(2.3)  # "newer" expired (memcached counts whole seconds)
    waiter = build(location, **LEASE, STALE_TIMEOUT=30)
    served = while_recomputed(cache, "k", lambda: waiter.get_or_set("k", "no", 60))
    assert served in ("newer", "recomputed")  # never "older"


@pytest.mark.parametrize("kind", ["meta", "classic"])
def test_a_delete_right_after_the_winner_stored_leaves_no_stale_copy(
    nodes, classic_only, kind
):
    """A delete that lands between the winner's writes — the entry's and its stale
    copy's — must not leave the deleted value as the stale copy: the winner writes the
    copy first (or in the same request), the delete removes the entry, then the copy."""
    location = locations(kind, nodes, classic_only)
    cache = build(location, **LEASE, STALE_TIMEOUT=30)
    cache.clear()
    holder = cache._lease_store("k", 60, None)
    assert read(holder).won
    storing = holder.store("deleted")
    deleted, answer = False, None
    with pytest.raises(StopIteration):
        while True:
            answer = storing.send(answer).run()
            if not deleted and cache.get("k") == "deleted":  # the entry is in
                assert cache.delete("k") is True
                deleted = True
    assert deleted
    waiter = build(location, **LEASE, STALE_TIMEOUT=30)
    assert while_recomputed(cache, "k", lambda: waiter.get_or_set("k", "no", 60)) == "recomputed"


def test_a_lease_timeout_over_thirty_days_still_protects(nodes):
    """memcached reads a lifetime over 30 days as a Unix time: a lease for 31 days sent as
    seconds is a date in 1970, expired at once, and every caller would win it."""
    compute = Computation()
    options = {"LEASE_TIMEOUT": 31 * 24 * 3600}
    results = in_threads(8, lambda i: build(nodes, **options).get_or_set("long", compute, 60))
    assert compute.calls == 1 and results == ["fresh"] * 8
    build(nodes).delete("long")


def server_tick(node: Any) -> float:
    """The ``time.monotonic()`` of a moment memcached's whole-second clock ticked: when an
    item's remaining TTL, read in a tight loop, drops."""
    node.call(wire.store(b"set", b"kvcache-tick", b"x", 0, 100))
    first = node.call(wire.meta_ttl(b"kvcache-tick"))
    deadline = time.monotonic() + 3
    while node.call(wire.meta_ttl(b"kvcache-tick")) == first:
        assert time.monotonic() < deadline
    return time.monotonic()


def test_early_recomputation_never_starts_before_three_quarters_of_the_lifetime(nodes):
    """EARLY_RECOMPUTE is bounded by a quarter of the entry's lifetime: for its first
    three quarters an entry is served as it is. On memcached's whole-second clock an
    entry set just before a tick lives up to a second less than its timeout; the early
    window must not start a second early then. (An entry of 8 s, stored just before a
    tick: no early winner before 6 s.)"""
    cache = build(nodes, LEASE_TIMEOUT=2, EARLY_RECOMPUTE=100)
    node = node_of(cache, "early")
    tick = server_tick(node)
    while time.monotonic() < tick + 0.9:  # just before the next tick
        time.sleep(0.005)
    cache.set("early", "value", timeout=8)
    stored = time.monotonic()
    while True:
        read_at = time.monotonic()
        found = read(cache._lease_store("early", 8, None))
        if found.won or not found.fresh:
            break
        time.sleep(0.02)
    assert found.fresh, "expired without an early winner"
    assert read_at - stored >= 0.75 * 8 - 0.02


@pytest.mark.parametrize("kind", ["meta", "classic"])
def test_an_encrypted_stale_copy_is_sealed_under_its_own_key(nodes, classic_only, kind):
    """With ENCRYPTION_KEYS every item is bound to its key: the winner's stale copy, written
    in the entry's request, is sealed under the copy's key, and served once the entry
    expired."""
    location = locations(kind, nodes, classic_only)
    options = {**LEASE, "STALE_TIMEOUT": 30, "ENCRYPTION_KEYS": ["a stale-copy test key 0123456"]}
    cache = build(location, **options)
    cache.clear()
    assert cache.get_or_set("k", "stale one", timeout=1) == "stale one"
    time.sleep(2.3)  # expired; the copy lives on
    waiter = build(location, **options)
    assert while_recomputed(cache, "k", lambda: waiter.get_or_set("k", "no", 60)) == "stale one"


@pytest.mark.parametrize("lease_timeout, sent, patience", [(1, 2, 4.0), (2.5, 4, 8.0)])
def test_waiters_wait_twice_the_longest_a_lease_lives(nodes, lease_timeout, sent, patience):
    """A lease is sent with LEASE_TIMEOUT rounded up plus one second (``wire.exptime``),
    and an item sent with n seconds lives up to n of them on memcached's whole-second
    clock: a waiter's patience is twice that longest life, as LEASE_TIMEOUT's is
    elsewhere."""
    store = build(nodes, LEASE_TIMEOUT=lease_timeout)._lease_store("k", 60, None)
    assert b" N%d " % sent in store.lease_command() + b" "
    assert store.patience == patience
