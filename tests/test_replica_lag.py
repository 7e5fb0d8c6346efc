"""MAX_REPLICA_LAG against the real replica (issue 22): reads go to the primary while the
replica is further behind than the bound — delayed (``MASTER_DELAY``), its SQL thread
stopped, unreachable, or replicating nothing — and to the replica again once it has caught
up; the lag is asked at most once per interval whatever the call rate and the number of
threads (counted by the server itself). Each routing test runs through the blocking API
and the asyncio one (``aget`` on an event loop's own connections): one policy, two drivers.

The interval is shortened by making the process's monitor first
(``replica_lag.monitor(alias, interval)``), as an operator would change
``replica_lag.DEFAULT_INTERVAL``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from typing import Any, Iterator

import pytest
from django.db import connections

from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.mysql import replica_lag
from django_kvcache.mysql.replica_lag import (
    INFINITE,
    LagMonitor,
    lag_from_status,
    monitor,
    status_statement,
)
from tests.mysql_support import make_cache, register_alias, unregister_alias
from tests.servers import Replica, free_port
from tests.test_memcached_async import run_on_a_fresh_loop

PRIMARY, REPLICA = "shard2", "shard2_replica"
TABLE = "kvcache_lag"
LAG = 4  # MASTER_DELAY of the delayed-replica tests
QUICK = 0.05  # the monitor's interval where a test wants every read to ask again

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", PRIMARY, REPLICA])
API = ["sync", "async"]


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def status_questions(replica: Replica) -> int:
    """How many SHOW SLAVE STATUS the replica has answered since it started."""
    (row,) = replica.query("SHOW GLOBAL STATUS LIKE 'Com_show_slave_status'")
    return int(row["Value"])


def bounded(replica: Replica, bound: float | None, **options: Any) -> MySQLCache:
    """A cache on PRIMARY reading from REPLICA. Instances of one configuration share this
    thread's READ_YOUR_WRITES window (:func:`read_elsewhere` reads from another thread)."""
    lag = {} if bound is None else {"MAX_REPLICA_LAG": bound}
    cache = make_cache(TABLE, OPTIONS={
        "DATABASE": PRIMARY, "REPLICAS": {PRIMARY: REPLICA}, **lag, **options})
    replica.caught_up()  # the table reaches the replica
    return cache


def reads(api: str, cache: MySQLCache, key: str, count: int = 1) -> list[Any]:
    """``count`` reads of ``key`` one after another: ``get``, or ``aget`` on a fresh loop."""
    if api == "sync":
        return [cache.get(key) for _ in range(count)]

    async def agets() -> list[Any]:
        return [await cache.aget(key) for _ in range(count)]

    return run_on_a_fresh_loop(agets())  # type: ignore[no-any-return]


def read(api: str, cache: MySQLCache, key: str) -> Any:
    return reads(api, cache, key)[0]


def read_elsewhere(api: str, cache: MySQLCache, key: str) -> Any:
    """``read`` in another thread: one whose READ_YOUR_WRITES window the writes of this
    thread did not open."""
    found: list[Any] = []
    thread = threading.Thread(target=lambda: found.append(read(api, cache, key)))
    thread.start()
    thread.join()
    return found[0]


@pytest.fixture
def lag_monitor() -> Iterator[LagMonitor]:
    """The process's monitor of REPLICA, made anew with a short interval."""
    replica_lag.forget(REPLICA)
    yield monitor(REPLICA, interval=QUICK)
    replica_lag.forget(REPLICA)


@pytest.fixture
def writer(replica: Replica) -> Iterator[MySQLCache]:
    cache = bounded(replica, None)
    cache.clear()
    replica.caught_up()
    yield cache
    cache.clear()


def read_until(api: str, cache: MySQLCache, lag_monitor: LagMonitor, until: Any,
               deadline: float) -> list[float]:
    """Read (each read asks the lag: the interval is short) until ``until(lag)`` or the
    deadline; the answers seen."""
    seen: list[float] = []
    while time.monotonic() < deadline and not (seen and until(seen[-1])):
        read(api, cache, "page")
        seen.append(lag_monitor.seconds)
        time.sleep(QUICK)
    return seen


