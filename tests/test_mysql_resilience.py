"""MySQLCache under concurrency (separate processes) and after a dropped connection."""
from __future__ import annotations

import logging
import multiprocessing
import os
import random
import select
import time
from contextlib import contextmanager
from typing import Any, Iterator

import MySQLdb
import pytest
from django.core.cache import caches
from django.db import OperationalError, ProgrammingError, connections, transaction
from django.test import override_settings

from django_kvcache.backends.mysql import ALWAYS_FITS, MySQLCache
from django_kvcache.mysql import blocking, pools
from django_kvcache.mysql.connect import connection_params
from tests.mysql_support import (  # noqa: F401  (fixtures)
    TABLE,
    insert_row,
    make_cache,
    mysql_tables,
    registered_alias,
    rows,
    sent_statements,
)

PROCESSES = 4
INCREMENTS = 150
RACED_KEYS = 120

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "cache"])


# --- child processes: fresh interpreters with their own connections ----------------------------


_start_line = None


def start_child(database_name: str, start_line) -> None:
    global _start_line
    _start_line = start_line
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    connections["default"].settings_dict["NAME"] = database_name


def child_cache() -> MySQLCache:
    """A cache on a fresh connection, once every process is ready: they start together."""
    cache = MySQLCache(TABLE, {"OPTIONS": {"CULL_PROBABILITY": 0}})
    cache.has_key("warm-up")  # connect and detect the server before the race
    _start_line.wait(timeout=60)
    return cache


def increment_many(_: int) -> list[int]:
    cache = child_cache()
    return [cache.incr("counter") for _ in range(INCREMENTS)]


def raced_order(worker: int) -> list[int]:
    """Each process goes through the keys in its own order, so they meet on many keys."""
    order = list(range(RACED_KEYS))
    random.Random(worker).shuffle(order)
    return order


def add_all(worker: int) -> list[str]:
    cache = child_cache()
    return [f"race{i}" for i in raced_order(worker) if cache.add(f"race{i}", worker)]


def get_or_set_all(worker: int) -> list[int]:
    cache = child_cache()
    got = {i: cache.get_or_set(f"gos{i}", lambda: worker) for i in raced_order(worker)}
    return [got[i] for i in range(RACED_KEYS)]


@pytest.fixture
def pool(mysql_tables):
    context = multiprocessing.get_context("spawn")  # no inherited sockets
    database_name = connections["default"].settings_dict["NAME"]
    # One task per process: a process waiting at the barrier cannot take a second task.
    start_line = context.Barrier(PROCESSES)
    initargs = (database_name, start_line)
    with context.Pool(PROCESSES, initializer=start_child, initargs=initargs) as pool:
        yield pool


@pytest.fixture
def shared(mysql_tables):
    cache = make_cache()
    cache.clear()
    yield cache
    cache.clear()


def test_concurrent_increments_lose_nothing(shared, pool):
    shared.set("counter", 0)
    results = pool.map(increment_many, range(PROCESSES))
    returned = [value for worker in results for value in worker]
    assert shared.get("counter") == PROCESSES * INCREMENTS
    # Each increment saw its own result: no two callers ever got the same value.
    assert sorted(returned) == list(range(1, PROCESSES * INCREMENTS + 1))
    # And they really interleaved: some process saw gaps made by the others.
    assert any(worker != list(range(worker[0], worker[0] + INCREMENTS)) for worker in results)


def test_racing_add_has_exactly_one_winner(shared, pool):
    past = int(time.time() * 1000) - 1000
    for i in range(0, RACED_KEYS, 2):  # half the keys hold an expired row to overwrite
        insert_row(f":1:race{i}", b"stale", 0, past)
    results = pool.map(add_all, range(PROCESSES))
    for i in range(RACED_KEYS):
        winners = [worker for worker, won in enumerate(results) if f"race{i}" in won]
        assert len(winners) == 1, (i, winners)
        assert shared.get(f"race{i}") == winners[0]
    assert sum(1 for won in results if won) > 1  # the race was real: several processes won


def test_racing_get_or_set_agrees_on_one_value(shared, pool):
    results = pool.map(get_or_set_all, range(PROCESSES))
    for i in range(RACED_KEYS):
        seen = {worker_results[i] for worker_results in results}
        assert len(seen) == 1, (i, seen)  # every process got the same, winning value
        assert shared.get(f"gos{i}") == seen.pop()


# --- dropped connections ------------------------------------------------------------------


@contextmanager
def monitor(alias: str = "default") -> Iterator[Any]:
    """A connection of the test's own to ``alias``'s database."""
    server = MySQLdb.connect(**connection_params(alias).kwargs)
    try:
        yield server
    finally:
        server.close()


def kill(alias: str) -> None:
    """Kill the server side of the cache's idle connections to ``alias``, as a restart or
    wait_timeout would."""
    victims = list(pools.process_pool(alias).idle)
    assert victims
    with monitor(alias) as killer:
        for raw in victims:
            killer.query(f"KILL CONNECTION {raw.thread_id()}".encode())
    # The server closes the socket right after KILL returns; wait (bounded) until that
    # reached the client, so the test does not race the server's close.
    for raw in victims:
        assert select.select([raw.fileno()], [], [], 10)[0], "a killed connection stayed open"


@pytest.mark.parametrize(
    "operation, expected",
    [
        (lambda c: c.get("key"), "value"),
        (lambda c: c.set("other", 1), None),
        (lambda c: c.get_many(["key", "n"]), {"key": "value", "n": 1}),
        (lambda c: c.keys_with_prefix("k"), ["key"]),
        (lambda c: c.delete("key"), True),
        (lambda c: c.add("fresh", 1), True),
        (lambda c: c.incr("n", 2), 3),
    ],
)
def test_an_operation_after_a_dropped_connection_is_sent_once_on_a_fresh_one(
    shared, operation, expected
):
    """The pool notices the closed connection before sending (a zero-timeout poll of
    its socket), whatever the operation: nothing is sent on it, nothing twice."""
    shared.set_many({"key": "value", "n": 1})
    kill("default")
    with sent_statements() as sent:
        assert operation(shared) == expected
    assert len(sent) == 1


