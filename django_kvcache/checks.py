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
  checked, whichever alias was named. Inside ``manage.py migrate``, a table the same run
  is about to create (its ``pre_migrate`` receiver does) is no warning.
* ``kvcache.W004`` with ``MAX_SIZE``, the table exists in one of the cache's own
  databases without the generated columns and index the budget's estimate reads, or
  with the size table and triggers of the release that kept an exact total; the
  message lists what, ``kvcache_createtable`` or ``migrate`` upgrades it. Checked as
  W001 is.
* ``kvcache.E002`` the table exists in one of the cache's own databases with another
  layout: django-mysql's, Django's DatabaseCache's, or another application's table of that
  name (every cache call would fail); the message says whose it looks like and the fix.
  Checked as W001 is, under ``--database``.
* ``kvcache.E011`` a key of a cache's ``OPTIONS["ENCRYPTION_KEYS"]`` is too weak: text
  under 32 characters or with fewer than 10 distinct ones, bytes that are not random;
* ``kvcache.W011`` two caches keep their entries in the same place (a table in a
  database, a memcached node), and one has ENCRYPTION_KEYS while the other has none, or
  (with the same KEY_PREFIX) one writes with a key the other cannot read;
* ``kvcache.E010`` a cache whose ``OPTIONS["ENGINE"]`` is not InnoDB (MyISAM, Aria,
  MEMORY…) uses a Galera node (MariaDB Galera, Percona XtraDB Cluster): Galera replicates
  only InnoDB, so each node would keep a cache of its own. It needs a connection, as W001.

None of them imports a backend that no cache in CACHES names.

An invalid LOCATION or OPTIONS value is no check message: Django's own cache checks build
every cache in CACHES before these run, so ``check`` (and every command that runs the
checks) stops with the cache's ``ImproperlyConfigured``, which names the option. So does
ENCRYPTION_KEYS where cryptography is not installed: the message says what to install.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from django.conf import settings
from django.core.cache import caches
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections, router

from django_kvcache.base import KVCache
from django_kvcache.configured import mysql_cache_aliases
from django_kvcache.encryption import configured_keys, key_id_text, weak_key
from django_kvcache.maintenance import lives_in
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


#: The databases the running ``migrate`` creates the cache tables in before it migrates
#: (set by django_kvcache's ``migrate`` command around its checks).
_MIGRATING: ContextVar[tuple[str, ...]] = ContextVar("kvcache_migrating", default=())


@contextlib.contextmanager
def migrating(databases: Iterable[str]) -> Iterator[None]:
    """Around ``migrate`` on ``databases``: its ``pre_migrate`` receiver creates the
    missing tables there, so W001 does not tell the user to run what is running."""
    token = _MIGRATING.set(tuple(databases))
    try:
        yield
    finally:
        _MIGRATING.reset(token)


def created_by_this_migrate(cache: MySQLCache, database: str) -> bool:
    """Whether the running ``migrate`` is about to create the cache's tables in
    ``database`` (as ``maintenance.create_tables_in`` decides, routers included)."""
    return any(
        connections[migrated].vendor == "mysql" and lives_in(database, migrated)
        and router.allow_migrate_model(migrated, cache.cache_model_class)
        for migrated in _MIGRATING.get()
    )


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
            elif cache.table not in missing and not created_by_this_migrate(cache, database):
                messages += outdated_warnings(alias, cache, database)
            if not missing or created_by_this_migrate(cache, database):
                continue
            names = " and ".join(repr(table) for table in missing)
            several = len(missing) > 1
            messages.append(
                Warning(
                    f"The table{'s' if several else ''} {names} of cache {alias!r} "
                    f"{'do' if several else 'does'} not exist in database {database!r}.",
                    hint=f"'manage.py migrate' creates {'them' if several else 'it'} before "
                    f"migrating (or run 'manage.py kvcache_createtable {alias}').",
                    id="kvcache.W001",
                )
            )
    return messages


