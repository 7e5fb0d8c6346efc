"""Keeping a MySQLCache table under ``MAX_ENTRIES`` without ever counting it.

1. Expired rows go first, oldest first, through the expiry index in batches (with
   STALE_TIMEOUT, only those expired longer ago than that: the others are stale values
   ``get_or_set`` may still serve).
2. If a row still exists at offset ``MAX_ENTRIES`` the table is over its limit: the
   entries closest to expiry are evicted until ``MAX_ENTRIES - MAX_ENTRIES // CULL_FREQUENCY``
   remain (``CULL_FREQUENCY`` 0 or 1, and ``MAX_ENTRIES`` 0, empty the table).
3. With ``MAX_SIZE``, if the table's stored bytes (estimated, plus what is about to be
   written) are over the budget, the entries closest to expiry are evicted in the same order until
   they fit (:mod:`~django_kvcache.mysql.budget`).

OPTIONS refuses negative numbers, but Django's own tests set ``cache._max_entries = -1``
on a live cache to force a cull. Django's backends then find the cache always over its
limit, which ``MAX_ENTRIES`` 0 means here: negative numbers count as 0, numbers past what
the server parses in ``OFFSET`` as that maximum, and no eviction keeps more than
``MAX_ENTRIES`` (a negative ``CULL_FREQUENCY`` would ask for more), so every number
builds valid SQL.

Each statement touches at most ``MAX_ENTRIES`` index entries or one batch of rows, so the
cost does not grow with the table. Every DELETE is bounded by ``LIMIT`` so no single
statement holds locks on a large part of the table.
"""
from __future__ import annotations

from typing import Any, Generator

from django_kvcache.mysql import budget
from django_kvcache.mysql.query import Query, first_row, rowcount
from django_kvcache.mysql.sql import Statements

#: Rows per DELETE. Small on the write path, so a request that draws a cull holds few
#: locks; larger for ``cull()`` and ``kvcache_cull``, because each batch re-scans the
#: index entries the earlier batches delete-marked (InnoDB purges them later), so many
#: small batches cost far more in total (33k rows: ~600 ms in batches of 1000, ~150 ms
#: in batches of 10,000 on the benchmark machine).
BATCH_SIZE = 1000
FULL_CULL_BATCH_SIZE = 10_000
#: A cull drawn on the write path stops after this many batches; the rest waits for the
#: next one (or for ``kvcache_cull``), so one unlucky request never pays for a backlog.
WRITE_PATH_BATCHES = 10
#: The limit check reads up to MAX_ENTRIES index entries. On the write path it runs with
#: probability ``LIMIT_CHECK_ENTRIES / MAX_ENTRIES`` (always when MAX_ENTRIES is at most
#: this), so a write pays for at most this many entries per cull on average, however
#: large the table. The price: a large cache may overshoot MAX_ENTRIES between checks by
#: about ``MAX_ENTRIES / (LIMIT_CHECK_ENTRIES * CULL_PROBABILITY)`` new keys at worst.
LIMIT_CHECK_ENTRIES = 1000
#: A full cull's MAX_SIZE eviction stops after this many rounds (of up to
#: ``budget.EVICTION_BATCH`` rows): ``kvcache_cull`` runs again for the rest.
MAX_BUDGET_ROUNDS = 10_000
#: The largest number MySQL and MariaDB parse in ``LIMIT``/``OFFSET`` (BIGINT UNSIGNED).
MAX_OFFSET = 2**64 - 1

Statements_ = Generator[Query, Any, int]


def draw_limit_check(max_entries: int, draw: float) -> bool:
    """Whether a write-path cull checks the limit, given a uniform ``draw`` in [0, 1)."""
    return draw * max_entries < LIMIT_CHECK_ENTRIES


class Cull:
    """One cull of one table, as a plan: :meth:`run` yields each statement and gets its
    answer back (run by whichever driver runs the call)."""

    def __init__(
        self,
        sql: Statements,
        max_entries: int,
        cull_frequency: int,
        max_batches: int | None = None,
        check_limit: bool = True,
        batch_size: int | None = None,
        keep_stale_ms: int = 0,
        max_size: int | None = None,
        incoming: int = 0,
        delete_expired: bool = True,
        observe: budget.Observer | None = None,
        where: tuple[str, str] = ("", ""),
    ) -> None:
        self.sql = sql
        self.max_entries = min(max(max_entries, 0), MAX_OFFSET)
        self.cull_frequency = cull_frequency
        self.batches_left = max_batches if max_batches is not None else float("inf")
        self.check_limit = check_limit
        self.batch_size = batch_size or BATCH_SIZE
        #: STALE_TIMEOUT in ms: expired rows are kept this long for ``get_or_set`` to
        #: serve while one caller recomputes (eviction over MAX_ENTRIES still takes them
        #: first, as they expire first).
        self.keep_stale_ms = max(keep_stale_ms, 0)
        #: MAX_SIZE (this shard's share), checked after MAX_ENTRIES with ``incoming``
        #: bytes about to be written (:mod:`~django_kvcache.mysql.budget`).
        self.max_size = max_size
        self.incoming = incoming
        #: False when only the budget drew this cull: its eviction takes expired rows
        #: first anyway, and one statement less keeps the check cheap.
        self.delete_expired = delete_expired
        self.observe = observe
        #: (database alias, table) the cull runs on: whose layout the budget remembers.
        self.where = where

    def run(self, now_ms: int) -> Statements_:
        """Delete expired rows, then evict if over the limit, then if over the byte
        budget; returns the rows deleted."""
        deleted = 0
        if self.delete_expired:
            expired_before = now_ms - self.keep_stale_ms
            deleted += yield from self.delete_in_batches(
                self.sql.delete_expired, [expired_before])
        if self.check_limit:
            if (yield Query(self.sql.row_at, [self.max_entries], first_row)) is not None:
                deleted += yield from self.evict()
        if self.max_size is not None and self.batches_left > 0:
            batches = int(min(self.batches_left, MAX_BUDGET_ROUNDS))
            deleted += yield from budget.enforce(
                self.sql, self.max_size, self.incoming, batches, self.where, self.observe)
        return deleted

    def entries_to_keep(self) -> int:
        if self.cull_frequency == 0:  # Django's meaning: clear the whole cache
            return 0
        return min(self.max_entries - self.max_entries // self.cull_frequency, self.max_entries)

    def evict(self) -> Statements_:
        keep = self.entries_to_keep()
        if keep == 0:
            return (yield from self.delete_in_batches(self.sql.evict_all, []))
        # The newest entry to go, in (expires, cache_key) order: the key breaks ties so
        # that entries sharing one expiry (e.g. every "forever" entry) are split exactly.
        row = yield Query(self.sql.nth_latest, [keep], first_row)
        if row is None:  # someone else deleted rows in the meantime
            return 0
        expires, key = row
        return (yield from self.delete_in_batches(self.sql.evict_through, [expires, expires, key]))

    def delete_in_batches(self, statement: str, params: list[Any]) -> Statements_:
        deleted = 0
        while self.batches_left > 0:
            self.batches_left -= 1
            count = yield Query(statement, [*params, self.batch_size], rowcount)
            deleted += count
            if count < self.batch_size:
                break
        return deleted
