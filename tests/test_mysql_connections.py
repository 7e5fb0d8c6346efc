"""MySQLCache's own connections: Django's connection never sees a cache statement.

The cache opens mysqlclient connections of its own from the alias's DATABASES entry (a
pool per process and alias on the sync API, per event loop on the async one). So no
caller's transaction, ``TestCase.databases`` check, ``execute_wrapper()`` or query log
involves them: a cache on any alias works in a test case that lists only "default", a
cache write inside a rolled-back ``atomic()`` stays written, a cull on the write path
holds no lock past its own statement, and forked workers each open their own.

(These tests replace the ones of the two Django connection styles the sync API used to
have: Django's cursor inside a transaction or while statements were watched, the DB-API
connection under Django's checks otherwise.)
"""
from __future__ import annotations

import ast
import asyncio
import gc
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import MySQLdb
import pytest
from django.db import (
    DEFAULT_DB_ALIAS,
    OperationalError,
    ProgrammingError,
    connections,
    transaction,
)
from django.test import LiveServerTestCase, TestCase, TransactionTestCase
from django.test.utils import CaptureQueriesContext

from django_kvcache.backends.mysql import CacheTableMissing, MySQLCache
from django_kvcache.codec import INT64_MAX
from django_kvcache.mysql import blocking, errors, pools
from django_kvcache.mysql.connect import connection_params
from tests.mysql_support import (  # noqa: F401  (fixtures)
    TABLE,
    cache,
    insert_row,
    make_cache,
    mysql_tables,
    now_ms,
    registered_alias,
    rows,
    sql,
)
from tests.settings import SHARD_ALIASES

pytestmark = pytest.mark.django_db(transaction=True)


def default_pool() -> pools.ProcessPool:
    return pools.process_pool(DEFAULT_DB_ALIAS)


@pytest.fixture
def django_cursors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the cursors opened on Django's ``default`` connection of this thread."""
    connection = connections["default"]
    calls = [0]
    cursor = connection.cursor

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return cursor(*args, **kwargs)

    monkeypatch.setattr(connection, "cursor", counting)
    yield calls


def operations(cache: Any) -> list[Callable[[], Any]]:
    return [lambda: cache.set("k", "v"), lambda: cache.get("k"), lambda: cache.add("a", 1),
            lambda: cache.incr("a"), lambda: cache.touch("k"), lambda: cache.delete("k"),
            lambda: cache.has_key("k"), lambda: cache.get_many(["k", "a"]),
            lambda: cache.set_many({"m": 1}), lambda: cache.delete_many(["m"]),
            lambda: cache.keys_with_prefix("a"), lambda: cache.get_or_set("g", 1)]


# --- Django's connection sees nothing ------------------------------------------------------


def test_cache_statements_never_use_django_s_connection(cache, django_cursors):
    before = django_cursors[0]
    for operation in operations(cache):
        operation()
    assert django_cursors[0] == before
    assert cache.get("a") == 2  # and the statements did their work


def test_execute_wrappers_and_query_logs_see_no_cache_statement(cache):
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    connections["default"].ensure_connection()  # (Django's own session set-up is done)
    with connections["default"].execute_wrapper(wrapper), \
            CaptureQueriesContext(connections["default"]) as captured:
        for operation in operations(cache):
            operation()
    assert seen == [] and len(captured) == 0
    assert cache.get("a") == 2


@pytest.mark.django_db(transaction=True, databases=["default", "cache"])
@pytest.mark.parametrize("alias", ["default", "cache"])
def test_a_cache_write_inside_a_rolled_back_atomic_stays_written(mysql_tables, alias):
    """Every cache statement commits on its own: a failed view's cache writes survive
    (as memcached's would), whichever alias the cache is on."""
    on_alias = make_cache(OPTIONS={"DATABASE": alias})
    on_alias.clear()
    with pytest.raises(RuntimeError):
        with transaction.atomic(using="default"), transaction.atomic(using="cache"):
            on_alias.set("written", 1)
            assert on_alias.incr("written") == 2
            raise RuntimeError("the view failed")
    assert on_alias.get("written") == 2
    on_alias.clear()


