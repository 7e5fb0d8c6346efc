"""One benchmark run from start to end: servers, caches, scenarios, clean-up, results."""
from __future__ import annotations

import importlib
import secrets
import time
from dataclasses import asdict
from typing import Any, Sequence

from kvcache_bench import caches, machine, servers, storage
from kvcache_bench.context import Context, Parameters

SCENARIOS = ("ops", "rows", "nodes", "concurrency")


def benchmark(parameters: Parameters, scenarios: Sequence[str], patterns: Sequence[str] | None,
              extras: Sequence[str] = (), show_progress: bool = True) -> dict[str, Any]:
    started = time.monotonic()
    token = secrets.token_hex(3)
    needed = caches.node_count_needed(patterns)
    if "nodes" in scenarios:
        needed = max(needed, *parameters.nodes)
    with servers.memcached_cluster(needed) as (nodes, cluster_note):
        selection = caches.select(token, nodes, patterns, extras)
        context = Context(token, parameters, [], None, nodes, show_progress)
        if cluster_note:
            context.notes.append(cluster_note)
        try:
            context.caches = _create_storage(selection, context)
            context.reference = caches.reference_of(context.caches)
            results = {name: _run_scenario(name, context) for name in scenarios}
        finally:
            _clean_up(context)
        return {
            "machine": machine.describe(nodes),
            "parameters": asdict(parameters),
            "scenarios_run": list(scenarios),
            "reference": context.reference,
            "caches": [_describe(spec) for spec in context.caches],
            "skipped": selection.skipped,
            "scenarios": results,
            "notes": context.notes,
            "failures": context.failures,
            "duration_s": round(time.monotonic() - started, 1),
        }


def _run_scenario(name: str, context: Context) -> dict[str, Any]:
    for spec in context.caches:  # what one scenario left behind must not slow the next
        storage.empty_storage(spec, context.cache(spec))
    return importlib.import_module(f"kvcache_bench.scenarios.{name}").run(context)


def _create_storage(selection: caches.Selection, context: Context) -> list[caches.CacheSpec]:
    """The caches whose table could be created; the others move to ``skipped``."""
    ready = []
    for spec in selection.caches:
        try:
            storage.create_storage(spec, context.cache(spec))
        except Exception as exc:  # a cache that cannot start is reported, not fatal
            selection.skipped[spec.name] = f"could not create its table: {exc!r}"
            continue
        ready.append(spec)
    return ready


def _clean_up(context: Context) -> None:
    for spec in context.caches:
        try:
            storage.clean_up(spec, context.written)
        except Exception as exc:  # keep cleaning the others
            context.notes.append(f"clean-up of {spec.name} failed: {exc!r}")
    for name, cache in context.instances.items():
        try:
            cache.close()
        except Exception as exc:
            context.notes.append(f"closing {name} failed: {exc!r}")


def _describe(spec: caches.CacheSpec) -> dict[str, Any]:
    return {"name": spec.name, "description": spec.description, "backend": spec.backend,
            "location": spec.location, "options": spec.options}
