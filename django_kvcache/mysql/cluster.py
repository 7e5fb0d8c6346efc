"""The shards of one MySQLCache configuration and what it remembers about them.

:func:`cluster_for` reads the placement and failure OPTIONS and returns the process-wide
:class:`Cluster` for them — every instance Django builds (one per thread, one per async
context) shares it: the shards and their router, each alias's health record and
counters, each primary's record of missed writes, and the statement text per server
flavour, and the read-your-writes window of each thread (or async context), which every
instance used there shares. What is per instance is a :class:`Session` (its messages).

Missed writes (:class:`MissedWrites`): a write that failed or was skipped leaves the
shard's older copy in place. Until it is deleted those keys are *owed*: a call that
touches one deletes it first (one bounded statement), and every call to the shard takes
one bounded step of the rest (:data:`OWED_BATCH_ROWS` rows at most, one call at a time);
what is left waits for the next calls or ``cull()``. A flush (after a missed ``clear()``
or more than ``outdated.LIMIT`` keys) owes every key of the cache: each is deleted before
it is read, and the flush runs in ``DELETE … LIMIT`` batches.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any, Callable, Collection, Generator, Iterator, Mapping

from django.conf import settings
from django.core.cache.backends.base import default_key_func

from django_kvcache.forks import Registry
from django_kvcache.health import NodeHealth, health_for
from django_kvcache.mysql.config import router_model
from django_kvcache.mysql.connect import (  # noqa: F401  (the pool defaults, named here too)
    DEFAULT_POOL_SIZE,
    DEFAULT_POOL_TIMEOUT,
    ConnectionSettings,
    connection_settings,
)
from django_kvcache.mysql.keys import DIGEST_HEAD_LENGTH, like_prefix
from django_kvcache.mysql.query import Query, rowcount
from django_kvcache.mysql.replica_lag import LagMonitor
from django_kvcache.mysql.replica_lag import monitor as lag_monitor
from django_kvcache.mysql.server import known_server
from django_kvcache.mysql.shards import (
    SHARD_KIND,
    Shard,
    ShardStats,
    make_shards,
    max_replica_lag,
    read_your_writes,
    shard_stats,
)
from django_kvcache.mysql.sql import Statements, quote_name
from django_kvcache.options import flag, integer, read_number_options, seconds
from django_kvcache.outdated import LIMIT, OutdatedCopies

logger = logging.getLogger(__name__)

#: Rows one owed-clean-up statement deletes at most (keys by primary key, or a flush
#: batch in key order): well inside the one-second read_timeout the docs recommend.
OWED_BATCH_ROWS = 1000
#: Owed-clean-up statements one call to a shard may run before its own work.
OWED_BATCHES_PER_CALL = 1

#: IGNORE_EXCEPTIONS when OPTIONS do not say: fail open, as MemcachedCache does.
IGNORE_EXCEPTIONS_DEFAULT = True

#: A call's ``keys`` when it reads or writes keys it cannot list (a prefix, a scan).
ANY_KEY: Any = object()


class MissedWrites(OutdatedCopies):
    """The keys of one cache whose copy on one primary may be older than this process's
    last write to them (:mod:`django_kvcache.outdated`), deleted in bounded steps.

    ``generation`` counts what was added: a step that ran while more was missed settles
    nothing it cannot vouch for (the keys stay owed, deleting them again is harmless).
    During a flush, ``cleaned`` lists the keys already deleted one by one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cleaning = threading.Lock()  # one clean-up step at a time, never waited for
        self.generation = 0
        self.cleaned: set[str] = set()
        self.deleted = 0  # keys deleted since the record last had nothing owed
        self.resume_at = 0.0  # monotonic time before which no call takes a step

    def add(self, keys: Collection[str]) -> None:
        with self.lock:
            self.generation += 1
        super().add(keys)

    def add_everything(self) -> None:
        with self.lock:
            self.generation += 1
            self.cleaned = set()
        super().add_everything()

    def owed(self, keys: Collection[str]) -> list[str]:
        """Which of ``keys`` may still have an older copy (read without the lock: a plain
        bool while nothing is owed)."""
        if not self.pending:
            return []
        if self.flush:
            cleaned = self.cleaned
            return [key for key in keys if key not in cleaned]
        owed = self.keys
        return [key for key in keys if key in owed]

    def settled(self, keys: Collection[str], generation: int, flush_done: bool = False) -> bool:
        """``keys`` were deleted (and with ``flush_done`` the flush's last batch came back
        short) by a step that started at ``generation``. True when nothing is owed now."""
        with self.lock:
            if generation == self.generation:
                if flush_done:
                    self.flush, self.cleaned = False, set()
                elif self.flush:
                    self.cleaned |= set(keys)
                    if len(self.cleaned) > LIMIT:
                        self.cleaned = set()
                else:
                    before = len(self.keys)
                    self.keys -= set(keys)
                    self.deleted += before - len(self.keys)
            self.pending = self.flush or bool(self.keys)
            return not self.pending

    def some_keys(self, count: int) -> list[str]:
        """Up to ``count`` of the owed keys, in key order (a snapshot)."""
        with self.lock:
            return sorted(self.keys)[:count]

    def after_fork(self) -> None:
        super().after_fork()
        self.cleaning = threading.Lock()


