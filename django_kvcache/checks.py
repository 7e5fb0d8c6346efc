"""System checks for the MySQLCache entries of ``CACHES``.

* ``kvcache.E001`` the cache's database is not MySQL/MariaDB;
* ``kvcache.W001`` the table is missing in the cache's own database. Like Django's own
  database checks it needs a connection, so it runs only when the checks are given
  databases (``check --database <any alias>``, ``migrate``); then every MySQLCache's own
  alias (``OPTIONS["DATABASE"]`` or the router's) is checked, whichever alias was named.

An invalid LOCATION or OPTIONS value is no check message: Django's own cache checks build
every cache in CACHES before these run, so ``check`` (and every command that runs the
checks) stops with the cache's ``ImproperlyConfigured``, which names the option.
"""
from __future__ import annotations

from typing import Any, Iterable

from django.core.cache import caches
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections

from django_kvcache.backends.mysql import mysql_cache_aliases


@register(Tags.caches)
def check_mysql_caches(
    app_configs: Iterable[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    for alias in mysql_cache_aliases():
        database = caches[alias].db_alias(write=True)
        vendor = connections[database].vendor
        if vendor != "mysql":
            messages.append(
                Error(
                    f"CACHES[{alias!r}] is a MySQLCache but its database {database!r} "
                    f"uses the {vendor!r} backend.",
                    hint="Point OPTIONS['DATABASE'] (or your database router) at a MySQL "
                    "or MariaDB connection.",
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
    for alias in mysql_cache_aliases():
        cache = caches[alias]
        database = cache.db_alias(write=True)
        if connections[database].vendor != "mysql":
            continue  # kvcache.E001
        if not cache.table_exists():
            messages.append(
                Warning(
                    f"The table {cache.table!r} of cache {alias!r} does not exist in "
                    f"database {database!r}.",
                    hint=f"Run 'manage.py kvcache_createtable {alias}' (or save the output "
                    "of 'manage.py kvcache_migration' as a migration).",
                    id="kvcache.W001",
                )
            )
    return messages
