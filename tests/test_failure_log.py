"""FailureLog: a line when a source starts failing, a summary per interval, a line at the end.

Unit tests with a clock the test moves by hand; the memcached backend's use of it, against
a dead node, is in tests/test_memcached_ops.py.
"""
from __future__ import annotations

import logging

import pytest

from django_kvcache.failure_log import FailureLog

LOGGER = "tests.failure_log"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def failures(clock):
    return FailureLog(logging.getLogger(LOGGER), "test", interval=60, clock=clock)


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)

    def messages():
        return [record.getMessage() for record in caplog.records if record.name == LOGGER]

    return messages


def test_first_failure_of_an_episode_is_logged_with_its_error(failures, lines):
    failures.failed("server-a", "refused")
    assert lines() == [
        "Ignored test failure on server-a: refused "
        "(further failures there are summarized at most every 60 s)"
    ]


def test_failures_within_the_interval_are_counted_not_logged(failures, clock, lines):
    failures.failed("server-a", "refused")
    for _ in range(5000):
        clock.now += 0.01  # 50 s in all
        failures.failed("server-a", "refused")
    assert len(lines()) == 1


def test_each_counted_failure_has_a_debug_line(failures, clock, caplog):
    # A burst that stops before the interval is up gets no summary until the next
    # failure; at DEBUG, none of it goes unlogged meanwhile.
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    failures.failed("server-a", "refused")
    for n in range(3):
        clock.now += 1
        failures.failed("server-a", f"timed out {n}")
    levels = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert [level for level, _ in levels] == ["WARNING", "DEBUG", "DEBUG", "DEBUG"]
    assert levels[3][1] == "test failure on server-a, counted for its summary: timed out 2"


def test_one_summary_per_interval_with_the_exact_count_and_last_error(failures, clock, lines):
    failures.failed("server-a", "first")
    for step in range(1, 1041):  # 130 s of failures, eight a second
        clock.now += 0.125
        failures.failed("server-a", f"error {step}")
    summaries = lines()[1:]
    assert summaries == [
        "480 more test failure(s) ignored on server-a in 60.0 s (last: error 480)",
        "480 more test failure(s) ignored on server-a in 60.0 s (last: error 960)",
    ]


def test_recovery_closes_the_episode_with_its_total(failures, clock, lines):
    failures.failed("server-a", "refused")
    clock.now += 1
    failures.failed("server-a", "timed out")
    clock.now += 2
    failures.recovered("server-a")
    assert lines()[-1] == (
        "test server-a answers again: 2 failure(s) ignored in 3.0 s (last: timed out)"
    )
    failures.failed("server-a", "refused again")  # a new episode: logged at once
    assert lines()[-1].startswith("Ignored test failure on server-a: refused again")


def test_recovery_of_a_source_that_did_not_fail_logs_nothing(failures, lines):
    failures.recovered("server-a")
    assert lines() == []


def test_sources_have_episodes_of_their_own(failures, clock, lines):
    failures.failed("server-a", "refused")
    failures.failed("server-b", "refused")
    failures.failed("server-a", "refused")
    failures.recovered("server-b")
    assert [line.split(":")[0] for line in lines()] == [
        "Ignored test failure on server-a",
        "Ignored test failure on server-b",
        "test server-b answers again",
    ]


def test_a_quiet_interval_ends_the_episode_and_reports_what_was_left(failures, clock, lines):
    failures.failed("server-a", "refused")
    clock.now += 1
    failures.failed("server-a", "refused")
    clock.now += 3600  # no failure for an hour, and nobody said the source recovered
    failures.failed("server-a", "timed out")
    assert lines()[1:] == [
        "1 more test failure(s) ignored on server-a in 1.0 s (last: refused)",
        "Ignored test failure on server-a: timed out "
        "(further failures there are summarized at most every 60 s)",
    ]


def test_first_line_is_a_warning(failures, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    failures.failed("server-a", "refused")
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
