"""The exchange loop's rules, run on both I/O styles by the same tests (issue 24).

One state machine (``django_kvcache.memcached.exchange``) decides what is sent, which
deadline applies and what an error reply, a failure, a timeout or a cancellation does to
the connection and the node; the blocking and asyncio drivers only move bytes. Every test
here is parametrized over the two styles (``api``): the blocking API, and the native
async API on an event loop of the test's own. Real memcached servers throughout; a
scripted socket server or a proxy only where a fault is simulated.
"""
from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterator

import pytest
from pymemcache.client.base import Client

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import NodeError, Refused, wire
from tests.contract import AsyncAPI
from tests.test_memcached_lifecycle import DelayingProxy, accepted

#: Short enough for a test to wait for, long enough for a busy 2-core machine to answer.
IO_TIMEOUT = 0.5
MARGIN = 1.0


class Style:
    """How a test drives its cache and its nodes: blocking, or on an event loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop() if name == "async" else None

    def cache(self, cache: MemcachedCache) -> Any:
        return cache if self.loop is None else AsyncAPI(cache, self.loop)

    def call(self, node: Any, op: wire.Op) -> Any:
        """``op`` on ``node`` through the exchange loop, in this style."""
        if self.loop is None:
            return node.call(op)
        return self.loop.run_until_complete(node.acall(op))

    def pool(self, node: Any) -> Any:
        """The pool this style's calls use on ``node``."""
        if self.loop is None:
            return node.pool
        from django_kvcache.memcached import aio

        async def current() -> Any:
            return aio.pool_of(node)

        return self.loop.run_until_complete(current())

    def close(self) -> None:
        if self.loop is not None:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()


@pytest.fixture(params=["sync", "async"])
def api(request) -> Iterator[Style]:
    style = Style(request.param)
    yield style
    style.close()


def build(locations: list[str], **options: Any) -> MemcachedCache:
    # Health is process-wide per (node, FAILURE_THRESHOLD, RETRY_TIMEOUT): a retry time a
    # hair different per cache keeps a reused port from inheriting an earlier test's state.
    options = {
        "IGNORE_EXCEPTIONS": False,
        "IO_TIMEOUT": IO_TIMEOUT,
        "RETRY_TIMEOUT": 30 + (time.monotonic() % 1) / 1000,
        **options,
    }
    return MemcachedCache(locations, {"OPTIONS": options})


def raw(address: str) -> Client:
    host, port = address.rsplit(":", 1)
    return Client((host, int(port)), default_noreply=False)


# --- an error reply to a command that carried a data block ------------------------------


def test_an_error_reply_to_a_data_command_closes_the_connection(memcached_node_factory, api):
    """memcached answers ``CLIENT_ERROR bad command line format`` to a ``set`` whose
    exptime it cannot read, *without reading the data block*: the value's bytes are then
    read as commands, and their replies follow. The op says the connection is out of
    step, so it is closed: no later request reads those replies as its own. (The cache
    never sends such a line: timeouts are clamped, see test_memcached_ops.)"""
    node_address = memcached_node_factory().address
    cache = build([node_address])
    node = cache._nodes[0]
    injected = b"a\r\nset victim 0 0 2\r\nhi\r\n"  # replies: ERROR, STORED
    with pytest.raises(Refused, match="bad command line format"):
        api.call(node, wire.store(b"set", b"k", injected, 0, 2**63))
    pool = api.pool(node)
    assert pool.size == len(pool.idle) == 0  # closed, not checked in
    assert api.call(node, wire.get_one(b"k")) is None  # not "ERROR", the set's leftovers
    assert api.call(node, wire.store(b"add", b"k", b"v", 0, 0)) is True
    assert pool.connects == 2
    assert cache.metrics()[node_address]["errors"] == 0  # refused: the node is fine


