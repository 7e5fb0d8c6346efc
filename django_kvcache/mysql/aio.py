"""The asyncio driver: the policy's statements on the event loop's own connections.

Per event loop and per database alias, a small pool of mysqlclient connections of the
backend's own (:class:`AliasPool`, at most MAX_POOL_SIZE, waiting at most POOL_TIMEOUT),
opened from the alias's DATABASES entry as the blocking driver's are
(:mod:`~django_kvcache.mysql.connect`). Never Django's connection of the thread: a
statement on the async API commits on its own.

A statement is sent with ``send_query``, the loop waits for the socket to become
readable (``loop.add_reader``; at most the alias's ``read_timeout``, after which the
connection is closed and the statement fails as a lost reply, as the blocking client
reports it), then ``read_query_result`` reads the reply. What still blocks the loop:
opening a connection (``connect``, up to ``connect_timeout``), sending a statement larger
than the socket's buffer, and reading a reply that has not fully arrived once the first
bytes have (a large result).

A pool belongs to the loop that made it and is used from that loop's thread; its
connections close when the loop shuts down (``loop.shutdown_asyncgens()``, which
``asyncio.run``, asgiref and uvicorn call; :mod:`django_kvcache.loops`).
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from django.db import OperationalError, connections

from django_kvcache.loops import PerLoop
from django_kvcache.mysql import errors, policy
from django_kvcache.mysql.cluster import Session
from django_kvcache.mysql.connect import (
    ConnectionParams,
    Retiring,
    connection_params,
    open_connection,
)
from django_kvcache.mysql.query import Query, Reply
from django_kvcache.mysql.server import local_reply, remember_reply, statement_bytes
from django_kvcache.pool import LoopPool


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
            if exchange.pause:
                await asyncio.sleep(exchange.pause)  # a rerun's back-off
            replies = await perform(exchange.items, cluster.max_pool_size, cluster.pool_timeout)
    finally:
        engine.close()  # interrupted (cancelled): the policy lets go of what it holds


class OwnConnection:
    """One DB-API connection of a pool (``raw``: mysqlclient's), watched by the loop (one
    registration per connection, not one per statement): readable while its reply is
    awaited means the reply is here; readable while idle means the server has closed it
    (or sent an error before closing), and it is no longer watched. A reply that
    arrives before it is awaited (a round over several shards awaits them one after
    another) is not watched either until it is awaited: the loop polls level-triggered,
    and would wake for it on every turn until then."""

    __slots__ = ("raw", "fd", "loop", "waiter", "sent", "hung_up", "watched", "arrived")

    def __init__(self, raw: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.raw = raw
        self.fd = raw.fileno()
        self.loop = loop
        self.waiter: asyncio.Future | None = None
        self.sent = False  # a statement is out, its reply not read yet
        self.hung_up = False
        self.arrived = False  # its reply came before it was awaited
        loop.add_reader(self.fd, self._readable)
        self.watched = True

    def _readable(self) -> None:
        if self.sent:
            waiter = self.waiter
            if waiter is not None:
                if not waiter.done():
                    waiter.set_result(None)
            elif self.raw.has_input():
                self.arrived = True  # nobody awaits it yet: stop watching until then
                self._unwatch()
        elif self.raw.has_input():  # (not an event of the reply just read: still readable)
            self.hung_up = True  # nothing was asked: the server is ending the session
            self._unwatch()

    def _unwatch(self) -> None:
        self.loop.remove_reader(self.fd)
        self.watched = False

    def send(self, query: Query) -> None:
        raw = self.raw
        raw.send_query(statement_bytes(raw, query.sql, query.params))
        self.sent = True

    async def reply(self, timeout: float | None, named: bool = False) -> Reply:
        """The reply of the statement sent, once it is here (at most ``timeout`` s);
        ``named``: its rows as dicts."""
        if self.arrived:  # here already: watched again for the next one
            self.arrived = False
            self.loop.add_reader(self.fd, self._readable)
            self.watched = True
            return self._read(named)
        deadline = self.loop.time() + timeout if timeout else None
        while True:
            waiter = self.waiter = self.loop.create_future()
            timer = self.loop.call_at(deadline, _expire, waiter, timeout) if deadline else None
            try:
                await waiter
            finally:
                self.waiter = None
                if timer is not None:
                    timer.cancel()
            if self.raw.has_input():  # else woken by an event of the previous reply: wait on
                break
        return self._read(named)

    def _read(self, named: bool) -> Reply:
        reply = receive(self.raw, named)
        self.sent = False
        return reply

    def close(self) -> None:
        if self.watched and not self.loop.is_closed():
            self._unwatch()
        self.raw.close()


class AliasPool(Retiring, LoopPool[OwnConnection]):
    """One loop's connections to one alias (see the module docstring)."""

    def __init__(self, alias: str, max_size: int, timeout: float) -> None:
        super().__init__(max_size, timeout)
        self.alias = alias
        self.entry = connections.settings[alias]  # replaced when the alias is redefined
        self.params: ConnectionParams | None = None  # of the last connection opened
        self.read_timeout: float | None = None
        self.reconnects = 0  # idle connections found closed by the server, replaced

    def open(self) -> OwnConnection:
        """A new connection (blocking: mysqlclient has no asynchronous connect), with the
        settings of now (a test database, a mirror)."""
        params = self.params = connection_params(self.alias)
        self.read_timeout = params.kwargs.get("read_timeout") or None
        return OwnConnection(open_connection(params), asyncio.get_running_loop())

    def usable(self, connection: OwnConnection) -> bool:
        """Not closed by the server while idle: seen by the loop, or (before the loop
        had a turn to see it) by a zero-timeout poll. No statement is sent on a
        connection the server has closed, so none has to run twice."""
        if connection.hung_up or connection.raw.has_input():
            self.reconnects += 1
            return False
        return True

    def exhausted(self) -> errors.PoolExhausted:
        return errors.PoolExhausted(
            f"all {self.max_size} connections of this event loop to {self.alias!r} busy "
            f"for {self.timeout} s (MAX_POOL_SIZE, POOL_TIMEOUT)"
        )


