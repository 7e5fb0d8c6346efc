"""The bits of memcached's text protocol we speak ourselves on pooled sockets.

pymemcache sends one command and reads its reply; the batch paths need to write many
commands (to many nodes) before reading any reply, so they build requests here and
read replies with :class:`ReplyReader`.

Every write is sent with our own loop (``send_write``), not ``sendall``: when it times
out we know which part of the request never left, and raise ``WriteTimeout`` so the
node can settle the connection (finish the request, then a fence) instead of closing it
with a write that may still land.
"""
from __future__ import annotations

import random
import socket
from typing import Callable, Iterable, TypeVar
from urllib.parse import unquote

from pymemcache.client.base import Client
from pymemcache.exceptions import (
    MemcacheClientError,
    MemcacheServerError,
    MemcacheUnexpectedCloseError,
)

#: Keys per ``get`` line; memcached accepts longer lines, this keeps each one modest.
GET_KEYS_PER_LINE = 100
#: Bytes asked of each ``recv``. Python allocates the full size before the call: 256 KiB
#: costs an mmap'd buffer per call, 64 KiB does not. Larger blocks are received in place.
RECV_SIZE = 64 * 1024

T = TypeVar("T")


def connected(client: Client) -> socket.socket:
    """The pooled pymemcache client's socket, connecting first if needed."""
    if client.sock is None:
        client._connect()
    return client.sock  # type: ignore[return-value]


class ProtocolError(Exception):
    """A reply we cannot make sense of; the connection is closed after it."""


#: What a socket raises when IO_TIMEOUT passes: Python's timeout, or the kernel's EAGAIN.
TIMEOUTS = (socket.timeout, BlockingIOError)


class WriteTimeout(TimeoutError):
    """A write request timed out: the server may still apply it (a paused server reads
    its socket buffers when it resumes). ``unsent`` is the part of the request that never
    left ``sock``; ``Node.settle`` finishes the conversation before any clean-up."""

    def __init__(self, sock: socket.socket, unsent: bytes) -> None:
        super().__init__(f"write timed out with {len(unsent)} bytes unsent")
        self.sock = sock
        self.unsent = unsent


def send_write(sock: socket.socket, request: bytes) -> None:
    """``sendall`` of a write request that keeps count: on a timeout, ``WriteTimeout``."""
    view = memoryview(request)
    sent = 0
    try:
        while sent < len(view):
            sent += sock.send(view[sent:])
    except TIMEOUTS as exc:
        raise WriteTimeout(sock, bytes(view[sent:])) from exc


def read_write_replies(reader: ReplyReader, read: Callable[[ReplyReader], T]) -> T:
    """``read(reader)`` of the replies to a write request; a timeout is a ``WriteTimeout``."""
    try:
        return read(reader)
    except TIMEOUTS as exc:
        raise WriteTimeout(reader.sock, b"") from exc


#: Answered after everything sent before it on the connection, whatever memcached version.
#: Write replies are status lines only, so the first line starting with ``VERSION `` is it.
FENCE = b"version\r\n"


def read_to_fence(sock: socket.socket) -> None:
    """Read and drop replies up to the fence's; its timeout means the node still sleeps."""
    reader = ReplyReader(sock)
    while not reader.line().startswith(b"VERSION "):
        pass


class ReplyReader:
    """Reads replies from one socket, buffering what arrives beyond the current line."""

    __slots__ = ("sock", "buf", "pos", "received")

    def __init__(self, sock: socket.socket, buf: bytes = b"") -> None:
        self.sock = sock
        self.buf = buf
        self.pos = 0
        self.received = len(buf)

    def line(self) -> bytes:
        """The next line, without its ``\\r\\n``."""
        end = self.buf.find(b"\r\n", self.pos)
        while end < 0:
            self._fill()
            end = self.buf.find(b"\r\n", self.pos)
        start, self.pos = self.pos, end + 2
        return self.buf[start:end]

    def block(self, length: int) -> bytes:
        """The next ``length`` bytes, then the ``\\r\\n`` that ends a data block."""
        missing = length + 2 - (len(self.buf) - self.pos)
        if missing > RECV_SIZE:
            return self._large_block(length)
        while missing > 0:
            self._fill()
            missing = length + 2 - (len(self.buf) - self.pos)
        start = self.pos
        self.pos = start + length + 2
        return self.buf[start : start + length]

    def _large_block(self, length: int) -> bytes:
        """Collect the chunks and join them once: no buffer regrown on every ``recv``."""
        chunks = [self.buf[self.pos :]]
        have = len(chunks[0])
        while have < length + 2:
            chunk = self.sock.recv(RECV_SIZE)
            if not chunk:
                raise MemcacheUnexpectedCloseError()
            self.received += len(chunk)
            chunks.append(chunk)
            have += len(chunk)
        data = b"".join(chunks)
        self.buf, self.pos = data, length + 2
        return data[:length]

    def _fill(self) -> None:
        chunk = self.sock.recv(RECV_SIZE)
        if not chunk:
            raise MemcacheUnexpectedCloseError()
        self.received += len(chunk)
        self.buf = self.buf[self.pos :] + chunk
        self.pos = 0


