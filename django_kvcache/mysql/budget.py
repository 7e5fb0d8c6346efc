"""``OPTIONS["MAX_SIZE"]``: a MySQLCache table kept under a byte budget, never scanned.

What the budget counts: each row's key and stored value, ``LENGTH(cache_key) +
LENGTH(value)`` — the bytes the cache writes after serialization, compression and
encryption (not InnoDB's page overhead, the ``flags``/``expires`` columns or the expiry
index: docs/mysql.rst, "Sizing", says what a server needs on top).

How it is known: exactly, by the server. A side table ``<LOCATION>_size`` holds running
totals (bytes and rows) in :data:`SLOTS` rows, and three triggers on the cache table add
each inserted, updated or deleted row's difference to the slot of the connection that
wrote it (slots spread the lock of a hot counter row over concurrent writers). Every
writer is counted — this cache's statements, ``kvcache_cull``, other processes, a
manual ``DELETE`` — and reading the total is a primary-key range over SLOTS rows,
whatever the table's size. The error is nil once installed; only rows written while
``kvcache_createtable``/``migrate`` installs the triggers on a non-empty table can be
missed (the seed total is summed before the triggers exist). Server statistics
(``information_schema.TABLES``) were the alternative: they count pages, lag behind by
up to a statistics recalculation and do not shrink after deletes.

How it is held: before a write, with a probability that grows with the bytes written
(:func:`draw`: on average one check per :data:`CHECK_FRACTION` of the budget written),
the write-path cull reads the total and, when the row about to be written would take it
over the budget, evicts the entries closest to expiry (the expiry index's order, as over
``MAX_ENTRIES``: expired rows first, entries that never expire last) in bounded batches
until :data:`HEADROOM` of the budget is free again. ``kvcache_cull`` does the same with
nothing incoming. Over several shards, the budget is split by their WEIGHTS (equal
shares without): each shard keeps its table under its share.
"""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Callable, Generator, Sequence

from django.core.exceptions import ImproperlyConfigured

from django_kvcache.mysql import blocking
from django_kvcache.mysql.query import Query, first_row, rowcount
from django_kvcache.mysql.query import rows as all_rows
from django_kvcache.mysql.sql import quote_name, side_table

if TYPE_CHECKING:
    from django_kvcache.mysql.sql import Statements

#: Rows of the size table: the triggers add to slot ``CONNECTION_ID() % SLOTS``.
SLOTS = 16
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

def size_table(table: str) -> str:
    """The running totals of cache table ``table``: ``<table>_size``."""
    return side_table(table, "_size")


def trigger_names(table: str) -> list[str]:
    return [side_table(table, f"_size_{event}") for event in ("ins", "upd", "del")]


def row_bytes(row: str) -> str:
    """What the budget counts of the row ``row`` (``NEW`` or ``OLD``)."""
    return f"LENGTH({row}.`cache_key`) + LENGTH({row}.`value`)"


def create_sql(table: str, quote_name: Callable[[str], str]) -> list[str]:
    """The size table, its totals (summed once from the rows already there) and the
    triggers that keep them; every statement does nothing when run again."""
    t, s = quote_name(table), quote_name(size_table(table))
    ins, upd, dele = (quote_name(name) for name in trigger_names(table))
    slot = f"WHERE `slot` = CONNECTION_ID() % {SLOTS}"
    zeros = ", ".join(f"({slot_}, 0, 0)" for slot_ in range(1, SLOTS))
    return [
        f"CREATE TABLE IF NOT EXISTS {s} (\n"
        "    `slot` SMALLINT UNSIGNED NOT NULL,\n"
        "    `bytes` BIGINT NOT NULL,\n"
        "    `entries` BIGINT NOT NULL,\n"
        "    PRIMARY KEY (`slot`)\n"
        ") ENGINE=InnoDB",
        f"INSERT IGNORE INTO {s} (`slot`, `bytes`, `entries`) SELECT 0, "
        f"COALESCE(SUM(LENGTH(`cache_key`) + LENGTH(`value`)), 0), COUNT(*) FROM {t}",
        f"INSERT IGNORE INTO {s} (`slot`, `bytes`, `entries`) VALUES {zeros}",
        f"CREATE TRIGGER IF NOT EXISTS {ins} AFTER INSERT ON {t} FOR EACH ROW "
        f"UPDATE {s} SET `bytes` = `bytes` + {row_bytes('NEW')}, `entries` = `entries` + 1 "
        f"{slot}",
        f"CREATE TRIGGER IF NOT EXISTS {upd} AFTER UPDATE ON {t} FOR EACH ROW "
        f"UPDATE {s} SET `bytes` = `bytes` + {row_bytes('NEW')} - ({row_bytes('OLD')}) {slot}",
        f"CREATE TRIGGER IF NOT EXISTS {dele} AFTER DELETE ON {t} FOR EACH ROW "
        f"UPDATE {s} SET `bytes` = `bytes` - ({row_bytes('OLD')}), `entries` = `entries` - 1 "
        f"{slot}",
    ]


