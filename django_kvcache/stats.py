"""The figures of every kvcache cache, per memcached node or MySQL shard, for operators:
what ``manage.py kvcache_stats`` prints and the Prometheus collector exports.

Two sources, kept apart because they mean different things:

* ``metrics()``, the counters of *this process* (hits, misses, bytes sent and saved by
  compression, failures, skipped and ignored calls, outdated keys waiting, pools), shared
  by every instance of a cache with the same settings. Inside a web process they are that
  process's traffic (the collector's case); in a fresh ``manage.py`` they are mostly zero.
* the servers' own view (``server_figures``): memcached's ``stats`` of each node (every
  client's hits and misses, items, bytes, evictions) and each MySQL shard's table size.

``metrics()`` is read as the backends give it, whatever keys they add: a dict-valued
entry is a node (memcached: ``{node: {...}}``) or a group of places (MySQL: ``{"shards":
{alias: {...}}}``); scalar entries belong to the cache as a whole (MySQL's table counters).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from django.core.cache import caches
from django.db import DatabaseError

from django_kvcache.configured import kvcache_aliases  # noqa: F401  (the commands' list)

#: Figures whose value only grows (Prometheus counters); every other figure is a gauge.
COUNTERS = frozenset({
    "ops", "hits", "misses", "errors", "timeouts", "ignored", "skipped", "reruns",
    "bytes_sent", "bytes_received", "bytes_saved", "bytes_encoded", "values_encoded",
    "pool_waits", "pool_wait_seconds", "pool_connects", "pool_reuses", "pool_reconnects",
})
#: What each known figure means (the collector's HELP, the table's order).
MEANINGS = {
    "hits": "reads that found the key",
    "misses": "reads that did not find the key",
    "ops": "operations sent to the node",
    "bytes_sent": "bytes sent to the node",
    "bytes_received": "bytes received from the node",
    "values_encoded": "values written (or refused as too large)",
    "bytes_encoded": "bytes of the values written, as stored",
    "bytes_saved": "bytes compression took off the values written",
    "errors": "calls that failed because the server could not be reached or answered wrong",
    "timeouts": "of the errors, timeouts",
    "skipped": "calls not sent because the server was marked down",
    "ignored": "failures IGNORE_EXCEPTIONS turned into a miss or a no-op",
    "reruns": "statements sent again after an error that left them safe to rerun "
              "(a deadlock or Galera conflict, a connection lost before sending)",
    "down": "1 while the server is marked down",
    "consecutive_failures": "failures in a row",
    "outdated_keys": "keys whose copy on this server may be outdated, to delete when it answers",
    "flush_pending": "1 while this server must be cleared when it answers",
    "replica_lag": "seconds this replica was behind at the last question (MAX_REPLICA_LAG)",
    "replica_behind": "1 while this replica is over MAX_REPLICA_LAG (stopped, unanswered, or "
                      "not asked yet included): its shard's reads go to the primary",
    "max_size": "MAX_SIZE: the bytes this table (shard) may hold, keys and stored values",
    "stored_bytes": "bytes of keys and stored values the table holds, MAX_SIZE's estimate "
                    "(exact for a table no larger than its sample; in a process's figures, as "
                    "its last budget check read it)",
    "stored_entries": "rows the table holds, MAX_SIZE's estimate (as stored_bytes)",
    "stored_estimated": "1 when stored_bytes and stored_entries are estimated from a sample "
                        "of the table, 0 when summed",
    "late_writes": "writes that timed out, still to settle",
    "pool_size": "open blocking connections",
    "pool_idle": "idle blocking connections",
    "pool_waiters": "threads waiting for a blocking connection now",
    "pool_waits": "times a thread waited for a blocking connection",
    "pool_wait_seconds": "seconds threads waited for a blocking connection, in all",
    "pool_connects": "blocking connections opened",
    "pool_reuses": "calls served by an idle blocking connection",
    "pool_reconnects": "idle blocking connections the server had closed, replaced",
    "pool_waiters": "threads waiting for a blocking connection now",
    "async_loops": "event loops with a pool for this node",
    "async_pool_size": "open asyncio connections",
    "async_pool_idle": "idle asyncio connections",
    "async_pool_waiters": "coroutines waiting for an asyncio connection now",
    "async_pool_waits": "times a coroutine waited for an asyncio connection (open loops)",
    "async_pool_wait_seconds": "seconds coroutines waited for an asyncio connection, in all "
                               "(open loops)",
    "async_pool_connects": "asyncio connections opened (open loops)",
    "async_pool_reuses": "calls served by an idle asyncio connection (open loops)",
    "async_pool_reconnects": "idle asyncio connections the server had closed, replaced "
                             "(open loops)",
}
#: memcached ``stats`` worth showing, in order.
MEMCACHED_SERVER_STATS = (
    "get_hits", "get_misses", "curr_items", "bytes", "limit_maxbytes", "evictions",
    "curr_connections",
)


@dataclass
class Place:
    """One memcached node or MySQL shard (database alias) of a cache."""

    kind: str  # "node" or "shard"
    name: str
    figures: dict[str, int | float] = field(default_factory=dict)


@dataclass
class CacheFigures:
    alias: str
    backend: str  # the backend's class name
    figures: dict[str, int | float]  # of the cache as a whole
    places: list[Place]


def number(value: Any) -> int | float | None:
    """A figure as a number (``True`` is 1); None for what is not one."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


