"""memcached's wire format, sans IO: request encoders and incremental reply parsers.

Nothing here touches a socket. A request is bytes; its reply is read by a parser object
that is handed a :class:`Buffer` of received bytes and says whether its reply is
complete (``parse(buffer) -> bool``; the result is then in ``result``). The sync
connections (``connection``) and the asyncio ones (``aio``) only move bytes between a
socket and a buffer, so both speak exactly this code.

An :class:`Op` ties a request to the parser of its reply and to what the caller makes
of it (``finish``). Two dialects:

* the classic text protocol (``get``/``gets``/``set``/``add``/``touch``/``delete``/
  ``incr``/``flush_all``/``version``/``stats``), which every memcached speaks, and
* the meta commands (``mg``/``ms``/``md``/``ma``/``mn``, memcached >= 1.6) with opaque
  tokens and quiet mode. :func:`meta_probe` detects them once per node (``mn`` answers
  ``MN``; an older server says ``ERROR``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable
from urllib.parse import unquote

#: Keys per ``get`` line; memcached accepts longer lines, this keeps each one modest.
GET_KEYS_PER_LINE = 100


class ProtocolError(Exception):
    """A reply we cannot make sense of; the connection is closed after it."""


class ErrorReply(Exception):
    """``SERVER_ERROR``/``CLIENT_ERROR``: the server refused one request (too large,
    out of memory, not a number) and the connection is still in step."""

    def __init__(self, line: bytes) -> None:
        kind, _, message = line.partition(b" ")
        super().__init__(message.decode(errors="replace") or kind.decode())
        self.client_error = kind == b"CLIENT_ERROR"


class Buffer:
    """Bytes received and not parsed yet.

    A chunk fed to an empty buffer is kept as it is (no copy: the usual reply arrives in
    one chunk); only a reply spread over several chunks is collected in a ``bytearray``.
    """

    __slots__ = ("data", "pos")

    def __init__(self) -> None:
        self.data: bytes | bytearray = b""
        self.pos = 0

    def feed(self, chunk: bytes) -> None:
        data, pos = self.data, self.pos
        if pos >= len(data):
            self.data, self.pos = chunk, 0
            return
        if isinstance(data, bytes):
            self.data = data = bytearray(memoryview(data)[pos:])
        elif pos:
            del data[:pos]
        self.pos = 0
        data += chunk

    def __len__(self) -> int:
        return len(self.data) - self.pos

    def line(self) -> bytes | None:
        """The next complete line without its ``\\r\\n``, or None."""
        end = self.data.find(b"\r\n", self.pos)
        if end < 0:
            return None
        start, self.pos = self.pos, end + 2
        return bytes(self.data[start:end])

    def text_line(self) -> bytes | None:
        """The next line ended by ``\n`` (``lru_crawler metadump`` omits the ``\r``)."""
        end = self.data.find(b"\n", self.pos)
        if end < 0:
            return None
        start, self.pos = self.pos, end + 1
        return bytes(self.data[start:end]).rstrip(b"\r")

    def block(self, length: int) -> bytes | None:
        """The next ``length`` bytes and the ``\\r\\n`` after them, or None."""
        data, start = self.data, self.pos
        end = start + length
        if len(data) < end + 2:
            return None
        if data[end : end + 2] != b"\r\n":
            raise ProtocolError("a data block does not end with \\r\\n")
        self.pos = end + 2
        if type(data) is bytes:
            return data[start:end]
        with memoryview(data) as view:
            return bytes(view[start:end])


def check_line(line: bytes, command: str) -> bytes:
    """``line`` itself, unless it is one of the error replies."""
    if line.startswith((b"SERVER_ERROR", b"CLIENT_ERROR")):
        raise ErrorReply(line)
    if line == b"ERROR":
        raise ProtocolError(f"memcached did not understand {command}")
    return line


# --- reply parsers ----------------------------------------------------------------------


class Values:
    """A ``get``/``gets`` reply: ``VALUE`` blocks up to ``ends`` ``END`` lines.

    ``result``: ``{key bytes: (data, flags)}``, or ``(data, flags, cas)`` for ``gets``.
    """

    __slots__ = ("ends", "cas", "result", "header")

    def __init__(self, ends: int = 1, cas: bool = False) -> None:
        self.ends = ends
        self.cas = cas
        self.result: dict[bytes, tuple] = {}
        self.header: tuple | None = None  # a VALUE line whose data has not all arrived

    def parse(self, buffer: Buffer) -> bool:
        while self.ends:
            if self.header is not None:
                key, flags, length, cas = self.header
                data = buffer.block(length)
                if data is None:
                    return False
                self.result[key] = (data, flags, cas) if self.cas else (data, flags)
                self.header = None
            line = buffer.line()
            if line is None:
                return False
            if line == b"END":
                self.ends -= 1
            elif line[:6] == b"VALUE ":
                parts = line.split(b" ")
                if len(parts) != (5 if self.cas else 4):
                    raise ProtocolError(f"unexpected VALUE line: {line[:80]!r}")
                cas = int(parts[4]) if self.cas else 0
                self.header = (parts[1], int(parts[2]), int(parts[3]), cas)
            else:  # even SERVER_ERROR: a get the server cannot answer leaves us lost
                raise ProtocolError(f"unexpected reply to get: {line[:80]!r}")
        return True


class OneValue:
    """The reply to ``get`` of one key: ``result`` is ``(data, flags)``, or None.

    A reply that arrived whole and alone (the usual case: one ``VALUE`` or none, and
    ``END``) is read in one go, without the line-by-line bookkeeping — the ``get`` hot
    path; one that comes in pieces is read by :class:`Values`.
    """

    __slots__ = ("result", "values")

    def __init__(self) -> None:
        self.result: tuple[bytes, int] | None = None
        self.values: Values | None = None

    def parse(self, buffer: Buffer) -> bool:
        if self.values is None:
            if self._whole(buffer):
                return True
            if not len(buffer):  # nothing yet (the asyncio path looks before data arrives)
                return False
            self.values = Values()
        if not self.values.parse(buffer):
            return False
        self.result = next(iter(self.values.result.values()), None)
        return True

    def _whole(self, buffer: Buffer) -> bool:
        data = buffer.data
        if buffer.pos or type(data) is not bytes:
            return False
        header = _VALUE_LINE.match(data)
        if header is None:
            if data != b"END\r\n":
                return False
            buffer.pos = 5
            return True
        start = header.end()
        end = start + int(header[2])
        if len(data) != end + 7 or not data.endswith(b"\r\nEND\r\n"):
            return False
        self.result = (data[start:end], int(header[1]))
        buffer.pos = end + 7
        return True


#: A ``VALUE <key> <flags> <length>`` line (``OneValue``'s shortcut).
_VALUE_LINE = re.compile(rb"VALUE [^ \r\n]+ (\d+) (\d+)\r\n")


class Lines:
    """``count`` status lines (``STORED``, ``DELETED``, ``NOT_FOUND``, ``SERVER_ERROR``…),
    one per pipelined command; an ``ERROR`` line is a protocol error."""

    __slots__ = ("count", "result")

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.result: list[bytes] = []

    def parse(self, buffer: Buffer) -> bool:
        while len(self.result) < self.count:
            line = buffer.line()
            if line is None:
                return False
            if line == b"ERROR":
                raise ProtocolError("memcached did not understand a command")
            self.result.append(line)
        return True


class Line:
    """One status line; the error replies raise (``ErrorReply``/``ProtocolError``)
    unless ``check`` is off."""

    __slots__ = ("command", "check", "result")

    def __init__(self, command: str, check: bool = True) -> None:
        self.command = command
        self.check = check
        self.result = b""

    def parse(self, buffer: Buffer) -> bool:
        line = buffer.line()
        if line is None:
            return False
        self.result = check_line(line, self.command) if self.check else line
        return True


class Fence:
    """Everything up to the reply of ``version`` (:data:`FENCE`), dropped. Write replies
    are status lines only, so the first line starting with ``VERSION `` is the fence's."""

    __slots__ = ("result",)

    def __init__(self) -> None:
        self.result = b""

    def parse(self, buffer: Buffer) -> bool:
        while (line := buffer.line()) is not None:
            if line.startswith(b"VERSION "):
                self.result = line[8:]
                return True
        return False


