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

Ours also runs with the compact setting of each family (``codec.compact_variants``): on
MySQL ``COMPRESS_DICTIONARY: "auto"``, whose dictionary is trained and installed from
other entries of the mix first (``codec.install_dictionary``); its table of dictionaries
is not counted (one row of at most 64 KB per dictionary, whatever the entries).
"""
from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

from kvcache_bench.caches import CacheSpec, add_peer_ratios, memcached_families, memcached_spec
from kvcache_bench.context import Context
from kvcache_bench.data import make_values
from kvcache_bench.payloads import payload_size
from django.db import connections

from django_kvcache.mysql.dictionaries import dictionary_table
from kvcache_bench.scenarios.codec import compact_variants, install_dictionary, variant_peer_ratios
from kvcache_bench.servers import dedicated_node, node_stats
from kvcache_bench.storage import bulk_load, create_storage, drop_storage, table_usage

MIB = 1024 * 1024
MIN_NODE_MB = 64


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    entries = make_values(p.seed, p.storage_entries, p.values, 0).entries
    items = {f"storage.{index}": value for index, value in enumerate(entries)}
    payload = sum(payload_size(value) for value in entries)
    with tempfile.TemporaryDirectory() as folder:
        variants = compact_variants(context, folder)
        tables: list[tuple[CacheSpec, str | None]] = []
        for spec in context.caches:
            if spec.table is not None:
                tables.append((spec, None))
                if spec.family in variants and spec.name == variants[spec.family][0].split()[0]:
                    name, _, options = variants[spec.family]
                    variant = dataclasses.replace(spec, name=name, location=f"{spec.table}_compact",
                                                  options={**spec.options, **options})
                    tables.append((variant, spec.name))
        families = [(family, None) for family in memcached_families(context.caches)]
        if "kv-memcached" in dict(families) and "kv-memcached" in variants:
            families.append(("kv-memcached", variants["kv-memcached"]))
        results = []
        with context.progress("storage", len(tables) + len(families)) as bar:
            for spec, variant_of in tables:
                results.append(_table_entry(context, spec, variant_of, items, payload))
                bar.update()
            for family, variant in families:
                results.append(_memcached_entry(context, family, variant, items, payload))
                bar.update()
    add_peer_ratios(results, "stored_bytes")
    variant_peer_ratios(results, "stored_bytes", subject="cache")
    return {"entries": len(items), "payload_bytes": payload, "results": results}


def _table_entry(context: Context, spec: CacheSpec, variant_of: str | None, items: dict[str, Any],
                 payload: int) -> dict[str, Any]:
    cache = spec.build() if variant_of else context.cache(spec)
    auto = spec.options.get("COMPRESS_DICTIONARY") == "auto"
    try:
        create_storage(spec, cache)
        if auto:  # then a new table: the training entries' pages must not count
            install_dictionary(context, spec)
            create_storage(spec, cache)
        bulk_load(spec, cache, items)
        usage = table_usage(spec)
    finally:
        if variant_of:  # a table of this scenario's own: no run-end clean-up knows it
            cache.close()
            drop_storage(spec)
        if auto:
            connection = connections[spec.database]
            with connection.cursor() as cursor:
                table = connection.ops.quote_name(dictionary_table(spec.table))
                cursor.execute(f"DROP TABLE IF EXISTS {table}")
    if usage["rows"] != len(items):
        context.failures.append(f"storage: {spec.name} holds {usage['rows']} rows "
                                f"after {len(items)} entries were written")
    entry = _entry(spec.name, "key and value columns", usage["column_bytes"], items, payload,
                   data_length=usage["data_length"], index_length=usage["index_length"])
    entry["variant_of"] = variant_of
    return entry


def _memcached_entry(context: Context, family: str, variant: tuple[str, str, dict[str, Any]] | None,
                     items: dict[str, Any], payload: int) -> dict[str, Any]:
    memory_mb = max(MIN_NODE_MB, 2 * payload // MIB + 8)  # room for all: nothing evicted
    name = variant[0] if variant else family
    with dedicated_node(memory_mb) as node:
        spec = memcached_spec(family, context.token, [node], 1)
        if variant:
            spec = dataclasses.replace(spec, options=variant[2])
        cache = spec.build()
        try:
            before = node_stats(node)
            failed = cache.set_many(items)
            after = node_stats(node)
        finally:
            cache.close()
    stored = after["curr_items"] - before["curr_items"]
    if failed or stored != len(items) or after["evictions"]:
        context.failures.append(f"storage: {name} kept {stored} of {len(items)} entries "
                                f"({len(failed)} failed, {after['evictions']} evicted)")
    entry = _entry(name, "memcached bytes stat", after["bytes"] - before["bytes"], items, payload)
    entry["variant_of"] = family if variant else None
    return entry


def _entry(cache: str, measured: str, stored: int, items: dict[str, Any], payload: int,
           data_length: int | None = None, index_length: int | None = None) -> dict[str, Any]:
    return {"cache": cache, "measured": measured, "entries": len(items), "stored_bytes": stored,
            "bytes_per_entry": round(stored / len(items), 1),
            "vs_payload": round(stored / payload, 3) if payload else None,
            "data_length": data_length, "index_length": index_length}
