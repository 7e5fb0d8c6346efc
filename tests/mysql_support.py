"""Shared helpers and fixtures of the MySQLCache test modules.

The cache writes on connections of its own, in autocommit mode: a test's rolled-back
transaction (pytest-django's ``db``) does not undo them, so the ``cache`` fixture empties
the table before and after each test. ``sql()`` runs a statement the same way (on the
cache's own connections, committed at once), so a row written behind the backend's back
is visible to it and locks nothing.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
from django.db import DEFAULT_DB_ALIAS, connections

from django_kvcache.backends.mysql import MySQLCache, now_ms  # noqa: F401  (re-exported)
from django_kvcache.mysql import blocking, connection
from django_kvcache.mysql.server import forget_server
from django_kvcache.mysql.tables import STATEMENT_SEPARATOR

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
    blocking.query(alias, f"DROP TABLE IF EXISTS {connections[alias].ops.quote_name(table)}")


def sql(statement: str, params: Any = None, alias: str = "default") -> list[tuple]:
    """Run ``statement`` on the test database (committed at once) and return its rows."""
    return blocking.query(alias, statement, params)


def drop_cache_tables(cache: MySQLCache) -> None:
    """The cache's tables dropped, one statement at a time (as the cache's connections
    take them)."""
    for statement in cache.drop_table_sql().split(STATEMENT_SEPARATOR):
        sql(statement)


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
    blocking.retire_pools([alias])


@pytest.fixture(scope="session")
def mysql_tables(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    with django_db_blocker.unblock():
        make_cache(TABLE)
        make_cache(MYISAM_TABLE, OPTIONS={"ENGINE": "MyISAM"})
        yield
        drop_table(TABLE)
        drop_table(MYISAM_TABLE)


@pytest.fixture
def cache(mysql_tables: None, db: None) -> Iterator[MySQLCache]:
    """A MySQLCache on an empty InnoDB table (its writes commit whatever the test's
    transaction does: emptied before and after)."""
    cache = make_cache()
    cache.clear()
    yield cache
    cache.clear()


@contextmanager
def sent_statements(alias: str | None = None) -> Iterator[list[str]]:
    """The statements the cache sends (on its own connections, either driver) while the
    block runs, in order, as sent (parameters in place); with ``alias``, only those sent
    to that database alias."""
    sent: list[str] = []

    def recording(before: Callable[..., bytes]) -> Callable[..., bytes]:
        def record(raw: Any, statement: str, params: Any) -> bytes:
            sent_bytes = before(raw, statement, params)
            if alias is None or connection.alias_of(raw) == alias:
                sent.append(sent_bytes.decode(raw.encoding, "replace"))
            return sent_bytes

        return record

    with pytest.MonkeyPatch.context() as patch:  # (around another recording block's, if any)
        patch.setattr(connection, "statement_bytes", recording(connection.statement_bytes))
        yield sent


def in_another_thread(call: Callable[[], Any]) -> Any:
    """``call()``'s result (or exception) from another thread: one whose READ_YOUR_WRITES
    window this thread's writes did not open, nor its writes this thread's."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((call(), None))
        except BaseException as exc:  # handed to the caller
            outcome.append((None, exc))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
