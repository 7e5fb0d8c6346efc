"""MySQLCache's own connections: opened from an alias's DATABASES entry, never Django's.

Both drivers (blocking and asyncio) send their statements on mysqlclient connections of
the backend's own, opened here. Django's connection of the thread is never used for a
cache statement: Django's ``TestCase.databases`` check, ``atomic()``,
``ATOMIC_REQUESTS``, ``execute_wrapper()`` and DEBUG query logging do not touch them,
and every cache statement commits on its own (autocommit).

The parameters are Django's own (the alias's backend's ``get_connection_params()``:
host, port or socket, user, database, charset, TLS, timeouts, ``init_command``,
``sql_mode`` and the other OPTIONS; ``CLIENT.FOUND_ROWS``), then autocommit and the
session's transaction isolation level, as Django sets them, and the cache's timeouts
(:class:`ConnectionSettings`): its OPTIONS' CONNECT_TIMEOUT and IO_TIMEOUT, else the
alias's ``connect_timeout``/``read_timeout``/``write_timeout``, else the defaults here —
so no connection of the cache waits for ever. They are read each time a
connection opens, from the settings Django's connection of this thread would use, so a
test database (``create_test_db`` renames the database in place) and a ``TEST: MIRROR``
alias are followed. Django points a mirror at its test database only in the thread that
sets the databases up, and only once every test database is built; the cache's
connections reach the test database from the moment it exists, in every thread (a live
server's too).

What a connection is, and what a fork does to it, is :mod:`~django_kvcache.mysql.connection`'s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.creation import TEST_DATABASE_PREFIX
from django.db.utils import load_backend

from django_kvcache.mysql import errors
from django_kvcache.mysql.connection import Connection, opened, poller
from django_kvcache.options import integer, seconds

#: Connections per process and alias on the sync API, and per event loop and alias on
#: the async API (OPTIONS["MAX_POOL_SIZE"]).
DEFAULT_POOL_SIZE = 16
#: Seconds a thread or coroutine waits for a pooled connection (OPTIONS["POOL_TIMEOUT"]).
DEFAULT_POOL_TIMEOUT = 1.0
#: Seconds to open a connection where neither the cache's OPTIONS (CONNECT_TIMEOUT) nor
#: the alias's (``connect_timeout``) say: as the memcached backend's (a LAN connect and
#: login take milliseconds). mysqlclient counts it in whole seconds.
DEFAULT_CONNECT_TIMEOUT = 1.0
#: Seconds a statement's reply may take where neither the cache's OPTIONS (IO_TIMEOUT)
#: nor the alias's (``read_timeout``) say. Twice the memcached backend's: the slowest
#: statements the cache sends legitimately (a cull or clear batch of 10,000 rows, a
#: set_many of megabytes) took 0.05–0.4 s on the development machine under load
#: (docs/benchmarks.rst, "Timeouts"), and a statement that runs out of time counts
#: against its server's health.
DEFAULT_IO_TIMEOUT = 2.0
#: ``mysql_set_server_option``'s MYSQL_OPTION_MULTI_STATEMENTS_OFF (mysqlclient exports
#: no name for it): one statement a query. mysqlclient turns multiple statements on for
#: every connection, and a second result nobody reads leaves the connection out of step
#: ("Commands out of sync") for the next caller; the cache never sends two at once.
MULTI_STATEMENTS_OFF = 1
#: A timeout the cache's OPTIONS leave to the alias (and then to the default).
FROM_ALIAS: Any = "from the alias"

#: alias -> (its configured entry, the settings a TEST MIRROR pointed it at).
_mirrored: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}


def server_settings(alias: str) -> dict[str, Any]:
    """The DATABASES settings ``alias``'s connections use now (see the module)."""
    entry = connections.settings[alias]
    current = connections[alias].settings_dict  # reads settings; never connects
    if current is not entry:  # a TEST MIRROR, in the thread that set it
        _mirrored[alias] = (entry, current)
        return current
    mirrored = _mirrored.get(alias)
    if mirrored is not None and mirrored[0] is entry:
        return mirrored[1]
    mirror = (entry.get("TEST") or {}).get("MIRROR")
    if mirror and mirror in connections.settings:
        primary = connections.settings[mirror]
        if is_test_database_of(primary, entry):  # Django has not pointed it there yet
            return primary
    return entry


def is_test_database_of(primary: dict[str, Any], mirror: dict[str, Any]) -> bool:
    """Whether ``primary`` names the test database the test runner made for the real
    database ``mirror`` still names (its TEST NAME, or ``test_`` and that name): then
    tests are running, and the mirror is to reach it."""
    test_name = (primary.get("TEST") or {}).get("NAME") or TEST_DATABASE_PREFIX + str(
        mirror.get("NAME")
    )
    return primary.get("NAME") == test_name != mirror.get("NAME")


def remember_mirror(alias: str, settings: dict[str, Any]) -> None:
    """``alias`` now reaches the database of ``settings`` (a TEST MIRROR), in every thread."""
    _mirrored[alias] = (connections.settings[alias], settings)


@dataclass(frozen=True)
class ConnectionSettings:
    """How a cache opens and pools its connections to an alias (its OPTIONS): a pool per
    alias and settings (``docs/mysql.rst``, "Connections"). ``connect_timeout`` and
    ``io_timeout``: seconds, ``None`` (no limit), or :data:`FROM_ALIAS`."""

    max_size: int = DEFAULT_POOL_SIZE
    pool_timeout: float = DEFAULT_POOL_TIMEOUT
    connect_timeout: Any = FROM_ALIAS
    io_timeout: Any = FROM_ALIAS

    def __post_init__(self) -> None:
        # Hashed once: a pool is found by (alias, settings) on every statement.
        fields = (self.max_size, self.pool_timeout, self.connect_timeout, self.io_timeout)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]