#: (table, primary alias, the cache's own-keys pattern) -> its record, process-wide.
_missed_writes: Registry[tuple[str, str, str | None], MissedWrites] = Registry()


def missed_writes(table: str, alias: str, scope: str | None) -> MissedWrites:
    """The record of a cache (``scope``: the LIKE pattern of its own keys, which a flush
    deletes; ``None``: the whole table) on one shard's primary."""
    return _missed_writes.get((table, alias, scope), MissedWrites)


def own_keys_pattern(key_prefix: str, default_key_function: bool) -> str | None:
    """A LIKE pattern matching every stored key of a cache and no key under another
    prefix; ``None`` when there is none (no KEY_PREFIX, another KEY_FUNCTION, or a prefix
    longer than the readable head a digested long key keeps)."""
    if not key_prefix or not default_key_function:
        return None
    head = f"{key_prefix}:"
    return like_prefix(head) if len(head) <= DIGEST_HEAD_LENGTH else None


# --- the bounded clean-up statements -------------------------------------------------------


def delete_keys(sql: Statements, keys: list[str]) -> Query:
    return Query(sql.delete_keys(len(keys)), keys, rowcount)


def delete_scope_batch(sql: Statements, scope: str | None, rows: int) -> Query:
    """One batch of a flush: this cache's rows (``scope``), or every row, in key order."""
    if scope is None:
        return Query(sql.clear_batch, (rows,), rowcount)
    return Query(sql.clear_prefix_batch, (scope, rows), rowcount)


def delete_owed(sql: Statements, keys: list[str]) -> Generator[Query, Any, None]:
    """The owed copies of the keys a call is about to use, by primary key."""
    for start in range(0, len(keys), OWED_BATCH_ROWS):
        yield delete_keys(sql, keys[start : start + OWED_BATCH_ROWS])


def steps(
    record: MissedWrites, scope: str | None, sql: Statements, alias: str,
    budget: int | None = None,
) -> Generator[Query, Any, None]:
    """Up to ``budget`` bounded statements of what ``record`` owes on its primary
    (``alias``: how the log names it) (``None``: until nothing is owed)."""
    taken = 0
    while record.pending and (budget is None or taken < budget):
        taken += 1
        generation = record.generation
        if record.flush:
            deleted = yield delete_scope_batch(sql, scope, OWED_BATCH_ROWS)
            settled = record.settled((), generation, flush_done=deleted < OWED_BATCH_ROWS)
            what = "every entry of this cache"
        else:
            keys = record.some_keys(OWED_BATCH_ROWS)
            if not keys:
                break
            yield delete_keys(sql, keys)
            settled = record.settled(keys, generation)
            what = f"the {record.deleted} key(s)"
        if settled:
            record.deleted = 0
            logger.warning("%s answers again: deleted %s written while it could not be "
                           "reached", alias, what)


