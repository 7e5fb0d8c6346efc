"""One million mixed operations in one process on each backend: memory growth stays bounded
and no socket or file descriptor leaks.

A key operation is one key read or written: a ``get_many`` of 20 keys counts 20. Each round
mixes batches with every single-key operation, checks what it reads, and writes keys never
used before (so per-key memos and tables are exercised, not just a warm working set).
"""
from __future__ import annotations

import os

import pytest
from django.core.cache.backends.base import BaseCache

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.backends.mysql import MySQLCache
from tests.mysql_support import drop_table, ensure_table

pytestmark = [pytest.mark.soak, pytest.mark.once]

TOTAL_OPS = 1_000_000
WARM_UP_OPS = 30_000
BATCH = 20
KEY_SPACE = 2000
MAX_RSS_GROWTH = 20 * 1024 * 1024  # bytes
MAX_FD_GROWTH = 2
LARGE_VALUE = "compressible " * 2000  # over COMPRESS_MIN_LENGTH: the zlib path too


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak_round(cache: BaseCache, round_: int) -> int:
    """One round of mixed operations, checking every answer; returns its key operations."""
    keys = [f"soak-{(round_ * BATCH + i) % KEY_SPACE}" for i in range(BATCH)]
    batch = {key: (key, round_) for key in keys}
    assert cache.set_many(batch, timeout=300) == []
    assert cache.get_many(keys) == batch
    ops = 2 * BATCH

    first, second = keys[0], keys[1]
    assert cache.get(first) == (first, round_)
    value = LARGE_VALUE if round_ % 64 == 0 else [round_, "small"]
    cache.set(first, value, timeout=300)
    assert cache.get(first) == value
    assert cache.has_key(first)
    assert cache.touch(first, 300)
    cache.add(f"soak-add-{round_ % 500}", round_)
    assert cache.incr("soak-counter", 2) - 1 == cache.decr("soak-counter")
    assert cache.delete(second)
    assert cache.get(second) is None
    cache.get_or_set(f"soak-computed-{round_ % 300}", round_, timeout=300)
    cache.delete_many(keys[2:4])
    assert cache.get(f"soak-never-set-{round_}") is None
    cache.set(f"soak-once-{round_}", round_, timeout=1)
    return ops + 16


def soak(cache: BaseCache) -> None:
    cache.set("soak-counter", 0, timeout=None)
    done = rounds = 0
    while done < WARM_UP_OPS:
        done += soak_round(cache, rounds)
        rounds += 1
    rss, fds = rss_bytes(), open_fds()
    while done < TOTAL_OPS:
        done += soak_round(cache, rounds)
        rounds += 1
    grown_rss, grown_fds = rss_bytes() - rss, open_fds() - fds

    assert cache.get("soak-counter") == rounds  # +2 -1 every round: no lost update
    assert grown_rss < MAX_RSS_GROWTH, f"RSS grew {grown_rss / 2**20:.1f} MiB over {done} ops"
    assert grown_fds <= MAX_FD_GROWTH, f"{grown_fds} more open file descriptors"


def test_memcached_soak(private_memcached_nodes):
    cache = MemcachedCache(private_memcached_nodes, {"KEY_PREFIX": "soak"})
    cache.clear()
    try:
        soak(cache)
    finally:
        cache.clear()


@pytest.mark.django_db(transaction=True)
def test_mysql_soak():
    cache = MySQLCache(
        "kvcache_soak",
        # The default write-path culling, with room for the live working set.
        {"OPTIONS": {"MAX_ENTRIES": 5000}, "KEY_PREFIX": "soak"},
    )
    ensure_table(cache)
    try:
        cache.clear()
        soak(cache)
    finally:
        drop_table("kvcache_soak")
