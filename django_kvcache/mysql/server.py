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
from typing import Any, Callable, Sequence, TypeVar
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
        return execute(connection, sql, params, read)
    except OperationalError as exc:
        if not may_run_again(connection, exc, sql, idempotent):
            raise
    return execute(connection, sql, params, read)


def execute(connection: BaseDatabaseWrapper, sql: str, params: Any, read: Callable[[Any], T]) -> T:
    if may_bypass_cursor(connection):
        check_before_bypass(connection)
        if connection.connection is not None:
            return execute_directly(connection, sql, params, read)
    with connection.cursor() as cursor:  # connects; shows the statement to its watchers
        cursor.execute(sql, params)
        return read(cursor)


def execute_directly(
    connection: BaseDatabaseWrapper, sql: str, params: Any, read: Callable[[Any], T]
) -> T:
    """``sql`` on the backend's own cursor of the open connection (``create_cursor()``:
    for MySQL the DB-API cursor with Django's error-code mapping), without the wrappers
    of ``connection.cursor()`` (~25 µs a statement here, a third of a primary-key
    SELECT). What they do that matters outside a transaction is done here (after
    ``check_before_bypass``): Django's exceptions, closing the cursor whatever happens;
    ``create_cursor`` itself carries Django's check against a sync call inside an event
    loop."""
    with connection.wrap_database_errors:
        cursor = connection.create_cursor()
        try:
            cursor.execute(sql, params)
            return read(cursor)
        finally:
            try:
                cursor.close()
            except connection.Database.Error:  # never hides the statement's own error
                pass


def may_run_again(
    connection: BaseDatabaseWrapper, exc: OperationalError, sql: str, idempotent: bool
) -> bool:
    """``run()``'s rules after ``exc``: whether ``sql`` may run once more. A dropped
    connection is closed either way, so the next statement starts on a fresh one."""
    code = error_code(exc)
    if in_transaction(connection):
        return False
    if code in DISCONNECTED:
        connection.close()
    if may_retry(code, idempotent):
        return True
    if code in DISCONNECTED:
        logger.warning("Not retried after error %s (the server may have run it): %s", code, sql)
    return False


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


# --- several connections in one round trip ----------------------------------------------
#
# mysqlclient's connection has public ``send_query()`` / ``read_query_result()`` (the C
# API's mysql_send_query / mysql_read_query_result, in mysqlclient since 1.3.2): sending
# every shard's statement before reading any reply makes a batch over N servers cost one
# round trip instead of N, from the calling thread.


@dataclass
class Pending:
    """One statement of ``run_each``: its outcome (the rows of a SELECT, else the affected
    row count) or its error once ``run_each`` returns."""

    connection: BaseDatabaseWrapper
    sql: str  # with ``%s`` placeholders, as for ``cursor.execute``
    params: Sequence[Any]
    idempotent: bool = True
    outcome: Any = None
    error: Exception | None = None


def check_before_bypass(connection: BaseDatabaseWrapper) -> None:
    """What ``connection.cursor()`` checks first, for a statement that bypasses it: the
    CONN_HEALTH_CHECKS ping (a dead connection is closed, so the next use reconnects)
    and that this thread may use the connection."""
    connection.close_if_health_check_failed()
    connection.validate_thread_sharing()


def may_bypass_cursor(connection: BaseDatabaseWrapper) -> bool:
    """Whether statements may bypass Django's cursor on ``connection``: only outside a
    transaction (``run()``'s retry rules), and when nobody watches statements (DEBUG or
    ``assertNumQueries`` logging, ``connection.execute_wrapper()`` instrumentation), so
    that those still see every statement, sent through the cursor."""
    if connection.queries_logged or connection.execute_wrappers or connection.in_atomic_block:
        return False
    return autocommits(connection)


