"""One benchmark run from start to end: servers, caches, scenarios, clean-up, results."""
from __future__ import annotations

import contextlib
import importlib
import secrets
import signal
import threading
import time
from dataclasses import asdict, replace
from typing import Any, Iterator, Sequence

from django.db import connections

from kvcache_bench import caches, data, machine, servers, storage
from kvcache_bench.context import Context, Parameters

SCENARIOS = ("ops", "rows", "nodes", "concurrency", "stampede", "storage", "capacity", "codec",
             "encryption", "locks")
#: The scenarios whose figures depend on the values: run once per value mix. The others
#: use small random filler and run with the first mix only.
MIX_SCENARIOS = ("ops", "storage", "capacity", "codec", "encryption")
#: Run only when named with --scenario: they need servers beyond the default ones.
ON_REQUEST_SCENARIOS = ("shards", "async", "replicas", "scale")
#: What runs on a site's own caches: nodes, storage, capacity, shards, async and replicas start
#: servers of their own (scripts/services.py), which only the project's benchmark has.
SITE_SCENARIOS = ("ops", "rows", "concurrency", "stampede", "codec")


def benchmark(parameters: Parameters, mixes: Sequence[str], scenarios: Sequence[str],
              patterns: Sequence[str] | None, extras: Sequence[str] = (),
              show_progress: bool = True, site: bool = False) -> list[dict[str, Any]]:
    """One result set per value mix in ``mixes``, in that order. With ``site``,
    ``patterns`` are aliases of the site's CACHES (``caches.site_selection``)."""
    for mix in mixes:
        data.mix_named(mix)  # an unknown name fails before any server is touched
    if site:
        outside = sorted(set(scenarios) - set(SITE_SCENARIOS))
        if outside:
            raise ValueError(
                f"scenario(s) {', '.join(outside)} start servers of their own: they run in "
                f"the project's benchmark (make bench); on a site's caches: "
                f"{', '.join(SITE_SCENARIOS)}")
        aliases = caches.site_aliases(patterns)
    token = secrets.token_hex(3)
    with _memcached_nodes(site, patterns, scenarios, parameters) as (nodes, cluster_note):
        if site:
            selection = caches.site_selection(token, aliases)
            selection.skipped.update({f"--extra-cache {extra}": "only in the project's benchmark"
                                      for extra in extras})
            nodes = caches.memcached_locations(selection.caches)
        else:
            selection = caches.select(token, nodes, patterns, extras)
        databases = [alias for spec in selection.caches for alias in spec.table_databases]
        described = {"machine": machine.describe(nodes, databases)}  # load average before the run
        context = Context(token, parameters, [], None, nodes, show_progress)
        runs = []
        try:
            _create_storage(selection, context)
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


@contextlib.contextmanager
def _memcached_nodes(site: bool, patterns: Sequence[str] | None, scenarios: Sequence[str],
                     parameters: Parameters) -> Iterator[tuple[list[str], str | None]]:
    """The project's memcached nodes (started as needed); none for a site's run, whose
    caches bring their own LOCATION."""
    if site:
        yield [], None
        return
    needed = caches.node_count_needed(patterns)
    if "nodes" in scenarios or "async" in scenarios:
        needed = max(needed, *parameters.nodes)
    with servers.memcached_cluster(needed) as found:
        yield found


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
        missing = _nothing_to_measure(name, context)
        if missing:
            context.notes.append(f"{name} not run: {missing}")
            continue
        scenario_started = time.monotonic()
        results[name] = _run_scenario(name, context)
        durations[name] = round(time.monotonic() - scenario_started, 1)
    return {
        "values": data.describe(context.values, parameters.seed),
        "machine": described["machine"],
        "parameters": asdict(parameters),
        "scenarios_run": list(results),
        "reference": context.reference,
        "caches": described["caches"],
        "skipped": described["skipped"],
        "scenarios": results,
        "notes": context.notes,
        "failures": context.failures,
        "duration_s": round(time.monotonic() - started, 1),
        "scenario_durations_s": durations,
    }


#: Scenarios about one kind of cache, and what they say when no cache of that kind runs
#: (a memcached-only site has no table to grow).
SUBJECTS = {"rows": (lambda spec: spec.table is not None,
                     "it measures table-backed caches, and none is measured"),
            "scale": (lambda spec: spec.name == "kv-mysql-innodb",
                      "it measures kv-mysql-innodb (beside db-mariadb and django-mysql), "
                      "which is not among the caches")}


def _nothing_to_measure(name: str, context: Context) -> str | None:
    subject = SUBJECTS.get(name)
    if subject is None or any(subject[0](spec) for spec in context.caches):
        return None
    return subject[1]


def _run_scenario(name: str, context: Context) -> dict[str, Any]:
    for spec in context.caches:  # what one scenario left behind must not slow the next
        storage.empty_storage(spec, context.cache(spec))
    return importlib.import_module(f"kvcache_bench.scenarios.{name}").run(context)


def _create_storage(selection: caches.Selection, context: Context) -> None:
    """``context.caches``: the caches whose table could be created; the others move to
    ``skipped``. Each is listed before its table is made, so that a run interrupted here
    drops what it made too."""
    context.caches = []
    for spec in selection.caches:
        context.caches.append(spec)
        try:
            storage.create_storage(spec, context.cache(spec))
        except Exception as exc:  # a cache that cannot start is reported, not fatal
            context.caches.remove(spec)
            selection.skipped[spec.name] = f"could not create its table: {exc!r}"
            storage.drop_storage(spec)


def _clean_up(context: Context) -> None:
    """Drop the run's tables and delete its keys, however the run ended: a second Ctrl-C
    while this runs is ignored (the first one stopped the run and brought it here)."""
    with _sigint_ignored():
        _close_connections(context)
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


def _close_connections(context: Context) -> None:
    """This thread's Django connections closed, to be opened afresh: a statement that
    Ctrl-C cut off leaves its connection out of sync ("Commands out of sync"), and every
    table dropped through it would stay."""
    for connection in connections.all(initialized_only=True):
        try:
            connection.close()
        except Exception as exc:  # a broken connection: closing it is all that matters
            context.notes.append(f"closing database {connection.alias!r} failed: {exc!r}")


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set signal handlers
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


#: OPTIONS whose values stay out of the results (a site's secrets and key files).
SECRET_OPTIONS = ("SIGNING_KEY", "TLS")


def _describe(spec: caches.CacheSpec) -> dict[str, Any]:
    options = {name: "(set)" if name in SECRET_OPTIONS else value
               for name, value in spec.options.items()}
    return {"name": spec.name, "description": spec.description, "backend": spec.backend,
            "location": spec.location, "options": options}
