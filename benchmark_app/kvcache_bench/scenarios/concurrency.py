"""``concurrency``: N threads, then N processes, running a mixed workload on one cache.

Each worker builds its own cache instance (as Django gives one per thread), connects,
waits at a barrier so all start together, then repeats: ``get`` of a shared hot key,
``set`` of its own key, ``incr`` of one shared counter, ``add`` of a key every worker
races for. Besides operations per second this counts what a cache must not do:
lost ``incr`` updates (the counter ends below the number of successful increments)
and extra ``add`` winners (more than one worker told it added the same key).
"""
from __future__ import annotations

import multiprocessing
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from kvcache_bench.caches import REDIS, CacheSpec
from kvcache_bench.context import Context
from kvcache_bench.data import FIXED_VALUE
from kvcache_bench.timing import rotated

OPERATIONS_PER_ITERATION = 4
HOT_KEYS = 20
OWN_KEYS = 10
BARRIER_TIMEOUT = 120.0
VALUE = FIXED_VALUE

_process_barrier: Any = None  # set in each pool process by _start_process


@dataclass(frozen=True)
class Job:
    spec: CacheSpec
    label: str  # key namespace of one (cache, mode, workers) run
    worker: int
    iterations: int


@dataclass
class Outcome:
    started: float = 0.0
    finished: float = 0.0
    operations: int = 0
    increments: int = 0  # successful incr calls
    add_wins: list[int] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None


def keys_of(label: str, workers: int, iterations: int) -> list[str]:
    return [f"{label}.counter", *(f"{label}.hot.{i}" for i in range(HOT_KEYS)),
            *(f"{label}.w{w}.{i}" for w in range(workers) for i in range(OWN_KEYS)),
            *(f"{label}.race.{i}" for i in range(iterations))]


def work(job: Job, barrier: Any) -> Outcome:
    from django.db import connections

    cache = job.spec.build()
    outcome = Outcome()

    def attempt(method: Callable[..., Any], *args: Any) -> Any:
        try:
            result = method(*args)
        except Exception as exc:  # counted and reported: errors are part of the finding
            outcome.errors += 1
            outcome.first_error = outcome.first_error or repr(exc)
            return exc
        outcome.operations += 1
        return result

    try:
        cache.get(f"{job.label}.hot.0")  # connect before the clock starts
        barrier.wait(BARRIER_TIMEOUT)
        outcome.started = time.monotonic()
        for i in range(job.iterations):
            attempt(cache.get, f"{job.label}.hot.{i % HOT_KEYS}")
            attempt(cache.set, f"{job.label}.w{job.worker}.{i % OWN_KEYS}", VALUE)
            if isinstance(attempt(cache.incr, f"{job.label}.counter"), int):
                outcome.increments += 1
            if attempt(cache.add, f"{job.label}.race.{i}", job.worker) is True:
                outcome.add_wins.append(i)
        outcome.finished = time.monotonic()
    finally:
        cache.close()
        connections.close_all()
    return outcome


def _start_process(barrier: Any) -> None:
    global _process_barrier
    import django

    django.setup()
    _process_barrier = barrier


def _work_in_process(job: Job) -> Outcome:
    return work(job, _process_barrier)


def run(context: Context) -> dict[str, Any]:
    # extra caches are process-local; Django's RedisCache is a peer of ops and async only
    specs = [spec for spec in context.caches if spec.family not in ("extra", REDIS)]
    workers = sorted(context.parameters.workers)
    results: list[dict[str, Any]] = []
    with context.progress("concurrency", 2 * len(workers) * len(specs)) as bar:
        for count in workers:
            with ThreadPoolExecutor(count) as threads:
                barrier = threading.Barrier(count)
                for spec in rotated(specs, count):
                    results.append(_measure(context, spec, "threads", count,
                                            lambda jobs: list(threads.map(lambda job: work(job, barrier), jobs))))
                    bar.update()
            spawn = multiprocessing.get_context("spawn")
            barrier = spawn.Barrier(count)
            with spawn.Pool(count, initializer=_start_process, initargs=(barrier,)) as processes:
                for spec in rotated(specs, count):
                    results.append(_measure(context, spec, "processes", count,
                                            lambda jobs: processes.map(_work_in_process, jobs, chunksize=1)))
                    bar.update()
    order = [spec.name for spec in specs]
    results.sort(key=lambda e: (e["mode"] != "threads", e["workers"], order.index(e["cache"])))
    return {"operations_per_iteration": OPERATIONS_PER_ITERATION, "results": results}


def _measure(context: Context, spec: CacheSpec, mode: str, count: int,
             run_jobs: Callable[[list[Job]], list[Outcome]]) -> dict[str, Any]:
    iterations = context.parameters.iterations
    label = f"conc.{mode}.{count}"
    cache = context.cache(spec)
    context.written.add(spec, keys_of(label, count, iterations))
    cache.set_many({f"{label}.hot.{i}": VALUE for i in range(HOT_KEYS)})
    cache.set(f"{label}.counter", 0)
    outcomes = run_jobs([Job(spec, label, worker, iterations) for worker in range(count)])
    counter = cache.get(f"{label}.counter")
    increments = sum(o.increments for o in outcomes)
    winners = Counter(i for o in outcomes for i in o.add_wins)
    elapsed = max(o.finished for o in outcomes) - min(o.started for o in outcomes)
    operations = sum(o.operations for o in outcomes)
    errors = [o.first_error for o in outcomes if o.first_error]
    if errors:
        context.notes.append(f"concurrency: {spec.name} {mode} x{count}: "
                             f"{sum(o.errors for o in outcomes)} error(s), first: {errors[0]}")
    return {
        "cache": spec.name, "mode": mode, "workers": count,
        "ops_per_s": round(operations / elapsed, 1) if elapsed > 0 else None,
        "operations": operations, "elapsed_s": round(elapsed, 4),
        "successful_incr": increments, "final_counter": counter,
        "lost_incr": increments - counter if isinstance(counter, int) else increments,
        "extra_add_winners": sum(n - 1 for n in winners.values() if n > 1),
        "races_without_winner": iterations - len(winners),
        "errors": sum(o.errors for o in outcomes),
    }
