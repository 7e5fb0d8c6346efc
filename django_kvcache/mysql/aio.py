"""The asyncio driver: the policy's statements on the event loop's own connections.

Per event loop and per database alias, a small pool of mysqlclient connections of the
backend's own (:class:`AliasPool`, at most MAX_POOL_SIZE, waiting at most POOL_TIMEOUT),
built from the alias's DATABASES entry the way Django builds its own (Django's
``get_connection_params()``: host, port, user, database, charset, TLS, timeouts,
``init_command``; then autocommit and the session's transaction isolation level, as
Django sets them). Never Django's connection of the thread: async code never runs inside
a caller's ``atomic()``, and a statement on the async API commits on its own.

A statement is sent with ``send_query``, the loop waits for the socket to become
readable (``loop.add_reader``; at most the alias's ``read_timeout``, after which the
connection is closed and the statement fails as a lost reply, as the blocking client
reports it), then ``read_query_result`` reads the reply. What still blocks the loop:
opening a connection (``connect``, up to ``connect_timeout``), sending a statement larger
than the socket's buffer, and reading a reply that has not fully arrived once the first
bytes have (a large result).

A pool belongs to the loop that made it and is only touched from that loop's thread, so
it needs no lock; its connections close when the loop shuts down
(``loop.shutdown_asyncgens()``, which ``asyncio.run``, asgiref and uvicorn call).
"""
from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections import deque
from typing import Any, AsyncIterator, Sequence

import MySQLdb
from django.db import OperationalError, connections

from django_kvcache.mysql import errors, policy
from django_kvcache.mysql.cluster import Session
from django_kvcache.mysql.query import Query, Reply
from django_kvcache.mysql.server import hung_up, local_reply, remember_reply, statement_bytes


async def execute(session: Session, calls: Sequence[policy.Call]) -> list[Any]:
    """:func:`policy.execute` on the running loop's connections."""
    engine = policy.execute(session, calls)
    cluster = session.cluster
    replies: Any = None
    try:
        while True:
            try:
                exchange = engine.send(replies)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            replies = await perform(exchange.items, cluster.max_pool_size, cluster.pool_timeout)
    finally:
        engine.close()  # interrupted (cancelled): the policy lets go of what it holds


class OwnConnection:
    """One DB-API connection of the pool; ``raw`` is mysqlclient's."""

    __slots__ = ("raw", "fd")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.fd = raw.fileno()

    def close(self) -> None:
        try:
            self.raw.close()
        except Exception:  # already closed, or the server is gone: nothing to keep
            pass


class AliasPool:
    """One loop's connections to one alias (see the module docstring)."""

    def __init__(self, alias: str, max_size: int, timeout: float) -> None:
        wrapper = connections[alias]  # this thread's: its settings, never its connection
        self.settings = wrapper.settings_dict
        self.params = {**wrapper.get_connection_params(), "autocommit": True}
        level = getattr(wrapper, "isolation_level", None)  # set by get_connection_params
        self.session_sql = (
            f"SET SESSION TRANSACTION ISOLATION LEVEL {level.upper()}".encode() if level else b""
        )
        self.read_timeout = self.params.get("read_timeout") or None
        self.max_size, self.timeout = max_size, timeout
        self.idle: list[OwnConnection] = []
        self.waiters: deque[asyncio.Future] = deque()
        self.size = 0
        self.connects = 0

    async def checkout(self) -> OwnConnection:
        if self.idle and not self.waiters:
            return self.idle.pop()
        if self.size < self.max_size:
            return self._connect()
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            handed = await asyncio.wait_for(waiter, self.timeout)
        except (TimeoutError, asyncio.TimeoutError):  # two classes on Python 3.10
            raise errors.PoolExhausted(
                f"all {self.max_size} connections of this event loop to "
                f"{self.settings.get('NAME')!r} busy for {self.timeout} s (MAX_POOL_SIZE, "
                "POOL_TIMEOUT)"
            ) from None
        except BaseException:  # cancelled just as a connection was handed over: pass it on
            if waiter.done() and not waiter.cancelled():
                handed = waiter.result()
                self._free_slot() if handed is None else self.checkin(handed)
            raise
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)
        return handed if handed is not None else self._connect(counted=True)

    def _connect(self, counted: bool = False) -> OwnConnection:
        """A new connection (blocking: mysqlclient has no asynchronous connect)."""
        if not counted:
            self.size += 1
        try:
            raw = MySQLdb.connect(**self.params)
            if self.session_sql:
                raw.query(self.session_sql)
        except BaseException:
            self._free_slot()
            raise
        self.connects += 1
        return OwnConnection(raw)

    def checkin(self, connection: OwnConnection) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        self.idle.append(connection)

    def discard(self, connection: OwnConnection) -> None:
        connection.close()
        self._free_slot()

    def _free_slot(self) -> None:
        while self.waiters:  # None: the waiter opens a connection of its own
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.size -= 1

    def close_idle(self) -> None:
        idle, self.idle = self.idle, []
        self.size -= len(idle)
        for connection in idle:
            connection.close()


