"""``rows``: ``set`` and ``get`` cost when the table already holds many rows, plus one cull.

Django's DatabaseCache runs ``SELECT COUNT(*)`` on every write to decide whether to cull,
so its ``set`` should grow with the table; a cache that avoids the count should not.
Tables are grown with bulk inserts (not timed) between the measured sizes.
"""
from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any

from kvcache_bench.caches import CacheSpec
from kvcache_bench.context import Context
from kvcache_bench import data
from kvcache_bench.checks import Call, mismatches
from kvcache_bench.storage import bulk_load, count_rows, cull_once
from kvcache_bench.timing import rotated, summarize, time_calls

FILLER_VALUES = 64


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    specs = [spec for spec in context.caches if spec.table is not None]
    sizes = sorted(p.rows)
    filler = data.filler(p.seed, FILLER_VALUES)
    rounds = max(1, min(p.rounds, p.row_calls))
    calls = max(1, p.row_calls // rounds)
    results: list[dict[str, Any]] = []
    loaded = dict.fromkeys((spec.name for spec in specs), 0)
    with context.progress("rows", len(sizes) * len(specs) * (1 + rounds) + len(specs)) as bar:
        for size in sizes:
            for spec in specs:
                _grow(context, spec, loaded, size, filler)
                bar.update()
            durations: dict[tuple[str, str], list[int]] = defaultdict(list)
            rng = random.Random(p.seed + size)
            for round_index in range(rounds):
                sets = [Call((f"rows.{size}.{round_index}.{i}", filler[i % len(filler)]), None)
                        for i in range(calls)]
                gets = [Call(f"row.{index}", filler[index % len(filler)])
                        for index in (rng.randrange(size) for _ in range(calls))]
                for spec in rotated(specs, round_index):
                    for operation, batch in (("set", sets), ("get", gets)):
                        durations[spec.name, operation].extend(
                            _timed(context, spec, operation, batch, size))
                    bar.update()
            results.extend({"cache": spec.name, "operation": operation, "rows": size,
                            **summarize(durations[spec.name, operation])}
                           for spec in specs for operation in ("set", "get"))
        for spec in specs:
            results.append(_cull(context, spec, sizes[-1]))
            bar.update()
    return {"sizes": sizes, "results": results}


def _grow(context: Context, spec: CacheSpec, loaded: dict[str, int], size: int, filler: tuple) -> None:
    """Bring the table to ``size`` preloaded rows (keys ``row.0`` … ``row.<size-1>``)."""
    start = loaded[spec.name]
    if size > start:
        bulk_load(spec, context.cache(spec),
                  {f"row.{index}": filler[index % len(filler)] for index in range(start, size)})
        loaded[spec.name] = size


def _timed(context: Context, spec: CacheSpec, operation: str, calls: list[Call], size: int) -> list[int]:
    cache = context.cache(spec)
    method = cache.set if operation == "set" else cache.get
    run = (lambda item: method(*item)) if operation == "set" else method
    timed = time_calls(run, [call.argument for call in calls])
    wrong = mismatches(timed.results, calls)
    if wrong:
        context.failures.append(f"rows: {spec.name} {operation} at {size:,} rows: "
                                f"{len(wrong)} wrong result(s): {wrong[0]}")
    return timed.durations


def _cull(context: Context, spec: CacheSpec, size: int) -> dict[str, Any]:
    """Time one cull of the full table, asked to keep one row fewer than it holds."""
    cache = context.cache(spec)
    before = count_rows(spec)
    start = time.perf_counter()
    cull_once(spec, cache, max_entries=before - 1)
    duration = time.perf_counter() - start
    after = count_rows(spec)
    if not after < before:
        context.failures.append(f"rows: {spec.name} cull removed nothing from {before:,} rows")
    return {"cache": spec.name, "operation": "cull", "rows": size, "rows_before": before,
            "rows_after": after, "duration_ms": round(duration * 1000, 2)}
