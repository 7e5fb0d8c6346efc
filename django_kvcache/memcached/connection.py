"""The blocking driver's byte mover: sockets that carry :mod:`wire` requests and replies.

TCP (with ``TCP_NODELAY``), unix sockets and TLS, a connect timeout and an IO timeout.
Nothing here decides anything: what to send, which deadline applies and what a failure
means are the exchange's (:mod:`django_kvcache.memcached.exchange`). A :class:`Connection`
sends bytes and reads a reply until its parser is satisfied, both by a deadline given to
it, and says where it stopped: the part of a request still unsent (``unsent``), the
bytes received so far (``received``). A write cut short leaves its socket to be settled
(:class:`UnsettledSocket`), by either driver: the same non-blocking byte moving, with the
driver's own way to wait for the socket.

Without TLS the IO timeout is the kernel's (``SO_RCVTIMEO``/``SO_SNDTIMEO`` on a blocking
socket): a Python socket timeout makes every ``send``/``recv`` a ``poll`` plus the call,
the kernel bounds the wait with one system call. A kernel timeout raises
``BlockingIOError`` (EAGAIN), counted as a timeout like Python's ``socket.timeout``. A
wait that starts with more than half the IO timeout left of its deadline — the usual
one — is bounded by the kernel alone; a later one (a reply trickling in) first polls for
what is left, so no node can stretch a call past its deadline by more than half an IO
timeout.
"""
from __future__ import annotations

import select
import socket
import ssl
import struct
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django_kvcache.memcached import wire

if TYPE_CHECKING:
    from django_kvcache.memcached.routing import NodeAddress

#: Bytes asked of each ``recv``. Python allocates the full size before the call: 256 KiB
#: costs an mmap'd buffer per call, 64 KiB does not.
RECV_SIZE = 64 * 1024

#: What a socket raises when IO_TIMEOUT passes: Python's timeout, or the kernel's EAGAIN.
TIMEOUTS = (socket.timeout, BlockingIOError)

#: How far past a deadline a blocking call may end, as a share of the socket's own
#: timeout (IO_TIMEOUT): a wait that starts with more than that share of it left is
#: bounded by the socket's timeout alone. Threads that wait for the GIL between sending
#: and reading would otherwise pay a ``poll`` per read (measured: a third fewer calls
#: with 6 threads at a 5 ms slack).
SLACK = 0.5

#: ``send`` without sleeping (where the platform has it; else sends may block).
DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)

# struct timeval as two C longs is what Linux and the BSDs take.
KERNEL_TIMEOUTS = sys.platform.startswith(("linux", "darwin", "freebsd"))


@dataclass(frozen=True)
class ConnectionSettings:
    connect_timeout: float | None = 1.0
    io_timeout: float | None = 1.0
    max_size: int = 64
    pool_timeout: float = 1.0
    tls: ssl.SSLContext | None = None  # hashed by identity, like the setting object itself
    autobatch: bool = True  # asyncio gets of one loop iteration as one request (autobatch)


class ConnectionClosed(ConnectionError):
    """The server closed the connection (restarted, or dropped us)."""


class ConnectTimeout(TimeoutError):
    """No connection within CONNECT_TIMEOUT (a ``socket.timeout``, as Python's own)."""

    def __init__(self, seconds: float | None) -> None:
        super().__init__(f"no connection within CONNECT_TIMEOUT ({seconds:g} s)")


class SendTimeout(TimeoutError):
    """The deadline passed with part of a request unsent (the connection's ``unsent``)."""


