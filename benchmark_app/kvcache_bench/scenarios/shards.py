"""``shards``: MySQLCache over 1, 2 and 3 MariaDB servers (``OPTIONS["DATABASES"]``).

The servers are the benchmark's own, three alike in everything
(``kvcache_bench.servers.mariadb_servers``), so no shard is the busier main server.

**Latency** (servers uncapped): per shard count, the median of ``get_many`` and
``set_many`` of ``--batch`` keys (one statement per shard, every shard's statement sent
before any reply is read: one round trip). ``get_many threads`` fans ``get_many`` out
over a thread pool instead (one thread per shard, connections kept), the path the
backend does not take.

**Throughput** (with ``--server-cpu Q``, each server capped at Q of a core): a shard on a
host of its own brings its own CPU, which one machine can only imitate. Each server is put
in a cgroup v1 cpu group of its own with a quota of Q cores (and a high CPU weight, so it
gets its quota however busy the client keeps the cores) and held on one core (server N on
core N modulo the cores): a host with one slow core. The client runs beside
them unconstrained: ``--client-processes`` processes of ``--client-threads`` threads, each
thread repeating one operation (``get``, ``set`` or ``get_many`` of ``--batch`` keys) on
random keys of a populated key space. After a warm-up, the calls that complete within a
window of ``--shard-seconds`` that all of them run through are counted. Shard counts and
operations are interleaved over ``--shard-rounds`` rounds (one operation's shard counts
back to back); the figure is the rounds' median, reported with their spread, each
round's ratio to the same round on one shard, the client's CPU (cores busy), the servers'
CPU per call, how often their quota held them back, and what other programs kept the
machine's cores busy meanwhile. Where the controller is not writable
(cgroup v2 only, not root) a note says so and the servers run uncapped.

Run it with ``--scenario shards`` (``make bench`` does, with ``--server-cpu``).
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable

from django.db import DEFAULT_DB_ALIAS, connections

from django_kvcache.mysql import blocking
from kvcache_bench import servers
from kvcache_bench.caches import KV_MYSQL, TIMEOUT
from kvcache_bench.context import Context
from kvcache_bench.data import filler
from kvcache_bench.timing import rotated, summarize, time_calls

SHARD_COUNTS = (1, 2, 3)
ALIAS_PREFIX = "kvbench_shard_"
#: What the throughput part repeats; ``get_many`` asks for ``--batch`` keys.
OPERATIONS = ("get", "set", "get_many")
#: Keys every throughput operation picks from at random (all present before it starts).
KEY_SPACE = 2000
#: Between the start of the client processes and the counted window: connections, server
#: detection, the caches' first statements, the quota's first periods.
WARM_UP_S = 1.5
#: Scaling the issue asks of 3 shards over 1 (throughput of one run): get_many touches
#: every shard, so only its per-key work spreads.
TARGETS = {"get": 2.4, "set": 2.4, "get_many": 1.2}
BARRIER_TIMEOUT = 120.0
#: Random key draws per client thread, cycled.
DRAWS = 1000


def register(host: str, ports: list[int] | tuple[int, ...]) -> list[str]:
    """One alias per server of ours (the ``kvcache`` user and database, as services.py
    sets them up)."""
    aliases = []
    for port in ports:
        alias = f"{ALIAS_PREFIX}{port}"
        connections.settings[alias] = {
            **connections.settings[DEFAULT_DB_ALIAS], "HOST": host, "PORT": str(port),
            "USER": "kvcache", "PASSWORD": "", "NAME": "kvcache",
        }
        aliases.append(alias)
    return aliases


def build(location: str, key_prefix: str, aliases: list[str], **options: Any) -> Any:
    from django.utils.module_loading import import_string

    databases = {"DATABASES": aliases} if len(aliases) > 1 else {"DATABASE": aliases[0]}
    params = {"TIMEOUT": TIMEOUT, "KEY_PREFIX": key_prefix,
              "OPTIONS": {"MAX_ENTRIES": 10_000_000, "CULL_PROBABILITY": 0, **databases, **options}}
    return import_string(KV_MYSQL)(location, params)


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    location, key_prefix = f"kvbench_{context.token}_shards", f"kvb-{context.token}-shards"
    with servers.mariadb_servers(max(SHARD_COUNTS), context.token,
                                 cpu_groups=p.server_cpu is not None) as own:
        if own.note:
            context.notes.append(f"shards: {own.note}: the servers ran uncapped")
        aliases = register(own.host, own.ports)
        caches = {n: build(location, key_prefix, aliases[:n]) for n in SHARD_COUNTS}
        caches[max(SHARD_COUNTS)].create_table()
        try:
            results = latency(context, caches, aliases, location, key_prefix)
            capped = bool(own.groups) and p.server_cpu is not None
            own.limit(p.server_cpu if capped else None)
            results += throughput(context, own, caches, aliases, location, key_prefix)
        finally:
            own.limit(None)
            blocking.retire_pools(aliases)  # the cache's connections to the servers
            for alias in aliases:
                connections[alias].close()
    return {"counts": list(SHARD_COUNTS), "keys": p.batch,
            "server_cpu": p.server_cpu if capped else None,
            "client_processes": p.client_processes, "client_threads": p.client_threads,
            "window_s": p.shard_seconds, "rounds": p.shard_rounds, "key_space": KEY_SPACE,
            "targets": TARGETS, "results": results}


# --- latency ---------------------------------------------------------------------------------


def latency(context: Context, caches: dict[int, Any], aliases: list[str], location: str,
            key_prefix: str) -> list[dict[str, Any]]:
    p = context.parameters
    values = filler(p.seed, p.batch)
    items = {f"shard.{context.token}.{i}": value for i, value in enumerate(values)}
    keys = list(items)
    durations: dict[tuple[int, str], list[int]] = {}
    pools = {n: ThreadPoolExecutor(n) for n in SHARD_COUNTS if n > 1}
    try:
        with context.progress("shards latency", p.rounds * len(SHARD_COUNTS)) as bar:
            for round_index in range(p.rounds):
                for n in rotated(SHARD_COUNTS, round_index):
                    cache = caches[n]
                    timed = {
                        "set_many": time_calls(lambda _: cache.set_many(items), range(p.calls)),
                        "get_many": time_calls(lambda _: cache.get_many(keys), range(p.calls)),
                    }
                    if n in pools:
                        fan_out = parallel_get_many(cache, aliases[:n], pools[n], location,
                                                    key_prefix)
                        timed["get_many threads"] = time_calls(lambda _: fan_out(keys), range(p.calls))
                    for operation, outcome in timed.items():
                        durations.setdefault((n, operation), []).extend(outcome.durations)
                        if operation.startswith("get_many") and any(r != items for r in outcome.results):
                            context.failures.append(f"shards: {operation} on {n} shard(s) was wrong")
                    bar.update()
    finally:
        for pool in pools.values():
            pool.shutdown()
    return [{"operation": operation, "shards": n, **summarize(taken)}
            for (n, operation), taken in sorted(durations.items())]


def parallel_get_many(sharded: Any, aliases: list[str], pool: ThreadPoolExecutor, location: str,
                      key_prefix: str) -> Callable[[list[str]], dict[str, Any]]:
    """get_many with one pool thread per shard (each its own single-database cache)."""
    local = threading.local()

    def on_shard(index: int, group: list[str]) -> dict[str, Any]:
        if not hasattr(local, "caches"):
            local.caches = {}
        cache = local.caches.setdefault(index, build(location, key_prefix, [aliases[index]]))
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


# --- throughput ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What one client process does for one throughput figure."""

    host: str
    ports: tuple[int, ...]  # the shards of this cache
    location: str
    key_prefix: str
    operation: str
    batch: int
    seed: int
    threads: int
    start_at: float = 0.0  # time.monotonic() (one clock for every process): counting starts
    end_at: float = 0.0  # counting, and the calls, stop


