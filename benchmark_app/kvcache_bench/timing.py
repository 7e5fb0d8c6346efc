"""Timing primitives: per-call clocks, rotating round order, and the summary figures."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable, NamedTuple, Sequence, TypeVar

T = TypeVar("T")


class Timed(NamedTuple):
    durations: list[int]  # wall time of each call, ns
    results: list[Any]
    cpu_ns: int  # CPU time of this process over all the calls (client side only)


def time_calls(call: Callable[[Any], Any], arguments: Iterable[Any]) -> Timed:
    """Run ``call`` on each argument; return each call's duration (ns), its result, and
    the process CPU time the calls took together.

    CPU time is read once around the loop, not per call: its clock is a system call,
    which would add to every wall time. An exception is a result too (e.g. ``incr`` of a
    missing key): it is returned in the results for the correctness check rather than
    stopping the round.
    """
    clock = time.perf_counter_ns
    durations: list[int] = []
    results: list[Any] = []
    cpu_start = time.process_time_ns()
    for argument in arguments:
        start = clock()
        try:
            result = call(argument)
        except Exception as exc:  # checked against the expected result afterwards
            result = exc
        durations.append(clock() - start)
        results.append(result)
    return Timed(durations, results, time.process_time_ns() - cpu_start)


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` starting at a different one each round, so no cache always goes first
    (and so always meets the same cold caches, connections or CPU state)."""
    if not items:
        return []
    shift = round_index % len(items)
    return list(items[shift:]) + list(items[:shift])


def summarize(durations_ns: Sequence[int], cpu_ns: int | None = None) -> dict[str, float]:
    """Median, p95, p99, mean and min of per-call durations, in microseconds; with
    ``cpu_ns`` (the process CPU time of all these calls) also the CPU time per call."""
    micros = sorted(d / 1000 for d in durations_ns)
    if len(micros) >= 2:
        cuts = statistics.quantiles(micros, n=100, method="inclusive")
        p95, p99 = cuts[94], cuts[98]
    else:
        p95 = p99 = micros[0]
    summary = {
        "median_us": round(statistics.median(micros), 2),
        "p95_us": round(p95, 2),
        "p99_us": round(p99, 2),
        "mean_us": round(statistics.fmean(micros), 2),
        "min_us": round(micros[0], 2),
        "samples": len(micros),
    }
    if cpu_ns is not None:
        summary["cpu_us"] = round(cpu_ns / 1000 / len(micros), 2)
    return summary
