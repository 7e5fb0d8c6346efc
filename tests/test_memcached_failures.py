"""Node failures: killed and restarted nodes under both FAILOVER policies and both
IGNORE_EXCEPTIONS settings, a node that accepts connections and never answers, the
health state machine and its signals."""
from __future__ import annotations

import logging
import socket
import time
from types import SimpleNamespace

import pytest
from pymemcache.client.base import Client

from django_kvcache import stampede
from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import NodeDown, NodeError
from django_kvcache.health import NodeHealth
from django_kvcache.signals import node_down, node_up
from tests.test_faults_memcached import pause, resume
from tests.test_stampede import while_recomputed

RETRY = 0.4


@pytest.fixture
def signals():
    received = []

    def down(sender, node, reason, **kwargs):
        received.append(("down", node))

    def up(sender, node, **kwargs):
        received.append(("up", node))

    node_down.connect(down)
    node_up.connect(up)
    yield received
    node_down.disconnect(down)
    node_up.disconnect(up)


@pytest.fixture
def two_nodes(memcached_node_factory):
    return memcached_node_factory(), memcached_node_factory()


def build(nodes, **options):
    # Health is process-wide per (node, FAILURE_THRESHOLD, RETRY_TIMEOUT); a RETRY_TIMEOUT
    # a hair different each time keeps a reused port from inheriting an old test's state.
    # Strict mode unless a test says otherwise: these tests are about what raises.
    unique_retry = RETRY + (time.monotonic() % 1) / 1000
    options = {"RETRY_TIMEOUT": unique_retry, "FAILURE_THRESHOLD": 2,
               "IGNORE_EXCEPTIONS": False, **options}
    return MemcachedCache([node.address for node in nodes], {"OPTIONS": options})


def key_on(cache, node, prefix="key"):
    """A caller key that the cache places on ``node``."""
    for i in range(1000):
        if cache._home(f":1:{prefix}-{i}").name == node.address:
            return f"{prefix}-{i}"
    raise AssertionError("no key found for the node")


def wait_for_retry():
    time.sleep(RETRY + 0.1)


def test_dead_node_raises_every_time_then_comes_back(two_nodes, signals):
    alive, dying = two_nodes
    cache = build(two_nodes)
    doomed, safe = key_on(cache, dying), key_on(cache, alive)
    cache.set_many({doomed: "before", safe: "kept"})
    dying.kill()

    for _ in range(2):  # refused connections, counted until the threshold
        with pytest.raises(NodeError) as raised:
            cache.get(doomed)
        assert not isinstance(raised.value, NodeDown)
        assert raised.value.node == dying.address
    assert signals == [("down", dying.address)]
    for call in (lambda: cache.get(doomed), lambda: cache.set(doomed, 1),
                 lambda: cache.get_many([doomed, safe]), lambda: cache.delete_many([doomed]),
                 lambda: cache.incr(doomed)):
        with pytest.raises(NodeDown, match="RETRY_TIMEOUT"):
            call()
    assert cache.get(safe) == "kept"  # the other node is unaffected

    dying.start()  # same port, empty
    wait_for_retry()
    assert cache.get(doomed) is None  # the probe: answered, so the node is up again
    assert signals == [("down", dying.address), ("up", dying.address)]
    cache.set(doomed, "after")
    assert cache.get_many([doomed, safe]) == {doomed: "after", safe: "kept"}
    metrics = cache.metrics()[dying.address]
    assert metrics["errors"] >= 7 and metrics["down"] is False


def test_failed_probe_keeps_the_node_down(two_nodes, signals):
    _, dying = two_nodes
    cache = build(two_nodes)
    doomed = key_on(cache, dying)
    dying.kill()
    for _ in range(2):
        with pytest.raises(NodeError):
            cache.get(doomed)
    wait_for_retry()
    with pytest.raises(NodeError) as probe:
        cache.get(doomed)
    assert not isinstance(probe.value, NodeDown)  # the probe really tried
    with pytest.raises(NodeDown):
        cache.get(doomed)
    assert signals == [("down", dying.address)]


