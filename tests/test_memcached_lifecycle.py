"""The life of a pooled connection (issue 9): handed over without stranding a waiter,
ended exactly once whatever a signal receiver raises, counted once per call on the node
that served it, and — after a write timed out — settled before the node's clean-up, so a
late write cannot land after it."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator

import pytest

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import NodeError, PoolExhausted, aio, wire
from django_kvcache.memcached.wire import ErrorReply
from django_kvcache.memcached.pool import ConnectionSettings, NodePool
from django_kvcache.memcached.routing import parse_location
from django_kvcache.memcached.stale import OutdatedCopies
from django_kvcache.signals import node_down
from tests.test_faults_memcached import api  # noqa: F401 (a fixture: each API in turn)


def build(addresses: list[str], **options: Any) -> MemcachedCache:
    # Health is process-wide per (node, FAILURE_THRESHOLD, RETRY_TIMEOUT): a RETRY_TIMEOUT a
    # hair different per cache keeps a reused port from inheriting an earlier test's state.
    options = {"RETRY_TIMEOUT": 30 + (time.monotonic() % 1) / 1000,
               "IGNORE_EXCEPTIONS": False, **options}
    return MemcachedCache(addresses, {"OPTIONS": options})


def key_on(cache: MemcachedCache, address: str, prefix: str = "key") -> str:
    for i in range(1000):
        if cache._home(cache.make_key(f"{prefix}-{i}")).name == address:
            return f"{prefix}-{i}"
    raise AssertionError("no key found for the node")


def assert_no_connection_checked_out(cache: MemcachedCache, styled: Any = None) -> None:
    """Every pool idle: the blocking ones, and the loop's when ``styled`` is an AsyncAPI."""
    for node in cache._nodes:
        assert node.pool.size == len(node.pool.idle), node.name
        assert not node.pool.line, node.name
    loop = getattr(styled, "loop", None)
    if loop is None:
        return

    async def the_loop_s_pools() -> list[Any]:
        return [aio.pool_of(node) for node in cache._nodes]

    for pool in loop.run_until_complete(the_loop_s_pools()):
        assert pool.size == len(pool.idle) and not pool.line


# --- the pool hands a returned connection to a thread that just queued ------------------------


class IdleList(list):
    """A pool's idle list that runs ``before_append`` once, inside the next ``append``."""

    def __init__(self, before_append: Callable[[], None]) -> None:
        super().__init__()
        self.before_append: Callable[[], None] | None = before_append

    def append(self, client: Any) -> None:
        hook, self.before_append = self.before_append, None
        if hook is not None:
            hook()
        super().append(client)


class WaitQueue(deque):
    """A pool's wait queue that tells when a thread has joined it."""

    def __init__(self) -> None:
        super().__init__()
        self.joined = threading.Event()

    def append(self, waiter: Any) -> None:
        super().append(waiter)
        self.joined.set()


def single_slot_pool(
    memcached_node_factory: Callable[[], Any]
) -> tuple[NodePool, Any, threading.Thread, list[Any]]:
    """A pool of one connection, checked out (``held``), and a thread, not yet started,
    that will wait for it: what it got (a connection or PoolExhausted) goes in the list."""
    address = parse_location(memcached_node_factory().address)[0]
    pool = NodePool(address, ConnectionSettings(max_size=1, pool_timeout=2.0))
    held = pool.checkout()
    outcome: list[Any] = []

    def take() -> None:
        try:
            outcome.append(pool.checkout())
        except PoolExhausted as exc:
            outcome.append(exc)

    return pool, held, threading.Thread(target=take), outcome


def test_a_thread_queueing_while_a_connection_is_checked_in_gets_it(memcached_node_factory):
    """The interleaving that stranded a waiter: the returning thread has looked at the
    (empty) queue, then a thread finds no idle connection and queues, then the connection
    is appended to ``idle``. The waiter must get it, not PoolExhausted after POOL_TIMEOUT."""
    pool, held, waiter, outcome = single_slot_pool(memcached_node_factory)
    pool.line.waiters = WaitQueue()

    def a_thread_queues() -> None:
        waiter.start()
        assert pool.line.waiters.joined.wait(5), "the waiter never queued"

    pool.idle = IdleList(a_thread_queues)
    started = time.monotonic()
    pool.checkin(held)
    waiter.join(10)
    assert outcome == [held]
    assert time.monotonic() - started < 1.0  # handed over, not found after a timeout
    assert pool.size == 1 and not pool.line and not pool.idle