_barrier: Any = None  # set in each client process by _start_client


def _start_client(barrier: Any) -> None:
    global _barrier
    import django

    django.setup()
    _barrier = barrier


def drive(load: Load) -> dict[str, Any]:
    """In a client process: ``load.threads`` threads repeat the operation until ``end_at``.
    Returns the calls that completed within ``[start_at, end_at)``, this process's CPU
    time in that window, and the errors."""
    _barrier.wait(BARRIER_TIMEOUT)  # one Load per process: none takes two
    aliases = register(load.host, load.ports)
    values = filler(load.seed, 64)
    keys = [f"k{i}" for i in range(KEY_SPACE)]
    counted = [0] * load.threads
    errors: list[str] = []

    def repeat(index: int) -> None:
        cache = build(load.location, load.key_prefix, aliases)
        # The random keys (and values) drawn before the clock runs: drawing 20 keys per
        # get_many cost a tenth of the client's CPU.
        rng = random.Random(f"{load.seed}.{os.getpid()}.{index}")
        chosen = [rng.sample(keys, load.batch) for _ in range(DRAWS)]
        call = {
            "get": lambda i: cache.get(chosen[i][0]),
            "set": lambda i: cache.set(chosen[i][0], values[i % len(values)]),
            "get_many": lambda i: cache.get_many(chosen[i]),
        }[load.operation]
        calls = 0
        try:
            for draw in itertools.cycle(range(DRAWS)):
                try:
                    call(draw)
                except Exception as exc:  # counted and reported, never a figure
                    errors.append(repr(exc))
                done = time.monotonic()
                if done >= load.end_at:
                    break
                if done >= load.start_at:
                    calls += 1
        finally:
            counted[index] = calls
            connections.close_all()

    threads = [threading.Thread(target=repeat, args=(index,)) for index in range(load.threads)]
    for thread in threads:
        thread.start()
    sleep_until(load.start_at)
    cpu_start = time.process_time()
    sleep_until(load.end_at)
    cpu = time.process_time() - cpu_start
    for thread in threads:
        thread.join()
    return {"calls": sum(counted), "cpu_s": cpu, "errors": len(errors),
            "first_error": errors[0] if errors else None}