def test_a_write_path_cull_inside_a_caller_s_atomic_holds_no_lock(mysql_tables):
    """The cull a write may run deletes expired rows: on the caller's connection, inside
    its atomic(), it held their locks until the caller committed, and another writer of
    such a key waited (then failed with 1205). On the cache's own connection it commits
    at once."""
    culling = make_cache(OPTIONS={"CULL_PROBABILITY": 1})
    culling.clear()
    insert_row(":1:expired", b"x", 0, now_ms() - 1000)
    with monitor() as writer:
        writer.query(b"SET SESSION innodb_lock_wait_timeout = 1")
        with transaction.atomic():
            culling.set("new", 1)  # culls ":1:expired" first
            assert [key for key, *_ in rows()] == [":1:new"]
            started = time.monotonic()
            writer.query(  # another process writing the culled key, while we hold atomic()
                f"INSERT INTO `{TABLE}` VALUES (':1:expired', 'y', 0, {now_ms() + 60_000}) "
                "ON DUPLICATE KEY UPDATE `value` = 'y'".encode()
            )
            assert time.monotonic() - started < 0.5
    assert culling.get("expired") is not None
    culling.clear()


def test_a_sync_call_inside_an_event_loop_runs_on_the_cache_s_own_connection(cache):
    """As with Django's memcached and Redis backends: no SynchronousOnlyOperation (that is
    Django's guard of its own connections), the call blocks the loop while it runs."""

    async def call() -> Any:
        cache.set("k", "v")
        return cache.get("k")

    assert asyncio.run(call()) == "v"


def test_errors_are_django_s(mysql_tables):
    """MySQLdb's errors come out as Django's: here a missing table's ProgrammingError,
    which the backend turns into CacheTableMissing."""
    missing = MySQLCache("kvcache_no_such_table", {"OPTIONS": {"CULL_PROBABILITY": 0}})
    with pytest.raises(CacheTableMissing) as raised:
        missing.get("k")
    assert isinstance(raised.value.__cause__, ProgrammingError)


def test_two_statements_in_one_string_are_refused_and_the_connection_stays_in_step(cache):
    """The cache's connections run one statement a query: mysqlclient turns multiple
    statements on for every connection, and a second result nobody reads put the
    connection out of step ("Commands out of sync", 2014) for whoever took it next."""
    blocking.close_pools(["default"])
    with pytest.raises(ProgrammingError):
        blocking.query("default", "SELECT 1; SELECT 2")
    for _ in range(3):
        assert blocking.query("default", "SELECT 3") == [(3,)]
    cache.set("k", "v")
    assert cache.get("k") == "v"


def test_an_incr_overflow_changes_nothing(cache):
    """Error 1690, as Django's cursor reported it."""
    cache.set("n", INT64_MAX)
    with pytest.raises(OverflowError):
        cache.incr("n")
    assert cache.get("n") == INT64_MAX


# --- where the connections go ----------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases="__all__")  # every test database made
@pytest.mark.parametrize("alias", ["default", "cache", *SHARD_ALIASES])
def test_the_connections_reach_the_test_databases(mysql_tables, alias):
    """Settings are read when a connection opens: the test database's name, and for a
    ``TEST: MIRROR`` alias ("cache", "shard1") its primary's."""
    (name,), = blocking.query(alias, "SELECT DATABASE()")
    mirror = (connections.settings[alias].get("TEST") or {}).get("MIRROR")
    assert name == connections[mirror or alias].settings_dict["NAME"]
    assert name.startswith("test_")


def test_a_mirror_reaches_the_test_database_from_another_thread(mysql_tables):
    """Django points a TEST MIRROR at the test database only in the thread that set the
    databases up; the cache's connections opened in another thread follow it too."""
    names: list[str] = []

    def ask() -> None:
        blocking.retire_pools(["cache"])  # a connection opened in this thread
        names.append(blocking.query("cache", "SELECT DATABASE()")[0][0])

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join()
    assert names == [connections["default"].settings_dict["NAME"]]


# --- the blocking pool ------------------------------------------------------------------------


def test_the_pool_reuses_its_connections_and_counts(cache):
    cache.get("warm-up")
    before = cache.metrics()["shards"]["default"]
    for _ in range(20):
        cache.get("k")
    after = cache.metrics()["shards"]["default"]
    assert after["pool_connects"] == before["pool_connects"]  # no new connection
    assert after["pool_reuses"] >= before["pool_reuses"] + 20
    assert after["pool_size"] >= 1 and after["pool_idle"] >= 1
    for name in ("pool_waits", "pool_wait_seconds", "pool_reconnects", "pool_waiters"):
        assert name in after


