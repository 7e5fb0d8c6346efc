"""A hung MySQL server never hangs a page: the quick start's configuration, as a new user
copies it (no timeout anywhere in ``DATABASES`` or the cache's ``OPTIONS``), bounds every
call by the cache's own defaults.

The server is a MariaDB of the test's own, stopped with SIGSTOP while threads and
coroutines call the cache: it accepts TCP connections (the kernel does) and never
answers, the way a hung server, a full disk or a saturated host looks to a client.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

import pytest

from django_kvcache.backends.mysql import MySQLCache
from tests.mysql_support import registered_alias
from tests.servers import services

pytestmark = pytest.mark.once  # a server failing, not Django's API

ALIAS = "kvcache_quick_start"
TABLE = "kvcache_entries"  # the quick start's LOCATION


def quick_start_database(port: int) -> dict[str, Any]:
    """docs/quickstart.rst's DATABASES entry, pointed at the test's own server."""
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": services.MYSQL_DATABASE,
        "USER": services.MYSQL_USER,
        "PASSWORD": "",
        "HOST": services.HOST,
        "PORT": str(port),
        "OPTIONS": {"charset": "utf8mb4"},
    }


#: docs/quickstart.rst's CACHES entry; DATABASE names the test's server (the quick start's
#: cache uses "default", which is the suite's own server here).
QUICK_START_CACHE = {"OPTIONS": {"MAX_ENTRIES": 100_000, "DATABASE": ALIAS}}

#: The defaults a call is bounded by (docs/mysql.rst, "Timeouts"): a wait for a pooled
#: connection, a connect, and a reply.
POOL_TIMEOUT, CONNECT_TIMEOUT, IO_TIMEOUT, RETRY_TIMEOUT = 1.0, 1.0, 2.0, 10.0
#: What a shared 2-core machine may add to a call besides its waits.
SLACK = 1.0
BOUND = POOL_TIMEOUT + CONNECT_TIMEOUT + IO_TIMEOUT + SLACK


@pytest.fixture
def quick_start(mariadb_server, django_db_blocker) -> Iterator[tuple[Any, MySQLCache]]:
    entry = quick_start_database(mariadb_server.port)
    with registered_alias(ALIAS, entry, django_db_blocker):
        cache = MySQLCache(TABLE, QUICK_START_CACHE)
        cache.create_table()
        try:
            yield mariadb_server, cache
        finally:
            os.kill(mariadb_server.process.pid, signal.SIGCONT)  # whatever happened


@dataclass
class Load:
    """Callers that keep calling the cache, each on keys of its own, and what each call
    did: ``(operation, started, seconds, exception or None)``."""

    cache: MySQLCache
    calls: list[tuple[str, float, float, BaseException | None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def operations(self, name: str, prefix: str = "") -> list[tuple[str, Callable[[], Any]]]:
        """Each operation on keys of ``name``'s own; ``prefix`` "a": the async twins."""
        keys = [f"{name}-{i}" for i in range(5)]
        arguments = {"get": (keys[0],), "set": (keys[1], "value " * 50), "get_many": (keys,),
                     "add": (keys[2], 1), "incr": (keys[3],)}
        return [(prefix + operation, partial(getattr(self.cache, prefix + operation), *args))
                for operation, args in arguments.items()]

    def record(self, name: str, started: float, error: BaseException | None) -> None:
        with self.lock:
            self.calls.append((name, started, time.monotonic() - started, error))

    def thread(self, name: str) -> None:
        self.cache.set(f"{name}-3", 0)  # incr's counter
        for operation, call in itertools.cycle(self.operations(name)):
            if self.stop.is_set():
                return
            started = time.monotonic()
            try:
                call()
            except Exception as exc:  # noqa: BLE001  (what a call raised is the subject)
                self.record(operation, started, exc)
            else:
                self.record(operation, started, None)
            time.sleep(0.005)

    async def coroutine(self, name: str) -> None:
        await self.cache.aset(f"{name}-3", 0)
        for operation, call in itertools.cycle(self.operations(name, prefix="a")):
            if self.stop.is_set():
                return
            started = time.monotonic()
            try:
                await call()
            except Exception as exc:  # noqa: BLE001
                self.record(operation, started, exc)
            else:
                self.record(operation, started, None)
            await asyncio.sleep(0.005)

    def loop_thread(self, coroutines: int) -> None:
        async def main() -> None:
            await asyncio.gather(*(self.coroutine(f"coroutine{i}") for i in range(coroutines)))

        asyncio.run(main())

    def start(self, threads: int = 4, coroutines: int = 8) -> list[threading.Thread]:
        workers = [threading.Thread(target=self.thread, args=(f"thread{i}",), daemon=True)
                   for i in range(threads)]
        workers.append(threading.Thread(target=self.loop_thread, args=(coroutines,), daemon=True))
        for worker in workers:
            worker.start()
        return workers


def served(cache: MySQLCache, key: str) -> bool:
    """Whether the server answers: a value written is read back (a fail-open ``set``
    does nothing and a fail-open ``get`` misses)."""
    cache.set(key, "served")
    return cache.get(key) == "served"


def test_a_hung_server_bounds_every_call_and_serves_again_without_stale_values(quick_start):
    server, cache = quick_start
    cache.set("before-stop", "old")
    cache.set("written-while-hung", "old")
    load = Load(cache)
    workers = load.start()
    time.sleep(0.5)
    os.kill(server.process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    # Resumed by a timer, longer after than the bound: a call that waits for the server
    # shows, and a call that hangs until the server answers again cannot hang the test.
    resume = threading.Timer(BOUND + 2.0, os.kill, (server.process.pid, signal.SIGCONT))
    resume.start()
    cache.set("written-while-hung", "new")  # fails open: its key is owed
    resume.join()
    resumed = time.monotonic()
    probes = itertools.count()
    while not served(cache, f"probe{next(probes)}"):
        assert time.monotonic() - resumed <= RETRY_TIMEOUT + 1.0, "not served again in time"
        time.sleep(0.05)
    served_after = time.monotonic() - resumed
    load.stop.set()
    for worker in workers:
        worker.join(timeout=30)
    assert not any(worker.is_alive() for worker in workers)

    during = [call for call in load.calls if stopped - BOUND <= call[1] <= resumed]
    assert len(during) > 20, "the load did not run while the server was stopped"
    slowest = max(during, key=lambda call: call[2])
    assert slowest[2] <= BOUND, f"{slowest[0]} took {slowest[2]:.1f} s (bound {BOUND} s)"
    raised = [(name, error) for name, _, _, error in during if error is not None]
    # incr's fail-open answer (docs/mysql.rst, "Failures") is ValueError, as for a missing
    # key, within the bound. Every other call answers as a miss or a no-op.
    assert all(name.endswith("incr") and type(error) is ValueError
               for name, error in raised), raised[:3]
    assert served_after <= RETRY_TIMEOUT + 1.0
    # Nothing stale: a value overwritten after the outage reads new, and one whose write
    # failed during it is never served old.
    cache.set("before-stop", "new")
    assert cache.get("before-stop") == "new"
    assert cache.get("written-while-hung") is None