class UnsettledSocket:
    """The socket of a write that was cut short (timed out or cancelled), with what
    settling it still has to do: the part of its request that never left (``unsent``,
    the fence added at its end once), and the replies received so far (``buffer``).
    Settled before its node serves again, by either driver: :meth:`advance` does what
    can be done without waiting, and says what to wait for before the next call.

    ``unsent`` and ``buffer`` are updated as bytes leave and arrive, so a settle that
    is itself interrupted resumes where it stopped and never sends a byte twice.
    """

    __slots__ = ("sock", "unsent", "fenced", "buffer", "fence")

    def __init__(self, sock: socket.socket, unsent: bytes | memoryview = b"",
                 buffer: wire.Buffer | None = None) -> None:
        self.sock = sock
        self.unsent = memoryview(unsent)
        self.fenced = False
        self.buffer = buffer if buffer is not None else wire.Buffer()
        self.fence = wire.Fence()

    def advance(self) -> int:
        """Send what is unsent (the fence last) and read up to the fence's reply, as far
        as the socket allows without waiting: 0 once the fence's reply is in (the server
        has applied or refused everything sent on the socket), else the ``select`` event
        to wait for (``POLLOUT``/``POLLIN``) before the next call. The socket must be
        non-blocking (:meth:`nonblocking`). ``ConnectionClosed`` if the server closed it.

        A TLS socket may want to read in order to write or the reverse; it sends a whole
        piece or nothing (OpenSSL keeps a partial record and finishes it when the same
        bytes are offered again, which they are)."""
        if not self.fenced:
            self.unsent = memoryview(bytes(self.unsent) + wire.FENCE)
            self.fenced = True
        sock = self.sock
        try:
            while self.unsent:
                self.unsent = self.unsent[sock.send(self.unsent):]
        except (BlockingIOError, ssl.SSLWantWriteError):
            return select.POLLOUT
        except ssl.SSLWantReadError:
            return select.POLLIN
        try:
            while not self.fence.parse(self.buffer):
                chunk = sock.recv(RECV_SIZE)
                if not chunk:
                    raise ConnectionClosed("the server closed the connection")
                self.buffer.feed(chunk)
        except (BlockingIOError, ssl.SSLWantReadError):
            return select.POLLIN
        except ssl.SSLWantWriteError:
            return select.POLLOUT
        return 0

    def nonblocking(self) -> _Nonblocking:
        """A context in which the socket does not block (its timeout put back after)."""
        return _Nonblocking(self.sock)

    def close(self) -> None:
        self.sock.close()


class _Nonblocking:
    __slots__ = ("sock", "previous")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.previous = sock.gettimeout()

    def __enter__(self) -> None:
        self.sock.setblocking(False)

    def __exit__(self, *exc_info: Any) -> None:
        if self.sock.fileno() >= 0:
            self.sock.settimeout(self.previous)


class Connection:
    """One socket to one node, opened on first use. One request at a time."""

    __slots__ = ("address", "settings", "sock", "buffer", "received", "unsent", "send_flags")

    def __init__(self, address: NodeAddress, settings: ConnectionSettings) -> None:
        self.address = address
        self.settings = settings
        self.sock: socket.socket | None = None
        self.buffer = wire.Buffer()
        self.received = 0  # bytes, over the connection's life
        self.unsent: memoryview | bytes = b""  # of the request being sent
        self.send_flags = 0

    def connect(self) -> socket.socket:
        """The socket, connecting first if needed."""
        if self.sock is None:
            self.sock = open_socket(self.address, self.settings)
            self.send_flags = send_flags(self.sock)
        return self.sock

    def transfer(self, request: bytes, reply: Any, deadline: float | None) -> None:
        """Send ``request`` and read until ``reply`` parses, both by ``deadline``.

        The usual exchange, written out for speed (``send`` and ``receive`` inlined):
        the request leaves in one ``send`` and its reply arrives in one ``recv``, bounded
        by the socket's own timeout (the deadline is IO_TIMEOUT from just now). When time
        went by first — a connect, a full buffer — the reads are bounded by the deadline
        itself (``receive``)."""
        sock = self.sock
        if sock is None:
            self.connect()
            self.send(request, deadline)
            self.receive(reply, deadline)
            return
        self.unsent = request
        try:
            sent = sock.send(request, self.send_flags)
        except BlockingIOError:  # the kernel's buffer is full
            sent = 0
        except TIMEOUTS as exc:  # TLS: its socket timeout
            raise SendTimeout(f"IO_TIMEOUT passed with {len(request)} bytes unsent") from exc
        if sent != len(request):
            self.unsent = memoryview(request)[sent:]
            send_rest(sock, self, deadline)
            self.unsent = b""
            self.receive(reply, deadline)
            return
        self.unsent = b""
        chunk = sock.recv(RECV_SIZE)
        if not chunk:
            raise ConnectionClosed("the server closed the connection")
        self.received += len(chunk)
        buffer = self.buffer
        buffer.feed(chunk)
        if not reply.parse(buffer):
            self.receive(reply, deadline)

    def send(self, request: bytes, deadline: float | None) -> bool:
        """Send all of ``request`` by ``deadline``; ``SendTimeout`` if not (``unsent``
        says what never left). Whether it had to wait for room."""
        sock = self.sock or self.connect()
        self.unsent = request
        try:
            sent = sock.send(request, self.send_flags)  # usually all of it, at once
        except BlockingIOError:  # the kernel's buffer is full
            sent = 0
        except TIMEOUTS as exc:  # TLS: its socket timeout
            raise SendTimeout(f"IO_TIMEOUT passed with {len(request)} bytes unsent") from exc
        if sent == len(request):
            self.unsent = b""
            return False
        self.unsent = memoryview(request)[sent:]
        send_rest(sock, self, deadline)
        self.unsent = b""
        return True

    def receive(self, reply: Any, deadline: float | None) -> None:
        """Receive until ``reply`` is complete, by ``deadline``."""
        sock, buffer = self.sock, self.buffer
        assert sock is not None
        if buffer.pos < len(buffer.data) and reply.parse(buffer):  # already here
            return
        while True:
            wait(sock, deadline, self.settings.io_timeout, select.POLLIN)
            chunk = sock.recv(RECV_SIZE)
            if not chunk:
                raise ConnectionClosed("the server closed the connection")
            self.received += len(chunk)
            buffer.feed(chunk)
            if reply.parse(buffer):
                return

    def round_trip(self, op: wire.Op) -> Any:
        """``op`` alone, within IO_TIMEOUT: what it makes of the reply (no failure
        handling: for tests; calls go through the exchange)."""
        reply = op.make_reply()
        self.transfer(op.request, reply, deadline_after(self.settings.io_timeout))
        return op.result(reply)

    def detach(self) -> UnsettledSocket | None:
        """Hand the socket over to be settled (a write cut short), with what is unsent
        and what was received; the connection no longer owns it."""
        sock, self.sock = self.sock, None
        if sock is None:
            return None
        return UnsettledSocket(sock, self.unsent, self.buffer)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