class Stats:
    """``STAT <name> <value>`` lines up to ``END``: ``{name: value}``, numbers as such."""

    __slots__ = ("result",)

    def __init__(self) -> None:
        self.result: dict[str, Any] = {}

    def parse(self, buffer: Buffer) -> bool:
        while (line := buffer.line()) is not None:
            if line == b"END":
                return True
            if not line.startswith(b"STAT "):
                check_line(line, "stats")
                raise ProtocolError(f"unexpected reply to stats: {line[:80]!r}")
            _, name, value = line.split(b" ", 2)
            self.result[name.decode()] = _number(value.decode(errors="replace"))
        return False


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class KeyDump:
    """``lru_crawler metadump`` lines (``key=<urlencoded> …``, ended by ``\n`` alone) up
    to ``END``; each key, decoded, goes to ``on_key`` as it arrives (a node may hold
    millions)."""

    __slots__ = ("on_key", "result")

    def __init__(self, on_key: Callable[[str], None]) -> None:
        self.on_key = on_key
        self.result = None

    def parse(self, buffer: Buffer) -> bool:
        while (line := buffer.text_line()) is not None:
            if line == b"END":
                return True
            if not line.startswith(b"key="):
                check_line(line, "lru_crawler metadump")
                raise ProtocolError(f"unexpected reply to lru_crawler metadump: {line[:80]!r}")
            self.on_key(unquote(line[4 : line.index(b" ")].decode()))
        return False