# --- signal receivers cannot leak connections or escape IGNORE_EXCEPTIONS --------------------


@pytest.fixture
def down_receiver() -> Iterator[list[BaseException]]:
    """A node_down receiver that raises the exception the test puts in the list."""
    raising: list[BaseException] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        raise raising[0]

    node_down.connect(receiver)
    yield raising
    node_down.disconnect(receiver)


OPERATIONS: dict[str, Callable[[MemcachedCache, str, str], Any]] = {
    "get": lambda cache, dead, alive: cache.get(dead, "fallback"),
    "set": lambda cache, dead, alive: cache.set(dead, 1),
    "get_many": lambda cache, dead, alive: cache.get_many([alive, dead]),
    "set_many": lambda cache, dead, alive: cache.set_many({alive: 1, dead: 2}),
}
FALLBACKS = {"get": "fallback", "set": None, "get_many": {}, "set_many": None}


@pytest.mark.parametrize("name", OPERATIONS)
def test_a_raising_node_down_receiver_is_logged_and_the_call_falls_back(
    name, memcached_node_factory, down_receiver, caplog
):
    alive, dead = memcached_node_factory(), memcached_node_factory()
    cache = build([alive.address, dead.address], FAILURE_THRESHOLD=1, IGNORE_EXCEPTIONS=True)
    dead_key, alive_key = key_on(cache, dead.address), key_on(cache, alive.address)
    cache.set(alive_key, "there")
    dead.kill()
    down_receiver.append(RuntimeError("receiver bug"))
    with caplog.at_level(logging.ERROR, logger="django_kvcache"):
        result = OPERATIONS[name](cache, dead_key, alive_key)
    if name == "get_many":
        assert result == {alive_key: "there"}
    elif name == "set_many":
        assert result == [dead_key]
    else:
        assert result == FALLBACKS[name]
    assert cache.cluster.by_name[dead.address].health.down
    errors = [r for r in caplog.records if r.name == "django_kvcache.health"
              and r.levelno == logging.ERROR and "node_down receiver" in r.getMessage()]
    assert len(errors) == 1 and "receiver bug" in errors[0].getMessage()
    assert_no_connection_checked_out(cache)
    assert cache.get(alive_key) in ("there", 1)  # the live node's pool still works


def test_a_keyboard_interrupt_mid_fan_out_leaks_no_connection(
    memcached_node_factory, down_receiver
):
    alive, dead = memcached_node_factory(), memcached_node_factory()
    cache = build([alive.address, dead.address], FAILURE_THRESHOLD=1)
    dead_key, alive_key = key_on(cache, dead.address), key_on(cache, alive.address)
    cache.set(alive_key, "there")
    dead.kill()
    down_receiver.append(KeyboardInterrupt())
    # The live node's request is sent first; the dead node's failure interrupts the call.
    with pytest.raises(KeyboardInterrupt):
        cache.get_many([alive_key, dead_key])
    assert_no_connection_checked_out(cache)
    assert cache.get(alive_key) == "there"
    assert_no_connection_checked_out(cache)


