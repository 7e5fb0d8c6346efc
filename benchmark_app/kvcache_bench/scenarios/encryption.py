"""``encryption``: what ``OPTIONS["ENCRYPTION_KEYS"]`` costs, on each kvcache backend.

For the kvcache MySQLCache (InnoDB) and MemcachedCache (one node) among the run's caches,
two twins alike in everything but ENCRYPTION_KEYS — each with a table or key prefix of
its own — run ``get`` (hits), ``get_many`` (hits, ``--batch`` keys), ``set`` and
``set_many`` on the run's value mix, with the ``ops`` scenario's rounds, checks and
clean-up; within each round the order of the twins rotates, so neither always goes first.
Per call: the median wall time and the process CPU time (the client's work), and the
encrypted twin's figure over the plain one's. The target is at most 1.05x the time.

Bytes: every value of the mix encoded by each twin's codec, as its backend stores it
(the value column, the memcached item's data): the mean per entry, and what encryption
adds (the target: at most 28 bytes, a 12-byte nonce and a 16-byte tag).
"""
from __future__ import annotations

import dataclasses
import secrets
from collections import defaultdict
from typing import Any

from kvcache_bench.caches import CacheSpec
from kvcache_bench.context import Context
from kvcache_bench.scenarios.ops import OPERATIONS, Outcome, Round, one_round
from kvcache_bench.storage import create_storage, drop_storage
from kvcache_bench.timing import rotated, summarize

#: The caches measured, when the run has them: one of each backend.
SUBJECTS = ("kv-mysql-innodb", "kv-memcached-1")
MEASURED = ("get hit", "get_many hit", "set", "set_many")
TARGET_TIME_RATIO = 1.05
TARGET_EXTRA_BYTES = 28


def twins(spec: CacheSpec) -> tuple[CacheSpec, CacheSpec]:
    """``spec`` without and with ENCRYPTION_KEYS, each in storage of its own."""
    def twin(suffix: str, options: dict[str, Any]) -> CacheSpec:
        location = f"{spec.location}_{suffix}" if spec.table is not None else spec.location
        return dataclasses.replace(spec, name=f"{spec.name} {suffix}", location=location,
                                   key_prefix=f"{spec.key_prefix}-{suffix}",
                                   options={**spec.options, **options})

    key = secrets.token_urlsafe(32)  # this run's own, never written anywhere
    return twin("plain", {}), twin("encrypted", {"ENCRYPTION_KEYS": [key]})


def run(context: Context) -> dict[str, Any]:
    subjects = [spec for spec in context.caches if spec.name in SUBJECTS]
    pairs = {spec.name: twins(spec) for spec in subjects}
    specs = [twin for pair in pairs.values() for twin in pair]
    operations = [operation for operation in OPERATIONS if operation.name in MEASURED]
    outcomes: dict[tuple[str, str], Outcome] = defaultdict(Outcome)
    p = context.parameters
    try:
        for spec in specs:
            create_storage(spec, context.cache(spec))
        rounds = range(-p.warmup_rounds, p.rounds)
        with context.progress("encryption", len(rounds) * len(operations) * len(specs)) as bar:
            for round_index in rounds:
                for op_index, operation in enumerate(operations):
                    label = f"encryption_{operation.name.replace(' ', '_')}.{round_index}"
                    r = Round(label, p.calls, p.batch, context.values)
                    for spec in rotated(specs, round_index + op_index):
                        one_round(context, spec, operation, r, outcomes[spec.name, operation.name],
                                  kept=round_index >= 0)
                        bar.update()
    finally:
        for spec in specs:  # tables of this scenario's own: no run-end clean-up knows them
            drop_storage(spec)
    results = []
    for name, (plain, encrypted) in pairs.items():
        for operation in operations:
            results.append(_entry(context, name, operation.name,
                                  outcomes[plain.name, operation.name],
                                  outcomes[encrypted.name, operation.name]))
    return {"operations": list(MEASURED), "results": results,
            "bytes": [_bytes(context, name, *pair) for name, pair in pairs.items()],
            "target_time_ratio": TARGET_TIME_RATIO, "target_extra_bytes": TARGET_EXTRA_BYTES}


def _entry(context: Context, cache: str, operation: str, plain: Outcome,
           encrypted: Outcome) -> dict[str, Any]:
    for twin, outcome in (("plain", plain), ("encrypted", encrypted)):
        if outcome.problems:
            context.failures.append(f"encryption: {cache} {twin} {operation}: "
                                    f"{len(outcome.problems)} wrong result(s): {outcome.problems[0]}")
    without = summarize(plain.durations, plain.cpu_ns)
    with_keys = summarize(encrypted.durations, encrypted.cpu_ns)
    time_ratio = round(with_keys["median_us"] / without["median_us"], 3)
    return {
        "cache": cache, "operation": operation,
        "plain_median_us": without["median_us"], "encrypted_median_us": with_keys["median_us"],
        "time_ratio": time_ratio,
        "plain_cpu_us": without["cpu_us"], "encrypted_cpu_us": with_keys["cpu_us"],
        "cpu_ratio": round(with_keys["cpu_us"] / without["cpu_us"], 3),
        "cpu_added_us": round(with_keys["cpu_us"] - without["cpu_us"], 2),
        "samples": without["samples"], "time_target_met": time_ratio <= TARGET_TIME_RATIO,
    }


def _bytes(context: Context, cache: str, plain: CacheSpec, encrypted: CacheSpec) -> dict[str, Any]:
    """The mix's values as each twin's codec stores them (under a key of its own)."""
    entries = context.values.entries
    sizes = {}
    for twin, spec in (("plain", plain), ("encrypted", encrypted)):
        built = context.cache(spec)
        sizes[twin] = sum(len(built.codec.encode(value, f"{spec.key_prefix}:1:{index}")[0])
                          for index, value in enumerate(entries))
    extra = (sizes["encrypted"] - sizes["plain"]) / len(entries)
    return {"cache": cache, "values": len(entries),
            "plain_bytes_per_entry": round(sizes["plain"] / len(entries), 1),
            "encrypted_bytes_per_entry": round(sizes["encrypted"] / len(entries), 1),
            "extra_bytes_per_entry": round(extra, 1),
            "bytes_target_met": extra <= TARGET_EXTRA_BYTES}
