"""One benchmark run from start to end: servers, caches, scenarios, clean-up, results."""
from __future__ import annotations

import importlib
import secrets
import time
from dataclasses import asdict, replace
from typing import Any, Sequence

from kvcache_bench import caches, data, machine, servers, storage
from kvcache_bench.context import Context, Parameters

SCENARIOS = ("ops", "rows", "nodes", "concurrency", "stampede", "storage", "capacity", "codec")
#: The scenarios whose figures depend on the values: run once per value mix. The others
#: use small random filler and run with the first mix only.
MIX_SCENARIOS = ("ops", "storage", "capacity", "codec")
#: Run only when named with --scenario: they need servers beyond the default ones.
ON_REQUEST_SCENARIOS = ("shards", "async")


def benchmark(parameters: Parameters, mixes: Sequence[str], scenarios: Sequence[str],
              patterns: Sequence[str] | None, extras: Sequence[str] = (),
              show_progress: bool = True) -> list[dict[str, Any]]:
    """One result set per value mix in ``mixes``, in that order."""
    for mix in mixes:
        data.mix_named(mix)  # an unknown name fails before any server is touched
    token = secrets.token_hex(3)
    needed = caches.node_count_needed(patterns)
    if "nodes" in scenarios or "async" in scenarios:
        needed = max(needed, *parameters.nodes)
    with servers.memcached_cluster(needed) as (nodes, cluster_note):
        described = {"machine": machine.describe(nodes)}  # load average before the run
        selection = caches.select(token, nodes, patterns, extras)
        context = Context(token, parameters, [], None, nodes, show_progress)
        runs = []
        try:
            context.caches = _create_storage(selection, context)
            context.reference = caches.reference_of(context.caches)
            described.update(caches=[_describe(spec) for spec in context.caches],
                             skipped=selection.skipped)
            for index, mix in enumerate(mixes):
                chosen = [s for s in scenarios if index == 0 or s in MIX_SCENARIOS]
                context.notes = [cluster_note] if cluster_note else []
                runs.append(_run_mix(context, replace(parameters, values=mix), chosen, described))
        finally:
            _clean_up(context)
        return runs


def _run_mix(context: Context, parameters: Parameters, scenarios: Sequence[str],
             described: dict[str, Any]) -> dict[str, Any]:
    """The chosen scenarios on one mix's values, with everything that says what ran."""
    started = time.monotonic()
    context.parameters = parameters
    context.failures = []
    context.values = data.make_values(parameters.seed, parameters.value_count, parameters.values,
                                      parameters.large_size)
    results, durations = {}, {}
    for name in scenarios:
        scenario_started = time.monotonic()
        results[name] = _run_scenario(name, context)
        durations[name] = round(time.monotonic() - scenario_started, 1)
    return {
        "values": data.describe(context.values, parameters.seed),
        "machine": described["machine"],
        "parameters": asdict(parameters),
        "scenarios_run": list(scenarios),
        "reference": context.reference,
        "caches": described["caches"],
        "skipped": described["skipped"],
        "scenarios": results,
        "notes": context.notes,
        "failures": context.failures,
        "duration_s": round(time.monotonic() - started, 1),
        "scenario_durations_s": durations,
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
