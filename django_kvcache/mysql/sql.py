"""The SQL text of every MySQLCache operation, built once per table and server flavour.

``%s`` parameters carry keys and times; values up to HEX_LIMIT bytes are written into the
statement as hex literals (:func:`value_sql`), larger ones are parameters too. The table
name is quoted by the connection (and its ``%`` doubled, since the driver %-formats
statements with parameters). Times are epoch milliseconds computed in Python (see
``docs/mysql.rst``).
"""
from __future__ import annotations

import hashlib
import re
import time
from functools import lru_cache
from typing import Callable

from django.core.exceptions import ImproperlyConfigured

from django_kvcache.encryption import FLAG_ENCRYPTED, KEY_ID_SHIFT, NONCE_BYTES
from django_kvcache.mysql.keys import LIKE_ESCAPE, MAX_KEY_LENGTH

#: ``expires`` of an entry that never expires. The largest BIGINT sorts such rows last in
#: the expiry index, so eviction reaches them only after every entry that does expire.
FOREVER = 2**63 - 1


def now_ms() -> int:
    """The application's clock as the ``expires`` column counts: ms since the epoch."""
    return time.time_ns() // 1_000_000


FOREVER_SECONDS = FOREVER // 1000


def expires_at(seconds: float | None) -> int | None:
    """The ``expires`` of an entry stored now for ``seconds`` (Django's: ``None``
    forever); ``None`` when it expires at once (0 and below)."""
    if seconds is None:
        return FOREVER
    if seconds <= 0:
        return None
    if seconds >= FOREVER_SECONDS:  # also keeps float("inf") out of int()
        return FOREVER
    return min(now_ms() + int(seconds * 1000), FOREVER)


INT64_RANGE = "-9223372036854775808 AND 9223372036854775807"
INTEGER_FLAGS = "2, 4"  # codec.FLAG_INTEGER and codec.FLAG_LONG: decimal text
ENGINE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}\Z")

# Binary, NO PAD collations: "a" and "a " stay two keys (the *_bin collations pad).
MARIADB_COLLATION = "utf8mb4_nopad_bin"
MYSQL_COLLATION = "utf8mb4_0900_bin"


def quote_name(name: str) -> str:
    """``name`` quoted as Django's MySQL backend quotes it (names with a backtick are
    refused earlier: :func:`~django_kvcache.mysql.config.check_table`)."""
    if name.startswith("`") and name.endswith("`"):
        return name
    return f"`{name}`"


def check_engine(engine: object) -> str:
    if not isinstance(engine, str) or not ENGINE_NAME.match(engine):
        raise ImproperlyConfigured(
            f"OPTIONS['ENGINE'] must be a storage engine name such as 'InnoDB', got {engine!r}"
        )
    return engine


def create_table_sql(
    table: str,
    quote_name: Callable[[str], str],
    mariadb: bool,
    engine: str = "InnoDB",
    collation: str | None = None,
    sampled: bool = False,
) -> str:
    """The table's DDL; ``collation`` defaults to the flavour's binary NO PAD one.
    ``sampled`` (MAX_SIZE): with the generated columns and index its estimate reads."""
    collation = collation or (MARIADB_COLLATION if mariadb else MYSQL_COLLATION)
    extra_columns, extra_keys = "", ""
    if sampled:
        columns = sample_columns_sql(mariadb, engine)
        extra_columns = "".join(f"    {column},\n" for column in columns)
        extra_keys = f",\n    {sample_index_sql()}"
    return (
        f"CREATE TABLE IF NOT EXISTS {quote_name(table)} (\n"
        f"    `cache_key` VARCHAR({MAX_KEY_LENGTH}) CHARACTER SET utf8mb4"
        f" COLLATE {collation} NOT NULL,\n"
        "    `value` LONGBLOB NOT NULL,\n"
        "    `flags` INT UNSIGNED NOT NULL,\n"
        "    `expires` BIGINT NOT NULL,\n"
        f"{extra_columns}"
        "    PRIMARY KEY (`cache_key`),\n"
        f"    KEY `kvcache_expires` (`expires`){extra_keys}\n"
        f") ENGINE={check_engine(engine)} DEFAULT CHARSET=utf8mb4 COLLATE={collation}"
    )


#: MAX_SIZE's estimate (``django_kvcache.mysql.budget``) reads this index of a budgeted
#: table: (key_hash, byte_size), covering.
SAMPLE_INDEX = "kvcache_sample"
#: The generated columns of a budgeted table, in order (:func:`sample_columns_sql`).
SAMPLE_COLUMNS = ("key_hash", "byte_size")


