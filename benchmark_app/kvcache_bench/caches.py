"""Which caches the benchmark compares, how to build them, and why one is skipped.

Every benchmarked cache gets its own table and key prefix carrying the run's token, so
two runs (or a run and the test suite) sharing the servers never see each other's
entries; tables are dropped and memcached keys deleted when the run ends.

Two ways to choose them. The project's own benchmark (``make bench``) builds every cache
it knows on the servers ``scripts/services.py`` starts (``candidates``). In a site that
adds ``kvcache_bench`` to INSTALLED_APPS, ``--caches ALIAS,...`` names caches of its
CACHES (``site_selection``): each is measured as configured — its BACKEND, LOCATION
and OPTIONS — under the run's own KEY_PREFIX, a MySQLCache in a table of the run's own;
beside it Django's DatabaseCache in a table of its own (on the database the site's
routers give it) and Django's PyMemcacheCache on the same memcached LOCATION. Nothing
of the site's is cleared or flushed: the run deletes the keys it wrote and drops its
tables.
"""
from __future__ import annotations

import fnmatch
import importlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from django.conf import settings
from django.core.cache.backends.base import BaseCache
from django.db import connections, router
from django.utils.module_loading import import_string

from django_kvcache.configured import loaded_class
from kvcache_bench.routers import SQLITE_TABLE_PREFIX
from kvcache_bench.servers import redis_answers

#: The cache every other one is compared with, and the fallback when it is skipped.
REFERENCE_CACHES = ("db-mariadb", "db-sqlite")
#: High enough that no benchmarked write triggers a cull; the rows scenario culls on purpose.
MAX_ENTRIES = 10_000_000
TIMEOUT = 900  # leftovers of a crashed run expire on their own
#: A site's MySQLCache over several shards (OPTIONS["DATABASES"]) is "kv-mysql-sharded".
TABLE_FAMILIES = ("db", "kv-mysql", "kv-mysql-sharded", "django-mysql")
MEMCACHED_FAMILIES = ("kv-memcached", "pymemcache")
#: Django's RedisCache, on the Redis ``services.py up`` starts: what most sites pick instead of
#: memcached, measured beside it in the ops and async scenarios only.
REDIS = "redis"
NODE_COUNTS = (1, 4, 8)
#: Ours, and the cache it is compared with where the figure is not a time (bytes, entries).
PEERS = {"kv-mysql-innodb": "django-mysql", "kv-mysql-myisam": "django-mysql",
         "kv-memcached": "pymemcache"}

KV_MYSQL = "django_kvcache.backends.mysql.MySQLCache"
KV_MEMCACHED = "django_kvcache.backends.memcached.MemcachedCache"
DJANGO_DB = "django.core.cache.backends.db.DatabaseCache"
DJANGO_PYMEMCACHE = "django.core.cache.backends.memcached.PyMemcacheCache"
DJANGO_MYSQL = "django_mysql.cache.MySQLCache"
DJANGO_REDIS = "django.core.cache.backends.redis.RedisCache"


@dataclass(frozen=True)
class CacheSpec:
    """Everything needed to build one benchmarked cache, in any thread or process."""

    name: str
    description: str
    family: str
    backend: str
    location: Any
    key_prefix: str
    options: dict[str, Any] = field(default_factory=dict)
    database: str | None = None  # alias holding the table of a table-backed cache
    databases: tuple[str, ...] = ()  # every alias holding it (a sharded MySQLCache)

    @property
    def table_databases(self) -> tuple[str, ...]:
        """The aliases whose database holds this cache's table."""
        return self.databases or ((self.database,) if self.database else ())

    @property
    def table(self) -> str | None:
        return self.location if self.family in TABLE_FAMILIES else None

    def build(self) -> BaseCache:
        params = {"TIMEOUT": TIMEOUT, "KEY_PREFIX": self.key_prefix, "OPTIONS": dict(self.options)}
        return import_string(self.backend)(self.location, params)


@dataclass
class Selection:
    caches: list[CacheSpec]
    skipped: dict[str, str]  # cache name -> why it did not run


