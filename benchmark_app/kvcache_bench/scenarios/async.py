"""``async``: N concurrent coroutines doing ``aget`` / ``aget_many(20)`` / ``aset``.

Against each ``--nodes`` count of memcached nodes (the issue's figures: 1, 4, 8), with 1,
16, 64 and 256 coroutines on one event loop:

* ``kv-memcached native``: MemcachedCache's own asyncio transport (no thread), one
  request per call and node (``AUTOBATCH`` off);
* ``kv-memcached autobatch``: the same with ``AUTOBATCH`` on: the gets of one loop
  iteration for one node go out as one request;
* ``kv-memcached sync_to_async``: our sync methods reached through one
  ``sync_to_async(thread_sensitive=True)`` hop each (what Django's backends do);
* ``pymemcache``: Django's PyMemcacheCache's async methods (Django's delegation: one
  hop per call, and per key in ``aget_many`` before Django 6.1);
* ``redis``: Django's RedisCache on the benchmark's Redis (one server, so measured once,
  as "1 node"), whose async methods are Django's delegation too.

Figures per (client, nodes, operation, coroutines): throughput (calls per second over the
whole batch) and the per-call latency percentiles; ``versus_redis``: ours (default OPTIONS,
autobatch) and PyMemcacheCache on one node over RedisCache. And per node count, ``latency``: one
``get_many`` of 100 keys at a time, sync (no loop) against native ``aget_many`` (per-call
percentiles of each, and their ratio).

Under ``"mysql"``, the same batches against the MySQL caches selected (kvcache's InnoDB
table and django-mysql), on the run's value mix (realistic by default), with the CPU
time of the process per call beside the throughput:

* ``kv-mysql native``: MySQLCache's asyncio driver on the loop's own connections;
* ``kv-mysql sync_to_async``: our sync methods behind one ``sync_to_async`` hop each;
* ``django-mysql``: its async methods (Django's delegation: one hop per call, and per
  key in ``aget_many`` before Django 6.1);

each figure the median of three rounds in which the clients take turns, and ``speedups``: native against the two others at the issue's settings (``aget`` with
256 coroutines, ``aget_many(20)`` with 64).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from asgiref.sync import sync_to_async

from kvcache_bench.caches import REDIS, memcached_families, memcached_spec
from kvcache_bench.context import Context
from kvcache_bench.data import filler
from kvcache_bench.scenarios import async_peers
from kvcache_bench.timing import summarize

COROUTINES = (1, 16, 64, 256)
BATCH = 20
KEYS = 400
LATENCY_KEYS = 100
NATIVE, AUTOBATCH = "kv-memcached native", "kv-memcached autobatch"
HOPPED, DJANGO = "kv-memcached sync_to_async", "pymemcache"
#: Each client's cache OPTIONS (on top of the family's).
CLIENT_OPTIONS = {NATIVE: {"AUTOBATCH": False}, AUTOBATCH: {"AUTOBATCH": True},
                  HOPPED: {"AUTOBATCH": False}, DJANGO: {}}

Operation = Callable[[int], Awaitable[Any]]


def run(context: Context) -> dict[str, Any]:
    figures = _memcached(context)
    figures["emcache"] = _emcache(context)
    figures["mysql"] = _mysql(context)
    return figures


def _emcache(context: Context) -> dict[str, Any]:
    """emcache's own benchmark, emcache against our MemcachedCache (async_peers)."""
    if "kv-memcached" not in memcached_families(context.caches):
        return {"results": [], "ratios": []}
    missing = async_peers.available()
    if missing is not None:
        context.notes.append(f"async: emcache skipped, {missing}")
        return {"results": [], "ratios": []}
    available = len(context.memcached_nodes)
    counts = [n for n in sorted(context.parameters.nodes) if n <= available]
    with context.progress("async emcache", 1) as bar:
        figures = async_peers.measure(context.memcached_nodes, counts, context.token)
        bar.update()
    return figures


def _memcached(context: Context) -> dict[str, Any]:
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
    latency: list[dict[str, Any]] = []
    subjects = [(family, n) for family in families for n in counts]
    items = {f"async.{context.token}.{i}": value for i, value in enumerate(values)}
    with context.progress("async", len(subjects)) as bar:
        for family, n in subjects:
            clients = [NATIVE, AUTOBATCH, HOPPED] if family == "kv-memcached" else [DJANGO]
            for client in clients:
                spec = memcached_spec(family, context.token, context.memcached_nodes, n)
                spec.options.update(CLIENT_OPTIONS[client])
                cache = spec.build()
                cache.set_many(items)
                try:
                    results += asyncio.run(_measure(cache, client, n, list(items), calls))
                    if client in (NATIVE, AUTOBATCH):
                        latency.append({"client": client,
                                        **_latency(cache, n, list(items), calls)})
                finally:
                    cache.delete_many(list(items))
                    cache.close()
            bar.update()
    results += _redis(context, items, calls)
    return {"coroutines": list(COROUTINES), "counts": counts, "batch": BATCH, "calls": calls,
            "results": results, "latency": latency, "versus_redis": _versus_redis(results)}


def _redis(context: Context, items: dict[str, Any], calls: int) -> list[dict[str, Any]]:
    """Django's RedisCache, when selected: its one server, the same calls."""
    spec = next((spec for spec in context.caches if spec.family == REDIS), None)
    if spec is None:
        return []
    cache = spec.build()
    cache.set_many(items)
    try:
        return asyncio.run(_measure(cache, REDIS, 1, list(items), calls))
    finally:
        cache.delete_many(list(items))
        cache.close()


