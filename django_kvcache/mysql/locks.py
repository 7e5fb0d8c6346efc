"""MySQLCache's lock store: one row per lock name in the cache's lock table.

The shared rules (:mod:`django_kvcache.locks`) decide when to try, wait and give up;
this module gives them, for one name, four statements (``sql.LockStatements``):

* **grant** — one ``INSERT … ON DUPLICATE KEY UPDATE`` that takes the row if it is
  missing, expired or released, stores the caller's owner id and expiry, and advances the
  token to ``GREATEST(token + 1, clock in µs)``; ``LAST_INSERT_ID`` hands the new token
  back (or, while someone else holds the lock, a number that says so). One statement, so
  on Galera two nodes' grants of one name conflict at certification: one commits, the
  other fails with 1213 and runs again (``mysql/errors.py``), then finds the lock held.
* **release** / **extend** — an ``UPDATE`` of the row only while it holds this caller's
  owner id and has not expired: never a blind write. A released row expires at once and
  keeps its token.
* **peek** — the live grant's owner, if any.

Rows are never deleted (culling, ``clear()`` and prefix deletes touch only the cache
table), so a name's token only grows. Expiry is judged by the database server's clock
(``sql.NOW_US``), not the application servers'. A name lives on the shard its stored
key routes to, always on that shard's primary; every call commits on its own, on the
cache's own connections (never inside a caller's transaction).
"""
from __future__ import annotations

import math
from typing import Any, Callable

from django.db import DatabaseError

from django_kvcache import locks, steps
from django_kvcache.mysql import errors, plans
from django_kvcache.mysql.cluster import Session
from django_kvcache.mysql.errors import CacheTableMissing
from django_kvcache.mysql.query import INFO, ROWCOUNT, Query, Reply, lastrowid, rows
from django_kvcache.mysql.sql import LOCK_BUSY, Statements

#: The longest lease (and extension) in microseconds: far beyond any real one, and far
#: enough below the largest BIGINT that the clock plus it never overflows.
LONGEST_US = 2**61


def matched(reply: Reply) -> int:
    """Rows an UPDATE matched, whether or not it changed them (the info line says,
    whatever CLIENT.FOUND_ROWS is)."""
    info = reply[INFO]
    if info:
        counts = info.partition("Rows matched: ")[2].split()
        if counts:
            return int(counts[0])
    return reply[ROWCOUNT]  # type: ignore[no-any-return]


def microseconds(seconds: float) -> int:
    return min(max(math.ceil(seconds * 1_000_000), 1), LONGEST_US)


class MySQLLockStore:
    """:class:`django_kvcache.locks.LockStore` for one name of a MySQLCache."""

    def __init__(
        self, session: Session, key: str,
        missing: Callable[[str, list[str] | None], BaseException],
    ) -> None:
        """``key``: the name as a stored key; ``missing(alias, columns)``: the error for a
        lock table that does not exist there, beside a cache table of ``columns``."""
        self.session = session
        self.key = key
        self.missing = missing
        self.shard = session.cluster.shard_for(key)
        self.where = f"MySQL shard {self.shard.primary()!r}"

    def __repr__(self) -> str:
        return f"<MySQLLockStore {self.key!r} on {self.where}>"

    def unreachable(self, exc: BaseException) -> bool:
        return isinstance(exc, DatabaseError) and errors.is_unreachable(exc)

    def _run(self, work: Callable[[Statements], Query]) -> steps.Plan:
        try:
            return (yield plans.lock(self.session, self.key, work))
        except CacheTableMissing as exc:
            # Which table is wrong: the lock table, or the cache table beside it (another
            # library's, next to which kvcache_createtable makes no lock table).
            alias = self.shard.primary()
            columns = yield from plans.table_columns(self.session, self.shard, alias)
            raise self.missing(alias, columns) from exc.__cause__

    def grant(self, grant: locks.Grant, seconds: float | None) -> steps.Plan:
        key, owner = self.key, grant.owner

        def work(sql: Statements) -> Query:
            if seconds is None:
                return Query(sql.locks.grant_forever, (key, *[owner] * 5), lastrowid)
            lease = microseconds(seconds)
            return Query(sql.locks.grant_for, (key, lease, *[owner] * 5, lease), lastrowid)

        # Safe to send again after a lost reply: a grant already this owner's is taken
        # again (with a new token), never waited for.
        answer = yield from self._run(work)
        if answer >= LOCK_BUSY:
            return False
        grant.token = answer
        return True

    def release(self, grant: locks.Grant) -> steps.Plan:
        key, owner = self.key, grant.owner
        # Not sent again after a lost reply: a second run would answer "not ours".
        return (yield from self._run(
            lambda sql: Query(sql.locks.release, (key, owner), matched, idempotent=False)
        )) > 0

    def extend(self, grant: locks.Grant, seconds: float, replace: bool) -> steps.Plan:
        key, owner, lease = self.key, grant.owner, microseconds(seconds) if seconds else 0
        params = (int(replace), lease, lease, key, owner)
        return (yield from self._run(
            lambda sql: Query(sql.locks.extend, params, matched, idempotent=False)
        )) > 0

    def peek(self) -> steps.Plan:
        key = self.key
        found = yield from self._run(lambda sql: Query(sql.locks.peek, (key,), rows))
        return bytes(found[0][0]) if found else None

    def holder_token(self) -> steps.Plan:
        """The live grant's token, or None (for tests and tools)."""
        key = self.key
        found: Any = yield from self._run(lambda sql: Query(sql.locks.peek, (key,), rows))
        return found[0][1] if found else None
