"""The cache's pools of connections: one pool type, keyed the same on both drivers.

A pool holds connections to one database alias opened with one
:class:`~django_kvcache.mysql.connect.ConnectionSettings` (MAX_POOL_SIZE, POOL_TIMEOUT,
CONNECT_TIMEOUT, IO_TIMEOUT): every cache of the process with those settings on that
alias shares it, and a cache with other settings has a pool of its own. The blocking
driver's pools are the process's, shared by its threads (:func:`process_pool`); the
asyncio driver's belong to one event loop each (:func:`loop_pool`, closed with the loop:
:mod:`django_kvcache.loops`). Both are a :class:`ServerPool`: what a MySQL pool adds to
:mod:`django_kvcache.pool`'s core, written once — how a connection opens, whether an idle
one may still be used, what a timed-out wait raises, when a pool retires — over that
core's two ways to wait for a connection (a thread's lock, a coroutine's future).

A pool retires when its alias names another database (a test database renames it in
place) or was redefined: its idle connections close, the ones in use when they come back,
and the next call makes a new pool. :func:`figures` gives one set of counters for both
drivers.
"""
from __future__ import annotations

from typing import Any, Sequence

from django.db import connections

from django_kvcache import forks, pool
from django_kvcache.loops import PerLoop
from django_kvcache.mysql import errors
from django_kvcache.mysql.connect import (
    DEFAULT_SETTINGS,
    ConnectionParams,
    ConnectionSettings,
    connection_params,
    open_connection,
)
from django_kvcache.mysql.connection import Connection

Key = tuple[str, ConnectionSettings]


class ServerPool:
    """What both drivers' pools of one alias and settings add to :mod:`django_kvcache.pool`
    (mixed in before :class:`~django_kvcache.pool.BlockingPool` or
    :class:`~django_kvcache.pool.LoopPool`)."""

    #: Whose connections these are, for the message of a wait that timed out.
    holder = "this process"
    retired = False

    def __init__(self, alias: str, settings: ConnectionSettings) -> None:
        super().__init__(settings.max_size, settings.pool_timeout)  # type: ignore[call-arg]
        self.alias = alias
        self.settings = settings
        self.entry = connections.settings[alias]  # replaced when the alias is redefined
        self.params: ConnectionParams | None = None  # of the last connection opened
        self.reconnects = 0  # idle connections found closed by the server, replaced

    def open(self) -> Connection:
        """A new connection, with the settings of now (a test database, a mirror)."""
        params = self.params = connection_params(self.alias, self.settings)
        return open_connection(params)

    def usable(self, connection: Connection) -> bool:
        """Not closed by the server while idle: no statement is sent on a connection the
        server has closed, so none has to run twice."""
        if connection.hung_up():
            self.reconnects += 1
            return False
        return True

    def exhausted(self) -> errors.PoolExhausted:
        return errors.PoolExhausted(
            f"all {self.max_size} connections of {self.holder} to {self.alias!r} busy "  # type: ignore[attr-defined]
            f"for {self.timeout:g} s (MAX_POOL_SIZE, POOL_TIMEOUT)"  # type: ignore[attr-defined]
        )

    def current(self) -> bool:
        """Whether the alias still means what it meant when the pool was made."""
        return self.entry is connections.settings[self.alias] and (
            self.params is None or self.params.current()
        )

    def retire(self) -> None:
        """Close the idle connections, and from now on each one that comes back."""
        self.retired = True
        self.checkin = self.discard  # type: ignore[attr-defined, method-assign]
        self.close_idle()  # type: ignore[attr-defined]

    def after_fork(self) -> None:
        super().after_fork()  # type: ignore[misc]
        self.reconnects = 0

    def figures(self) -> dict[str, float]:  # type: ignore[override]
        return {**super().figures(), "reconnects": self.reconnects}  # type: ignore[misc]


class ProcessPool(ServerPool, pool.BlockingPool[Connection]):
    """The process's connections to one alias, shared by its threads."""


class LoopPool(ServerPool, pool.LoopPool[Connection]):
    """One event loop's connections to one alias, for its coroutines."""

    holder = "this event loop"


# --- the pools of the process and of each event loop -----------------------------------------


def _current(pools: dict[Key, Any], key: Key, make: Any) -> Any:
    """``pools[key]``, made (and the one it replaces retired) when missing or no longer
    current."""
    found = pools.get(key)
    if found is not None and found.current():
        return found
    if found is not None:
        pools.pop(key, None)
        found.retire()
    made = pools[key] = make(*key)
    return made


#: (alias, settings) -> the process's pool.
_process: forks.Registry[Key, ProcessPool] = forks.Registry()
#: Per event loop: (alias, settings) -> that loop's pool.
_loops: PerLoop[dict[Key, LoopPool]] = PerLoop(dict, lambda pools: close_each(pools.values()))


def process_pool(alias: str, settings: ConnectionSettings = DEFAULT_SETTINGS) -> ProcessPool:
    """The process's pool for ``alias`` and ``settings``, shared by its threads."""
    found = _process.items.get((alias, settings))
    if found is not None and found.entry is connections.settings[alias] and (
        found.params is None or found.params.current()  # (current(), inlined: every call)
    ):
        return found
    with _process.lock:
        return _current(_process.items, (alias, settings), ProcessPool)  # type: ignore[no-any-return]


def loop_pool(alias: str, settings: ConnectionSettings = DEFAULT_SETTINGS) -> LoopPool:
    """The running event loop's pool for ``alias`` and ``settings`` (call it on the loop)."""
    pools = _loops.get()
    found = pools.get((alias, settings))
    if found is not None and found.current():
        return found
    return _current(pools, (alias, settings), LoopPool)  # type: ignore[no-any-return]


def close_each(pools: Any) -> None:
    for each in list(pools):
        each.close_idle()


def close_idle(aliases: Sequence[str], loop: bool = False) -> None:
    """Close the idle connections to ``aliases`` of the process's pools, or (``loop``)
    of the running event loop's."""
    if loop:
        pools = _loops.existing()
        close_each([] if pools is None else
                   [each for each in pools.values() if each.alias in aliases])
    else:
        close_each([each for each in _process.values() if each.alias in aliases])


def retire(aliases: Sequence[str]) -> None:
    """Forget the process's pools for ``aliases`` (their settings now name another
    database): idle connections are closed, the ones in use when they come back."""
    with _process.lock:
        found = [(key, each) for key, each in _process.items.items() if each.alias in aliases]
        for key, _ in found:
            _process.items.pop(key, None)
    for _, each in found:
        each.retire()


def figures(alias: str, settings: ConnectionSettings = DEFAULT_SETTINGS) -> dict[str, Any]:
    """The counters of the pools for ``alias`` and ``settings`` (for ``metrics()``): the
    process's as ``pool_*``, every event loop's summed as ``async_pool_*`` with
    ``async_loops`` (read from any thread; each figure is one read of a pool's counters).
    None before a pool's first use."""
    key = (alias, settings)
    found: dict[str, Any] = {}
    process = _process.items.get(key)
    if process is not None:
        found.update((f"pool_{name}", value) for name, value in process.figures().items())
    loops = [each.figures() for each in (pools.get(key) for pools in _loops.every())
             if each is not None]
    if loops:
        found["async_loops"] = len(loops)
        for name in loops[0]:
            total = sum(each[name] for each in loops)
            found[f"async_pool_{name}"] = round(total, 6) if name == "wait_seconds" else total
    return found


def process_pools() -> list[ProcessPool]:
    """Every pool of the process (for tests and tools)."""
    return _process.values()
