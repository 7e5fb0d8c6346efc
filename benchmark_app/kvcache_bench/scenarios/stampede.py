"""``stampede``: N callers at once on a hot key that is missing, then expired.

Every caller runs ``get_or_set(key, compute)`` in its own thread (its own cache instance,
as Django gives one per thread), released together at a barrier; ``compute`` takes
``COMPUTE_MS``. Four rounds per cache and N (``--callers``): the key present (*fresh*: every call is a
plain get, the baseline at that concurrency), missing (*cold*), just expired after a
first value was stored (*expired*), and about to expire, inside ``EARLY_RECOMPUTE``
(*early*: one caller may recompute it while every other one still gets the present value).
Reported: how many times the value
was computed, the callers' p50/p99 latency, and the same for the callers that did not
compute (the ones herd protection lets wait, or answers with the stale value). Our backends run with herd protection
(``LEASE_TIMEOUT``, ``STALE_TIMEOUT`` and ``EARLY_RECOMPUTE``); the others as they are,
recomputing N times.
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import replace
from typing import Any

from kvcache_bench.caches import REDIS, CacheSpec
from kvcache_bench.context import Context

COMPUTE_MS = 50
#: Our caches' options in this scenario (docs/stampede.rst).
PROTECTION = {"LEASE_TIMEOUT": 5, "STALE_TIMEOUT": 60, "EARLY_RECOMPUTE": 3}
EXPIRY = 1  # seconds: the first value's timeout in the "expired" round
#: The "early" round's first value: stored for EARLY_EXPIRY seconds, the herd released
#: EARLY_WAIT seconds later — inside EARLY_RECOMPUTE, before expiry, on memcached's whole
#: seconds too (an item set for n seconds lives between n - 1 and n).
EARLY_EXPIRY, EARLY_WAIT = 4, 2.1
#: fresh: the key is there (the same calls as plain gets: the baseline); cold: missing;
#: expired: stored with EXPIRY and expired since; early: about to expire.
STATES = ("fresh", "cold", "expired", "early")
BARRIER_TIMEOUT = 60.0


def run(context: Context) -> dict[str, Any]:
    specs = [_protected(spec) for spec in context.caches if spec.family != REDIS]
    rounds = [(spec, callers) for spec in specs for callers in context.parameters.callers]
    key = lambda spec, callers, state: f"stampede.{context.token}.{spec.name}.{callers}.{state}"  # noqa: E731
    # The "expired" rounds' first values, written now: they expire during the cold rounds.
    for spec, callers in rounds:
        spec.build().get_or_set(key(spec, callers, "expired"), "first", timeout=EXPIRY)
    expired_at = time.monotonic() + EXPIRY + 1.1  # memcached counts whole seconds
    results = []
    with context.progress("stampede", len(rounds) * len(STATES)) as bar:
        for state in STATES:
            if state == "expired":
                time.sleep(max(0.0, expired_at - time.monotonic()))
            for spec, callers in rounds:
                if state == "fresh":  # the baseline: every call is one plain get
                    spec.build().set(key(spec, callers, state), "fresh", timeout=300)
                if state == "early":
                    spec.build().get_or_set(key(spec, callers, state), "first",
                                            timeout=EARLY_EXPIRY)
                    time.sleep(EARLY_WAIT)
                results.append(_herd(spec, key(spec, callers, state), callers, state))
                bar.update()
    return {"compute_ms": COMPUTE_MS, "callers": list(context.parameters.callers),
            "protection": PROTECTION,
            "results": results}


def _protected(spec: CacheSpec) -> CacheSpec:
    if not spec.family.startswith("kv-"):
        return spec
    return replace(spec, options={**spec.options, **PROTECTION})


def _herd(spec: CacheSpec, key: str, callers: int, state: str) -> dict[str, Any]:
    from django.db import connections

    computations = []
    lock = threading.Lock()

    def compute() -> str:
        with lock:
            computations.append(threading.get_ident())
        time.sleep(COMPUTE_MS / 1000)
        return "fresh"

    barrier = threading.Barrier(callers)
    latencies: list[float] = [0.0] * callers
    answers: list[Any] = [None] * callers
    threads_of: list[int] = [0] * callers

    def caller(index: int) -> None:
        cache = spec.build()
        try:
            cache.get("stampede.warm-up")  # connect before the clock starts
            barrier.wait(BARRIER_TIMEOUT)
            started = time.perf_counter()
            answers[index] = cache.get_or_set(key, compute, timeout=300)
            latencies[index] = (time.perf_counter() - started) * 1e6
            threads_of[index] = threading.get_ident()
        finally:
            cache.close()
            connections.close_all()

    threads = [threading.Thread(target=caller, args=(index,)) for index in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BARRIER_TIMEOUT)
    spec.build().delete(key)
    # The callers that did not compute: how long they waited (or got a stale value in).
    waiting = sorted(latency for latency, ident in zip(latencies, threads_of)
                     if ident not in computations)  # empty when every caller computed
    return {"cache": spec.name, "callers": callers, "state": state,
            "computations": len(computations),
            "answers_ok": all(answer in ("fresh", "first") for answer in answers),
            "p50_us": round(statistics.median(sorted(latencies)), 1),
            "p99_us": round(_p99(sorted(latencies)), 1),
            "others_p50_us": round(statistics.median(waiting), 1) if waiting else None,
            "others_p99_us": round(_p99(waiting), 1) if waiting else None}


def _p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