@pytest.mark.parametrize("api", API)
def test_reads_go_to_the_primary_while_a_delayed_replica_is_over_the_bound(
    api, replica, writer, lag_monitor
):
    strict, loose, unbounded = bounded(replica, 0), bounded(replica, 60), bounded(replica, None)
    writer.set("page", "old")
    replica.caught_up()
    # Caught up: zero seconds behind, within either bound: the replica serves them.
    read_until(api, strict, lag_monitor, lambda lag: lag == 0.0, time.monotonic() + 10)
    assert lag_monitor.seconds == 0.0
    with replica.delayed(LAG):
        written = time.monotonic()
        writer.set("page", "new")  # applied LAG - 1 to LAG seconds from now
        seen = read_until(api, strict, lag_monitor, lambda lag: 0 < lag < INFINITE,
                          written + LAG - 1.5)
        assert 0 < seen[-1] <= LAG + 1, seen
        assert all(lag <= LAG + 1 for lag in seen if lag != INFINITE), seen
        # Over the bound: the primary answers, with what was just written.
        assert read(api, strict, "page") == "new"
        # Within a bound of 60 s, or without one, the replica answers: the lag shows.
        assert read(api, loose, "page") == "old"
        assert read_elsewhere(api, unbounded, "page") == "old"
        behind = time.monotonic() - written
        assert behind < LAG - 1, f"the test stalled {behind:.1f} s: the replica may be current"
        assert replica.status()["SQL_Delay"] == LAG
    # delayed() waited until the replica caught up: back to zero, back to the replica.
    read_until(api, strict, lag_monitor, lambda lag: lag == 0.0, time.monotonic() + 10)
    assert lag_monitor.seconds == 0.0
    assert strict.session.reader(strict.shards[0]) == REPLICA


@pytest.mark.parametrize("api", API)
def test_reads_go_to_the_primary_while_the_replica_s_sql_thread_is_stopped(
    api, replica, writer, lag_monitor
):
    cache, unbounded = bounded(replica, 60), bounded(replica, None)
    writer.set("page", "v1")
    replica.caught_up()
    read_until(api, cache, lag_monitor, lambda lag: lag == 0.0, time.monotonic() + 10)
    assert cache.session.reader(cache.shards[0]) == REPLICA
    with replica.sql_thread_stopped():
        writer.set("page", "v2")
        # The read that asks still goes where the last answer said; the next ones do not.
        read_until(api, cache, lag_monitor, lambda lag: lag == INFINITE, time.monotonic() + 10)
        assert lag_monitor.seconds == INFINITE  # stopped: no estimate, infinitely behind
        assert reads(api, cache, "page", 3) == ["v2"] * 3
        assert read_elsewhere(api, unbounded, "page") == "v1"  # the replica has not applied it
        assert replica.status()["Slave_SQL_Running"] == "No"
    read_until(api, cache, lag_monitor, lambda lag: lag == 0.0, time.monotonic() + 10)
    assert cache.session.reader(cache.shards[0]) == REPLICA


@pytest.mark.parametrize("api", API)
def test_asked_at_most_once_per_interval_whatever_the_call_rate(api, replica, writer):
    clock = Clock()
    replica_lag.forget(REPLICA)
    lag_monitor = monitor(REPLICA, interval=3.0)
    lag_monitor.clock = clock
    try:
        cache = bounded(replica, 5)
        writer.set("page", 1)
        replica.caught_up()
        before = status_questions(replica)
        assert reads(api, cache, "page", 200) == [1] * 200
        assert status_questions(replica) - before == 1
        assert lag_monitor.seconds == 0.0
        shard = cache.metrics()["replicas"][REPLICA]
        assert (shard["replica_lag"], shard["replica_behind"]) == (0.0, False)
        clock.now += 2.9
        reads(api, cache, "page", 100)
        assert status_questions(replica) - before == 1
        clock.now += 0.1  # an interval after the last question: one more
        reads(api, cache, "page", 100)
        assert status_questions(replica) - before == 2
        # Writes never ask; nor does a cache without MAX_REPLICA_LAG.
        clock.now += 10
        cache.set("other", 1)
        assert read(api, bounded(replica, None), "page") == 1
        assert status_questions(replica) - before == 2
        assert "replica_lag" not in bounded(replica, None).metrics()["replicas"][REPLICA]
    finally:
        replica_lag.forget(REPLICA)