def drop_sql(table: str, quote_name: Callable[[str], str]) -> list[str]:
    """The size table (the triggers go with the cache table, or before it)."""
    return [f"DROP TRIGGER IF EXISTS {quote_name(name)}" for name in trigger_names(table)] + [
        f"DROP TABLE IF EXISTS {quote_name(size_table(table))}"
    ]


def server_totals(database: str, table: str) -> tuple[int, int]:
    """The (bytes, rows) the size table of ``table`` in ``database`` counts, read on the
    blocking driver (``kvcache_stats``)."""
    found = blocking.query(database, f"SELECT COALESCE(SUM(`bytes`), 0), COALESCE(SUM("
                           f"`entries`), 0) FROM {quote_name(size_table(table))}")
    return (int(found[0][0]), int(found[0][1])) if found else (0, 0)


TRIGGERS_QUERY = (
    "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS WHERE TRIGGER_SCHEMA = DATABASE() "
    "AND EVENT_OBJECT_TABLE = %s"
)


def installed(tables: set[str], triggers: set[str], table: str) -> bool:
    """Whether the size table and all its triggers exist, given the database's tables and
    the triggers on ``table``."""
    return size_table(table) in tables and set(trigger_names(table)) <= triggers


class BudgetStatements:
    """The statements a budget check sends (``%s`` parameters, ``%`` doubled); its
    DELETE is the cull's (``Statements.evict_through``)."""

    def __init__(self, table: str, quote_name: Callable[[str], str]) -> None:
        t = quote_name(table).replace("%", "%%")
        s = quote_name(size_table(table)).replace("%", "%%")
        #: The totals: a primary-key range over the SLOTS rows.
        self.total = (
            f"SELECT COALESCE(SUM(`bytes`), 0), COALESCE(SUM(`entries`), 0) FROM {s} "
            f"WHERE `slot` < {SLOTS}"
        )
        #: The ``%s`` entries closest to expiry and what each counts, through the expiry
        #: index (the sizes read the values: an eviction reads what it deletes).
        #: (The expiry index alone picks them, in a derived table: asked for the values
        #: beside the order, the optimizer prefers a scan and a sort of the whole table.)
        self.candidates = (
            f"SELECT `first`.`expires`, `first`.`cache_key`, "
            f"LENGTH(`first`.`cache_key`) + LENGTH({t}.`value`) FROM (SELECT `expires`, "
            f"`cache_key` FROM {t} ORDER BY `expires`, `cache_key` LIMIT %s) AS `first` "
            f"JOIN {t} ON {t}.`cache_key` = `first`.`cache_key` "
            "ORDER BY `first`.`expires`, `first`.`cache_key`"
        )



Plan = Generator[Query, Any, int]


def totals(reply: Any) -> tuple[int, int]:
    row = first_row(reply)
    return (int(row[0]), int(row[1])) if row else (0, 0)


Observer = Callable[[int, int], None]


def stored_bytes(
    sql: Statements, observe: Observer | None = None
) -> Generator[Query, Any, tuple[int, int]]:
    """The table's (bytes, rows) as the size table counts them, handed to ``observe``."""
    size, entries = yield Query(sql.budget.total, (), totals)
    if observe is not None:
        observe(size, entries)
    return size, entries


def enforce(
    sql: Statements, budget: int, incoming: int, batches: int,
    observe: Observer | None = None,
) -> Plan:
    """Evict the entries closest to expiry until ``incoming`` more bytes fit under
    ``budget`` with HEADROOM to spare; at most ``batches`` rounds of a SELECT of the next
    candidates (their sizes) and a DELETE of the fewest of them that free enough.
    Returns rows deleted. ``observe`` is handed each (bytes, rows) read (the process's
    figures)."""
    size, entries = yield from stored_bytes(sql, observe)
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
        size, entries = yield from stored_bytes(sql, observe)
    return deleted