DEFAULT_SETTINGS = ConnectionSettings()
#: For DDL (``kvcache_createtable``, ``migrate``'s step, an upgrade): a table's ALTER can
#: take minutes on a large table and must not be cut off by IO_TIMEOUT half way (the
#: command would fail with the server still altering); these run outside any request.
DDL_SETTINGS = ConnectionSettings(io_timeout=None)


def connection_settings(options: Mapping[str, Any]) -> ConnectionSettings:
    """The connection settings a cache's OPTIONS give (ImproperlyConfigured, naming the
    option, for a bad one: the backend names the cache)."""
    timeouts = {
        field: seconds(options, name, None, allow_none=True) if name in options else FROM_ALIAS
        for field, name in (("connect_timeout", "CONNECT_TIMEOUT"), ("io_timeout", "IO_TIMEOUT"))
    }
    return ConnectionSettings(
        max_size=integer(options, "MAX_POOL_SIZE", DEFAULT_POOL_SIZE),
        pool_timeout=seconds(options, "POOL_TIMEOUT", DEFAULT_POOL_TIMEOUT),  # type: ignore[arg-type]
        **timeouts,
    )


class ConnectionParams:
    """How to open one connection to an alias: mysqlclient's arguments, the statement
    that sets the session up (empty: none), and the seconds a connect and a reply may
    take (``None``: no limit)."""

    __slots__ = ("alias", "kwargs", "session_sql", "settings", "name", "connect_timeout",
                 "io_timeout")

    def __init__(
        self, alias: str, kwargs: dict[str, Any], session_sql: bytes, settings: dict[str, Any],
        connection: ConnectionSettings = DEFAULT_SETTINGS,
    ) -> None:
        self.alias, self.session_sql = alias, session_sql
        self.settings = settings  # the settings they were read from
        self.name = settings.get("NAME")  # the database, as it was then
        self.connect_timeout = _timeout(connection.connect_timeout, kwargs, "connect_timeout",
                                        DEFAULT_CONNECT_TIMEOUT)
        self.io_timeout = _timeout(connection.io_timeout, kwargs, "read_timeout",
                                   DEFAULT_IO_TIMEOUT)
        kwargs = {**kwargs}
        _set_seconds(kwargs, "connect_timeout", self.connect_timeout)
        _set_seconds(kwargs, "read_timeout", self.io_timeout)  # past the first bytes of a reply
        write = _timeout(connection.io_timeout, kwargs, "write_timeout", DEFAULT_IO_TIMEOUT)
        _set_seconds(kwargs, "write_timeout", write)
        self.kwargs = kwargs

    def current(self) -> bool:
        """Whether the settings still name the same database (a test database renames it
        in place)."""
        return self.settings.get("NAME") == self.name


def _timeout(option: Any, kwargs: dict[str, Any], name: str, default: float) -> float | None:
    """The cache's timeout, else the alias's ``name`` (0: none), else ``default``."""
    if option is not FROM_ALIAS:
        return option  # type: ignore[no-any-return]
    if name in kwargs:
        return float(kwargs[name]) or None
    return default


def _set_seconds(kwargs: dict[str, Any], name: str, timeout: float | None) -> None:
    """mysqlclient's ``name``: whole seconds (it takes no fraction), none for no limit."""
    if timeout is None:
        kwargs.pop(name, None)
    else:
        kwargs[name] = max(1, math.ceil(timeout))


def connection_params(
    alias: str, connection: ConnectionSettings = DEFAULT_SETTINGS
) -> ConnectionParams:
    """The arguments Django would connect ``alias`` with now, in autocommit mode, with the
    cache's timeouts."""
    settings = server_settings(alias)
    wrapper = load_backend(settings["ENGINE"]).DatabaseWrapper(settings, alias)
    if wrapper.vendor != "mysql":
        raise ImproperlyConfigured(
            f"MySQLCache needs a MySQL or MariaDB database; DATABASES[{alias!r}] uses the "
            f"{wrapper.vendor!r} backend"
        )
    kwargs = {**wrapper.get_connection_params(), "autocommit": True}
    level = getattr(wrapper, "isolation_level", None)  # set by get_connection_params
    session_sql = f"SET SESSION TRANSACTION ISOLATION LEVEL {level.upper()}".encode() if level else b""
    return ConnectionParams(alias, kwargs, session_sql, settings, connection)


def open_connection(params: ConnectionParams) -> Connection:
    """A new connection (blocking: mysqlclient has no asynchronous connect). An error is
    Django's, marked as met while connecting (:func:`errors.connect_failed`)."""
    try:
        raw = Connection(**params.kwargs)
    except Exception as exc:
        raise errors.connect_failed(exc)
    try:
        if raw.encoders.get(bytes) is bytes:  # as Django's get_new_connection()
            raw.encoders.pop(bytes)
        raw.set_server_option(MULTI_STATEMENTS_OFF)
        if params.session_sql:
            raw.query(params.session_sql)
        raw.alias = params.alias
        raw.io_timeout = params.io_timeout
        raw.poll = poller(raw.fileno())
    except BaseException as exc:
        raw.close()
        if isinstance(exc, Exception):
            raise errors.connect_failed(exc)
        raise
    opened.track(raw, params.alias)
    return raw