def sample_columns_sql(mariadb: bool, engine: str) -> list[str]:
    """The generated columns of a budgeted table. VIRTUAL: no bytes in the row, added to
    an existing table without a copy (ALGORITHM=INSTANT); their index stores the values.
    Only some engines index a virtual column (MySQL: InnoDB; MariaDB: InnoDB and MyISAM,
    not Aria, error 1904): the others store them."""
    indexes_virtual = {"innodb", "myisam"} if mariadb else {"innodb"}
    kind = "VIRTUAL" if engine.lower() in indexes_virtual else "STORED"
    return [
        f"`key_hash` INT UNSIGNED GENERATED ALWAYS AS (CRC32(`cache_key`)) {kind}",
        f"`byte_size` BIGINT UNSIGNED GENERATED ALWAYS AS "
        f"(LENGTH(`cache_key`) + LENGTH(`value`)) {kind}",
    ]


def sample_index_sql() -> str:
    return f"KEY `{SAMPLE_INDEX}` (`key_hash`, `byte_size`)"


def drop_table_sql(table: str, quote_name: Callable[[str], str]) -> str:
    return f"DROP TABLE IF EXISTS {quote_name(table)}"


# --- locks (``django_kvcache.mysql.locks``) ---------------------------------------------------

def side_table(table: str, suffix: str) -> str:
    """A table kept beside cache table ``table``: ``<table><suffix>``, or for a name too
    long for that, its head and a digest of the whole (64 characters at most)."""
    name = table + suffix
    if len(name) <= 64:
        return name
    digest = hashlib.sha256(table.encode()).hexdigest()[:8]
    return f"{table[:64 - len(suffix) - 9]}_{digest}{suffix}"


def lock_table(table: str) -> str:
    """The lock table of cache table ``table``: ``<table>_locks``."""
    return side_table(table, "_locks")


def create_lock_table_sql(
    table: str, quote_name: Callable[[str], str], mariadb: bool, collation: str | None = None
) -> str:
    """The lock table of cache table ``table``: one row per lock name, never deleted (a
    released or expired row keeps its token, so tokens only grow). InnoDB whatever the
    cache's ENGINE: its rows must survive a restart, and Galera replicates only InnoDB."""
    collation = collation or (MARIADB_COLLATION if mariadb else MYSQL_COLLATION)
    return (
        f"CREATE TABLE IF NOT EXISTS {quote_name(lock_table(table))} (\n"
        f"    `name` VARCHAR({MAX_KEY_LENGTH}) CHARACTER SET utf8mb4"
        f" COLLATE {collation} NOT NULL,\n"
        "    `token` BIGINT NOT NULL,\n"
        "    `expires` BIGINT NOT NULL,\n"
        "    `owner` VARBINARY(64) NOT NULL,\n"
        "    PRIMARY KEY (`name`)\n"
        f") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE={collation}"
    )


def drop_lock_table_sql(table: str, quote_name: Callable[[str], str]) -> str:
    return f"DROP TABLE IF EXISTS {quote_name(lock_table(table))}"


#: The server's clock in microseconds since the epoch, in UTC whatever the session's
#: time zone (no daylight-saving step): a lock's expiry is the database's to judge, so
#: that the clocks of the application servers do not matter.
NOW_US = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
#: ``LAST_INSERT_ID`` of a grant that found the lock held: this plus the holder's token
#: (tokens are signed BIGINTs, so never this large; LAST_INSERT_ID is unsigned).
LOCK_BUSY = 2**63


