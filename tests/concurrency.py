"""Concurrency guarantees, for every kvcache backend, with real processes and threads.

Mixed into a :class:`~tests.contract.CacheFixture` subclass. Worker processes are
forked and build their own cache (their own connections) from ``backend_params``; they
report through a queue, and every figure is checked exactly, never approximately.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import weakref
from typing import Any, Callable

from django.db import connections
from django.db.backends.signals import connection_created

from django_kvcache import forks

FORK = multiprocessing.get_context("fork")
WORKER_TIMEOUT = 60


#: Every Django connection (a ``DatabaseWrapper``) this process made, in any thread:
#: Django's connections are per thread, and asgiref's executor thread, where the async ORM
#: runs, has its own.
_wrappers: weakref.WeakSet[Any] = weakref.WeakSet()
_wrappers_lock = threading.Lock()
#: Their DB-API connections open at a fork, gathered in the parent just before it.
_open_at_fork: list[Any] = []


def _remember(sender: Any, connection: Any, **kwargs: Any) -> None:
    with _wrappers_lock:
        _wrappers.add(connection)


def _before_fork() -> None:
    _wrappers_lock.acquire()  # released on both sides of the fork: no thread adds meanwhile
    _open_at_fork[:] = [w.connection for w in _wrappers if w.connection is not None]


def _after_fork_in_parent() -> None:
    _open_at_fork.clear()
    _wrappers_lock.release()


def _after_fork_in_child() -> None:
    """Point every inherited Django socket at ``/dev/null`` and forget it.

    The other threads' connections are garbage in the child (it has only the forking
    thread), which its garbage collector deallocates whenever it runs; mysqlclient then
    closes each, and the ``COM_QUIT`` it sends on the socket shared with the parent would
    end the parent's session. Pointed at ``/dev/null``, a socket takes it harmlessly,
    however the child ends; forgotten, the forking thread's connection is not used by the
    child either: Django opens it one of its own."""
    _wrappers_lock.release()  # the one thread here took it before the fork
    for wrapper in list(_wrappers):
        wrapper.connection = None
    inherited, _open_at_fork[:] = list(_open_at_fork), []
    forks.disown(inherited)


_guarding = False


def keep_forked_children_off_django_sockets() -> None:
    """From now on, a child forked by this process (``os.fork()``, a ``fork`` context's
    process) ends no Django session of its parent, whichever thread holds it. Once per
    process (conftest's ``pytest_configure``): a fork hook cannot be removed."""
    global _guarding
    if _guarding:
        return
    _guarding = True
    connection_created.connect(_remember, dispatch_uid="tests.concurrency")
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def run_processes(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(index)`` in ``count`` forked processes; return their results by index."""
    pipes = [FORK.Pipe(duplex=False) for _ in range(count)]

    def child(index: int) -> None:
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
