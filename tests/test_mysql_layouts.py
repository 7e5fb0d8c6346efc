"""A MySQLCache pointed at a table of another layout: django-mysql's, Django's
DatabaseCache's, or some other application's. ``check --database``, every cache call
(both APIs) and ``kvcache_createtable`` name the table, whose layout it looks like and
the fix, instead of "table exists" and a bare ``Unknown column 'flags'``."""
from __future__ import annotations

import asyncio
from io import StringIO
from typing import Iterator

import pytest
from django.core.cache import caches
from django.core.management import CommandError, call_command
from django.conf import settings
from django.db import ProgrammingError, connections
from django.test import override_settings

from django_kvcache.checks import check_mysql_cache_tables
from django_kvcache.mysql import layouts
from tests.mysql_support import BACKEND, drop_table, registered_alias, sql
from tests.slow_reply_proxy import SlowReplyProxy

TABLE = "kvcache_other_layout"
LAYOUTS = {
    # django-mysql's MySQLCache table (its cache migration / mysql_cache_migration)
    "django-mysql": (
        f"CREATE TABLE `{TABLE}` (cache_key varchar(255) CHARACTER SET utf8mb4 COLLATE "
        "utf8mb4_bin NOT NULL PRIMARY KEY, value longblob NOT NULL, value_type char(1) "
        "CHARACTER SET latin1 COLLATE latin1_bin NOT NULL DEFAULT 'p', expires BIGINT "
        "UNSIGNED NOT NULL, KEY expires (expires))",
        "django-mysql's MySQLCache table (columns cache_key, value, value_type, expires)",
    ),
    # Django's createcachetable
    "databasecache": (
        f"CREATE TABLE `{TABLE}` (cache_key varchar(255) NOT NULL PRIMARY KEY, value "
        "longtext NOT NULL, expires datetime(6) NOT NULL)",
        "Django's DatabaseCache table (columns cache_key, value, expires)",
    ),
    # a cache table, of some other layout (an older one, say)
    "cache-like": (
        f"CREATE TABLE `{TABLE}` (cache_key varchar(250) NOT NULL PRIMARY KEY, value "
        "longblob NOT NULL, flags int unsigned NOT NULL)",
        "a cache table of another layout (columns cache_key, value, flags)",
    ),
    "other": (
        f"CREATE TABLE `{TABLE}` (id int NOT NULL PRIMARY KEY, name varchar(20))",
        "not a cache table (columns id, name)",
    ),
}
FIX = (
    "Give the cache a table of its own: another LOCATION, then 'manage.py "
    "kvcache_createtable legacy' (entries are not carried over: docs/mysql.rst, "
    "\"Coming from DatabaseCache or django-mysql\")."
)


@pytest.fixture(params=list(LAYOUTS))
def layout(request, django_db_blocker) -> Iterator[str]:
    """The table, made in the test database with another layout; the cache "legacy" on it."""
    statement, described = LAYOUTS[request.param]
    layouts._read.clear()  # each test's table is new: what an earlier one read is not it
    with django_db_blocker.unblock():
        drop_table(TABLE)
        with connections["default"].cursor() as cursor:
            cursor.execute(statement)
        configured = {"BACKEND": BACKEND, "LOCATION": TABLE}
        with override_settings(CACHES={"default": {"BACKEND": BACKEND, "LOCATION": "kvcache_ok"},
                                       "legacy": configured}):
            try:
                yield described
            finally:
                drop_table(TABLE)
                drop_table(TABLE + "_locks")  # none is made beside another's table


def message(described: str) -> str:
    return (
        f"The table '{TABLE}' of cache 'legacy' in database 'default' is {described}, not "
        "a django-kvcache table (columns cache_key, value, flags, expires). " + FIX
    )


@pytest.mark.django_db(transaction=True)
def test_check_database_reports_the_layout(layout):
    errors = [m for m in check_mysql_cache_tables(databases=["default"]) if m.id == "kvcache.E002"]
    assert [(e.msg, e.hint) for e in errors] == [(message(layout).split(". Give")[0] + ".",
                                                  FIX)]
    assert check_mysql_cache_tables() == []  # no database access unless allowed


@pytest.mark.django_db(transaction=True)
def test_every_call_names_the_table_and_the_fix(layout):
    cache = caches["legacy"]
    for call in (lambda: cache.get("k"), lambda: cache.set("k", 1),
                 lambda: cache.get_many(["a", "b"]), lambda: cache.incr("n")):
        with pytest.raises(ProgrammingError) as raised:
            call()
        assert str(raised.value) == message(layout)
        assert type(raised.value).__name__ == "CacheTableLayout"


