"""MySQLCache's counters: per table in this process, per shard and replica alias, and
their connection pools (``cache.metrics()``, ``kvcache_stats``, the Prometheus
collector)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from django_kvcache.mysql import pools
from django_kvcache.mysql.cluster import Cluster


@dataclass
class TableStats:
    """Process-wide counters of one table on its databases, shared by every instance
    (plain ints: cheap, and exact enough under the GIL for monitoring)."""

    hits: int = 0  # keys read that were found (get, get_many, and get_or_set's reads)
    misses: int = 0  # keys read that were not found, or found unreadable
    values_encoded: int = 0  # values written (or refused as too large) since start
    bytes_encoded: int = 0  # their size as stored
    bytes_saved: int = 0  # what compression took off that


#: (table, its shards' aliases) -> its counters: one table name on two databases is two.
_stats: dict[tuple[str, tuple[str | None, ...]], TableStats] = {}


def table_stats(cluster: Cluster) -> TableStats:
    """The counters of ``cluster``'s table on its shards."""
    where = tuple(shard.alias for shard in cluster.shards)
    return _stats.setdefault((cluster.table, where), TableStats())


def figures(
    cluster: Cluster, stats: TableStats, max_sizes: tuple[int | None, ...] = ()
) -> dict[str, Any]:
    """``stats``, and under ``"shards"`` each shard's primary alias, under ``"replicas"``
    (with ``REPLICAS``) each replica alias, with its failure counters, health and
    connection pools (``pool_*`` for the sync API, ``async_pool_*`` summed over the event
    loops); for each primary the keys it missed writes of (``outdated_keys``, and
    ``flush_pending`` past the record's limit or after a missed clear); with
    MAX_REPLICA_LAG, for each replica the seconds it was behind at the last question
    (``replica_lag``; ``None`` when stopped, unanswered or not asked yet) and whether its
    shard's reads go to the primary for it (``replica_behind``)."""
    shards: dict[str, dict[str, Any]] = {}
    replicas: dict[str, dict[str, Any]] = {}
    for shard, alias in cluster.aliases():
        health = cluster.health(alias)
        figures = {
            # (stored_bytes and stored_entries only once a budget check read them)
            **{name: value for name, value in asdict(cluster.stats(alias)).items()
               if value is not None},
            "down": health.down,
            "consecutive_failures": health.failures,
            **pools.figures(alias, cluster.connections),
        }
        if alias == shard.primary():
            missed = cluster.missed(shard)
            figures.update(outdated_keys=len(missed.keys), flush_pending=missed.flush)
            if max_sizes:
                figures["max_size"] = max_sizes[shard.index]
            shards[alias] = figures
            continue
        lag_monitor = cluster.lag_monitor(shard)
        if lag_monitor is not None:  # the last answer: no question asked here
            lag = lag_monitor.seconds
            figures.update(
                replica_lag=None if math.isinf(lag) else lag,  # JSON has no inf
                replica_behind=cluster.replica_behind(shard),
            )
        replicas[alias] = figures
    metrics: dict[str, Any] = {**asdict(stats), "shards": shards}
    if replicas:
        metrics["replicas"] = replicas
    return metrics