def test_a_refused_value_in_a_pipeline_keeps_every_other_answer(memcached_node_factory, api):
    """A pipelined set whose middle value is too large: each key gets its own answer,
    and the connection (out of step after an error reply to a data command) is closed."""
    node_address = memcached_node_factory().address
    cache = build([node_address], COMPRESSOR=None)
    node = cache._nodes[0]
    items = [(b"a", b"1", 0), (b"b", b"x" * (2 << 20), 0), (b"c", b"3", 0)]
    lines = api.call(node, wire.store_many(items, 0))
    assert lines[0] == lines[2] == b"STORED" and lines[1].startswith(b"SERVER_ERROR")
    pool = api.pool(node)
    assert pool.size == len(pool.idle) == 0
    assert api.call(node, wire.get_many([b"a", b"b", b"c"])) == {b"a": (b"1", 0), b"c": (b"3", 0)}


# --- a restart: stale pooled connections are not node failures -----------------------------


def warm_connections(cache: MemcachedCache, style: Style, count: int) -> None:
    """Leave ``count`` idle connections in the style's pool (writes: never batched)."""
    if style.loop is None:
        pool = cache._nodes[0].pool
        held = [pool.checkout() for _ in range(count)]
        for client in held:
            client.connect()
        for client in held:
            pool.checkin(client)
        return

    async def concurrently() -> None:
        await asyncio.gather(*(cache.aset(f"warm-{i}", i) for i in range(count)))

    style.loop.run_until_complete(concurrently())


@pytest.mark.parametrize("operation", ["incr", "get", "set", "get_many", "delete"])
def test_a_restart_costs_no_error_whatever_the_first_command(
    memcached_node_factory, api, operation
):
    """Every pooled connection is stale after a restart. Each is found closed before it
    answered anything: not a node failure, for any command — ``incr`` included — and the
    other idle ones are dropped with it, so two calls never mark a healthy node down."""
    node = memcached_node_factory()
    cache = build([node.address], FAILURE_THRESHOLD=2, MAX_POOL_SIZE=8)
    cache.set("n", 1)
    warm_connections(cache, api, 4)
    node.restart()
    styled = api.cache(cache)
    for _ in range(2):
        if operation == "incr":
            with pytest.raises(ValueError):  # missing after the restart, not NodeError
                styled.incr("n")
        elif operation == "get":
            assert styled.get("n") is None
        elif operation == "set":
            styled.set("n", 2)
        elif operation == "get_many":
            styled.get_many(["n", "m"])
        else:
            styled.delete("n")
    metrics = cache.metrics()[node.address]
    assert metrics["errors"] == 0 and metrics["down"] is False


def test_a_connection_refused_on_a_new_connection_is_a_node_failure(memcached_node_factory, api):
    """The retry is for connections that went stale in the pool; a fresh connection that
    fails is the node's failure."""
    node = memcached_node_factory()
    cache = build([node.address], FAILURE_THRESHOLD=5)
    node.kill()
    with pytest.raises(NodeError):
        api.cache(cache).incr("n")
    assert cache.metrics()[node.address]["errors"] == 1


# --- replies we cannot read --------------------------------------------------------------


class ScriptedServer:
    """A socket server that answers each request line with ``answer(line)`` (bytes, or
    None for nothing), sent ``trickle`` bytes at a time with ``pause`` seconds between
    pieces: a fault only (garbled or trickling replies), never a stand-in for memcached."""

    def __init__(self, answer: Callable[[bytes], bytes | None], trickle: int = 0,
                 pause: float = 0.0) -> None:
        self.answer = answer
        self.trickle = trickle
        self.pause = pause
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        for client in accepted(self.listener):
            self.sockets.append(client)
            threading.Thread(target=self.serve, args=(client,), daemon=True).start()

    def serve(self, client: socket.socket) -> None:
        pending = b""
        try:
            while chunk := client.recv(65536):
                pending += chunk
                while b"\r\n" in pending:
                    line, pending = pending.split(b"\r\n", 1)
                    reply = self.answer(line)
                    if reply:
                        self.send(client, reply)
        except OSError:
            pass

    def send(self, client: socket.socket, reply: bytes) -> None:
        if not self.trickle:
            client.sendall(reply)
            return
        for start in range(0, len(reply), self.trickle):
            client.sendall(reply[start : start + self.trickle])
            time.sleep(self.pause)

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