@pytest.mark.django_db(transaction=True)
def test_the_async_api_says_the_same(layout):
    async def aget() -> str:
        try:
            await caches["legacy"].aget("k")
        except ProgrammingError as exc:
            return str(exc)
        return "no error"

    assert asyncio.run(aget()) == message(layout)


@pytest.mark.django_db(transaction=True)
def test_a_lock_says_the_same_instead_of_naming_the_missing_lock_table(layout):
    """No lock table is made beside another library's table (kvcache_createtable refuses
    to), so a lock meets a missing lock table: the error names the real problem and its
    fix, on both APIs, not the lock table and a command that refuses."""
    with pytest.raises(ProgrammingError) as raised:
        caches["legacy"].lock("job", timeout=10).acquire()
    assert (type(raised.value).__name__, str(raised.value)) == ("CacheTableLayout",
                                                                message(layout))

    async def acquire() -> str:
        try:
            await caches["legacy"].alock("job", timeout=10).acquire()
        except ProgrammingError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    layouts._read.clear()  # asked again, on the event loop
    assert asyncio.run(acquire()) == f"CacheTableLayout: {message(layout)}"


SLOW = "kvcache_slow_columns"
#: How late the answer to a question for a table's columns comes.
DELAY = 1.0


@pytest.fixture
def slow_columns(django_db_blocker) -> Iterator[SlowReplyProxy]:
    """The test database as alias SLOW, behind a proxy that answers every question for a
    table's columns (information_schema) DELAY seconds late."""
    proxy = SlowReplyProxy(settings.MYSQL["HOST"], int(settings.MYSQL["PORT"]))
    proxy.delay_replies_to(b"information_schema", DELAY)
    entry = {**connections["default"].settings_dict, "HOST": "127.0.0.1",
             "PORT": str(proxy.port), "TEST": {}}
    try:
        with registered_alias(SLOW, entry, django_db_blocker):
            yield proxy
    finally:
        proxy.stop()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("layout", ["django-mysql"], indirect=True)
@pytest.mark.parametrize("call", ["aget", "alock"])
def test_the_async_api_reads_the_columns_without_blocking_the_loop(layout, slow_columns, call):
    """The columns of the table met are read on the event loop's own connections: while
    their answer is late, the loop goes on (a ticker every 10 ms never waits long)."""
    configured = {"BACKEND": BACKEND, "LOCATION": TABLE, "OPTIONS": {"DATABASE": SLOW}}

    async def measured() -> tuple[str, float, float]:
        loop = asyncio.get_running_loop()
        gaps: list[float] = []
        running = [True]

        async def tick() -> None:
            last = loop.time()
            while running[0]:
                await asyncio.sleep(0.01)
                now = loop.time()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        started = loop.time()
        try:
            if call == "aget":
                await caches["legacy"].aget("k")
            else:
                await caches["legacy"].alock("job", timeout=10).acquire()
            outcome = "no error"
        except ProgrammingError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        took = loop.time() - started
        running[0] = False
        await ticker
        return outcome, took, max(gaps)

    with override_settings(CACHES={"legacy": configured}):
        outcome, took, longest_gap = asyncio.run(measured())
    assert outcome == f"CacheTableLayout: {message(layout).replace(repr('default'), repr(SLOW))}"
    assert slow_columns.replies_held == 1 and took >= DELAY * 0.9  # asked, answered late
    assert longest_gap < DELAY / 2  # meanwhile the loop ran


@pytest.mark.django_db(transaction=True)
def test_kvcache_createtable_says_the_same_instead_of_exists(layout):
    with pytest.raises(CommandError) as raised:
        call_command("kvcache_createtable", "legacy", stdout=StringIO())
    assert str(raised.value) == f"legacy: {message(layout)}"
    assert sql(f"SHOW TABLES LIKE '{TABLE}%'") == [(TABLE,)]  # no lock table made beside it


@pytest.mark.django_db(transaction=True)
def test_a_table_of_ours_passes():
    table = "kvcache_layout_ours"
    configured = {"BACKEND": BACKEND, "LOCATION": table}
    with override_settings(CACHES={"default": configured}):
        caches["default"].create_table()
        try:
            assert [m for m in check_mysql_cache_tables(databases=["default"])] == []
            out = StringIO()
            call_command("kvcache_createtable", stdout=out)
            assert out.getvalue() == "default: table exists\n"
        finally:
            drop_table(table)