def sleep_until(moment: float) -> None:
    while (left := moment - time.monotonic()) > 0:
        time.sleep(left)


def throughput(context: Context, own: servers.MariaDBServers, caches: dict[int, Any],
               aliases: list[str], location: str, key_prefix: str) -> list[dict[str, Any]]:
    p = context.parameters
    values = filler(p.seed, 64)
    for cache in caches.values():  # every key present on its shard, whatever the count
        cache.set_many({f"k{i}": values[i % len(values)] for i in range(KEY_SPACE)})
    rounds: dict[tuple[int, str], list[dict[str, Any]]] = {}
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(p.client_processes)
    total = p.shard_rounds * len(SHARD_COUNTS) * len(OPERATIONS)
    with spawn.Pool(p.client_processes, initializer=_start_client, initargs=(barrier,)) as pool, \
            context.progress("shards throughput", total) as bar:
        for round_index in range(p.shard_rounds):
            # One operation's shard counts back to back: the machine's drift (other work,
            # frequency) weighs on them alike, and each round gives a ratio of its own.
            for operation in rotated(OPERATIONS, round_index):
                for n in rotated(SHARD_COUNTS, round_index):
                    load = Load(own.host, tuple(own.ports[:n]), location, key_prefix, operation, p.batch,
                                p.seed + round_index, p.client_threads)
                    rounds.setdefault((n, operation), []).append(
                        one_window(pool, own, load, p.client_processes, p.shard_seconds))
                    bar.update()
    results = []
    for (n, operation), measured in sorted(rounds.items(), key=lambda item: (
            OPERATIONS.index(item[0][1]), item[0][0])):
        entry = summarize_rounds(context, n, operation, p.batch, measured)
        # Each round against the same round on the fewest shards: measured back to back.
        fewest = rounds[min(SHARD_COUNTS), operation]
        entry["rounds_vs_fewest"] = [round(m["calls"] / f["calls"], 2) if f["calls"] else None
                                     for m, f in zip(measured, fewest)]
        results.append(entry)
    return results


