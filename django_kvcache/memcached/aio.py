"""The asyncio driver's byte mover: :mod:`wire` requests and replies on event-loop
connections, no thread.

Per event loop and per node, a small pool of connections (:class:`AsyncPool`, at most
MAX_POOL_SIZE, waiting at most POOL_TIMEOUT). A pool belongs to the loop that made it
and is used from that loop's thread; a process running several loops (``async_to_sync``
in threads, several servers) has one pool per loop. When the loop shuts down
(``asyncio.run``, asgiref and uvicorn call ``loop.shutdown_asyncgens()``), its pools
close their connections (:mod:`django_kvcache.loops`).

Nothing here decides anything: what to send, which deadline applies and what a failure
or a cancellation does to a connection and its node are the exchange's
(:mod:`django_kvcache.memcached.exchange`), the same for this driver and the blocking
one. An :class:`AsyncConnection` sends and reads by a deadline given to it; a write cut
short is settled on its raw socket by the same byte moving as the blocking driver's
(``connection.UnsettledSocket``), waiting for the socket on the loop (:func:`wait_ready`).
"""
from __future__ import annotations

import asyncio
import os
import select
import socket
import time
import weakref
from collections import deque
from typing import Any, Sequence

from django_kvcache.loops import PerLoop
from django_kvcache.memcached import PoolExhausted, wire
from django_kvcache.memcached.connection import (
    ConnectionClosed,
    ConnectTimeout,
    ConnectionSettings,
    UnsettledSocket,
    deadline_after,
    set_io_timeout,
)
from django_kvcache.memcached.pool import exhausted
from django_kvcache.memcached.routing import NodeAddress
from django_kvcache.pool import FIGURES, LoopPool


class _Stream(asyncio.Protocol):
    """The bytes of one connection: received into a ``wire.Buffer``; a waiting reply is
    parsed as data arrives and its future resolved when complete."""

    def __init__(self) -> None:
        self.buffer = wire.Buffer()
        self.transport: asyncio.Transport | None = None
        self.loop: Any = None  # the loop it runs on, once connected
        self.reply: Any = None
        self.waiter: asyncio.Future | None = None
        self.drained: asyncio.Future | None = None
        self.lost: BaseException | None = None
        self.received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        self.buffer.feed(data)
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        try:
            complete = self.reply.parse(self.buffer)
        except Exception as exc:  # a garbled reply: the waiting call fails with it
            waiter.set_exception(exc)
            return
        if complete:
            waiter.set_result(None)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or ConnectionClosed("the server closed the connection")
        for future in (self.waiter, self.drained):
            if future is not None and not future.done():
                future.set_exception(ConnectionClosed(str(self.lost)))

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError("the time allowed passed"))


def _timer(future: asyncio.Future, deadline: float | None) -> asyncio.TimerHandle | None:
    """Fail ``future`` with TimeoutError at ``deadline`` (a ``time.monotonic`` time)."""
    if deadline is None:
        return None
    delay = deadline - time.monotonic()
    return asyncio.get_running_loop().call_later(max(delay, 0.0), _expire, future)


