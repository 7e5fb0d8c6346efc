"""``capacity``: how many entries of the value mix a memcached node of fixed memory keeps.

For each memcached client (ours with its defaults, Django's PyMemcacheCache), a fresh
node is started with ``-m`` of ``--capacity-mb`` MiB; the client writes N entries, N
chosen so that the values written add up to ``capacity_fill`` times that memory (so
the node overflows several times and evicts), then reads every key back. Reported: the
entries still readable, and that count over PyMemcacheCache's. The values cycle through
a pool of distinct values of the mix (each is compressed on its own, so repeats change
nothing about its size).

Beside our defaults, ours runs once more with the setting we recommend where memory
matters most ("kv-memcached zstd+dict": zstd level 3 with a 16 KB dictionary trained on
2000 values of the same mix drawn with another seed, never the values then written) when
zstd is installed. Entries are also counted by kind (``kept_html``...): the small ints
and strings of a mix fit in a few slab pages and all survive with every client, so the
ratio of entries kept is below the ratio of bytes per entry.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import tempfile
import time
from typing import Any

from kvcache_bench.caches import add_peer_ratios, memcached_families, memcached_spec
from kvcache_bench.checks import matches
from kvcache_bench.context import Context
from kvcache_bench.data import make_values
from kvcache_bench.payloads import payload_size
from kvcache_bench.scenarios.codec import compact_variants, variant_peer_ratios
from kvcache_bench.servers import dedicated_node, node_stats

MIB = 1024 * 1024
POOL = 1024  # distinct values the entries cycle through
CHUNK = 500  # keys per set_many / get_many


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    values = make_values(p.seed, POOL, p.values, 0)
    pool, kinds = values.entries, values.kinds
    mean = sum(payload_size(value) for value in pool) / len(pool)
    written = math.ceil(p.capacity_fill * p.capacity_mb * MIB / mean)
    with tempfile.TemporaryDirectory() as folder:
        variants = compact_variants(context, folder)
        runs: list[tuple[str, str, str, dict[str, Any] | None]] = []
        for family in memcached_families(context.caches):
            runs.append((family, family, "defaults", None))
            if family in variants:
                runs.append((family, *variants[family]))
        results = []
        with context.progress("capacity", len(runs)) as bar:
            for family, client, setting, options in runs:
                results.append(_fill_and_count(context, family, client, setting, options, pool,
                                               kinds, written))
                bar.update()
    add_peer_ratios(results, "kept", subject="client")
    variant_peer_ratios(results, "kept", subject="client")
    return {"memory_mb": p.capacity_mb, "written": written, "mean_value_bytes": round(mean, 1),
            "results": results}


def _fill_and_count(context: Context, family: str, client: str, setting: str,
                    options: dict[str, Any] | None,
                    pool: tuple[Any, ...], kinds: tuple[str, ...], written: int) -> dict[str, Any]:
    memory_mb = context.parameters.capacity_mb
    keys = [f"capacity.{index}" for index in range(written)]
    expected = lambda index: pool[index % len(pool)]  # noqa: E731
    failed = errors = kept = wrong = 0
    kept_by_kind: collections.Counter[str] = collections.Counter()
    first_error = None
    with dedicated_node(memory_mb) as node:
        spec = memcached_spec(family, context.token, [node], 1)
        if options is not None:
            spec = dataclasses.replace(spec, options=options)
        cache = spec.build()
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
                        kept_by_kind[kinds[index % len(pool)]] += good
            stats = node_stats(node)
        finally:
            cache.close()
    if wrong:
        context.failures.append(f"capacity: {client} read back {wrong} wrong value(s)")
    if first_error:
        context.notes.append(f"capacity: {client}: {errors} entries not written, first error: {first_error}")
    return {"client": client, "setting": setting, "variant_of": family if options else None,
            "memory_mb": memory_mb, "written": written, "kept": kept,
            "kept_percent": round(100 * kept / written, 1), "kept_per_mb": round(kept / memory_mb, 1),
            "refused": failed + errors, "evictions": stats.get("evictions"),
            "node_bytes": stats.get("bytes"), "write_s": round(write_s, 2),
            **{f"kept_{kind}": kept_by_kind[kind] for kind in sorted(set(kinds))}}

