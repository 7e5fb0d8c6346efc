"""The databases a MySQLCache spreads its keys over, read from its OPTIONS.

A *shard* is one Django database alias (``OPTIONS["DATABASE"]``, one entry of
``OPTIONS["DATABASES"]``, or whatever the database routers name when neither is set),
with an optional replica alias for reads (``OPTIONS["REPLICAS"]``). Which shard owns a key
is decided by the shared rendezvous router (:mod:`django_kvcache.routing`), so removing a
shard from the list moves only that shard's keys. Which alias serves a read of a shard
is decided in one place, :meth:`Shard.reader`.

What happens when a shard fails (health, missed writes, counters) is the cluster's
(:mod:`django_kvcache.mysql.cluster`) and the failure policy's
(:mod:`django_kvcache.mysql.policy`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, cast

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, router

from django_kvcache.dependencies import require
from django_kvcache.options import seconds
from django_kvcache.routing import KvcacheRouter, Router, parse_weights

#: Health records of shards are named with this kind ("MySQL shard cache2 is down ...").
SHARD_KIND = "MySQL shard"
#: Seconds after a write during which this thread reads that shard from its primary.
DEFAULT_READ_YOUR_WRITES = 5.0


@dataclass
class ShardStats:
    """Process-wide counters of one alias of one table (plain ints, as TableStats)."""

    errors: int = 0  # statements that failed because the server was unreachable
    ignored: int = 0  # of those (and skips), how many IGNORE_EXCEPTIONS turned into misses
    skipped: int = 0  # calls not sent because the alias was marked down
    reruns: int = 0  # statements sent again after an error (a Galera conflict, a lost connection)
    # MAX_SIZE: the table's stored bytes and rows at this process's last budget check
    # (None before one), and 1 when they were estimated from a sample (0: summed): what a
    # scrape can show without asking the server.
    stored_bytes: int | None = None
    stored_entries: int | None = None
    stored_estimated: int | None = None


_shard_stats: dict[tuple[str, str], ShardStats] = {}


def shard_stats(table: str, alias: str) -> ShardStats:
    return _shard_stats.setdefault((table, alias), ShardStats())


class Shard:
    """One shard: its primary alias (``None``: ask the routers) and its replica, if any."""

    __slots__ = ("index", "alias", "replica", "model")

    def __init__(self, index: int, alias: str | None, replica: str | None, model: type) -> None:
        self.index = index
        self.alias = alias
        self.replica = replica
        self.model = model  # what the routers are asked about

    def __repr__(self) -> str:
        return f"<MySQL shard {self.alias or '(routers)'}>"

    def primary(self) -> str:
        return self.alias if self.alias is not None else router.db_for_write(self.model)

    def reader(self, wrote_lately: bool = False, replica_behind: bool = False) -> str:
        """The alias that serves a read of this shard — the one place that decides it.

        Within READ_YOUR_WRITES of a write by this thread (``wrote_lately``), or while the
        replica is further behind than MAX_REPLICA_LAG (``replica_behind``), the primary;
        else the replica, else the primary (or what the routers say).
        """
        if wrote_lately or replica_behind:
            return self.primary()
        if self.alias is None:
            return router.db_for_read(self.model)
        return self.replica or self.alias


def check_alias(alias: Any, option: str) -> str:
    if not isinstance(alias, str) or alias not in connections.settings:
        raise ImproperlyConfigured(f"{option} must name an entry of DATABASES, got {alias!r}")
    return alias


def shard_aliases(options: Mapping[str, Any]) -> list[str | None]:
    """The primary aliases from DATABASE or DATABASES; ``[None]`` when the routers decide."""
    single, many = options.get("DATABASE"), options.get("DATABASES")
    if single is not None and many is not None:
        raise ImproperlyConfigured(
            "OPTIONS['DATABASE'] and OPTIONS['DATABASES'] are mutually exclusive: use "
            "DATABASE for one alias, DATABASES for a list of shards"
        )
    if many is None:
        return [None if single is None else check_alias(single, "OPTIONS['DATABASE']")]
    if isinstance(many, (str, bytes)) or not isinstance(many, Sequence) or not many:
        raise ImproperlyConfigured(
            f"OPTIONS['DATABASES'] must be a non-empty list of DATABASES aliases, got {many!r}"
        )
    aliases = [check_alias(alias, "each entry of OPTIONS['DATABASES']") for alias in many]
    if len(set(aliases)) != len(aliases):
        raise ImproperlyConfigured(f"OPTIONS['DATABASES'] lists an alias twice: {many!r}")
    return list(aliases)


def replicas(options: Mapping[str, Any], aliases: list[str | None]) -> dict[str, str]:
    """OPTIONS['REPLICAS']: primary alias -> replica alias, each a DATABASES entry."""
    mapping = options.get("REPLICAS")
    if mapping is None:
        return {}
    if aliases == [None]:
        raise ImproperlyConfigured(
            "OPTIONS['REPLICAS'] needs OPTIONS['DATABASE'] or OPTIONS['DATABASES']; with "
            "neither, Django's database routers choose where reads go"
        )
    if not isinstance(mapping, Mapping):
        raise ImproperlyConfigured(f"OPTIONS['REPLICAS'] must be a dict, got {mapping!r}")
    for primary, replica in mapping.items():
        if primary not in aliases:
            raise ImproperlyConfigured(
                f"OPTIONS['REPLICAS'] has {primary!r}, which is not a shard of this cache "
                f"(OPTIONS['DATABASE'] or OPTIONS['DATABASES']: {aliases})"
            )
        check_alias(replica, f"OPTIONS['REPLICAS'][{primary!r}]")
    return dict(mapping)


def make_shards(options: Mapping[str, Any], model: type) -> tuple[list[Shard], Router | None]:
    """The shards of OPTIONS and the router over them (``None`` for a single shard)."""
    aliases = shard_aliases(options)
    replica_of = replicas(options, aliases)
    shards = [
        Shard(index, alias, replica_of.get(alias) if alias else None, model)
        for index, alias in enumerate(aliases)
    ]
    if options.get("WEIGHTS") is not None and options.get("DATABASES") is None:
        raise ImproperlyConfigured("OPTIONS['WEIGHTS'] needs OPTIONS['DATABASES'] (the shards)")
    if len(shards) == 1:
        return shards, None
    require("mmh3", "A MySQLCache over several shards (OPTIONS['DATABASES'])", extra="mysql")
    names = [alias for alias in aliases if alias is not None]
    weights = parse_weights(options.get("WEIGHTS"), names, "aliases of OPTIONS['DATABASES']")
    return shards, KvcacheRouter(names, weights)


def read_your_writes(options: Mapping[str, Any]) -> float:
    return cast(float, seconds(options, "READ_YOUR_WRITES", DEFAULT_READ_YOUR_WRITES))


def max_replica_lag(options: Mapping[str, Any]) -> float | None:
    """OPTIONS['MAX_REPLICA_LAG']: seconds a replica may be behind and still serve reads;
    ``None`` (the default): any."""
    bound = seconds(options, "MAX_REPLICA_LAG", None, allow_none=True, allow_zero=True)
    if bound is not None and options.get("REPLICAS") is None:
        raise ImproperlyConfigured(
            "OPTIONS['MAX_REPLICA_LAG'] needs OPTIONS['REPLICAS']: it bounds the lag of "
            "their replicas"
        )
    return bound
