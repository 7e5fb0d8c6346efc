"""``ops``: the cost of each cache operation, hit and miss, per call.

Each operation runs in rounds; within a round every cache does the same calls on fresh
keys, in an order that rotates from round to round. The values come from the run's
value mix (``--values``; the "large" operations use one 32 KiB HTML page), generated
before anything is timed. Entries an operation needs (the hits) are written before its
timed calls, without the clock running. Every result is checked after the round's timed
calls, and so is what the cache holds afterwards. Besides each call's wall time, the
process CPU time of the timed calls is kept (the client's work; not the servers').

The floor under a MySQL read: in every round of "get hit" (and of "get_many hit"), right
after each kvcache MySQL cache's timed calls, the same keys are read again, call after
call, once through the cache and once by a bare mysqlclient primary-key ``SELECT value,
flags`` of the row (``SELECT cache_key, value, flags … IN`` of the batch), no Django, no
codec, on the connection the cache has just used (its own pool's). Same connection, same
session settings, same server thread: on this 2-core VM a statement's time moves by tens
of µs with the CPU the scheduler gives the connection's server thread (two connections
to one server differ by up to 60 µs a statement, whichever runs the SELECT), so only
this like-for-like pair measures what the cache adds. Reported as ``floor``: both
medians (and the SELECT's CPU time from a block of its own) and get / SELECT.
"""
from __future__ import annotations

import itertools
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

from django.core.cache.backends.base import BaseCache

from kvcache_bench.caches import REDIS, CacheSpec
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


@dataclass
class Floor:
    """The bare statement under one kvcache MySQL cache's read: a primary-key SELECT
    under ``get`` (``many``: ``SELECT … IN`` of the batch under ``get_many``)."""

    alias: str
    select: str
    many: bool = False

    @classmethod
    def of(cls, spec: CacheSpec, many: bool = False) -> Floor:
        columns = "`cache_key`, `value`, `flags`" if many else "`value`, `flags`"
        where = "`cache_key` IN ({})" if many else "`cache_key` = %s"
        return cls(spec.database or "default", f"SELECT {columns} FROM `{spec.table}` WHERE {where}",
                   many)

    def _pool(self) -> Any:
        """The cache's own pool of connections to its database (its defaults). Imported
        here: only a kvcache MySQL cache has a floor, and a site without mysqlclient
        measures none."""
        from django_kvcache.mysql import pools

        return pools.process_pool(self.alias)

    def time(self, stored: list[Any]) -> Any:
        """The SELECTs alone (for their CPU time), on one of the cache's connections."""
        pool = self._pool()
        raw = pool.checkout()
        cursor = raw.cursor()
        try:
            return time_calls(partial(self._select, cursor), stored)
        finally:
            cursor.close()
            pool.checkin(raw)

    def interleaved(self, read: Callable[[Any], Any], arguments: list[Any],
                    stored: list[Any]) -> tuple[list[int], list[int], list[Any]]:
        """Per argument, ``read(argument)`` then the SELECT of its rows on the connection
        the read has just used (the pool's last one in): both durations (ns), the rows."""
        pool = self._pool()
        clock = time.perf_counter_ns
        reads: list[int] = []
        selects: list[int] = []
        rows = []
        for argument, keys in zip(arguments, stored):
            start = clock()
            read(argument)
            reads.append(clock() - start)
            raw = pool.checkout()
            cursor = raw.cursor()
            try:
                start = clock()
                rows.append(self._select(cursor, keys))
                selects.append(clock() - start)
            finally:
                cursor.close()
                pool.checkin(raw)
        return reads, selects, rows

    def _select(self, cursor: Any, keys: Any) -> Any:
        if not self.many:
            cursor.execute(self.select, (keys,))
            return cursor.fetchone()
        cursor.execute(self.select.format(", ".join(["%s"] * len(keys))), keys)
        found = cursor.fetchall()
        return found if len(found) == len(keys) else None


@dataclass
class Outcome:
    """What one cache did with one operation over the rounds kept."""

    durations: list[int] = field(default_factory=list)
    cpu_ns: int = 0
    problems: list[str] = field(default_factory=list)
    deviations: int = 0


@dataclass
class FloorOutcome:
    """A floor's figures over the rounds kept."""

    select: Outcome = field(default_factory=Outcome)
    interleaved_get: list[int] = field(default_factory=list)
    interleaved_select: list[int] = field(default_factory=list)