class LockStatements:
    """Statement text for the lock table of one cache table (``%s`` parameters)."""

    def __init__(self, table: str, quote_name: Callable[[str], str]) -> None:
        t = quote_name(lock_table(table)).replace("%", "%%")
        now = NOW_US
        # Free: expired or released (expires 0), or already this owner's (a grant sent
        # again after a lost reply takes it again rather than waiting for itself). Every
        # assignment's condition reads `expires` before it is assigned (it is assigned
        # last) and `owner` as it was or as this very grant set it, so MySQL's
        # left-to-right assignments and MariaDB's SIMULTANEOUS_ASSIGNMENT agree.
        free = f"({t}.`expires` <= {now} OR {t}.`owner` = %s)"
        # The token of a grant is the old one plus 1, or the clock in microseconds if
        # that is larger: it grows with every grant, and still grows after the row was
        # lost (a restored backup, a replica promoted before it caught up, the table
        # dropped) as long as the clock does. LAST_INSERT_ID hands it back in the same
        # statement — a new row's from the VALUES, a taken row's from the update — or,
        # when the lock is held, LOCK_BUSY plus the holder's token.
        head = (
            f"INSERT INTO {t} (`name`, `token`, `expires`, `owner`) "
            f"VALUES (%s, LAST_INSERT_ID({now}), {{expires}}, %s) ON DUPLICATE KEY UPDATE "
            f"`token` = IF({free}, LAST_INSERT_ID(GREATEST({t}.`token` + 1, {now})), "
            f"LAST_INSERT_ID({t}.`token` + {LOCK_BUSY}) - {LOCK_BUSY}), "
            f"`owner` = IF({free}, %s, {t}.`owner`), "
            f"`expires` = IF({free}, {{expires}}, {t}.`expires`)"
        )
        #: Parameters: name, microseconds, owner (5 times), microseconds.
        self.grant_for = head.format(expires=f"{now} + %s")
        #: Parameters: name, owner (5 times): a lock that never expires.
        self.grant_forever = head.format(expires=str(FOREVER))
        # Released: expired at once, the token kept. Only the live grant of this owner.
        mine = f"`name` = %s AND `owner` = %s AND `expires` > {now}"
        self.release = f"UPDATE {t} SET `expires` = 0 WHERE {mine}"
        # Parameters: replace (0/1), microseconds, microseconds, name, owner.
        self.extend = (
            f"UPDATE {t} SET `expires` = IF(%s, {now} + %s, `expires` + %s) "
            f"WHERE {mine} AND `expires` < {FOREVER}"
        )
        self.peek = f"SELECT `owner`, `token` FROM {t} WHERE `name` = %s AND `expires` > {now}"


#: Values up to this size go into statements as hex literals (``X'…'``): building one
#: costs a quarter of escaping the bytes as a string literal (2.4 against 10.8 µs for a
#: 2 KB value here) and the server parses it faster too (a ``set_many`` of 20 such values:
#: 630 against 930 µs). Hex doubles the bytes, so larger values stay escaped parameters,
#: whose size is close to the value's: the largest value a statement can carry stays
#: about ``max_allowed_packet``.
HEX_LIMIT = 512 * 1024


def value_sql(data: bytes) -> tuple[str, tuple[bytes, ...]]:
    """The SQL text of a stored value and the parameters it needs: a hex literal and none,
    or ``%s`` and the bytes. A hex literal has only hex digits, ``X`` and quotes, so the
    driver's %-formatting of the statement leaves it alone."""
    if len(data) <= HEX_LIMIT:
        return f"X'{data.hex()}'", ()
    return "%s", (data,)


@lru_cache(maxsize=32)
def placeholders(count: int, width: int = 1) -> str:
    """``%s, %s`` (width 1) or ``(%s, %s), (%s, %s)`` (width 2) for ``count`` items."""
    item = "%s" if width == 1 else "(" + ", ".join(["%s"] * width) + ")"
    return ", ".join([item] * count)


#: MySQL's row alias of the inserted row in an upsert (``INSERT … AS kvcache_new``).
ROW_ALIAS = "kvcache_new"


def row_alias_name(table: str) -> str:
    """The row alias for ``table``: never the table's own name, which would make every
    column qualified by it ambiguous (a table named ``new`` and the customary ``AS new``)."""
    return ROW_ALIAS if table.lower() != ROW_ALIAS else ROW_ALIAS + "_row"


# --- MAX_SIZE's statements (django_kvcache.mysql.budget builds on them) -------------------

def size_table(table: str) -> str:
    """The old running totals of cache table ``table``: ``<table>_size``."""
    return side_table(table, "_size")


#: What a budgeted table in the current database has: (columns of SAMPLE_COLUMNS, whether
#: SAMPLE_INDEX exists, whether the old size table exists). Parameters: the table (3 times).
LAYOUT_QUERY = (
    "SELECT (SELECT COUNT(*) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
    "AND TABLE_NAME = %s AND COLUMN_NAME IN ('key_hash', 'byte_size')), "
    "(SELECT COUNT(*) FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() "
    f"AND TABLE_NAME = %s AND INDEX_NAME = '{SAMPLE_INDEX}'), "
    "(SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() "
    "AND TABLE_NAME = %s)"
)


