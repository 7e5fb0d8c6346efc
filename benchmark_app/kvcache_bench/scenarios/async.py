"""``async``: N concurrent coroutines doing ``aget`` / ``aget_many(20)`` / ``aset``.

Against each ``--nodes`` count of memcached nodes (the issue's figures: 1, 4, 8), with 1,
16, 64 and 256 coroutines on one event loop:

* ``kv-memcached native``: MemcachedCache's own asyncio transport (no thread);
* ``kv-memcached sync_to_async``: our sync methods reached through one
  ``sync_to_async(thread_sensitive=True)`` hop each (what Django's backends do);
* ``pymemcache``: Django's PyMemcacheCache's async methods (Django's delegation: one
  hop per call, and per key in ``aget_many`` before Django 6.1).

Figures per (client, nodes, operation, coroutines): throughput (calls per second over the
whole batch) and the per-call latency percentiles.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from asgiref.sync import sync_to_async

from kvcache_bench.caches import memcached_families, memcached_spec
from kvcache_bench.context import Context
from kvcache_bench.data import filler
from kvcache_bench.timing import summarize

COROUTINES = (1, 16, 64, 256)
BATCH = 20
KEYS = 400
NATIVE, HOPPED, DJANGO = "kv-memcached native", "kv-memcached sync_to_async", "pymemcache"

Operation = Callable[[int], Awaitable[Any]]


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    available = len(context.memcached_nodes)
    counts = [n for n in sorted(p.nodes) if n <= available]
    for n in sorted(set(p.nodes) - set(counts)):
        context.notes.append(f"async: {n} nodes skipped, only {available} memcached nodes available")
    families = memcached_families(context.caches)
    if not counts or not families:
        context.notes.append("async: skipped, no memcached cache selected or no node available")
        return {"coroutines": list(COROUTINES), "counts": counts, "results": []}
    calls = max(p.node_calls, 64)  # calls per (client, nodes, operation, coroutines)
    values = filler(p.seed, KEYS)
    results: list[dict[str, Any]] = []
    subjects = [(family, n) for family in families for n in counts]
    with context.progress("async", len(subjects)) as bar:
        for family, n in subjects:
            spec = memcached_spec(family, context.token, context.memcached_nodes, n)
            cache = spec.build()
            items = {f"async.{context.token}.{i}": value for i, value in enumerate(values)}
            cache.set_many(items)
            try:
                clients = [NATIVE, HOPPED] if family == "kv-memcached" else [DJANGO]
                for client in clients:
                    results += asyncio.run(_measure(cache, client, n, list(items), calls))
            finally:
                cache.delete_many(list(items))
                cache.close()
            bar.update()
    return {"coroutines": list(COROUTINES), "counts": counts, "batch": BATCH, "calls": calls,
            "results": results}


async def _measure(cache: Any, client: str, nodes: int, keys: list[str],
                   calls: int) -> list[dict[str, Any]]:
    operations = _operations(cache, client, keys)
    results = []
    for operation, call in operations.items():
        for coroutines in COROUTINES:
            await _batch(call, coroutines, coroutines)  # warm: connections open, code paths hot
            durations, wall = await _batch(call, coroutines, calls)
            results.append({
                "client": client, "operation": operation, "setting": f"{nodes}x{coroutines}",
                "nodes": nodes, "coroutines": coroutines,
                "ops_per_s": round(len(durations) / wall, 1), **summarize(durations),
            })
    return results


def _operations(cache: Any, client: str, keys: list[str]) -> dict[str, Operation]:
    if client == HOPPED:
        get, get_many, put = (sync_to_async(cache.get), sync_to_async(cache.get_many),
                              sync_to_async(cache.set))
    else:
        get, get_many, put = cache.aget, cache.aget_many, cache.aset
    count = len(keys)
    return {
        "aget": lambda i: get(keys[i % count]),
        f"aget_many({BATCH})": lambda i: get_many(
            [keys[(i * BATCH + j) % count] for j in range(BATCH)]),
        "aset": lambda i: put(keys[i % count], b"x" * 100),
    }


async def _batch(call: Operation, coroutines: int, calls: int) -> tuple[list[int], float]:
    """``calls`` calls spread over ``coroutines`` concurrent coroutines: each call's
    duration (ns) and the wall time of the whole batch (s)."""
    durations: list[int] = []
    per_coroutine = max(4, calls // coroutines)

    async def worker(offset: int) -> None:
        for i in range(per_coroutine):
            started = time.perf_counter_ns()
            await call(offset * per_coroutine + i)
            durations.append(time.perf_counter_ns() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(coroutines)))
    return durations, time.perf_counter() - started
