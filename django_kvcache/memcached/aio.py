"""The asyncio transport: :mod:`wire` ops on event-loop connections, no thread.

Per event loop and per node, a small pool of connections (:class:`AsyncPool`, at most
MAX_POOL_SIZE, waiting at most POOL_TIMEOUT). A pool belongs to the loop that made it
and is only touched from that loop's thread, so it needs no lock; a process running
several loops (``async_to_sync`` in threads, several servers) has one pool per loop.
When the loop shuts down (``asyncio.run``, asgiref and uvicorn call
``loop.shutdown_asyncgens()``), its pools close their connections.

What is shared with the blocking path is everything above the socket: the node's health,
counters, outdated copies and late writes, the ``Lease`` that decides what becomes of a
connection and translates errors (``Node.call`` and ``Node.acall`` differ only in
awaiting), ``fanout``'s batches, and the operations' plans. With AUTOBATCH, each loop
also keeps per node the gets waiting to share a request (``autobatch``).
"""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

from django_kvcache.memcached import PoolExhausted, wire
from django_kvcache.memcached.autobatch import Gets
from django_kvcache.memcached.connection import ConnectionClosed, WriteTimeout, set_io_timeout
from django_kvcache.memcached.pool import ConnectionSettings
from django_kvcache.memcached.routing import NodeAddress

if TYPE_CHECKING:
    from django_kvcache.memcached.node import Node


class _Stream(asyncio.Protocol):
    """The bytes of one connection: received into a ``wire.Buffer``; a waiting reply is
    parsed as data arrives and its future resolved when complete."""

    def __init__(self) -> None:
        self.buffer = wire.Buffer()
        self.transport: asyncio.Transport | None = None
        self.reply: Any = None
        self.waiter: asyncio.Future | None = None
        self.drained: asyncio.Future | None = None
        self.lost: BaseException | None = None
        self.received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

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
        future.set_exception(TimeoutError("IO_TIMEOUT passed"))


class AsyncConnection:
    """One asyncio connection to one node, opened on first use. One request at a time."""

    __slots__ = ("address", "settings", "stream", "sock", "request")

    def __init__(self, address: NodeAddress, settings: ConnectionSettings) -> None:
        self.address = address
        self.settings = settings
        self.stream: _Stream | None = None
        self.sock: Any = None  # set once connected (``Lease`` reads it: reused or new)
        self.request = b""

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
        _, stream = await asyncio.wait_for(opening, self.settings.connect_timeout)
        self.stream, self.sock = stream, stream.transport.get_extra_info("socket")
        return stream

    async def exchange(self, op: wire.Op) -> Any:
        reply = op.make_reply()
        await self.send(op.request, op.writes)
        await self.read(reply, op.writes)
        return op.result(reply)

    async def send(self, request: bytes, writes: bool) -> None:
        stream = self.stream or await self.connect()
        if stream.lost is not None:
            raise ConnectionClosed(str(stream.lost))
        self.request = request
        stream.transport.write(request)  # type: ignore[union-attr]
        if stream.drained is not None:  # the kernel's buffer is full: wait for room
            await self._wait(stream.drained, writes)

    async def read(self, reply: Any, writes: bool = False, since: float | None = None) -> None:
        """Wait until ``reply`` is complete, at most IO_TIMEOUT (counted from ``since``,
        a loop time, when given: the replies of a fan-out share one wait)."""
        stream = self.stream
        assert stream is not None
        if reply.parse(stream.buffer):  # already here
            return
        if stream.lost is not None:
            raise ConnectionClosed(str(stream.lost))
        stream.reply, stream.waiter = reply, asyncio.get_running_loop().create_future()
        try:
            await self._wait(stream.waiter, writes, since)
        finally:
            stream.reply = stream.waiter = None

    async def _wait(self, future: asyncio.Future, writes: bool, since: float | None = None) -> None:
        timeout = self.settings.io_timeout
        timer = None
        if timeout is not None:
            loop = asyncio.get_running_loop()
            timer = loop.call_at((loop.time() if since is None else since) + timeout,
                                 _expire, future)
        try:
            await future
        except TimeoutError:
            if writes:
                raise self._late_write() from None
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _late_write(self) -> BaseException:
        """A write timed out: hand its socket over (a blocking duplicate) with what never
        left, so the node settles it like a blocking one. TLS state cannot be handed
        over: that connection is closed, a plain timeout."""
        stream = self.stream
        transport = stream.transport  # type: ignore[union-attr]
        unsent_size = transport.get_write_buffer_size()
        if self.settings.tls is not None or self.sock is None:
            return TimeoutError("IO_TIMEOUT passed on a write")
        sock = socket.socket(fileno=os.dup(self.sock.fileno()))
        set_io_timeout(sock, self.settings.io_timeout, kernel=True)
        unsent = self.request[len(self.request) - unsent_size :] if unsent_size else b""
        self.close()  # drops the transport's buffer (it is ``unsent``); ``sock`` keeps the line
        return WriteTimeout(sock, unsent)

    def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None and stream.transport is not None:
            stream.transport.abort()  # never waits: a failed server may not read anything


