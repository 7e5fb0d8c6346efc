"""``OPTIONS["MAX_SIZE"]``: a MySQLCache table kept under a byte budget, never scanned.

What the budget counts: each row's key and stored value, ``LENGTH(cache_key) +
LENGTH(value)`` — the bytes the cache writes after serialization, compression and
encryption (not InnoDB's page overhead, the ``flags``/``expires`` columns or the
indexes: docs/mysql.rst, "Sizing", says what a server needs on top).

How it is known: estimated from a sample, by the server, with nothing kept per write.
A table made for MAX_SIZE has two generated columns — ``key_hash``, the key's CRC32
(spread evenly over its 32 bits, whatever the keys look like), and ``byte_size``, what
the row counts —
and an index on both (:data:`SAMPLE_INDEX`). The :data:`SAMPLE_ROWS` + 1 entries of
lowest ``key_hash`` are a uniform sample of the rows (the hash does not depend on the
size), read as one range of that covering index whatever the table's size
(:func:`estimate`): a table of no more than SAMPLE_ROWS rows is summed exactly; a
larger one is estimated from the sample's k-th smallest hash (the k minimum values
estimate of the row count, ``(k - 1) / (h_k / 2**32)``, unbiased) times the sample's
mean row size (unbiased, and independent of it: which rows hash lowest does not depend on
the hash values' order statistics). Its relative standard deviation is about
``sqrt((1 + cv²) / k)`` (cv: the rows' coefficient of variation of size); measured over
400 sets of 100k keys with 100 B-20 kB values, 0.7 % median and 3.9 % p99 error in bytes
with 10,000 rows (2.9 % and 14 % with 1,000). Every writer is counted (this cache's statements, ``kvcache_cull``, other
processes, a manual ``DELETE``): the estimate reads the table as it is.

This replaced a running total kept by triggers in a side table (``<LOCATION>_size``):
updating its shared rows cost each write 25-30 µs of server CPU (a ``set`` 1.2x its
time) and its rows collided between Galera nodes. A table made by that release is
upgraded by ``kvcache_createtable``/``migrate`` (:func:`upgrade_sql`); until then the
budget reads the old side table, which its triggers still keep (:func:`layout`).

How it is held: before a write, with a probability that grows with the bytes written
(:func:`draw`: on average one check per :data:`CHECK_FRACTION` of the budget written),
the write-path cull estimates the total and, when the row about to be written would take
it over the budget, evicts the entries closest to expiry (the expiry index's order, as
over ``MAX_ENTRIES``: expired rows first, entries that never expire last) in bounded
batches until :data:`HEADROOM` of the budget is free again, counting off the bytes it
deleted. ``kvcache_cull`` does the same with nothing incoming. Over several shards, the
budget is split by their WEIGHTS (equal shares without): each shard keeps its table
under its share.
"""
from __future__ import annotations

import logging
import math
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Generator, NamedTuple, Sequence

from django.core.exceptions import ImproperlyConfigured

from django_kvcache.failure_log import FailureLog
from django_kvcache.mysql import blocking
from django_kvcache.mysql.query import Query, first_row, rowcount
from django_kvcache.mysql.query import rows as all_rows
from django_kvcache.mysql.sql import (  # the DDL of the estimate's columns: a table's own
    LAYOUT_QUERY,
    SAMPLE_COLUMNS,
    SAMPLE_INDEX,
    sample_columns_sql,
    sample_index_sql,
    quote_name,
    side_table,
    size_table,
    BudgetStatements,
)

if TYPE_CHECKING:
    from django_kvcache.mysql.sql import Statements

#: Rows the estimate reads (index entries of :data:`SAMPLE_INDEX`): a table of no more
#: rows is summed exactly; a larger one is estimated with a relative standard deviation
#: of about ``sqrt((1 + cv²) / SAMPLE_ROWS)`` (about 1.6 % for 100 B-20 kB values,
#: measured 0.7 % median, 3.9 % p99 error). Reading them costs the server about 3 ms,
#: once per :data:`CHECK_FRACTION` of the budget written.
SAMPLE_ROWS = 10_000
#: ``key_hash`` is the key's CRC32: values in ``[0, HASH_SPACE)``. An MD5 (60 of its bits)
#: was measured too: its error on the same tables was no smaller, and computing it (with
#: the conversions to a number) cost each write 6-9 µs more of server CPU than CRC32.
HASH_SPACE = 2**32
#: On average, one budget check per this fraction of the budget written (per shard): a
#: table overshoots its budget by about this much between two checks.
CHECK_FRACTION = 0.02
#: An eviction frees this fraction of the budget beyond what the incoming row needs, so
#: that a full cache does not evict on every check.
HEADROOM = 0.02
#: The largest number of rows one eviction statement deletes.
EVICTION_BATCH = 1000

UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
SIZE_TEXT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*\Z")


def max_size(options: dict[str, Any]) -> int | None:
    """``OPTIONS["MAX_SIZE"]``: ``None`` (no budget), a positive number of bytes, or a text
    such as ``"20GB"``, ``"512MB"``, ``"1.5GiB"`` (KB, MB, GB, TB are powers of 1000;
    KiB, MiB, GiB, TiB powers of 1024)."""
    value = options.get("MAX_SIZE")
    if value is None:
        return None
    size: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        match = SIZE_TEXT.match(value)
        unit = match and UNITS.get(match.group(2).upper())
        if match and unit:
            size = float(match.group(1)) * unit
    if size is None or not math.isfinite(size) or int(size) < 1:
        raise ImproperlyConfigured(
            "OPTIONS['MAX_SIZE'] must be None, a positive number of bytes or a size such as "
            f"'512MB' or '20GB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}"
        )
    return int(size)


def shares(budget: int | None, weights: Sequence[float]) -> list[int | None]:
    """Each shard's part of the budget, by weight (one shard: all of it)."""
    if budget is None:
        return [None] * len(weights)
    total = sum(weights)
    return [max(1, int(budget * weight / total)) for weight in weights]


def row_bytes_of(key: str, value: bytes) -> int:
    """What the budget counts of a row: its key's UTF-8 bytes and its stored value's."""
    return len(key.encode()) + len(value)


def draw(incoming: int, budget: int, uniform: float) -> bool:
    """Whether a write of ``incoming`` bytes checks the budget, given ``uniform`` in [0, 1)."""
    return uniform * CHECK_FRACTION * budget < incoming


# --- the tables ------------------------------------------------------------------------------

# The side table and triggers of the release that kept an exact total (see the module's
# docstring): only read until the upgrade, and dropped by it.

def trigger_names(table: str) -> list[str]:
    """The old triggers that kept :func:`size_table`."""
    return [side_table(table, f"_size_{event}") for event in ("ins", "upd", "del")]


TRIGGERS_QUERY = (
    "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS WHERE TRIGGER_SCHEMA = DATABASE() "
    "AND EVENT_OBJECT_TABLE = %s"
)

#: How the budget reads a table's total (:func:`layout`).
SAMPLED, OLD_TOTALS, UNKNOWN = "sampled", "old totals", "unknown"


def layout_of(found: Any) -> str:
    """From a :data:`LAYOUT_QUERY` row: SAMPLED (the columns and index are there),
    OLD_TOTALS (not yet upgraded, the old size table is there), else UNKNOWN."""
    columns, indexes, old = (int(value or 0) for value in (found or (0, 0, 0)))
    if columns == len(SAMPLE_COLUMNS) and indexes:
        return SAMPLED
    return OLD_TOTALS if old else UNKNOWN


def outdated(database: str, table: str) -> list[str]:
    """What ``table`` in ``database`` lacks for the estimate, or keeps of the old totals
    (an upgrade's list, read on the blocking driver); [] when it is ready."""
    columns = {row[0] for row in blocking.query(
        database, "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = "
        "DATABASE() AND TABLE_NAME = %s", [table])}
    if not columns:
        return []  # no table: it is missing, not outdated
    indexes = {row[0] for row in blocking.query(
        database, "SELECT INDEX_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = "
        "DATABASE() AND TABLE_NAME = %s", [table])}
    triggers = {row[0] for row in blocking.query(database, TRIGGERS_QUERY, [table])}
    old_table = blocking.query(
        database, "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = "
        "DATABASE() AND TABLE_NAME = %s", [size_table(table)])
    lacks = [f"column {name}" for name in SAMPLE_COLUMNS if name not in columns]
    if SAMPLE_INDEX not in indexes:
        lacks.append(f"index {SAMPLE_INDEX}")
    lacks += [f"trigger {name}" for name in trigger_names(table) if name in triggers]
    if old_table:
        lacks.append(f"table {size_table(table)}")
    return lacks