def get_request(keys: Iterable[bytes]) -> bytes:
    keys = list(keys)
    lines = [
        b"get " + b" ".join(keys[i : i + GET_KEYS_PER_LINE]) + b"\r\n"
        for i in range(0, len(keys), GET_KEYS_PER_LINE)
    ]
    return b"".join(lines)


def get_lines(count: int) -> int:
    """How many ``END`` lines the reply to ``get_request`` of ``count`` keys has."""
    return -(-count // GET_KEYS_PER_LINE)


def read_values(reader: ReplyReader, ends: int) -> dict[bytes, tuple[bytes, int]]:
    """Read a ``get`` reply: ``VALUE <key> <flags> <bytes>`` blocks up to ``END`` lines."""
    found: dict[bytes, tuple[bytes, int]] = {}
    while ends:
        line = reader.line()
        if line == b"END":
            ends -= 1
        elif line[:6] == b"VALUE ":
            _, key, flags, length = line.split(b" ", 3)
            found[key] = (reader.block(int(length)), int(flags))
        else:
            raise ProtocolError(f"unexpected reply to get: {line[:80]!r}")
    return found


def get_one(client: Client, key: str) -> tuple[bytes, int] | None:
    """``get`` of one key: ``(data, flags)`` or None. The single-key hot path.

    A small value's whole reply usually arrives in one ``recv``; it is parsed in place
    without the reader's bookkeeping.
    """
    sock = connected(client)
    sock.sendall(b"get %b\r\n" % key.encode())
    buf = sock.recv(RECV_SIZE)
    if buf == b"END\r\n":
        return None
    header_end = buf.find(b"\r\n")
    if buf[:6] == b"VALUE " and header_end > 0 and buf[-7:] == b"\r\nEND\r\n":
        flags, length = buf[6:header_end].split(b" ")[1:]
        start = header_end + 2
        if len(buf) == start + int(length) + 7:
            return buf[start : len(buf) - 7], int(flags)
    if not buf:
        raise MemcacheUnexpectedCloseError()
    return read_values(ReplyReader(sock, buf), 1).get(key.encode())


def store_command(name: bytes, key: bytes, data: bytes, flags: int, expire: int) -> bytes:
    return b"%b %b %d %d %d\r\n%b\r\n" % (name, key, flags, expire, len(data), data)


# --- single-key writes: our own send loop, so a timeout knows what is still unsent -------


def set_one(client: Client, key: str, value: tuple[bytes, int], expire: int) -> bool:
    """``set`` of an encoded ``(data, flags)``; the signature of pymemcache's ``Client.set``."""
    return _store_one(client, b"set", key, value, expire)


def add_one(client: Client, key: str, value: tuple[bytes, int], expire: int) -> bool:
    """``add``: False when the key exists."""
    return _store_one(client, b"add", key, value, expire)


def touch_one(client: Client, key: str, expire: int) -> bool:
    """``touch``: False when the key is missing."""
    return _write_one(client, b"touch %b %d\r\n" % (key.encode(), expire)) == b"TOUCHED"


def delete_one(client: Client, key: str) -> bool:
    """``delete``: False when the key is missing."""
    return _write_one(client, b"delete %b\r\n" % key.encode()) == b"DELETED"


def incr_one(client: Client, key: str, delta: int) -> int | None:
    """``incr``: the new value, None when the key is missing (as ``Client.incr``);
    ``MemcacheClientError`` for a value memcached cannot count with."""
    line = _write_one(client, b"incr %b %d\r\n" % (key.encode(), delta))
    if line == b"NOT_FOUND":
        return None
    if not line.isdigit():
        raise ProtocolError(f"unexpected reply to incr: {line[:80]!r}")
    return int(line)


def _store_one(
    client: Client, name: bytes, key: str, value: tuple[bytes, int], expire: int
) -> bool:
    data, flags = value
    return _write_one(client, store_command(name, key.encode(), data, flags, expire)) == b"STORED"


def _write_one(client: Client, request: bytes) -> bytes:
    """Send one write command, return its status line; errors as pymemcache raises them."""
    sock = connected(client)
    send_write(sock, request)
    line = read_write_replies(ReplyReader(sock), ReplyReader.line)
    if line.startswith(b"SERVER_ERROR"):  # too large, out of memory: refused, node fine
        raise MemcacheServerError(line[13:])
    if line.startswith(b"CLIENT_ERROR"):
        raise MemcacheClientError(line[13:])
    if line == b"ERROR":
        raise ProtocolError("memcached did not understand a command")
    return line


def read_lines(reader: ReplyReader, count: int) -> list[bytes]:
    """One status line per pipelined command (``STORED``, ``DELETED``, ``NOT_FOUND``...)."""
    lines = [reader.line() for _ in range(count)]
    for line in lines:
        if line == b"ERROR":
            raise ProtocolError("memcached did not understand a command")
    return lines


# --- meta commands: read-modify-write that keeps the item's remaining TTL -------------


def meta_get(client: Client, key: bytes) -> tuple[bytes, int, int, int] | None:
    """``(data, flags, remaining ttl or -1, cas)``, or None when the key is missing."""
    sock = connected(client)
    sock.sendall(b"mg %b v f t c\r\n" % key)
    reader = ReplyReader(sock)
    line = reader.line()
    if line == b"EN":
        return None
    if line[:3] != b"VA ":
        raise ProtocolError(f"unexpected reply to mg: {line[:80]!r}")
    length, *tokens = line[3:].split(b" ")
    fields = {token[:1]: int(token[1:]) for token in tokens}
    return reader.block(int(length)), fields[b"f"], fields[b"t"], fields[b"c"]


def meta_cas(
    client: Client, key: bytes, data: bytes, flags: int, ttl: int, cas: int
) -> bool:
    """Store only if the item is unchanged since ``meta_get``; keeps its TTL."""
    sock = connected(client)
    ttl = 0 if ttl == -1 else max(ttl, 1)  # mg says -1 for "never expires"; ms wants 0
    send_write(sock, b"ms %b %d T%d F%d C%d\r\n%b\r\n" % (key, len(data), ttl, flags, cas, data))
    line = read_write_replies(ReplyReader(sock), ReplyReader.line)
    if line == b"HD":
        return True
    if line in (b"EX", b"NF", b"NS"):
        return False
    raise ProtocolError(f"unexpected reply to ms: {line[:80]!r}")


# --- maintenance --------------------------------------------------------------------


def sample_keys(client: Client, count: int, rng: random.Random | None = None) -> list[str]:
    """Up to ``count`` of the node's keys, picked at random (a reservoir sample) from
    ``lru_crawler metadump all`` (memcached 1.4.31+). It walks every item on the node:
    for maintenance commands, never the request path."""
    rng = rng or random.Random()
    sock = connected(client)
    sock.sendall(b"lru_crawler metadump all\r\n")
    sample: list[str] = []
    seen = 0
    pending = b""
    while True:
        chunk = sock.recv(RECV_SIZE)
        if not chunk:
            raise MemcacheUnexpectedCloseError()
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if not line.startswith(b"key="):
                if line.rstrip(b"\r") == b"END":
                    return sample
                raise ProtocolError(f"unexpected reply to lru_crawler metadump: {line[:80]!r}")
            key = unquote(line[4:line.index(b" ")].decode())
            seen += 1
            if len(sample) < count:
                sample.append(key)
            elif (slot := rng.randrange(seen)) < count:
                sample[slot] = key
        if pending.rstrip(b"\r") == b"END":
            return sample
