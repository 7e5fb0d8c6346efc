"""MySQLCache fails open by default: a cache outage is not a site outage.

``IGNORE_EXCEPTIONS`` is on unless OPTIONS say otherwise. Errors that mean the server is
unreachable or overloaded (no connection, a lost connection, a lock wait timeout, a
statement stopped by a server limit, a pool busy for POOL_TIMEOUT) give misses and
no-ops, logged and counted; errors that mean the configuration is wrong (access denied,
an unknown database, a missing table or one of another layout) raise whatever the
setting. ``incr`` has no right answer without the server: it raises. A write that failed
open leaves its key owed: deleted before the shard serves it again, never read stale.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from typing import Any, Iterator

import MySQLdb
import pytest
from django.db import DatabaseError, OperationalError, connections

from django_kvcache.backends.mysql import CacheTableMissing, MySQLCache
from django_kvcache.mysql import errors, pools
from tests.mysql_support import (  # noqa: F401  (fixtures)
    TABLE,
    make_cache,
    mysql_tables,
    registered_alias,
    sql,
)
from tests.servers import free_port

pytestmark = pytest.mark.django_db(transaction=True)

UNREACHABLE = "kvcache_fail_open_unreachable"
SIGNALLING = "kvcache_signalling"


@pytest.fixture
def unreachable(django_db_blocker) -> Iterator[str]:
    """An alias of a port nothing listens on."""
    entry = {**connections["default"].settings_dict, "PORT": str(free_port()), "TEST": {}}
    entry["OPTIONS"] = {**entry["OPTIONS"], "connect_timeout": 1}
    with registered_alias(UNREACHABLE, entry, django_db_blocker):
        yield UNREACHABLE


@pytest.fixture
def alias_with(django_db_blocker) -> Iterator[Any]:
    """Registers a variant of the test database's alias (``name``, settings changed)."""
    stack: list[Any] = []

    def register(name: str, **changes: Any) -> str:
        entry = {**connections["default"].settings_dict, "TEST": {}, **changes}
        context = registered_alias(name, entry, django_db_blocker)
        context.__enter__()
        stack.append(context)
        return name

    yield register
    for context in reversed(stack):
        context.__exit__(None, None, None)


def test_the_default_is_to_fail_open(mysql_tables):
    assert make_cache().cluster.ignore_exceptions is True
    assert make_cache(OPTIONS={"IGNORE_EXCEPTIONS": False}).cluster.ignore_exceptions is False


def test_an_unreachable_server_gives_misses_and_no_ops(unreachable, caplog):
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": unreachable}})
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert cache.get("k", "default") == "default"
        assert cache.set("k", 1) is None
        assert cache.add("k", 1) is False
        assert cache.get_many(["k", "j"]) == {}
        assert cache.set_many({"k": 1, "j": 2}) == ["k", "j"]
        assert cache.delete("k") is False
        assert cache.delete_many(["k"]) is None
        assert cache.has_key("k") is False
        assert cache.touch("k") is False
        assert cache.ttl("k") == 0.0
        assert cache.get_or_set("k", lambda: "computed") == "computed"
        with pytest.raises(ValueError):  # as for a missing key, as on memcached
            cache.incr("k")
        with pytest.raises(ValueError):
            cache.decr("k")
    failures = [r for r in caplog.records if "Ignored MySQL failure" in r.getMessage()]
    assert len(failures) == 1  # one line per episode, then a summary
    shard = cache.metrics()["shards"][unreachable]
    assert shard["errors"] + shard["skipped"] >= 10 and shard["down"] is True


