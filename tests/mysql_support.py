"""Shared helpers of the MySQLCache test modules: building caches on the test database."""
from __future__ import annotations

from typing import Any

from django.db import connections

from django_kvcache.backends.mysql import MySQLCache

BACKEND = "django_kvcache.backends.mysql.MySQLCache"
TABLE = "kvcache_test"


def make_cache(table: str = TABLE, **params: Any) -> MySQLCache:
    """A MySQLCache on ``table`` (created if missing); OPTIONS default to no write-path culling."""
    params.setdefault("OPTIONS", {"CULL_PROBABILITY": 0})
    cache = MySQLCache(table, params)
    ensure_table(cache)
    return cache


def ensure_table(cache: MySQLCache) -> None:
    # CREATE TABLE commits any open transaction, even when the table exists: skip it then.
    if not cache.table_exists():
        cache.create_table()


def drop_table(table: str, alias: str = "default") -> None:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {connections[alias].ops.quote_name(table)}")


def rows(table: str = TABLE, alias: str = "default") -> list[tuple]:
    """Every row of ``table``, in key order, straight from SQL."""
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT `cache_key`, `value`, `flags`, `expires` FROM "
            f"{connections[alias].ops.quote_name(table)} ORDER BY `cache_key`"
        )
        return list(cursor.fetchall())