GARBLED = {
    b"get": b"VALUE k x 1\r\nv\r\nEND\r\n",  # flags not a number
    b"mg": b"VA 1 t5\r\nv\r\n",  # no f flag (mg v f asked for it)
    b"stats": b"STAT pid\r\nEND\r\n",  # a STAT line without a value
}


@pytest.fixture
def garbling_server() -> Iterator[ScriptedServer]:
    def answer(line: bytes) -> bytes | None:
        return GARBLED.get(line.split(b" ", 1)[0], b"ERROR\r\n")

    server = ScriptedServer(answer)
    yield server
    server.close()


@pytest.mark.parametrize("ignore_exceptions", [False, True])
def test_a_garbled_reply_is_a_node_failure(garbling_server, api, ignore_exceptions):
    """A reply the parser cannot read (a number that is not one, a flag missing) fails
    like a node: counted, closed, and under IGNORE_EXCEPTIONS a miss — never a bare
    ValueError or KeyError that bypasses both."""
    cache = build([garbling_server.address], FAILURE_THRESHOLD=100,
                  IGNORE_EXCEPTIONS=ignore_exceptions)
    node = cache._nodes[0]
    styled = api.cache(cache)
    if ignore_exceptions:
        assert styled.get("k", "default") == "default"
    else:
        with pytest.raises(NodeError, match="ProtocolError"):
            styled.get("k")
    for op in (wire.meta_get(b"k"), wire.stats()):
        with pytest.raises(NodeError, match="ProtocolError"):
            api.call(node, op)
    assert cache.metrics()[garbling_server.address]["errors"] == 3
    pool = api.pool(node)
    assert pool.size == len(pool.idle) == 0  # each garbled connection was closed


@pytest.fixture
def wrong_key_server() -> Iterator[ScriptedServer]:
    """Answers every get with a value for a key that was not asked (a server or proxy
    out of step, or one whose replies are crossed)."""

    def answer(line: bytes) -> bytes | None:
        if not line.startswith(b"get "):
            return b"ERROR\r\n"
        return b"VALUE :1:intruder 0 5\r\nwrong\r\nEND\r\n"

    server = ScriptedServer(answer)
    yield server
    server.close()


@pytest.mark.parametrize("autobatch", [True, False])
@pytest.mark.parametrize("ignore_exceptions", [False, True])
def test_a_value_for_a_key_not_asked_is_a_protocol_error(
    wrong_key_server, api, ignore_exceptions, autobatch
):
    """A reply that does not match its request is no answer to it: never the value of
    the key asked (``get``), never a ``KeyError`` out of ``get_many`` — whatever
    IGNORE_EXCEPTIONS says. The connection is closed and the call fails as the node's
    failure (a miss under IGNORE_EXCEPTIONS)."""
    cache = build([wrong_key_server.address], FAILURE_THRESHOLD=100,
                  IGNORE_EXCEPTIONS=ignore_exceptions, AUTOBATCH=autobatch)
    styled = api.cache(cache)
    if ignore_exceptions:
        assert styled.get("k", "default") == "default"
        assert styled.get_many(["a", "b"]) == {}
    else:
        with pytest.raises(NodeError, match="not asked"):
            styled.get("k")
        with pytest.raises(NodeError, match="not asked"):
            styled.get_many(["a", "b"])
    metrics = cache.metrics()[wrong_key_server.address]
    assert metrics["errors"] == 2
    pool = api.pool(cache._nodes[0])
    assert pool.size == len(pool.idle) == 0  # each crossed connection was closed


# --- deadlines ---------------------------------------------------------------------------