def test_ignore_exceptions_gives_defaults_and_counts(two_nodes, caplog):
    alive, dying = two_nodes
    cache = build(two_nodes, IGNORE_EXCEPTIONS=True)
    doomed, safe = key_on(cache, dying), key_on(cache, alive)
    cache.set_many({doomed: "before", safe: "kept"})
    dying.kill()
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        for _ in range(3):  # before and after the node is marked down
            assert cache.get(doomed, "default") == "default"
        assert cache.set(doomed, "x") is None
        assert cache.add(doomed, "x") is False
        assert cache.delete(doomed) is False
        assert cache.touch(doomed) is False
        assert cache.has_key(doomed) is False
        assert cache.get_many([doomed, safe]) == {safe: "kept"}
        assert cache.set_many({doomed: 1, safe: 2}) == [doomed]
        assert cache.delete_many([doomed, safe]) is None
    assert cache.get(safe) is None  # the reachable part of delete_many happened
    assert "Ignored memcached failure" in caplog.text  # repeats are summarized, not logged
    assert cache.metrics()[dying.address]["ignored"] == 11
    for call in (cache.incr, cache.decr):  # as for a missing key (Django's fail-open answer)
        with pytest.raises(ValueError, match="not found"):
            call(doomed)
    assert cache.metrics()[dying.address]["ignored"] == 13


def test_fail_open_is_the_default(two_nodes):
    """Without IGNORE_EXCEPTIONS in OPTIONS a dead node's keys miss, as with Django's own
    memcached backends once their client has dropped the node: a page keeps working.
    Rate limiters built on add + incr get add() False and incr() ValueError."""
    alive, dying = two_nodes
    cache = MemcachedCache([node.address for node in two_nodes],
                           {"OPTIONS": {"RETRY_TIMEOUT": RETRY + 0.0007}})
    doomed, safe = key_on(cache, dying), key_on(cache, alive)
    cache.set_many({doomed: 1, safe: "kept"})
    dying.kill()
    for _ in range(3):  # failures, then the node is down: the same answers
        assert cache.get(doomed, "default") == "default"
        assert cache.add(doomed, 1) is False
        with pytest.raises(ValueError):
            cache.incr(doomed)
        assert cache.get_many([doomed, safe]) == {safe: "kept"}
    assert cache.metrics()[dying.address]["down"] is True


def test_without_failover_a_down_nodes_keys_miss_and_nothing_is_copied(two_nodes):
    alive, dying = two_nodes
    cache = build(two_nodes, IGNORE_EXCEPTIONS=True)
    doomed = key_on(cache, dying)
    dying.kill()
    for _ in range(3):
        cache.set(doomed, "written while down")
    raw = Client(("127.0.0.1", alive.port))
    assert raw.get(f":1:{doomed}") is None  # no copy on the surviving node
    raw.close()


def test_failover_moves_keys_to_the_next_choice_and_back(two_nodes, signals):
    alive, dying = two_nodes
    cache = build(two_nodes, FAILOVER=True)
    doomed = key_on(cache, dying)
    dying.kill()
    for _ in range(2):
        with pytest.raises(NodeError):
            cache.get(doomed)  # failures before the threshold still raise
    cache.set(doomed, "on the fallback")
    assert cache.get(doomed) == "on the fallback"
    assert cache.get_many([doomed]) == {doomed: "on the fallback"}
    raw = Client(("127.0.0.1", alive.port))
    assert raw.get(f":1:{doomed}") is not None  # it really lives on the other node
    raw.close()

    dying.start()
    wait_for_retry()
    assert cache.get(doomed) is None  # back on its own (empty) node
    assert signals == [("down", dying.address), ("up", dying.address)]


def test_failover_with_every_node_down_raises(memcached_node_factory):
    only = memcached_node_factory()
    cache = build([only], FAILOVER=True)
    only.kill()
    for _ in range(2):
        with pytest.raises(NodeError):
            cache.set("key", 1)
    with pytest.raises(NodeDown):
        cache.get("key")


