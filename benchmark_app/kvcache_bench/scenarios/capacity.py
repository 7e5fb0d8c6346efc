"""``capacity``: how many entries of the value mix a memcached node of fixed memory keeps.

For each memcached client (ours with its defaults, Django's PyMemcacheCache), a fresh
node is started with ``-m`` of ``--capacity-mb`` MiB; the client writes N entries, N
chosen so that the values written add up to ``capacity_fill`` times that memory (so
the node overflows several times and evicts), then reads every key back. Reported: the
entries still readable, and that count over PyMemcacheCache's. The values cycle through
a pool of distinct values of the mix (each is compressed on its own, so repeats change
nothing about its size).
"""
from __future__ import annotations

import math
import time
from typing import Any

from kvcache_bench.caches import add_peer_ratios, memcached_families, memcached_spec
from kvcache_bench.checks import matches
from kvcache_bench.context import Context
from kvcache_bench.data import make_values
from kvcache_bench.payloads import payload_size
from kvcache_bench.servers import dedicated_node, node_stats

MIB = 1024 * 1024
POOL = 1024  # distinct values the entries cycle through
CHUNK = 500  # keys per set_many / get_many


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    pool = make_values(p.seed, POOL, p.values, 0).entries
    mean = sum(payload_size(value) for value in pool) / len(pool)
    written = math.ceil(p.capacity_fill * p.capacity_mb * MIB / mean)
    families = memcached_families(context.caches)
    results = []
    with context.progress("capacity", len(families)) as bar:
        for family in families:
            results.append(_fill_and_count(context, family, pool, written))
            bar.update()
    add_peer_ratios(results, "kept", subject="client")
    return {"memory_mb": p.capacity_mb, "written": written, "mean_value_bytes": round(mean, 1),
            "results": results}


def _fill_and_count(context: Context, family: str, pool: tuple[Any, ...], written: int) -> dict[str, Any]:
    memory_mb = context.parameters.capacity_mb
    keys = [f"capacity.{index}" for index in range(written)]
    expected = lambda index: pool[index % len(pool)]  # noqa: E731
    failed = errors = kept = wrong = 0
    first_error = None
    with dedicated_node(memory_mb) as node:
        cache = memcached_spec(family, context.token, [node], 1).build()
        try:
            started = time.monotonic()
            for start in range(0, written, CHUNK):
                batch = {key: expected(start + i) for i, key in enumerate(keys[start:start + CHUNK])}
                try:
                    failed += len(cache.set_many(batch))
                except Exception as exc:  # a full node may refuse a write: counted, not fatal
                    errors += len(batch)
                    first_error = first_error or repr(exc)
            write_s = time.monotonic() - started
            for start in range(0, written, CHUNK):
                found = cache.get_many(keys[start:start + CHUNK])
                for index in range(start, min(start + CHUNK, written)):
                    if keys[index] in found:
                        good = matches(found[keys[index]], expected(index))
                        kept, wrong = kept + good, wrong + (not good)
            stats = node_stats(node)
        finally:
            cache.close()
    if wrong:
        context.failures.append(f"capacity: {family} read back {wrong} wrong value(s)")
    if first_error:
        context.notes.append(f"capacity: {family}: {errors} entries not written, first error: {first_error}")
    return {"client": family, "memory_mb": memory_mb, "written": written, "kept": kept,
            "kept_percent": round(100 * kept / written, 1), "kept_per_mb": round(kept / memory_mb, 1),
            "refused": failed + errors, "evictions": stats.get("evictions"),
            "node_bytes": stats.get("bytes"), "write_s": round(write_s, 2)}