def test_threads_share_one_question_per_interval(replica, writer):
    """32 threads reading at once, each with its own instance and connections: one
    question to the server; the readers that are not asking never wait for the one that
    is (they read the primary until the answer is in)."""
    replica_lag.forget(REPLICA)
    monitor(REPLICA, interval=60)
    writer.set("page", 1)
    replica.caught_up()
    barrier = threading.Barrier(32)
    answers: list[Any] = []

    def reader() -> None:
        cache = bounded(replica, 5)
        barrier.wait(30)
        try:
            answers.extend(cache.get("page") for _ in range(50))
        finally:
            connections.close_all()

    before = status_questions(replica)
    try:
        threads = [threading.Thread(target=reader) for _ in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert status_questions(replica) - before == 1
        assert answers == [1] * (32 * 50)
        assert monitor(REPLICA).seconds == 0.0
    finally:
        replica_lag.forget(REPLICA)


@pytest.mark.parametrize("api", API)
def test_an_unreachable_replica_sends_reads_to_the_primary_logged_once(
    api, replica, writer, django_db_blocker, caplog
):
    """The question fails: infinitely behind, one log line for the episode, and neither
    the call nor the replica's health pays for it."""
    alias = "lag_unreachable"
    register_alias(alias, {**connections.settings[REPLICA], "PORT": str(free_port())})
    clock = Clock()
    replica_lag.forget(alias)
    monitor(alias, interval=1.0).clock = clock
    try:
        with django_db_blocker.unblock(), \
                caplog.at_level(logging.WARNING, logger="django_kvcache.mysql.replica_lag"):
            cache = make_cache(TABLE, OPTIONS={
                "DATABASE": PRIMARY, "REPLICAS": {PRIMARY: alias}, "MAX_REPLICA_LAG": 60,
                "IGNORE_EXCEPTIONS": True})
            writer.set("page", "fresh")
            for _ in range(5):
                assert read(api, cache, "page") == "fresh"
                assert monitor(alias).seconds == INFINITE
                clock.now += 1.0  # each read asks again
            shard = cache.metrics()["replicas"][alias]
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and f"MySQL replica lag failure on {alias}" in lines[0], lines
        assert shard["errors"] == shard["consecutive_failures"] == 0 and not shard["down"]
        assert (shard["replica_lag"], shard["replica_behind"]) == (None, True)
    finally:
        replica_lag.failures.recovered(alias)
        replica_lag.forget(alias)
        unregister_alias(alias)


def test_a_server_that_replicates_nothing_is_infinitely_behind(replica, writer):
    """shard3 is a server of its own: no replication status, so no replica to trust."""
    replica_lag.forget("shard3")
    try:
        cache = make_cache(TABLE, OPTIONS={
            "DATABASE": PRIMARY, "REPLICAS": {PRIMARY: "shard3"}, "MAX_REPLICA_LAG": 60})
        writer.set("page", "on the primary only")
        assert cache.get("page") == "on the primary only"
        assert monitor("shard3").seconds == INFINITE
    finally:
        replica_lag.forget("shard3")


def test_one_monitor_per_alias_and_process():
    assert monitor(REPLICA) is monitor(REPLICA)
    assert monitor(REPLICA) is not monitor(PRIMARY)
    replica_lag.forget("other-alias")  # forgetting an unknown alias is harmless


@pytest.mark.parametrize(
    "columns, rows, expected",
    [
        (["Slave_SQL_Running", "Seconds_Behind_Master"], [("Yes", 7)], 7.0),
        (["Replica_SQL_Running", "Seconds_Behind_Source"], [("Yes", 0)], 0.0),
        (["Slave_SQL_Running", "Seconds_Behind_Master"], [("Yes", None)], INFINITE),
        (["Slave_SQL_Running", "Seconds_Behind_Master"], [("No", 3)], INFINITE),
        (["Slave_SQL_Running", "Seconds_Behind_Master"], [], INFINITE),
    ],
)
def test_lag_from_status(columns, rows, expected):
    assert lag_from_status(columns, rows) == expected


def test_status_statement_per_server():
    assert status_statement(True, (10, 11, 9)) == "SHOW SLAVE STATUS"
    assert status_statement(False, (8, 0, 21)) == "SHOW SLAVE STATUS"
    assert status_statement(False, (8, 4, 0)) == "SHOW REPLICA STATUS"
    assert math.isinf(INFINITE)


def test_a_hung_replica_is_logged_once_not_once_per_question(replica, writer, django_db_blocker,
                                                             caplog):
    """A replica that accepts connections and never answers: each question fails with a
    lost connection (2013) after connect_timeout. The lag log says so once for the
    episode; no other line is written per question (the "not retried, the server may
    have run it" warning is for the calls' own statements, not for questions on the side)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    alias = "lag_hung"
    entry = connections.settings[REPLICA]
    register_alias(alias, {**entry, "PORT": str(listener.getsockname()[1]),
                           "OPTIONS": {**entry["OPTIONS"], "connect_timeout": 1}})
    clock = Clock()
    replica_lag.forget(alias)
    monitor(alias, interval=1.0).clock = clock
    try:
        with django_db_blocker.unblock(), caplog.at_level(logging.WARNING):
            cache = make_cache(TABLE, OPTIONS={
                "DATABASE": PRIMARY, "REPLICAS": {PRIMARY: alias}, "MAX_REPLICA_LAG": 60,
                "IGNORE_EXCEPTIONS": True})
            writer.set("page", "fresh")
            for _ in range(3):
                assert cache.get("page") == "fresh"
                clock.now += 1.0  # each read asks again
        lines = [record.getMessage() for record in caplog.records]
        assert len(lines) == 1 and f"MySQL replica lag failure on {alias}" in lines[0], lines
    finally:
        listener.close()
        replica_lag.failures.recovered(alias)
        replica_lag.forget(alias)
        connections[alias].close()
        unregister_alias(alias)