class Cluster:
    """One configuration's shards and records, shared process-wide (see the module)."""

    def __init__(self, table: str, options: Mapping[str, Any], scope: str | None) -> None:
        self.table = table
        self.scope = scope
        self.shards, self.router = make_shards(options, router_model(table))
        self.ignore_exceptions = flag(options, "IGNORE_EXCEPTIONS", IGNORE_EXCEPTIONS_DEFAULT)
        self.failure_threshold = integer(options, "FAILURE_THRESHOLD", 2)
        self.retry_timeout = seconds(options, "RETRY_TIMEOUT", 10.0)
        self.read_your_writes = read_your_writes(options)
        self.max_replica_lag = max_replica_lag(options)
        # The cache's own connections: a pool per alias and these settings, per process
        # on the sync API, per event loop on the async API (docs/mysql.rst).
        self.connections: ConnectionSettings = connection_settings(options)
        self.max_pool_size = self.connections.max_size
        self.pool_timeout = self.connections.pool_timeout
        self.identity = _frozen(options)
        self._names: tuple[Any, str] = (None, "")  # (settings.CACHES, the caches' names)
        # Reads may leave the primary only with a replica or routers that pick readers.
        self.tracks_writes = any(s.replica or s.alias is None for s in self.shards)
        # shard index -> when this thread (or async context) last wrote it: every
        # instance of this configuration in the thread reads its writes, as one Django
        # request would through two aliases of one table (another VERSION, say).
        self._written_at: contextvars.ContextVar[dict[int, float]] = contextvars.ContextVar(
            f"kvcache written shards of {table}")
        self._health: dict[str, NodeHealth] = {}
        self._statements: dict[bool, Statements] = {}
        self._missed: dict[str, MissedWrites] = {}  # primary alias -> its record
        self.single = self.shards[0] if self.router is None else None

    def written_here(self) -> dict[int, float]:
        """When this thread (or async context) last wrote each shard (monotonic time)."""
        written = self._written_at.get(None)
        if written is None:
            written = {}
            self._written_at.set(written)
        return written

    # --- where keys live ---------------------------------------------------------------

    def shard_for(self, key: str) -> Shard:
        if self.single is not None:
            return self.single
        return self.shards[self.router.node_for(key)]  # type: ignore[union-attr]

    def by_shard(self, keys: list[str]) -> list[tuple[Shard, list[str]]]:
        """``keys`` grouped by shard, in the order of their first key."""
        if self.single is not None:
            return [(self.single, keys)]
        shards = self.shards
        return [(shards[i], group) for i, group in self.router.group(keys).items()]  # type: ignore[union-attr]

    # --- what is known per alias ---------------------------------------------------------

    def health(self, alias: str) -> NodeHealth:
        health = self._health.get(alias)
        if health is None:
            health = self._health[alias] = health_for(
                alias, self.failure_threshold, self.retry_timeout, kind=SHARD_KIND
            )
        return health

    def stats(self, alias: str) -> ShardStats:
        return shard_stats(self.table, alias)

    def missed(self, shard: Shard) -> MissedWrites:
        alias = shard.primary()
        record = self._missed.get(alias)
        if record is None:
            record = self._missed[alias] = missed_writes(self.table, alias, self.scope)
        return record

    def statements(self, alias: str) -> Statements | None:
        """The statement text for ``alias``'s server flavour; None until it is detected."""
        info = known_server(alias)
        if info is None:
            return None
        row_alias = info.row_alias
        sql = self._statements.get(row_alias)
        if sql is None:
            sql = self._statements[row_alias] = Statements(self.table, quote_name, row_alias)
        return sql

    def lag_monitor(self, shard: Shard) -> LagMonitor | None:
        """The monitor of ``shard``'s replica where MAX_REPLICA_LAG bounds its lag."""
        if self.max_replica_lag is None or not shard.replica:
            return None
        return lag_monitor(shard.replica)

    def replica_behind(self, shard: Shard) -> bool:
        """Whether ``shard``'s replica was, at the last answer, further behind than
        MAX_REPLICA_LAG (INFINITE before the first answer and after a failed question)."""
        monitor, bound = self.lag_monitor(shard), self.max_replica_lag
        return monitor is not None and bound is not None and monitor.seconds > bound

    def describe(self, alias: str, kind: bool = True) -> str:
        """How log lines and errors name ``alias``: its role in this cache (server,
        shard, replica) and the cache, by its name in CACHES (``kind``: with "MySQL ")."""
        if any(shard.replica == alias for shard in self.shards):
            role = "replica"
        else:
            role = "shard" if len(self.shards) > 1 else "server"
        return f"{'MySQL ' if kind else ''}{role} {alias!r} of {self.cache_name()}"

    def cache_name(self) -> str:
        """``cache 'sessions'`` (the CACHES entries that make this configuration), else
        the table's name."""
        caches = settings.CACHES
        if self._names[0] is not caches:
            names = [name for name in caches if self._made_by(caches[name])]
            described = ("cache " + " or ".join(map(repr, names)) if names
                         else f"the MySQLCache of table {self.table!r}")
            self._names = (caches, described)
        return self._names[1]

    def _made_by(self, entry: Mapping[str, Any]) -> bool:
        """Whether a CACHES entry makes this configuration (its table, options, keys)."""
        if entry.get("LOCATION") != self.table or "mysql" not in str(entry.get("BACKEND")):
            return False
        try:
            options = read_number_options(entry.get("OPTIONS") or {})
        except Exception:  # noqa: BLE001  (that entry's own error, raised when it is built)
            return False
        scope = own_keys_pattern(entry.get("KEY_PREFIX", ""),
                                 entry.get("KEY_FUNCTION") in (None, default_key_func))
        return _frozen(options) == self.identity and scope == self.scope

    def aliases(self) -> Iterator[tuple[Shard, str]]:
        """Every alias of every shard: its primary, then its replica."""
        for shard in self.shards:
            yield shard, shard.primary()
            if shard.replica:
                yield shard, shard.replica


