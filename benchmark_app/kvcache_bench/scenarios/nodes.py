"""``nodes``: single ``get`` and ``get_many`` of 100 keys over 1, 2, 4, 8 memcached nodes.

Our MemcachedCache against Django's PyMemcacheCache (whose HashClient asks the nodes one
after another), with a bare pymemcache ``Client`` on one node as the floor: no Django,
no key building, no serializer. Beside it on one node, where it is installed,
meta-memcache-py's ``CacheClient`` (the meta-protocol client; its own serializer, no
Django): its ``multi_get`` answers every key, so its ``get_many`` here keeps the hits.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from kvcache_bench.caches import memcached_families, memcached_spec
from kvcache_bench.context import Context
from kvcache_bench.data import filler
from kvcache_bench.checks import Call, mismatches
from kvcache_bench.timing import rotated, summarize, time_calls

FLOOR = "bare pymemcache Client"
META = "meta-memcache CacheClient"


@dataclass
class Subject:
    """One client on one node count: how to write the keys, read them, and forget them."""

    client: str
    nodes: int
    set_many: Callable[[dict[str, Any]], Any]
    get: Callable[[str], Any]
    get_many: Callable[[list[str]], Any]
    delete_many: Callable[[list[str]], Any]
    close: Callable[[], Any]


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    available = len(context.memcached_nodes)
    counts = [n for n in sorted(p.nodes) if n <= available]
    for n in sorted(set(p.nodes) - set(counts)):
        context.notes.append(f"nodes: {n} nodes skipped, only {available} memcached nodes available")
    families = memcached_families(context.caches)
    if not counts or not families:
        context.notes.append("nodes: skipped, no memcached cache selected or no node available")
        return {"counts": counts, "keys": p.node_keys, "results": []}
    subjects = [_cache_subject(context, family, n) for family in families for n in counts]
    subjects.append(_floor_subject(context.memcached_nodes[0]))
    meta = _meta_subject(context.memcached_nodes[0])
    if meta is None:
        context.notes.append("nodes: meta-memcache skipped, not installed")
    else:
        subjects.append(meta)
    values = filler(p.seed, p.node_keys)
    items = {f"node.{context.token}.{index}": value for index, value in enumerate(values)}
    keys = list(items)
    rounds = max(1, min(p.rounds, p.node_calls))
    calls = max(1, p.node_calls // rounds)
    durations: dict[tuple[str, int, str], list[int]] = defaultdict(list)
    cpu: dict[tuple[str, int, str], int] = defaultdict(int)
    try:
        for subject in subjects:
            subject.set_many(items)
        with context.progress("nodes", rounds * len(subjects)) as bar:
            for round_index in range(rounds):
                gets = [Call(keys[(round_index * calls + i) % len(keys)], None) for i in range(calls)]
                gets = [Call(call.argument, items[call.argument]) for call in gets]
                many = [Call(keys, items)] * calls
                for subject in rotated(subjects, round_index):
                    for operation, batch, method in (("get", gets, subject.get),
                                                     ("get_many", many, subject.get_many)):
                        timed = time_calls(method, [call.argument for call in batch])
                        durations[subject.client, subject.nodes, operation].extend(timed.durations)
                        cpu[subject.client, subject.nodes, operation] += timed.cpu_ns
                        wrong = mismatches(timed.results, batch)
                        if wrong:
                            context.failures.append(f"nodes: {subject.client} on {subject.nodes} "
                                                    f"node(s) {operation}: {wrong[0]}")
                    bar.update()
    finally:
        for subject in subjects:
            subject.delete_many(keys)
            subject.close()
    results = [{"client": client, "nodes": n, "operation": operation,
                **summarize(taken, cpu[client, n, operation])}
               for (client, n, operation), taken in durations.items()]
    return {"counts": counts, "keys": p.node_keys, "results": results,
            "single_node": [s.client for s in subjects if s.client in (FLOOR, META)]}


def _cache_subject(context: Context, family: str, nodes: int) -> Subject:
    spec = memcached_spec(family, context.token, context.memcached_nodes, nodes)
    cache = spec.build()
    return Subject(family, nodes, cache.set_many, cache.get, cache.get_many,
                   cache.delete_many, cache.close)


def _floor_subject(address: str) -> Subject:
    from pymemcache.client.base import Client

    host, port = address.rsplit(":", 1)
    client = Client((host, int(port)), default_noreply=False)
    return Subject(FLOOR, 1, client.set_many, client.get, client.get_many,
                   client.delete_many, client.close)


def _meta_subject(address: str) -> Subject | None:
    try:
        from meta_memcache import CacheClient, ServerAddress, connection_pool_factory_builder
    except ImportError:
        return None
    host, port = address.rsplit(":", 1)
    client = CacheClient.cache_client_from_servers(
        servers=[ServerAddress(host=host, port=int(port))],
        connection_pool_factory_fn=connection_pool_factory_builder(),
    )

    # Keys of its own: the bare client reads the same names on the same node.
    def set_many(items: dict[str, Any]) -> None:
        for key, value in items.items():
            client.set(f"meta.{key}", value, ttl=900)

    def get(key: str) -> Any:
        return client.get(f"meta.{key}")

    def get_many(keys: list[str]) -> dict[str, Any]:
        found = client.multi_get([f"meta.{key}" for key in keys])
        return {key.key[5:]: value for key, value in found.items() if value is not None}

    def delete_many(keys: list[str]) -> None:
        for key in keys:
            client.delete(f"meta.{key}")

    return Subject(META, 1, set_many, get, get_many, delete_many, lambda: None)