class BudgetStatements:
    """The statements a budget check sends (``%s`` parameters, ``%`` doubled); its
    DELETE is the cull's (``Statements.evict_through``)."""

    def __init__(self, table: str, quote_name: Callable[[str], str]) -> None:
        t = quote_name(table).replace("%", "%%")
        old = quote_name(size_table(table)).replace("%", "%%")
        self.table = table
        #: (rows, bytes, largest key_hash) of the ``%s`` entries of lowest key_hash: one
        #: range of the covering SAMPLE_INDEX, whatever the table's size.
        self.sample = (
            "SELECT COUNT(*), COALESCE(SUM(`byte_size`), 0), COALESCE(MAX(`key_hash`), 0) "
            f"FROM (SELECT `key_hash`, `byte_size` FROM {t} FORCE INDEX (`{SAMPLE_INDEX}`) "
            "ORDER BY `key_hash` LIMIT %s) AS `sample`"
        )
        #: A table not upgraded yet: the totals its old triggers keep.
        self.old_totals = (
            f"SELECT COALESCE(SUM(`bytes`), 0), COALESCE(SUM(`entries`), 0) FROM {old}"
        )
        self.layout = LAYOUT_QUERY
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


class Statements:
    """Statement text for one table on one server flavour.

    ``row_alias`` selects MySQL's ``INSERT … AS kvcache_new`` form (8.0.19+); MariaDB only
    knows ``VALUES(col)``, which MySQL 8.0.20+ deprecates.
    """

    def __init__(self, table: str, quote_name: Callable[[str], str], row_alias: bool) -> None:
        # Every statement here runs with parameters, so the driver %-formats it: a % in
        # the table name must be doubled (the DDL, run without parameters, must not be).
        t = quote_name(table).replace("%", "%%")
        self.row_alias = row_alias
        self.alias = row_alias_name(table)
        # "+ 0" hides the expiry index from the optimizer where the primary key already
        # picks the rows: weighing a range over the whole index costs every statement.
        live = "`expires` + 0 > %s"
        insert = f"INSERT INTO {t} (`cache_key`, `value`, `flags`, `expires`) VALUES "
        self.insert = insert
        self.new_row = (f" AS `{self.alias}`" if row_alias else "") + " ON DUPLICATE KEY UPDATE "

        # The primary-key reads select `expires` and leave the expired row out in Python
        # (query.live_row and the like): a condition on it beside the key cost the server
        # 12 us a statement here (MariaDB 10.11), reading the column 2 us.
        self.get = f"SELECT `value`, `flags`, `expires` FROM {t} WHERE `cache_key` = %s"
        self.has_key = f"SELECT `expires` FROM {t} WHERE `cache_key` = %s"
        # set and add put the value's SQL (value_sql) between a head and a tail.
        self.row_head = insert + "(%s, "
        self.set_tail = ", %s, %s)" + self.new_row + self.overwrite_all()
        # The IFs read the old `expires`, so it is assigned last. A live row is left as it
        # is and reports its expiry through LAST_INSERT_ID (never 0), which tells "not
        # added" apart from an insert: CLIENT.FOUND_ROWS makes rowcount 1 for both.
        # The stored row's columns are qualified: next to MySQL's row alias, a bare
        # column name must not be read as ambiguous.
        old_live = f"{t}.`expires` > %s"
        self.add_tail = (
            ", %s, %s)"
            + self.new_row
            + f"`value` = IF({old_live}, {t}.`value`, {self.new('value')}), "
            + f"`flags` = IF({old_live}, {t}.`flags`, {self.new('flags')}), "
            + f"`expires` = IF({old_live}, LAST_INSERT_ID({t}.`expires`), {self.new('expires')})"
        )
        self.touch = f"UPDATE {t} SET `expires` = %s WHERE `cache_key` = %s AND {live}"
        self.delete = f"DELETE FROM {t} WHERE `cache_key` = %s"
        self.delete_live = f"DELETE FROM {t} WHERE `cache_key` = %s AND {live}"
        self.delete_expired_key = f"DELETE FROM {t} WHERE `cache_key` = %s AND `expires` + 0 <= %s"
        # LAST_INSERT_ID hands the new value back without a second statement (as unsigned:
        # the caller wraps it back). Signed BIGINT arithmetic fails with error 1690 on
        # overflow, which aborts the statement and leaves the value unchanged.
        # The key alone picks the row, so matching no row means "missing" without a
        # second query; whether the entry is live and an integer is decided in IF(), and
        # the server's info line ("Changed: 1") tells whether the increment applied.
        self.incr = (
            f"UPDATE {t} SET `value` = IF({live} AND `flags` IN ({INTEGER_FLAGS}), "
            "CAST(LAST_INSERT_ID(CAST(`value` AS SIGNED) + %s) AS SIGNED), `value`) "
            "WHERE `cache_key` = %s"
        )
        # A delta outside BIGINT (up to 2**64 - 1 either way) can still give a BIGINT
        # result; DECIMAL arithmetic cannot overflow, and the range test makes an
        # out-of-range result match no row.
        as_decimal = "CAST(`value` AS DECIMAL(65, 0))"
        self.incr_wide = (
            f"UPDATE {t} SET `value` = "
            f"CAST(LAST_INSERT_ID(CAST({as_decimal} + %s AS SIGNED)) AS SIGNED) "
            f"WHERE `cache_key` = %s AND {live} "
            f"AND IF(`flags` IN ({INTEGER_FLAGS}), {as_decimal} + %s, NULL) "
            f"BETWEEN {INT64_RANGE}"
        )
        self.incr_failure = f"SELECT `flags`, `value` FROM {t} WHERE `cache_key` = %s AND {live}"
        # Every DELETE of a clear, a prefix delete or an owed flush is a batch in key order
        # (``LIMIT``): none holds locks on a large part of the table, none outlasts a
        # read_timeout, and statement-based replication deletes the same rows.
        self.clear_batch = f"DELETE FROM {t} ORDER BY `cache_key` LIMIT %s"
        self.clear_prefix_batch = (
            f"DELETE FROM {t} WHERE `cache_key` LIKE %s ESCAPE '{LIKE_ESCAPE}' "
            "ORDER BY `cache_key` LIMIT %s"
        )
        self.select_many = f"SELECT `cache_key`, `value`, `flags`, `expires` FROM {t} WHERE `cache_key` IN "
        self.delete_many = f"DELETE FROM {t} WHERE `cache_key` IN "

        like = f"`cache_key` LIKE %s ESCAPE '{LIKE_ESCAPE}' AND {live}"
        self.keys_with_prefix = f"SELECT `cache_key` FROM {t} WHERE {like} ORDER BY `cache_key`"
        self.get_with_prefix = (
            f"SELECT `cache_key`, `value`, `flags` FROM {t} WHERE {like} ORDER BY `cache_key`"
        )
        self.delete_with_prefix = f"DELETE FROM {t} WHERE {like} ORDER BY `cache_key` LIMIT %s"
        # With STALE_TIMEOUT, what expired under the prefix goes too (never served stale).
        self.delete_expired_with_prefix = (
            f"DELETE FROM {t} WHERE `cache_key` LIKE %s ESCAPE '{LIKE_ESCAPE}' "
            "AND `expires` + 0 <= %s ORDER BY `cache_key` LIMIT %s"
        )
        # For training a compression dictionary: a scan, kept out of the request path.
        self.sample = (
            f"SELECT `cache_key`, `value`, `flags` FROM {t} WHERE {live} ORDER BY RAND() LIMIT %s"
        )
        # Re-encryption with the newest key (``kvcache_rotate_key``): a batch of rows in
        # key order, each with its value only where it is encrypted with another key id
        # and still readable (live, or kept for STALE_TIMEOUT); the rest costs a key and
        # flags. The batch examines LIMIT rows however few need work.
        older_key = (
            f"`flags` & {FLAG_ENCRYPTED} AND `flags` >> {KEY_ID_SHIFT} <> %s AND `expires` > %s"
        )
        scan = f"SELECT `cache_key`, `flags`, IF({older_key}, `value`, NULL) FROM {t} WHERE "
        self.rotation_scan = scan + "`cache_key` > %s ORDER BY `cache_key` LIMIT %s"
        self.rotation_scan_prefix = (
            scan + f"`cache_key` > %s AND `cache_key` LIKE %s ESCAPE '{LIKE_ESCAPE}' "
            "ORDER BY `cache_key` LIMIT %s"
        )
        # Only the row as it was read (its flags and random nonce): a value written since
        # is already encrypted with the newest key, and stays.
        self.reseal_head = f"UPDATE {t} SET `value` = "
        self.reseal_tail = (
            f", `flags` = %s WHERE `cache_key` = %s AND `flags` = %s "
            f"AND LEFT(`value`, {NONCE_BYTES}) = "
        )

        # Culling walks the expiry index (whose entries end with the primary key).
        self.delete_expired = f"DELETE FROM {t} WHERE `expires` <= %s ORDER BY `expires` LIMIT %s"
        self.row_at = f"SELECT 1 FROM {t} LIMIT 1 OFFSET %s"
        self.nth_latest = (
            f"SELECT `expires`, `cache_key` FROM {t} "
            "ORDER BY `expires` DESC, `cache_key` DESC LIMIT 1 OFFSET %s"
        )
        self.evict_through = (
            f"DELETE FROM {t} WHERE `expires` < %s OR (`expires` = %s AND `cache_key` <= %s) "
            "ORDER BY `expires`, `cache_key` LIMIT %s"
        )
        self.evict_all = f"DELETE FROM {t} ORDER BY `expires`, `cache_key` LIMIT %s"

        self.ttl = self.has_key
        # Herd protection (``django_kvcache.mysql.lease``): an entry and its lease row in
        # one primary-key read, live or not (the caller tells fresh, stale and missing).
        self.lease_read = (
            f"SELECT `cache_key`, `value`, `flags`, `expires` FROM {t} "
            "WHERE `cache_key` IN (%s, %s)"
        )
        # Take the lease row if it is gone, expired, or still exactly as the caller read
        # it: a compare-and-set on `value`, which holds the holder's token, or once
        # released a released marker with that token, so no two states are alike. The
        # second IF reads the `value` the first assigned: our own (unique) token there
        # means we took it; it repeats the take's condition for MariaDB's
        # SIMULTANEOUS_ASSIGNMENT mode, where it reads the row as it was (the token is
        # compared as a parameter: on MariaDB 10.11, with
        # VALUES(`value`) in that condition, LAST_INSERT_ID(expr) is not reported to the
        # client). A row left alone reports its (positive) expiry through
        # LAST_INSERT_ID, so the caller won if and only if LAST_INSERT_ID is 0 — the row
        # count cannot say, since CLIENT.FOUND_ROWS counts an untouched row as 1, like an
        # insert.
        self.lease_take = (
            insert
            + "(%s, %s, %s, %s)"
            + self.new_row
            + f"`value` = IF({t}.`expires` <= %s OR {t}.`value` = %s, "
            + f"{self.new('value')}, {t}.`value`), "
            + f"`expires` = IF({t}.`value` = %s OR {t}.`expires` <= %s OR {t}.`value` = %s, "
            + f"{self.new('expires')}, LAST_INSERT_ID({t}.`expires`))"
        )
        # Only the holder's own lease (its token): after LEASE_TIMEOUT it may be another's.
        self.lease_release = (
            f"UPDATE {t} SET `value` = %s, `expires` = %s WHERE `cache_key` = %s AND `value` = %s"
        )
        self.lease_drop = f"DELETE FROM {t} WHERE `cache_key` = %s AND `value` = %s"

        self.locks = LockStatements(table, quote_name)
        self.budget = BudgetStatements(table, quote_name)

    def new(self, column: str) -> str:
        """The inserted row's ``column`` inside ``ON DUPLICATE KEY UPDATE``."""
        return f"`{self.alias}`.`{column}`" if self.row_alias else f"VALUES(`{column}`)"

    def overwrite_all(self) -> str:
        return ", ".join(f"`{c}` = {self.new(c)}" for c in ("value", "flags", "expires"))

    def set_row(self, value: str) -> str:
        """Upsert one row; ``value`` is its value's SQL (:func:`value_sql`)."""
        return self.row_head + value + self.set_tail

    def add_row(self, value: str) -> str:
        """Insert one row unless a live one is there (LAST_INSERT_ID 0 when added)."""
        return self.row_head + value + self.add_tail

    def set_many(self, values: list[str]) -> str:
        """Upsert one row per value's SQL (:func:`value_sql`)."""
        rows = ", ".join(["(%s, " + value + ", %s, %s)" for value in values])
        return self.insert + rows + self.new_row + self.overwrite_all()

    def reseal(self, value: str, nonce: bytes) -> str:
        """Replace a row's value and flags if it still holds the ciphertext of ``nonce``;
        ``value`` is the new value's SQL (:func:`value_sql`)."""
        return f"{self.reseal_head}{value}{self.reseal_tail}X'{nonce.hex()}'"

    def get_many(self, keys: int) -> str:
        return f"{self.select_many}({placeholders(keys)})"

    def delete_keys(self, keys: int) -> str:
        return f"{self.delete_many}({placeholders(keys)})"
