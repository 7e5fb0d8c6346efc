"""A MySQL/MariaDB cache backend: one indexed table, one statement per operation.

    CACHES = {
        "default": {
            "BACKEND": "django_kvcache.backends.mysql.MySQLCache",
            "LOCATION": "kvcache",  # the table; create it with `manage.py kvcache_createtable`
            "OPTIONS": {"DATABASE": "cache"},
        }
    }

``OPTIONS["DATABASES"]`` spreads the keys over several aliases (shards) instead, with
optional read replicas and ``IGNORE_EXCEPTIONS`` (see ``docs/scale-out.rst``).

See ``docs/mysql.rst`` for the schema, every option and the SQL of each operation.
"""
from __future__ import annotations

import logging
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from functools import partial
from operator import attrgetter, itemgetter, methodcaller
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

from django.apps import apps as django_apps
from django.conf import settings
from django.core.cache.backends.base import (
    DEFAULT_TIMEOUT,
    MEMCACHE_MAX_KEY_LENGTH,
    default_key_func,
)
from django.db import DatabaseError, OperationalError, ProgrammingError, connections, router
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.module_loading import import_string

from django_kvcache.base import MISSING, KVCache, check_delta, delegate_to_sync
from django_kvcache.codec import INT64_MAX, INT64_MIN
from django_kvcache.failure_log import FailureLog
from django_kvcache.health import NodeHealth, health_for
from django_kvcache.mysql import culling, dictionaries
from django_kvcache.mysql.config import DEFAULT_CULL_PROBABILITY, check_table, router_model
from django_kvcache.mysql.lease import MySQLLeaseStore, Work
from django_kvcache.mysql.shards import (
    SHARD_KIND,
    MissedWrites,
    Shard,
    ShardDown,
    ShardStats,
    is_unreachable,
    make_shards,
    missed_writes,
    read_your_writes,
    shard_stats,
)
from django_kvcache.mysql.keys import DIGEST_HEAD_LENGTH, MAX_KEY_LENGTH, like_prefix, stored_key
from django_kvcache.mysql.server import (
    PACKET_HEADROOM,
    Pending,
    autocommits,
    error_code,
    in_transaction,
    is_lock_conflict,
    may_bypass_cursor,
    run,
    run_each,
    server_info,
    statement_budget,
)
from django_kvcache.mysql.sql import (
    FOREVER,
    HEX_LIMIT,
    Statements,
    check_engine,
    create_table_sql,
    drop_table_sql,
    now_ms,
    value_sql,
)
from django_kvcache.options import flag, fraction, integer, seconds
from django_kvcache.signals import node_up
from django_kvcache.stampede import LeaseStore

logger = logging.getLogger(__name__)
#: Shard failures ignored under IGNORE_EXCEPTIONS: logged once per episode, then summarized.
ignored_failures = FailureLog(logger, "MySQL")


def _shard_answers_again(sender: Any, node: str, kind: str = "", **kwargs: Any) -> None:
    if kind == SHARD_KIND:
        ignored_failures.recovered(f"shard {node}")


node_up.connect(_shard_answers_again, dispatch_uid="django_kvcache.mysql.ignored_failures")

#: Escaped size of the largest stored key (250 four-byte characters, every byte escaped).
KEY_BYTES = MAX_KEY_LENGTH * 4 * 2 + 8
#: Statements up to this size are sent without looking at the connection's
#: ``max_allowed_packet`` (MariaDB's default is 16 MiB, MySQL's 64 MiB); larger ones
#: are checked against it (read once per connection).
ALWAYS_FITS = 512 * 1024
#: The bytes the client library escapes with a backslash inside a string literal.
ESCAPED_BYTES = tuple(bytes([byte]) for byte in b"\0\n\r\\'\"\x1a")
#: The characters Django warns about in keys (``memcache_key_warnings``).
KEY_WARNING_CHARACTERS = re.compile(r"[\x00-\x20\x7f]")
#: MySQL error codes for a value that is not decimal text in an integer-flagged row.
BAD_NUMBER = frozenset({1292, 1366})
#: "BIGINT value is out of range": an increment past the signed 64-bit range.
OUT_OF_RANGE = 1690
#: "Table ... doesn't exist".
NO_SUCH_TABLE = 1146
FOREVER_SECONDS = FOREVER // 1000

fetchone = methodcaller("fetchone")
fetchall = methodcaller("fetchall")
rowcount = attrgetter("rowcount")
lastrowid = attrgetter("lastrowid")
T = TypeVar("T")
#: ``_call``'s fallback meaning "raise even under IGNORE_EXCEPTIONS" (incr, maintenance).
RAISE: Any = object()
#: ``_call``'s ``stale`` for a write that reaches every key (clear, delete_with_prefix).
EVERYTHING: Any = object()
#: A *_many's one statement for a shard's keys: ``(statements, keys, connection) -> (sql,
#: params)``.
Builder = Callable[[Statements, list[str], BaseDatabaseWrapper], tuple[str, list[Any]]]


def update_outcome(cursor: Any) -> tuple[int, int, int]:
    """Rows matched, rows changed and LAST_INSERT_ID of the UPDATE just run.

    Django connects with CLIENT.FOUND_ROWS, so ``rowcount`` counts matched rows; the
    changed count is only in the server's info line ("Rows matched: 1  Changed: 1 ...").
    """
    # No info line at all only when no row matched (seen on an empty MyISAM table).
    # The DB-API connection, under Django's cursor wrapper or not.
    counts = (cursor.connection.info() or "").partition("Changed: ")[2].split()
    changed = int(counts[0]) if counts else 0
    return cursor.rowcount, changed, cursor.lastrowid


def row_size(data: bytes) -> int:
    """Statement bytes one row takes: a hex literal's for values up to HEX_LIMIT, exact
    escaping for larger ones (``value_sql``)."""
    if len(data) <= HEX_LIMIT:
        return KEY_BYTES + 2 * len(data) + 3
    return KEY_BYTES + len(data) + sum(data.count(byte) for byte in ESCAPED_BYTES)


def needs_budget(rows: list[tuple[Any, str, bytes, int]]) -> bool:
    """Whether rows of ``(caller key, stored key, bytes, flags)`` may exceed ALWAYS_FITS."""
    return sum(row_size(row[2]) for row in rows) > ALWAYS_FITS