class Deadlines:
    """One loop's reply waits, each failed with TimeoutError at its deadline, on one
    timer for all of them instead of a timer each (made, pushed on the loop's heap,
    cancelled, popped: a fifth of a get's CPU).

    Waits come in the order of their deadlines (now + IO_TIMEOUT) — a wait whose deadline
    is earlier than the last one queued (another IO_TIMEOUT on the same loop) gets a timer
    of its own. Answered waits leave from the front as new ones come and when the timer
    fires; the timer is set for the oldest unanswered wait, or set again earlier for a
    wait that comes after the ones it was set for were answered and have left."""

    __slots__ = ("waits", "timer", "at")

    def __init__(self) -> None:
        self.waits: deque[tuple[asyncio.Future, float]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.at = 0.0  # the timer's deadline

    def add(self, future: asyncio.Future, deadline: float) -> asyncio.TimerHandle | None:
        """Fail ``future`` at ``deadline`` (a ``time.monotonic`` time) unless it is done
        by then; a timer of its own (to cancel) when it comes out of order, else None."""
        waits = self.waits
        while waits and waits[0][0].done():
            waits.popleft()
        if waits and deadline < waits[-1][1]:
            return _timer(future, deadline)
        waits.append((future, deadline))
        if self.timer is None or deadline < self.at:  # none, or set for waits gone since
            if self.timer is not None:
                self.timer.cancel()
            self._set(deadline)
        return None

    def _set(self, deadline: float) -> None:
        self.timer, self.at = _timer_call(deadline, self._expire), deadline

    def _expire(self) -> None:
        """Fail the waits whose time is up; set the timer again for the next one."""
        self.timer = None
        waits = self.waits
        now = time.monotonic()
        while waits:
            future, deadline = waits[0]
            if future.done():
                waits.popleft()
            elif deadline > now:
                self._set(deadline)
                return
            else:
                waits.popleft()
                _expire(future)


def _timer_call(deadline: float, callback: Any) -> asyncio.TimerHandle:
    return asyncio.get_running_loop().call_later(max(deadline - time.monotonic(), 0.0),
                                                 callback)


class AsyncConnection:
    """One asyncio connection to one node, opened on first use. One request at a time.
    ``deadlines``: its loop's (:class:`Deadlines`)."""

    __slots__ = ("address", "settings", "stream", "sock", "request", "deadlines")

    def __init__(self, address: NodeAddress, settings: ConnectionSettings,
                 deadlines: Deadlines | None = None) -> None:
        self.address = address
        self.settings = settings
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        self.stream: _Stream | None = None
        self.sock: Any = None  # set once connected (the exchange reads it: reused or new)
        self.request = b""  # the last request written: its unsent tail is in the transport

    @property
    def received(self) -> int:
        return self.stream.received if self.stream is not None else 0

    async def connect(self) -> _Stream:
        if self.stream is not None:
            return self.stream
        loop = asyncio.get_running_loop()
        address, tls = self.address, self.settings.tls
        if address.path is not None:
            opening = loop.create_unix_connection(
                _Stream, address.path, ssl=tls, server_hostname="" if tls else None
            )
        else:
            host, port = address.server  # type: ignore[misc]
            opening = loop.create_connection(_Stream, host, port, ssl=tls)
        try:
            _, stream = await asyncio.wait_for(opening, self.settings.connect_timeout)
        except asyncio.TimeoutError as exc:  # said as what it is, as the blocking driver does
            raise ConnectTimeout(self.settings.connect_timeout) from exc
        self.stream, self.sock = stream, stream.transport.get_extra_info("socket")
        return stream

    async def transfer(self, request: bytes, reply: Any, deadline: float | None) -> None:
        """Send ``request`` and wait until ``reply`` parses, both by ``deadline``
        (:meth:`send` then :meth:`receive`, in one coroutine: the hot path)."""
        stream = self.stream or await self.connect()
        if stream.lost is not None:
            raise ConnectionClosed(str(stream.lost))
        self.request = request
        stream.transport.write(request)  # type: ignore[union-attr]
        if stream.drained is not None:  # the kernel's buffer is full: wait for room
            await self._wait(stream.drained, deadline)
        buffer = stream.buffer
        # Bytes come in only while this coroutine waits (data_received runs on the loop),
        # so the reply is parsed here only if some did (while it waited for room).
        if buffer.pos < len(buffer.data) and reply.parse(buffer):  # already here
            return
        timer = self._expect(stream, reply, deadline)
        try:
            await stream.waiter  # type: ignore[misc]
        finally:
            stream.reply = stream.waiter = None
            if timer is not None:
                timer.cancel()

    async def send(self, request: bytes, deadline: float | None) -> None:
        """Hand ``request`` to the transport, waiting (by ``deadline``) only while the
        kernel's buffer is full. What never left stays in the transport (``detach``)."""
        stream = self.stream or await self.connect()
        if stream.lost is not None:
            raise ConnectionClosed(str(stream.lost))
        self.request = request
        stream.transport.write(request)  # type: ignore[union-attr]
        if stream.drained is not None:  # the kernel's buffer is full: wait for room
            await self._wait(stream.drained, deadline)

    async def receive(self, reply: Any, deadline: float | None) -> None:
        """Wait until ``reply`` is complete (parsed as data arrives), by ``deadline``."""
        stream = self.stream
        assert stream is not None
        if reply.parse(stream.buffer):  # already here
            return
        timer = self._expect(stream, reply, deadline)
        try:
            await stream.waiter  # type: ignore[misc]
        finally:
            stream.reply = stream.waiter = None
            if timer is not None:
                timer.cancel()

    def _expect(self, stream: _Stream, reply: Any, deadline: float | None) -> Any:
        """``reply`` is awaited: ``stream.waiter``, resolved as data arrives, failed at
        ``deadline`` by the loop's :class:`Deadlines` (or a timer it returns, to cancel)."""
        if stream.lost is not None:
            raise ConnectionClosed(str(stream.lost))
        waiter = stream.waiter = stream.loop.create_future()
        stream.reply = reply
        return None if deadline is None else self.deadlines.add(waiter, deadline)

    @staticmethod
    async def _wait(future: asyncio.Future, deadline: float | None) -> None:
        timer = _timer(future, deadline)
        try:
            await future
        finally:
            if timer is not None:
                timer.cancel()

    async def round_trip(self, op: wire.Op) -> Any:
        """``op`` alone, within IO_TIMEOUT: what it makes of the reply (no failure
        handling: for tests; calls go through the exchange)."""
        reply = op.make_reply()
        await self.transfer(op.request, reply, deadline_after(self.settings.io_timeout))
        return op.result(reply)

    def detach(self) -> UnsettledSocket | None:
        """Hand the connection over to be settled (a write cut short): a blocking
        duplicate of its socket, with what the transport never sent and what it
        received. TLS state cannot be handed over: None (the caller closes it)."""
        stream = self.stream
        if stream is None or stream.transport is None or self.sock is None:
            return None
        if self.settings.tls is not None:
            return None
        unsent_size = stream.transport.get_write_buffer_size()
        unsent = memoryview(self.request)[len(self.request) - unsent_size:]
        sock = socket.socket(fileno=os.dup(self.sock.fileno()))
        set_io_timeout(sock, self.settings.io_timeout, kernel=True)
        buffer = stream.buffer
        self.close()  # drops the transport's buffer (it is ``unsent``); ``sock`` keeps the line
        return UnsettledSocket(sock, unsent, buffer)

    def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is None or stream.transport is None:
            return
        try:
            stream.transport.abort()  # never waits: a failed server may not read anything
        except RuntimeError:  # its loop was closed (without shutting down): hang up at
            if self.sock is not None:  # least; the socket object closes when collected
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # the peer had already reset it
                    pass


async def wait_ready(sock: socket.socket, events: int, deadline: float | None) -> None:
    """Wait on the running loop until ``sock`` is ready for ``events`` (``select``'s
    ``POLLIN`` or ``POLLOUT``), by ``deadline``: how this driver waits while it settles
    a write cut short (``connection.UnsettledSocket``)."""
    loop = asyncio.get_running_loop()
    if events == select.POLLIN:
        add, remove = loop.add_reader, loop.remove_reader
    else:
        add, remove = loop.add_writer, loop.remove_writer
    ready = loop.create_future()
    add(sock, lambda: ready.done() or ready.set_result(None))
    timer = _timer(ready, deadline)
    try:
        await ready
    finally:
        remove(sock)
        if timer is not None:
            timer.cancel()


class AsyncPool(LoopPool[AsyncConnection]):
    """One loop's connections to one node, with the blocking pool's interface
    (``try_checkout``, ``checkout``, ``checkin``, ``discard``, ``free_slot``,
    ``close_idle``): the exchange uses either the same way. A connection is opened
    lazily, by its first exchange."""

    def __init__(self, address: NodeAddress, settings: ConnectionSettings,
                 deadlines: Deadlines | None = None) -> None:
        super().__init__(settings.max_size, settings.pool_timeout)
        self.address = address
        self.settings = settings
        self.deadlines = deadlines if deadlines is not None else Deadlines()

    def open(self) -> AsyncConnection:
        return AsyncConnection(self.address, self.settings, self.deadlines)

    def exhausted(self) -> PoolExhausted:
        return exhausted(self.address, self.settings)


class LoopState:
    """What one event loop keeps per node — its pools, and the gets waiting to go out
    together (``autobatch``) — closed by the loop's ``shutdown_asyncgens``."""

    def __init__(self) -> None:
        self.pools: dict[Any, AsyncPool] = {}
        self.gets: dict[Any, Any] = {}
        self.deadlines = Deadlines()

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close_idle()


#: Each loop's state (:class:`~django_kvcache.loops.PerLoop`, as the MySQL driver's pools).
_loops: PerLoop[LoopState] = PerLoop(LoopState, LoopState.close)


def loop_state() -> LoopState:
    """The running loop's state, made (and registered to close with it) on first use."""
    return _loops.get()


def pool_of(node: Any) -> AsyncPool:
    """The running loop's pool for ``node`` (a ``memcached.node.Node``: its blocking
    ``pool`` gives the address and settings), made on first use. Call it on the loop.

    Every request asks, so the node remembers the last loop's pool (``loop_pool``: weak
    references to the loop and its pool, one attribute that another thread's loop may
    replace whole; weak, so that a loop closed without shutting down is collected) and
    the loop's state is looked up only when another loop asks."""
    loop = asyncio.get_running_loop()
    last = node.loop_pool
    if last is not None and last[0]() is loop:
        pool = last[1]()
        if pool is not None:
            return pool
    state = loop_state()
    pool = state.pools.get(node)
    if pool is None:
        pool = state.pools[node] = AsyncPool(node.pool.address, node.pool.settings,
                                             state.deadlines)
    node.loop_pool = (weakref.ref(loop), weakref.ref(pool))
    return pool


def pool_figures(node: Any) -> dict[str, float]:
    """The asyncio pools' figures for ``node``, summed over the process's open event
    loops (a loop's figures leave with it). Read from any thread: each figure is one read
    of a loop's own counters (monitoring, not exact)."""
    pools = [p for p in (state.pools.get(node) for state in _loops.every()) if p is not None]
    figures: dict[str, float] = {"async_loops": len(pools)}
    figures.update((f"async_pool_{name}", 0) for name in FIGURES)
    for pool in pools:
        for name, value in pool.figures().items():
            figures[f"async_pool_{name}"] += value
    return figures


def close_pools(nodes: Sequence[Any]) -> None:
    """Close the running loop's idle connections to ``nodes``."""
    state = _loops.existing()
    if state is not None:
        for node in nodes:
            pool = state.pools.get(node)
            if pool is not None:
                pool.close_idle()