class AsyncPool:
    """One loop's connections to one node: the blocking pool's interface (``checkin``,
    ``discard``, ``free_slot``, ``close_idle``) for the shared ``Lease``."""

    def __init__(self, address: NodeAddress, settings: ConnectionSettings) -> None:
        self.address = address
        self.settings = settings
        self.idle: list[AsyncConnection] = []
        self.waiters: deque[asyncio.Future] = deque()
        self.size = 0
        self.waits = 0
        self.connects = 0

    def try_checkout(self) -> AsyncConnection | None:
        """A connection if one is free or may be opened now; None instead of waiting."""
        if self.idle and not self.waiters:
            return self.idle.pop()
        if self.size < self.settings.max_size:
            self.size += 1
            return self._new()
        return None

    async def checkout(self) -> AsyncConnection:
        """A connection, waiting at most POOL_TIMEOUT for one.

        The waiter's future decides between a hand-over and the timeout: whichever comes
        first sets it (no ``asyncio.wait_for``, which from Python 3.12 may raise
        TimeoutError after the future got its connection). A caller cancelled after a
        connection was handed over gives it on.
        """
        connection = self.try_checkout()
        if connection is not None:
            return connection
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self.waiters.append(waiter)
        self.waits += 1
        timer = loop.call_later(self.settings.pool_timeout, _expire, waiter)
        try:
            handed = await waiter
        except TimeoutError:  # set by the timer: nothing was handed over
            raise PoolExhausted(
                self.address.name,
                f"all {self.settings.max_size} connections busy for "
                f"{self.settings.pool_timeout} s (MAX_POOL_SIZE, POOL_TIMEOUT)",
            ) from None
        except BaseException:  # cancelled just as a connection was handed over: give it on
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()
                self.free_slot() if handed is None else self.checkin(handed)
            raise
        finally:
            timer.cancel()
            if waiter in self.waiters:
                self.waiters.remove(waiter)
        return handed if handed is not None else self._new()

    def checkin(self, connection: AsyncConnection) -> None:
        if not self._hand_over(connection):
            self.idle.append(connection)

    def discard(self, connection: AsyncConnection) -> None:
        connection.close()
        self.free_slot()

    def free_slot(self) -> None:
        if not self._hand_over(None):  # None: the waiter opens a connection of its own
            self.size -= 1

    def close_idle(self) -> None:
        idle, self.idle = self.idle, []
        self.size -= len(idle)
        for connection in idle:
            connection.close()

    def _hand_over(self, connection: AsyncConnection | None) -> bool:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return True
        return False

    def _new(self) -> AsyncConnection:
        self.connects += 1
        return AsyncConnection(self.address, self.settings)


