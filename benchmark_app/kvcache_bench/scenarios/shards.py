"""``shards``: MySQLCache over 1, 2, 3 MariaDB servers (``OPTIONS["DATABASES"]``).

Per shard count: the latency of ``get_many`` and ``set_many`` of ``--batch`` keys (one
statement per shard, every shard's statement sent before any reply is read: one round
trip), and the throughput of 8 threads each repeating ``get_many`` + ``set_many`` of its
own keys. From 2 shards on, each is also measured "sequential": the same calls with a
pass-through ``connection.execute_wrapper()`` on every shard alias, which makes the
backend ask the shards one after another through Django's cursor (its path while
statements are watched) — the path of the previous version, measured in the same rounds
for an A/B comparison. ``get_many threads`` fans ``get_many`` out over a thread pool
instead (one thread per shard, connections kept), the path the backend does not take.

The shards are the main MariaDB and the extra ones ``scripts/services.py up`` starts
(``KVCACHE_MYSQL_SHARD_PORTS``); their aliases are registered for the run only. Run it
with ``--scenario shards``: it is not part of the default set.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

from django.db import DEFAULT_DB_ALIAS, connections

from kvcache_bench.caches import KV_MYSQL, TIMEOUT
from kvcache_bench.context import Context
from kvcache_bench.data import filler
from kvcache_bench.timing import rotated, summarize, time_calls

SHARD_COUNTS = (1, 2, 3)
WORKERS = 8
ALIAS_PREFIX = "kvbench_shard_"


def shard_aliases() -> list[str]:
    """The main server's alias, then one alias per extra server (registered here)."""
    from tests.settings import MYSQL_SHARD_PORTS

    aliases = [DEFAULT_DB_ALIAS]
    for port in MYSQL_SHARD_PORTS:
        alias = f"{ALIAS_PREFIX}{port}"
        # A copy of the main alias (defaults already filled in) on the shard's port.
        connections.settings[alias] = {**connections.settings[DEFAULT_DB_ALIAS], "PORT": str(port)}
        aliases.append(alias)
    return aliases


def reachable(alias: str) -> bool:
    try:
        connections[alias].ensure_connection()
    except Exception:  # any driver error: no server to benchmark
        return False
    return True


def build(context: Context, aliases: list[str], **options: Any) -> Any:
    from django.utils.module_loading import import_string

    location = f"kvbench_{context.token}_shards"
    databases = {"DATABASES": aliases} if len(aliases) > 1 else {"DATABASE": aliases[0]}
    params = {"TIMEOUT": TIMEOUT, "KEY_PREFIX": f"kvb-{context.token}-shards",
              "OPTIONS": {"MAX_ENTRIES": 10_000_000, "CULL_PROBABILITY": 0, **databases, **options}}
    return import_string(KV_MYSQL)(location, params)


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    aliases = [alias for alias in shard_aliases() if reachable(alias)]
    counts = [n for n in SHARD_COUNTS if n <= len(aliases)]
    if len(counts) < len(SHARD_COUNTS):
        context.notes.append(f"shards: only {len(aliases)} MariaDB server(s) reachable "
                             "(scripts/services.py up starts 3)")
    caches = {n: build(context, aliases[:n]) for n in counts}
    widest = caches[counts[-1]]
    widest.create_table()
    values = filler(p.seed, p.batch)
    items = {f"shard.{context.token}.{i}": value for i, value in enumerate(values)}
    keys = list(items)
    results: list[dict[str, Any]] = []
    durations: dict[tuple[int, str], list[int]] = {}
    pools = {n: ThreadPoolExecutor(n) for n in counts if n > 1}
    try:
        with context.progress("shards", p.rounds * len(counts)) as bar:
            for round_index in range(p.rounds):
                for n in rotated(counts, round_index):
                    cache = caches[n]
                    timed = {}
                    for sequential in rotated([False, True] if n > 1 else [False], round_index):
                        suffix = " sequential" if sequential else ""
                        with watched(aliases[:n], sequential):
                            timed["set_many" + suffix] = time_calls(
                                lambda _: cache.set_many(items), range(p.calls))
                            timed["get_many" + suffix] = time_calls(
                                lambda _: cache.get_many(keys), range(p.calls))
                    if n in pools:
                        fan_out = parallel_get_many(context, aliases[:n], pools[n])
                        timed["get_many threads"] = time_calls(lambda _: fan_out(keys), range(p.calls))
                    for operation, outcome in timed.items():
                        durations.setdefault((n, operation), []).extend(outcome.durations)
                        if operation.startswith("get_many") and any(r != items for r in outcome.results):
                            context.failures.append(f"shards: {operation} on {n} shard(s) was wrong")
                    bar.update()
        for (n, operation), taken in sorted(durations.items()):
            results.append({"operation": operation, "shards": n, **summarize(taken)})
        for n in counts:
            for sequential in [False, True] if n > 1 else [False]:
                operation = f"throughput x{WORKERS}" + (" sequential" if sequential else "")
                results.append({"operation": operation, "shards": n, **throughput(
                    context, aliases[:n], p.iterations, values, sequential)})
    finally:
        for pool in pools.values():
            pool.shutdown()
        for cache in caches.values():
            cache.clear()
        for alias in aliases:
            with connections[alias].cursor() as cursor:
                cursor.execute(f"DROP TABLE IF EXISTS `{widest.table}`")
    return {"counts": counts, "keys": p.batch, "workers": WORKERS, "results": results}


