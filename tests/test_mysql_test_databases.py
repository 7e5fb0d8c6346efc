"""MySQLCache tables in the test databases Django's test runner creates, and in migrate.

``setup_databases`` (what ``manage.py test`` and pytest-django run) creates each test
database, migrates it and calls ``createcachetable --database <alias>`` on it.
django_kvcache's ``pre_migrate`` receiver creates the MySQLCache tables that live there
before any migration runs, including those of an alias that is the database's
``TEST["MIRROR"]`` (which it points at the test database first), so a ``post_migrate``
receiver may write to them; its ``createcachetable`` creates them too.
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
from django.db.models.signals import post_migrate
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
    """Outside the test runner: ``createcachetable --database kvcache_testdb`` (dry run);
    another server's database gets none of them."""
    out = StringIO()
    call_command("createcachetable", "--database", PRIMARY, "--dry-run", stdout=out)
    assert out.getvalue().count("CREATE TABLE IF NOT EXISTS") == 4  # and their lock tables
    if "shard2" not in connections:
        pytest.skip("no second MariaDB server (KVCACHE_MYSQL_SHARD_PORTS)")
    out = StringIO()
    call_command("createcachetable", "--database", "shard2", "--dry-run", stdout=out)
    assert out.getvalue() == ""


def test_another_alias_of_the_same_database_gets_the_tables_of_its_caches(runner_databases):
    """A second connection to the same database without TEST MIRROR (same HOST, PORT and
    NAME) is where the cache's table lives as well."""
    add_alias("kvcache_testdb_twin", dict(connections.settings[PRIMARY], TEST={}))
    try:
        out = StringIO()
        call_command("createcachetable", "--database", "kvcache_testdb_twin", "--dry-run",
                     stdout=out)
    finally:
        remove_alias("kvcache_testdb_twin")
    assert out.getvalue().count("CREATE TABLE IF NOT EXISTS") == 4  # and their lock tables


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


class WritesWhileMigrating:
    """A post_migrate receiver writing to caches, as django-cachalot invalidates its cache
    after every migrate: what it wrote (or the error it met) per cache alias."""

    def __init__(self, aliases: list[str]) -> None:
        self.aliases = aliases
        self.outcomes: dict[str, Any] = {}

    def __call__(self, using: str, **kwargs: Any) -> None:
        for alias in self.aliases:
            try:
                caches[alias].set("written-during-migrate", using)
                self.outcomes[alias] = caches[alias].get("written-during-migrate")
            except Exception as exc:  # reported by the test, with the message
                self.outcomes[alias] = exc

    def __enter__(self) -> "WritesWhileMigrating":
        post_migrate.connect(self, weak=False, dispatch_uid="kvcache-test-writes")
        return self

    def __exit__(self, *exc_info: Any) -> None:
        post_migrate.disconnect(dispatch_uid="kvcache-test-writes")


def test_a_post_migrate_receiver_writes_to_the_caches_of_the_test_database_being_built(
    runner_databases,
):
    """Own alias and mirror alias alike: the tables exist before the migrations, and the
    mirror reaches the test database already, not the real one."""
    before = tables(PRIMARY)
    with WritesWhileMigrating(["own", "mirrored"]) as writer:
        old_config = setup_databases(verbosity=0, interactive=False, aliases={PRIMARY, MIRROR})
    try:
        assert writer.outcomes == {"own": PRIMARY, "mirrored": PRIMARY}
        for alias in ("own", "mirrored"):  # what was written went to the test database
            assert caches[alias].get("written-during-migrate") == PRIMARY
        assert connections[MIRROR].settings_dict["NAME"] == runner_databases
    finally:
        teardown_databases(old_config, verbosity=0)
    assert tables(PRIMARY) == before  # the real database got no table and no entry


def test_migrate_creates_the_tables_first_and_says_so(runner_databases):
    """In a real ``manage.py migrate`` too: a new site needs no separate table step."""
    def drop() -> None:
        for cache in ("own", "mirrored"):
            with connections[PRIMARY].cursor() as cursor:
                cursor.execute(caches[cache].drop_table_sql(PRIMARY))

    old_config = setup_databases(verbosity=0, interactive=False, aliases={PRIMARY, MIRROR})
    try:
        drop()
        out = StringIO()
        with WritesWhileMigrating(["own", "mirrored"]) as writer:
            call_command("migrate", database=PRIMARY, verbosity=1, stdout=out)
        assert {"kvcache_tdb_own", "kvcache_tdb_mirrored"} <= tables(PRIMARY)
        for cache in ("own", "mirrored"):  # each with its lock table
            assert (f"  Created the tables 'kvcache_tdb_{cache}' and 'kvcache_tdb_{cache}_locks' "
                    f"of cache '{cache}'.\n") in out.getvalue()
        assert writer.outcomes == {"own": PRIMARY, "mirrored": PRIMARY}
        out = StringIO()
        call_command("migrate", database=PRIMARY, verbosity=1, stdout=out)
        assert "Created the table" not in out.getvalue()
    finally:
        teardown_databases(old_config, verbosity=0)


@pytest.mark.django_db
@pytest.mark.parametrize("installed, fix", [
    (False, "Add 'django_kvcache' to INSTALLED_APPS: then 'manage.py migrate' creates it, and "
            "so does the test runner in test databases."),
    (True, "Create it with 'manage.py kvcache_createtable lost' (or 'manage.py migrate', "
           "which creates it first)."),
])
def test_a_missing_table_points_at_the_fix_that_works_here(installed, fix):
    """Without django_kvcache in INSTALLED_APPS there is no kvcache_createtable to run, and
    no test database gets the table: the app is the fix."""
    apps = [app for app in settings.INSTALLED_APPS if installed or app != "django_kvcache"]
    lost = {"BACKEND": BACKEND, "LOCATION": "kvcache_tdb_lost"}
    with override_settings(INSTALLED_APPS=apps, CACHES={"lost": lost}):
        with pytest.raises(Exception) as raised:
            caches["lost"].set("key", "value")
    assert str(raised.value) == (
        "The table 'kvcache_tdb_lost' of cache 'lost' does not exist in database 'default'. "
        + fix
    )