class _LoopPools:
    """The pools (and autobatched gets) of one event loop, closed by the loop's
    ``shutdown_asyncgens``."""

    def __init__(self) -> None:
        self.pools: dict[Node, AsyncPool] = {}
        self.gets: dict[Node, Gets] = {}
        self.guard: AsyncIterator[None] | None = None

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close_idle()


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPools] = (
    weakref.WeakKeyDictionary()
)
_loops_lock = threading.Lock()


async def _closed_with_the_loop(loop: asyncio.AbstractEventLoop, pools: _LoopPools):
    """An async generator the loop finalizes at shutdown: then the pools close."""
    try:
        yield
    finally:
        pools.close()
        with _loops_lock:
            _loops.pop(loop, None)


def pool_of(node: Node) -> AsyncPool:
    """The running loop's pool for ``node``, made on first use (call it on the loop)."""
    loop = asyncio.get_running_loop()
    pools = _loops.get(loop)
    if pools is None:
        pools = _pools_of(loop)
    pool = pools.pools.get(node)
    if pool is None:
        pool = pools.pools[node] = AsyncPool(node.pool.address, node.pool.settings)
    return pool


def batch_for(node: Node) -> Gets | None:
    """With AUTOBATCH, the running loop's batch of gets for ``node`` to join — when this
    loop already has gets waiting or a connection busy on the node, so there is company
    to share a request with. None: go alone (a lone call pays no batching detour)."""
    if not node.pool.settings.autobatch:
        return None
    gets = gets_of(node)
    pool = _loops[asyncio.get_running_loop()].pools.get(node)
    if gets.waiting or (pool is not None and pool.size > len(pool.idle)):
        return gets
    return None


def gets_of(node: Node) -> Gets:
    """The running loop's batch of gets for ``node``, made on first use."""
    loop = asyncio.get_running_loop()
    pools = _loops.get(loop) or _pools_of(loop)
    gets = pools.gets.get(node)
    if gets is None:
        gets = pools.gets[node] = Gets(node)
    return gets


def _pools_of(loop: asyncio.AbstractEventLoop) -> _LoopPools:
    """The loop's pools, registered to close with it: the guard's first step runs here
    (a coroutine step, driven by hand) so the loop's asyncgen hook adopts it."""
    with _loops_lock:
        pools = _loops.setdefault(loop, _LoopPools())
    if pools.guard is None:
        pools.guard = _closed_with_the_loop(loop, pools)
        try:
            pools.guard.__anext__().send(None)
        except StopIteration:  # reached its ``yield``: registered, now waits for shutdown
            pass
    return pools


def pool_figures(node: Node) -> dict[str, int]:
    """The asyncio pools' figures for ``node``, summed over the process's event loops:
    connections open (idle or in use), idle, and coroutines waiting for one. Read from
    any thread: each figure is one read of a loop's own counters (monitoring, not exact)."""
    with _loops_lock:
        loops = list(_loops.values())
    pools = [p for p in (loop.pools.get(node) for loop in loops) if p is not None]
    return {
        "async_loops": len(pools),
        "async_pool_size": sum(pool.size for pool in pools),
        "async_pool_idle": sum(len(pool.idle) for pool in pools),
        "async_pool_waiters": sum(len(pool.waiters) for pool in pools),
        "async_pool_waits": sum(pool.waits for pool in pools),
        "async_pool_connects": sum(pool.connects for pool in pools),
    }


def close_pools(nodes: Sequence[Node]) -> None:
    """Close the running loop's idle connections to ``nodes``."""
    pools = _loops.get(asyncio.get_running_loop())
    if pools is not None:
        for node in nodes:
            pool = pools.pools.get(node)
            if pool is not None:
                pool.close_idle()


def _forget_after_fork() -> None:
    global _loops_lock
    _loops_lock = threading.Lock()
    _loops.clear()  # the parent's loops and sockets


os.register_at_fork(after_in_child=_forget_after_fork)
