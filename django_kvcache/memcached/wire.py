"""memcached's wire format, sans IO: request encoders and incremental reply parsers.

Nothing here touches a socket. A request is bytes; its reply is read by a parser object
that is handed a :class:`Buffer` of received bytes and says whether its reply is
complete (``parse(buffer) -> bool``; the result is then in ``result``). The sync
connections (``connection``) and the asyncio ones (``aio``) only move bytes between a
socket and a buffer, so both speak exactly this code.

An :class:`Op` ties a request to the parser of its reply and to what the caller makes
of it (``finish``). A parser also says whether the connection is still *in step* after
its reply (``in_step``): after an error reply to a command that carried a data block the
server may not have read that block, so the stream position is unknown and the
connection must not be used again. Whatever a parser cannot read — an unknown line, a
number that is not one, a missing flag — raises :class:`ProtocolError`, nothing else.
Two dialects:

* the classic text protocol (``get``/``gets``/``set``/``add``/``touch``/``delete``/
  ``incr``/``flush_all``/``version``/``stats``), which every memcached speaks, and
* the meta commands (``mg``/``ms``/``md``/``mn``, memcached >= 1.6.6), for
  ``get_or_set``'s leases, ``ttl()`` and compare-and-swap. :func:`meta_probe` detects
  them once per node (``mn`` answers ``MN``; an older server says ``ERROR``).
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Collection, Iterable
from urllib.parse import unquote

#: Keys per ``get`` line; memcached accepts longer lines, this keeps each one modest.
GET_KEYS_PER_LINE = 100


class ProtocolError(Exception):
    """A reply we cannot make sense of; the connection is closed after it."""


class ErrorReply(Exception):
    """``SERVER_ERROR``/``CLIENT_ERROR``: the server refused one request. ``in_step``:
    whether the connection may carry another request — not after a refused command that
    carried a data block, which the server may have left unread (then its bytes would be
    read as commands).

    What was refused: ``client_error``, the request itself (a counter that is not a
    number, a bad command line); ``refuses_value``, the value it carried (too large, out
    of memory: :func:`refuses_value`); else the server could not serve it — a proxy
    answers so for a key whose server it cannot reach (twemproxy: ``SERVER_ERROR
    Connection refused``): that key's failure, not the connection's."""

    def __init__(self, line: bytes, in_step: bool = True) -> None:
        kind, _, message = line.partition(b" ")
        super().__init__(message.decode(errors="replace") or kind.decode())
        self.client_error = kind == b"CLIENT_ERROR"
        self.refuses_value = refuses_value(line)
        self.in_step = in_step


#: What memcached says when it will not store a value (``SERVER_ERROR object too large
#: for cache``, ``SERVER_ERROR out of memory storing object``).
VALUE_REFUSALS = (b"too large", b"out of memory")


def refuses_value(line: bytes) -> bool:
    """Whether the error reply ``line`` refuses the value a command carried (rather than
    the command, or the service: a proxy's server that is down)."""
    return line.startswith(b"SERVER_ERROR") and any(words in line for words in VALUE_REFUSALS)


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


ERROR_REPLIES = (b"SERVER_ERROR", b"CLIENT_ERROR")


def check_line(line: bytes, command: str, carries_data: bool = False) -> bytes:
    """``line`` itself, unless it is one of the error replies (``carries_data``: the
    command sent a data block, so after a refusal the connection is out of step)."""
    if line.startswith(ERROR_REPLIES):
        raise ErrorReply(line, in_step=not carries_data)
    if line == b"ERROR":
        raise ProtocolError(f"memcached did not understand {command}")
    return line


def number(token: bytes, what: str) -> int:
    """``token`` as an integer; a :class:`ProtocolError` naming ``what`` otherwise."""
    try:
        return int(token)
    except ValueError:
        raise ProtocolError(f"{what} is not a number: {token[:40]!r}") from None


# --- reply parsers ----------------------------------------------------------------------


#: A ``VALUE`` line of a ``get`` reply: key, flags, length (the shortcuts' pattern: a
#: number of more than ten digits, which no server sends, is left to the careful parser).
_VALUE_LINE = re.compile(rb"VALUE ([^ \r\n]+) ([0-9]{1,10}) ([0-9]{1,10})\r\n")


class Values:
    """A ``get``/``gets`` reply: ``VALUE`` blocks up to ``ends`` ``END`` lines.

    ``result``: ``{key bytes: (data, flags)}``, or ``(data, flags, cas)`` for ``gets``.
    A value for a key that is not one of ``keys`` (those asked) answers another request:
    a :class:`ProtocolError`, never a value.
    """

    __slots__ = ("keys", "ends", "cas", "result", "header")
    in_step = True

    def __init__(self, keys: Collection[bytes], ends: int = 1, cas: bool = False) -> None:
        self.keys = keys
        self.ends = ends
        self.cas = cas
        self.result: dict[bytes, tuple] = {}
        self.header: tuple | None = None  # a VALUE line whose data has not all arrived

    def parse(self, buffer: Buffer) -> bool:
        if self.header is None and not self.cas and type(buffer.data) is bytes:
            self._whole_values(buffer)
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
            elif line.startswith(b"SERVER_ERROR"):
                # The server could not answer (a proxy whose server for the key is down):
                # this request's failure; the connection is in step once this get line's
                # reply has ended, which the error line does if it is the last one.
                raise ErrorReply(line, in_step=self.ends == 1)
            elif line[:6] == b"VALUE ":
                parts = line.split(b" ")
                if len(parts) != (5 if self.cas else 4):
                    raise ProtocolError(f"unexpected VALUE line: {line[:80]!r}")
                if parts[1] not in self.keys:
                    raise ProtocolError(f"a value for a key not asked: {line[:80]!r}")
                cas = number(parts[4], "a cas") if self.cas else 0
                length = number(parts[3], "a value's length")
                if length < 0:
                    raise ProtocolError(f"negative value length: {line[:80]!r}")
                self.header = (parts[1], number(parts[2], "flags"), length, cas)
            else:
                raise ProtocolError(f"unexpected reply to get: {line[:80]!r}")
        return True


    def _whole_values(self, buffer: Buffer) -> None:
        """Read the ``VALUE`` blocks and ``END`` lines that are here whole, in one loop over
        the received bytes (no call per line or block: a ``get_many`` reply's hot path).
        It stops, leaving the buffer at the start of the line, at anything else — a value
        not all here, an error, something malformed — for :meth:`parse`'s careful loop
        to read or reject."""
        data, pos = buffer.data, buffer.pos
        header, size, keys, result = _VALUE_LINE.match, len(data), self.keys, self.result
        ends = self.ends
        while ends:
            match = header(data, pos)
            if match is not None:
                key, flags, length = match.groups()
                start = match.end()
                stop = start + int(length)
                if key not in keys or size < stop + 2 or data[stop:stop + 2] != b"\r\n":
                    break
                result[key] = (data[start:stop], int(flags))
                pos = stop + 2
            elif data.startswith(b"END\r\n", pos):
                ends -= 1
                pos += 5
            else:
                break
        self.ends = ends
        buffer.pos = pos


class OneValue:
    """The reply to ``get`` of one key: ``result`` is ``(data, flags)``, or None.

    A reply that arrived whole and alone (the usual case: one ``VALUE`` or none, and
    ``END``) is read in one go, without the line-by-line bookkeeping — the ``get`` hot
    path; one that comes in pieces is read by :class:`Values`. A value for another key
    than ``key`` is a :class:`ProtocolError`.
    """

    __slots__ = ("key", "result", "values")
    in_step = True

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.result: tuple[bytes, int] | None = None
        self.values: Values | None = None

    def parse(self, buffer: Buffer) -> bool:
        if self.values is None:
            # The usual reply, whole in one chunk, read at once: a value line, the value
            # and END, or END alone. Anything else goes to the line parser, which says
            # what is wrong with it.
            data = buffer.data
            if not buffer.pos and type(data) is bytes:
                header = _VALUE_LINE.match(data)
                if header is None:
                    if data == b"END\r\n":
                        buffer.pos = 5
                        return True
                elif header[1] == self.key:
                    start = header.end()
                    end = start + int(header[3])
                    if len(data) == end + 7 and data.endswith(b"\r\nEND\r\n"):
                        self.result = (data[start:end], int(header[2]))
                        buffer.pos = end + 7
                        return True
            if not len(buffer):  # nothing yet (the asyncio path looks before data arrives)
                return False
            self.values = Values((self.key,))
        if not self.values.parse(buffer):
            return False
        self.result = next(iter(self.values.result.values()), None)
        return True



class Lines:
    """``count`` status lines, one per pipelined command: each one of ``expected``
    (``STORED``, ``DELETED``…) or an error reply (``SERVER_ERROR …``), kept as it is.
    Any other line is a protocol error. After an error reply to a command that carried
    a data block (``carries_data``) the connection is out of step (``in_step``)."""

    __slots__ = ("count", "expected", "carries_data", "result", "in_step")

    def __init__(
        self, count: int = 1, expected: tuple[bytes, ...] = (), carries_data: bool = False
    ) -> None:
        self.count = count
        self.expected = expected
        self.carries_data = carries_data
        self.result: list[bytes] = []
        self.in_step = True

    def parse(self, buffer: Buffer) -> bool:
        while len(self.result) < self.count:
            line = buffer.line()
            if line is None:
                return False
            if line not in self.expected:
                if not line.startswith(ERROR_REPLIES):
                    raise ProtocolError(f"unexpected reply line: {line[:80]!r}")
                if self.carries_data:
                    self.in_step = False
            self.result.append(line)
        return True


class Line:
    """One status line; the error replies raise (``ErrorReply``/``ProtocolError``)
    unless ``check`` is off. ``carries_data``: the command sent a data block (``set``),
    so a refusal leaves the connection out of step."""

    __slots__ = ("command", "check", "carries_data", "result", "in_step")

    def __init__(self, command: str, check: bool = True, carries_data: bool = False) -> None:
        self.command = command
        self.check = check
        self.carries_data = carries_data
        self.result = b""
        self.in_step = True

    def parse(self, buffer: Buffer) -> bool:
        line = buffer.line()
        if line is None:
            return False
        if self.check:
            try:
                line = check_line(line, self.command, self.carries_data)
            except ErrorReply as exc:
                self.in_step = exc.in_step
                raise
        self.result = line
        return True


class Fence:
    """Everything up to the reply of ``version`` (:data:`FENCE`), dropped. Write replies
    are status lines only, so the first line starting with ``VERSION `` is the fence's."""

    __slots__ = ("result",)
    in_step = True

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
    in_step = True

    def __init__(self) -> None:
        self.result: dict[str, Any] = {}

    def parse(self, buffer: Buffer) -> bool:
        while (line := buffer.line()) is not None:
            if line == b"END":
                return True
            parts = line.split(b" ", 2)
            if parts[0] != b"STAT" or len(parts) != 3:
                check_line(line, "stats")
                raise ProtocolError(f"unexpected reply to stats: {line[:80]!r}")
            name, value = parts[1].decode(errors="replace"), parts[2].decode(errors="replace")
            self.result[name] = _number(value)
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
    in_step = True

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
            key = line[4:].split(b" ", 1)[0]
            try:
                self.on_key(unquote(key.decode(), errors="strict"))
            except UnicodeDecodeError:
                raise ProtocolError(f"a key that is not UTF-8: {key[:80]!r}") from None
        return False


@dataclass
class MetaReply:
    """One meta reply: ``code`` (``VA``, ``HD``, ``EN``, ``NF``, ``NS``, ``EX``, ``MN``),
    its flags (``{b"f": b"16", b"O": b"7"}``) and the value of a ``VA``."""

    code: bytes
    flags: dict[bytes, bytes] = field(default_factory=dict)
    value: bytes | None = None

    def number(self, flag: bytes) -> int:
        """The integer value of ``flag``; a :class:`ProtocolError` if it is missing or
        not a number (a reply we cannot read, never a KeyError or ValueError)."""
        token = self.flags.get(flag)
        if token is None:
            raise ProtocolError(f"meta reply {self.code!r} without the {flag!r} flag")
        return number(token, f"the {flag.decode()} flag")


META_CODES = frozenset({b"VA", b"HD", b"EN", b"NF", b"NS", b"EX", b"MN"})


class Meta:
    """One meta reply (:class:`MetaReply`). ``carries_data``: the command sent a data
    block (``ms``), so a refusal leaves the connection out of step."""

    __slots__ = ("carries_data", "result", "pending", "length", "in_step")

    def __init__(self, carries_data: bool = False) -> None:
        self.carries_data = carries_data
        self.result: MetaReply | None = None
        self.pending: MetaReply | None = None  # a VA whose value has not all arrived
        self.length = 0
        self.in_step = True

    def parse(self, buffer: Buffer) -> bool:
        if self.pending is None:
            line = buffer.line()
            if line is None:
                return False
            code, *tokens = line.split(b" ")
            if code not in META_CODES:
                try:
                    check_line(line, "a meta command", self.carries_data)
                except ErrorReply as exc:
                    self.in_step = exc.in_step
                    raise
                raise ProtocolError(f"unexpected meta reply: {line[:80]!r}")
            reply = MetaReply(code, {})
            if code == b"VA":
                if not tokens or not tokens[0].isdigit():
                    raise ProtocolError(f"VA without a length: {line[:80]!r}")
                self.length = int(tokens.pop(0))
            reply.flags = {token[:1]: token[1:] for token in tokens if token}
            if code != b"VA":
                self.result = reply
                return True
            self.pending = reply
        value = buffer.block(self.length)
        if value is None:
            return False
        self.pending.value, self.result, self.pending = value, self.pending, None
        return True


# --- expiry times -----------------------------------------------------------------------

#: memcached reads an exptime up to this many seconds as relative, a larger one as a Unix time.
THIRTY_DAYS = 60 * 60 * 24 * 30
#: The latest expiry memcached takes: a Unix time as a signed 32-bit number (2038-01-19
#: 03:14:07 UTC). Later ones wrap into the past (stored, already expired), and from 2**63
#: it refuses the command line without reading the value (whose bytes are then read as
#: commands). Longer lifetimes are clamped to it.
LATEST_EXPIRY = 2**31 - 1
#: "Already expired": a Unix time long past (1970-01-31). memcached takes a negative
#: exptime too, but twemproxy closes the connection on one; a past time works everywhere.
EXPIRED = THIRTY_DAYS + 1


def exptime(seconds: float | None) -> int:
    """memcached's exptime for an item that lives ``seconds`` from now (None: forever) —
    the one conversion of every lifetime sent (``set``, ``touch``, a lease's ``N``, a
    stale copy's ``T``): 0 for forever, :data:`EXPIRED` for none (0 or less), else whole
    seconds rounded up, plus one, up to 30 days, then an absolute Unix time, at most
    :data:`LATEST_EXPIRY`.

    The one more second is why an entry never expires early: memcached's clock ticks
    whole seconds and an item given ``n`` lives until the ``n``-th tick, between ``n - 1``
    and ``n`` seconds; with ``n + 1`` it lives at least ``n``. (Without it, ``set(k, v, 1)``
    followed at once by ``get(k)`` missed about once in 27,000 tries.)"""
    if seconds is None:
        return 0
    if seconds <= 0:
        return EXPIRED
    whole = math.ceil(min(seconds, LATEST_EXPIRY)) + 1
    if whole <= THIRTY_DAYS:
        return whole
    return min(int(time.time()) + whole, LATEST_EXPIRY)


def seconds_left(remaining: int) -> int | None:
    """What an item's remaining lifetime as memcached reports it (``mg <key> t``: whole
    seconds to its last tick, -1 for never) means to a caller of :func:`exptime`: None
    for never, else that less the second ``exptime`` adds (0 in its last second), so
    that ``exptime(seconds_left(t))`` is ``t`` again: a rewrite keeps the expiry."""
    if remaining < 0:
        return None
    return max(remaining - 1, 0)


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
    applied by the server, so its connection is settled rather than closed. ``optional``:
    a command some servers lack (the meta commands before memcached 1.6.6) or a proxy
    does not forward (twemproxy: meta commands, ``flush_all``, ``stats``,
    ``lru_crawler``) — twemproxy closes the connection on one, which for such a command
    is its refusal rather than the node's failure."""

    __slots__ = ("request", "make_reply", "writes", "finish", "optional")

    def __init__(
        self,
        request: bytes,
        make_reply: Callable[[], Any],
        writes: bool,
        finish: Callable[[Any], Any] | None = None,
        optional: bool = False,
    ) -> None:
        self.request = request
        self.make_reply = make_reply
        self.writes = writes
        self.finish = finish
        self.optional = optional

    @property
    def command(self) -> str:
        """The command's name (its request's first word), for messages."""
        return self.request.split(b" ", 1)[0].split(b"\r", 1)[0].decode(errors="replace")

    def result(self, reply: Any) -> Any:
        return reply.result if self.finish is None else self.finish(reply.result)


def get_one(key: bytes) -> Op:
    """``(data, flags)`` or None."""
    return Op(b"get " + key + b"\r\n", partial(OneValue, key), False)


def get_many(keys: list[bytes]) -> Op:
    """``{key: (data, flags)}`` for the keys found."""
    ends = get_lines(len(keys))
    asked = frozenset(keys)
    return Op(get_request(keys), lambda: Values(asked, ends), False)


def get_each(keys: list[bytes]) -> Op:
    """A ``get`` per key, pipelined: ``(found, failed)`` — ``{key: (data, flags)}`` for the
    keys found, and the keys the server could not serve (``SERVER_ERROR``: behind a proxy,
    their server is down), each failing alone where one multi-key ``get`` fails whole."""
    ops = [get_one(key) for key in keys]

    def finish(parsed: list[Any]) -> tuple[dict[bytes, tuple[bytes, int]], list[bytes]]:
        found, failed = {}, []
        for key, op, item in zip(keys, ops, parsed):
            if isinstance(item, ErrorReply):
                failed.append(key)
            elif (value := op.result(item)) is not None:
                found[key] = value
        return found, failed

    return Op(b"".join(op.request for op in ops),
              lambda: Replies([op.make_reply() for op in ops]), False, finish)


def gets_one(key: bytes) -> Op:
    """``(data, flags, cas)`` or None (``gets``: the classic protocol's compare token)."""
    def finish(found: dict[bytes, tuple]) -> tuple[bytes, int, int] | None:
        return next(iter(found.values()), None)

    return Op(get_request([key], b"gets"), lambda: Values((key,), cas=True), False, finish)


STORE_REPLIES = (b"STORED", b"NOT_STORED", b"EXISTS", b"NOT_FOUND")


def store(name: bytes, key: bytes, data: bytes, flags: int, expire: int) -> Op:
    """``set``/``add``/``replace``: whether it was stored; ``ErrorReply`` if refused
    (out of step: memcached may not have read the data block)."""
    reading = _STORE_READING.get(name) or _store_reading(name)
    return Op(store_command(name, key, data, flags, expire), reading[0], True, reading[1])


def _store_reading(name: bytes) -> tuple[Callable[[], Line], Callable[[bytes], bool]]:
    """How a store command's reply is read (its parser's factory) and what it means:
    made once per command name (``set`` is on every write's path)."""
    command = name.decode()
    reading = _STORE_READING[name] = (partial(Line, command, True, True),
                                      _answer(b"STORED", STORE_REPLIES, command))
    return reading


_STORE_READING: dict[bytes, tuple[Callable[[], Line], Callable[[bytes], bool]]] = {}


def cas(key: bytes, data: bytes, flags: int, expire: int, token: int) -> Op:
    """``cas``: store only if the item's compare token is still ``token``; whether it
    was. With ``expire`` :data:`EXPIRED` a conditional delete (the item is replaced by an
    expired one)."""
    request = b"cas %b %d %d %d %d\r\n%b\r\n" % (key, flags, expire, len(data), token, data)
    return Op(request, lambda: Line("cas", carries_data=True), True,
              _answer(b"STORED", STORE_REPLIES, "cas"))


def store_many(
    items: list[tuple[bytes, bytes, int]], expire: int, name: bytes = b"set",
    deletes: list[bytes] | None = None,
) -> Op:
    """``set`` (or ``add``) of ``(key, data, flags)`` items, then ``delete`` of
    ``deletes``, in one request: one status line per command (``STORED``… or the
    server's refusal, kept as it is)."""
    request = b"".join(store_command(name, k, d, f, expire) for k, d, f in items)
    if deletes:
        request += b"".join(map(delete_command, deletes))
    count = len(items) + len(deletes or ())
    return Op(request, lambda: Lines(count, STORE_REPLIES + DELETE_REPLIES, carries_data=True),
              True)


def touch(key: bytes, expire: int) -> Op:
    return Op(b"touch %b %d\r\n" % (key, expire), lambda: Line("touch"), True,
              _answer(b"TOUCHED", (b"TOUCHED", b"NOT_FOUND"), "touch"))


DELETE_REPLIES = (b"DELETED", b"NOT_FOUND")


def delete(key: bytes) -> Op:
    return Op(delete_command(key), lambda: Line("delete"), True,
              _answer(b"DELETED", DELETE_REPLIES, "delete"))


def delete_many(keys: Iterable[bytes]) -> Op:
    keys = list(keys)
    return Op(b"".join(map(delete_command, keys)),
              lambda: Lines(len(keys), DELETE_REPLIES), True)


def flush_all() -> Op:
    return Op(b"flush_all\r\n", lambda: Lines(1, (b"OK",)), True, optional=True)


def incr(key: bytes, delta: int) -> Op:
    """The new value, None when the key is missing; ``ErrorReply`` (a client error) for
    a value memcached cannot count with."""
    return Op(b"incr %b %d\r\n" % (key, delta), lambda: Line("incr"), True, _counter)


def decr(key: bytes, delta: int) -> Op:
    """``incr``'s twin: memcached's ``decr``, which stops at 0."""
    return Op(b"decr %b %d\r\n" % (key, delta), lambda: Line("decr"), True, _counter)


def _counter(line: bytes) -> int | None:
    if line == b"NOT_FOUND":
        return None
    if not line.isdigit():
        raise ProtocolError(f"unexpected reply to incr or decr: {line[:80]!r}")
    return int(line)


def _answer(yes: bytes, known: tuple[bytes, ...], command: str) -> Callable[[bytes], bool]:
    """A status line's meaning: ``yes`` or another of the ``known`` answers; any other
    line is a reply we cannot read."""
    def finish(line: bytes) -> bool:
        if line not in known:
            raise ProtocolError(f"unexpected reply to {command}: {line[:80]!r}")
        return line == yes

    return finish


def fence() -> Op:
    """``version``: its reply comes after every reply to what was sent before it."""
    return Op(FENCE, Fence, False)


def stats() -> Op:
    return Op(b"stats\r\n", Stats, False, optional=True)


def key_dump(on_key: Callable[[str], None]) -> Op:
    """Every key of the node (memcached >= 1.4.31), each handed to ``on_key``."""
    return Op(b"lru_crawler metadump all\r\n", lambda: KeyDump(on_key), False, optional=True)


def meta_probe() -> Op:
    """Whether the server speaks the meta commands: ``mn`` answers ``MN`` (1.6.6+),
    older servers say ``ERROR``."""
    return Op(b"mn\r\n", lambda: Line("mn", check=False), False, lambda line: line == b"MN",
              optional=True)


def meta_get(key: bytes) -> Op:
    """``(data, flags, remaining ttl or -1, cas)``, or None when the key is missing."""
    return Op(meta_command(b"mg", key, b"v", b"f", b"t", b"c"), Meta, False, _meta_item)


def _meta_item(reply: MetaReply) -> tuple[bytes, int, int, int] | None:
    if reply.code == b"EN":
        return None
    if reply.code != b"VA":
        raise ProtocolError(f"unexpected reply to mg: {reply.code!r}")
    return reply.value, reply.number(b"f"), reply.number(b"t"), reply.number(b"c")


#: What :func:`meta_get_settled` gives when its two reads disagree: read again.
UNSETTLED: Any = object()


def meta_get_settled(key: bytes) -> Op:
    """:func:`meta_get` sent twice in one request, for a read-modify-write by CAS: its
    result when both replies agree, :data:`UNSETTLED` when they do not (read again).

    A reply to ``mg`` can pair an item's old value with the CAS of what replaced it:
    when an ``incr`` replaces an item another connection is reading (memcached 1.6 up to
    at least 1.6.3x, ``do_add_delta``), it gives the old item its successor's CAS, and a
    ``ms`` with that CAS then overwrites the increment. The second ``mg`` starts after the
    first has read its CAS, so after such a replacement: it sees the successor, whose
    value differs (an increment never adds 0) or whose CAS does. Two agreeing replies
    are a value and a CAS of one item.
    """
    command = meta_command(b"mg", key, b"v", b"f", b"t", b"c")

    def finish(replies: list[MetaReply]) -> Any:
        for reply in replies:
            if reply.code in (b"CLIENT_ERROR", b"SERVER_ERROR"):
                raise ErrorReply(reply.code + b" " + (reply.value or b""))
        first, second = _meta_item(replies[0]), _meta_item(replies[1])
        if first is None or second is None:
            return first if first == second else UNSETTLED
        if first[3] != second[3] or first[0].rstrip(b" ") != second[0].rstrip(b" "):
            return UNSETTLED  # (an in-place incr pads a shorter number with spaces)
        return first

    return Op(command + command, lambda: MetaSequence([False, False]), False, finish)


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

    return Op(request, lambda: Meta(carries_data=True), True, finish)


# --- meta commands for get_or_set's leases and ttl() (memcached.lease) -----------------


class MetaSequence:
    """The replies to pipelined meta commands sent without ``q`` (one reply each), in
    order, as :class:`MetaReply`. A refused command (``SERVER_ERROR`` out of memory…)
    becomes its reply, code ``SERVER_ERROR``/``CLIENT_ERROR`` with the message as value,
    instead of raising: the replies after it are still read. ``carries_data`` says, per
    command, whether it sent a data block (``ms``): a refusal of one of those leaves the
    connection out of step (``in_step``), once every reply is read."""

    __slots__ = ("carries_data", "result", "current", "in_step")

    def __init__(self, carries_data: list[bool]) -> None:
        self.carries_data = carries_data
        self.result: list[MetaReply] = []
        self.current = Meta(carries_data[0]) if carries_data else Meta()
        self.in_step = True

    def parse(self, buffer: Buffer) -> bool:
        while len(self.result) < len(self.carries_data):
            try:
                if not self.current.parse(buffer):
                    return False
                reply = self.current.result
            except ErrorReply as exc:
                code = b"CLIENT_ERROR" if exc.client_error else b"SERVER_ERROR"
                reply = MetaReply(code, {}, str(exc).encode())
                self.in_step = self.in_step and exc.in_step
            self.result.append(reply)
            if len(self.result) < len(self.carries_data):
                self.current = Meta(self.carries_data[len(self.result)])
        return True


class Replies:
    """The replies to several ops sent in one request (:func:`pipeline`), in order, each
    read by its own parser; ``result``: each parser, or the :class:`ErrorReply` its
    command got (the replies after it are still read). The connection is out of step
    after them if it is after any of them."""

    __slots__ = ("parsers", "result", "in_step")

    def __init__(self, parsers: list[Any]) -> None:
        self.parsers = parsers
        self.result: list[Any] = []
        self.in_step = True

    def parse(self, buffer: Buffer) -> bool:
        while len(self.result) < len(self.parsers):
            parser = self.parsers[len(self.result)]
            try:
                if not parser.parse(buffer):
                    return False
                self.result.append(parser)
                self.in_step = self.in_step and parser.in_step
            except ErrorReply as exc:
                self.result.append(exc)
                self.in_step = self.in_step and exc.in_step
        return True


def pipeline(ops: list[Op]) -> Op:
    """``ops`` in one request: a list of what each makes of its reply, or the
    :class:`ErrorReply` its command got."""
    def finish(parsed: list[Any]) -> list[Any]:
        return [item if isinstance(item, ErrorReply) else op.result(item)
                for op, item in zip(ops, parsed)]

    return Op(b"".join(op.request for op in ops),
              lambda: Replies([op.make_reply() for op in ops]),
              any(op.writes for op in ops), finish)


def meta_store(key: bytes, data: bytes, flags: int, expire: int) -> Op:
    """``ms``: store ``data`` under ``key`` for ``expire`` (an exptime): the reply's code."""
    request = meta_command(b"ms", key, b"T%d" % expire, b"F%d" % flags, data=data)
    return Op(request, lambda: Meta(carries_data=True), True, _code)


def meta_delete(key: bytes, cas: int) -> Op:
    """``md`` of ``key`` only if its CAS is still ``cas``: the reply's code."""
    return Op(meta_command(b"md", key, b"C%d" % cas), Meta, True, _code)


def _code(reply: MetaReply) -> bytes:
    return reply.code


def meta_sequence(commands: list[bytes], writes: bool) -> Op:
    """Several meta commands (from :func:`meta_command`, without ``q``) in one request:
    their replies in order (:class:`MetaSequence`)."""
    carries_data = [command.startswith(b"ms ") for command in commands]
    return Op(b"".join(commands), lambda: MetaSequence(carries_data), writes)


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