def test_threads_wait_for_a_connection_and_are_counted(mysql_tables):
    """MAX_POOL_SIZE bounds the process's connections to an alias: a second thread waits
    for the first one's connection (POOL_TIMEOUT at most), and the wait is counted."""
    small = make_cache(OPTIONS={"MAX_POOL_SIZE": 1, "POOL_TIMEOUT": 5})
    small.set("k", 1)
    pool = pools.process_pool(DEFAULT_DB_ALIAS, small.cluster.connections)
    held = pool.checkout()
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.append(small.get("k")))
    worker.start()
    deadline = time.monotonic() + 5
    while not len(pool.line) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pool.line) == 1  # waiting, not opening a second connection
    time.sleep(0.05)
    pool.checkin(held)
    worker.join()
    assert results == [1]
    figures = small.metrics()["shards"]["default"]
    assert figures["pool_size"] == 1 and figures["pool_waits"] >= 1
    assert figures["pool_wait_seconds"] >= 0.05


def test_a_pool_that_stays_busy_for_pool_timeout_raises_pool_exhausted(mysql_tables):
    small = make_cache(OPTIONS={"MAX_POOL_SIZE": 1, "POOL_TIMEOUT": 0.05,
                                "IGNORE_EXCEPTIONS": False})
    small.get("warm-up")
    pool = pools.process_pool(DEFAULT_DB_ALIAS, small.cluster.connections)
    held = pool.checkout()
    try:
        with pytest.raises(errors.PoolExhausted, match="MAX_POOL_SIZE"):
            small.get("busy")
    finally:
        pool.checkin(held)
    assert small.get("busy") is None


def test_an_idle_connection_killed_by_the_server_is_replaced_before_a_statement(cache):
    """The server closed it while idle (KILL, as wait_timeout or a restart would): the
    pool notices without a round trip and opens another; nothing is sent twice."""
    cache.set("n", 1)
    pool = default_pool()
    victims = list(pool.idle)
    with monitor() as server:
        for raw in victims:
            server.query(f"KILL CONNECTION {raw.thread_id()}".encode())
        for raw in victims:  # the server's close has reached the client
            assert select.select([raw.fileno()], [], [], 10)[0]
        reconnects = pool.reconnects
        before = status_counts(server)
        assert cache.incr("n") == 2  # not safe to send twice: must go out on a live one
        assert status_counts(server)["Com_update"] - before["Com_update"] == 1
    assert pool.reconnects == reconnects + len(victims)
    assert not set(pool.idle) & set(victims)


@contextmanager
def monitor() -> Iterator[Any]:
    """A connection of the test's own to the server of "default"."""
    server = MySQLdb.connect(**connection_params(DEFAULT_DB_ALIAS).kwargs)
    try:
        yield server
    finally:
        server.close()


def status_counts(server: Any) -> dict[str, int]:
    """The server's statement counters (every connection's)."""
    server.query(b"SHOW GLOBAL STATUS WHERE Variable_name IN ('Com_update', 'Com_select')")
    return {name: int(value) for name, value in server.store_result().fetch_row(0)}


# --- forked workers ---------------------------------------------------------------------------


def test_forked_workers_never_share_a_connection(cache):
    """A prefork server forks after the parent used the cache: each child opens its own
    connections and never closes the parent's (closing sends COM_QUIT on the socket
    they share, which ends the parent's session)."""
    cache.set("k", "parent")
    pool = default_pool()
    parent = {raw.thread_id() for raw in pool.idle}
    connects, reconnects = pool.connects, pool.reconnects
    children: list[tuple[int, int]] = []
    for number in range(3):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                os.close(read_end)
                cache.set(f"child{number}", number)
                got = cache.get("k")
                own = [raw.thread_id() for raw in default_pool().idle]
                gc.collect()  # the parent's connections, forgotten: never closed
                os.write(write_end, json.dumps({"got": got, "own": own}).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end) as reply:
            answer = json.loads(reply.read() or "{}")
        _, status = os.waitpid(pid, 0)
        assert status == 0 and answer["got"] == "parent"
        children.append(tuple(answer["own"]))
    seen = [set(own) for own in children]
    assert all(own and not own & parent for own in seen)  # never the parent's
    assert len(set().union(*seen)) == sum(len(own) for own in seen)  # nor each other's
    assert cache.get_many([f"child{n}" for n in range(3)]) == {f"child{n}": n for n in range(3)}
    # The parent's connections are still its own, alive: nothing reopened.
    assert (pool.connects, pool.reconnects) == (connects, reconnects)
    assert parent <= {raw.thread_id() for raw in pool.idle}


