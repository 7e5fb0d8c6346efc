"""The exchange: statements on the cache's own connections, written once for both drivers.

A round of statements (:func:`perform`: at most one per alias, from the failure policy,
:mod:`~django_kvcache.mysql.policy`) goes from checkout to the end of each reply here.
It is a plan (:mod:`django_kvcache.steps`) that leaves each wait — for a pooled
connection, for a reply, for a rerun's pause — to the driver it is given
(:class:`Driver`), which waits its own way: the blocking one in the calling thread, there
and then (:mod:`~django_kvcache.mysql.blocking`: the plan never yields), the asyncio one
on the event loop, by handing back a :class:`Wait` that the plan yields to be awaited
(:mod:`~django_kvcache.mysql.aio`). Which pools a driver's connections come from and how
it waits is all that differs; everything else is decided here, once:

* **Which connection**: one of the driver's pool for the alias and the cache's
  connection settings; an idle one the server closed is replaced before anything is
  sent on it (``ServerPool.usable``).
* **What is sent**: a reply known without asking (a connection's packet limit,
  :func:`~django_kvcache.mysql.server.local_reply`), else the statement. A round over
  several aliases sends every statement before it waits for any reply.
* **Which deadline**: each reply within its connection's IO_TIMEOUT from the moment its
  statement was sent; past it, :class:`~django_kvcache.mysql.errors.ReplyTimeout`.
* **What an outcome does to the connection**:

  - a reply: back to its pool;
  - an error reply: back to its pool, in step — unless the error's class says the
    connection is lost (:func:`~django_kvcache.mysql.errors.classify`), then closed;
  - no reply in time, or a reply read only in part: closed;
  - an error that says every idle connection of the pool is stale too (a read-only
    server: a primary demoted by a failover): they are closed with it, so that the rerun
    goes out on a new connection;
  - a cancellation (``CancelledError``, ``KeyboardInterrupt``, anything raised into a
    wait): a connection with a statement out is closed (its reply would be left unread);
    a wait for a pooled connection leaves the pool as it found it
    (:mod:`django_kvcache.pool`); the exception goes on.

Errors come back as :class:`Failed` answers (Django's exception classes, translated
once), for the policy to classify and account; only a cancellation is raised.
"""
from __future__ import annotations

from time import monotonic
from typing import Any, Awaitable, Generator, Protocol, Sequence

from django_kvcache.mysql import errors
from django_kvcache.mysql.connect import ConnectionSettings
from django_kvcache.mysql.connection import Connection, Unreadable
from django_kvcache.mysql.query import Query
from django_kvcache.mysql.server import local_reply, remember_reply


class Wait:
    """A wait the asyncio driver hands back: the plan yields it, and whoever runs the
    plan on the loop (:func:`django_kvcache.steps.arun`) awaits it and sends back its
    result (or throws in its exception)."""

    __slots__ = ("awaitable",)

    def __init__(self, awaitable: Awaitable[Any]) -> None:
        self.awaitable = awaitable

    def arun(self) -> Awaitable[Any]:
        return self.awaitable

    def run(self) -> Any:
        raise RuntimeError("a wait of the asyncio driver is awaited on its event loop")


class Driver(Protocol):
    """What differs between the two drivers. Each wait either is done when it returns
    (the blocking driver: its result, or its exception raised) or returns a :class:`Wait`
    for the plan to yield (the asyncio driver)."""

    def pool(self, alias: str, settings: ConnectionSettings) -> Any:
        """The pool this driver's connections to ``alias`` come from."""

    def checkout(self, pool: Any) -> Any:
        """A connection of ``pool``, once one is free (PoolExhausted after its timeout)."""

    def reply(self, connection: Connection, deadline: float | None) -> Any:
        """Once ``connection``'s reply is here; ReplyTimeout at ``deadline``
        (``time.monotonic()``; None: no limit)."""

    def sleep(self, seconds: float) -> Any:
        """Once ``seconds`` have passed."""


