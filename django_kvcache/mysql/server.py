"""What MySQLCache knows about the servers behind its connections, and what both drivers
share below the failure policy: the statement bytes, the packet limit of a connection,
whether the server has hung up an idle connection.

The flavour and version are detected once per alias and process (one ``SELECT``, the
first statement the policy sends to an alias it does not know). The packet limit belongs
to each connection (a session keeps the ``max_allowed_packet`` it started with), so it
is remembered per DB-API connection, and asked only when a statement might come near it:
never on the hot path.
"""
from __future__ import annotations

import re
import select
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from weakref import WeakKeyDictionary

from django_kvcache.mysql.query import PacketLimit, Query, Reply, first_row

#: Room left in a packet for the statement text around the parameters.
PACKET_HEADROOM = 4096
#: The first statement sent to an alias the process does not know yet.
DETECT = Query("SELECT VERSION(), @@max_allowed_packet", (), first_row)


@dataclass(frozen=True)
class ServerInfo:
    mariadb: bool
    version: tuple[int, ...]
    max_allowed_packet: int  # as the connection that detected the server had it

    @property
    def row_alias(self) -> bool:
        """``INSERT … AS alias`` exists from MySQL 8.0.19; MariaDB has only ``VALUES()``."""
        return not self.mariadb and self.version >= (8, 0, 19)


_servers: dict[str, ServerInfo] = {}
#: ``max_allowed_packet`` per DB-API connection, forgotten with the connection.
_packet_limits: WeakKeyDictionary[Any, int] = WeakKeyDictionary()


def parse_version(text: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(part) for part in match.groups()) if match else (0, 0, 0)


def known_server(alias: str) -> ServerInfo | None:
    return _servers.get(alias)


def remember_server(alias: str, row: tuple[str, Any]) -> ServerInfo:
    """The answer of :data:`DETECT` on ``alias``."""
    version, max_packet = row
    info = ServerInfo("mariadb" in version.lower(), parse_version(version), int(max_packet))
    _servers[alias] = info
    return info


def forget_server(alias: str) -> None:
    """Detect again on next use (after the server behind ``alias`` was reconfigured)."""
    _servers.pop(alias, None)


def statement_budget(limit: int) -> int:
    """Bytes of escaped parameters one statement may carry under a packet ``limit``."""
    return max(limit - PACKET_HEADROOM, PACKET_HEADROOM)


def local_reply(raw: Any, query: Query) -> Reply | None:
    """The reply to ``query`` without asking the server, where it is known: the packet
    limit of ``raw`` (a DB-API connection), once asked."""
    if isinstance(query, PacketLimit):
        limit = _packet_limits.get(raw)
        if limit is not None:
            return (((limit,),), 1, 0, None)
    return None


def remember_reply(raw: Any, query: Query, reply: Reply) -> None:
    if isinstance(query, PacketLimit) or query is DETECT:
        _packet_limits[raw] = int(reply[0][0][-1])


# --- statement bytes and idle connections (both drivers) ---------------------------------


def literal(raw: Any, value: Any) -> bytes:
    """``value`` as an SQL literal, escaped by the DB-API connection ``raw`` (its
    character set and ``NO_BACKSLASH_ESCAPES`` mode): strings and bytes through
    ``string_literal``, bytes marked ``_binary``."""
    if isinstance(value, str):
        return raw.string_literal(value.encode(raw.encoding))
    if isinstance(value, int) and not isinstance(value, bool):
        return b"%d" % value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"_binary" + raw.string_literal(bytes(value))
    if value is None:
        return b"NULL"
    raise TypeError(f"no SQL literal for {type(value).__name__}")


def statement_bytes(raw: Any, sql: str, params: Sequence[Any]) -> bytes:
    """The statement as sent: ``%s`` replaced by escaped literals (``%%`` by ``%``)."""
    encoded = sql.encode(raw.encoding)
    if not params:
        return encoded.replace(b"%%", b"%")
    return encoded % tuple([literal(raw, value) for value in params])


def watcher(fd: int) -> Callable[[], bool]:
    """:func:`readable` for one connection's descriptor, made once (a poll object
    registered once: making one per check costs three times as much). Asked of an idle
    connection: the server sends nothing between statements unless it ends the session
    (a closed socket, or an error packet such as MySQL's 4031), so a connection it
    dropped while idle is found out before any statement is sent on it."""
    if not hasattr(select, "poll"):
        return lambda: readable(fd)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poll = poller.poll
    return lambda: bool(poll(0))  # a closed descriptor reports POLLNVAL: true, hung up


def readable(fd: int) -> bool:
    """Whether ``fd`` has something to read now (a zero-timeout poll)."""
    if hasattr(select, "poll"):  # select() refuses descriptors above FD_SETSIZE (1024)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])
