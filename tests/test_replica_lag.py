"""The replica-lag monitor (django_kvcache.mysql.replica_lag) against the real replica:
delayed, with its SQL thread stopped, caught up, unreachable; asked at most once per
interval whatever the number of calls and threads (counted by the server itself)."""
from __future__ import annotations

import logging
import math
import threading
import time

import pytest
from django.db import connections

from django_kvcache.mysql import replica_lag
from django_kvcache.mysql.replica_lag import (
    INFINITE,
    LagMonitor,
    lag_from_status,
    monitor,
    status_statement,
)
from tests.mysql_support import register_alias, unregister_alias
from tests.servers import Replica, free_port

PRIMARY, REPLICA = "shard2", "shard2_replica"
LAG = 4  # MASTER_DELAY of the delayed-replica test

on_the_replica = pytest.mark.django_db(transaction=True, databases=["default", PRIMARY, REPLICA])


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


def write_on_primary(value: int) -> None:
    with connections[PRIMARY].cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS lag_probe (id INT PRIMARY KEY, v INT)")
        cursor.execute("REPLACE INTO lag_probe VALUES (1, %s)", [value])


@pytest.fixture
def lag_monitor(replica: Replica):
    return LagMonitor(REPLICA, interval=0.0)  # asks on every call: the tests poll it


def ask(lag_monitor: LagMonitor) -> float:
    return lag_monitor.ask(connections[REPLICA])


@on_the_replica
def test_a_caught_up_replica_is_zero_seconds_behind(replica, lag_monitor):
    write_on_primary(1)
    replica.caught_up()
    assert ask(lag_monitor) == 0.0


@on_the_replica
def test_a_delayed_replica_is_behind_by_about_its_delay(replica, lag_monitor):
    write_on_primary(1)
    replica.caught_up()
    with replica.delayed(LAG):
        write_on_primary(2)  # held back LAG seconds: the estimate grows meanwhile
        seen = []
        deadline = time.monotonic() + LAG + 5
        while time.monotonic() < deadline and (not seen or not LAG - 1 <= seen[-1] < INFINITE):
            seen.append(ask(lag_monitor))
            time.sleep(0.2)
        assert LAG - 1 <= seen[-1] <= LAG + 1, seen
        # Never further behind than the delay (INFINITE: the server had no estimate yet).
        assert all(lag <= LAG + 1 for lag in seen if lag != INFINITE), seen
    assert ask(lag_monitor) == 0.0  # delayed() waited until it caught up


@on_the_replica
def test_a_replica_whose_sql_thread_is_stopped_is_infinitely_behind(replica, lag_monitor):
    replica.caught_up()
    assert ask(lag_monitor) == 0.0
    with replica.sql_thread_stopped():
        assert ask(lag_monitor) == INFINITE
        write_on_primary(3)
        assert ask(lag_monitor) == INFINITE
    assert ask(lag_monitor) == 0.0


@on_the_replica
def test_a_server_that_replicates_nothing_is_infinitely_behind(replica):
    assert LagMonitor(PRIMARY).ask(connections[PRIMARY]) == INFINITE


@on_the_replica
def test_asked_at_most_once_per_interval_whatever_the_calls(replica):
    clock = Clock()
    lag_monitor = LagMonitor(REPLICA, interval=3.0, clock=clock)
    connection = connections[REPLICA]
    before = status_questions(replica)
    answers = set()
    for _ in range(500):
        if lag_monitor.claim():
            lag_monitor.ask(connection)
        answers.add(lag_monitor.seconds)
    assert status_questions(replica) - before == 1
    clock.now += 2.9
    assert not lag_monitor.claim()
    clock.now += 0.1  # an interval after the last question
    assert lag_monitor.claim() and not lag_monitor.claim()
    assert answers == {0.0}


@on_the_replica
def test_threads_share_one_question_per_interval(replica):
    """32 threads calling at once on their own connections: one question to the server;
    the callers that are not asking never wait for the one that is."""
    alias = REPLICA
    replica_lag.forget(alias)
    barrier = threading.Barrier(32)
    answers: list[float] = []

    def caller() -> None:
        barrier.wait(30)
        try:
            answers.extend(replica_lag.replica_lag(alias, interval=60) for _ in range(50))
        finally:
            connections[alias].close()

    before = status_questions(replica)
    try:
        threads = [threading.Thread(target=caller) for _ in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert status_questions(replica) - before == 1
        assert len(answers) == 32 * 50
        # Before the asker's answer, the others had only INFINITE (no answer yet).
        assert set(answers) <= {0.0, INFINITE} and answers.count(0.0) >= 50
        assert replica_lag.replica_lag(alias, interval=60) == 0.0  # no new question
        assert status_questions(replica) - before == 1
    finally:
        replica_lag.forget(alias)


@on_the_replica
def test_one_monitor_per_alias_and_process(replica):
    assert monitor(REPLICA) is monitor(REPLICA)
    assert monitor(REPLICA) is not monitor(PRIMARY)
    replica_lag.forget("other-alias")  # forgetting an unknown alias is harmless


def test_an_unreachable_replica_is_infinitely_behind_and_logged_once(django_db_blocker, caplog):
    alias = "lag_unreachable"
    register_alias(alias, {**connections.settings[REPLICA], "PORT": str(free_port())})
    clock = Clock()
    lag_monitor = LagMonitor(alias, interval=1.0, clock=clock)
    try:
        with django_db_blocker.unblock(), \
                caplog.at_level(logging.WARNING, logger="django_kvcache.mysql.replica_lag"):
            for _ in range(5):
                assert lag_monitor.claim()
                assert lag_monitor.ask(connections[alias]) == INFINITE
                clock.now += 1.0
        assert len(caplog.records) == 1
        assert f"MySQL replica lag failure on {alias}" in caplog.records[0].getMessage()
    finally:
        replica_lag.failures.recovered(alias)
        unregister_alias(alias)


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