def figures_of(values: Mapping[str, Any]) -> dict[str, int | float]:
    """The numeric entries of ``values``, known figures first, in MEANINGS' order."""
    read = {name: number(value) for name, value in values.items()}
    known = [name for name in MEANINGS if read.get(name) is not None]
    others = [name for name in read if name not in MEANINGS and read[name] is not None]
    return {name: read[name] for name in known + others}  # type: ignore[misc]


def process_figures(alias: str) -> CacheFigures:
    """``caches[alias].metrics()``, per node or shard."""
    cache = caches[alias]
    metrics = cache.metrics()
    places: list[Place] = []
    for name, value in metrics.items():
        if not isinstance(value, Mapping):
            continue
        if value and all(isinstance(inner, Mapping) for inner in value.values()):
            kind = name[:-1] if name.endswith("s") else name  # "shards" -> "shard"
            places += [Place(kind, inner, figures_of(values)) for inner, values in value.items()]
        else:
            places.append(Place("node", name, figures_of(value)))
    return CacheFigures(alias, type(cache).__name__, figures_of(metrics), places)


def hit_ratio(figures: Mapping[str, int | float]) -> float | None:
    hits, misses = figures.get("hits"), figures.get("misses")
    if hits is None or misses is None or not hits + misses:
        return None
    return hits / (hits + misses)


def server_figures(alias: str) -> dict[str, dict[str, Any]]:
    """The servers' own view of the cache ``alias``, per node or shard; a server that
    cannot be asked gives ``{"error": ...}``."""
    cache = caches[alias]
    if hasattr(cache, "server_stats"):  # memcached
        answers = cache.server_stats()
        return {
            node: stats if "error" in stats else {
                name: stats[name] for name in MEMCACHED_SERVER_STATS if name in stats
            }
            for node, stats in answers.items()
        }
    if hasattr(cache, "database_aliases"):  # MySQL
        budgets = dict(zip(cache.database_aliases(), cache.max_sizes))
        return {database: {**table_size(database, cache.table),
                           **budget_size(database, cache.table, budgets.get(database))}
                for database in cache.database_aliases()}
    return {}


def budget_size(database: str, table: str, max_size: int | None) -> dict[str, Any]:
    """With MAX_SIZE: the budget of ``table`` in ``database`` and what it holds, as a
    budget check estimates it (:mod:`django_kvcache.mysql.budget`)."""
    if max_size is None:
        return {}
    from django_kvcache.mysql.budget import NotReady, server_estimate

    try:
        held = server_estimate(database, table)
    except (DatabaseError, NotReady) as exc:
        return {"max_size": max_size, "error": f"{type(exc).__name__}: {exc}"}
    return {"max_size": max_size, "stored_bytes": held.bytes, "stored_entries": held.entries,
            "stored_estimated": int(not held.exact)}


def table_size(database: str, table: str) -> dict[str, Any]:
    """Rows (the server's estimate) and bytes of ``table`` in ``database``."""
    query = (
        "SELECT TABLE_ROWS, DATA_LENGTH, INDEX_LENGTH FROM information_schema.TABLES "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s"
    )
    from django_kvcache.mysql.blocking import query as run  # the cache's own connections

    try:
        found = run(database, query, [table])
    except DatabaseError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not found:
        return {"error": f"no table {table!r}"}
    rows, data, index = found[0]
    return {"rows_estimate": rows, "data_bytes": data, "index_bytes": index}
