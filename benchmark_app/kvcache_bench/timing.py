"""Timing primitives: per-call clocks, rotating round order, and the summary figures."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")


def time_calls(call: Callable[[Any], Any], arguments: Iterable[Any]) -> tuple[list[int], list[Any]]:
    """Run ``call`` on each argument; return each call's duration (ns) and result.

    An exception is a result too (e.g. ``incr`` of a missing key): it is returned in
    the results for the correctness check rather than stopping the round.
    """
    clock = time.perf_counter_ns
    durations: list[int] = []
    results: list[Any] = []
    for argument in arguments:
        start = clock()
        try:
            result = call(argument)
        except Exception as exc:  # checked against the expected result afterwards
            result = exc
        durations.append(clock() - start)
        results.append(result)
    return durations, results


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` starting at a different one each round, so no cache always goes first
    (and so always meets the same cold caches, connections or CPU state)."""
    if not items:
        return []
    shift = round_index % len(items)
    return list(items[shift:]) + list(items[:shift])


def summarize(durations_ns: Sequence[int]) -> dict[str, float]:
    """Median, p95, p99, mean and min of per-call durations, in microseconds."""
    micros = sorted(d / 1000 for d in durations_ns)
    if len(micros) >= 2:
        cuts = statistics.quantiles(micros, n=100, method="inclusive")
        p95, p99 = cuts[94], cuts[98]
    else:
        p95 = p99 = micros[0]
    return {
        "median_us": round(statistics.median(micros), 2),
        "p95_us": round(p95, 2),
        "p99_us": round(p99, 2),
        "mean_us": round(statistics.fmean(micros), 2),
        "min_us": round(micros[0], 2),
        "samples": len(micros),
    }
