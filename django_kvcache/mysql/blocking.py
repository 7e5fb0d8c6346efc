"""The blocking driver: the cache's statements in the calling thread.

What to send, which deadline applies and what an error or an interruption does are
decided once, by the failure policy (:mod:`~django_kvcache.mysql.policy`) and the
exchange (:mod:`~django_kvcache.mysql.exchange`); this driver only waits, in the thread:
for a connection of the process's pool for the alias (shared by every thread:
:func:`~django_kvcache.mysql.pools.process_pool`), for a reply (a poll of the
connection's socket until IO_TIMEOUT), for a rerun's pause. It also runs the statements
of tables and tools (:func:`query`), outside the failure policy.
"""
from __future__ import annotations

import time
from time import monotonic
from typing import Any, Sequence

from django_kvcache.mysql import errors, exchange, policy, pools
from django_kvcache.mysql.cluster import Session
from django_kvcache.mysql.connect import DEFAULT_SETTINGS, ConnectionSettings
from django_kvcache.mysql.connection import Connection
from django_kvcache.mysql.query import Query, rows
from django_kvcache.mysql.server import DETECT, ServerInfo, known_server, remember_server


class Blocking:
    """The blocking driver's side of the exchange (:class:`exchange.Driver`): every wait
    done in the thread, there and then."""

    pool = staticmethod(pools.process_pool)
    sleep = staticmethod(time.sleep)

    @staticmethod
    def checkout(pool: pools.ProcessPool) -> Connection:
        return pool.checkout()

    @staticmethod
    def reply(connection: Connection, deadline: float | None) -> None:
        """Until ``connection``'s reply is here (a poll of its socket): ReplyTimeout at
        ``deadline``."""
        if deadline is None:
            connection.poll(-1)
        elif not connection.poll(max(deadline - monotonic(), 0.0) * 1000):
            raise errors.ReplyTimeout(connection.alias, connection.io_timeout or 0.0)


BLOCKING = Blocking()


def execute(session: Session, calls: Sequence[policy.Call]) -> list[Any]:
    """:func:`policy.execute` in this thread, on the process's connections."""
    return done(policy.execute(session, calls, BLOCKING))


def done(plan: Any) -> Any:
    """What ``plan`` returns: on this driver it yields nothing (every wait is done in
    place), so it ends at its first step."""
    try:
        plan.send(None)
    except StopIteration as finished:
        return finished.value
    plan.close()
    raise RuntimeError("a plan on the blocking driver yielded a wait")


# --- statements outside the request path (tables, dictionaries, tools) ------------------


def query(alias: str, statement: str, params: Sequence[Any] | None = None,
          settings: ConnectionSettings = DEFAULT_SETTINGS) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of ``alias``'s pool (DDL and tools, outside the
    failure policy: errors are raised as Django's); its rows (none for a write).
    Without ``params`` the statement is sent as it is (no ``%`` formatting).
    ``settings``: the pool's (``connect.DDL_SETTINGS`` for DDL, which has no reply limit)."""
    statement_query = Query(statement, params, rows)  # type: ignore[arg-type]
    (reply,) = done(exchange.perform([(alias, statement_query)], settings, BLOCKING))
    if isinstance(reply, exchange.Failed):
        raise reply.error
    return list(rows(reply))


def server_info(alias: str) -> ServerInfo:
    """The server behind ``alias`` (for DDL and tools: outside any request path)."""
    info = known_server(alias)
    if info is None:
        info = remember_server(alias, query(alias, DETECT.sql)[0])
    return info


# --- the process's pools (for tools and tests) -------------------------------------------------


def close_pools(aliases: Sequence[str]) -> None:
    """Close the process's idle connections to ``aliases``."""
    pools.close_idle(aliases)


def retire_pools(aliases: Sequence[str]) -> None:
    """Forget the process's pools for ``aliases`` (see :func:`pools.retire`)."""
    pools.retire(aliases)
