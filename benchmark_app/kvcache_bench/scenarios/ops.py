"""``ops``: the cost of each cache operation, hit and miss, per call.

Each operation runs in rounds; within a round every cache does the same calls on fresh
keys, in an order that rotates from round to round. The values come from the run's
value mix (``--values``; the "large" operations use one 32 KiB HTML page), generated
before anything is timed. Entries an operation needs (the hits) are written before its
timed calls, without the clock running. Every result is checked after the round's timed
calls, and so is what the cache holds afterwards. Besides each call's wall time, the
process CPU time of the timed calls is kept (the client's work; not the servers').

The floor under a MySQL ``get``: in every round of "get hit", right after each kvcache
MySQL cache's timed gets and on the same rows, a bare mysqlclient connection (the
cache's database settings, no Django) runs the primary-key ``SELECT value, flags`` of
each key, once in autocommit mode (each statement its own snapshot, as every cache
needs to see other writers) and once in mysqlclient's default mode with one transaction
per round (the round's SELECTs share one snapshot: cheaper for the server, but a
connection that stays in one transaction reads the rows of its snapshot forever, so no
cache can run that way). Reported as ``floor`` beside the results.
"""
from __future__ import annotations

import itertools
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from django.core.cache.backends.base import BaseCache
from django.db import connections

from kvcache_bench.caches import CacheSpec
from kvcache_bench.checks import ABSENT, Call, deviations, mismatches, stored_mismatches
from kvcache_bench.context import Context
from kvcache_bench.data import Values
from kvcache_bench.storage import bulk_load
from kvcache_bench.timing import rotated, summarize, time_calls

MAX_REPORTED_MISMATCHES = 3
#: Results a third-party backend is known to return instead of Django's: reported as a
#: note rather than failing the run, as long as the result is exactly this one.
KNOWN_DEVIATIONS: dict[tuple[str, str], tuple[Any, str]] = {
    ("django-mysql", "delete hit"): (None, "django-mysql's delete() returns None, not True"),
    ("django-mysql", "delete miss"): (None, "django-mysql's delete() returns None, not False"),
}


@dataclass(frozen=True)
class Prepared:
    preload: dict[str, Any]  # written before the timed calls
    calls: list[Call]
    stored: dict[str, Any]  # what the cache must hold afterwards (ABSENT = nothing)


@dataclass(frozen=True)
class Round:
    """Fresh keys and pre-generated values for one operation in one round."""

    label: str
    calls: int
    batch: int
    values: Values

    def keys(self, count: int | None = None) -> list[str]:
        return [f"{self.label}.{index}" for index in range(count or self.calls)]

    def items(self, count: int | None = None) -> dict[str, Any]:
        entries = self.values.entries
        start = zlib.crc32(self.label.encode()) % len(entries)  # stable across runs
        return dict(zip(self.keys(count), itertools.cycle(entries[start:] + entries[:start])))

    def batches(self) -> list[dict[str, Any]]:
        items = list(self.items(self.calls * self.batch).items())
        return [dict(items[start:start + self.batch]) for start in range(0, len(items), self.batch)]


@dataclass(frozen=True)
class Operation:
    name: str
    prepare: Callable[[Round], Prepared]
    run: Callable[[BaseCache, Any], Any]