def test_a_keyboard_interrupt_in_a_single_key_call_leaks_no_connection(
    memcached_node_factory, down_receiver
):
    dead = memcached_node_factory()
    cache = build([dead.address], FAILURE_THRESHOLD=1)
    dead.kill()
    down_receiver.append(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        cache.set("key", 1)
    assert_no_connection_checked_out(cache)


# --- counters: once per call, on the node that served it ------------------------------------


def test_a_call_retried_on_a_new_connection_counts_once(memcached_node_factory):
    node = memcached_node_factory()
    cache = build([node.address])
    stats = cache._nodes[0]
    cache.set_many({"a": 1, "b": 2, "c": 3})
    for call, ops in [
        (lambda: cache.get("a"), 1),
        (lambda: cache.set("a", 4), 1),
        (lambda: cache.get_many(["a", "b", "c"]), 3),
        (lambda: cache.set_many({"a": 5, "b": 6}), 2),
    ]:
        node.restart()  # the pooled connection is now stale: the call is retried
        connects, before = stats.pool.connects, stats.ops
        call()
        assert stats.pool.connects == connects + 1  # really replaced and sent again
        assert stats.ops - before == ops
    assert stats.errors == 0


def test_a_failover_write_credits_its_bytes_to_the_node_that_served_it(memcached_node_factory):
    alive, dying = memcached_node_factory(), memcached_node_factory()
    cache = build([alive.address, dying.address], FAILOVER=True, FAILURE_THRESHOLD=1)
    key = key_on(cache, dying.address)
    dying.kill()
    with pytest.raises(NodeError):
        cache.get(key)  # the node is down now: its keys go to the other node
    before = cache.metrics()
    cache.set(key, os.urandom(3000))
    after = cache.metrics()
    assert after[alive.address]["bytes_sent"] - before[alive.address]["bytes_sent"] > 3000
    assert after[alive.address]["ops"] == before[alive.address]["ops"] + 1
    assert after[dying.address]["bytes_sent"] == before[dying.address]["bytes_sent"]
    assert cache.get(key) is not None


# --- a write that timed out lands before the clean-up, never after -----------------------------


class Link:
    """One proxied connection; what the client sends waits behind ``gate``."""

    def __init__(self, client: socket.socket, upstream: socket.socket, open_: bool) -> None:
        self.client = client
        self.upstream = upstream
        self.gate = threading.Event()
        if open_:
            self.gate.set()
        self.carrying = False  # something sent while the gate was closed waits behind it
        self.answered = threading.Event()  # the server replied to something sent here
        self.forwarded = 0  # bytes passed on to the server

    def start(self) -> None:
        for pump in (self.forward, self.backward):
            threading.Thread(target=pump, daemon=True).start()

    def forward(self) -> None:
        try:
            while chunk := self.client.recv(65536):
                self.carrying = self.carrying or not self.gate.is_set()
                self.gate.wait()
                self.upstream.sendall(chunk)
                self.forwarded += len(chunk)
            self.gate.wait()
            self.upstream.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def backward(self) -> None:
        try:
            while chunk := self.upstream.recv(65536):
                self.answered.set()
                self.client.sendall(chunk)
        except OSError:  # the client is gone: its replies go nowhere
            pass

    def close(self) -> None:
        self.gate.set()
        for sock in (self.client, self.upstream):
            sock.close()


def accepted(listener: socket.socket) -> Iterator[socket.socket]:
    """Each client ``listener`` accepts, until it is closed."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        yield client


class DelayingProxy:
    """A TCP proxy to memcached whose links can be held: what clients send while held is
    delivered when released, ``delay`` seconds late — the unlucky order a paused server
    may process its socket buffers in when it resumes."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.links: list[Link] = []
        self.holding = False
        self.timers: list[threading.Timer] = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        for client in accepted(self.listener):
            link = Link(client, socket.create_connection(self.upstream), not self.holding)
            self.links.append(link)  # before it carries anything: ``hold`` must see it
            link.start()

    def hold(self) -> None:
        self.holding = True
        for link in self.links:
            link.gate.clear()

    def release(self, delay: float) -> list[Link]:
        """New links flow at once, held ones after ``delay``. Returns those that carry
        something sent while held."""
        self.holding = False
        held = [link for link in self.links if not link.gate.is_set()]
        for link in held:
            link.answered.clear()
            timer = threading.Timer(delay, link.gate.set)
            self.timers.append(timer)
            timer.start()
        return [link for link in held if link.carrying]

    def close(self) -> None:
        for timer in self.timers:
            timer.cancel()
        self.listener.close()
        for link in self.links:
            link.close()


@pytest.fixture
def proxy(memcached_node_factory) -> Iterator[DelayingProxy]:
    proxy = DelayingProxy(memcached_node_factory().address)
    yield proxy
    proxy.close()


IO_TIMEOUT = 0.5
LATE_BY = 0.2  # under IO_TIMEOUT: settling waits for the late write, it does not time out


@pytest.mark.parametrize("single_key", [True, False], ids=["set", "set_many"])
@pytest.mark.parametrize("after_resume", ["read", "write"])
def test_a_timed_out_write_lands_before_the_clean_up(proxy, single_key, after_resume, api):
    built = build([proxy.address], IO_TIMEOUT=IO_TIMEOUT, IGNORE_EXCEPTIONS=True,
                  FAILURE_THRESHOLD=100)
    cache = api(built)
    cache.set("key", "before")  # a pooled connection through the proxy
    proxy.hold()
    started = time.monotonic()
    if single_key:
        cache.set("key", "late")  # times out: ignored, and maybe applied later
    else:
        assert cache.set_many({"key": "late"}) == ["key"]
    assert time.monotonic() - started < IO_TIMEOUT + 1.0
    assert cache.metrics()[proxy.address]["outdated_keys"] == 1

    held = proxy.release(LATE_BY)
    assert held, "the write was not held by the proxy"
    if after_resume == "write":
        cache.set("key", "newest")  # the last write: nothing older may overwrite it
        expected = "newest"
    else:
        assert cache.get("key", "miss") in ("miss", "late")
        expected = "miss"  # cleaned up after the late write landed
    for link in held:  # the late write has been applied by now (its reply came back)
        assert link.answered.wait(5), "the held write never reached the server"
    assert cache.get("key", "miss") == expected
    metrics = cache.metrics()[proxy.address]
    assert metrics["late_writes"] == 0 and metrics["outdated_keys"] == 0
    assert_no_connection_checked_out(built, cache)


def test_a_node_still_paused_fails_the_request_and_keeps_the_clean_up(proxy, api):
    built = build([proxy.address], IO_TIMEOUT=0.2, FAILURE_THRESHOLD=100)
    cache = api(built)
    cache.set("key", "before")
    proxy.hold()
    with pytest.raises(NodeError, match="timed out"):
        cache.set("key", "late")
    with pytest.raises(NodeError, match="timed out"):
        cache.get("key")  # settling waits for the held fence: the node still sleeps
    metrics = cache.metrics()[proxy.address]
    assert metrics["late_writes"] == 1 and metrics["outdated_keys"] == 1
    assert metrics["timeouts"] == 2
    for link in proxy.release(0):
        assert link.answered.wait(5)
    assert cache.get("key", "miss") == "miss"  # settled, then cleaned up
    metrics = cache.metrics()[proxy.address]
    assert metrics["late_writes"] == 0 and metrics["outdated_keys"] == 0
    assert_no_connection_checked_out(built, cache)


def test_a_write_whose_send_timed_out_is_settled_with_its_unsent_rest(proxy, api):
    """A value larger than the socket buffers: the send itself times out, part of the
    request still unsent. Settling sends exactly that rest, so the server reads whole
    commands and answers the fence."""
    built = build([proxy.address], IO_TIMEOUT=0.3, FAILURE_THRESHOLD=100,
                  IGNORE_EXCEPTIONS=True, COMPRESSOR=None)
    cache = api(built)
    cache.set("key", "before")
    proxy.hold()
    big = os.urandom(8 * 1024 * 1024)
    cache.set("key", big)
    node = built._nodes[0]
    assert node.unsettled.connections and node.unsettled.connections[0].unsent, "the whole value was sent"
    held = proxy.release(0)
    cache.set("other", "after")  # settles (the big value lands), cleans up, then writes
    for link in held:
        assert link.answered.wait(5)
    assert cache.get_many(["key", "other"]) == {"other": "after"}
    assert cache.metrics()[proxy.address]["late_writes"] == 0


def test_our_single_key_writes_answer_like_pymemcache(memcached_node_factory):
    """set/add/touch/delete/incr on our own connection give pymemcache ``Client``'s answers."""
    address = parse_location(memcached_node_factory().address)[0]
    client = NodePool(address, ConnectionSettings()).checkout()
    try:
        assert client.round_trip(wire.store(b"add", b"k", b"1", 0, 0)) is True
        assert client.round_trip(wire.store(b"add", b"k", b"2", 0, 0)) is False
        assert client.round_trip(wire.store(b"set", b"k", b"41", 0, 0)) is True
        assert client.round_trip(wire.incr(b"k", 1)) == 42
        assert client.round_trip(wire.incr(b"absent", 1)) is None
        assert client.round_trip(wire.touch(b"k", 100)) is True
        assert client.round_trip(wire.touch(b"absent", 100)) is False
        assert client.round_trip(wire.delete(b"k")) is True
        assert client.round_trip(wire.delete(b"k")) is False
        client.round_trip(wire.store(b"set", b"text", b"x", 0, 0))
        with pytest.raises(ErrorReply) as refused:
            client.round_trip(wire.incr(b"text", 1))
        assert refused.value.client_error
        with pytest.raises(ErrorReply) as refused:  # over memcached's 1 MB item size
            client.round_trip(wire.store(b"set", b"huge", b"x" * 2_000_000, 0, 0))
        assert not refused.value.client_error
        assert client.round_trip(wire.get_one(b"text")) == (b"x", 0)  # still in step
    finally:
        client.close()


# --- found by review: close_idle, the clean-up window, callers queueing behind a settle -----


def test_closing_idle_connections_hands_the_freed_slot_to_a_waiter(memcached_node_factory):
    """close_idle runs (a stale connection, disconnect_all) just after a checkin put its
    connection back and before it looked at the queue: the closed connection's slot must
    go to the waiting thread, not vanish while it sleeps to POOL_TIMEOUT."""
    pool, held, waiter, outcome = single_slot_pool(memcached_node_factory)
    pool.line.waiters = WaitQueue()
    waiter.start()
    assert pool.line.waiters.joined.wait(5)

    class ClosingQueue(WaitQueue):
        fired = False

        def __len__(self) -> int:  # checkin's look at the line, after its append
            if not ClosingQueue.fired:
                ClosingQueue.fired = True
                pool.close_idle()
            return super().__len__()

    queued = ClosingQueue()
    queued.extend(pool.line.waiters)
    pool.line.waiters = queued
    started = time.monotonic()
    pool.checkin(held)
    waiter.join(10)
    assert len(outcome) == 1 and not isinstance(outcome[0], PoolExhausted), outcome
    assert time.monotonic() - started < 1.0
    assert pool.size == 1  # the waiter's new connection, counted once


def test_no_thread_reads_an_outdated_copy_while_another_cleans_it_up(memcached_node_factory):
    node_address = memcached_node_factory().address
    cache = build([node_address], MAX_POOL_SIZE=2, POOL_TIMEOUT=0.2, IGNORE_EXCEPTIONS=True)
    node = cache._nodes[0]
    cache.set("k", "old")
    held = [node.pool.checkout(), node.pool.checkout()]
    cache.set("k", "new")  # PoolExhausted, ignored: "old" stays on the node, outdated
    for connection in held:
        node.pool.checkin(connection)
    assert node.outdated.pending
    seen: dict[str, Any] = {}
    real_op = OutdatedCopies.op

    def op(keys, flush):
        # Thread A has taken the keys and not sent the deletes: B reads now.
        reader = threading.Thread(target=lambda: seen.setdefault("B", cache.get("k", "miss")))
        reader.start()
        reader.join(0.5)
        seen["B answered during the clean-up"] = not reader.is_alive()
        seen["thread"] = reader
        return real_op(keys, flush)

    OutdatedCopies.op = staticmethod(op)
    try:
        cache.get("another-key")  # thread A: clean-up first
    finally:
        OutdatedCopies.op = staticmethod(real_op)
    seen["thread"].join(5)
    assert seen["B answered during the clean-up"] is False  # it waited for the clean-up
    assert seen["B"] == "miss"  # and never saw "old"


def test_callers_queued_behind_a_timed_out_settle_fail_at_once(proxy):
    """A paused node with a late write: every caller must not wait its own IO_TIMEOUT in
    turn behind the one settling (the k-th waited k timeouts)."""
    cache = build([proxy.address], IO_TIMEOUT=0.3, FAILURE_THRESHOLD=100)
    cache.set("key", "before")
    proxy.hold()
    with pytest.raises(NodeError, match="timed out"):
        cache.set("key", "late")
    waited: list[float] = []

    def read() -> None:
        started = time.monotonic()
        with pytest.raises(NodeError):
            cache.get("key")
        waited.append(time.monotonic() - started)

    readers = [threading.Thread(target=read) for _ in range(6)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(10)
    assert len(waited) == 6
    assert max(waited) < 1.0, sorted(waited)  # one IO_TIMEOUT and a margin, not 6 x 0.3
    for link in proxy.release(0):
        assert link.answered.wait(5)
    assert cache.get("key", "miss") == "miss"  # settled and cleaned up once it answers
