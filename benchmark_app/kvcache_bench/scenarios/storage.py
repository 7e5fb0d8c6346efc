"""``storage``: the bytes each cache keeps per entry of the value mix.

Each cache is given the same N entries of the mix (``--storage-entries``), written the
way ``rows`` grows its tables, then:

* a table-backed cache (its table created anew, so no space freed by earlier scenarios
  counts): the bytes in its key and value columns
  (``SUM(LENGTH(cache_key) + LENGTH(value))``: DatabaseCache stores base64 text of the
  pickle, django-mysql and ours bytes, compressed or not), and on MariaDB the table's
  data and index length from information_schema after ``ANALYZE TABLE`` (whole pages,
  so coarser);
* a memcached client: the ``bytes`` stat of a fresh node it alone writes to (items with
  their keys and memcached's per-item header).
"""
from __future__ import annotations

from typing import Any

from kvcache_bench.caches import add_peer_ratios, memcached_families, memcached_spec
from kvcache_bench.context import Context
from kvcache_bench.data import make_values
from kvcache_bench.payloads import payload_size
from kvcache_bench.servers import dedicated_node, node_stats
from kvcache_bench.storage import bulk_load, create_storage, table_usage

MIB = 1024 * 1024
MIN_NODE_MB = 64


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    entries = make_values(p.seed, p.storage_entries, p.values, 0).entries
    items = {f"storage.{index}": value for index, value in enumerate(entries)}
    payload = sum(payload_size(value) for value in entries)
    tables = [spec for spec in context.caches if spec.table is not None]
    families = memcached_families(context.caches)
    results = []
    with context.progress("storage", len(tables) + len(families)) as bar:
        for spec in tables:
            create_storage(spec, context.cache(spec))
            bulk_load(spec, context.cache(spec), items)
            usage = table_usage(spec)
            if usage["rows"] != len(items):
                context.failures.append(f"storage: {spec.name} holds {usage['rows']} rows "
                                        f"after {len(items)} entries were written")
            results.append(_entry(spec.name, "key and value columns", usage["column_bytes"], items,
                                  payload, data_length=usage["data_length"],
                                  index_length=usage["index_length"]))
            bar.update()
        for family in families:
            results.append(_memcached_entry(context, family, items, payload))
            bar.update()
    add_peer_ratios(results, "stored_bytes")
    return {"entries": len(items), "payload_bytes": payload, "results": results}


def _memcached_entry(context: Context, family: str, items: dict[str, Any], payload: int) -> dict[str, Any]:
    memory_mb = max(MIN_NODE_MB, 2 * payload // MIB + 8)  # room for all: nothing evicted
    with dedicated_node(memory_mb) as node:
        cache = memcached_spec(family, context.token, [node], 1).build()
        try:
            before = node_stats(node)
            failed = cache.set_many(items)
            after = node_stats(node)
        finally:
            cache.close()
    stored = after["curr_items"] - before["curr_items"]
    if failed or stored != len(items) or after["evictions"]:
        context.failures.append(f"storage: {family} kept {stored} of {len(items)} entries "
                                f"({len(failed)} failed, {after['evictions']} evicted)")
    return _entry(family, "memcached bytes stat", after["bytes"] - before["bytes"], items, payload)


def _entry(cache: str, measured: str, stored: int, items: dict[str, Any], payload: int,
           data_length: int | None = None, index_length: int | None = None) -> dict[str, Any]:
    return {"cache": cache, "measured": measured, "entries": len(items), "stored_bytes": stored,
            "bytes_per_entry": round(stored / len(items), 1),
            "vs_payload": round(stored / payload, 3) if payload else None,
            "data_length": data_length, "index_length": index_length}