class CacheTableMissing(ProgrammingError):
    """A MySQLCache's table does not exist; the message names the command that creates it.

    The server's error (1146) is chained as ``__cause__``.
    """


@dataclass
class TableStats:
    """Process-wide counters of one table, shared by every instance (plain ints: cheap,
    and exact enough under the GIL for monitoring)."""

    values_encoded: int = 0  # values written (or refused as too large) since start
    bytes_encoded: int = 0  # their size as stored
    bytes_saved: int = 0  # what compression took off that


_stats: dict[str, TableStats] = {}


class MySQLCache(KVCache):
    """Django cache backend storing entries in a MySQL/MariaDB table (LOCATION)."""

    backend_options = frozenset(
        {
            "DATABASE",
            "DATABASES",
            "WEIGHTS",
            "REPLICAS",
            "READ_YOUR_WRITES",
            "IGNORE_EXCEPTIONS",
            "FAILURE_THRESHOLD",
            "RETRY_TIMEOUT",
            "ENGINE",
            "CULL_PROBABILITY",
        }
    )
    #: Compress from 1000 bytes: with zstandard's reused decompressors, reading the
    #: realistic mix costs about what django-mysql's policy (zlib level 6 from 5000 bytes)
    #: costs, and it stores 0.64x its bytes; from 2000, 0.71x (docs/codec.rst, "Choosing
    #: compression": the curve it was chosen from).
    default_compress_min_length = 1000

    def __init__(self, location: str, params: Mapping[str, Any]) -> None:
        # COMPRESS_DICTIONARY "auto": zstd dictionaries in a table beside the cache's.
        super().__init__(params, partial(dictionaries.table_dictionaries, location))
        self.table = check_table(location)
        self.engine = check_engine(self.options.get("ENGINE", "InnoDB"))
        self.cull_probability = fraction(
            self.options, "CULL_PROBABILITY", DEFAULT_CULL_PROBABILITY
        )
        self.cache_model_class = router_model(self.table)
        self.shards, self.router = make_shards(self.options, self.cache_model_class)
        #: The one alias of OPTIONS['DATABASE']; None for shards or the routers' choice.
        self.database: str | None = self.shards[0].alias if self.router is None else None
        self.ignore_exceptions = flag(self.options, "IGNORE_EXCEPTIONS")
        self.failure_threshold = integer(self.options, "FAILURE_THRESHOLD", 2)
        self.retry_timeout = seconds(self.options, "RETRY_TIMEOUT", 10.0)
        self.read_your_writes = read_your_writes(self.options)
        # Reads may leave the primary only with a replica or routers that pick readers.
        self._tracks_writes = any(s.replica or s.alias is None for s in self.shards)
        self._written_at: dict[int, float] = {}  # shard index -> monotonic time of last write
        self._health: dict[str, NodeHealth] = {}
        self._missed: dict[str, MissedWrites] = {}  # primary alias -> its record
        self._statements: dict[str, Statements] = {}
        self.stats = _stats.setdefault(self.table, TableStats())

    # --- shards and connections ------------------------------------------------------

    def db_alias(self, write: bool) -> str:
        """The alias of a single-shard cache: OPTIONS['DATABASE'], else what the routers
        say (as for DatabaseCache). With OPTIONS['DATABASES'], the first shard's."""
        shard = self.shards[0]
        return shard.primary() if write else self._read_alias(shard)

    def database_aliases(self) -> list[str]:
        """Every shard's primary alias, in OPTIONS order (one alias without shards)."""
        return [shard.primary() for shard in self.shards]

    def _shard_for(self, key: str) -> Shard:
        if self.router is None:
            return self.shards[0]
        return self.shards[self.router.node_for(key)]

    def _by_shard(self, keys: list[str]) -> list[tuple[Shard, list[str]]]:
        """``keys`` grouped by shard: one statement per shard."""
        if self.router is None:
            return [(self.shards[0], keys)]
        shards = self.shards
        return [(shards[index], group) for index, group in self.router.group(keys).items()]

    def _read_alias(self, shard: Shard) -> str:
        """The shard's reader, unless this thread wrote to it within READ_YOUR_WRITES."""
        reader = shard.reader()
        if not self._tracks_writes:
            return reader
        written = self._written_at.get(shard.index)
        if written is not None and time.monotonic() - written < self.read_your_writes:
            return shard.primary()
        return reader

    def _db(self, alias: str) -> tuple[BaseDatabaseWrapper, Statements]:
        connection = connections[alias]
        sql = self._statements.get(alias)
        if sql is None:
            row_alias = server_info(connection).row_alias
            sql = self._statements[alias] = Statements(
                self.table, connection.ops.quote_name, row_alias
            )
        return connection, sql

    def _reader(self) -> tuple[BaseDatabaseWrapper, Statements]:
        return self._db(self.db_alias(write=False))

    def _writer(self) -> tuple[BaseDatabaseWrapper, Statements]:
        return self._db(self.db_alias(write=True))

    def _call(
        self,
        shard: Shard,
        write: bool,
        work: Callable[[BaseDatabaseWrapper, Statements], T],
        fallback: Any = RAISE,
        stale: Any = None,
        primary: bool = False,
    ) -> T:
        """``work(connection, statements)`` on the shard's primary (``write``, or a read
        with ``primary``) or reader.

        An unreachable server raises, unless IGNORE_EXCEPTIONS turns it into ``fallback``
        (a miss, a no-op); with RAISE it raises either way but still counts. A write
        that fails so leaves the shard's older copies of ``stale`` (keys, or EVERYTHING)
        in place: they are deleted there before the shard serves again (``_attempt``).
        """
        return self._call_on(shard, self._route(shard, write, primary), work, fallback, stale)

    def _route(self, shard: Shard, write: bool, primary: bool = False) -> str:
        """The alias a call goes to (a read with ``primary`` goes to the primary too); a
        write starts this thread's read-your-writes window."""
        if not write:
            return shard.primary() if primary else self._read_alias(shard)
        if self._tracks_writes:  # before the write: a lost reply may still have applied
            self._written_at[shard.index] = time.monotonic()
        return shard.primary()

    def _call_on(
        self,
        shard: Shard,
        alias: str,
        work: Callable[[BaseDatabaseWrapper, Statements], T],
        fallback: Any,
        stale: Any,
    ) -> T:
        if self.ignore_exceptions:
            skipped = self._skip(shard, alias, fallback, stale)
            if skipped is not None:
                return skipped[0]  # type: ignore[no-any-return]
        try:
            result = self._attempt(shard, alias, work)
        except OperationalError as exc:
            return self._failure(shard, alias, exc, fallback, stale)  # type: ignore[no-any-return]
        if self.ignore_exceptions:
            self._health_of(alias).succeeded()
        return result

    def _skip(self, shard: Shard, alias: str, fallback: Any, stale: Any) -> tuple[Any] | None:
        """Under IGNORE_EXCEPTIONS: ``(fallback,)`` when the alias is marked down and not
        due for a probe (nothing is tried), else ``None``."""
        health = self._health_of(alias)
        if not health.down_until or health.may_try():
            return None
        stats = shard_stats(self.table, alias)
        stats.skipped += 1
        self._missed_write(shard, stale)
        return (self._ignored(alias, stats, self._skipped(alias, health), fallback),)

    def _failure(
        self, shard: Shard, alias: str, exc: Exception, fallback: Any, stale: Any
    ) -> Any:
        """After ``exc`` on ``alias``: ``fallback`` when IGNORE_EXCEPTIONS ignores it, else
        raise it. Only an unreachable server counts, marks health and records ``stale``."""
        if not (isinstance(exc, OperationalError) and is_unreachable(exc)):
            raise exc
        stats = shard_stats(self.table, alias)
        stats.errors += 1
        self._missed_write(shard, stale)
        if not self.ignore_exceptions:
            raise exc
        self._health_of(alias).failed(f"{type(exc).__name__}: {exc}")
        return self._ignored(alias, stats, exc, fallback)

    def _attempt(
        self, shard: Shard, alias: str, work: Callable[[BaseDatabaseWrapper, Statements], T]
    ) -> T:
        """``work`` on ``alias``, once the shard's copies outdated by missed writes are gone."""
        if self._missed_writes(shard).pending:  # one bool read while nothing was missed
            self._clean_up(shard)
        return work(*self._db(alias))

    # --- writes a shard missed ---------------------------------------------------------

    def _missed_writes(self, shard: Shard) -> MissedWrites:
        alias = shard.primary()
        record = self._missed.get(alias)
        if record is None:
            record = missed_writes(self.table, alias, self._own_keys_pattern())
            self._missed[alias] = record
        return record

    def _missed_write(self, shard: Shard, stale: Any) -> None:
        if stale is EVERYTHING:
            self._missed_writes(shard).add_everything()
        elif stale:
            self._missed_writes(shard).add(stale)

    def _clean_up(self, shard: Shard) -> None:
        """Delete on the shard's primary the keys it missed writes of (or this cache's
        whole content after a missed clear, or past the record's key limit). One thread
        at a time; the others wait, then find nothing left to do."""
        record = self._missed_writes(shard)
        with record.cleaning:
            if not record.pending:
                return
            keys, flush = record.take()
            try:
                connection, sql = self._db(shard.primary())
                if flush:
                    self._clear(connection, sql)
                elif keys:
                    self._delete_keys(sorted(keys), connection, sql)
            except BaseException:
                record.put_back(keys, flush)
                raise
            record.done()
        if self._tracks_writes:  # a write: read it back from the primary, not a replica
            self._written_at[shard.index] = time.monotonic()
        logger.warning(
            "%s %s answers again: deleted %s written while it could not be reached",
            SHARD_KIND, shard.primary(),
            f"the {len(keys)} key(s)" if not flush else "every entry of this cache",
        )

    # --- one statement per shard, all shards in one round trip ------------------------

    def _on_shards(
        self,
        write: bool,
        groups: list[tuple[Shard, list[str]]],
        work: Callable[[list[str], BaseDatabaseWrapper, Statements], T],
        fallback: Any,
        builder: Builder | None = None,
        read: Callable[[Any], T] | None = None,
    ) -> list[Any]:
        """``work(keys, connection, statements)`` for each group of keys on its shard,
        with ``_call``'s policies; the answers (or ``fallback``) in group order.

        With a ``builder`` (each group needs exactly one statement) over two shards or
        more, every shard's statement is sent before any reply is read (``run_each``):
        one round trip instead of one per shard. ``read`` turns a reply (rows, or the
        affected row count) into ``work``'s answer. Where statements must be seen by
        Django (DEBUG, ``execute_wrapper``) or a transaction is open, shards are asked
        one after another through the cursor instead.
        """
        aliases = [self._route(shard, write) for shard, _ in groups]
        if builder is None or len(groups) < 2 or not all(
            may_bypass_cursor(connections[alias]) for alias in aliases
        ):
            return [
                self._call_on(shard, alias, partial(work, keys), fallback, keys if write else None)
                for (shard, keys), alias in zip(groups, aliases)
            ]
        assert read is not None
        answers: list[Any] = [fallback] * len(groups)
        sending: dict[int, Pending] = {}
        error: Exception | None = None  # the first, raised once every shard had its turn
        for index, ((shard, keys), alias) in enumerate(zip(groups, aliases)):
            stale = keys if write else None
            if self.ignore_exceptions:
                skipped = self._skip(shard, alias, fallback, stale)
                if skipped is not None:
                    continue
            try:
                pending = self._attempt(shard, alias, partial(self._pending, builder, keys))
            except OperationalError as exc:
                try:
                    self._failure(shard, alias, exc, fallback, stale)
                except OperationalError as raised:  # the other shards still get theirs
                    error = error or raised
                continue
            sending[index] = pending
        run_each(list(sending.values()))  # every reply is read before anything raises
        for index, pending in sending.items():
            shard, keys = groups[index]
            if pending.error is None:
                answers[index] = read(pending.outcome)
                if self.ignore_exceptions:
                    self._health_of(aliases[index]).succeeded()
                continue
            alias = aliases[index]
            try:
                self._failure(
                    shard, alias, self._table_error(pending.error, alias), fallback,
                    keys if write else None,
                )
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return answers

    @staticmethod
    def _pending(
        builder: Builder, keys: list[str], connection: BaseDatabaseWrapper, sql: Statements
    ) -> Pending:
        statement, params = builder(sql, keys, connection)
        return Pending(connection, statement, params)

    def _table_error(self, exc: Exception, alias: str) -> Exception:
        """``exc``; for a missing table, an error caused by it that says how to create the
        table."""
        if isinstance(exc, ProgrammingError) and error_code(exc) == NO_SUCH_TABLE:
            missing = CacheTableMissing(self._missing_table_message(alias))
            missing.__cause__ = exc
            return missing
        return exc

    def _health_of(self, alias: str) -> NodeHealth:
        health = self._health.get(alias)
        if health is None:
            health = self._health[alias] = health_for(
                alias, self.failure_threshold, self.retry_timeout, kind=SHARD_KIND
            )
        return health

    @staticmethod
    def _skipped(alias: str, health: NodeHealth) -> ShardDown:
        retry_in = max(0.0, health.down_until - time.monotonic())
        return ShardDown(
            f"{SHARD_KIND} {alias} is marked down after {health.failures} consecutive "
            f"failures; next try in {retry_in:.1f} s (RETRY_TIMEOUT)"
        )

    def _ignored(self, alias: str, stats: ShardStats, error: Exception, fallback: Any) -> Any:
        if fallback is RAISE:
            raise error
        stats.ignored += 1
        # Logged once per episode and then summarized: a down shard fails every call.
        ignored_failures.failed(f"shard {alias}", f"{type(error).__name__}: {error}")
        return fallback

    def _run(
        self,
        connection: BaseDatabaseWrapper,
        statement: str,
        params: Any,
        read: Callable[[Any], T],
        idempotent: bool = True,
    ) -> T:
        """``run()``; a missing table becomes an error that says how to create it."""
        try:
            return run(connection, statement, params, read, idempotent)
        except ProgrammingError as exc:
            raise self._table_error(exc, connection.alias)

    def _missing_table_message(self, database: str) -> str:
        aliases = self.configured_aliases()
        if not aliases:  # built outside CACHES
            owner, fix = f"a {self.backend_name}", "Create it with cache.create_table()."
        elif not django_apps.is_installed("django_kvcache"):  # no commands, no pre_migrate
            owner = "cache " + ", ".join(repr(alias) for alias in aliases)
            fix = (
                "Add 'django_kvcache' to INSTALLED_APPS: then 'manage.py migrate' creates "
                "it, and so does the test runner in test databases."
            )
        else:
            owner = "cache " + ", ".join(repr(alias) for alias in aliases)
            fix = (
                f"Create it with 'manage.py kvcache_createtable {' '.join(aliases)}' (or "
                "'manage.py migrate', which creates it first)."
            )
        return (
            f"The table {self.table!r} of {owner} does not exist in database {database!r}. "
            f"{fix}"
        )

    def configured_aliases(self) -> list[str]:
        """The CACHES aliases configured with this cache's table and databases."""
        return [
            alias
            for alias in mysql_cache_aliases()
            if settings.CACHES[alias].get("LOCATION") == self.table
            and shard_options(settings.CACHES[alias]) == shard_options({"OPTIONS": self.options})
        ]

    # --- keys and timeouts -----------------------------------------------------------

    def validate_key(self, key: str) -> None:
        """Django's key warnings, with a fast path for the keys that need none."""
        if len(key) > MEMCACHE_MAX_KEY_LENGTH or KEY_WARNING_CHARACTERS.search(key):
            super().validate_key(key)

    def make_and_validate_key(self, key: Any, version: int | None = None) -> str:
        """The key as stored: Django's key, or its digest form when it overflows the column.

        Every key goes through here, so ``make_keys`` maps stored keys to callers' keys too.
        """
        key = super().make_and_validate_key(key, version=version)
        return key if len(key) < MAX_KEY_LENGTH else stored_key(key)

    def _expires(self, timeout: Any) -> int | None:
        """Expiry in epoch ms; ``None`` when the entry is expired at once (timeout <= 0)."""
        seconds = self.timeout_seconds(timeout)
        if seconds is None:
            return FOREVER
        if seconds <= 0:
            return None
        if seconds >= FOREVER_SECONDS:  # also keeps float("inf") out of int()
            return FOREVER
        return min(now_ms() + int(seconds * 1000), FOREVER)

    # --- reading ---------------------------------------------------------------------

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        key = self.make_and_validate_key(key, version)
        row = self._call(self._shard_for(key), False, partial(self._get_row, key), None)
        if row is None:
            return default
        value = self.decode(row[0], row[1], key)
        return default if value is MISSING else value

    def _get_row(self, key: str, connection: BaseDatabaseWrapper, sql: Statements) -> Any:
        return self._run(connection, sql.get, (key, now_ms()), fetchone)

    def has_key(self, key: Any, version: int | None = None) -> bool:
        key = self.make_and_validate_key(key, version)
        return self._call(self._shard_for(key), False, partial(self._has_key, key), False)

    def _has_key(self, key: str, connection: BaseDatabaseWrapper, sql: Statements) -> bool:
        return self._run(connection, sql.has_key, (key, now_ms()), fetchone) is not None

    def get_many(self, keys: Iterable[Any], version: int | None = None) -> dict[Any, Any]:
        key_map = self.make_keys(keys, version)
        if not key_map:
            return {}
        now = now_ms()
        groups = self._by_shard(list(key_map))

        def select(sql: Statements, keys: list[str], _: Any) -> tuple[str, list[Any]]:
            return sql.get_many(len(keys)), [now, *keys]

        answers = self._on_shards(
            False, groups, partial(self._select_many, now), (),
            select if self._one_statement(groups) else None, list,
        )
        found = {}
        for rows in answers:
            for key, data, flags in rows:
                value = self.decode(data, flags, key)
                if value is not MISSING:
                    found[key_map[key]] = value
        return found

    @staticmethod
    def _one_statement(groups: list[tuple[Shard, list[str]]]) -> bool:
        """Whether each group's keys fit one statement without asking the server."""
        return all(len(keys) * KEY_BYTES <= ALWAYS_FITS for _, keys in groups)

    def _select_many(
        self, now: int, keys: list[str], connection: BaseDatabaseWrapper, sql: Statements
    ) -> list[tuple[str, bytes, int]]:
        rows: list[tuple[str, bytes, int]] = []
        for chunk in self._key_chunks(connection, keys):
            rows += self._run(connection, sql.get_many(len(chunk)), [now, *chunk], fetchall)
        return rows

    # --- writing ---------------------------------------------------------------------

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        key = self.make_and_validate_key(key, version)
        expires = self._expires(timeout)
        shard = self._shard_for(key)
        if expires is None:
            self._call(shard, True, partial(self._delete_row, key), None, (key,))
            return
        data, flags = self._encode(value)
        self._call(shard, True, partial(self._set_row, key, data, flags, expires), None, (key,))

    def _delete_row(self, key: str, connection: BaseDatabaseWrapper, sql: Statements) -> int:
        return self._run(connection, sql.delete, (key,), rowcount)

    def _set_row(
        self,
        key: str,
        data: bytes,
        flags: int,
        expires: int,
        connection: BaseDatabaseWrapper,
        sql: Statements,
    ) -> None:
        if row_size(data) > ALWAYS_FITS and not self._fits(connection, data, key):
            self._delete_row(key, connection, sql)  # never leave an older value
            return
        self._maybe_cull(connection, sql)
        value, blob = value_sql(data)
        self._run(connection, sql.set_row(value), (key, *blob, flags, expires), rowcount)

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        key = self.make_and_validate_key(key, version)
        expires = self._expires(timeout)
        shard = self._shard_for(key)
        if expires is None:  # nothing is stored; "added" when no live entry was there
            return not self._call(shard, True, partial(self._has_key, key), True)
        data, flags = self._encode(value)
        return self._call(shard, True, partial(self._add_row, key, data, flags, expires), False)

    def _add_row(
        self,
        key: str,
        data: bytes,
        flags: int,
        expires: int,
        connection: BaseDatabaseWrapper,
        sql: Statements,
    ) -> bool:
        if row_size(data) > ALWAYS_FITS and not self._fits(connection, data, key):
            return False
        self._maybe_cull(connection, sql)
        now = now_ms()
        value, blob = value_sql(data)
        params = (key, *blob, flags, expires, now, now, now)
        return self._run(connection, sql.add_row(value), params, lastrowid, idempotent=False) == 0

    def _encode(self, value: Any) -> tuple[bytes, int]:
        data, flags, saved = self.codec.encode_measured(value)
        stats = self.stats
        stats.values_encoded += 1
        stats.bytes_encoded += len(data)
        stats.bytes_saved += saved
        return data, flags

    def set_many(
        self, data: Mapping[Any, Any], timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> list[Any]:
        """Returns the caller's keys not stored: too large for a statement, or (with
        IGNORE_EXCEPTIONS) on a shard that could not be reached."""
        if not data:
            return []
        expires = self._expires(timeout)
        if expires is None:
            self.delete_many(data, version=version)
            return []
        # Every key and value is checked and encoded before anything is written, so a bad
        # key or an unpicklable value leaves the whole batch unwritten.
        rows = {
            self.make_and_validate_key(key, version): (key, *self._encode(value))
            for key, value in data.items()
        }
        groups = self._by_shard(list(rows))

        def rows_of(keys: list[str]) -> list[tuple[Any, str, bytes, int]]:
            return [(rows[key][0], key, rows[key][1], rows[key][2]) for key in keys]

        def write(keys: list[str], connection: BaseDatabaseWrapper, sql: Statements) -> list[Any]:
            return self._write_rows(rows_of(keys), expires, connection, sql)

        def upsert(
            sql: Statements, keys: list[str], connection: BaseDatabaseWrapper
        ) -> tuple[str, list[Any]]:
            self._maybe_cull(connection, sql)
            values: list[str] = []
            params: list[Any] = []
            for key in keys:
                value, blob = value_sql(rows[key][1])
                values.append(value)
                params += (key, *blob, rows[key][2], expires)
            return sql.set_many(values), params

        # One statement per shard when no shard's rows come near ALWAYS_FITS (the usual
        # batch): then none is too large either, and every answer is "nothing failed".
        single = not any(needs_budget(rows_of(keys)) for _, keys in groups)
        answers = self._on_shards(
            True, groups, write, None, upsert if single else None, lambda _: []
        )
        failed: list[Any] = []
        for (shard, keys), too_large in zip(groups, answers):
            if too_large is None:  # ignored: the shard was not reached
                failed += [rows[key][0] for key in keys]
                continue
            if too_large:  # an older value must not outlive a failed write
                stored = [self.make_and_validate_key(key, version) for key in too_large]
                self._call(shard, True, partial(self._delete_keys, stored), None, stored)
                failed += too_large
        return failed

    def _write_rows(
        self,
        rows: list[tuple[Any, str, bytes, int]],
        expires: int,
        connection: BaseDatabaseWrapper,
        sql: Statements,
    ) -> list[Any]:
        self._maybe_cull(connection, sql)
        return self._upsert_rows(connection, sql, rows, expires)

    def _upsert_rows(
        self,
        connection: BaseDatabaseWrapper,
        sql: Statements,
        rows: list[tuple[Any, str, bytes, int]],
        expires: int,
    ) -> list[Any]:
        """Upsert ``(caller key, stored key, bytes, flags)`` rows in as few statements as
        ``max_allowed_packet`` allows; returns the caller keys of rows too large for any."""
        budget = statement_budget(connection) if needs_budget(rows) else ALWAYS_FITS
        failed: list[Any] = []
        values: list[str] = []
        params: list[Any] = []
        size = 0
        for caller_key, key, data, flags in rows:
            size_of_row = row_size(data)
            if size_of_row > budget:
                self._too_large(caller_key, size_of_row, budget)
                failed.append(caller_key)
                continue
            if size + size_of_row > budget:
                self._run(connection, sql.set_many(values), params, rowcount)
                values, params, size = [], [], 0
            value, blob = value_sql(data)
            values.append(value)
            params += (key, *blob, flags, expires)
            size += size_of_row
        if values:
            self._run(connection, sql.set_many(values), params, rowcount)
        return failed

    def touch(self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None) -> bool:
        key = self.make_and_validate_key(key, version)
        expires = self._expires(timeout)
        # A touch that would have deleted the entry (timeout <= 0) and failed leaves it.
        stale = (key,) if expires is None else None
        return self._call(
            self._shard_for(key), True, partial(self._touch, key, expires), False, stale
        )

    def _touch(
        self, key: str, expires: int | None, connection: BaseDatabaseWrapper, sql: Statements
    ) -> bool:
        if expires is None:
            return self._delete_live(key, connection, sql)
        return self._run(connection, sql.touch, (expires, key, now_ms()), rowcount) > 0

    def incr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        """Add ``delta`` atomically in one UPDATE; the entry keeps its expiry.

        Raises ``ValueError`` for a missing key, ``TypeError`` for a value that is not an
        integer, and ``OverflowError`` (value unchanged) past the signed 64-bit range.
        An unreachable shard raises even under IGNORE_EXCEPTIONS: no answer is right.
        """
        check_delta(delta)
        key = self.make_and_validate_key(key, version)
        return self._call(self._shard_for(key), True, partial(self._incr, key, delta))

    def _incr(
        self, key: str, delta: int, connection: BaseDatabaseWrapper, sql: Statements
    ) -> int:
        now = now_ms()
        if delta and INT64_MIN <= delta <= INT64_MAX:
            statement, params = sql.incr, (now, delta, key)
        elif -(2**64) < delta < 2**64:  # and 0, whose "Changed: 0" would say nothing
            statement, params = sql.incr_wide, (delta, key, now, delta)
        else:  # overflows every stored value
            raise self._incr_error(connection, sql, key, delta, now)
        try:
            matched, changed, value = self._run(
                connection, statement, params, update_outcome, idempotent=False
            )
        except DatabaseError as exc:
            if error_code(exc) == OUT_OF_RANGE:
                raise self._incr_error(connection, sql, key, delta, now) from None
            if error_code(exc) not in BAD_NUMBER:
                raise
            self.report_unreadable(
                "corrupt integer", f"corrupt integer cache entry {key!r} read as missing: {exc}"
            )
            raise ValueError(f"Key '{key}' not found") from exc
        if statement is sql.incr and not matched:  # no row under this key: the usual miss
            raise ValueError(f"Key '{key}' not found")
        if not (changed if statement is sql.incr else matched):
            raise self._incr_error(connection, sql, key, delta, now)
        # LAST_INSERT_ID is unsigned: negative results come back as 2**64 + value.
        return value - 2**64 if value > INT64_MAX else value

    def _incr_error(
        self, connection: BaseDatabaseWrapper, sql: Statements, key: str, delta: int, now: int
    ) -> Exception:
        """Why the UPDATE did not apply to a row (only ever run after a failed incr)."""
        row = self._run(connection, sql.incr_failure, (key, now), fetchone)
        if row is None:
            return ValueError(f"Key '{key}' not found")
        is_integer, data = row
        if not is_integer:
            return TypeError(f"The value of key '{key}' is not an integer")
        try:
            in_range = INT64_MIN <= int(data) + delta <= INT64_MAX
        except ValueError:  # not decimal text: corrupt, and a miss like in get()
            in_range = True
        if in_range:  # the key was missing when the UPDATE ran, and was set since
            return ValueError(f"Key '{key}' not found")
        return OverflowError(
            f"Adding {delta} to key '{key}' leaves the signed 64-bit range; value unchanged"
        )

    # --- deleting --------------------------------------------------------------------

    def delete(self, key: Any, version: int | None = None) -> bool:
        key = self.make_and_validate_key(key, version)
        shard = self._shard_for(key)
        return self._call(shard, True, partial(self._delete_live, key), False, (key,))

    def _delete_live(self, key: str, connection: BaseDatabaseWrapper, sql: Statements) -> bool:
        # Not retried after a lost reply: the row may be gone by our own hand, and a retry
        # would answer False for a delete that happened (its effect repeats, its answer not).
        now = now_ms()
        statement, params = sql.delete_live, (key, now)
        deleted = self._run(connection, statement, params, rowcount, idempotent=False) > 0
        if not deleted and self.stampede is not None and self.stampede.stale_timeout:
            # An expired row kept for STALE_TIMEOUT goes too: a deleted entry must never be
            # served stale. Only a row that is still expired: a concurrent set stays.
            self._run(connection, sql.delete_expired_key, (key, now), rowcount)
        return deleted

    def delete_many(self, keys: Iterable[Any], version: int | None = None) -> None:
        stored = list(self.make_keys(keys, version))
        if not stored:
            return
        groups = self._by_shard(stored)

        def delete(sql: Statements, keys: list[str], _: Any) -> tuple[str, list[Any]]:
            return sql.delete_keys(len(keys)), keys

        self._on_shards(
            True, groups, self._delete_keys, None,
            delete if self._one_statement(groups) else None, lambda _: None,
        )

    def _delete_keys(
        self, keys: list[str], connection: BaseDatabaseWrapper, sql: Statements
    ) -> None:
        for chunk in self._key_chunks(connection, keys):
            self._run(connection, sql.delete_keys(len(chunk)), chunk, rowcount)

    def clear(self) -> None:
        """Delete this cache's entries on every shard: those under its KEY_PREFIX (every
        version) when it has one and the default KEY_FUNCTION, else every row of the table."""
        for shard in self.shards:
            self._call(shard, True, self._clear, None, EVERYTHING)

    def _clear(self, connection: BaseDatabaseWrapper, sql: Statements) -> None:
        # DELETE, not TRUNCATE: TRUNCATE commits the caller's open transaction.
        pattern = self._own_keys_pattern()
        if pattern is None:
            self._run(connection, sql.clear, (), rowcount)
        else:
            self._run(connection, sql.clear_prefix, (pattern,), rowcount)

    def _own_keys_pattern(self) -> str | None:
        """A LIKE pattern matching every stored key of this cache and no key under another
        prefix; ``None`` when there is none (no KEY_PREFIX, another KEY_FUNCTION, or a
        prefix longer than the readable head a digested long key keeps)."""
        if not self.key_prefix or self.key_func is not default_key_func:
            return None
        head = f"{self.key_prefix}:"
        return like_prefix(head) if len(head) <= DIGEST_HEAD_LENGTH else None

    # --- prefix operations (primary key order, over every shard) ---------------------

    def keys_with_prefix(self, prefix: str, version: int | None = None) -> list[str]:
        """The caller's keys that start with ``prefix``, in key order.

        Keys over 250 characters are listed in their stored digest form.
        """
        head = self.make_key("", version=version)
        rows = self._prefix_query("keys_with_prefix", prefix, version, fetchall, ())
        return [self._caller_key(stored, head) for (stored,) in sorted(rows)]

    def get_with_prefix(self, prefix: str, version: int | None = None) -> dict[str, Any]:
        """``{key: value}`` of every live entry whose key starts with ``prefix``."""
        head = self.make_key("", version=version)
        found = {}
        rows = self._prefix_query("get_with_prefix", prefix, version, fetchall, ())
        for stored, data, flags in sorted(rows, key=itemgetter(0)):
            value = self.decode(data, flags, stored)
            if value is not MISSING:
                found[self._caller_key(stored, head)] = value
        return found

    def delete_with_prefix(self, prefix: str, version: int | None = None) -> int:
        """Delete every live entry whose key starts with ``prefix``; returns how many.
        With STALE_TIMEOUT, expired entries kept for ``get_or_set`` go too (uncounted)."""
        return sum(self._prefix_query("delete_with_prefix", prefix, version, rowcount, 0))

    def _prefix_query(
        self, statement: str, prefix: str, version: int | None, read: Any, fallback: Any
    ) -> list[Any]:
        """``statement`` on every shard: the rows of all (reads) or each shard's count."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, got {prefix!r}")
        params = (like_prefix(self.make_key(prefix, version=version)), now_ms())

        write = statement.startswith("delete")

        def query(connection: BaseDatabaseWrapper, sql: Statements) -> Any:
            # A delete's count is its answer: not retried after a lost reply (_delete_live).
            answer = self._run(connection, getattr(sql, statement), params, read, idempotent=not write)
            if write and self._stale_ms:  # as delete(): a deleted entry is never served stale
                self._run(connection, sql.delete_expired_with_prefix, params, rowcount)
            return answer

        # A missed prefix delete cannot be listed key by key: the shard is cleared instead.
        stale = EVERYTHING if write else None
        answers = [self._call(shard, write, query, fallback, stale) for shard in self.shards]
        return answers if write else [row for rows in answers for row in rows]

    @staticmethod
    def _caller_key(stored: str, head: str) -> str:
        return stored[len(head) :] if stored.startswith(head) else stored

    def metrics(self) -> dict[str, Any]:
        """This process's counters for the table: values written, their stored bytes and
        the bytes compression saved (``bytes_encoded + bytes_saved`` is the serialized
        size), and under ``"shards"`` each alias's unreachable-server counters and health,
        and for each primary the keys it missed writes of (``outdated_keys``, and
        ``flush_pending`` past the record's limit or after a missed clear)."""
        shards = {}
        for shard in self.shards:
            aliases = [shard.primary()] + ([shard.replica] if shard.replica else [])
            for alias in aliases:
                health = self._health_of(alias)
                shards[alias] = {
                    **asdict(shard_stats(self.table, alias)),
                    "down": health.down,
                    "consecutive_failures": health.failures,
                }
            missed = self._missed_writes(shard)
            shards[aliases[0]].update(outdated_keys=len(missed.keys), flush_pending=missed.flush)
        return {**asdict(self.stats), "shards": shards}

    def sample_entries(self, count: int) -> list[tuple[bytes, int]]:
        """Up to ``count`` live entries picked at random, as stored: ``(bytes, flags)``,
        the same share from each shard.

        For training a compression dictionary (``kvcache_train_dictionary``); it scans
        the table, so it is no request-path call.
        """
        per_shard = -(-count // len(self.shards))

        def sample(connection: BaseDatabaseWrapper, sql: Statements) -> list[Any]:
            return self._run(connection, sql.sample, (now_ms(), per_shard), fetchall)

        rows = [row for shard in self.shards for row in self._call(shard, False, sample)]
        random.shuffle(rows)
        return [(bytes(data), flags) for data, flags in rows[:count]]

    # --- ttl and herd protection -----------------------------------------------------

    def ttl(self, key: Any, version: int | None = None) -> float | None:
        """Seconds until ``key`` expires, as a float (millisecond precision); ``None`` if
        it never expires; ``0.0`` if it is missing or expired — also while an expired
        entry is kept for STALE_TIMEOUT (only ``get_or_set`` serves it). An unreachable
        shard under IGNORE_EXCEPTIONS gives ``0.0``, logged as for ``get``."""
        key = self.make_and_validate_key(key, version)
        row = self._call(self._shard_for(key), False, partial(self._ttl, key), None)
        if row is None:
            return 0.0
        expires, now = row
        if expires >= FOREVER:
            return None
        return max(expires - now, 0) / 1000

    def _ttl(self, key: str, connection: BaseDatabaseWrapper, sql: Statements) -> Any:
        now = now_ms()
        row = self._run(connection, sql.ttl, (key, now), fetchone)
        return None if row is None else (row[0], now)

    def _lease_store(self, key: Any, timeout: Any, version: Any) -> LeaseStore | None:
        """A lease row beside the entry, and expired rows kept for STALE_TIMEOUT
        (``django_kvcache.mysql.lease``)."""
        if self.stampede is None or self._expires(timeout) is None:
            return None
        store = MySQLLeaseStore(self, self.stampede, key, timeout, version)
        primary = connections[self._shard_for(store.entry_key).primary()]
        if primary.in_atomic_block or not autocommits(primary):
            # A lease row written inside a transaction stays locked, and invisible, until
            # the transaction ends: every other caller's take would wait on that lock
            # (innodb_lock_wait_timeout), not LEASE_TIMEOUT. Plain get_or_set instead.
            return None
        return store

    def _lease_call(self, key: str, write: bool, work: Work, fallback: Any) -> Any:
        """``work(execute, statements)`` for the lease store, on the primary of the shard
        that owns ``key`` (an entry's stored key: its lease row lives beside it). Reads
        go to the primary too, where leases are taken, without counting as a write."""

        def on_connection(connection: BaseDatabaseWrapper, sql: Statements) -> Any:
            return work(partial(self._run, connection), sql)

        return self._call(self._shard_for(key), write, on_connection, fallback, primary=True)

    @property
    def _stale_ms(self) -> int:
        """Milliseconds culling keeps an expired row: STALE_TIMEOUT, else 0."""
        stale = self.stampede.stale_timeout if self.stampede is not None else None
        return 0 if stale is None else math.ceil(stale * 1000)

    # --- culling ---------------------------------------------------------------------

    def cull(self, max_batches: int | None = None) -> int:
        """On every shard, delete expired entries, then evict the ones closest to expiry
        while its table holds more than MAX_ENTRIES. Returns the number of rows deleted."""
        cull = partial(self._cull, max_batches)
        return sum(self._call(shard, True, cull) for shard in self.shards)

    def _cull(
        self, max_batches: int | None, connection: BaseDatabaseWrapper, sql: Statements
    ) -> int:
        return culling.Cull(
            partial(self._run, connection),
            sql,
            self._max_entries,
            self._cull_frequency,
            max_batches,
            batch_size=culling.FULL_CULL_BATCH_SIZE,
            keep_stale_ms=self._stale_ms,
        ).run(now_ms())

    def _maybe_cull(self, connection: BaseDatabaseWrapper, sql: Statements) -> None:
        if not self.cull_probability or random.random() >= self.cull_probability:
            return
        cull = culling.Cull(
            partial(self._run, connection),
            sql,
            self._max_entries,
            self._cull_frequency,
            max_batches=culling.WRITE_PATH_BATCHES,
            check_limit=culling.draw_limit_check(self._max_entries, random.random()),
            keep_stale_ms=self._stale_ms,
        )
        try:
            cull.run(now_ms())
        except OperationalError as exc:
            # Culling is housekeeping: rows locked by concurrent writers must not fail
            # this write; the next cull (or kvcache_cull) gets them. In a transaction a
            # deadlock has rolled back the caller's work, which must not go unnoticed.
            if not is_lock_conflict(exc) or in_transaction(connection):
                raise
            logger.info("Cull of %s skipped after a lock conflict: %s", self.table, exc)

    # --- table management ------------------------------------------------------------

    # ``database`` defaults to the cache's own (write) alias, or for ``create_table`` and
    # ``table_exists`` to every shard; the tables of test databases are made through the
    # alias being set up, which a TEST MIRROR alias is not yet.

    def create_table_sql(self, database: str | None = None) -> str:
        connection = connections[database or self.db_alias(write=True)]
        mariadb = server_info(connection).mariadb
        statement = create_table_sql(self.table, connection.ops.quote_name, mariadb, self.engine)
        if dictionaries.uses_stored_dictionaries(self.options):  # and its dictionary table
            statement += ";\n" + dictionaries.create_table_sql(self.table, connection.ops.quote_name)
        return statement

    def drop_table_sql(self, database: str | None = None) -> str:
        connection = connections[database or self.db_alias(write=True)]
        statement = drop_table_sql(self.table, connection.ops.quote_name)
        if dictionaries.uses_stored_dictionaries(self.options):
            statement += ";\n" + dictionaries.drop_table_sql(self.table, connection.ops.quote_name)
        return statement

    def create_table(self, database: str | None = None) -> str:
        """Create the table where it is missing (``database``, else every shard); returns
        the statement it ran (the last one, with shards)."""
        statement = ""
        for alias in [database] if database else self.database_aliases():
            statement = self.create_table_sql(alias)
            with connections[alias].cursor() as cursor:
                for part in connections[alias].ops.prepare_sql_script(statement):
                    cursor.execute(part)
        return statement

    def table_exists(self, database: str | None = None) -> bool:
        """Whether the table exists in ``database``, else on every shard."""
        tables = [self.table]
        if dictionaries.uses_stored_dictionaries(self.options):
            tables.append(dictionaries.dictionary_table(self.table))
        return all(
            set(tables) <= set(connections[alias].introspection.table_names())
            for alias in ([database] if database else self.database_aliases())
        )

    # --- helpers ---------------------------------------------------------------------

    def _key_chunks(self, connection: BaseDatabaseWrapper, keys: list[str]) -> Iterator[list[str]]:
        """``keys`` in as few statements as ``max_allowed_packet`` allows (usually one)."""
        if len(keys) * KEY_BYTES <= ALWAYS_FITS:
            yield keys
            return
        per_statement = statement_budget(connection) // KEY_BYTES
        for start in range(0, len(keys), per_statement):
            yield keys[start : start + per_statement]

    def _fits(self, connection: BaseDatabaseWrapper, data: bytes, key: str) -> bool:
        size, budget = row_size(data), statement_budget(connection)
        if size <= budget:
            return True
        self._too_large(key, size, budget)
        return False

    def _too_large(self, key: Any, size: int, budget: int) -> None:
        logger.warning(
            "Not caching %r in %s: its row takes %d bytes in a statement (escaped, with the "
            "key), over the limit of %d bytes (the connection's max_allowed_packet minus %d)",
            key,
            self.backend_name,
            size,
            budget,
            PACKET_HEADROOM,
        )

    akeys_with_prefix = delegate_to_sync("keys_with_prefix")
    aget_with_prefix = delegate_to_sync("get_with_prefix")
    adelete_with_prefix = delegate_to_sync("delete_with_prefix")
    acull = delegate_to_sync("cull")


def shard_options(cache_settings: Mapping[str, Any]) -> tuple[Any, Any]:
    """The DATABASE and DATABASES of a CACHES entry: where its table lives."""
    options = cache_settings.get("OPTIONS") or {}
    databases = options.get("DATABASES")
    return options.get("DATABASE"), None if databases is None else tuple(databases)


def is_mysql_cache(alias: str) -> bool:
    """Whether ``CACHES[alias]`` is a MySQLCache (or a subclass), without building it."""
    try:
        backend = import_string(settings.CACHES[alias]["BACKEND"])
    except (KeyError, ImportError):
        return False
    return isinstance(backend, type) and issubclass(backend, MySQLCache)


def mysql_cache_aliases() -> list[str]:
    """The aliases of every MySQLCache in ``CACHES``, in settings order."""
    return [alias for alias in settings.CACHES if is_mysql_cache(alias)]
