"""MySQLCache tables in the test databases Django's test runner creates.

``setup_databases`` (what ``manage.py test`` and pytest-django run) creates each test
database and calls ``createcachetable --database <alias>`` on it; django-kvcache's
``createcachetable`` also creates the MySQLCache tables that live there, including those
of an alias that is the database's ``TEST["MIRROR"]``.
"""
from __future__ import annotations

import os
from io import StringIO
from typing import Any, Iterator

import pytest
from django.conf import settings
from django.core.cache import caches
from django.core.management import call_command
from django.db import DEFAULT_DB_ALIAS, connections
from django.test import override_settings
from django.test.utils import setup_databases, teardown_databases

from django_kvcache.mysql.server import forget_server
from tests.mysql_support import BACKEND

PRIMARY = "kvcache_testdb"
MIRROR = "kvcache_testdb_mirror"
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "own": {"BACKEND": BACKEND, "LOCATION": "kvcache_tdb_own", "OPTIONS": {"DATABASE": PRIMARY}},
    "mirrored": {
        "BACKEND": BACKEND,
        "LOCATION": "kvcache_tdb_mirrored",
        "OPTIONS": {"DATABASE": MIRROR},
    },
}


def add_alias(alias: str, entry: dict[str, Any]) -> None:
    """A DATABASES entry at run time (create_test_db renames it in settings.DATABASES)."""
    settings.DATABASES[alias] = entry
    connections.settings[alias] = connections.configure_settings({DEFAULT_DB_ALIAS: dict(entry)})[
        DEFAULT_DB_ALIAS
    ]


def remove_alias(alias: str) -> None:
    if alias in connections:
        connections[alias].close()
        del connections[alias]
    connections.settings.pop(alias)
    settings.DATABASES.pop(alias, None)  # often the same dict as connections.settings
    forget_server(alias)


@pytest.fixture
def runner_databases(django_db_blocker) -> Iterator[str]:
    """Two aliases on the real database "kvcache"; the second mirrors the first in tests."""
    real = {
        "ENGINE": "django.db.backends.mysql",
        "NAME": settings.MYSQL_DATABASE,
        **settings.MYSQL,
        "OPTIONS": {"charset": "utf8mb4"},
    }
    test_name = f"{os.environ['KVCACHE_TEST_DATABASE']}_runner"
    add_alias(PRIMARY, {**real, "TEST": {"NAME": test_name, "DEPENDENCIES": []}})
    add_alias(MIRROR, {**real, "TEST": {"MIRROR": PRIMARY}})
    try:
        with django_db_blocker.unblock(), override_settings(CACHES=CACHES):
            yield test_name
    finally:
        remove_alias(MIRROR)
        remove_alias(PRIMARY)


def tables(alias: str) -> set[str]:
    return set(connections[alias].introspection.table_names())


def test_a_test_database_made_by_the_test_runner_gets_the_cache_tables(runner_databases):
    before = tables(PRIMARY)  # the real database, which must stay untouched
    old_config = setup_databases(verbosity=0, interactive=False, aliases={PRIMARY, MIRROR})
    try:
        assert connections[PRIMARY].settings_dict["NAME"] == runner_databases
        assert {"kvcache_tdb_own", "kvcache_tdb_mirrored"} <= tables(PRIMARY)
        caches["mirrored"].set("key", "value")  # the mirror alias now reads the test database
        assert caches["mirrored"].get("key") == "value"
    finally:
        teardown_databases(old_config, verbosity=0)
    assert tables(PRIMARY) == before


def test_createcachetable_creates_the_tables_of_its_database_only(runner_databases):
    """Outside the test runner: ``createcachetable --database kvcache_testdb`` (dry run)."""
    out = StringIO()
    call_command("createcachetable", "--database", PRIMARY, "--dry-run", stdout=out)
    assert out.getvalue().count("CREATE TABLE IF NOT EXISTS") == 2
    out = StringIO()
    call_command("createcachetable", "--database", DEFAULT_DB_ALIAS, "--dry-run", stdout=out)
    assert out.getvalue() == ""


def test_createcachetable_reports_each_table_as_django_does(runner_databases):
    """At verbosity 2 Django says which cache tables it created and which existed."""
    def run() -> str:
        out = StringIO()
        call_command("createcachetable", "--database", PRIMARY, verbosity=2, stdout=out)
        return out.getvalue()

    try:
        first, second = run(), run()
    finally:
        for cache in ("own", "mirrored"):
            with connections[PRIMARY].cursor() as cursor:
                cursor.execute(caches[cache].drop_table_sql())
    for table in ("kvcache_tdb_own", "kvcache_tdb_mirrored"):
        assert f"Cache table '{table}' created." in first
        assert f"Cache table '{table}' already exists." in second
    assert "created" not in second
