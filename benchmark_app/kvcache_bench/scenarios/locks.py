"""``locks``: what ``cache.lock()`` costs, beside the ``add``/``delete`` recipe.

Subjects: our ``lock()`` (and ``alock()`` on the event loop) on each kvcache backend;
the recipe sites use without it — ``add(name, token, timeout)`` to take, ``delete(name)``
to give back, with no fencing token and a blind delete — on the same caches, on Django's
DatabaseCache and on Django's PyMemcacheCache.

* *uncontended*: one caller takes and gives back a name of its own, ``rounds`` x
  ``calls`` times (rounds interleaved across subjects): wall time and client CPU time of
  each acquire + release pair.
* *contended*: ``LOCK_WORKERS`` threads (a cache instance each) take turns on one name
  for ``lock_seconds`` (after a start of a second, or a third of a shorter window), each
  holding it ``HOLD_MS``: grants per second, the wait before each grant (median, p99,
  the longest: fairness) and the fewest and most grants one worker got. Waiters of both kinds poll at most every ``POLL_S`` (our lock from 2 ms
  up, the recipe at random below it). Every grant's interval is checked: two holders
  at once is a failure of the run.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
import uuid
from typing import Any, Callable

from kvcache_bench.caches import CacheSpec
from kvcache_bench.context import Context
from kvcache_bench.timing import rotated, summarize

LOCK_WORKERS = 8
HOLD_MS = 1.0
POLL_S = 0.01
LEASE_S = 60  # every lease outlives the run's holds: none expires under a holder
#: (cache families, ...): which caches run which methods, the first of each family only.
LOCKING_FAMILIES = ("kv-mysql", "kv-memcached")
RECIPE_FAMILIES = ("kv-mysql", "kv-memcached", "db", "pymemcache")


def run(context: Context) -> dict[str, Any]:
    subjects = _subjects(context.caches)
    parameters = context.parameters
    results = []
    with context.progress("locks", parameters.rounds * len(subjects) + len(subjects)) as bar:
        durations: dict[tuple[str, str], list[int]] = {s: [] for s in subjects}
        cpu: dict[tuple[str, str], int] = {s: 0 for s in subjects}
        caches = {spec.name: context.cache(spec) for spec in _specs(context.caches)}
        for round_index in range(parameters.rounds):
            for cache_name, method in rotated(list(subjects), round_index):
                taken, cpu_ns = _uncontended(caches[cache_name], method, parameters.calls,
                                             f"locks.{context.token}.{round_index}")
                durations[cache_name, method] += taken
                cpu[cache_name, method] += cpu_ns
                bar.update()
        for (cache_name, method), taken in durations.items():
            results.append({"cache": cache_name, "method": method, "mode": "uncontended",
                            **summarize(taken, cpu[cache_name, method])})
        specs = {spec.name: spec for spec in context.caches}
        for cache_name, method in subjects:
            if method == "alock":
                continue  # the contended figure is the threads' (alock's waits are lock's)
            entry = _contended(specs[cache_name], method, parameters.lock_seconds,
                               f"locks.{context.token}.contended")
            if entry.pop("overlaps"):
                context.failures.append(f"locks: two holders at once with {cache_name} {method}")
            results.append({"cache": cache_name, "method": method, "mode": "contended",
                            **entry})
            bar.update()
    return {"workers": LOCK_WORKERS, "hold_ms": HOLD_MS, "poll_s": POLL_S,
            "seconds": parameters.lock_seconds, "results": results}


def _specs(specs: list[CacheSpec]) -> list[CacheSpec]:
    """The first cache of each family that takes part (one memcached node count, the
    InnoDB MySQLCache)."""
    chosen: dict[str, CacheSpec] = {}
    for spec in specs:
        if spec.family in RECIPE_FAMILIES and spec.family not in chosen:
            if spec.family == "kv-mysql" and spec.options.get("ENGINE", "InnoDB") != "InnoDB":
                continue
            chosen[spec.family] = spec
    return list(chosen.values())


def _subjects(specs: list[CacheSpec]) -> list[tuple[str, str]]:
    subjects = []
    for spec in _specs(specs):
        if spec.family in LOCKING_FAMILIES:
            subjects += [(spec.name, "lock"), (spec.name, "alock")]
        subjects.append((spec.name, "add+delete"))
    return subjects


# --- uncontended -----------------------------------------------------------------------------


def _uncontended(cache: Any, method: str, calls: int, prefix: str) -> tuple[list[int], int]:
    """Wall time of each acquire + release pair (ns) and their CPU time together."""
    name = f"{prefix}.{method}"
    clock = time.perf_counter_ns
    durations: list[int] = []
    cpu_started = time.process_time_ns()
    if method == "alock":
        async def pairs() -> None:
            for _ in range(calls):
                lock = cache.alock(name, timeout=LEASE_S)
                started = clock()
                if not await lock.acquire(blocking=False):
                    raise AssertionError(f"{name} was not free")
                await lock.release()
                durations.append(clock() - started)

        asyncio.run(pairs())
    else:
        recipe = Recipe(cache, method)
        for _ in range(calls):
            started = clock()
            handle = recipe.take(name)
            if handle is None:
                raise AssertionError(f"{name} was not free")
            recipe.give_back(handle)
            durations.append(clock() - started)
    return durations, time.process_time_ns() - cpu_started


class Recipe:
    """One way to take a name and give it back: our ``lock()``, or ``add`` + ``delete``."""

    def __init__(self, cache: Any, method: str) -> None:
        self.cache, self.method = cache, method

    def take(self, name: str) -> Any:
        """One try: a handle, or None while someone else holds ``name``."""
        if self.method == "lock":
            lock = self.cache.lock(name, timeout=LEASE_S)
            return lock if lock.acquire(blocking=False) else None
        return name if self.cache.add(name, uuid.uuid4().hex, LEASE_S) else None

    def wait(self, name: str, stop_at: float) -> Any:
        """Take ``name``, waiting as each kind of waiter does (our lock: acquire's own
        pauses, from 2 ms doubling up to POLL_S; the recipe: a pause below POLL_S);
        None once ``stop_at`` has passed."""
        if self.method == "lock":
            left = stop_at - time.monotonic()
            lock = self.cache.lock(name, timeout=LEASE_S, sleep=POLL_S)
            return lock if left > 0 and lock.acquire(blocking_timeout=left) else None
        while time.monotonic() < stop_at:
            handle = self.take(name)
            if handle is not None:
                return handle
            time.sleep(random.uniform(POLL_S / 2, POLL_S))
        return None

    def give_back(self, handle: Any) -> None:
        if self.method == "lock":
            handle.release()
        else:
            self.cache.delete(handle)


# --- contended ---------------------------------------------------------------------------------


def _contended(spec: CacheSpec, method: str, seconds: float, name: str) -> dict[str, Any]:
    from django.db import connections

    name = f"{name}.{spec.name}.{method}"
    # Counted from a moment after the start (a second, or a third of a short window):
    # every worker is in the race by then.
    count_from = time.monotonic() + min(1.0, seconds / 3)
    stop_at = count_from + seconds
    ready = threading.Barrier(LOCK_WORKERS)
    guard = threading.Lock()
    waits: list[float] = []
    intervals: list[tuple[int, int]] = []
    grants = [0] * LOCK_WORKERS
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        cache = spec.build()
        try:
            recipe = Recipe(cache, method)
            cache.get("locks.warm-up")
            ready.wait(60)
            while time.monotonic() < stop_at:
                started = time.monotonic_ns()
                handle = recipe.wait(name, stop_at)
                if handle is None:
                    break
                held = time.monotonic_ns()
                time.sleep(HOLD_MS / 1000)
                released = time.monotonic_ns()
                recipe.give_back(handle)
                with guard:
                    intervals.append((held, released))
                    if held / 1e9 >= count_from:
                        waits.append((held - started) / 1e6)
                        grants[index] += 1
        except BaseException as exc:  # reported in the run's thread
            errors.append(exc)
        finally:
            cache.close()
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(LOCK_WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 120)
    if errors:
        raise errors[0]
    ordered = sorted(intervals)
    overlaps = sum(1 for a, b in zip(ordered, ordered[1:]) if a[1] > b[0])
    waits.sort()
    return {
        "grants": len(waits),
        "grants_per_s": round(len(waits) / seconds, 1),
        "wait_p50_ms": round(statistics.median(waits), 2) if waits else None,
        "wait_p99_ms": round(waits[min(len(waits) - 1, int(len(waits) * 0.99))], 2)
        if waits else None,
        "wait_max_ms": round(waits[-1], 2) if waits else None,
        "worker_min_grants": min(grants),
        "worker_max_grants": max(grants),
        "overlaps": overlaps,
    }