def reference_of(specs: Iterable[CacheSpec]) -> str | None:
    """The cache the others are compared with: DatabaseCache on MariaDB, else on SQLite,
    else (a site's run) the first DatabaseCache."""
    specs = list(specs)
    names = {spec.name for spec in specs}
    found = next((name for name in REFERENCE_CACHES if name in names), None)
    return found or next((spec.name for spec in specs if spec.family == "db"), None)


def importable(module: str) -> str | None:
    """None when ``module`` imports, else a note saying why not."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{module} is not importable ({exc})"
    return None


def database_problem(alias: str) -> str | None:
    try:
        connections[alias].ensure_connection()
    except Exception as exc:  # any driver error means "no server to benchmark"
        return f"database {alias!r} is not reachable: {exc}"
    return None


def candidates(token: str, nodes: list[str]) -> list[tuple[CacheSpec, list[str | None]]]:
    """Every cache the benchmark knows, each with the checks that must pass (None = ok)."""
    mariadb = database_problem("default")
    found: list[tuple[CacheSpec, list[str | None]]] = []

    def add_table_cache(name: str, description: str, family: str, backend: str, table: str,
            problems: list[str | None], database: str, options: dict[str, Any] | None = None) -> None:
        options = {"MAX_ENTRIES": MAX_ENTRIES, **(options or {})}
        spec = CacheSpec(name, description, family, backend, table, key_prefix=f"kvb-{token}-{name}",
                         options=options, database=database)
        found.append((spec, problems))

    add_table_cache("db-mariadb", "Django DatabaseCache on MariaDB", "db", DJANGO_DB,
        f"kvbench_{token}_db", [mariadb], database="default")
    add_table_cache("db-sqlite", "Django DatabaseCache on SQLite", "db", DJANGO_DB,
        f"{SQLITE_TABLE_PREFIX}{token}", [database_problem("sqlite")], database="sqlite")
    for engine in ("InnoDB", "MyISAM"):
        add_table_cache(f"kv-mysql-{engine.lower()}", f"kvcache MySQLCache, {engine} table", "kv-mysql",
            KV_MYSQL, f"kvbench_{token}_{engine.lower()}",
            [importable("django_kvcache.backends.mysql"), mariadb],
            options={"ENGINE": engine, "DATABASE": "default"}, database="default")
    add_table_cache("django-mysql", "django-mysql MySQLCache", "django-mysql", DJANGO_MYSQL,
        f"kvbench_{token}_djmysql", [importable("django_mysql.cache"), mariadb],
        database="default")
    for family in MEMCACHED_FAMILIES:
        module = "django_kvcache.backends.memcached" if family == "kv-memcached" else "pymemcache"
        for count in NODE_COUNTS:
            short = None if len(nodes) >= count else (
                f"needs {count} memcached nodes, {len(nodes)} available")
            found.append((memcached_spec(family, token, nodes, count), [importable(module), short]))
    found.append((redis_spec(token), [importable("redis"), redis_problem()]))
    return found


def redis_spec(token: str) -> CacheSpec:
    """Django's RedisCache (redis-py, hiredis's parser when installed) on the benchmark's Redis."""
    return CacheSpec(REDIS, "Django RedisCache, 1 server", REDIS, DJANGO_REDIS,
                     f"redis://{getattr(settings, 'REDIS', '')}", key_prefix=f"kvb-{token}-{REDIS}")


def redis_problem() -> str | None:
    """Why the benchmark's Redis cannot be used, or None."""
    address = getattr(settings, "REDIS", "")
    if not address:
        return "no Redis configured (KVCACHE_REDIS is empty)"
    if not redis_answers(address):
        return f"no Redis answers on {address} (scripts/services.py up starts one)"
    return None


def memcached_spec(family: str, token: str, nodes: list[str], count: int) -> CacheSpec:
    """Our MemcachedCache ("kv-memcached") or Django's PyMemcacheCache on the first nodes."""
    name = f"{family}-{count}"
    if family == "kv-memcached":
        description, backend = f"kvcache MemcachedCache, {count} node(s)", KV_MEMCACHED
    else:
        description, backend = f"Django PyMemcacheCache, {count} node(s)", DJANGO_PYMEMCACHE
    return CacheSpec(name, description, family, backend, nodes[:count],
                     key_prefix=f"kvb-{token}-{name}")


