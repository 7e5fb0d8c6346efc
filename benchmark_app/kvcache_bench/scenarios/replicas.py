"""``replicas``: our MemcachedCache with ``REPLICAS: 2`` beside ``REPLICAS: 1``, on
``NODES`` memcached nodes of the scenario's own (it kills one of them).

* *latency*: ``set``, ``get`` and ``get_many`` of ``batch`` keys on the mix's values, all
  nodes up, ``rounds`` x ``calls`` per setting and operation, rounds interleaved between
  the settings: the median per call and its ratio to ``REPLICAS: 1``.
* *memory*: what the nodes hold (memcached's ``bytes`` and ``curr_items``, summed) after
  ``replica_keys`` entries of the mix were written to freshly started nodes.
* *outage*: the ``replica_keys`` entries written, then one thread calls for
  ``replica_seconds``: 90 % ``get``, 10 % ``set`` of a newer version of the key (each
  value is ``(version, payload)``); halfway, one node is killed (SIGKILL). Hit ratio
  before and after the kill, and stale reads: a value older than the last version this
  thread wrote for its key. ``IGNORE_EXCEPTIONS`` (the default): a failure is a miss.
  The node is started again (empty) before the next setting.
"""
from __future__ import annotations

import random
import time
from typing import Any

from django_kvcache.backends.memcached import MemcachedCache
from kvcache_bench.context import Context
from kvcache_bench.servers import OwnNodes, node_stats, own_nodes
from kvcache_bench.timing import rotated, summarize, time_calls

NODES = 8
SETTINGS = (1, 2)
READ_SHARE = 0.9
#: The killed node's failures are noticed by IO errors at once (connection refused); the
#: retry time only decides how often it is probed afterwards.
RETRY_TIMEOUT = 1.0


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    values = context.values.entries if context.values else (b"x" * 100,)
    scenario: dict[str, Any] = {"nodes": NODES, "keys": p.replica_keys, "batch": p.batch,
                                "seconds": p.replica_seconds, "read_share": READ_SHARE,
                                "results": []}
    try:
        with own_nodes(NODES) as nodes:
            with context.progress("replicas", 2 * len(SETTINGS) + p.rounds) as bar:
                scenario["results"] += _memory(context, nodes, values, bar)
                scenario["results"] += _latency(context, nodes, values, bar)
                for replicas in SETTINGS:
                    scenario["results"].append(_outage(context, nodes, values, replicas))
                    bar.update()
    except RuntimeError as exc:
        context.notes.append(f"replicas: skipped, {exc}")
    return scenario


def _cache(context: Context, nodes: OwnNodes, replicas: int, tag: str) -> MemcachedCache:
    # Node health is process-wide per (node, FAILURE_THRESHOLD, RETRY_TIMEOUT): a retry
    # time of its own per cache keeps one setting's outage out of the next one's.
    return MemcachedCache(nodes.addresses, {
        "KEY_PREFIX": f"rep.{context.token}.{tag}", "TIMEOUT": 3600,
        "OPTIONS": {"REPLICAS": replicas, "RETRY_TIMEOUT": RETRY_TIMEOUT + random.random() / 100},
    })


def _keys(count: int) -> list[str]:
    return [f"k{index}" for index in range(count)]


def _memory(context: Context, nodes: OwnNodes, values: tuple, bar: Any) -> list[dict[str, Any]]:
    results = []
    keys = _keys(context.parameters.replica_keys)
    for replicas in SETTINGS:
        nodes.restart()  # flush_all frees its items lazily: fresh nodes count from zero
        before = [node_stats(address) for address in nodes.addresses]
        cache = _cache(context, nodes, replicas, f"mem{replicas}")
        for start in range(0, len(keys), 100):
            chunk = keys[start:start + 100]
            cache.set_many({key: values[(start + i) % len(values)] for i, key in enumerate(chunk)})
        after = [node_stats(address) for address in nodes.addresses]
        results.append({
            "replicas": replicas, "part": "memory",
            "bytes": sum(a["bytes"] - b["bytes"] for a, b in zip(after, before)),
            "items": sum(a["curr_items"] - b["curr_items"] for a, b in zip(after, before)),
        })
        cache.disconnect_all()
        bar.update()
    nodes.flush()
    return results