async def perform(items: list[tuple[str, Query]], max_size: int, timeout: float) -> list[Any]:
    """One round: every statement sent, then every reply awaited and read. A connection
    leaves with its reply read, or is closed (an error, a timeout, a cancellation)."""
    replies: list[Any] = [None] * len(items)
    in_flight: list[tuple[int, AliasPool, OwnConnection, Query]] = []
    try:
        for index, (alias, query) in enumerate(items):
            pool = pool_of(alias, max_size, timeout)
            try:
                connection = await pool.checkout()
            except Exception as exc:
                replies[index] = policy.Failed(errors.translate(exc))
                continue
            try:
                if not query.idempotent and hung_up(connection.raw):
                    pool.discard(connection)  # closed by the server while idle
                    connection = await pool.checkout()
                known = local_reply(connection.raw, query)
                if known is not None:
                    replies[index] = known
                    pool.checkin(connection)
                    continue
                raw = connection.raw
                raw.send_query(statement_bytes(raw, query.sql, query.params))
            except BaseException as exc:
                pool.discard(connection)
                if not isinstance(exc, Exception):
                    raise
                replies[index] = policy.Failed(errors.translate(exc))
                continue
            in_flight.append((index, pool, connection, query))
        while in_flight:
            index, pool, connection, query = in_flight[0]
            try:
                await readable(connection.fd, pool.read_timeout)
                reply = receive(connection.raw)
            except Exception as exc:
                in_flight.pop(0)
                pool.discard(connection)
                replies[index] = policy.Failed(errors.translate(exc))
                continue
            in_flight.pop(0)
            remember_reply(connection.raw, query, reply)
            pool.checkin(connection)
            replies[index] = reply
    finally:
        for _, pool, connection, _ in in_flight:  # cancelled: replies left unread
            pool.discard(connection)
    return replies


def receive(raw: Any) -> Reply:
    raw.read_query_result()
    result = raw.store_result()
    if result is None:
        return (None, raw.affected_rows(), raw.insert_id(), raw.info())
    return (result.fetch_row(0), raw.affected_rows(), raw.insert_id(), None)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _expire(future: asyncio.Future, timeout: float) -> None:
    if not future.done():
        future.set_exception(OperationalError(
            2013, f"Lost connection to server during query (no reply within read_timeout, "
            f"{timeout} s)"
        ))


async def readable(fd: int, timeout: float | None) -> None:
    """Until ``fd`` has something to read; a lost-reply error after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    loop.add_reader(fd, _wake, future)
    timer = loop.call_later(timeout, _expire, future, timeout) if timeout else None
    try:
        await future
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


# --- one set of pools per event loop -------------------------------------------------------


class _LoopPools:
    def __init__(self) -> None:
        self.pools: dict[str, AliasPool] = {}
        self.guard: AsyncIterator[None] | None = None

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close_idle()


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPools] = (
    weakref.WeakKeyDictionary()
)
_loops_lock = threading.Lock()


async def _closed_with_the_loop(loop: asyncio.AbstractEventLoop, pools: _LoopPools):
    """An async generator the loop finalizes at shutdown: then the pools close."""
    try:
        yield
    finally:
        pools.close()
        with _loops_lock:
            _loops.pop(loop, None)


def pool_of(alias: str, max_size: int, timeout: float) -> AliasPool:
    """The running loop's pool for ``alias`` (made again if its DATABASES entry changed)."""
    loop = asyncio.get_running_loop()
    pools = _loops.get(loop) or _pools_of(loop)
    pool = pools.pools.get(alias)
    if pool is None or pool.settings is not connections[alias].settings_dict:
        if pool is not None:
            pool.close_idle()
        pool = pools.pools[alias] = AliasPool(alias, max_size, timeout)
    return pool


def _pools_of(loop: asyncio.AbstractEventLoop) -> _LoopPools:
    """The loop's pools, registered to close with it: the guard's first step runs here
    (a coroutine step, driven by hand) so the loop's asyncgen hook adopts it."""
    with _loops_lock:
        pools = _loops.setdefault(loop, _LoopPools())
    if pools.guard is None:
        pools.guard = _closed_with_the_loop(loop, pools)
        try:
            pools.guard.__anext__().send(None)
        except StopIteration:  # reached its ``yield``: registered, now waits for shutdown
            pass
    return pools


def close_pools(aliases: Sequence[str]) -> None:
    """Close the running loop's idle connections to ``aliases``."""
    pools = _loops.get(asyncio.get_running_loop())
    if pools is not None:
        for alias in aliases:
            pool = pools.pools.get(alias)
            if pool is not None:
                pool.close_idle()


def pool_figures(alias: str) -> dict[str, int]:
    """The asyncio pools' figures for ``alias``, summed over the process's event loops."""
    with _loops_lock:
        loops = list(_loops.values())
    pools = [p for p in (loop.pools.get(alias) for loop in loops) if p is not None]
    return {
        "async_pool_size": sum(pool.size for pool in pools),
        "async_pool_idle": sum(len(pool.idle) for pool in pools),
        "async_pool_connects": sum(pool.connects for pool in pools),
    }


def _forget_after_fork() -> None:
    global _loops_lock
    _loops_lock = threading.Lock()
    _loops.clear()  # the parent's loops and sockets


os.register_at_fork(after_in_child=_forget_after_fork)