def outdated_warnings(alias: str, cache: Any, database: str) -> list[CheckMessage]:
    """kvcache.W004: the table in ``database`` lacks what MAX_SIZE's estimate reads."""
    outdated = cache.outdated_table(database)
    if not outdated:
        return []
    return [Warning(
        f"The table {cache.table!r} of cache {alias!r} in database {database!r} is outdated "
        f"for MAX_SIZE: {', '.join(outdated)}.",
        hint="'manage.py migrate' upgrades it before migrating (or run 'manage.py "
        f"kvcache_createtable {alias}'). Until then the budget is read from the old size "
        "table where there is one, else not enforced (docs/mysql.rst, \"Sizing\").",
        id="kvcache.W004",
    )]


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


def kvcaches() -> dict[str, KVCache]:
    """The kvcache caches of CACHES, by alias (built: Django's own checks built them)."""
    return {alias: caches[alias] for alias in settings.CACHES
            if isinstance(caches[alias], KVCache)}


@register(Tags.caches)
def check_encryption_keys(
    app_configs: Iterable[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """``kvcache.E011``: a weak key (never repeated in the message)."""
    messages: list[CheckMessage] = []
    for alias, cache in kvcaches().items():
        for index, key in enumerate(configured_keys(cache.options) or []):
            why = weak_key(key)
            if why is None:
                continue
            messages.append(
                Error(
                    f"CACHES[{alias!r}]['OPTIONS']['ENCRYPTION_KEYS'][{index}] {why}: too "
                    "weak to encrypt the cache's entries with.",
                    hint="Generate a key with: python -c \"import secrets; "
                    "print(secrets.token_urlsafe(32))\" and read it from the environment.",
                    id="kvcache.E011",
                )
            )
    return messages


@register(Tags.caches)
def check_shared_encryption(
    app_configs: Iterable[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """``kvcache.W011``: caches in one place whose ENCRYPTION_KEYS do not agree."""
    messages: list[CheckMessage] = []
    found = list(kvcaches().items())
    for number, (alias, cache) in enumerate(found):
        for other_alias, other in found[number + 1:]:
            shared = cache.storage() & other.storage()
            if not shared:
                continue
            problem = _encryption_mismatch(alias, cache, other_alias, other)
            if problem is None:
                continue
            messages.append(
                Warning(
                    f"CACHES[{alias!r}] and CACHES[{other_alias!r}] keep their entries in "
                    f"the same place ({sorted(shared)[0]}), but {problem}",
                    hint="Give caches that share a table or memcached nodes the same "
                    "OPTIONS['ENCRYPTION_KEYS'] (or put the unencrypted one elsewhere).",
                    id="kvcache.W011",
                )
            )
    return messages


def _encryption_mismatch(alias: str, cache: KVCache, other_alias: str, other: KVCache) -> str | None:
    mine, theirs = cache.codec.encryption, other.codec.encryption
    if mine is None and theirs is None:
        return None
    if mine is None or theirs is None:
        plain = alias if mine is None else other_alias
        return (
            f"only one of them has ENCRYPTION_KEYS: CACHES[{plain!r}] stores its entries "
            "unencrypted where the other's are encrypted, readable by anyone who can read "
            "the other's ciphertext, and each reads the other's entries as misses."
        )
    if cache.key_prefix != other.key_prefix:
        return None  # separate entries, each cache's own readable by itself alone
    for writer, reader, writer_alias, reader_alias in (
        (mine, theirs, alias, other_alias), (theirs, mine, other_alias, alias)
    ):
        if writer.writer_id not in reader.key_ids:
            return (
                f"CACHES[{writer_alias!r}] encrypts with key id "
                f"{key_id_text(writer.writer_id)}, which is not among CACHES[{reader_alias!r}]'s "
                "ENCRYPTION_KEYS: what one writes, the other reads as a miss."
            )
    return None
