"""Blocking connections to one memcached node: sockets that carry :mod:`wire` ops.

TCP (with ``TCP_NODELAY``), unix sockets and TLS, a connect timeout and an IO timeout.
Without TLS the IO timeout is the kernel's (``SO_RCVTIMEO``/``SO_SNDTIMEO`` on a
blocking socket): a Python socket timeout makes every ``send``/``recv`` a ``poll`` plus
the call, the kernel bounds the wait with one system call. A kernel timeout raises
``BlockingIOError`` (EAGAIN), counted as a timeout like Python's ``socket.timeout``.

Every write is sent with our own loop, not ``sendall``: when it times out we know which
part of the request never left, and raise :class:`WriteTimeout` so the node can settle
the connection (finish the request, then a fence) instead of closing it with a write
that may still land.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import sys
from typing import TYPE_CHECKING, Any

from django_kvcache.memcached import wire

if TYPE_CHECKING:
    from django_kvcache.memcached.pool import ConnectionSettings
    from django_kvcache.memcached.routing import NodeAddress

#: Bytes asked of each ``recv``. Python allocates the full size before the call: 256 KiB
#: costs an mmap'd buffer per call, 64 KiB does not.
RECV_SIZE = 64 * 1024

#: What a socket raises when IO_TIMEOUT passes: Python's timeout, or the kernel's EAGAIN.
TIMEOUTS = (socket.timeout, BlockingIOError)

# struct timeval as two C longs is what Linux and the BSDs take.
KERNEL_TIMEOUTS = sys.platform.startswith(("linux", "darwin", "freebsd"))


class ConnectionClosed(ConnectionError):
    """The server closed the connection (restarted, or dropped us)."""


class WriteTimeout(TimeoutError):
    """A write request timed out: the server may still apply it (a paused server reads
    its socket buffers when it resumes). ``unsent`` is the part of the request that never
    left ``sock``; ``Node.settle`` finishes the conversation before any clean-up."""

    def __init__(self, sock: socket.socket, unsent: bytes) -> None:
        super().__init__(f"write timed out with {len(unsent)} bytes unsent")
        self.sock = sock
        self.unsent = unsent


class Connection:
    """One socket to one node, opened on first use. One request at a time."""

    __slots__ = ("address", "settings", "sock", "buffer", "received")

    def __init__(self, address: NodeAddress, settings: ConnectionSettings) -> None:
        self.address = address
        self.settings = settings
        self.sock: socket.socket | None = None
        self.buffer = wire.Buffer()
        self.received = 0  # bytes, over the connection's life

    def connect(self) -> socket.socket:
        """The socket, connecting first if needed."""
        if self.sock is None:
            self.sock = open_socket(self.address, self.settings)
        return self.sock

    def exchange(self, op: wire.Op) -> Any:
        """Send ``op``'s request, read its reply: what ``op`` makes of it."""
        reply = op.make_reply()
        sock = self.sock or self.connect()
        if op.writes:
            send_counted(sock, op.request)
        else:
            sock.sendall(op.request)  # a read: nothing to settle if it times out
        self.read(reply, op.writes)
        return op.result(reply)

    def send(self, request: bytes, writes: bool) -> None:
        """A request whose reply is read later (a fan-out sends every node's first)."""
        sock = self.sock or self.connect()
        if writes:
            send_counted(sock, request)
        else:
            sock.sendall(request)

    def read(self, reply: Any, writes: bool = False) -> None:
        """Receive until ``reply`` is complete; a write's timeout is a ``WriteTimeout``."""
        assert self.sock is not None
        sock, buffer = self.sock, self.buffer
        try:
            if buffer.pos < len(buffer.data) and reply.parse(buffer):  # already here
                return
            while True:
                chunk = sock.recv(RECV_SIZE)
                if not chunk:
                    raise ConnectionClosed("the server closed the connection")
                self.received += len(chunk)
                buffer.feed(chunk)
                if reply.parse(buffer):
                    return
        except TIMEOUTS as exc:
            if writes:
                raise WriteTimeout(self.sock, b"") from exc
            raise

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