_clusters: Registry[tuple, Cluster] = Registry()


def cluster_for(table: str, options: Mapping[str, Any], scope: str | None) -> Cluster:
    """The process-wide cluster of this table, OPTIONS and key scope."""
    identity = (table, scope, _frozen(options))
    return _clusters.get(identity, lambda: Cluster(table, options, scope))  # checks OPTIONS


def _frozen(value: Any) -> Any:
    if isinstance(value, bool):  # True == 1: a cluster built for 1 must not serve True
        return ("bool", value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


class Session:
    """One backend instance's view of its cluster: the cluster's shared records, and the
    read-your-writes window of the thread (or async context) that uses it — shared by
    every instance of the configuration there (:meth:`Cluster.written_here`)."""

    def __init__(
        self,
        cluster: Cluster,
        describe_missing_table: Callable[[str], str],
        describe_table_layout: Callable[[str, list[str] | None, BaseException], str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.describe_missing_table = describe_missing_table
        # a table of another layout: (alias, its columns, the server's error) -> message
        self.describe_table_layout = describe_table_layout
        # The window of the context that builds the instance exists from now on, so the
        # tasks it starts later (each asyncio.run, asyncio.gather…) share it, not copies.
        cluster.written_here()

    def wrote(self, shard: Shard) -> None:
        """A write to ``shard`` starts, or ends: reads of it go to its primary for
        READ_YOUR_WRITES from now (stamped at both ends: a lost reply may still have
        applied, and a slow write must not end with its window already past)."""
        if self.cluster.tracks_writes:
            self.cluster.written_here()[shard.index] = time.monotonic()

    def reader(self, shard: Shard) -> str:
        if not self.cluster.tracks_writes:
            return shard.reader()
        written = self.cluster.written_here().get(shard.index)
        lately = written is not None and time.monotonic() - written < self.cluster.read_your_writes
        return shard.reader(lately, self.cluster.replica_behind(shard))
