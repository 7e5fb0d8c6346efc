"""A forked child (a prefork server's worker) never inherits a lock that another thread of
its parent held at the fork: every process-wide registry and shared record is renewed by
the package's one fork hook."""
from __future__ import annotations

import os
import threading

import pytest

from django_kvcache import forks
from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.backends.mysql import MySQLCache

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def in_child(work) -> int:
    """Exit code of ``work()`` run in a forked child (0: it returned True within 5 s)."""
    pid = os.fork()
    if pid == 0:  # never return into pytest
        status = 1
        try:
            done = threading.Event()
            result: list[bool] = []
            thread = threading.Thread(target=lambda: (result.append(work()), done.set()))
            thread.daemon = True
            thread.start()
            status = 0 if done.wait(5) and result == [True] else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def holding(locks: list[threading.Lock]):
    """A thread that holds ``locks`` until the returned event is set."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        taken.set()
        release.wait()
        for lock in locks:
            lock.release()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(5)
    return release, thread


def test_a_child_builds_caches_while_its_parent_held_every_registry():
    # Caches of both backends make their process-wide records once...
    MemcachedCache("127.0.0.1:1", {})
    MySQLCache("kvcache_fork_parent", {})
    registries = [aware for aware in list(forks._aware) if isinstance(aware, forks.Registry)]
    assert len(registries) >= 5  # health, pools, both backends' clusters, missed writes...
    release, thread = holding([registry.lock for registry in registries])
    try:
        # ...and a child forked while another thread of the parent held all their locks
        # makes new ones for a new node and a new table.
        def build() -> bool:
            MemcachedCache("127.0.0.1:2", {})
            MySQLCache("kvcache_fork_child", {})
            return True

        assert in_child(build) == 0
    finally:
        release.set()
        thread.join()


def test_every_registered_lock_is_free_in_the_child():
    MemcachedCache("127.0.0.1:3", {})
    locks = [
        aware.lock for aware in list(forks._aware)
        if isinstance(getattr(aware, "lock", None), type(threading.Lock()))
    ]
    assert locks
    release, thread = holding(locks)
    try:
        def take_all() -> bool:
            return all(aware.lock.acquire(timeout=1) for aware in list(forks._aware)
                       if hasattr(aware, "lock"))

        assert in_child(take_all) == 0
    finally:
        release.set()
        thread.join()