@pytest.fixture
def silent_server():
    """Accepts connections (the kernel completes them) and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_node_that_never_answers_times_out_then_is_skipped(silent_server, memcached_node_factory):
    alive = memcached_node_factory()
    cache = MemcachedCache(
        [alive.address, silent_server],
        {"OPTIONS": {"IO_TIMEOUT": 0.2, "RETRY_TIMEOUT": 30, "FAILURE_THRESHOLD": 2,
                     "IGNORE_EXCEPTIONS": False}},
    )
    silent_key = key_on(cache, type("N", (), {"address": silent_server})())
    for _ in range(2):
        started = time.monotonic()
        with pytest.raises(NodeError, match="did not answer within IO_TIMEOUT"):
            cache.get(silent_key)
        assert time.monotonic() - started < 5  # bounded by IO_TIMEOUT, not forever
    with pytest.raises(NodeDown):
        cache.get_many([silent_key])
    metrics = cache.metrics()[silent_server]
    assert metrics["timeouts"] == 2 and metrics["down"] is True


def test_restarted_node_costs_no_error(memcached_node_factory):
    node = memcached_node_factory()
    cache = build([node])
    cache.set_many({"a": 1, "b": 2})
    assert cache._nodes[0].pool.idle  # a pooled connection, about to go stale
    node.restart()
    assert cache.get_many(["a", "b"]) == {}  # batch path: replaced, no error
    cache.set("a", 3)
    node.restart()
    assert cache.get("a") is None  # single-key path: the same
    cache.set("a", 4)
    assert cache.get_many(["a", "b"]) == {"a": 4}
    assert cache.metrics()[node.address]["errors"] == 0


def test_health_allows_one_probe_per_retry_period(signals):
    health = NodeHealth("test:1", threshold=2, retry_timeout=0.2)
    assert health.may_try()
    health.failed("refused")
    assert health.may_try() and not health.down
    health.failed("refused")
    assert health.down and not health.may_try()
    time.sleep(0.25)
    assert health.may_try()  # the probe
    assert not health.may_try()  # everyone else keeps waiting for it
    health.succeeded()
    assert not health.down and health.may_try() and health.failures == 0
    assert signals == [("down", "test:1"), ("up", "test:1")]


# --- writes a node missed are not served stale when it returns ----------------------------


@pytest.fixture
def paused(two_nodes):
    """Stop one node with SIGSTOP (it keeps its data: a partition, not a crash)."""
    _, node = two_nodes
    yield node, lambda: pause(node)  # returns once the process is really stopped
    resume(node)


@pytest.mark.parametrize("ignore", [False, True], ids=["raised", "logged"])
def test_a_hung_node_did_not_answer_within_io_timeout_naming_the_node_and_the_cache(
        two_nodes, paused, caplog, ignore):
    """A SIGSTOPped node: the kernel's timeout surfaces as BlockingIOError (EAGAIN), which
    the message said as if it were the cause ("timed out (BlockingIOError: [Errno 11]
    Resource temporarily unavailable)"), naming no cache."""
    from django.core.cache import caches
    from django.test import override_settings

    node, stop = paused
    configured = {"pages": {"BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
                            "LOCATION": [n.address for n in two_nodes],
                            "OPTIONS": {"IO_TIMEOUT": 0.2, "FAILURE_THRESHOLD": 100,
                                        "IGNORE_EXCEPTIONS": ignore}}}
    wanted = (f"memcached node {node.address} of CACHES['pages']: did not answer within "
              "IO_TIMEOUT (0.2 s)")
    with override_settings(CACHES=configured):
        cache = caches["pages"]
        key = key_on(cache, node)
        stop()
        with caplog.at_level(logging.WARNING, logger="django_kvcache.backends.memcached"):
            if ignore:
                assert cache.get(key, "missed") == "missed"
            else:
                with pytest.raises(NodeError) as raised:
                    cache.get(key)
    if ignore:
        (line,) = [r.getMessage() for r in caplog.records if "Ignored" in r.getMessage()]
        assert line.startswith(f"Ignored memcached failure on node {node.address} of "
                               "CACHES['pages']: NodeError: did not answer within IO_TIMEOUT "
                               "(0.2 s) ")
    else:
        assert str(raised.value) == wanted
    assert "Errno" not in caplog.text and "BlockingIOError" not in caplog.text


def keys_on(cache, node, count):
    return [key_on(cache, node, prefix=f"k{i}") for i in range(count)]


def test_writes_missed_during_a_partition_are_deleted_before_the_node_serves(two_nodes, paused):
    node, stop = paused
    cache = build(two_nodes, IGNORE_EXCEPTIONS=True, IO_TIMEOUT=0.2)
    written, kept, deleted, many = keys_on(cache, node, 4)
    cache.set_many({written: "v1", kept: "kept", deleted: "v1", many: "v1"})
    stop()
    cache.set(written, "v2")  # times out: maybe stored, maybe not
    cache.delete(deleted)  # the node is down now: skipped
    cache.set_many({many: "v2"})
    assert cache.metrics()[node.address]["outdated_keys"] == 3
    resume(node)
    wait_for_retry()
    assert cache.get(written, "miss") in ("miss", "v2")  # the last write, or nothing
    assert cache.get_many([kept, deleted, many]) == {kept: "kept"}  # only outdated keys go
    assert cache.metrics()[node.address]["outdated_keys"] == 0