def test_a_large_write_on_a_dropped_connection_reads_the_packet_limit_again(shared):
    big = random.Random(1).randbytes(ALWAYS_FITS * 2)
    blocking.close_pools(["default"])
    shared.get("warm-up")  # a new connection, never asked for its packet limit
    kill("default")
    shared.set("big", big)
    assert shared.get("big") == big


def test_inside_a_caller_s_transaction_a_dropped_connection_is_replaced(mysql_tables):
    """The caller's atomic() is not the cache's: its connection, dropped, is replaced as
    anywhere else, and its writes are committed."""
    cache = make_cache(OPTIONS={"DATABASE": "cache"})
    cache.set("key", "value")
    with pytest.raises(RuntimeError):
        with transaction.atomic(using="cache"):
            assert cache.get("key") == "value"
            kill("cache")
            cache.set("key", "inside")
            raise RuntimeError("the view failed")
    assert cache.get("key") == "inside"
    cache.clear()


def test_other_errors_are_not_retried(mysql_tables):
    missing = MySQLCache("kvcache_no_such_table", {})
    with sent_statements() as sent:
        with pytest.raises(ProgrammingError):
            missing.get("key")
    assert len(sent) == 1


def test_no_alias_joins_the_caller_s_transaction(mysql_tables):
    """On its own alias or on "default", the cache writes on connections of its own:
    a failed view's transaction does not take its writes with it."""
    dedicated = make_cache(OPTIONS={"DATABASE": "cache"})
    on_default = make_cache()
    dedicated.clear()
    with pytest.raises(RuntimeError):
        with transaction.atomic(using="default"):
            dedicated.set("dedicated", 1)
            on_default.set("shared", 1)
            raise RuntimeError("the view failed")
    assert dedicated.get("dedicated") == 1
    assert on_default.get("shared") == 1
    dedicated.clear()


# --- lock conflicts -----------------------------------------------------------------------

SHORT_WAITS = "kvcache_short_lock_waits"


@pytest.fixture
def short_lock_waits(mysql_tables, django_db_blocker) -> Iterator[str]:
    """An alias of the test database whose sessions wait one second for a row lock
    (InnoDB's default is 50)."""
    entry = connections["default"].settings_dict
    options = {**entry["OPTIONS"], "init_command": "SET SESSION innodb_lock_wait_timeout = 1"}
    with registered_alias(SHORT_WAITS, {**entry, "OPTIONS": options, "TEST": {}},
                          django_db_blocker):
        yield SHORT_WAITS


@contextmanager
def row_locked_elsewhere(stored_key: str) -> Iterator[None]:
    """Another connection holds ``stored_key``'s row lock in an open transaction."""
    with monitor() as locker:
        locker.query(b"BEGIN")
        locker.query(f"SELECT 1 FROM `{TABLE}` WHERE `cache_key` = '{stored_key}' FOR UPDATE"
                     .encode())
        locker.store_result()
        try:
            yield
        finally:
            locker.query(b"ROLLBACK")


def test_a_cull_blocked_by_locks_is_skipped_and_the_write_succeeds(shared, short_lock_waits,
                                                                    caplog):
    culling_cache = make_cache(OPTIONS={"CULL_PROBABILITY": 1, "DATABASE": short_lock_waits})
    insert_row(":1:old", b"x", 0, int(time.time() * 1000) - 1000)
    with row_locked_elsewhere(":1:old"):
        with caplog.at_level(logging.INFO, logger="django_kvcache"):
            culling_cache.set("new", 1)
    assert "skipped after a lock conflict" in caplog.text
    assert culling_cache.get("new") == 1
    assert [key for key, *_ in rows()] == [":1:new", ":1:old"]
    assert culling_cache.cull() == 1  # the next cull gets it


def test_a_statement_that_timed_out_on_a_lock_is_retried_once(shared, short_lock_waits):
    waiting = make_cache(OPTIONS={"DATABASE": short_lock_waits, "IGNORE_EXCEPTIONS": False})
    waiting.set("key", 1)
    with row_locked_elsewhere(":1:key"):
        with sent_statements() as sent:
            with pytest.raises(OperationalError) as raised:
                waiting.set("key", 2)
    assert raised.value.args[0] == 1205
    assert len(sent) == 2
    assert waiting.get("key") is None  # the failed write's older copy is not served


def test_a_missing_table_names_the_cache_and_the_command_that_creates_it(mysql_tables):
    missing = {"BACKEND": "django_kvcache.backends.mysql.MySQLCache",
               "LOCATION": "kvcache_no_such_table"}
    with override_settings(CACHES={"default": missing, "other": {**missing, "LOCATION": "x"}}):
        with pytest.raises(ProgrammingError) as raised:
            caches["default"].set("key", 1)
    message = str(raised.value)
    assert "'kvcache_no_such_table'" in message and "cache 'default'" in message
    assert "database 'default'" in message
    assert "manage.py kvcache_createtable default'" in message
    assert raised.value.__cause__.args[0] == 1146  # the server's error, chained


def test_a_missing_table_of_a_cache_outside_caches_names_its_backend(mysql_tables):
    with pytest.raises(ProgrammingError) as raised:
        MySQLCache("kvcache_no_such_table", {}).get("key")
    assert "django_kvcache.backends.mysql.MySQLCache" in str(raised.value)
    assert "cache.create_table()" in str(raised.value)