def extra_spec(token: str, definition: str) -> CacheSpec:
    """A cache from ``--extra-cache NAME=dotted.Backend[@LOCATION]`` (ops scenario only)."""
    name, sep, rest = definition.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--extra-cache wants NAME=dotted.path.Backend[@LOCATION], got {definition!r}")
    backend, _, location = rest.partition("@")
    return CacheSpec(name, f"extra cache {backend}", "extra", backend, location or name,
                     key_prefix=f"kvb-{token}-{name}")


def select(token: str, nodes: list[str], patterns: Iterable[str] | None,
           extras: Iterable[str] = ()) -> Selection:
    """The caches matching ``patterns`` (fnmatch, all when empty) that can run here."""
    patterns = list(patterns or ["*"])
    selection = Selection(caches=[], skipped={})
    for spec, problems in candidates(token, nodes):
        if not any(fnmatch.fnmatch(spec.name, pattern) for pattern in patterns):
            continue
        notes = [problem for problem in problems if problem]
        if notes:
            selection.skipped[spec.name] = "; ".join(notes)
        else:
            selection.caches.append(spec)
    for definition in extras:
        spec = extra_spec(token, definition)
        problem = importable(spec.backend.rpartition(".")[0])
        if problem:
            selection.skipped[spec.name] = problem
        else:
            selection.caches.append(spec)
    return selection


def node_count_needed(patterns: Iterable[str] | None) -> int:
    """How many memcached nodes the selected caches need (the nodes scenario asks separately)."""
    patterns = list(patterns or ["*"])
    wanted = [
        count for count in NODE_COUNTS for family in MEMCACHED_FAMILIES
        if any(fnmatch.fnmatch(f"{family}-{count}", pattern) for pattern in patterns)
    ]
    return max(wanted, default=0)


def memcached_families(specs: Iterable[CacheSpec]) -> list[str]:
    """The memcached clients ("kv-memcached", "pymemcache") among ``specs``."""
    present = {spec.family for spec in specs}
    return [family for family in MEMCACHED_FAMILIES if family in present]


def add_peer_ratios(results: list[dict[str, Any]], metric: str, subject: str = "cache") -> None:
    """``vs_peer``: this cache's ``metric`` over its peer's (django-mysql, PyMemcacheCache)."""
    by_subject = {entry[subject]: entry[metric] for entry in results}
    for entry in results:
        peer = PEERS.get(entry[subject])
        base = by_subject.get(peer)
        entry["peer"] = peer if base else None
        entry["vs_peer"] = round(entry[metric] / base, 3) if base else None


# --- a site's own caches (``--caches ALIAS,...`` in a site with kvcache_bench installed) --


def is_site_run(names: Iterable[str] | None) -> bool:
    """Whether the run measures the site's CACHES: outside the project's benchmark
    settings always, inside them when every name given is a CACHES alias."""
    names = list(names or [])
    if not getattr(settings, "KVCACHE_BENCH_PROJECT", False):
        return True
    return bool(names) and all(name in settings.CACHES for name in names)


def site_aliases(names: Iterable[str] | None) -> list[str]:
    """The CACHES aliases to measure: those named, else every kvcache cache.

    Raises ValueError naming what is not an alias of CACHES."""
    names = list(names or [])
    unknown = [name for name in names if name not in settings.CACHES]
    if unknown:
        raise ValueError(
            f"--caches names no cache of CACHES: {', '.join(unknown)} (CACHES has "
            f"{', '.join(settings.CACHES)})"
        )
    if names:
        return names
    found = [alias for alias in settings.CACHES if _backend(alias)[1] in ("mysql", "memcached")]
    if not found:
        raise ValueError("CACHES has no django-kvcache cache: name the caches with --caches")
    return found


def _backend(alias: str) -> tuple[str, str]:
    """The dotted BACKEND of CACHES[alias] and what it is: "mysql", "memcached" (kvcache's
    backends or subclasses) or "other"."""
    path = settings.CACHES[alias]["BACKEND"]
    try:
        backend = import_string(path)
    except ImportError:
        return path, "other"
    for kind, base in (("mysql", KV_MYSQL), ("memcached", KV_MEMCACHED)):
        # Importing ``backend`` imported its kvcache base: one not loaded is none of its
        # bases (and importing it would need that backend's extra).
        found = loaded_class(*base.rsplit(".", 1))
        if found is not None and isinstance(backend, type) and issubclass(backend, found):
            return path, kind
    return path, "other"