def test_the_log_names_the_server_and_the_cache(unreachable, caplog):
    """A cache on one database calls it its server (not a shard), and names the cache
    by its CACHES alias."""
    from django.core.cache import caches
    from django.test import override_settings

    configured = {"BACKEND": "django_kvcache.backends.mysql.MySQLCache", "LOCATION": TABLE,
                  "OPTIONS": {"DATABASE": unreachable, "RETRY_TIMEOUT": 61}}
    with override_settings(CACHES={"sessions": configured}), \
            caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert caches["sessions"].get("k", "default") == "default"
    assert any(r.getMessage().startswith(
        f"Ignored MySQL failure on server {unreachable!r} of cache 'sessions': ")
        for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_without_ignore_exceptions_an_unreachable_server_raises(unreachable):
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": unreachable, "IGNORE_EXCEPTIONS": False}})
    with pytest.raises(OperationalError) as raised:
        cache.get("k")
    assert errors.classify(raised.value) is errors.NO_CONNECTION


# --- configuration errors raise whatever IGNORE_EXCEPTIONS says ----------------------------


@pytest.mark.parametrize("ignore", [True, False])
def test_access_denied_raises(mysql_tables, alias_with, ignore):
    alias = alias_with("kvcache_wrong_password", PASSWORD="not-the-password", USER="nobody")
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": alias, "IGNORE_EXCEPTIONS": ignore}})
    with pytest.raises(OperationalError) as raised:
        cache.set("k", 1)
    assert raised.value.args[0] == 1045


@pytest.mark.parametrize("ignore", [True, False])
def test_an_unknown_database_raises(mysql_tables, alias_with, ignore):
    alias = alias_with("kvcache_no_such_database", NAME="kvcache_no_such_database")
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": alias, "IGNORE_EXCEPTIONS": ignore}})
    with pytest.raises(OperationalError) as raised:
        cache.get("k")
    assert raised.value.args[0] == 1049


@pytest.mark.parametrize("ignore", [True, False])
def test_a_missing_table_raises(mysql_tables, ignore):
    cache = MySQLCache("kvcache_missing", {"OPTIONS": {"IGNORE_EXCEPTIONS": ignore}})
    with pytest.raises(CacheTableMissing):
        cache.get("k")


@pytest.mark.parametrize("ignore", [True, False])
def test_a_table_of_another_layout_raises(mysql_tables, ignore):
    sql("DROP TABLE IF EXISTS `kvcache_other_layout`")
    sql("CREATE TABLE `kvcache_other_layout` (`cache_key` VARCHAR(255) PRIMARY KEY, "
        "`value` LONGTEXT, `expires` DATETIME(6))")  # Django's DatabaseCache, roughly
    try:
        cache = MySQLCache("kvcache_other_layout", {"OPTIONS": {"IGNORE_EXCEPTIONS": ignore}})
        for call in (lambda: cache.get("k"), lambda: cache.set("k", 1)):
            with pytest.raises(DatabaseError) as raised:
                call()
            assert not errors.fails_open(raised.value)
    finally:
        sql("DROP TABLE IF EXISTS `kvcache_other_layout`")


# --- overloaded: fails open, never held against the server's health ------------------------


@contextmanager
def failing_inserts(code: int, message: str, times: int = 1_000_000) -> Iterator[str]:
    """A cache table whose next ``times`` row writes fail with the server error ``code``
    (a trigger's SIGNAL: the server's own error packet, as the client sees any other).
    The count lives in a MyISAM table, which a failed statement does not roll back."""
    sql(f"DROP TABLE IF EXISTS `{SIGNALLING}`, `{SIGNALLING}_left`")
    make_cache(SIGNALLING)
    sql(f"CREATE TABLE `{SIGNALLING}_left` (n INT) ENGINE=MyISAM")
    sql(f"INSERT INTO `{SIGNALLING}_left` VALUES ({times})")
    sql(f"""
        CREATE TRIGGER `{SIGNALLING}_fails` BEFORE INSERT ON `{SIGNALLING}` FOR EACH ROW
        BEGIN
            IF (SELECT n FROM `{SIGNALLING}_left`) > 0 THEN
                UPDATE `{SIGNALLING}_left` SET n = n - 1;
                SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = {code}, MESSAGE_TEXT = '{message}';
            END IF;
        END""")
    try:
        yield SIGNALLING
    finally:
        sql(f"DROP TABLE IF EXISTS `{SIGNALLING}`, `{SIGNALLING}_left`")


def signals_left() -> int:
    return sql(f"SELECT n FROM `{SIGNALLING}_left`")[0][0]


@pytest.mark.parametrize("code, message", [
    (1969, "Query execution was interrupted (max_statement_time exceeded)"),
    (1114, "The table is full"),
    (1205, "Lock wait timeout exceeded; try restarting transaction"),
])
def test_an_overloaded_server_fails_open_without_marking_it_down(mysql_tables, code, message):
    with failing_inserts(code, message) as table:
        cache = make_cache(table, OPTIONS={"FAILURE_THRESHOLD": 1})
        before = cache.metrics()["shards"]["default"]
        for _ in range(3):
            assert cache.set("k", "new") is None
            assert cache.set_many({"k": "new"}) == ["k"]
        shard = cache.metrics()["shards"]["default"]
        assert shard["errors"] - before["errors"] == 6
        assert shard["ignored"] - before["ignored"] == 6
        assert shard["down"] is False  # the server answers: reads go on
        assert cache.get("k") is None


def test_a_write_that_failed_open_is_never_read_stale(mysql_tables):
    """The older copy a failed write leaves is owed: deleted before the key is read."""
    with failing_inserts(1205, "Lock wait timeout exceeded; try restarting transaction",
                         times=0) as table:
        cache = make_cache(table)
        cache.set("k", "old")
        sql(f"UPDATE `{SIGNALLING}_left` SET n = 2")  # the set and its one rerun fail
        assert cache.set("k", "new") is None
        assert signals_left() == 0
        assert cache.metrics()["shards"]["default"]["outdated_keys"] == 1
        assert cache.get("k") is None  # not "old"
        assert cache.metrics()["shards"]["default"]["outdated_keys"] == 0


def test_a_busy_pool_fails_open(mysql_tables):
    small = make_cache(OPTIONS={"MAX_POOL_SIZE": 1, "POOL_TIMEOUT": 0.05})
    small.set("busy", 1)
    pool = pools.process_pool("default", small.cluster.connections)
    before = small.metrics()["shards"]["default"]["ignored"]
    held = pool.checkout()
    try:
        assert small.get("busy", "fallback") == "fallback"
        assert small.set("busy", 2) is None
    finally:
        pool.checkin(held)
    shard = small.metrics()["shards"]["default"]
    assert shard["down"] is False and shard["ignored"] - before == 2
    assert small.get("busy") is None  # the failed set's key was owed, then deleted


def test_kvcache_cull_fails_loudly_whatever_ignore_exceptions_says(unreachable):
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": unreachable}})
    assert cache.cull() == 0  # a call from a view fails open
    with pytest.raises(OperationalError):
        cache.cull(fail_open=False)  # kvcache_cull, cull_all()


def test_errors_are_classified_once_for_every_path():
    def error(code: int, message: str = "") -> OperationalError:
        return OperationalError(code, message)

    assert errors.fails_open(error(2003)) and errors.is_unreachable(error(2003))
    assert errors.fails_open(error(1205)) and not errors.is_unreachable(error(1205))
    assert errors.fails_open(error(1969)) and not errors.is_unreachable(error(1969))
    assert errors.fails_open(errors.PoolExhausted("busy"))
    assert not errors.is_unreachable(errors.PoolExhausted("busy"))
    for code in (1045, 1049, 1146, 1054, 1064):
        assert not errors.fails_open(error(code))
    # Limits that are the account's or the server's state, not the configuration's.
    for code in (1226, 3032, 1040, 1203, 1135):
        assert errors.fails_open(error(code)) and errors.is_unreachable(error(code)), code
    assert errors.fails_open(error(1637)) and not errors.is_unreachable(error(1637))


def test_error_1047_is_galera_s_only_from_a_galera_node(mysql_tables):
    """1047 from a Galera node ("WSREP has not yet prepared node for application use") is
    a node out of the primary component: unreachable, failed open. From any other server
    it is "unknown command": the statement is wrong, raised, and the server's health is
    not touched."""
    with failing_inserts(1047, "Unknown command") as table:
        cache = make_cache(table, OPTIONS={"FAILURE_THRESHOLD": 1})
        with pytest.raises(OperationalError) as raised:
            cache.set("k", 1)
        assert raised.value.args[0] == 1047
        assert cache.metrics()["shards"]["default"]["down"] is False
    message = "WSREP has not yet prepared node for application use"
    with failing_inserts(1047, message) as table:
        cache = make_cache(table, OPTIONS={"FAILURE_THRESHOLD": 1, "RETRY_TIMEOUT": 0.5})
        assert cache.set("k", 1) is None
        assert cache.metrics()["shards"]["default"]["down"] is True


# --- MySQL 8 errors, raised by MariaDB (a trigger's SIGNAL) with MySQL's codes and words ----

GROUP_REPLICATION_CONFLICT = (3101, "Plugin instructed the server to rollback the current "
                                    "transaction.")
GROUP_REPLICATION_HOOK = (3100, "Error on observer while running replication hook "
                                "before_commit.")
SUPER_READ_ONLY = (1290, "The MySQL server is running with the --super-read-only option so "
                         "it cannot execute this statement")
READ_ONLY_MODE = (1836, "Running in read-only mode")


@pytest.mark.parametrize("code, message", [GROUP_REPLICATION_CONFLICT, GROUP_REPLICATION_HOOK])
@pytest.mark.parametrize("ignore", [True, False])
def test_a_group_replication_conflict_is_rerun_as_a_deadlock_is(mysql_tables, code, message,
                                                                  ignore):
    """Group Replication rolls back a transaction that conflicts with one certified on
    another member (3101, reported through the before_commit hook's 3100): nothing was
    applied, so it runs again, as 1213 does on Galera."""
    with failing_inserts(code, message, times=3) as table:
        cache = make_cache(table, OPTIONS={"IGNORE_EXCEPTIONS": ignore})
        assert cache.set("k", "v") is None
        assert signals_left() == 0 and cache.get("k") == "v"


def test_a_conflict_that_keeps_coming_fails_open(mysql_tables):
    with failing_inserts(*GROUP_REPLICATION_CONFLICT) as table:
        cache = make_cache(table, OPTIONS={"FAILURE_THRESHOLD": 1})
        assert cache.set("k", "v") is None  # after its reruns: failed open
        assert cache.metrics()["shards"]["default"]["down"] is False  # the server answers
        strict = make_cache(table, OPTIONS={"IGNORE_EXCEPTIONS": False})
        with pytest.raises(OperationalError) as raised:
            strict.set("k", "v")
        assert raised.value.args[0] == 3101


@pytest.mark.parametrize("code, message", [SUPER_READ_ONLY, READ_ONLY_MODE])
def test_a_read_only_server_after_a_failover_is_unreachable_for_writes(mysql_tables, code,
                                                                       message):
    """A primary demoted by a failover refuses writes (1290 naming --read-only or
    --super-read-only, 1836): not applied, so the write is sent once more on a fresh
    connection (where a proxy or a DNS name follows the failover, it reaches the new
    primary); if that fails too, the server is unreachable for it: failed open, and
    counted against its health."""
    with failing_inserts(code, message, times=1) as table:
        cache = make_cache(table, OPTIONS={"IGNORE_EXCEPTIONS": False})
        pool = pools.process_pool("default", cache.cluster.connections)
        # Idle connections opened before the failover reach the demoted server too: the
        # rerun takes none of them (it took one where earlier tests had left some).
        opened_before = [pool.checkout() for _ in range(3)]
        for raw in opened_before:
            pool.checkin(raw)
        connects = pool.connects
        assert cache.set("k", "v") is None  # the rerun, on a new connection, went through
        assert pool.connects == connects + 1 and cache.get("k") == "v"
        assert not any(raw.open for raw in opened_before)
    with failing_inserts(code, message) as table:
        cache = make_cache(table, OPTIONS={"FAILURE_THRESHOLD": 1, "RETRY_TIMEOUT": 0.5})
        assert cache.set("k", "v") is None
        assert cache.metrics()["shards"]["default"]["down"] is True


def test_on_the_event_loop_a_read_only_server_s_write_reruns_on_a_new_connection(mysql_tables):
    with failing_inserts(*SUPER_READ_ONLY, times=1) as table:
        cache = make_cache(table, OPTIONS={"IGNORE_EXCEPTIONS": False})

        async def failover() -> tuple[int, list[Any]]:
            pool = pools.loop_pool("default", cache.cluster.connections)
            opened_before = [await pool.checkout() for _ in range(3)]
            for connection in opened_before:
                pool.checkin(connection)
            connects = pool.connects
            assert await cache.aset("k", "v") is None
            return pool.connects - connects, opened_before

        opened, opened_before = asyncio.run(failover())
        assert opened == 1 and cache.get("k") == "v"
        assert not any(connection.open for connection in opened_before)


def test_1290_for_another_option_is_a_statement_error(mysql_tables):
    with failing_inserts(1290, "The MySQL server is running with the --secure-file-priv "
                               "option so it cannot execute this statement") as table:
        with pytest.raises(OperationalError):
            make_cache(table).set("k", "v")


# --- limits of the account and of the server (issue 39) --------------------------------------

USER_LIMIT = (1226, "User kvcache_limited has exceeded the max_queries_per_hour resource "
                    "(current value: 100)")
OFFLINE_MODE = (3032, "The server is currently in offline mode")


@pytest.mark.parametrize("code, message", [USER_LIMIT, OFFLINE_MODE])
def test_an_account_limit_or_offline_mode_fails_open_as_too_many_connections_does(
        mysql_tables, code, message):
    """A per-account limit (1226: MAX_QUERIES_PER_HOUR, MAX_UPDATES_PER_HOUR…) and
    MySQL 8's offline mode (3032) say the server will not serve this client now, as the
    server-wide 1040 and 1203 do: failed open and held against the server's health — a
    cache limit must not become a site error."""
    with failing_inserts(code, message) as table:
        cache = make_cache(table, OPTIONS={"FAILURE_THRESHOLD": 1, "RETRY_TIMEOUT": 0.5})
        assert cache.set("k", "v") is None
        assert cache.add("k", "v") is False
        shard = cache.metrics()["shards"]["default"]
        assert shard["ignored"] >= 1 and shard["down"] is True


LIMITED = "kvcache_limited"


@pytest.fixture
def limited_account(alias_with) -> Iterator[str]:
    """An alias that logs in as an account allowed one connection at a time
    (MAX_USER_CONNECTIONS 1, a per-account limit: error 1226 past it)."""
    hosts = ("%", "localhost")
    for host in hosts:
        sql(f"DROP USER IF EXISTS '{LIMITED}'@'{host}'")
        sql(f"CREATE USER '{LIMITED}'@'{host}' WITH MAX_USER_CONNECTIONS 1")
        sql(f"GRANT ALL PRIVILEGES ON *.* TO '{LIMITED}'@'{host}'")
    try:
        yield alias_with(LIMITED, USER=LIMITED, PASSWORD="")
    finally:
        for host in hosts:
            sql(f"DROP USER IF EXISTS '{LIMITED}'@'{host}'")


def test_an_account_at_its_connection_limit_fails_open(mysql_tables, limited_account):
    from django_kvcache.mysql.connect import connection_params

    holder = MySQLdb.connect(**connection_params(limited_account).kwargs)  # the one allowed
    try:
        cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": limited_account}})
        assert cache.get("k", "default") == "default"
        assert cache.set("k", 1) is None
        assert cache.metrics()["shards"][limited_account]["errors"] >= 1
        strict = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": limited_account,
                                                "IGNORE_EXCEPTIONS": False}})
        with pytest.raises(OperationalError) as raised:
            strict.get("k")
        assert raised.value.args[0] == 1226
    finally:
        holder.close()
