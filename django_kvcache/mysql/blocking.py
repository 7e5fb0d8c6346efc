"""The blocking driver: the policy's statements on this thread's Django connections.

It moves statements and nothing else (what to send, what an error means and what comes
next are :mod:`~django_kvcache.mysql.policy`'s). Per statement it takes one of two ways:

* **the DB-API connection directly**, while nobody watches statements and no
  transaction is open (``may_bypass_cursor``): Django's connection checks first (the
  CONN_HEALTH_CHECKS ping, the thread and event-loop checks of ``ensure_connection``),
  then mysqlclient's ``send_query``/``read_query_result``. A round over several
  connections sends every statement before reading any reply: one round trip for all
  shards instead of one each;
* **Django's cursor**, one statement after another, where DEBUG, ``assertNumQueries``
  or an ``execute_wrapper`` must see every statement, or inside a transaction.

Either way a reply is the same :data:`~django_kvcache.mysql.query.Reply`, errors are
Django's exceptions, and a connection the error class says is lost is closed (outside a
transaction), so the next statement starts on a fresh one.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_kvcache.mysql import errors, policy
from django_kvcache.mysql.cluster import Session
from django_kvcache.mysql.query import PacketLimit, Query, Reply
from django_kvcache.mysql.server import (
    hung_up,
    in_transaction,
    local_reply,
    may_bypass_cursor,
    remember_reply,
    statement_bytes,
)


def execute(session: Session, calls: Sequence[policy.Call]) -> list[Any]:
    """:func:`policy.execute` on this thread's connections."""
    engine = policy.execute(session, calls)
    replies: Any = None
    while True:
        try:
            exchange = engine.send(replies)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if exchange.pause:
            time.sleep(exchange.pause)  # a rerun's back-off
        replies = perform(exchange.items)


def perform(items: list[tuple[str, Query]]) -> list[Any]:
    """One round: a reply or a :class:`policy.Failed` per statement."""
    if len(items) == 1:
        alias, query = items[0]
        return [one(connections[alias], query)]
    targets = [(connections[alias], query) for alias, query in items]
    if all(may_bypass_cursor(connection) for connection, _ in targets):
        return pipelined(targets)
    return [one(connection, query) for connection, query in targets]


def one(connection: BaseDatabaseWrapper, query: Query) -> Any:
    if not may_bypass_cursor(connection):
        return through_cursor(connection, query)
    try:
        raw = ready(connection, query)
        reply = local_reply(raw, query)
        if reply is None:
            with connection.wrap_database_errors:
                raw.send_query(statement_bytes(raw, query.sql, query.params))
            reply = receive(connection, raw, query.named)
            remember_reply(raw, query, reply)
        return reply
    except Exception as exc:
        return failed(connection, exc)


def through_cursor(connection: BaseDatabaseWrapper, query: Query) -> Any:
    """``query`` through ``connection.cursor()``: seen by DEBUG logging and execute
    wrappers, inside the caller's transaction if one is open."""
    try:
        if not query.idempotent and not in_transaction(connection):
            connection.ensure_connection()
            if hung_up(connection.connection):  # noticed before sending, not after
                connection.close()
        if isinstance(query, PacketLimit):
            connection.ensure_connection()
            known = local_reply(connection.connection, query)
            if known is not None:
                return known
        with connection.cursor() as cursor:  # connects; shows the statement to its watchers
            cursor.execute(query.sql, query.params)
            if cursor.description is not None:
                found = cursor.fetchall()
                if query.named:
                    names = [column[0] for column in cursor.description]
                    found = tuple(dict(zip(names, row)) for row in found)
                reply: Reply = (found, cursor.rowcount, cursor.lastrowid, None)
            else:
                info = cursor.connection.info()  # the DB-API connection's, under any wrapper
                reply = (None, cursor.rowcount, cursor.lastrowid, info)
        remember_reply(connection.connection, query, reply)
        return reply
    except Exception as exc:
        return failed(connection, exc)


def ready(connection: BaseDatabaseWrapper, query: Query) -> Any:
    """The open DB-API connection, after what ``connection.cursor()`` checks first: the
    CONN_HEALTH_CHECKS ping (a dead connection is closed and reopened), that this thread
    may use it, and (``ensure_connection``) that no event loop runs in this thread. A
    statement that must not run twice first makes sure the server has not hung up."""
    connection.close_if_health_check_failed()
    connection.validate_thread_sharing()
    connection.ensure_connection()
    if not query.idempotent and hung_up(connection.connection):
        connection.close()
        connection.ensure_connection()
    return connection.connection


def receive(connection: BaseDatabaseWrapper, raw: Any, named: bool = False) -> Reply:
    """The reply of the statement sent on ``raw``: its rows (``named``: as dicts), or its
    counts."""
    with connection.wrap_database_errors:
        raw.read_query_result()  # an error reply carries no result: nothing left unread
        try:
            result = raw.store_result()
            if result is None:
                return (None, raw.affected_rows(), raw.insert_id(), raw.info())
            return (result.fetch_row(0, int(named)), raw.affected_rows(), raw.insert_id(), None)
        except BaseException:
            connection.close()  # rows may be left unread on it
            raise


def pipelined(targets: list[tuple[BaseDatabaseWrapper, Query]]) -> list[Any]:
    """Every statement sent (each on its own connection) before any reply is read.

    Every reply sent for is read, so no connection is left with an unread result; one
    whose reply could not be read (interrupted) is closed.
    """
    replies: list[Any] = [None] * len(targets)
    sent: list[tuple[int, Any]] = []
    try:
        for index, (connection, query) in enumerate(targets):
            try:
                raw = ready(connection, query)
                known = local_reply(raw, query)
                if known is not None:
                    replies[index] = known
                    continue
                with connection.wrap_database_errors:
                    raw.send_query(statement_bytes(raw, query.sql, query.params))
            except Exception as exc:  # this statement's error: the others go on
                replies[index] = failed(connection, exc)
                continue
            sent.append((index, raw))
    except BaseException:  # interrupted between two sends: no reply is left unread
        for index, _ in sent:
            targets[index][0].close()
        raise
    read = 0
    try:
        for index, raw in sent:
            connection, query = targets[index]
            try:
                replies[index] = reply = receive(connection, raw, query.named)
                remember_reply(raw, query, reply)
            except Exception as exc:
                replies[index] = failed(connection, exc)
            read += 1
    finally:
        for index, _ in sent[read:]:  # interrupted (KeyboardInterrupt...): unread replies
            targets[index][0].close()
    return replies


def failed(connection: BaseDatabaseWrapper, exc: Exception) -> policy.Failed:
    """``exc`` as the policy's answer; a lost connection closed outside a transaction."""
    inside = in_transaction(connection)
    if not inside and errors.classify(exc).connection_lost:
        connection.close()
    return policy.Failed(exc, inside)