def one_round(context: Context, spec: CacheSpec, operation: Operation, r: Round,
              outcome: Outcome, kept: bool,
              floor: tuple[Floor, FloorOutcome] | None = None) -> None:
    """Prepare, time and check one round; add its figures to ``outcome`` if ``kept``
    (problems always count, warm-up included). With ``floor``, time the floor's
    SELECTs of the rows just read, into its outcome."""
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
                outcome: FloorOutcome, kept: bool) -> None:
    arguments = [call.argument for call in prepared.calls]
    if floor.many:
        read: Callable[[Any], Any] = cache.get_many
        stored: list[Any] = [[cache.make_key(key) for key in keys] for keys in arguments]
    else:
        read, stored = cache.get, [cache.make_key(key) for key in arguments]
    gets, selects, rows = floor.interleaved(read, arguments, stored)
    timed = floor.time(stored)
    if any(row is None for row in [*rows, *timed.results]):
        outcome.select.problems.append("a row the cache had just read was not found")
    if kept:
        outcome.interleaved_get += gets
        outcome.interleaved_select += selects
        outcome.select.durations += timed.durations
        outcome.select.cpu_ns += timed.cpu_ns


#: The read each floor is timed under, and what it is.
FLOORS = {"get hit": (False, "mysqlclient primary-key SELECT, same connection"),
          "get_many hit": (True, "mysqlclient SELECT … IN of the batch, same connection")}


def _floor_results(context: Context, floors: dict[tuple[str, str], FloorOutcome]
                   ) -> list[dict[str, Any]]:
    entries = []
    for (name, operation), outcome in floors.items():
        if outcome.select.problems:
            context.failures.append(f"ops: floor of {name} {operation}: {outcome.select.problems[0]}")
        get = summarize(outcome.interleaved_get)["median_us"]
        select = summarize(outcome.interleaved_select)["median_us"]
        entries.append({"cache": name, "operation": operation, "floor": FLOORS[operation][1],
                        **summarize(outcome.select.durations, outcome.select.cpu_ns),
                        "interleaved_get_us": get, "interleaved_floor_us": select,
                        "get_over_floor": round(get / select, 3) if select else None})
    return entries


def run(context: Context) -> dict[str, Any]:
    outcomes: dict[tuple[str, str], Outcome] = defaultdict(Outcome)
    floors = {(spec.name, operation): Floor.of(spec, many)
              for spec in context.caches if spec.family == "kv-mysql"
              for operation, (many, _) in FLOORS.items()}
    floor_outcomes = {key: FloorOutcome() for key in floors}
    _rounds(context, outcomes, floors, floor_outcomes)
    results = _results(context, outcomes)
    add_ratios(results, context.reference)
    return {"operations": [op.name for op in OPERATIONS], "results": results,
            "floor": _floor_results(context, floor_outcomes), "versus": versus(results)}


def _rounds(context: Context, outcomes: dict[tuple[str, str], Outcome],
            floors: dict[tuple[str, str], Floor],
            floor_outcomes: dict[tuple[str, str], FloorOutcome]) -> None:
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
                    if (spec.name, operation.name) in floors:
                        key = (spec.name, operation.name)
                        floor = (floors[key], floor_outcomes[key])
                    one_round(context, spec, operation, r, outcomes[spec.name, operation.name],
                              kept=round_index >= 0, floor=floor)
                    bar.update()


#: Ours, and the peers its targets name: memcached against Django's PyMemcacheCache and
#: RedisCache (one node or server each), MySQL against django-mysql.
VERSUS = {"kv-memcached-1": ("pymemcache-1", REDIS), "kv-mysql-innodb": ("django-mysql",)}


def versus(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per operation, each peer's median over ours (above 1x: ours is faster), for the pairs
    of VERSUS that both ran."""
    medians = {(e["cache"], e["operation"]): e["median_us"] for e in results}
    found = []
    for ours, peers in VERSUS.items():
        for peer in peers:
            for operation in dict.fromkeys(e["operation"] for e in results):
                mine, theirs = medians.get((ours, operation)), medians.get((peer, operation))
                if mine and theirs:
                    found.append({"cache": ours, "peer": peer, "operation": operation,
                                  "speedup": round(theirs / mine, 3)})
    return found


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
