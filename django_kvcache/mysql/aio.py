"""The asyncio driver: the cache's statements on the running event loop.

What to send, which deadline applies and what an error or a cancellation does are
decided once, by the failure policy (:mod:`~django_kvcache.mysql.policy`) and the
exchange (:mod:`~django_kvcache.mysql.exchange`); this driver only waits, on the loop:
for a connection of the loop's pool for the alias
(:func:`~django_kvcache.mysql.pools.loop_pool`, closed when the loop shuts down), for a
reply (the loop watches the connection's socket: :class:`Watch`; at most IO_TIMEOUT),
for a rerun's pause. Never Django's connection of the thread: a statement on the async
API commits on its own.

What still blocks the loop: opening a connection (mysqlclient has no asynchronous
connect: up to CONNECT_TIMEOUT), sending a statement larger than the socket's buffer,
and reading a reply that has not fully arrived once its first bytes have (a large
result).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from django_kvcache.mysql import errors, policy, pools
from django_kvcache.mysql.cluster import Session
from django_kvcache.mysql.connection import Connection
from django_kvcache.mysql.exchange import Wait
from django_kvcache.steps import arun


class Watch:
    """The loop's watch of one connection's socket, registered once per connection (not
    once per statement). Readable while a reply is awaited: the reply is here. Readable
    with nobody waiting — a reply that came before it was awaited (a round over several
    shards awaits them one after another), or a connection the server closed while it
    sat idle — it is no longer watched (the loop polls level-triggered, and would wake
    for it on every turn), and ``pending`` says so: the next wait takes it at once, and
    a pool asking whether the idle connection may be used learns that the server hung
    up (``hung_up``)."""

    __slots__ = ("connection", "loop", "fd", "waiter", "pending", "watched")

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.loop = asyncio.get_running_loop()
        self.fd = connection.fileno()
        self.waiter: asyncio.Future | None = None
        self.pending = False
        self.watched = False
        self._watch()

    @property
    def hung_up(self) -> bool:
        return self.pending

    def _watch(self) -> None:
        self.loop.add_reader(self.fd, self._readable)
        self.watched = True

    def _readable(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(None)
        elif self.connection.poll(0):  # (not an event of the reply just read: still there)
            self.pending = True
            self.loop.remove_reader(self.fd)
            self.watched = False

    async def reply(self, deadline: float | None) -> None:
        if self.pending:  # here already: watched again for the next one
            self.pending = False
            self._watch()
            return
        loop = self.loop
        while True:
            waiter = self.waiter = loop.create_future()
            timer = None if deadline is None else loop.call_later(
                deadline - time.monotonic(), _expire, waiter, self.connection)
            try:
                await waiter
            finally:
                self.waiter = None
                if timer is not None:
                    timer.cancel()
            if self.connection.poll(0):  # else woken by an event of the last reply: wait on
                return

    def close(self) -> None:
        if self.watched and not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
            self.watched = False


def _expire(waiter: asyncio.Future, connection: Connection) -> None:
    if not waiter.done():
        waiter.set_exception(errors.ReplyTimeout(connection.alias, connection.io_timeout or 0.0))


class Asyncio:
    """The asyncio driver's side of the exchange (:class:`exchange.Driver`): every wait
    a :class:`exchange.Wait`, awaited on the loop."""

    pool = staticmethod(pools.loop_pool)

    @staticmethod
    def checkout(pool: pools.LoopPool) -> Wait:
        return Wait(pool.checkout())

    @staticmethod
    def reply(connection: Connection, deadline: float | None) -> Wait:
        """Until ``connection``'s reply is here (ReplyTimeout at ``deadline``), watched
        by the loop from the connection's first statement on."""
        watch = connection.watch
        if watch is None:
            watch = connection.watch = Watch(connection)
        return Wait(watch.reply(deadline))

    @staticmethod
    def sleep(seconds: float) -> Wait:
        return Wait(asyncio.sleep(seconds))


ASYNCIO = Asyncio()


async def execute(session: Session, calls: Sequence[policy.Call]) -> list[Any]:
    """:func:`policy.execute` on the running loop's connections."""
    return await arun(policy.execute(session, calls, ASYNCIO))  # type: ignore[no-any-return]


def close_pools(aliases: Sequence[str]) -> None:
    """Close the running loop's idle connections to ``aliases``."""
    pools.close_idle(aliases, loop=True)
