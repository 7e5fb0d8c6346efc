"""Shared helpers and fixtures of the MySQLCache test modules.

Tables are created once per session outside any test transaction (DDL commits whatever
transaction is open), so most tests can run inside pytest-django's rolled-back
transaction; the ones that need real commits use ``transaction=True``.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
from django.db import DEFAULT_DB_ALIAS, connections

from django_kvcache.backends.mysql import MySQLCache, now_ms  # noqa: F401  (re-exported)
from django_kvcache.mysql.server import forget_server

BACKEND = "django_kvcache.backends.mysql.MySQLCache"
TABLE = "kvcache_test"
MYISAM_TABLE = "kvcache_test_myisam"


def make_cache(table: str = TABLE, **params: Any) -> MySQLCache:
    """A MySQLCache on ``table`` (created if missing); no culling on writes unless asked."""
    options = {"CULL_PROBABILITY": 0, **params.pop("OPTIONS", {})}
    cache = MySQLCache(table, {**params, "OPTIONS": options})
    ensure_table(cache)
    return cache


def ensure_table(cache: MySQLCache) -> None:
    # CREATE TABLE commits any open transaction, even when the table exists: skip it then.
    if not cache.table_exists():
        cache.create_table()


def drop_table(table: str, alias: str = "default") -> None:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {connections[alias].ops.quote_name(table)}")


def sql(statement: str, params: Any = None, alias: str = "default") -> list[tuple]:
    """Run ``statement`` on the test database and return its rows."""
    with connections[alias].cursor() as cursor:
        cursor.execute(statement, params)
        return list(cursor.fetchall()) if cursor.description else []


def rows(table: str = TABLE) -> list[tuple]:
    """Every row of ``table`` as (cache_key, value, flags, expires), in key order."""
    columns = "`cache_key`, `value`, `flags`, `expires`"
    return sql(f"SELECT {columns} FROM `{table}` ORDER BY `cache_key`")


def insert_row(key: str, value: bytes, flags: int, expires: int, table: str = TABLE) -> None:
    """A row written behind the backend's back (expired, corrupt...)."""
    sql(f"INSERT INTO `{table}` VALUES (%s, %s, %s, %s)", (key, value, flags, expires))


def register_alias(alias: str, entry: dict[str, Any]) -> None:
    """Add a DATABASES entry at run time, with the defaults Django fills in at start-up."""
    connections.settings[alias] = connections.configure_settings({DEFAULT_DB_ALIAS: dict(entry)})[
        DEFAULT_DB_ALIAS
    ]


@contextmanager
def registered_alias(alias: str, entry: dict[str, Any], django_db_blocker: Any) -> Iterator[str]:
    """``alias`` defined for the block, database access allowed (a server of a test's own,
    or another view of one): the pytest-django blocker does not know run-time aliases."""
    register_alias(alias, entry)
    try:
        with django_db_blocker.unblock():
            yield alias
    finally:
        unregister_alias(alias)


def unregister_alias(alias: str) -> None:
    for connection in connections.all(initialized_only=True):
        if connection.alias == alias:  # this thread's; worker threads close their own
            connection.close()
            del connections[alias]
    del connections.settings[alias]
    forget_server(alias)


@pytest.fixture(scope="session")
def mysql_tables(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    with django_db_blocker.unblock():
        make_cache(TABLE)
        make_cache(MYISAM_TABLE, OPTIONS={"ENGINE": "MyISAM"})
        yield
        # A fault test may have left this thread's connection dead (server restarted).
        connections["default"].close()
        drop_table(TABLE)
        drop_table(MYISAM_TABLE)


@pytest.fixture
def cache(mysql_tables: None, db: None) -> Iterator[MySQLCache]:
    """A MySQLCache on an empty InnoDB table, inside the test's rolled-back transaction."""
    cache = make_cache()
    cache.clear()
    yield cache
    cache.clear()


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