@pytest.fixture
def trickling_server() -> Iterator[ScriptedServer]:
    """Answers every get with a 2 KB value, 20 bytes every 0.1 s: each piece comes well
    within IO_TIMEOUT, the whole reply takes 10 s."""
    value = b"x" * 2000

    def answer(line: bytes) -> bytes | None:
        if not line.startswith(b"get "):
            return b"ERROR\r\n"
        keys = line.split(b" ")[1:]
        return b"".join(b"VALUE %b 0 %d\r\n%b\r\n" % (key, len(value), value)
                        for key in keys) + b"END\r\n"

    server = ScriptedServer(answer, trickle=20, pause=0.1)
    yield server
    server.close()


@pytest.mark.parametrize("many", [False, True], ids=["get", "get_many"])
def test_a_trickling_node_is_bounded_by_one_io_timeout(trickling_server, api, many):
    """IO_TIMEOUT bounds the wait for a whole reply, counted from when the request went
    out, not each piece of it: a node that trickles its reply cannot stretch a call."""
    cache = build([trickling_server.address], FAILURE_THRESHOLD=100)
    styled = api.cache(cache)
    started = time.monotonic()
    with pytest.raises(NodeError, match="timed out"):
        styled.get_many(["a", "b"]) if many else styled.get("a")
    assert time.monotonic() - started < IO_TIMEOUT + MARGIN


# --- a cancelled write is settled before the node is used again ----------------------------


class Cancelled(BaseException):
    """What a signal handler raises into a blocking call: the sync form of cancellation."""


def cancel_after(style: Style, seconds: float, call: Callable[[], Any]) -> None:
    """Run ``call`` (a cache call in ``style``) and cancel it after ``seconds``: on the
    loop with ``asyncio.wait_for``, blocking with a signal whose handler raises."""
    if style.loop is not None:
        async def cancelled() -> None:
            await asyncio.wait_for(call(), seconds)

        with pytest.raises(asyncio.TimeoutError):
            style.loop.run_until_complete(cancelled())
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise Cancelled()

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with pytest.raises(Cancelled):
            call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def cancel_once(style: Style, happened: Callable[[], bool], call: Callable[[], Any]) -> None:
    """Run ``call`` (a cache call in ``style``) and cancel it as soon as ``happened()``
    (asked every millisecond): on the loop by cancelling its task, blocking with a signal
    whose handler raises. Not after a fixed time: a loaded machine may not have run the
    call that far by then."""
    if style.loop is not None:
        async def cancelled() -> None:
            task = asyncio.ensure_future(call())
            while not (happened() or task.done()):
                await asyncio.sleep(0.001)
            task.cancel()
            await task

        with pytest.raises(asyncio.CancelledError):
            style.loop.run_until_complete(cancelled())
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise Cancelled()

    caller, done = threading.get_ident(), threading.Event()

    def watch() -> None:
        while not done.wait(0.001):
            if happened():
                signal.pthread_kill(caller, signal.SIGALRM)
                return

    previous = signal.signal(signal.SIGALRM, interrupt)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(Cancelled):
            call()
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def proxy(memcached_node_factory) -> Iterator[DelayingProxy]:
    proxy = DelayingProxy(memcached_node_factory().address)
    yield proxy
    proxy.close()


def test_a_cancelled_write_lands_before_a_later_write(proxy, api):
    """The write's bytes are in the server's buffers when it is cancelled; delivered late
    they must not overwrite the write that follows. As after a timeout, the connection is
    settled (its reply read after a fence) before the node serves the next request."""
    cache = build([proxy.address], IO_TIMEOUT=2.0, FAILURE_THRESHOLD=100)
    node = cache._nodes[0]
    cache.set("key", "first")
    proxy.hold()
    if api.loop is None:
        cancel_after(api, 0.2, lambda: cache.set("key", "old"))
    else:
        cancel_after(api, 0.2, lambda: cache.aset("key", "old"))
    kept_to_settle = node.unsettled.pending  # like a timed-out write's connection
    held = proxy.release(0.3)  # "old" reaches the server 0.3 s from now
    assert held, "the write was not held by the proxy"
    api.cache(cache).set("key", "new")  # settles "old" first, then writes
    for link in held:
        assert link.answered.wait(5)
    assert api.cache(cache).get("key") == "new"
    assert kept_to_settle and not node.unsettled.pending
    assert cache.metrics()[proxy.address]["errors"] == 0  # cancelled: not the node's fault