@dataclass
class MetaReply:
    """One meta reply: ``code`` (``VA``, ``HD``, ``EN``, ``NF``, ``NS``, ``EX``, ``MN``),
    its flags (``{b"f": b"16", b"O": b"7"}``) and the value of a ``VA``."""

    code: bytes
    flags: dict[bytes, bytes] = field(default_factory=dict)
    value: bytes | None = None

    def number(self, flag: bytes) -> int:
        return int(self.flags[flag])


META_CODES = frozenset({b"VA", b"HD", b"EN", b"NF", b"NS", b"EX", b"MN"})


class Meta:
    """One meta reply; with ``until_mn``, every reply up to ``MN`` (a quiet batch
    ended by ``mn``), as ``{opaque token: MetaReply}`` (``O`` flag)."""

    __slots__ = ("until_mn", "result", "pending", "length")

    def __init__(self, until_mn: bool = False) -> None:
        self.until_mn = until_mn
        self.result: Any = {} if until_mn else None
        self.pending: MetaReply | None = None  # a VA whose value has not all arrived
        self.length = 0

    def parse(self, buffer: Buffer) -> bool:
        while True:
            if self.pending is not None:
                value = buffer.block(self.length)
                if value is None:
                    return False
                self.pending.value, reply, self.pending = value, self.pending, None
                if self._done(reply):
                    return True
            line = buffer.line()
            if line is None:
                return False
            code, *tokens = line.split(b" ")
            if code not in META_CODES:
                check_line(line, "a meta command")
                raise ProtocolError(f"unexpected meta reply: {line[:80]!r}")
            if code == b"VA":
                if not tokens or not tokens[0].isdigit():
                    raise ProtocolError(f"VA without a length: {line[:80]!r}")
                self.length = int(tokens.pop(0))
            reply = MetaReply(code, {token[:1]: token[1:] for token in tokens if token})
            if code == b"VA":
                self.pending = reply
            elif self._done(reply):
                return True

    def _done(self, reply: MetaReply) -> bool:
        if not self.until_mn:
            self.result = reply
            return True
        if reply.code == b"MN":
            return True
        self.result[reply.flags.get(b"O", b"")] = reply
        return False


# --- requests -------------------------------------------------------------------------

#: Answered after everything sent before it on the connection, whatever memcached version.
FENCE = b"version\r\n"


def get_request(keys: Iterable[bytes], command: bytes = b"get") -> bytes:
    keys = list(keys)
    return b"".join(
        command + b" " + b" ".join(keys[i : i + GET_KEYS_PER_LINE]) + b"\r\n"
        for i in range(0, len(keys), GET_KEYS_PER_LINE)
    )