def autocommits(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection`` is (or, not connected yet, will be) in autocommit mode —
    asked without connecting: its server may be down."""
    if connection.connection is None:  # it connects in the mode its settings ask for
        return bool(connection.settings_dict["AUTOCOMMIT"])
    return bool(connection.autocommit)


def literal(raw: Any, value: Any) -> bytes:
    """``value`` as an SQL literal, escaped by the DB-API connection ``raw`` (its
    character set and ``NO_BACKSLASH_ESCAPES`` mode): strings and bytes through
    ``string_literal``, bytes marked ``_binary``, numbers through ``escape``."""
    if isinstance(value, str):
        return raw.string_literal(value.encode(raw.encoding))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"_binary" + raw.string_literal(bytes(value))
    if isinstance(value, int) and not isinstance(value, bool):
        escaped = raw.escape(value, raw.encoders)
        return escaped.encode("ascii") if isinstance(escaped, str) else escaped
    raise TypeError(f"no SQL literal for {type(value).__name__} in a pipelined statement")


def statement_bytes(raw: Any, sql: str, params: Sequence[Any]) -> bytes:
    """The statement as the driver sends it: ``%s`` replaced by escaped literals."""
    return sql.encode(raw.encoding) % tuple(literal(raw, value) for value in params)


def rows_or_count(cursor: Any) -> Any:
    """What ``run_each`` reads from a statement run through a cursor (after a retry)."""
    return cursor.fetchall() if cursor.description is not None else cursor.rowcount


def send(pending: Pending) -> bool:
    """Send one statement without waiting for its reply; False (and ``pending.error``) when
    it could not be sent."""
    connection = pending.connection
    try:
        check_before_bypass(connection)
        connection.ensure_connection()
        if not pending.idempotent:
            close_if_hung_up(connection)
            connection.ensure_connection()
        raw = connection.connection
        query = statement_bytes(raw, pending.sql, pending.params)
        with connection.wrap_database_errors:
            raw.send_query(query)
    except Exception as exc:  # this statement's error: the others go on
        pending.error = exc
        return False
    return True


def run_each(statements: list[Pending]) -> None:
    """Send every statement (each on its own connection), then read every reply.

    Never raises for a statement: each ``Pending`` gets its outcome or its error. Every
    reply sent for is read before anything is retried, so no connection is left with an
    unread result; a connection whose reply could not be read is closed. A failed
    statement then follows ``run()``'s rules, each on its own: retried once through the
    cursor (on a fresh connection after a dropped one) when it may run again, so a lost
    reply of a statement that must not run twice (``idempotent=False``) stays an error.
    The callers use it only where ``may_bypass_cursor()`` holds.
    """
    sent: list[Pending] = []
    try:
        for pending in statements:
            if send(pending):
                sent.append(pending)
    except BaseException:  # interrupted between two sends: no reply is left unread
        for pending in sent:
            pending.connection.close()
        raise
    read = 0
    try:
        for pending in sent:
            receive(pending)
            read += 1
    finally:
        for pending in sent[read:]:  # interrupted (KeyboardInterrupt...): drop unread replies
            pending.connection.close()
    for pending in statements:
        exc = pending.error
        if isinstance(exc, OperationalError) and may_run_again(
            pending.connection, exc, pending.sql, pending.idempotent
        ):
            try:
                pending.outcome = execute(
                    pending.connection, pending.sql, pending.params, rows_or_count
                )
                pending.error = None
            except Exception as again:
                pending.error = again


def receive(pending: Pending) -> None:
    """Read the reply of ``pending``'s statement: its rows or its affected row count."""
    connection = pending.connection
    raw = connection.connection
    try:
        with connection.wrap_database_errors:
            raw.read_query_result()
    except Exception as exc:  # an error reply carries no result set: nothing left unread
        pending.error = exc
        return
    try:
        with connection.wrap_database_errors:
            result = raw.store_result()
            pending.outcome = raw.affected_rows() if result is None else result.fetch_row(0)
    except BaseException as exc:
        connection.close()  # rows may be left unread on it
        if not isinstance(exc, Exception):
            raise
        pending.error = exc