def _merged(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {key: value for batch in batches for key, value in batch.items()}


def _set(r: Round) -> Prepared:
    items = r.items()
    return Prepared({}, [Call(item, None) for item in items.items()], items)


def _set_large(r: Round) -> Prepared:
    items = dict.fromkeys(r.keys(), r.values.large)
    return Prepared({}, [Call(item, None) for item in items.items()], items)


def _set_many(r: Round) -> Prepared:
    batches = r.batches()
    return Prepared({}, [Call(batch, []) for batch in batches], _merged(batches))


def _get_hit(r: Round) -> Prepared:
    items = r.items()
    return Prepared(items, [Call(key, value) for key, value in items.items()], {})


def _get_large(r: Round) -> Prepared:
    items = dict.fromkeys(r.keys(), r.values.large)
    return Prepared(items, [Call(key, value) for key, value in items.items()], {})


def _get_miss(r: Round) -> Prepared:
    return Prepared({}, [Call(key, None) for key in r.keys()], {})


def _get_many_hit(r: Round) -> Prepared:
    batches = r.batches()
    return Prepared(_merged(batches), [Call(list(batch), batch) for batch in batches], {})


def _get_many_miss(r: Round) -> Prepared:
    batches = r.batches()
    return Prepared({}, [Call(list(batch), {}) for batch in batches], {})


def _delete_hit(r: Round) -> Prepared:
    items = r.items()
    return Prepared(items, [Call(key, True) for key in items], dict.fromkeys(items, ABSENT))


def _delete_miss(r: Round) -> Prepared:
    return Prepared({}, [Call(key, False) for key in r.keys()], {})


def _delete_many(r: Round) -> Prepared:
    batches = r.batches()
    items = _merged(batches)
    return Prepared(items, [Call(list(batch), None) for batch in batches], dict.fromkeys(items, ABSENT))


def _incr(r: Round) -> Prepared:
    counters = {key: index for index, key in enumerate(r.keys())}
    after = {key: start + 1 for key, start in counters.items()}
    return Prepared(counters, [Call(key, value) for key, value in after.items()], after)


def _incr_miss(r: Round) -> Prepared:
    return Prepared({}, [Call(key, ValueError) for key in r.keys()], {})


def _add_new(r: Round) -> Prepared:
    items = r.items()
    return Prepared({}, [Call(item, True) for item in items.items()], items)


def _add_existing(r: Round) -> Prepared:
    items = r.items()
    return Prepared(items, [Call((key, b"loser"), False) for key in items], items)


def _touch_hit(r: Round) -> Prepared:
    items = r.items()
    return Prepared(items, [Call(key, True) for key in items], items)


def _touch_miss(r: Round) -> Prepared:
    return Prepared({}, [Call(key, False) for key in r.keys()], {})


OPERATIONS: tuple[Operation, ...] = (
    Operation("set", _set, lambda cache, item: cache.set(*item)),
    Operation("set large", _set_large, lambda cache, item: cache.set(*item)),
    Operation("set_many", _set_many, lambda cache, batch: cache.set_many(batch)),
    Operation("get hit", _get_hit, lambda cache, key: cache.get(key)),
    Operation("get miss", _get_miss, lambda cache, key: cache.get(key)),
    Operation("get large", _get_large, lambda cache, key: cache.get(key)),
    Operation("get_many hit", _get_many_hit, lambda cache, keys: cache.get_many(keys)),
    Operation("get_many miss", _get_many_miss, lambda cache, keys: cache.get_many(keys)),
    Operation("delete hit", _delete_hit, lambda cache, key: cache.delete(key)),
    Operation("delete miss", _delete_miss, lambda cache, key: cache.delete(key)),
    Operation("delete_many", _delete_many, lambda cache, keys: cache.delete_many(keys)),
    Operation("incr", _incr, lambda cache, key: cache.incr(key)),
    Operation("incr miss", _incr_miss, lambda cache, key: cache.incr(key)),
    Operation("add new", _add_new, lambda cache, item: cache.add(*item)),
    Operation("add existing", _add_existing, lambda cache, item: cache.add(*item)),
    Operation("touch hit", _touch_hit, lambda cache, key: cache.touch(key)),
    Operation("touch miss", _touch_miss, lambda cache, key: cache.touch(key)),
)


#: The floor's connection modes: (label, autocommit).
FLOOR_MODES = (("mysqlclient SELECT, autocommit", True),
               ("mysqlclient SELECT, one transaction per round", False))


@dataclass
class Floor:
    """Bare mysqlclient connections to one kvcache MySQL cache's database, one per mode."""

    select: str
    connections: dict[str, Any]

    @classmethod
    def open(cls, spec: CacheSpec) -> Floor:
        import MySQLdb

        params = connections[spec.database or "default"].get_connection_params()
        opened = {}
        for label, autocommit in FLOOR_MODES:
            opened[label] = raw = MySQLdb.connect(**params)
            raw.autocommit(autocommit)
        return cls(f"SELECT `value`, `flags` FROM `{spec.table}` WHERE `cache_key` = %s", opened)

    def time(self, label: str, keys: list[str]) -> Any:
        raw = self.connections[label]
        raw.commit()  # without autocommit: a fresh snapshot, which sees this round's rows
        cursor = raw.cursor()

        def select(key: str) -> Any:
            cursor.execute(self.select, (key,))
            return cursor.fetchone()

        try:
            return time_calls(select, keys)
        finally:
            cursor.close()

    def close(self) -> None:
        for raw in self.connections.values():
            raw.close()


@dataclass
class Outcome:
    """What one cache did with one operation over the rounds kept."""

    durations: list[int] = field(default_factory=list)
    cpu_ns: int = 0
    problems: list[str] = field(default_factory=list)
    deviations: int = 0


def one_round(context: Context, spec: CacheSpec, operation: Operation, r: Round,
              outcome: Outcome, kept: bool,
              floor: tuple[Floor, dict[str, Outcome]] | None = None) -> None:
    """Prepare, time and check one round; add its figures to ``outcome`` if ``kept``
    (problems always count, warm-up included). With ``floor``, time the floor's
    SELECTs of the rows just read, into its outcomes."""
    cache = context.cache(spec)
    prepared = operation.prepare(r)
    if prepared.preload:
        bulk_load(spec, cache, prepared.preload)
    timed = time_calls(lambda argument: operation.run(cache, argument),
                       [call.argument for call in prepared.calls])
    known = KNOWN_DEVIATIONS.get((spec.family, operation.name))
    outcome.problems += mismatches(timed.results, prepared.calls, known)
    outcome.problems += stored_mismatches(cache, prepared.stored)
    outcome.deviations += deviations(timed.results, prepared.calls, known)
    if kept:
        outcome.durations += timed.durations
        outcome.cpu_ns += timed.cpu_ns
    if floor is not None:
        _time_floor(cache, prepared, *floor, kept)
    # Drop the round's entries: tables stay small (their growth is the rows scenario's
    # subject) and so do the shared memcached nodes.
    written = list(dict.fromkeys([*prepared.preload, *prepared.stored]))
    if written:  # django-mysql's delete_many([]) is an SQL syntax error
        cache.delete_many(written)


def _time_floor(cache: BaseCache, prepared: Prepared, floor: Floor,
                outcomes: dict[str, Outcome], kept: bool) -> None:
    keys = [cache.make_key(call.argument) for call in prepared.calls]
    for label, _ in FLOOR_MODES:
        timed = floor.time(label, keys)
        if any(row is None for row in timed.results):
            outcomes[label].problems.append("a row the cache had just read was not found")
        if kept:
            outcomes[label].durations += timed.durations
            outcomes[label].cpu_ns += timed.cpu_ns


def _floors(context: Context) -> dict[str, Floor]:
    return {spec.name: Floor.open(spec) for spec in context.caches if spec.family == "kv-mysql"}


def _floor_results(context: Context, floors: dict[str, dict[str, Outcome]],
                   results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each floor's figures and the cache's ``get hit`` median over the floor's."""
    gets = {e["cache"]: e for e in results if e["operation"] == "get hit"}
    entries = []
    for name, outcomes in floors.items():
        for label, outcome in outcomes.items():
            if outcome.problems:
                context.failures.append(f"ops: floor of {name}, {label}: {outcome.problems[0]}")
            figures = summarize(outcome.durations, outcome.cpu_ns)
            entries.append({"cache": name, "floor": label, **figures,
                            "get_hit_over_floor": round(gets[name]["median_us"] / figures["median_us"], 3)
                            if figures["median_us"] else None})
    return entries


def run(context: Context) -> dict[str, Any]:
    outcomes: dict[tuple[str, str], Outcome] = defaultdict(Outcome)
    floors = _floors(context)
    floor_outcomes: dict[str, dict[str, Outcome]] = {name: defaultdict(Outcome) for name in floors}
    try:
        _rounds(context, outcomes, floors, floor_outcomes)
    finally:
        for floor in floors.values():
            floor.close()
    results = _results(context, outcomes)
    add_ratios(results, context.reference)
    return {"operations": [op.name for op in OPERATIONS], "results": results,
            "floor": _floor_results(context, floor_outcomes, results)}


def _rounds(context: Context, outcomes: dict[tuple[str, str], Outcome],
            floors: dict[str, Floor], floor_outcomes: dict[str, dict[str, Outcome]]) -> None:
    p = context.parameters
    values = context.values
    rounds = range(-p.warmup_rounds, p.rounds)  # negative rounds: warm-up, checked, not kept
    total = len(rounds) * len(OPERATIONS) * len(context.caches)
    with context.progress("ops", total) as bar:
        for round_index in rounds:
            for op_index, operation in enumerate(OPERATIONS):
                r = Round(f"{operation.name.replace(' ', '_')}.{round_index}", p.calls, p.batch, values)
                for spec in rotated(context.caches, round_index + op_index):
                    floor = None
                    if operation.name == "get hit" and spec.name in floors:
                        floor = (floors[spec.name], floor_outcomes[spec.name])
                    one_round(context, spec, operation, r, outcomes[spec.name, operation.name],
                              kept=round_index >= 0, floor=floor)
                    bar.update()


def add_ratios(results: list[dict[str, Any]], reference: str | None) -> None:
    """Speed-up over the reference cache for the same operation: its median / this median.

    Above 1 is faster than the reference, as in "2.5x DatabaseCache".
    """
    medians = {e["operation"]: e["median_us"] for e in results if e["cache"] == reference}
    for entry in results:
        base = medians.get(entry["operation"])
        entry["ratio"] = round(base / entry["median_us"], 3) if base and entry["median_us"] else None


def _results(context: Context, outcomes: dict[tuple[str, str], Outcome]) -> list[dict[str, Any]]:
    results = []
    for spec in context.caches:
        for operation in OPERATIONS:
            outcome = outcomes[spec.name, operation.name]
            if outcome.deviations:
                reason = KNOWN_DEVIATIONS[spec.family, operation.name][1]
                context.notes.append(f"ops: {spec.name} {operation.name}: {reason} (accepted)")
            wrong = outcome.problems
            if wrong:
                shown = "; ".join(wrong[:MAX_REPORTED_MISMATCHES])
                context.failures.append(
                    f"ops: {spec.name} {operation.name}: {len(wrong)} wrong result(s): {shown}")
            results.append({"cache": spec.name, "operation": operation.name,
                            "correct": not wrong, "wrong_results": len(wrong),
                            **summarize(outcome.durations, outcome.cpu_ns)})
    return results
