"""Tables and keys of the benchmarked caches: create, bulk-load, cull, clean up."""
from __future__ import annotations

import base64
import datetime
import pickle
from collections import defaultdict
from typing import Any, Iterable, Mapping

from django.core.cache.backends.base import BaseCache
from django.core.management.commands.createcachetable import Command as CreateCacheTable
from django.db import connections, transaction

from kvcache_bench.caches import CacheSpec

LOAD_CHUNK = 1000  # rows per multi-row INSERT / set_many while preloading


def create_storage(spec: CacheSpec, cache: BaseCache) -> None:
    """Create the cache's table (memcached and extra caches have none)."""
    if spec.table is None:
        return
    drop_storage(spec)
    if spec.family == "db":
        command = CreateCacheTable()
        command.verbosity = 0
        command.create_table(spec.database, spec.table, False)
    elif spec.family == "django-mysql":
        from django_mysql.cache import MySQLCache

        with connections[spec.database].cursor() as cursor:
            cursor.execute(MySQLCache.create_table_sql.format(table_name=spec.table))
    elif spec.family.startswith("kv-mysql"):
        cache.create_table()  # on every shard


def empty_storage(spec: CacheSpec, cache: BaseCache) -> None:
    """Start a scenario on an empty table (memcached is shared: never flushed)."""
    if spec.table is not None:
        cache.clear()


def drop_storage(spec: CacheSpec) -> None:
    """Drop the cache's tables (the run's own), on every database holding them: a
    MySQLCache's lock table and dictionary table too (``COMPRESS_DICTIONARY: "auto"``
    makes one)."""
    if spec.table is None:
        return
    tables = [spec.table]
    if spec.family.startswith("kv-mysql"):
        from django_kvcache.mysql.dictionaries import dictionary_table
        from django_kvcache.mysql.sql import lock_table

        tables += [lock_table(spec.table), dictionary_table(spec.table)]
    for database in spec.table_databases:
        connection = connections[database]
        with connection.cursor() as cursor:
            for table in tables:
                cursor.execute(f"DROP TABLE IF EXISTS {connection.ops.quote_name(table)}")


def count_rows(spec: CacheSpec) -> int:
    """Rows in the cache's table, over every database holding it."""
    rows = 0
    for database in spec.table_databases:
        connection = connections[database]
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT COUNT(*) FROM {connection.ops.quote_name(spec.table)}")
            rows += cursor.fetchone()[0]
    return rows


#: The key and value columns: the same names in DatabaseCache's, django-mysql's and our tables.
KEY_COLUMN, VALUE_COLUMN = "cache_key", "value"


def table_usage(spec: CacheSpec) -> dict[str, int | None]:
    """Rows, bytes in the key and value columns, and (MySQL) the table's data and index
    length from information_schema after ``ANALYZE TABLE`` refreshed them."""
    connection = connections[spec.database]
    table = connection.ops.quote_name(spec.table)
    cast = "CAST({} AS BLOB)" if connection.vendor == "sqlite" else "{}"  # SQLite counts characters
    lengths = " + ".join(f"LENGTH({cast.format(connection.ops.quote_name(column))})"
                         for column in (KEY_COLUMN, VALUE_COLUMN))
    usage: dict[str, int | None] = {"data_length": None, "index_length": None}
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*), COALESCE(SUM({lengths}), 0) FROM {table}")
        rows, column_bytes = cursor.fetchone()
        usage.update(rows=rows, column_bytes=int(column_bytes))
        if connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {table}")
            cursor.fetchall()
            cursor.execute("SELECT DATA_LENGTH, INDEX_LENGTH FROM information_schema.TABLES "
                           "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s", [spec.table])
            usage["data_length"], usage["index_length"] = cursor.fetchone()
    return usage


def bulk_load(spec: CacheSpec, cache: BaseCache, items: Mapping[str, Any]) -> None:
    """Write many entries fast: multi-row INSERTs for DatabaseCache (its ``set_many``
    is one ``set`` with a ``COUNT(*)`` per key), the cache's own ``set_many`` otherwise."""
    keys = list(items)
    for start in range(0, len(keys), LOAD_CHUNK):
        chunk = {key: items[key] for key in keys[start:start + LOAD_CHUNK]}
        if spec.family == "db":
            _insert_database_cache_rows(spec, cache, chunk)
        else:
            failed = cache.set_many(chunk)
            if failed:
                raise RuntimeError(f"{spec.name}: set_many failed for {len(failed)} keys")


def _insert_database_cache_rows(spec: CacheSpec, cache: BaseCache, items: Mapping[str, Any]) -> None:
    """Rows exactly as DatabaseCache writes them: base64 of the pickle, expiry in UTC."""
    connection = connections[spec.database]
    expires = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    expires = connection.ops.adapt_datetimefield_value(expires + datetime.timedelta(hours=1))
    rows = [
        (cache.make_key(key), base64.b64encode(pickle.dumps(value, pickle.HIGHEST_PROTOCOL)).decode("latin1"), expires)
        for key, value in items.items()
    ]
    table = connection.ops.quote_name(spec.table)
    with transaction.atomic(using=spec.database), connection.cursor() as cursor:
        cursor.executemany(f"INSERT INTO {table} (cache_key, value, expires) VALUES (%s, %s, %s)", rows)


def cull_once(spec: CacheSpec, cache: BaseCache, max_entries: int) -> None:
    """One cull of a table holding more than ``max_entries`` rows (it removes a third)."""
    cache._max_entries = max_entries
    if spec.family == "db":
        # DatabaseCache culls inside set(); _cull is the step it runs there.
        connection = connections[spec.database]
        now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        with transaction.atomic(using=spec.database), connection.cursor() as cursor:
            cache._cull(spec.database, cursor, now, count_rows(spec))
    else:
        cache.cull()


class WrittenKeys:
    """The keys each cache was given, so the ones without a table can be deleted at the end."""

    def __init__(self) -> None:
        self.keys: dict[str, set[str]] = defaultdict(set)

    def add(self, spec: CacheSpec, keys: Iterable[str]) -> None:
        if spec.table is None:
            self.keys[spec.name].update(keys)

    def forget(self, spec: CacheSpec, cache: BaseCache) -> None:
        keys = sorted(self.keys.pop(spec.name, ()))
        for start in range(0, len(keys), LOAD_CHUNK):
            cache.delete_many(keys[start:start + LOAD_CHUNK])


def clean_up(spec: CacheSpec, written: WrittenKeys) -> None:
    cache = spec.build()
    try:
        if spec.table is None:
            written.forget(spec, cache)
        else:
            drop_storage(spec)
    finally:
        cache.close()