# --- timeouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("alias_options, cache_options, expected", [
    # The quick start's alias, the cache's defaults: 1 s to connect, 2 s for a reply.
    ({}, {}, (1, 2, 2, 2.0)),
    # An alias that sets its own keeps them (the write timeout too).
    ({"connect_timeout": 5, "read_timeout": 30, "write_timeout": 7}, {}, (5, 30, 7, 30.0)),
    ({"read_timeout": 10}, {}, (1, 10, 2, 10.0)),
    # The cache's OPTIONS win over the alias's; whole seconds for mysqlclient, the reply
    # wait to the fraction; None: no limit.
    ({"connect_timeout": 5, "read_timeout": 30}, {"CONNECT_TIMEOUT": 2, "IO_TIMEOUT": 0.5},
     (2, 1, 1, 0.5)),
    ({}, {"CONNECT_TIMEOUT": None, "IO_TIMEOUT": None}, (None, None, None, None)),
])
def test_the_cache_s_connections_are_bounded_unless_told_otherwise(
        django_db_blocker, alias_options, cache_options, expected):
    entry = {**connections.settings[DEFAULT_DB_ALIAS], "TEST": {},
             "OPTIONS": {"charset": "utf8mb4", **alias_options}}
    with registered_alias("kvcache_timeouts", entry, django_db_blocker):
        cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": "kvcache_timeouts", **cache_options}})
        params = connection_params("kvcache_timeouts", cache.cluster.connections)
    kwargs = params.kwargs
    assert (kwargs.get("connect_timeout"), kwargs.get("read_timeout"),
            kwargs.get("write_timeout"), params.io_timeout) == expected


def test_io_timeout_bounds_the_wait_for_a_reply_on_both_apis(cache):
    """A statement held up (here by a table lock) fails after IO_TIMEOUT, a fraction of a
    second included, on the sync and the async API alike; not sent again."""
    cache.set("locked", 1)
    strict = make_cache(OPTIONS={"IO_TIMEOUT": 0.3, "IGNORE_EXCEPTIONS": False})
    strict.get("warm-up")
    locker = MySQLdb.connect(**connection_params(DEFAULT_DB_ALIAS).kwargs)
    locker.query(f"LOCK TABLES `{TABLE}` WRITE".encode())
    waits: list[tuple[float, BaseException]] = []

    async def aget() -> None:  # (the loop's connection opens within the clock: quickly)
        started = time.monotonic()
        try:
            await strict.aget("locked")
        except OperationalError as exc:
            waits.append((time.monotonic() - started, exc))

    try:
        started = time.monotonic()
        with pytest.raises(OperationalError) as raised:
            strict.get("locked")
        waits.append((time.monotonic() - started, raised.value))
        asyncio.run(aget())
    finally:
        locker.close()  # (its lock goes with it)
    assert len(waits) == 2
    for waited, error in waits:
        assert 0.25 <= waited < 1.0, waited
        assert errors.classify(error) is errors.TIMED_OUT and error.args[0] == 2013
    assert strict.get("locked") == 1


@pytest.mark.parametrize("name", ["CONNECT_TIMEOUT", "IO_TIMEOUT"])
@pytest.mark.parametrize("value", [0, -1, "soon", float("inf")], ids=repr)
def test_a_bad_timeout_names_the_cache_and_the_option(name, value):
    from django.core.exceptions import ImproperlyConfigured
    from django.core.cache import caches
    from django.test import override_settings

    configured = {"BACKEND": "django_kvcache.backends.mysql.MySQLCache",
                  "LOCATION": TABLE, "OPTIONS": {name: value}}
    with override_settings(CACHES={"sessions": configured}):
        with pytest.raises(ImproperlyConfigured) as raised:
            caches["sessions"]
    assert str(raised.value).startswith(
        f"CACHES['sessions']['OPTIONS'][{name!r}] must be a positive number of seconds"
    ), raised.value


