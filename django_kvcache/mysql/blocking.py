"""The blocking driver: the policy's statements on the process's own connections.

It moves statements and nothing else (what to send, what an error means and what comes
next are :mod:`~django_kvcache.mysql.policy`'s). Per database alias, one process-wide
pool of mysqlclient connections of the backend's own (:class:`AliasPool`, at most
MAX_POOL_SIZE, a thread waiting at most POOL_TIMEOUT for one), opened from the alias's
DATABASES entry (:mod:`~django_kvcache.mysql.connect`): never Django's connection of the
thread, so no caller's transaction, ``TestCase.databases`` or ``execute_wrapper`` sees
a cache statement, and every statement commits on its own.

A statement is sent with mysqlclient's ``send_query`` and its reply read with
``read_query_result``. A round over several connections (shards) sends every statement
before reading any reply: one round trip for all shards instead of one each. A
connection leaves with its reply read, or is closed (an error that loses it, an
interruption); errors are Django's exception classes.

An idle connection the server has closed (``wait_timeout``, a restart) is found out
before a statement is sent on it, by a zero-timeout poll of its socket
(:meth:`AliasPool.usable`), and replaced: no statement is sent on it, none runs twice.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from django.db import connections

from django_kvcache import forks
from django_kvcache.mysql import errors, policy
from django_kvcache.mysql.cluster import DEFAULT_POOL_SIZE, DEFAULT_POOL_TIMEOUT, Session
from django_kvcache.mysql.connect import (
    ConnectionParams,
    OwnConnection,
    Retiring,
    connection_params,
    open_connection,
)
from django_kvcache.mysql.query import Query, Reply
from django_kvcache.mysql.server import (
    DETECT,
    ServerInfo,
    known_server,
    local_reply,
    remember_reply,
    remember_server,
    statement_bytes,
)
from django_kvcache.pool import BlockingPool


def execute(session: Session, calls: Sequence[policy.Call]) -> list[Any]:
    """:func:`policy.execute` on this process's connections."""
    engine = policy.execute(session, calls)
    cluster = session.cluster
    replies: Any = None
    while True:
        try:
            exchange = engine.send(replies)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if exchange.pause:
            time.sleep(exchange.pause)  # a rerun's back-off
        replies = perform(exchange.items, cluster.max_pool_size, cluster.pool_timeout)


def perform(items: list[tuple[str, Query]], max_size: int, timeout: float) -> list[Any]:
    """One round: a reply or a :class:`policy.Failed` per statement."""
    if len(items) == 1:
        alias, query = items[0]
        return [one(pool_of(alias, max_size, timeout), query)]
    return pipelined([(pool_of(alias, max_size, timeout), query) for alias, query in items])


def one(pool: AliasPool, query: Query) -> Any:
    try:
        raw = pool.checkout()
    except Exception as exc:
        return policy.Failed(errors.translate(exc))
    try:
        reply = local_reply(raw, query)
        if reply is None:
            raw.send_query(statement_bytes(raw, query.sql, query.params))
            reply = receive(raw, query.named)
            remember_reply(raw, query, reply)
    except Exception as exc:
        return failed(pool, raw, exc)
    except BaseException:  # interrupted: the reply may be left unread
        pool.discard(raw)
        raise
    pool.checkin(raw)
    return reply


def receive(raw: Any, named: bool = False) -> Reply:
    """The reply of the statement sent on ``raw``: its rows (``named``: as dicts), or its
    counts. Rows left unread (an error, an interruption) lose the connection."""
    raw.read_query_result()  # an error reply carries no result: nothing left unread
    try:
        result = raw.store_result()
        if result is None:
            return (None, raw.affected_rows(), raw.insert_id(), raw.info())
        return (result.fetch_row(0, int(named)), raw.affected_rows(), raw.insert_id(), None)
    except BaseException as exc:
        raise Unreadable(exc) from exc