def _versus_redis(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On one node: each memcached client's calls per second over RedisCache's."""
    rate = {(e["client"], e["operation"], e["coroutines"]): e["ops_per_s"]
            for e in results if e["nodes"] == 1}
    found = []
    for client in (AUTOBATCH, NATIVE, DJANGO):
        for (other, operation, coroutines), theirs in rate.items():
            mine = rate.get((client, operation, coroutines))
            if other == REDIS and mine and theirs:
                found.append({"client": client, "operation": operation, "coroutines": coroutines,
                              "speedup": round(mine / theirs, 2)})
    return found


def _latency(cache: Any, nodes: int, keys: list[str], calls: int) -> dict[str, Any]:
    """``get_many`` of LATENCY_KEYS keys, one call at a time, sync and native async calls
    interleaved (the machine's noise hits both alike)."""
    chunks = [keys[(i * LATENCY_KEYS) % len(keys):][:LATENCY_KEYS] for i in range(calls)]

    async def interleaved() -> tuple[list[int], list[int]]:
        sync, native = [], []
        for chunk in chunks:
            started = time.perf_counter_ns()
            cache.get_many(chunk)  # the blocking call, on purpose, between two native ones
            sync.append(time.perf_counter_ns() - started)
            started = time.perf_counter_ns()
            await cache.aget_many(chunk)
            native.append(time.perf_counter_ns() - started)
        return sync, native

    sync, native = asyncio.run(interleaved())
    sync_figures, async_figures = summarize(sync), summarize(native)
    return {"nodes": nodes, "keys": LATENCY_KEYS, "sync": sync_figures, "async": async_figures,
            "async_vs_sync_median": round(async_figures["median_us"] / sync_figures["median_us"], 3)}


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
    if client in (HOPPED, MYSQL_HOPPED):
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


# --- MySQL -----------------------------------------------------------------------------

MYSQL_NATIVE, MYSQL_HOPPED, MYSQL_DJANGO = (
    "kv-mysql native", "kv-mysql sync_to_async", "django-mysql")
#: The issue's settings: (operation, coroutines) at which native must be 3x the others.
TARGETS = (("aget", 256), (f"aget_many({BATCH})", 64))
#: Rounds per figure (the median is kept), the clients taking turns within each.
MYSQL_ROUNDS = 3


def _mysql(context: Context) -> dict[str, Any]:
    specs = {spec.family: spec for spec in context.caches
             if spec.name in ("kv-mysql-innodb", "django-mysql")}
    if "kv-mysql" not in specs:
        context.notes.append("async: MySQL skipped, kv-mysql-innodb not selected")
        return {"results": [], "speedups": []}
    calls = max(context.parameters.node_calls, 256)
    entries = context.values.entries if context.values is not None else filler(0, KEYS)
    items = {f"async.{context.token}.{i}": entries[i % len(entries)] for i in range(KEYS)}
    clients = [(MYSQL_NATIVE, specs["kv-mysql"]), (MYSQL_HOPPED, specs["kv-mysql"])]
    if "django-mysql" in specs:
        clients.append((MYSQL_DJANGO, specs["django-mysql"]))
    caches = {client: spec.build() for client, spec in clients}
    for cache in caches.values():
        cache.set_many(items)
    try:
        results = asyncio.run(_measure_mysql(context, caches, list(items), calls))
    finally:
        for cache in caches.values():
            cache.delete_many(list(items))
    return {"results": results, "speedups": _speedups(results), "calls": calls,
            "rounds": MYSQL_ROUNDS,
            "values": context.values.mix.name if context.values is not None else "filler"}


async def _measure_mysql(context: Context, caches: dict[str, Any], keys: list[str],
                         calls: int) -> list[dict[str, Any]]:
    """Each (operation, coroutines): every client in turn, MYSQL_ROUNDS times in a rotating
    order, so a change in the machine's load hits all clients alike; per client the round
    of median throughput."""
    operations = {client: _operations(cache, client, keys) for client, cache in caches.items()}
    names = list(next(iter(operations.values())))
    results = []
    with context.progress("async mysql", len(names) * len(COROUTINES)) as bar:
        for operation in names:
            for coroutines in COROUTINES:
                rounds: dict[str, list[dict[str, Any]]] = {client: [] for client in caches}
                for round_ in range(MYSQL_ROUNDS):
                    order = list(caches)
                    order = order[round_ % len(order):] + order[:round_ % len(order)]
                    for client in order:
                        call = operations[client][operation]
                        if round_ == 0:
                            await _batch(call, coroutines, coroutines)  # warm: connections open
                        cpu = time.process_time()
                        durations, wall = await _batch(call, coroutines, calls)
                        cpu = time.process_time() - cpu
                        rounds[client].append({
                            "client": client, "operation": operation,
                            "setting": f"mysql x{coroutines}", "nodes": 1,
                            "coroutines": coroutines,
                            "ops_per_s": round(len(durations) / wall, 1),
                            "cpu_us": round(cpu / len(durations) * 1e6, 1),
                            **summarize(durations),
                        })
                for client, measured in rounds.items():
                    measured.sort(key=lambda entry: entry["ops_per_s"])
                    results.append(measured[len(measured) // 2])
                bar.update()
    return results


def _speedups(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Native's throughput over each other client's, at the issue's settings."""
    rate = {(e["client"], e["operation"], e["coroutines"]): e["ops_per_s"] for e in results}
    found = []
    for operation, coroutines in TARGETS:
        native = rate.get((MYSQL_NATIVE, operation, coroutines))
        for other in (MYSQL_HOPPED, MYSQL_DJANGO):
            theirs = rate.get((other, operation, coroutines))
            if native and theirs:
                found.append({"operation": operation, "coroutines": coroutines, "versus": other,
                              "speedup": round(native / theirs, 2)})
    return found


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
