"""MySQLCache management commands, the plain cull function and the system checks."""
from __future__ import annotations

import time
from io import StringIO

import pytest
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import override_settings

from django_kvcache.checks import (
    check_engine_on_galera,
    check_mysql_cache_tables,
    check_mysql_caches,
    is_galera_node,
)
from django_kvcache.maintenance import cull_all, python_literal
from tests.mysql_support import BACKEND, drop_table, insert_row, sql

TABLES = ["kvcache_cmd_a", "kvcache_cmd_b"]
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "mysql_a": {"BACKEND": BACKEND, "LOCATION": TABLES[0]},
    "mysql_b": {"BACKEND": BACKEND, "LOCATION": TABLES[1], "OPTIONS": {"MAX_ENTRIES": 2}},
}

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def cache_settings():
    for table in TABLES:
        drop_table(table)
    with override_settings(CACHES=CACHES):
        yield
    for table in TABLES:
        drop_table(table)


def command(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def tables() -> set[str]:
    return set(TABLES) & set(connections["default"].introspection.table_names())


def test_createtable_creates_missing_tables_once():
    assert command("kvcache_createtable") == "mysql_a: created table\nmysql_b: created table\n"
    assert tables() == set(TABLES)
    assert command("kvcache_createtable") == "mysql_a: table exists\nmysql_b: table exists\n"
    caches["mysql_a"].set("key", "value")
    assert caches["mysql_a"].get("key") == "value"


def test_createtable_for_named_aliases():
    assert command("kvcache_createtable", "mysql_b") == "mysql_b: created table\n"
    assert tables() == {TABLES[1]}


class NoCacheTablesOnDefault:
    """A router that keeps the cache tables (app_label django_kvcache) off "default"."""

    def allow_migrate(self, db, app_label, model_name=None, **hints):
        if app_label == "django_kvcache":
            return db != "default"
        return None


def test_table_creation_for_a_database_asks_the_routers(settings):
    """As Django's createcachetable asks allow_migrate for DatabaseCache tables, so do
    its override and the pre_migrate receiver (both create_tables_in) for MySQLCache's:
    a router that says no keeps the table off that database."""
    from django_kvcache.maintenance import create_tables_in

    settings.DATABASE_ROUTERS = [f"{__name__}.NoCacheTablesOnDefault"]
    assert create_tables_in("default") == {}
    command("createcachetable", "--database", "default")
    assert tables() == set()
    settings.DATABASE_ROUTERS = []
    command("createcachetable", "--database", "default")
    assert tables() == set(TABLES)


def test_createtable_dry_run_prints_sql_and_creates_nothing():
    out = command("kvcache_createtable", "--dry-run")
    assert out.count("CREATE TABLE IF NOT EXISTS") == 4  # each cache's table and lock table
    assert "-- mysql_a\nCREATE TABLE IF NOT EXISTS `kvcache_cmd_a`" in out
    assert "CREATE TABLE IF NOT EXISTS `kvcache_cmd_a_locks`" in out
    assert tables() == set()


@pytest.mark.parametrize("name", ["kvcache_createtable", "kvcache_migration", "kvcache_cull"])
@pytest.mark.parametrize(
    "alias, reason", [("nope", "No cache named"), ("default", "not a MySQLCache")]
)
def test_commands_refuse_unknown_aliases(name, alias, reason):
    with pytest.raises(CommandError, match=reason):
        command(name, alias)


def test_migration_module_creates_and_drops_each_table():
    source = command("kvcache_migration")
    namespace: dict = {}
    exec(compile(source, "0002_cache_tables.py", "exec"), namespace)
    (operation,) = namespace["Migration"].operations
    with connections["default"].schema_editor() as editor:
        operation.code(None, editor)
        assert tables() == set(TABLES)
        operation.reverse_code(None, editor)
    assert tables() == set()


def test_cull_command_and_function_report_rows_deleted_per_alias():
    command("kvcache_createtable")
    past = int(time.time() * 1000) - 1000
    for i in range(3):
        insert_row(f":1:old{i}", b"x", 0, past, table=TABLES[0])
    caches["mysql_b"].set_many({f"k{i}": i for i in range(5)})
    assert command("kvcache_cull") == "mysql_a: 3 rows deleted\nmysql_b: 3 rows deleted\n"
    assert cull_all() == {"mysql_a": 0, "mysql_b": 0}
    assert cull_all(["mysql_b"]) == {"mysql_b": 0}
    assert sql(f"SELECT COUNT(*) FROM `{TABLES[1]}`") == [(2 - 2 // 3,)]


# --- system checks -------------------------------------------------------------------------


def check_ids(messages) -> list[str]:
    return [message.id for message in messages]


def test_missing_table_warns_with_the_command_to_run():
    messages = check_mysql_cache_tables(databases=["default"])
    assert check_ids(messages) == ["kvcache.W001", "kvcache.W001"]
    assert "kvcache_createtable mysql_a" in messages[0].hint
    assert check_mysql_cache_tables(databases=None) == []  # no database access unless asked
    command("kvcache_createtable")
    assert check_mysql_cache_tables(databases=["default"]) == []


def test_a_missing_dictionary_table_is_named_not_the_cache_table():
    with_dictionaries = {
        **CACHES,
        "mysql_d": {"BACKEND": BACKEND, "LOCATION": "kvcache_cmd_d",
                    "OPTIONS": {"COMPRESS_DICTIONARY": "auto"}},
    }
    with override_settings(CACHES=with_dictionaries):
        command("kvcache_createtable")
        drop_table("kvcache_cmd_d_dictionaries")
        (message,) = check_mysql_cache_tables(databases=["default"])
    assert message.id == "kvcache.W001"
    assert message.msg == ("The table 'kvcache_cmd_d_dictionaries' of cache 'mysql_d' does "
                           "not exist in database 'default'.")
    drop_table("kvcache_cmd_d")


@pytest.mark.django_db(transaction=True, databases=["default", "cache"])
def test_missing_table_of_a_cache_on_its_own_alias_warns_whichever_database_is_checked():
    on_cache_alias = {
        **CACHES,
        "mysql_c": {"BACKEND": BACKEND, "LOCATION": "kvcache_cmd_c",
                    "OPTIONS": {"DATABASE": "cache"}},
    }
    drop_table("kvcache_cmd_c", alias="cache")
    with override_settings(CACHES=on_cache_alias):
        messages = check_mysql_cache_tables(databases=["default"])
    assert check_ids(messages) == ["kvcache.W001"] * 3
    assert "'mysql_c'" in messages[2].msg and "'cache'" in messages[2].msg


# The check command asks every database alias's server (Django 6.1's model checks): see
# the check_order fixture.
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_invalid_options_stop_the_check_command_naming_the_option(check_order):
    """What docs/mysql.rst promises: Django's own cache checks build every cache first."""
    broken = {
        **CACHES,
        "broken": {"BACKEND": BACKEND, "LOCATION": "t", "OPTIONS": {"CULL_PROBABILITY": 5}},
    }
    with override_settings(CACHES=broken):
        with pytest.raises(ImproperlyConfigured, match="CULL_PROBABILITY"):
            call_command("check", stdout=StringIO(), stderr=StringIO())


def test_commands_are_silent_at_verbosity_0():
    assert command("kvcache_createtable", "--verbosity", "0") == ""
    assert tables() == set(TABLES)
    assert command("kvcache_createtable", "--verbosity", "0") == ""
    caches["mysql_b"].set_many({f"k{i}": i for i in range(5)})
    assert command("kvcache_cull", "--verbosity", "0") == ""
    assert sql(f"SELECT COUNT(*) FROM `{TABLES[1]}`") == [(2 - 2 // 3,)]


@pytest.fixture
def sqlite_alias():
    """A non-MySQL database alias (never connected to: checks only look at its vendor)."""
    connections.settings["sqlite"] = {
        **connections.settings["default"],
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": ":memory:",
    }
    yield "sqlite"
    del connections["sqlite"]
    del connections.settings["sqlite"]


def test_database_that_is_not_mysql_is_an_error(sqlite_alias):
    elsewhere = {**CACHES, "elsewhere": {"BACKEND": BACKEND, "LOCATION": "t",
                                         "OPTIONS": {"DATABASE": sqlite_alias}}}
    with override_settings(CACHES=elsewhere):
        messages = check_mysql_caches()
    assert check_ids(messages) == ["kvcache.E001"]
    assert "'sqlite'" in messages[0].msg


def test_valid_configuration_has_no_errors():
    assert check_mysql_caches() == []


@pytest.mark.parametrize(
    "statement",
    [
        "CREATE TABLE `t` (\n    `a` INT\n)",
        'DROP TABLE `we"""ird`',
        "DROP TABLE `back\\slash`",
        'X "',
    ],
)
def test_migration_literals_round_trip(statement):
    assert " ".join(eval(python_literal(statement)).split()) == " ".join(statement.split())


def test_a_myisam_table_on_a_server_that_is_not_a_galera_node_is_no_error():
    """kvcache.E010 is for Galera nodes only (tests/test_galera.py shows it there)."""
    myisam = {**CACHES, "mysql_b": {**CACHES["mysql_b"], "OPTIONS": {"ENGINE": "MyISAM"}}}
    assert not is_galera_node(connections["default"])
    with override_settings(CACHES=myisam):
        assert check_engine_on_galera(databases=["default"]) == []


# --- issue 21: charset and collation suspicions ------------------------------------------------


@pytest.fixture
def utf8mb3_alias():
    """A MySQL alias whose connections use utf8mb3 ("utf8": Django 4.2's default)."""
    entry = dict(connections.settings["default"])
    connections.settings["mb3"] = {**entry, "OPTIONS": {"charset": "utf8"}, "TEST": {"MIRROR": "default"}}
    yield "mb3"
    if "mb3" in [c.alias for c in connections.all(initialized_only=True)]:
        connections["mb3"].close()
        del connections["mb3"]
    del connections.settings["mb3"]


def test_a_utf8mb3_connection_is_a_warning(utf8mb3_alias):
    """Confirmed: on a utf8mb3 connection a key with a 4-byte character (an emoji) fails
    with 1366 (1267 under a non-strict sql_mode): a check says so before a request does."""
    from django_kvcache import checks

    on_mb3 = {**CACHES, "mb3cache": {"BACKEND": BACKEND, "LOCATION": "t",
                                      "OPTIONS": {"DATABASE": utf8mb3_alias}}}
    with override_settings(CACHES=on_mb3):
        messages = checks.check_mysql_connection_charsets()
    assert check_ids(messages) == ["kvcache.W003"]
    assert "'mb3cache'" in messages[0].msg and "'mb3'" in messages[0].msg
    assert "utf8mb4" in messages[0].hint
    with override_settings(CACHES=CACHES):
        assert checks.check_mysql_connection_charsets() == []


def test_the_migration_picks_the_collation_of_the_server_it_runs_on():
    """Confirmed: kvcache_migration embedded the collation of the server that generated it
    (MariaDB's utf8mb4_nopad_bin, unknown to MySQL 8). The module names both and picks by
    the flavour of the connection it is applied to."""
    source = command("kvcache_migration")
    assert "utf8mb4_nopad_bin" in source and "utf8mb4_0900_bin" in source
    namespace: dict = {}
    exec(compile(source, "0002_cache_tables.py", "exec"), namespace)
    with connections["default"].schema_editor() as editor:
        for operation in namespace["Migration"].operations:
            operation.code(None, editor)
    (_, create), = sql(f"SHOW CREATE TABLE `{TABLES[0]}`")
    assert "utf8mb4_nopad_bin" in create  # this server is MariaDB