async def perform(items: list[tuple[str, Query]], max_size: int, timeout: float) -> list[Any]:
    """One round: every statement sent, then every reply awaited and read. A connection
    leaves with its reply read, or is closed (an error, a timeout, a cancellation)."""
    if len(items) == 1:
        alias, query = items[0]
        return [await one(pool_of(alias, max_size, timeout), query)]
    replies: list[Any] = [None] * len(items)
    in_flight: list[tuple[int, AliasPool, OwnConnection, Query]] = []
    try:
        for index, (alias, query) in enumerate(items):
            pool = pool_of(alias, max_size, timeout)
            sent = await send(pool, query)
            if isinstance(sent, OwnConnection):
                in_flight.append((index, pool, sent, query))
            else:
                replies[index] = sent
        while in_flight:
            index, pool, connection, query = in_flight[0]
            replies[index] = await receive_on(pool, connection, query)
            in_flight.pop(0)
    finally:
        for _, pool, connection, _ in in_flight:  # cancelled: replies left unread
            pool.discard(connection)
    return replies


async def one(pool: AliasPool, query: Query) -> Any:
    sent = await send(pool, query)
    if not isinstance(sent, OwnConnection):
        return sent
    try:
        return await receive_on(pool, sent, query)
    except BaseException:  # cancelled: the reply is left unread
        pool.discard(sent)
        raise


async def send(pool: AliasPool, query: Query) -> Any:
    """``query`` sent on a connection of ``pool``: the connection, or the answer when
    none was needed (a known packet limit) or a :class:`policy.Failed`."""
    try:
        connection = await pool.checkout()  # one the server has not closed (usable())
    except Exception as exc:
        return policy.Failed(errors.translate(exc))
    try:
        known = local_reply(connection.raw, query)
        if known is not None:
            pool.checkin(connection)
            return known
        connection.send(query)
    except BaseException as exc:
        pool.discard(connection)
        if not isinstance(exc, Exception):
            raise
        return policy.Failed(errors.translate(exc))
    return connection


async def receive_on(pool: AliasPool, connection: OwnConnection, query: Query) -> Any:
    """The reply on ``connection`` (back to the pool), or a :class:`policy.Failed`
    (the connection closed). A cancellation is the caller's to handle."""
    try:
        reply = await connection.reply(pool.read_timeout, query.named)
    except Exception as exc:
        pool.discard(connection)
        error = errors.translate(exc)
        if errors.classify(error).pool_stale:
            pool.close_idle()
        return policy.Failed(error)
    remember_reply(connection.raw, query, reply)
    pool.checkin(connection)
    return reply


def receive(raw: Any, named: bool = False) -> Reply:
    raw.read_query_result()
    result = raw.store_result()
    if result is None:
        return (None, raw.affected_rows(), raw.insert_id(), raw.info())
    return (result.fetch_row(0, int(named)), raw.affected_rows(), raw.insert_id(), None)


def _expire(future: asyncio.Future, timeout: float) -> None:
    if not future.done():
        future.set_exception(OperationalError(
            2013, f"Lost connection to server during query (no reply within read_timeout, "
            f"{timeout} s)"
        ))


# --- one set of pools per event loop -------------------------------------------------------


def _close(pools: dict[str, AliasPool]) -> None:
    for pool in pools.values():
        pool.close_idle()


_pools: PerLoop[dict[str, AliasPool]] = PerLoop(dict, _close)


def pool_of(alias: str, max_size: int, timeout: float) -> AliasPool:
    """The running loop's pool for ``alias`` (made again if its DATABASES entry was
    replaced, or the database it names changed: a test database)."""
    pools = _pools.get()
    pool = pools.get(alias)
    if pool is None or pool.entry is not connections.settings[alias] or (
        pool.params is not None and not pool.params.current()
    ):
        if pool is not None:
            pool.retire()
        pool = pools[alias] = AliasPool(alias, max_size, timeout)
    return pool


def close_pools(aliases: Sequence[str]) -> None:
    """Close the running loop's idle connections to ``aliases``."""
    pools = _pools.existing()
    if pools is not None:
        for alias in aliases:
            pool = pools.get(alias)
            if pool is not None:
                pool.close_idle()


def pool_figures(alias: str) -> dict[str, Any]:
    """The counters of every event loop's pool for ``alias``, summed (read from any
    thread: each figure is one read of a loop's own counters; for monitoring)."""
    pools = [pool for pool in (state.get(alias) for state in _pools.every()) if pool is not None]
    if not pools:
        return {}
    return {
        "async_loops": len(pools),
        "async_pool_size": sum(pool.size for pool in pools),
        "async_pool_idle": sum(len(pool.idle) for pool in pools),
        "async_pool_waiters": sum(len(pool.line) for pool in pools),
        "async_pool_waits": sum(pool.waits for pool in pools),
        "async_pool_wait_seconds": round(sum(pool.wait_time for pool in pools), 6),
        "async_pool_connects": sum(pool.connects for pool in pools),
        "async_pool_reuses": sum(pool.reuses for pool in pools),
        "async_pool_reconnects": sum(pool.reconnects for pool in pools),
    }