def upgrade_sql(table: str, quote_name: Callable[[str], str], mariadb: bool, engine: str,
                lacks: Sequence[str]) -> list[str]:
    """The statements that bring a table to what :func:`outdated` found it ``lacks``:
    the columns (INSTANT where the server can), the index (built in place, writes go on),
    then the old triggers and size table dropped (after the index: until then, processes
    not yet upgraded read the old totals)."""
    t = quote_name(table)
    statements = []
    definitions = zip(SAMPLE_COLUMNS, sample_columns_sql(mariadb, engine))
    columns = [definition for name, definition in definitions if f"column {name}" in lacks]
    if columns:
        statements.append(f"ALTER TABLE {t} " + ", ".join(f"ADD COLUMN {c}" for c in columns))
    if f"index {SAMPLE_INDEX}" in lacks:
        statements.append(f"ALTER TABLE {t} ADD {sample_index_sql()}")
    statements += [f"DROP TRIGGER IF EXISTS {quote_name(name)}" for name in trigger_names(table)
                   if f"trigger {name}" in lacks]
    if f"table {size_table(table)}" in lacks:
        statements.append(f"DROP TABLE IF EXISTS {quote_name(size_table(table))}")
    return statements


# --- the estimate ---------------------------------------------------------------------------

class Estimate(NamedTuple):
    """What a table holds: bytes (keys and stored values) and rows; ``exact`` when summed
    (no more rows than SAMPLE_ROWS, or the old totals), else estimated from a sample."""

    bytes: int
    entries: int
    exact: bool


def from_sample(found: Any, sample_rows: int = SAMPLE_ROWS) -> Estimate:
    """The estimate from a :attr:`BudgetStatements.sample` row read with LIMIT
    ``sample_rows + 1``: (rows, their bytes, their largest key_hash)."""
    rows, size, largest = (int(value or 0) for value in (found or (0, 0, 0)))
    if rows <= sample_rows:
        return Estimate(size, rows, True)
    # The k minimum values: the k-th smallest of N uniform hashes is about k / N of the
    # space, and (k - 1) over that fraction estimates N without bias; the sample's mean
    # size, independent of it, times that estimates the bytes without bias.
    entries = (rows - 1) * HASH_SPACE / (largest + 1)
    return Estimate(round(size / rows * entries), round(entries), False)


#: Seconds a table's layout (:func:`layout`) is remembered by a process: an upgrade by
#: ``kvcache_createtable`` in another process is seen within this.
REMEMBER_LAYOUT = 60.0
_layouts: dict[tuple[str, str], tuple[float, str]] = {}
_layouts_lock = threading.Lock()


def remembered_layout(where: tuple[str, str]) -> str | None:
    """The layout of table ``where`` = (database alias, table) read lately, if any."""
    with _layouts_lock:
        found = _layouts.get(where)
    if found is not None and time.monotonic() - found[0] < REMEMBER_LAYOUT:
        return found[1]
    return None


def remember_layout(where: tuple[str, str], kind: str) -> str:
    with _layouts_lock:
        _layouts[where] = (time.monotonic(), kind)
    return kind


def layout(sql: Statements, where: tuple[str, str]) -> Generator[Query, Any, str]:
    """How the budget reads table ``where``: SAMPLED, OLD_TOTALS or UNKNOWN, asked of
    the server at most once per REMEMBER_LAYOUT seconds per process."""
    kind = remembered_layout(where)
    if kind is None:
        table = sql.budget.table
        found = yield Query(sql.budget.layout, (table, table, size_table(table)), first_row)
        kind = remember_layout(where, layout_of(found))
    return kind


def forget_layouts() -> None:
    """After DDL in this process: read each table's layout again."""
    with _layouts_lock:
        _layouts.clear()


def forget_layout(where: tuple[str, str]) -> None:
    with _layouts_lock:
        _layouts.pop(where, None)


class NotReady(Exception):
    """A budgeted table neither upgraded nor with the old size table: nothing to read
    its total from (``kvcache_createtable`` or ``migrate`` adds what it lacks)."""


