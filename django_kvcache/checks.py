"""System checks for the MySQLCache entries of ``CACHES``.

* ``kvcache.E001`` the cache's database is not MySQL/MariaDB;
* ``kvcache.E002`` the cache cannot be created (an invalid LOCATION or OPTIONS value);
* ``kvcache.W001`` the table is missing (only with ``check --database``, or during
  ``migrate``: like Django's own database checks it needs a connection).
"""
from __future__ import annotations

from typing import Any, Iterable

from django.core.cache import caches
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from django_kvcache.mysql.maintenance import is_mysql_cache


def _mysql_cache_aliases() -> list[str]:
    from django.conf import settings

    return [alias for alias in settings.CACHES if is_mysql_cache(alias)]


@register(Tags.caches)
def check_mysql_caches(
    app_configs: Iterable[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    for alias in _mysql_cache_aliases():
        try:
            cache = caches[alias]
        except ImproperlyConfigured as exc:
            messages.append(Error(f"CACHES[{alias!r}]: {exc}", id="kvcache.E002"))
            continue
        database = cache.db_alias(write=True)
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
    if not databases:
        return []
    messages: list[CheckMessage] = []
    for alias in _mysql_cache_aliases():
        try:
            cache = caches[alias]
        except ImproperlyConfigured:
            continue  # reported by check_mysql_caches
        database = cache.db_alias(write=True)
        if database not in databases or connections[database].vendor != "mysql":
            continue
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
