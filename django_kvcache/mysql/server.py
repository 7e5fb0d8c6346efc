"""What MySQLCache knows about the servers behind its connections, and what both drivers
share below the failure policy: the statement bytes and the packet limit of a connection.

The flavour and version are detected once per alias and process (one ``SELECT``, the
first statement the policy sends to an alias it does not know). The packet limit belongs
to each connection (a session keeps the ``max_allowed_packet`` it started with), so it
is remembered per DB-API connection, and asked only when a statement might come near it:
never on the hot path.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence
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


# --- statement bytes (both drivers) ---------------------------------------------------------


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
    return raw.literal(value)  # anything else a tool passes: mysqlclient's own escaping


def statement_bytes(raw: Any, sql: str, params: Sequence[Any] | None) -> bytes:
    """The statement as sent: ``%s`` replaced by escaped literals (``%%`` by ``%``);
    ``None``: the text as it is (a tool's statement without parameters)."""
    encoded = sql.encode(raw.encoding)
    if params is None:
        return encoded
    if not params:
        return encoded.replace(b"%%", b"%")
    return encoded % tuple([literal(raw, value) for value in params])