def passthrough(execute: Callable[..., Any], sql: str, params: Any, many: bool,
                context: dict[str, Any]) -> Any:
    return execute(sql, params, many, context)


@contextmanager
def watched(aliases: list[str], on: bool) -> Iterator[None]:
    """While ``on``: a pass-through execute wrapper on each alias (this thread's
    connections), so the backend sends through the cursor, one shard after another."""
    with ExitStack() as stack:
        if on:
            for alias in aliases:
                stack.enter_context(connections[alias].execute_wrapper(passthrough))
        yield


def parallel_get_many(context: Context, aliases: list[str],
                      pool: ThreadPoolExecutor) -> Callable[[list[str]], dict[str, Any]]:
    """get_many with one pool thread per shard (each its own single-database cache)."""
    sharded = build(context, aliases)
    local = threading.local()

    def on_shard(index: int, group: list[str]) -> dict[str, Any]:
        if not hasattr(local, "caches"):
            local.caches = {}
        cache = local.caches.setdefault(index, build(context, [aliases[index]]))
        return cache.get_many(group)

    def get_many(keys: list[str]) -> dict[str, Any]:
        by_caller = {sharded.make_key(key): key for key in keys}
        groups = sharded.router.group(list(by_caller))
        futures = [pool.submit(on_shard, index, [by_caller[k] for k in group])
                   for index, group in groups.items()]
        found: dict[str, Any] = {}
        for future in futures:
            found.update(future.result())
        return found

    return get_many


def throughput(context: Context, aliases: list[str], iterations: int,
               values: list[bytes], sequential: bool = False) -> dict[str, Any]:
    """8 threads, each ``iterations`` times set_many + get_many of its own keys."""
    barrier = threading.Barrier(WORKERS)
    operations = [0] * WORKERS
    spans: list[tuple[float, float]] = []

    def work(worker: int) -> None:
        cache = build(context, aliases)
        items = {f"shard.{context.token}.w{worker}.{i}": value for i, value in enumerate(values)}
        try:
            cache.get_many(list(items))  # connect before the clock starts
            barrier.wait(120)
            started = time.monotonic()
            with watched(aliases, sequential):
                for _ in range(iterations):
                    cache.set_many(items)
                    cache.get_many(list(items))
                    operations[worker] += 2
            spans.append((started, time.monotonic()))
        finally:
            connections.close_all()

    with ThreadPoolExecutor(WORKERS) as threads:
        list(threads.map(work, range(WORKERS)))
    elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
    return {"ops_per_s": round(sum(operations) / elapsed, 1) if elapsed > 0 else None,
            "operations": sum(operations), "elapsed_s": round(elapsed, 4)}
