"""What OPTIONS["MAX_SIZE"] costs a MySQLCache ``set``: one short run, four tables side by
side, their calls interleaved in a random order (so the load of a shared machine falls
on all four alike). From a checkout with the test servers up::

    eval "$(.venv/bin/python scripts/services.py env)"
    PYTHONPATH=. .venv/bin/python scripts/bench_max_size.py [values]

Values: 100 B-20 kB, spread evenly over orders of magnitude, half random bytes, half
text (which compresses); 2000 keys written first, then twice ``values`` sets over 4000
keys. Prints p50, mean and p99 per configuration and their ratio to "no budget". Its
tables (``kvcache_bench_budget*``) are dropped at the end.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

from django_kvcache.backends.mysql import MySQLCache  # noqa: E402
from django_kvcache.mysql import blocking, budget  # noqa: E402

DATABASE = os.environ.get("DATABASE", "default")
CONFIGURATIONS = {
    "no budget": {},
    "MAX_SIZE, under budget": {"MAX_SIZE": "1GB"},
    "MAX_SIZE 2MB, full": {"MAX_SIZE": "2MB"},
    "MAX_ENTRIES 550, full": {"MAX_ENTRIES": 550, "CULL_PROBABILITY": 0.05},
    "no budget, a 2nd table": {},  # the noise between two alike tables
}


def tables(index: int) -> tuple[str, list[str]]:
    name = f"kvcache_bench_budget{index}"
    return name, [name, budget.size_table(name), name + "_locks"]


def drop(index: int) -> None:
    for table in tables(index)[1]:
        blocking.query(DATABASE, f"DROP TABLE IF EXISTS `{table}`")


def main(count: int) -> None:
    rng = random.Random(7)

    def value() -> bytes | str:
        size = int(100 * 200 ** rng.random())
        if rng.random() < 0.5:
            return rng.randbytes(size)
        return ("lorem ipsum " * (size // 12 + 1))[:size]

    values = [value() for _ in range(count)]
    caches = []
    for index, options in enumerate(CONFIGURATIONS.values()):
        drop(index)
        cache = MySQLCache(tables(index)[0], {"TIMEOUT": 3600, "OPTIONS": {
            "CULL_PROBABILITY": 0, "DATABASE": DATABASE, **options}})
        cache.create_table()
        caches.append(cache)
    try:
        for number, data in enumerate(values):
            for cache in caches:
                cache.set(f"k{number % 2000}", data)
        times: list[list[int]] = [[] for _ in caches]
        order = list(range(len(caches)))
        for number, data in enumerate(values * 2):
            rng.shuffle(order)
            for index in order:
                start = time.perf_counter_ns()
                caches[index].set(f"k{(number * 7) % 4000}", data)
                times[index].append(time.perf_counter_ns() - start)
        with open("/proc/loadavg") as load:
            print(f"load {load.read().strip()}; {len(times[0])} sets each")
        base = None
        for index, (name, spent) in enumerate(zip(CONFIGURATIONS, times)):
            p50, mean = statistics.median(spent) / 1000, statistics.fmean(spent) / 1000
            p99 = sorted(spent)[int(len(spent) * 0.99)] / 1000
            base = base or (p50, mean)
            rows, stored = blocking.query(DATABASE, "SELECT COUNT(*), SUM(LENGTH(`cache_key`) + "
                                          f"LENGTH(`value`)) FROM `{tables(index)[0]}`")[0]
            print(f"{name:24} p50 {p50:6.1f} µs  mean {mean:6.1f} µs  p99 {p99:7.1f} µs  "
                  f"{p50 / base[0]:.2f}x p50  {mean / base[1]:.2f}x mean  "
                  f"rows {rows} stored bytes {stored}")
    finally:
        for index in range(len(caches)):
            drop(index)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