#: A process that used the cache (threads' pool and an event loop's), then forks a worker
#: that exits the way gunicorn's, uWSGI's and Celery's workers do: ``sys.exit()``, which
#: finalizes the interpreter (every object it still holds is deallocated). The workers
#: the test above forks end with ``os._exit()``, which skips that. Prints the cache's
#: server sessions before the fork, and the ones still open after the worker exited.
FORKING_PARENT = """
import asyncio, os, sys, time
import django
PARENT = os.getpid()
django.setup()
from django_kvcache.backends.mysql import MySQLCache
import MySQLdb
from django_kvcache.mysql import blocking
from django_kvcache.mysql.connect import connection_params

cache = MySQLCache(sys.argv[1], {"OPTIONS": {"CULL_PROBABILITY": 0}})
cache.create_table()

def sessions():  # asked on a connection of the script's own
    watcher = MySQLdb.connect(**connection_params("default").kwargs)
    try:
        watcher.query(b"SELECT ID FROM information_schema.PROCESSLIST "
                      b"WHERE DB = DATABASE() AND ID <> CONNECTION_ID()")
        return sorted(row[0] for row in watcher.store_result().fetch_row(0))
    finally:
        watcher.close()

async def main():
    cache.set("k", "parent")
    await cache.aset("k", "parent")  # this loop's pool: open while the worker runs
    before = sessions()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # the worker's end: raised through asyncio.run, the interpreter exits
    os.waitpid(pid, 0)
    time.sleep(0.5)  # the server has read a COM_QUIT by now, if one was sent
    print(before, sessions(), await cache.aget("k"), cache.get("k"))

try:
    asyncio.run(main())
finally:
    if os.getpid() == PARENT:
        blocking.query("default", cache.drop_table_sql().split(";")[0])
"""


def test_a_forked_worker_that_exits_normally_leaves_its_parent_s_sessions_open(cache):
    """A forked child must never send COM_QUIT on the sockets it inherited: the server
    would end the parent's sessions (a parent thread using one gets 2013). At interpreter
    exit mysqlclient closes every connection still referenced, so the child's copies of
    its parent's connections must be closed without a word to the server."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings",
           "PYTHONPATH": os.getcwd()}
    result = subprocess.run([sys.executable, "-c", FORKING_PARENT, "kvcache_fork_exit"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    sessions = [ast.literal_eval(part) for part in re.findall(r"\[[^]]*\]", result.stdout)]
    assert len(sessions) == 2 and len(sessions[0]) >= 2, result.stdout
    assert sessions[1] == sessions[0], "the worker's exit ended its parent's sessions"
    assert result.stdout.split("]")[-1].split() == ["parent", "parent"]


# --- Django's test cases ----------------------------------------------------------------------

#: A cache on every kind of alias: "default", a TEST MIRROR of it, another server.
ALIASES = ["default", "cache", *SHARD_ALIASES[1:2]]


class OnEveryAlias:
    """What each test case checks: caches on aliases the case does not list work."""

    databases: Any = {"default"}

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()  # type: ignore[misc]
        cls.caches = [make_cache(KEY_PREFIX=alias, OPTIONS={"DATABASE": alias})
                      for alias in ALIASES]

    def tearDown(self) -> None:
        for cache in self.caches:
            cache.clear()
        super().tearDown()  # type: ignore[misc]

    def test_a_cache_on_any_alias_works(self) -> None:
        for number, cache in enumerate(self.caches):
            cache.set("key", number)
            assert cache.get("key") == number
            assert cache.add("added", 1) and cache.incr("added") == 2


class DefaultOnlyTestCase(OnEveryAlias, TestCase):
    """A TestCase listing only "default" (Django stops any query on another alias)."""


class DefaultOnlyTransactionTestCase(OnEveryAlias, TransactionTestCase):
    """A TransactionTestCase listing only "default"."""


class DefaultOnlyLiveServerTestCase(LiveServerTestCase):
    """A view the live server runs (another thread) writes a MySQLCache on the TEST
    MIRROR alias "cache"; the test reads it back in its own thread."""

    databases: Any = {"default"}

    def test_a_view_in_the_live_server_uses_the_cache(self) -> None:
        reader = make_cache(OPTIONS={"DATABASE": "cache"})
        reader.delete("live")
        url = f"{self.live_server_url}/mysql-cache/cache/live?value=served"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.read() == b"served"
        assert reader.get("live") == "served"  # the same (test) database
        reader.delete("live")