def _slug(alias: str) -> str:
    """``alias`` as it may appear in a table name and a memcached key."""
    return "".join(c if c.isalnum() else "_" for c in alias)[:24]


def site_selection(token: str, aliases: Sequence[str]) -> Selection:
    """The site's caches ``aliases`` as configured, each with Django's own beside it."""
    from django.core.cache import caches

    selection = Selection(caches=[], skipped={})
    for alias in aliases:
        path, kind = _backend(alias)
        entry = settings.CACHES[alias]
        options = dict(entry.get("OPTIONS") or {})
        slug = _slug(alias)
        if kind == "mysql":
            shards = tuple(caches[alias].database_aliases())
            table = f"kvbench_{token}_{slug}"
            selection.caches.append(CacheSpec(
                alias, f"{alias}: {path.rpartition('.')[2]} as configured, in a table of its own",
                "kv-mysql" if len(shards) == 1 else "kv-mysql-sharded", path, table,
                key_prefix=f"kvb-{token}-{slug}", options=options, database=shards[0],
                databases=shards if len(shards) > 1 else ()))
            selection.caches.append(site_database_cache(token, alias, slug, shards[0]))
        elif kind == "memcached":
            selection.caches.append(CacheSpec(
                alias, f"{alias}: {path.rpartition('.')[2]} as configured", "kv-memcached", path,
                entry.get("LOCATION"), key_prefix=f"kvb-{token}-{slug}", options=options))
            peer, problem = site_pymemcache(token, alias, slug, entry.get("LOCATION"), options)
            if problem:
                selection.skipped[peer.name] = problem
            else:
                selection.caches.append(peer)
        else:  # any other backend: the operations only, under the run's own prefix
            selection.caches.append(CacheSpec(
                alias, f"{alias}: {path}", "extra", path, entry.get("LOCATION", ""),
                key_prefix=f"kvb-{token}-{slug}", options=options))
    return selection


def site_database_cache(token: str, alias: str, slug: str, beside: str) -> CacheSpec:
    """Django's DatabaseCache in a table of the run's own, where the site's routers put
    it (the alias a DatabaseCache of that table writes to)."""
    table = f"kvbench_{token}_{slug}_db"
    model = import_string(DJANGO_DB)(table, {}).cache_model_class
    database = router.db_for_write(model)
    same = _same_database(database, beside)
    where = f"database {database!r}" + ("" if same else f", not {beside!r} (the site's routers)")
    return CacheSpec(f"{alias}-databasecache", f"Django DatabaseCache on {where}", "db",
                     DJANGO_DB, table, key_prefix=f"kvb-{token}-{slug}-db",
                     options={"MAX_ENTRIES": MAX_ENTRIES}, database=database)


def _same_database(one: str, other: str) -> bool:
    a, b = connections[one].settings_dict, connections[other].settings_dict
    return all(a.get(name) == b.get(name) for name in ("ENGINE", "HOST", "PORT", "NAME"))


def site_pymemcache(token: str, alias: str, slug: str, location: Any,
                    options: dict[str, Any]) -> tuple[CacheSpec, str | None]:
    """Django's PyMemcacheCache on the same servers, and why it cannot run, if it cannot."""
    spec = CacheSpec(f"{alias}-pymemcache", "Django PyMemcacheCache on the same LOCATION",
                     "pymemcache", DJANGO_PYMEMCACHE, location,
                     key_prefix=f"kvb-{token}-{slug}-pm")
    problem = importable("pymemcache")
    if problem is None and options.get("TLS"):
        problem = "the cache uses TLS, which this comparison does not set up"
    return spec, problem


def memcached_locations(specs: Iterable[CacheSpec]) -> list[str]:
    """The memcached servers of a site's caches (for the run's description)."""
    found: list[str] = []
    for spec in specs:
        if spec.family in MEMCACHED_FAMILIES:
            location = spec.location
            servers = location if isinstance(location, (list, tuple)) else [
                part.strip() for part in str(location).replace(";", ",").split(",")]
            found += [server for server in servers if server and server not in found]
    return found
