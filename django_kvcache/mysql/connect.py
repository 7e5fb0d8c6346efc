"""MySQLCache's own connections: opened from an alias's DATABASES entry, never Django's.

Both drivers (blocking and asyncio) send their statements on mysqlclient connections of
the backend's own, opened here. Django's connection of the thread is never used for a
cache statement: Django's ``TestCase.databases`` check, ``atomic()``,
``ATOMIC_REQUESTS``, ``execute_wrapper()`` and DEBUG query logging do not touch them,
and every cache statement commits on its own (autocommit).

The parameters are Django's own (the alias's backend's ``get_connection_params()``:
host, port or socket, user, database, charset, TLS, timeouts, ``init_command``,
``sql_mode`` and the other OPTIONS; ``CLIENT.FOUND_ROWS``), then autocommit and the
session's transaction isolation level, as Django sets them. They are read each time a
connection opens, from the settings Django's connection of this thread would use, so a
test database (``create_test_db`` renames the database in place) and a ``TEST: MIRROR``
alias are followed. Django points a mirror at its test database only in the thread that
sets the databases up, and only once every test database is built; the cache's
connections reach the test database from the moment it exists, in every thread (a live
server's too).

A forked child must never close a connection it inherited: closing sends ``COM_QUIT``
on the socket it shares with its parent, which ends the parent's session. Every open
connection is held by :data:`opened` until the cache closes it, so the garbage collector
never closes one; a forked child keeps the inherited ones there, unused, their
descriptors pointed at ``/dev/null``: however the child exits — ``os._exit()``, or
``sys.exit()`` as gunicorn's, uWSGI's and Celery's workers do, when the interpreter
deallocates every object and mysqlclient closes what it still holds — its ``COM_QUIT``
goes nowhere.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import MySQLdb
import MySQLdb.connections
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.creation import TEST_DATABASE_PREFIX
from django.db.utils import load_backend

from django_kvcache import forks
from django_kvcache.mysql.server import watcher

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


class ConnectionParams:
    """How to open one connection to an alias: mysqlclient's arguments and the
    statement that sets the session up (empty: none)."""

    __slots__ = ("alias", "kwargs", "session_sql", "settings", "name")

    def __init__(
        self, alias: str, kwargs: dict[str, Any], session_sql: bytes, settings: dict[str, Any]
    ) -> None:
        self.alias, self.kwargs, self.session_sql = alias, kwargs, session_sql
        self.settings = settings  # the settings they were read from
        self.name = settings.get("NAME")  # the database, as it was then

    def current(self) -> bool:
        """Whether the settings still name the same database (a test database renames it
        in place)."""
        return self.settings.get("NAME") == self.name


def connection_params(alias: str) -> ConnectionParams:
    """The arguments Django would connect ``alias`` with now, in autocommit mode."""
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
    return ConnectionParams(alias, kwargs, session_sql, settings)


class OwnConnection(MySQLdb.connections.Connection):
    """A mysqlclient connection of the cache's own: held open by :data:`opened` until
    :meth:`close` (never by the garbage collector), which never raises (it may be closed
    already, or its server gone), so a pool can always let it go. ``has_input()``: whether
    the server sent something (between statements, only when it ends the session)."""

    has_input: Callable[[], bool]

    def close(self) -> None:
        opened.forget(self)
        try:
            super().close()
        except Exception:  # already closed, or the server is gone: nothing to keep
            pass


def open_connection(params: ConnectionParams) -> OwnConnection:
    """A new mysqlclient connection (blocking: mysqlclient has no asynchronous connect).
    Errors are mysqlclient's (``MySQLdb.OperationalError`` ...)."""
    raw = OwnConnection(**params.kwargs)
    try:
        if raw.encoders.get(bytes) is bytes:  # as Django's get_new_connection()
            raw.encoders.pop(bytes)
        if params.session_sql:
            raw.query(params.session_sql)
        raw.has_input = watcher(raw.fileno())
    except BaseException:
        raw.close()
        raise
    opened.track(raw, params.alias)
    return raw


class Retiring:
    """What both drivers' pools of an alias add to :mod:`django_kvcache.pool`'s: once the
    alias names another database (or was redefined), the pool is retired: its idle
    connections are closed, the ones in use when they come back."""

    retired = False

    def checkin(self, connection: Any) -> None:
        if self.retired:
            self.discard(connection)  # type: ignore[attr-defined]
        else:
            super().checkin(connection)  # type: ignore[misc]

    def retire(self) -> None:
        self.retired = True
        self.close_idle()  # type: ignore[attr-defined]


class Opened:
    """Every connection this process opened and has not closed, with its alias.

    Held here, a connection is closed only by its :meth:`OwnConnection.close`, never by
    the garbage collector — which would also close, in a forked child, the connections
    it inherited when the pools forget them (see the module). The child keeps those,
    unused, their sockets replaced by ``/dev/null``."""

    def __init__(self) -> None:
        self.open: dict[Any, str] = {}
        self.inherited: list[dict[Any, str]] = []
        forks.register(self)

    def track(self, raw: Any, alias: str) -> None:
        self.open[raw] = alias

    def forget(self, raw: Any) -> None:
        self.open.pop(raw, None)

    def after_fork(self) -> None:
        """In a forked child: the parent's connections are kept, never used, and their
        descriptors now name ``/dev/null``, so that whatever closes them — this process
        closing a connection, or mysqlclient at interpreter exit — writes its
        ``COM_QUIT`` there, not on the socket the child shares with its parent."""
        inherited, self.open = self.open, {}
        self.inherited.append(inherited)
        if not inherited:
            return
        nowhere = os.open(os.devnull, os.O_RDWR)
        try:
            for raw in inherited:
                try:
                    os.dup2(nowhere, raw.fileno(), inheritable=False)
                except Exception:  # noqa: BLE001  (closed already: nothing of the parent's)
                    continue
        finally:
            os.close(nowhere)


opened = Opened()


def alias_of(raw: Any) -> str | None:
    """The alias a connection of this process was opened for (None: not one of ours)."""
    return opened.open.get(raw)