def send_rest(sock: socket.socket, holder: Any, deadline: float | None) -> None:
    """Send ``holder.unsent`` (a connection's) by ``deadline``, recording
    what is left after each piece; ``SendTimeout`` if the deadline passes.

    A plain socket is never put to sleep by ``send`` (``MSG_DONTWAIT``): waits happen in
    ``poll``, where a signal handler's exception interrupts nothing half done, so
    ``unsent`` is exact even then (a ``send`` interrupted in its sleep after part of the
    data left would return a count the exception throws away). A TLS socket sends a
    whole piece or nothing (OpenSSL keeps a partial record and finishes it when the same
    bytes are sent again)."""
    flags = send_flags(sock)
    bound = sock.gettimeout()
    try:
        while holder.unsent:
            if flags:
                poll(sock, deadline, select.POLLOUT)
            else:
                wait(sock, deadline, bound, select.POLLOUT)
            try:
                holder.unsent = holder.unsent[sock.send(holder.unsent, flags):]
            except BlockingIOError:  # readiness is no promise of room: poll again
                pass
    except TIMEOUTS as exc:
        raise SendTimeout(f"IO_TIMEOUT passed with {len(holder.unsent)} bytes unsent") from exc


def send_flags(sock: socket.socket) -> int:
    """``MSG_DONTWAIT`` for a plain socket; a TLS socket takes no flags."""
    return 0 if isinstance(sock, ssl.SSLSocket) else DONTWAIT


def deadline_after(seconds: float | None) -> float | None:
    """The monotonic time ``seconds`` from now (None: no deadline)."""
    return None if seconds is None else time.monotonic() + seconds


def wait(sock: socket.socket, deadline: float | None, bound: float | None, events: int) -> None:
    """Before a blocking call on ``sock`` (whose own timeout is ``bound``): when less than
    that is left of ``deadline``, wait for readiness with what is left instead; past it,
    raise ``socket.timeout``."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if bound is not None and left >= bound * SLACK:
        return  # the socket's own timeout ends soon enough after the deadline
    if events == select.POLLIN and isinstance(sock, ssl.SSLSocket) and sock.pending():
        return  # decrypted bytes are waiting: no need to ask the kernel
    poll(sock, deadline, events)


def poll(sock: socket.socket, deadline: float | None, events: int) -> None:
    """Wait until ``sock`` is ready for ``events``, at the latest until ``deadline``
    (``socket.timeout`` then). Past the deadline it still looks once: a reply that came
    in time while this thread waited for the GIL is no timeout of the node's."""
    poller = select.poll()
    poller.register(sock, events)
    if deadline is None:
        poller.poll()
    elif not poller.poll(max(deadline - time.monotonic(), 0.0) * 1000):
        raise socket.timeout("IO_TIMEOUT passed")


def open_socket(address: NodeAddress, settings: ConnectionSettings) -> socket.socket:
    """A connected socket with the settings' timeouts (and TLS, if configured)."""
    try:
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
    except socket.timeout as exc:  # said as what it is, not "timed out"
        raise ConnectTimeout(settings.connect_timeout) from exc
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
