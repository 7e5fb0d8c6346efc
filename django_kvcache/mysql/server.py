"""What MySQLCache needs to know about the server behind a Django connection alias.

The flavour and version are detected once per alias and process (one ``SELECT``). The
packet limit belongs to each database connection (a session keeps the
``max_allowed_packet`` it started with), so it is read once per connection, and only when
a statement might come near it: never on the hot path.
"""
from __future__ import annotations

import logging
import re
import select
from dataclasses import dataclass
from operator import methodcaller
from typing import Any, Callable, TypeVar
from weakref import WeakKeyDictionary

from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

logger = logging.getLogger(__name__)
T = TypeVar("T")
fetchone = methodcaller("fetchone")

#: Client/server error codes meaning "the connection is gone", not "the statement failed":
#: 2006 server has gone away, 2013 lost connection during query (what a KILLed or timed
#: out connection reports), 2055 lost connection (extended), 1927 MariaDB connection
#: killed, 4031 MySQL client interaction timeout.
DISCONNECTED = frozenset({2006, 2013, 2055, 1927, 4031})

#: The ones that prove the server never ran the statement: the client library reports
#: 2006 when it could not send the statement, and MySQL sends 4031 when it closes an idle
#: session, before reading what comes next. After the others the reply was lost, and the
#: server may have run the statement (or been killed in the middle of it).
NOT_SENT = frozenset({2006, 4031})

#: Errors after which InnoDB has rolled the statement back: 1213 deadlock, 1205 lock wait
#: timeout. Outside a transaction the statement had no effect and can run again.
ROLLED_BACK = frozenset({1213, 1205})

#: Room left in a packet for the statement text around the parameters.
PACKET_HEADROOM = 4096


@dataclass(frozen=True)
class ServerInfo:
    mariadb: bool
    version: tuple[int, ...]
    max_allowed_packet: int  # as the connection that detected the server had it

    @property
    def row_alias(self) -> bool:
        """``INSERT … AS new`` exists from MySQL 8.0.19; MariaDB has only ``VALUES()``."""
        return not self.mariadb and self.version >= (8, 0, 19)


_servers: dict[str, ServerInfo] = {}
#: ``max_allowed_packet`` per DB-API connection, forgotten with the connection.
_packet_limits: WeakKeyDictionary[Any, int] = WeakKeyDictionary()


def require_mysql(connection: BaseDatabaseWrapper) -> None:
    if connection.vendor != "mysql":
        raise ImproperlyConfigured(
            f"MySQLCache needs a MySQL or MariaDB database; DATABASES[{connection.alias!r}] "
            f"uses the {connection.vendor!r} backend"
        )


def parse_version(text: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(part) for part in match.groups()) if match else (0, 0, 0)


def server_info(connection: BaseDatabaseWrapper) -> ServerInfo:
    """The server behind ``connection``, queried the first time an alias is used."""
    info = _servers.get(connection.alias)
    if info is None:
        require_mysql(connection)
        query = "SELECT VERSION(), @@max_allowed_packet"
        version, max_packet = run(connection, query, (), fetchone)
        info = ServerInfo("mariadb" in version.lower(), parse_version(version), int(max_packet))
        _servers[connection.alias] = info
        _packet_limits[connection.connection] = info.max_allowed_packet
    return info


def statement_budget(connection: BaseDatabaseWrapper) -> int:
    """Bytes of escaped parameters one statement may carry on this connection."""
    raw = connection.connection
    limit = _packet_limits.get(raw) if raw is not None else None
    if limit is None:
        (limit,) = run(connection, "SELECT @@max_allowed_packet", (), fetchone)
        # Keyed after the query: a retry may have opened a new connection.
        _packet_limits[connection.connection] = limit = int(limit)
    return max(limit - PACKET_HEADROOM, PACKET_HEADROOM)


def forget_server(alias: str) -> None:
    """Detect again on next use (after the server behind ``alias`` was reconfigured)."""
    _servers.pop(alias, None)


def error_code(exc: Exception) -> int | None:
    return exc.args[0] if exc.args and isinstance(exc.args[0], int) else None


def is_lock_conflict(exc: Exception) -> bool:
    return error_code(exc) in ROLLED_BACK


def in_transaction(connection: BaseDatabaseWrapper) -> bool:
    return connection.in_atomic_block or not connection.autocommit


def run(
    connection: BaseDatabaseWrapper,
    sql: str,
    params: Any,
    read: Callable[[Any], T],
    idempotent: bool = True,
) -> T:
    """Execute one statement and ``read`` its result from the cursor.

    Outside a transaction, the statement is retried once after a dropped connection
    (server restart, ``wait_timeout``, ``KILL``: on a fresh connection) or a deadlock or
    lock wait timeout (InnoDB rolled the statement back). Inside one the error is raised:
    the transaction's earlier work is lost, so only the caller may decide what to do.

    A statement that must not run twice (``idempotent=False``: ``add``, ``incr``) is
    retried after a dropped connection only when the server cannot have run it
    (``NOT_SENT``). So that a connection the server closed while it sat idle (the usual
    case) costs no error, such a statement first checks, without a round trip, whether
    the server has hung up, and reconnects before sending.
    """
    if not idempotent and not in_transaction(connection):
        close_if_hung_up(connection)
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return read(cursor)
    except OperationalError as exc:
        code = error_code(exc)
        if in_transaction(connection):
            raise
        if code in DISCONNECTED:
            connection.close()  # the next call starts on a fresh connection either way
        if not may_retry(code, idempotent):
            if code in DISCONNECTED:
                logger.warning(
                    "Not retried after error %s (the server may have run it): %s", code, sql
                )
            raise
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return read(cursor)


def may_retry(code: int | None, idempotent: bool) -> bool:
    if code in ROLLED_BACK or code in NOT_SENT:
        return True
    return idempotent and code in DISCONNECTED


def close_if_hung_up(connection: BaseDatabaseWrapper) -> None:
    """Close ``connection`` if the server has closed its end (a zero-timeout poll).

    Between statements the server sends nothing unless it is ending the session (a
    closed socket, or an error packet such as 4031 before closing), so a readable socket
    means the connection is gone.
    """
    raw = connection.connection
    if raw is not None and readable(raw.fileno()):
        connection.close()


def readable(fd: int) -> bool:
    if hasattr(select, "poll"):  # select() refuses descriptors above FD_SETSIZE (1024)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])