def test_a_cancelled_settle_never_sends_the_same_bytes_twice(proxy, api):
    """A late write is settled (its unsent rest, then a fence) before the node serves
    again. If that settling is itself cancelled after sending part of the rest, the part
    sent must not go out a second time: memcached would read those bytes — the tail of a
    value — as commands. The value here is made of ``set victim`` commands."""
    cache = build([proxy.address], IO_TIMEOUT=0.3, FAILURE_THRESHOLD=100,
                  IGNORE_EXCEPTIONS=True, COMPRESSOR=None)
    node = cache._nodes[0]
    cache.set("key", "before")
    proxy.hold()
    commands = b"\r\nset victim 0 0 1\r\nV\r\n" * (16 * 1024 * 1024 // 24)
    cache.set("key", commands)  # the send times out, most of it unsent
    (late,) = node.unsettled.connections
    unsent = bytes(late.unsent)
    assert unsent, "the whole value was sent"
    forwarded = sum(link.forwarded for link in proxy.links)
    deadline = time.monotonic() + 30
    for link in proxy.links:  # let some of it through (room in the socket buffers), then hold
        link.gate.set()
    while sum(link.forwarded for link in proxy.links) < forwarded + 1024 * 1024:
        assert time.monotonic() < deadline, "the proxy passed on nothing in 30 s"
        time.sleep(0.001)
    for link in proxy.links:
        link.gate.clear()
    # The settle sends some of the rest, and is cancelled once it has.
    sent_some = lambda: len(late.unsent) < len(unsent)  # noqa: E731
    if api.loop is None:
        cancel_once(api, sent_some, lambda: cache.get("other"))
    else:
        cancel_once(api, sent_some, lambda: cache.aget("other"))
    (late,) = node.unsettled.connections
    assert len(late.unsent) < len(unsent)  # what the cancelled settle sent is not sent again
    held = proxy.release(0)
    assert api.cache(cache).get("other") is None  # settled: the rest, then the fence
    for link in held:
        assert link.answered.wait(5)
    assert not node.unsettled.pending
    client = raw(proxy.upstream[0] + ":" + str(proxy.upstream[1]))
    try:
        assert client.get("victim") is None  # no byte of the value ran as a command
    finally:
        client.close()


# --- waiting for a node's repair: never forever, never for itself -----------------------------


def cut_short_then_repairing(
    cache: MemcachedCache, proxy: DelayingProxy, how: str
) -> Callable[[], Any]:
    """On the running loop: an ``aset`` cut short while the proxy holds its bytes —
    ``"timed out"`` (IO_TIMEOUT: the key is outdated too) or ``"cancelled"`` (an ASGI
    disconnect) — whose connection is kept to settle; then an ``aget`` that repairs the
    node: it settles that write and waits for its fence's reply, which the proxy holds
    too. Returns the repairing task once it holds the node's repair."""

    async def start() -> Any:
        proxy.hold()
        if how == "cancelled":
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(cache.aset("key", "cut short"), 0.2)
        else:
            with pytest.raises(NodeError, match="timed out"):
                await cache.aset("key", "cut short")
        assert cache._nodes[0].unsettled.pending
        repairing = asyncio.ensure_future(cache.aget("other", "missing"))
        await asyncio.sleep(0.2)  # sent the rest and the fence; awaits the fence's reply
        assert not repairing.done()
        return repairing

    return start


def on_a_thread_of_its_own(scenario: Callable[[], Any], seconds: float) -> dict[str, Any]:
    """``scenario()`` (a coroutine) on a loop in a daemon thread; fails if it does not
    end within ``seconds`` (a hung thread is left behind, harmless)."""
    outcome: dict[str, Any] = {}

    def main() -> None:
        try:
            outcome["value"] = asyncio.run(scenario())
        except BaseException as exc:  # shown by the assertion below
            outcome["error"] = exc

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call never returned"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.parametrize("how", ["timed out", "cancelled"])
@pytest.mark.parametrize("ignore_exceptions", [True, False])
def test_a_sync_call_on_the_loop_thread_never_waits_for_a_coroutine_repairing_the_node(
    proxy, ignore_exceptions, how
):
    """A coroutine repairs a node (it settles a write that timed out, or that an ASGI
    disconnect cut short) and waits for the node's answer; a sync call on the loop's own
    thread (a ``{% cache %}`` tag in an async view) needs the same node. Waiting for the
    repair would wait for a coroutine that cannot run until the call returns: the thread,
    and every request on the loop, would hang for good. Going round the repair would let
    its request overtake the write being settled. The call fails at once instead, as the
    node's unavailability (a miss under IGNORE_EXCEPTIONS), and the node is not blamed."""
    cache = build([proxy.address], IO_TIMEOUT=1.0, FAILURE_THRESHOLD=100)
    cache.set("key", "first")
    start = cut_short_then_repairing(cache, proxy, how)
    # Another instance of the same cache (the same nodes): only IGNORE_EXCEPTIONS differs.
    calling = MemcachedCache([proxy.address], {"OPTIONS": {
        **cache.options, "IGNORE_EXCEPTIONS": ignore_exceptions}})
    assert calling._nodes[0] is cache._nodes[0]

    async def scenario() -> tuple[Any, float, Any]:
        repairing = await start()
        began = time.monotonic()
        try:
            answer = calling.get("key", "default")  # blocking, on the loop's thread
        except NodeError as exc:
            answer = exc
        waited = time.monotonic() - began
        proxy.release(0)
        return answer, waited, await repairing

    answer, waited, repaired = on_a_thread_of_its_own(scenario, 10)
    if ignore_exceptions:
        assert answer == "default"
    else:
        assert isinstance(answer, NodeError) and "coroutine" in str(answer), answer
    assert waited < 0.2
    assert repaired == "missing"  # the repair went on, and its own call with it
    # Settled, then (timed out: the key is outdated) cleaned up.
    assert cache.get("key") == ("cut short" if how == "cancelled" else None)
    assert cache.metrics()[proxy.address]["errors"] == (how == "timed out")


def test_a_thread_waits_for_a_coroutine_repairing_the_node_at_most_an_io_timeout(proxy):
    """A thread whose node is being repaired by a coroutine waits for it — but the loop
    may be busy (blocked by a long sync call), so the coroutine cannot go on: the thread
    waits at most IO_TIMEOUT, not as long as the loop is blocked."""
    cache = build([proxy.address], IO_TIMEOUT=IO_TIMEOUT, FAILURE_THRESHOLD=100)
    cache.set("key", "first")
    start = cut_short_then_repairing(cache, proxy, "timed out")
    holding = threading.Event()
    waited: list[float] = []

    def thread_call() -> None:
        holding.wait(10)
        began = time.monotonic()
        with pytest.raises(NodeError, match="timed out"):
            cache.get("key")
        waited.append(time.monotonic() - began)

    caller = threading.Thread(target=thread_call, daemon=True)
    caller.start()

    async def scenario() -> Any:
        repairing = await start()
        holding.set()
        time.sleep(3)  # the loop is blocked: the repairing coroutine cannot go on
        proxy.release(0)
        try:
            return await repairing
        except NodeError:  # its settle timed out meanwhile (the loop ran late)
            return None

    on_a_thread_of_its_own(scenario, 15)
    caller.join(10)
    assert waited and waited[0] < IO_TIMEOUT + MARGIN