class Failed:
    """A statement that failed: the error (Django's exception class)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


Plan = Generator[Wait, Any, Any]  # yields only the asyncio driver's waits


def perform(items: Sequence[tuple[str, Query]], settings: ConnectionSettings,
            io: Driver) -> Plan:
    """One round: per ``(alias, query)``, the reply or a :class:`Failed`, in order."""
    if len(items) != 1:
        return (yield from pipelined(items, settings, io))
    return [(yield from one(*items[0], settings, io))]


def one(alias: str, query: Query, settings: ConnectionSettings, io: Driver) -> Plan:
    """The usual round, one statement: its reply or a :class:`Failed` (written out for
    speed: what :func:`pipelined` does for one)."""
    pool = io.pool(alias, settings)
    try:
        connection = pool.try_checkout()  # an idle connection, or a new one if room
        if connection is None:
            connection = io.checkout(pool)
            if type(connection) is Wait:
                connection = yield connection
    except Exception as exc:
        return Failed(errors.translate(exc))
    sent = send(pool, connection, query)
    if sent is not connection:
        return sent
    try:
        waiting = io.reply(connection, _deadline(connection))
        if waiting is not None:
            yield waiting
    except Exception as exc:
        return settle(pool, connection, exc)
    except BaseException:  # cancelled: the reply is left unread
        pool.discard(connection)
        raise
    return receive(pool, connection, query)


def pipelined(items: Sequence[tuple[str, Query]], settings: ConnectionSettings,
              io: Driver) -> Plan:
    """Every statement sent (each on a connection of its alias) before any reply is
    awaited; the replies read in order."""
    answers: list[Any] = [None] * len(items)
    out: list[tuple[int, Any, Connection, Query, float | None]] = []
    try:
        for index, (alias, query) in enumerate(items):
            pool = io.pool(alias, settings)
            try:
                connection = pool.try_checkout()
                if connection is None:
                    connection = io.checkout(pool)
                    if type(connection) is Wait:
                        connection = yield connection
            except Exception as exc:
                answers[index] = Failed(errors.translate(exc))
                continue
            sent = answers[index] = send(pool, connection, query)
            if sent is connection:
                out.append((index, pool, connection, query, _deadline(connection)))
        while out:
            index, pool, connection, query, deadline = out[0]
            try:
                waiting = io.reply(connection, deadline)
                if waiting is not None:
                    yield waiting
            except Exception as exc:
                answers[index] = settle(pool, connection, exc)
            else:
                answers[index] = receive(pool, connection, query)
            out.pop(0)
    finally:
        for _, pool, connection, _, _ in out:  # interrupted: their replies left unread
            pool.discard(connection)
    return answers


def send(pool: Any, connection: Connection, query: Query) -> Any:
    """``query`` sent on ``connection`` (returned), or its answer when none had to be
    sent (a known reply: the connection back to its pool) or a :class:`Failed`."""
    try:
        known = local_reply(connection, query)
        if known is not None:
            pool.checkin(connection)
            return known
        connection.send(query)
    except Exception as exc:
        return settle(pool, connection, exc)
    except BaseException:  # interrupted: part of the statement may be out
        pool.discard(connection)
        raise
    return connection


def receive(pool: Any, connection: Connection, query: Query) -> Any:
    """The reply to ``query``, here now on ``connection``, read; the connection back to
    its pool (or a :class:`Failed`, the connection kept or closed as the error says)."""
    try:
        reply = connection.read(query.named)
    except Exception as exc:
        return settle(pool, connection, exc)
    except BaseException:  # interrupted mid-reply: the rest is left unread
        pool.discard(connection)
        raise
    remember_reply(connection, query, reply)
    pool.checkin(connection)
    return reply


def settle(pool: Any, connection: Connection, exc: Exception) -> Failed:
    """``exc`` as a :class:`Failed`; ``connection`` back to its pool, or closed if the
    error lost it (a reply read in part, a timeout, a broken connection), and with it
    the pool's idle ones where they reach the same stale server (a demoted primary)."""
    lost = isinstance(exc, Unreadable)
    error = errors.translate(exc.error if lost else exc)  # type: ignore[union-attr, arg-type]
    kind = errors.classify(error)
    if lost or kind.connection_lost:
        pool.discard(connection)
    else:
        pool.checkin(connection)
    if kind.pool_stale:
        pool.close_idle()
    return Failed(error)


def _deadline(connection: Connection) -> float | None:
    timeout = connection.io_timeout
    return None if timeout is None else monotonic() + timeout