def _latency(context: Context, nodes: OwnNodes, values: tuple, bar: Any) -> list[dict[str, Any]]:
    p = context.parameters
    keys = _keys(max(p.replica_keys, p.batch))
    caches = {replicas: _cache(context, nodes, replicas, f"lat{replicas}") for replicas in SETTINGS}
    for cache in caches.values():
        cache.set_many({key: values[i % len(values)] for i, key in enumerate(keys)})
    rng = random.Random(p.seed)
    operations = ("set", "get", f"get_many({p.batch})")
    durations: dict[tuple[int, str], list[int]] = {(r, op): [] for r in SETTINGS for op in operations}
    cpu = {pair: 0 for pair in durations}
    for round_index in range(p.rounds):
        picks = [rng.randrange(len(keys)) for _ in range(p.calls)]
        batches = [rng.sample(keys, p.batch) for _ in range(p.calls)]
        for replicas in rotated(list(SETTINGS), round_index):
            cache = caches[replicas]
            timed = [
                ("set", time_calls(lambda i: cache.set(keys[i], values[i % len(values)]), picks)),
                ("get", time_calls(lambda i: cache.get(keys[i]), picks)),
                (operations[2], time_calls(cache.get_many, batches)),
            ]
            for operation, result in timed:
                if round_index >= p.warmup_rounds or p.rounds <= p.warmup_rounds:
                    durations[replicas, operation] += result.durations
                    cpu[replicas, operation] += result.cpu_ns
                if operation == "get" and any(r is None for r in result.results):
                    context.failures.append(f"replicas: a get missed with every node up "
                                            f"(REPLICAS {replicas})")
        bar.update()
    results = []
    for (replicas, operation), taken in durations.items():
        results.append({"replicas": replicas, "part": "latency", "operation": operation,
                        **summarize(taken, cpu[replicas, operation])})
    single = {e["operation"]: e["median_us"] for e in results if e["replicas"] == 1}
    for entry in results:
        entry["vs_replicas_1"] = round(entry["median_us"] / single[entry["operation"]], 3)
    for cache in caches.values():
        cache.disconnect_all()
    nodes.flush()
    return results


def _outage(context: Context, nodes: OwnNodes, values: tuple, replicas: int) -> dict[str, Any]:
    p = context.parameters
    keys = _keys(p.replica_keys)
    cache = _cache(context, nodes, replicas, f"out{replicas}")
    written = dict.fromkeys(keys, 0)
    for start in range(0, len(keys), 100):
        cache.set_many({key: (0, values[(start + i) % len(values)])
                        for i, key in enumerate(keys[start:start + 100])})
    rng = random.Random(f"{p.seed}:outage")
    counts = {"before": [0, 0], "after": [0, 0]}  # [hits, gets]
    stale = sets = errors = 0
    start = time.monotonic()
    kill_at = start + p.replica_seconds / 2
    killed = False
    while (now := time.monotonic()) < start + p.replica_seconds:
        if not killed and now >= kill_at:
            nodes.kill(0)
            killed = True
        key = keys[rng.randrange(len(keys))]
        try:
            if rng.random() < READ_SHARE:
                found = cache.get(key)
                phase = counts["after" if killed else "before"]
                phase[1] += 1
                if found is not None:
                    phase[0] += 1
                    if found[0] < written[key]:
                        stale += 1
            else:
                written[key] += 1
                sets += 1
                cache.set(key, (written[key], values[rng.randrange(len(values))]))
        except Exception:  # counted: IGNORE_EXCEPTIONS leaves none but a bug
            errors += 1
    nodes.kill(0)
    nodes.start(0)
    nodes.flush()
    cache.disconnect_all()
    if stale:
        context.failures.append(f"replicas: {stale} stale read(s) with REPLICAS {replicas}")
    return {
        "replicas": replicas, "part": "outage",
        "gets_before_kill": counts["before"][1], "gets_after_kill": counts["after"][1],
        "hit_ratio_before_kill": _ratio(*counts["before"]),
        "hit_ratio_after_kill": _ratio(*counts["after"]),
        "stale_reads": stale, "sets": sets, "errors": errors,
    }


def _ratio(hits: int, gets: int) -> float | None:
    return round(hits / gets, 4) if gets else None
