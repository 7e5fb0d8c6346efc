"""System checks for the kvcache entries of ``CACHES``.

* ``kvcache.W002`` a cache (either backend) leaves COMPRESSOR to its default while zstd
  is not installed, so it compresses with zlib and reads the zstd entries other
  processes write as misses;

* ``kvcache.E001`` one of the cache's databases (a shard, or a shard's replica) is not
  MySQL/MariaDB;
* ``kvcache.W003`` one of the cache's databases connects with the utf8mb3 character set
  (``"utf8"``: Django 4.2's default), on which keys with 4-byte characters (emoji) fail;
* ``kvcache.W001`` the table (or, with ``COMPRESS_DICTIONARY: "auto"``, its dictionary
  table), is missing in one of the cache's own databases; the message names which. Like Django's
  own database checks it needs a connection, so it runs only when the checks are given
  databases (``check --database <any alias>``, ``migrate``); then every MySQLCache's own
  aliases (``OPTIONS["DATABASE"]``, each of ``OPTIONS["DATABASES"]``, or the router's) are
  checked, whichever alias was named.
* ``kvcache.E002`` the table exists in one of the cache's own databases with another
  layout: django-mysql's, Django's DatabaseCache's, or another application's table of that
  name (every cache call would fail); the message says whose it looks like and the fix.
  Checked as W001 is, under ``--database``.
* ``kvcache.E010`` a cache whose ``OPTIONS["ENGINE"]`` is not InnoDB (MyISAM, Aria,
  MEMORY…) uses a Galera node (MariaDB Galera, Percona XtraDB Cluster): Galera replicates
  only InnoDB, so each node would keep a cache of its own. It needs a connection, as W001.

None of them imports a backend that no cache in CACHES names.

An invalid LOCATION or OPTIONS value is no check message: Django's own cache checks build
every cache in CACHES before these run, so ``check`` (and every command that runs the
checks) stops with the cache's ``ImproperlyConfigured``, which names the option.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from django.conf import settings
from django.core.cache import caches
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections

from django_kvcache.base import KVCache
from django_kvcache.configured import mysql_cache_aliases
from django_kvcache.zstd import INSTALL_HINT, zstd_engine

if TYPE_CHECKING:  # the MySQL backend is imported only by a site that configures it
    from django_kvcache.backends.mysql import MySQLCache


def all_databases(cache: MySQLCache) -> list[str]:
    """Every alias the cache talks to: each shard's primary, then the replicas."""
    return cache.database_aliases() + [shard.replica for shard in cache.shards if shard.replica]


@register(Tags.caches)
def check_mysql_caches(
    app_configs: Iterable[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    for alias in mysql_cache_aliases(importable=True):
        for database in all_databases(caches[alias]):
            vendor = connections[database].vendor
            if vendor == "mysql":
                continue
            messages.append(
                Error(
                    f"CACHES[{alias!r}] is a MySQLCache but its database {database!r} "
                    f"uses the {vendor!r} backend.",
                    hint="Point OPTIONS['DATABASE'] or OPTIONS['DATABASES'] (or your "
                    "database router) at MySQL or MariaDB connections.",
                    id="kvcache.E001",
                )
            )
    return messages


@register(Tags.caches, Tags.database)
def check_mysql_cache_tables(
    app_configs: Iterable[Any] | None = None,
    databases: Iterable[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    if not databases:  # no database access unless the caller allows it
        return []
    messages: list[CheckMessage] = []
    for alias in mysql_cache_aliases(importable=True):
        cache = caches[alias]
        for database in cache.database_aliases():
            if connections[database].vendor != "mysql":
                continue  # kvcache.E001
            missing = cache.missing_tables(database)
            problem = None if cache.table in missing else cache.table_layout_problem(database)
            if problem is not None:
                found, fix = problem
                messages.append(Error(found, hint=fix, id="kvcache.E002"))
            if not missing:
                continue
            names = " and ".join(repr(table) for table in missing)
            messages.append(
                Warning(
                    f"The table{'s' if len(missing) > 1 else ''} {names} of cache {alias!r} "
                    f"{'do' if len(missing) > 1 else 'does'} not exist in database "
                    f"{database!r}.",
                    hint="'manage.py migrate' creates it before migrating (or run "
                    f"'manage.py kvcache_createtable {alias}').",
                    id="kvcache.W001",
                )
            )
    return messages


@register(Tags.caches)
def check_default_compressor(
    app_configs: Iterable[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    if zstd_engine() is not None:
        return []
    return [
        Warning(
            f"CACHES[{alias!r}] compresses with zlib: its default compressor is zstd, "
            "which is not installed here.",
            hint=f"To compress with zstd, {INSTALL_HINT}. Until then entries other "
            "processes write with zstd read as misses here, and writes cost 3-4x the "
            "CPU. To keep zlib on purpose, set OPTIONS['COMPRESSOR'] to "
            "'django_kvcache.codec.ZlibCompressor'.",
            id="kvcache.W002",
        )
        for alias in settings.CACHES
        if isinstance(caches[alias], KVCache) and "COMPRESSOR" not in caches[alias].options
    ]


def is_galera_node(connection: Any) -> bool:
    """Whether the server behind ``connection`` is a node of a Galera cluster (wsrep_on)."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW GLOBAL VARIABLES LIKE 'wsrep_on'")
        row = cursor.fetchone()
    return row is not None and str(row[1]).upper() == "ON"


@register(Tags.caches, Tags.database)
def check_engine_on_galera(
    app_configs: Iterable[Any] | None = None,
    databases: Iterable[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    if not databases:  # no database access unless the caller allows it (as W001)
        return []
    messages: list[CheckMessage] = []
    for alias in mysql_cache_aliases(importable=True):
        cache = caches[alias]
        if cache.engine.lower() == "innodb":
            continue
        for database in all_databases(cache):
            if connections[database].vendor != "mysql" or not is_galera_node(connections[database]):
                continue
            messages.append(
                Error(
                    f"CACHES[{alias!r}] stores its entries in a {cache.engine} table, but "
                    f"its database {database!r} is a Galera node: Galera replicates only "
                    "InnoDB tables, so every node would keep a cache of its own.",
                    hint="Remove OPTIONS['ENGINE'] (InnoDB is the default) and recreate "
                    "the table with 'manage.py kvcache_createtable'.",
                    id="kvcache.E010",
                )
            )
    return messages


#: The names of MySQL's three-byte UTF-8 (no emoji, no characters outside the BMP).
UTF8MB3 = frozenset({"utf8", "utf8mb3"})


@register(Tags.caches)
def check_mysql_connection_charsets(
    app_configs: Iterable[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """``kvcache.W003``: the connection character set, as Django will connect (OPTIONS
    ``charset``, else the Django version's default) — read from settings, no connection."""
    messages: list[CheckMessage] = []
    for alias in mysql_cache_aliases(importable=True):
        for database in all_databases(caches[alias]):
            connection = connections[database]
            if connection.vendor != "mysql":
                continue  # kvcache.E001
            charset = connection.get_connection_params().get("charset")
            if charset not in UTF8MB3:
                continue
            messages.append(
                Warning(
                    f"CACHES[{alias!r}] is a MySQLCache on database {database!r}, which "
                    f"connects with the {charset!r} (utf8mb3) character set: a key with a "
                    "4-byte character (an emoji) fails with error 1366 or 1267.",
                    hint=f"Set DATABASES[{database!r}]['OPTIONS']['charset'] to 'utf8mb4' "
                    "(Django's default from 5.2).",
                    id="kvcache.W003",
                )
            )
    return messages