def test_a_stale_copy_whose_delete_was_missed_is_deleted_before_the_node_serves(
    two_nodes, paused, caplog
):
    """A delete that times out under fail-open leaves get_or_set's stale copy as it leaves
    the entry: both are remembered as outdated and deleted when the node answers again,
    so the deleted value is never served stale."""
    node, stop = paused
    options = {"IGNORE_EXCEPTIONS": True, "IO_TIMEOUT": 0.2, "LEASE_TIMEOUT": 2,
               "STALE_TIMEOUT": 30}
    cache = build(two_nodes, **options)
    key = key_on(cache, node)
    assert cache.get_or_set(key, "deleted", timeout=60) == "deleted"
    stop()
    with caplog.at_level(logging.WARNING, logger="django_kvcache.backends.memcached"):
        assert cache.delete(key) is False  # timed out: logged, not raised
    assert "did not answer within IO_TIMEOUT" in caplog.text
    assert cache.metrics()[node.address]["outdated_keys"] == 2  # the entry and its copy
    resume(node)
    wait_for_retry()
    waiter = build(two_nodes, **options)
    assert while_recomputed(cache, key, lambda: waiter.get_or_set(key, "no", 60)) == "recomputed"
    assert cache.metrics()[node.address]["outdated_keys"] == 0


def test_a_stale_copy_on_another_node_whose_delete_was_missed_is_deleted_there_later(
    two_nodes, paused, caplog
):
    """On nodes without meta commands the stale copy is a key of its own, here on another
    node than its entry: the entry's delete succeeds, the copy's times out (fail-open:
    logged), and the copy is remembered as outdated on its node, deleted when it answers
    again."""
    from tests.test_memcached_meta_lease import ClassicOnlyProxy

    node, stop = paused
    proxies = []
    for each in two_nodes:
        host, port = each.address.rsplit(":", 1)
        proxies.append(ClassicOnlyProxy(host, int(port)))
    try:
        fronts = [SimpleNamespace(address=f"127.0.0.1:{proxy.port}") for proxy in proxies]
        paused_at = fronts[two_nodes.index(node)].address
        cache = build(fronts, IGNORE_EXCEPTIONS=True, IO_TIMEOUT=0.2, LEASE_TIMEOUT=2,
                      STALE_TIMEOUT=30)
        key = next(
            f"k{i}" for i in range(1000)
            if cache._home(cache.make_and_validate_key(f"k{i}")).name != paused_at
            and cache._home(cache.make_and_validate_key(stampede.side_key("stale", f"k{i}"))
                            ).name == paused_at
        )
        assert cache.get_or_set(key, "deleted", timeout=60) == "deleted"
        stop()
        with caplog.at_level(logging.WARNING, logger="django_kvcache.backends.memcached"):
            assert cache.delete(key) is True  # the entry is gone; its copy's delete timed out
        assert "did not answer within IO_TIMEOUT" in caplog.text
        assert cache.metrics()[paused_at]["outdated_keys"] == 1  # the copy
        resume(node)
        wait_for_retry()
        assert while_recomputed(cache, key, lambda: cache.get_or_set(key, "no", 60)) == "recomputed"
        assert cache.metrics()[paused_at]["outdated_keys"] == 0
    finally:
        for proxy in proxies:
            proxy.stop()


def test_too_many_missed_writes_flush_the_node(two_nodes, paused, monkeypatch):
    from django_kvcache import outdated

    monkeypatch.setattr(outdated, "LIMIT", 3)
    node, stop = paused
    cache = build(two_nodes, IGNORE_EXCEPTIONS=True, IO_TIMEOUT=0.2)
    untouched, *written = keys_on(cache, node, 6)
    cache.set_many(dict.fromkeys([untouched, *written], "v1"))
    stop()
    for key in written:
        cache.set(key, "v2")
    resume(node)
    wait_for_retry()
    assert cache.get_many([untouched, *written]) == {}  # flushed: even the untouched key


def test_a_node_that_missed_clear_is_flushed_when_it_returns(two_nodes, paused):
    node, stop = paused
    cache = build(two_nodes, IGNORE_EXCEPTIONS=True, IO_TIMEOUT=0.2)
    key = key_on(cache, node)
    cache.set(key, "before clear")
    stop()
    for _ in range(2):
        cache.get(key)  # time out twice: the node is down, clear() will not reach it
    cache.clear()
    resume(node)
    wait_for_retry()
    assert cache.get(key) is None
