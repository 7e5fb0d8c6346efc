"""Concurrency guarantees, for every kvcache backend, with real processes and threads.

Mixed into a :class:`~tests.contract.CacheFixture` subclass. Worker processes are
forked and build their own cache (their own connections) from ``backend_params``; they
report through a queue, and every figure is checked exactly, never approximately.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any, Callable

from django.db import connections

FORK = multiprocessing.get_context("fork")
WORKER_TIMEOUT = 60


#: The parent's DB-API connections a forked child inherited, kept referenced: a
#: mysqlclient connection that is garbage-collected closes itself, sending COM_QUIT on
#: the socket it shares with the parent, whose session the server then ends.
_inherited: list[Any] = []


def forget_inherited_connections() -> None:
    """A forked child must not talk on its parent's database sockets: drop (not close) them."""
    for connection in connections.all():
        if connection.connection is not None:
            _inherited.append(connection.connection)
        connection.connection = None


def run_processes(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(index)`` in ``count`` forked processes; return their results by index."""
    pipes = [FORK.Pipe(duplex=False) for _ in range(count)]

    def child(index: int) -> None:
        forget_inherited_connections()
        try:
            outcome = ("ok", work(index))
        except BaseException as exc:  # reported to the parent, which fails the test
            outcome = ("error", repr(exc))
        pipes[index][1].send(outcome)  # synchronous, unlike a Queue's feeder thread
        os._exit(0)  # skip the pytest and atexit machinery inherited from the parent

    processes = [FORK.Process(target=child, args=(index,)) for index in range(count)]
    for process in processes:
        process.start()
    outcomes = []
    for index, (reader, _) in enumerate(pipes):
        assert reader.poll(WORKER_TIMEOUT), f"worker {index} did not answer"
        outcomes.append(reader.recv())
    for process in processes:
        process.join(timeout=WORKER_TIMEOUT)
    errors = [detail for status, detail in outcomes if status == "error"]
    assert not errors, errors
    return [result for _, result in outcomes]


class ConcurrencyContract:
    build: Callable[..., Any]

    def test_processes_incrementing_one_key_lose_no_update(self, cache):
        cache.set("counter", 0, timeout=None)

        def work(index: int) -> int:
            own = self.build()
            for _ in range(500):
                own.incr("counter")
            return 500

        assert sum(run_processes(4, work)) == 2000
        assert cache.get("counter") == 2000

    def test_racing_add_has_exactly_one_winner(self, cache):
        trials = 100
        barrier = FORK.Barrier(8)

        def work(index: int) -> list[bool]:
            own = self.build()
            won = []
            for trial in range(trials):
                barrier.wait(timeout=WORKER_TIMEOUT)
                won.append(own.add(f"race-{trial}", index))
            return won

        results = run_processes(8, work)
        for trial in range(trials):
            winners = [index for index, won in enumerate(results) if won[trial]]
            assert len(winners) == 1, (trial, winners)
            assert cache.get(f"race-{trial}") == winners[0]

    def test_racing_get_or_set_agrees_on_one_value(self, cache):
        barrier = FORK.Barrier(8)

        def work(index: int) -> list[Any]:
            own = self.build()
            seen = []
            for trial in range(20):
                barrier.wait(timeout=WORKER_TIMEOUT)
                seen.append(own.get_or_set(f"computed-{trial}", lambda: f"by {index}"))
            return seen

        results = run_processes(8, work)
        for trial in range(20):
            assert len({seen[trial] for seen in results}) == 1, trial
            assert cache.get(f"computed-{trial}") == results[0][trial]

    def test_threads_sharing_one_instance_see_only_their_keys(self, cache):
        wrong: list[tuple] = []
        errors: list[str] = []

        def work(thread: int) -> None:
            try:
                check(thread)
            except Exception as exc:  # an exception must fail the test, not end a thread quietly
                errors.append(repr(exc))
            finally:
                connections.close_all()  # this thread's own database connections

        def check(thread: int) -> None:
            for round_ in range(300):
                key = f"thread-{thread}-{round_ % 7}"
                value = (key, round_)
                cache.set(key, value)
                got = cache.get(key)
                if got != value:
                    wrong.append((key, value, got))
                many = cache.get_many([key, f"thread-{thread}-missing"])
                if many != {key: value}:
                    wrong.append((key, value, many))

        threads = [threading.Thread(target=work, args=(index,)) for index in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=WORKER_TIMEOUT)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == []
        assert wrong == []