def one_window(pool: Any, own: servers.MariaDBServers, load: Load, processes: int,
               seconds: float) -> dict[str, Any]:
    """Every client process on ``load``; what the window counted, client and servers."""
    start_at = time.monotonic() + WARM_UP_S
    load = replace(load, start_at=start_at, end_at=start_at + seconds)
    pending = pool.map_async(drive, [load] * processes, chunksize=1)
    sleep_until(load.start_at)
    cpu_before, periods_before = own.cpu_seconds(), own.periods()
    busy_before = servers.machine_busy_seconds()
    sleep_until(load.end_at)
    cpu_after, periods_after = own.cpu_seconds(), own.periods()
    busy = servers.machine_busy_seconds() - busy_before
    outcomes = pending.get(timeout=BARRIER_TIMEOUT + seconds + 60)
    shards = len(load.ports)
    periods = [(after[0] - before[0], after[1] - before[1])
               for before, after in zip(periods_before[:shards], periods_after[:shards])]
    client_cpu = sum(o["cpu_s"] for o in outcomes)
    return {
        "calls": sum(o["calls"] for o in outcomes),
        "client_cpu_s": client_cpu,
        # What else kept the machine's cores busy meanwhile (other programs, this
        # process): the measurement's interference.
        "other_cpu_s": max(0.0, busy - client_cpu - sum(
            after - before for before, after in zip(cpu_before, cpu_after))),
        # The servers this cache used (the others idle meanwhile).
        "server_cpu_s": sum(after - before for before, after in
                            zip(cpu_before[:shards], cpu_after[:shards])),
        "periods": sum(ran for ran, _ in periods),
        "throttled_periods": sum(cut for _, cut in periods),
        "errors": sum(o["errors"] for o in outcomes),
        "first_error": next((o["first_error"] for o in outcomes if o["first_error"]), None),
        "seconds": seconds,
    }


def summarize_rounds(context: Context, n: int, operation: str, batch: int,
                     measured: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [m["calls"] / m["seconds"] for m in measured]
    calls = sum(m["calls"] for m in measured) or 1
    seconds = sum(m["seconds"] for m in measured)
    errors = sum(m["errors"] for m in measured)
    name = f"get_many({batch})" if operation == "get_many" else operation
    if errors:
        first = next(m["first_error"] for m in measured if m["first_error"])
        context.failures.append(f"shards: throughput {name} on {n} shard(s): {errors} "
                                f"error(s), first: {first}")
    median = statistics.median(rates)
    return {
        "operation": f"throughput {name}", "shards": n,
        "ops_per_s": round(median, 1),
        "rounds_ops_per_s": [round(rate, 1) for rate in rates],
        "spread": round((max(rates) - min(rates)) / median, 3) if median else None,
        "client_cores": round(sum(m["client_cpu_s"] for m in measured) / seconds, 2),
        "server_cpu_us": round(sum(m["server_cpu_s"] for m in measured) / calls * 1e6, 1),
        "server_cores": round(sum(m["server_cpu_s"] for m in measured) / seconds, 3),
        "other_cores": round(sum(m["other_cpu_s"] for m in measured) / seconds, 2),
        # Of the quota periods the servers ran in, the share their quota cut short: near 1
        # when the cap is what limits them.
        "throttled": round(sum(m["throttled_periods"] for m in measured)
                           / max(1, sum(m["periods"] for m in measured)), 3),
        "errors": errors,
    }