class Unreadable(Exception):
    """The reply could not be read to its end: the connection cannot be used again."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def pipelined(targets: list[tuple[AliasPool, Query]]) -> list[Any]:
    """Every statement sent (each on a connection of its alias) before any reply is read.

    Every reply sent for is read, so no connection is left with an unread result; one
    whose reply could not be read (interrupted) is closed.
    """
    replies: list[Any] = [None] * len(targets)
    sent: list[tuple[int, Any]] = []
    try:
        for index, (pool, query) in enumerate(targets):
            try:
                raw = pool.checkout()
            except Exception as exc:
                replies[index] = policy.Failed(errors.translate(exc))
                continue
            try:
                known = local_reply(raw, query)
                if known is not None:
                    replies[index] = known
                    pool.checkin(raw)
                    continue
                raw.send_query(statement_bytes(raw, query.sql, query.params))
            except Exception as exc:  # this statement's error: the others go on
                replies[index] = failed(pool, raw, exc)
                continue
            except BaseException:
                pool.discard(raw)
                raise
            sent.append((index, raw))
    except BaseException:  # interrupted between two sends: no reply is left unread
        for index, raw in sent:
            targets[index][0].discard(raw)
        raise
    read = 0
    try:
        for index, raw in sent:
            pool, query = targets[index]
            try:
                replies[index] = reply = receive(raw, query.named)
                remember_reply(raw, query, reply)
            except Exception as exc:
                replies[index] = failed(pool, raw, exc)
            else:
                pool.checkin(raw)
            read += 1
    finally:
        for index, raw in sent[read:]:  # interrupted (KeyboardInterrupt...): unread replies
            targets[index][0].discard(raw)
    return replies


def failed(pool: AliasPool, raw: Any, exc: Exception) -> policy.Failed:
    """``exc`` as the policy's answer; ``raw`` back to the pool, or closed if the error
    lost it."""
    lost = isinstance(exc, Unreadable)
    error = errors.translate(exc.error if lost else exc)  # type: ignore[arg-type]
    kind = errors.classify(error)
    if lost or kind.connection_lost:
        pool.discard(raw)
    else:
        pool.checkin(raw)
    if kind.pool_stale:
        pool.close_idle()
    return policy.Failed(error)


# --- statements outside the request path (tables, dictionaries, tools) ------------------


def query(alias: str, statement: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of ``alias``'s pool (DDL and tools, outside the
    failure policy: errors are raised as Django's); its rows (none for a write).
    Without ``params`` the statement is sent as it is (no ``%`` formatting)."""
    pool = pool_of(alias, DEFAULT_POOL_SIZE, DEFAULT_POOL_TIMEOUT)
    try:
        raw = pool.checkout()
    except Exception as exc:
        raise errors.translate(exc) from exc
    try:
        cursor = raw.cursor()
        try:
            cursor.execute(statement, params)
            rows = list(cursor.fetchall()) if cursor.description else []
        finally:
            cursor.close()
    except Exception as exc:
        error = errors.translate(exc)
        if errors.classify(error).connection_lost:
            pool.discard(raw)
        else:
            pool.checkin(raw)
        if error is exc:
            raise
        raise error from exc
    except BaseException:
        pool.discard(raw)
        raise
    pool.checkin(raw)
    return rows


def server_info(alias: str) -> ServerInfo:
    """The server behind ``alias`` (for DDL and tools: outside any request path)."""
    info = known_server(alias)
    if info is None:
        info = remember_server(alias, query(alias, DETECT.sql)[0])
    return info


# --- the pools ------------------------------------------------------------------------------


class AliasPool(Retiring, BlockingPool[OwnConnection]):
    """This process's connections to one alias: at most MAX_POOL_SIZE, a thread waiting
    at most POOL_TIMEOUT for one (:class:`django_kvcache.pool.BlockingPool`)."""

    def __init__(self, alias: str, max_size: int, timeout: float) -> None:
        super().__init__(max_size, timeout)
        self.alias = alias
        self.entry = connections.settings[alias]  # replaced when the alias is redefined
        self.params: ConnectionParams | None = None  # of the last connection opened
        self.reconnects = 0  # idle connections found closed by the server, replaced

    def after_fork(self) -> None:
        super().after_fork()
        self.reconnects = 0


    def open(self) -> OwnConnection:
        """A new connection, with the settings of now (a test database, a mirror)."""
        params = self.params = connection_params(self.alias)
        return open_connection(params)

    def usable(self, raw: OwnConnection) -> bool:
        """Not closed by the server while idle (``wait_timeout``, a restart): a
        zero-timeout poll of its socket. No statement is sent on a connection the
        server has closed, so none has to run twice."""
        if raw.has_input():
            self.reconnects += 1
            return False
        return True

    def exhausted(self) -> errors.PoolExhausted:
        return errors.PoolExhausted(
            f"all {self.max_size} connections of this process to {self.alias!r} busy for "
            f"{self.timeout} s (MAX_POOL_SIZE, POOL_TIMEOUT)"
        )



#: (alias, MAX_POOL_SIZE, POOL_TIMEOUT) -> its pool, process-wide.
_pools: forks.Registry[tuple[str, int, float], AliasPool] = forks.Registry()


def pool_of(alias: str, max_size: int, timeout: float) -> AliasPool:
    """The process's pool for ``alias`` (made again when its DATABASES entry was
    replaced, or the database it names changed: a test database)."""
    key = (alias, max_size, timeout)
    pool = _pools.items.get(key)
    if pool is not None and pool.entry is connections.settings[alias] and (
        pool.params is None or pool.params.current()
    ):
        return pool
    return _replace(key, pool)


def _replace(key: tuple[str, int, float], old: AliasPool | None) -> AliasPool:
    if old is not None:
        _pools.pop(key)
        old.retire()
    return _pools.get(key, lambda: AliasPool(*key))


def pools() -> list[AliasPool]:
    """Every pool of this process (for metrics)."""
    return _pools.values()


def pool_figures(alias: str, max_size: int, timeout: float) -> dict[str, Any]:
    """The counters of this process's pool for ``alias`` (none before its first use)."""
    pool = _pools.items.get((alias, max_size, timeout))
    if pool is None:
        return {}
    return {
        "pool_size": pool.size,
        "pool_idle": len(pool.idle),
        "pool_waiters": len(pool.line),
        "pool_waits": pool.waits,
        "pool_wait_seconds": round(pool.wait_time, 6),
        "pool_connects": pool.connects,
        "pool_reuses": pool.reuses,
        "pool_reconnects": pool.reconnects,
    }


def retire_pools(aliases: Sequence[str]) -> None:
    """Forget this process's pools for ``aliases`` (their settings now name another
    database): idle connections are closed, the ones in use when they come back."""
    for key, pool in list(_pools.items.items()):
        if pool.alias in aliases:
            _pools.pop(key)
            pool.retire()


def close_pools(aliases: Sequence[str]) -> None:
    """Close this process's idle connections to ``aliases``."""
    for pool in pools():
        if pool.alias in aliases:
            pool.close_idle()