def receive(sock: socket.socket, buffer: wire.Buffer, reply: Any) -> None:
    """Feed ``buffer`` from ``sock`` until ``reply`` parses (``settle``'s fence)."""
    while not reply.parse(buffer):
        chunk = sock.recv(RECV_SIZE)
        if not chunk:
            raise ConnectionClosed("the server closed the connection")
        buffer.feed(chunk)


def settle(sock: socket.socket, unsent: bytes) -> None:
    """Send the rest of a timed-out write and a fence, and read up to the fence's reply:
    after that the server has applied (or refused) everything sent on ``sock``. A timeout
    while sending raises ``WriteTimeout`` with what is still unsent."""
    send_counted(sock, unsent + wire.FENCE)
    receive(sock, wire.Buffer(), wire.Fence())


def send_counted(sock: socket.socket, data: bytes) -> None:
    """``sendall`` that knows, when it times out, what never left (``WriteTimeout``)."""
    sent = 0
    try:
        sent = sock.send(data)  # a request usually leaves in one piece
        if sent < len(data):
            view = memoryview(data)
            while sent < len(view):
                sent += sock.send(view[sent:])
    except TIMEOUTS as exc:
        raise WriteTimeout(sock, data[sent:]) from exc


async def asettle(sock: socket.socket, unsent: bytes, timeout: float | None) -> None:
    """``settle`` on the running event loop: the socket is non-blocking meanwhile, each
    wait bounded by ``timeout``. A TLS socket is settled blocking (bounded by its own
    timeout): an SSL socket's non-blocking writes need the same buffer retried."""
    if isinstance(sock, ssl.SSLSocket):
        settle(sock, unsent)
        return
    loop = asyncio.get_running_loop()
    previous = sock.gettimeout()
    sock.setblocking(False)
    try:
        view = memoryview(unsent + wire.FENCE)
        sent = 0
        try:
            while sent < len(view):
                try:
                    sent += sock.send(view[sent:])
                except BlockingIOError:
                    await asyncio.wait_for(_writable(loop, sock), timeout)
        except TimeoutError as exc:
            raise WriteTimeout(sock, bytes(view[sent:])) from exc
        buffer, fence = wire.Buffer(), wire.Fence()
        while not fence.parse(buffer):
            chunk = await asyncio.wait_for(loop.sock_recv(sock, RECV_SIZE), timeout)
            if not chunk:
                raise ConnectionClosed("the server closed the connection")
            buffer.feed(chunk)
    finally:
        if sock.fileno() >= 0:
            sock.settimeout(previous)


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready = loop.create_future()
    loop.add_writer(sock, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(sock)


def open_socket(address: NodeAddress, settings: ConnectionSettings) -> socket.socket:
    """A connected socket with the settings' timeouts (and TLS, if configured)."""
    if address.path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(settings.connect_timeout)
            sock.connect(address.path)
        except BaseException:
            sock.close()
            raise
    else:
        host, port = address.server  # type: ignore[misc]
        sock = socket.create_connection((host, port), timeout=settings.connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        if settings.tls is not None:
            server_hostname = None if address.path is not None else address.server[0]
            sock = settings.tls.wrap_socket(sock, server_hostname=server_hostname)
        set_io_timeout(sock, settings.io_timeout, kernel=settings.tls is None)
    except BaseException:
        sock.close()
        raise
    return sock


def set_io_timeout(sock: socket.socket, timeout: float | None, kernel: bool) -> None:
    if not (kernel and KERNEL_TIMEOUTS) or timeout is None:
        sock.settimeout(timeout)
        return
    sock.settimeout(None)  # blocking: the kernel bounds every wait
    seconds = int(timeout)
    value = struct.pack("ll", seconds, int((timeout - seconds) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