def not_ready(table: str, database: str) -> NotReady:
    return NotReady(
        f"the table {table!r} in database {database!r} lacks the columns and index "
        f"MAX_SIZE's estimate reads ({', '.join(SAMPLE_COLUMNS)}, {SAMPLE_INDEX}): the "
        "budget is not enforced until 'manage.py kvcache_createtable' (or 'migrate') adds "
        "them"
    )


#: A budget that cannot be read (NotReady): logged once per episode, never raised on a
#: write, which goes on (the system check, kvcache.W004, says what to run).
not_ready_log = FailureLog(logging.getLogger("django_kvcache.backends.mysql"), "MAX_SIZE")


def estimate(sql: Statements, where: tuple[str, str]) -> Generator[Query, Any, Estimate | None]:
    """What table ``where`` (database alias, table) holds: sampled, or from the old
    totals until the table is upgraded; ``None`` (logged) when it can be neither."""
    kind = yield from layout(sql, where)
    try:
        if kind == SAMPLED:
            return from_sample((yield Query(sql.budget.sample, (SAMPLE_ROWS + 1,), first_row)))
        if kind == OLD_TOTALS:
            size, entries = yield Query(sql.budget.old_totals, (), totals)
            return Estimate(size, entries, True)
    except BaseException:  # noqa: B036  (an error thrown in, or GeneratorExit: the
        # failure policy closes a quiet cull's plan instead) The table may have changed
        # since its layout was read (upgraded by another process, dropped and made
        # again): read it again next time.
        forget_layout(where)
        raise
    not_ready_log.failed(f"{where[0]} table {where[1]}", not_ready(*reversed(where)))
    return None


def server_estimate(database: str, table: str) -> Estimate:
    """What ``table`` in ``database`` holds, estimated as a budget check does, on the
    blocking driver (``kvcache_stats``); NotReady when it cannot be."""
    statements = BudgetStatements(table, quote_name)
    kind = layout_of(blocking.query(database, statements.layout,
                                    [table, table, size_table(table)])[0])
    if kind == SAMPLED:
        return from_sample(blocking.query(database, statements.sample, [SAMPLE_ROWS + 1])[0])
    if kind == OLD_TOTALS:
        found = blocking.query(database, statements.old_totals)[0]
        return Estimate(int(found[0]), int(found[1]), True)
    raise not_ready(table, database)


Plan = Generator[Query, Any, int]


def totals(reply: Any) -> tuple[int, int]:
    row = first_row(reply)
    return (int(row[0]), int(row[1])) if row else (0, 0)


Observer = Callable[[Estimate], None]


def enforce(
    sql: Statements, budget: int, incoming: int, batches: int, where: tuple[str, str],
    observe: Observer | None = None,
) -> Plan:
    """Evict the entries closest to expiry until ``incoming`` more bytes fit under
    ``budget`` with HEADROOM to spare, by the estimate of table ``where`` (database
    alias, table) less what the eviction deleted; at most ``batches`` rounds of a SELECT
    of the next candidates (their sizes) and a DELETE of the fewest of them that free
    enough. Returns rows deleted. ``observe`` is handed the estimate, and what is left
    after an eviction (the process's figures)."""
    held = yield from estimate(sql, where)
    if held is None:
        return 0
    if observe is not None:
        observe(held)
    size, entries = held.bytes, held.entries
    if size + incoming <= budget:
        return 0
    target = max(budget - int(budget * HEADROOM) - incoming, 0)
    deleted = 0
    while size > target and entries > 0 and batches > 0:
        batches -= 1
        excess = size - target
        # Twice the rows of the table's average size that cover the excess: the rows
        # closest to expiry may be smaller; the next round reads more if they were.
        wanted = min(max(2 * math.ceil(excess * entries / size), 1), EVICTION_BATCH)
        candidates = yield Query(sql.budget.candidates, (wanted,), all_rows)
        if not candidates:
            break
        freed, taken = 0, 0
        for _, _, row_size in candidates:
            freed += int(row_size)
            taken += 1
            if freed >= excess:
                break
        expires, key, _ = candidates[taken - 1]
        count = yield Query(sql.evict_through, (expires, expires, key, taken), rowcount)
        deleted += count
        if count == 0:
            break
        # What the DELETE took (the candidates, unless another writer got some first):
        # no second sample, whose cost would be paid per round.
        size -= freed * count // taken
        entries -= count
    if deleted and observe is not None:
        observe(Estimate(max(size, 0), max(entries, 0), held.exact))
    return deleted