def get_lines(count: int) -> int:
    """How many ``END`` lines the reply to ``get_request`` of ``count`` keys has."""
    return -(-count // GET_KEYS_PER_LINE)


def store_command(name: bytes, key: bytes, data: bytes, flags: int, expire: int) -> bytes:
    return b"%b %b %d %d %d\r\n%b\r\n" % (name, key, flags, expire, len(data), data)


def delete_command(key: bytes) -> bytes:
    return b"delete %b\r\n" % key


def meta_command(name: bytes, key: bytes, *flags: bytes, data: bytes | None = None) -> bytes:
    """``mg``/``ms``/``md``/``ma``/``mn`` with its flags (``b"v"``, ``b"T60"``,
    ``b"O12"``, ``b"q"``…); ``ms`` takes ``data``."""
    head = b" ".join((name, key) + flags) if key else b" ".join((name,) + flags)
    if data is None:
        return head + b"\r\n"
    parts = head.split(b" ", 2)
    parts.insert(2, b"%d" % len(data))
    return b" ".join(parts) + b"\r\n" + data + b"\r\n"


# --- operations: a request, its reply's parser and what the caller gets -----------------


class Op:
    """One request and how to read its reply. ``make_reply`` builds a fresh parser for
    each attempt (a retry on a new connection starts over); ``finish`` turns the parsed
    reply into what the caller gets. ``writes``: a write that timed out may still be
    applied by the server, so its connection is settled rather than closed."""

    __slots__ = ("request", "make_reply", "writes", "finish")

    def __init__(
        self,
        request: bytes,
        make_reply: Callable[[], Any],
        writes: bool,
        finish: Callable[[Any], Any] | None = None,
    ) -> None:
        self.request = request
        self.make_reply = make_reply
        self.writes = writes
        self.finish = finish

    def result(self, reply: Any) -> Any:
        return reply.result if self.finish is None else self.finish(reply.result)


def get_one(key: bytes) -> Op:
    """``(data, flags)`` or None."""
    return Op(b"get %b\r\n" % key, OneValue, False)


def get_many(keys: list[bytes]) -> Op:
    """``{key: (data, flags)}`` for the keys found."""
    ends = get_lines(len(keys))
    return Op(get_request(keys), lambda: Values(ends), False)


def store(name: bytes, key: bytes, data: bytes, flags: int, expire: int) -> Op:
    """``set``/``add``/``replace``: whether it was stored; ``ErrorReply`` if refused."""
    return Op(store_command(name, key, data, flags, expire), lambda: Line(name.decode()), True,
              _is(b"STORED"))


def store_many(items: list[tuple[bytes, bytes, int]], expire: int) -> Op:
    """``set`` of ``(key, data, flags)`` items: one status line per item."""
    request = b"".join(store_command(b"set", k, d, f, expire) for k, d, f in items)
    return Op(request, lambda: Lines(len(items)), True)


def touch(key: bytes, expire: int) -> Op:
    return Op(b"touch %b %d\r\n" % (key, expire), lambda: Line("touch"), True, _is(b"TOUCHED"))


def delete(key: bytes) -> Op:
    return Op(delete_command(key), lambda: Line("delete"), True, _is(b"DELETED"))


def delete_many(keys: Iterable[bytes]) -> Op:
    keys = list(keys)
    return Op(b"".join(map(delete_command, keys)), lambda: Lines(len(keys)), True)


def flush_all() -> Op:
    return Op(b"flush_all\r\n", Lines, True)


def incr(key: bytes, delta: int) -> Op:
    """The new value, None when the key is missing; ``ErrorReply`` (a client error) for
    a value memcached cannot count with."""
    return Op(b"incr %b %d\r\n" % (key, delta), lambda: Line("incr"), True, _counter)


def _counter(line: bytes) -> int | None:
    if line == b"NOT_FOUND":
        return None
    if not line.isdigit():
        raise ProtocolError(f"unexpected reply to incr: {line[:80]!r}")
    return int(line)


def fence() -> Op:
    """``version``: its reply comes after every reply to what was sent before it."""
    return Op(FENCE, Fence, False)


def stats() -> Op:
    return Op(b"stats\r\n", Stats, False)


def key_dump(on_key: Callable[[str], None]) -> Op:
    """Every key of the node (memcached >= 1.4.31), each handed to ``on_key``."""
    return Op(b"lru_crawler metadump all\r\n", lambda: KeyDump(on_key), False)


def meta_probe() -> Op:
    """Whether the server speaks the meta commands: ``mn`` answers ``MN`` (1.6.6+),
    older servers say ``ERROR``."""
    return Op(b"mn\r\n", lambda: Line("mn", check=False), False, lambda line: line == b"MN")


def meta_get(key: bytes) -> Op:
    """``(data, flags, remaining ttl or -1, cas)``, or None when the key is missing."""
    def finish(reply: MetaReply) -> tuple[bytes, int, int, int] | None:
        if reply.code == b"EN":
            return None
        if reply.code != b"VA":
            raise ProtocolError(f"unexpected reply to mg: {reply.code!r}")
        return reply.value, reply.number(b"f"), reply.number(b"t"), reply.number(b"c")

    return Op(meta_command(b"mg", key, b"v", b"f", b"t", b"c"), Meta, False, finish)


def meta_cas(key: bytes, data: bytes, flags: int, ttl: int, cas: int) -> Op:
    """Store only if the item is unchanged since ``meta_get``; keeps its TTL."""
    ttl = 0 if ttl == -1 else max(ttl, 1)  # mg says -1 for "never expires"; ms wants 0
    request = meta_command(b"ms", key, b"T%d" % ttl, b"F%d" % flags, b"C%d" % cas, data=data)

    def finish(reply: MetaReply) -> bool:
        if reply.code == b"HD":
            return True
        if reply.code in (b"EX", b"NF", b"NS"):
            return False
        raise ProtocolError(f"unexpected reply to ms: {reply.code!r}")

    return Op(request, Meta, True, finish)


def meta_get_quiet(keys: list[bytes]) -> Op:
    """``mg`` of many keys in quiet mode, ended by ``mn``: misses send nothing.
    ``{key: (data, flags)}`` for the keys found (each found by its opaque token)."""
    request = b"".join(
        meta_command(b"mg", key, b"v", b"f", b"q", b"O%d" % index)
        for index, key in enumerate(keys)
    ) + b"mn\r\n"

    def finish(replies: dict[bytes, MetaReply]) -> dict[bytes, tuple[bytes, int]]:
        return {
            keys[int(token)]: (reply.value, reply.number(b"f"))
            for token, reply in replies.items() if reply.code == b"VA"
        }

    return Op(request, lambda: Meta(until_mn=True), False, finish)


def _is(expected: bytes) -> Callable[[bytes], bool]:
    return lambda line: line == expected


# --- meta commands for get_or_set's leases and ttl() (memcached.lease) -----------------


class MetaSequence:
    """The replies to ``count`` pipelined meta commands sent without ``q`` (one reply
    each), in order, as :class:`MetaReply`. A refused command (``SERVER_ERROR`` out of
    memory…) becomes its reply, code ``SERVER_ERROR``/``CLIENT_ERROR`` with the message
    as value, instead of raising: the replies after it are still read, so the connection
    stays in step."""

    __slots__ = ("count", "result", "current")

    def __init__(self, count: int) -> None:
        self.count = count
        self.result: list[MetaReply] = []
        self.current = Meta()

    def parse(self, buffer: Buffer) -> bool:
        while len(self.result) < self.count:
            try:
                if not self.current.parse(buffer):
                    return False
                reply = self.current.result
            except ErrorReply as exc:
                code = b"CLIENT_ERROR" if exc.client_error else b"SERVER_ERROR"
                reply = MetaReply(code, {}, str(exc).encode())
            self.result.append(reply)
            self.current = Meta()
        return True


def meta_sequence(commands: list[bytes], writes: bool) -> Op:
    """Several meta commands (from :func:`meta_command`, without ``q``) in one request:
    their replies in order (:class:`MetaSequence`)."""
    return Op(b"".join(commands), lambda: MetaSequence(len(commands)), writes)


def meta_get_fresh(key: bytes, recache: int | None = None) -> Op:
    """``mg`` of one value: ``(data, flags, won)``, or None when missing. With
    ``recache``, the first reader to find fewer than that many seconds left wins the
    early recomputation (``W``: ``won`` is true); the later ones see ``Z`` until the item
    is replaced."""
    flags = (b"v", b"f", b"R%d" % recache) if recache else (b"v", b"f")

    def finish(reply: MetaReply) -> tuple[bytes, int, bool] | None:
        if reply.code == b"EN":
            return None
        if reply.code != b"VA":
            raise ProtocolError(f"unexpected reply to mg: {reply.code!r}")
        return reply.value, reply.number(b"f"), b"W" in reply.flags

    return Op(meta_command(b"mg", key, *flags), Meta, False, finish)


def meta_ttl(key: bytes) -> Op:
    """Seconds the item has left (``-1``: it never expires), or None when missing."""
    def finish(reply: MetaReply) -> int | None:
        if reply.code == b"EN":
            return None
        if reply.code != b"HD":
            raise ProtocolError(f"unexpected reply to mg: {reply.code!r}")
        return reply.number(b"t")

    return Op(meta_command(b"mg", key, b"t"), Meta, False, finish)
