"""Observability: per-node counters from cache.metrics() and memcached's own stats."""
from __future__ import annotations

import os

import pytest

from django_kvcache.backends.memcached import MemcachedCache


@pytest.fixture
def nodes(memcached_node_factory):
    return [memcached_node_factory(), memcached_node_factory()]


@pytest.fixture
def cache(nodes):
    return MemcachedCache([node.address for node in nodes], {})


def totals(cache):
    summed: dict[str, int] = {}
    for counters in cache.metrics().values():
        for name, value in counters.items():
            if type(value) is int:
                summed[name] = summed.get(name, 0) + value
    return summed


def test_metrics_lists_every_node_with_every_counter(cache, nodes):
    metrics = cache.metrics()
    assert list(metrics) == [node.address for node in nodes]
    for counters in metrics.values():
        assert set(counters) >= {
            "ops", "hits", "misses", "errors", "timeouts", "ignored", "bytes_sent",
            "bytes_received", "bytes_saved", "pool_size", "pool_idle", "pool_waits",
            "pool_wait_seconds", "pool_connects", "pool_reuses", "down", "consecutive_failures", "outdated_keys", "flush_pending",
        }
        counted = {name: value for name, value in counters.items() if type(value) is int and value}
        assert not counted, counted  # nodes this process never used: nothing counted yet


def test_hits_misses_and_operations(cache):
    cache.set("a", 1)
    cache.get("a")
    cache.get("absent")
    cache.set_many({f"k{i}": i for i in range(10)})
    cache.get_many([f"k{i}" for i in range(12)])
    summed = totals(cache)
    assert summed["hits"] == 1 + 10
    assert summed["misses"] == 1 + 2
    assert summed["ops"] == 3 + 10 + 12
    assert summed["errors"] == summed["timeouts"] == 0


def test_bytes_counters(cache):
    value = os.urandom(5000)  # incompressible: stored as is (pickled)
    cache.set("noise", value)
    sent_after_set = totals(cache)["bytes_sent"]
    assert sent_after_set > 5000
    cache.get("noise")
    assert totals(cache)["bytes_received"] > 5000
    cache.get_many(["noise"])
    assert totals(cache)["bytes_received"] > 10000
    assert totals(cache)["bytes_saved"] == 0


def test_compression_savings_are_counted(cache):
    text = "compress me " * 10_000  # 120 kB that zlib shrinks to almost nothing
    cache.set("text", text)
    cache.set_many({"more": text})
    saved = totals(cache)["bytes_saved"]
    assert saved > 2 * 100_000
    assert totals(cache)["bytes_sent"] < 2 * 20_000


def test_metrics_are_shared_by_instances_with_the_same_settings(cache, nodes):
    other = MemcachedCache([node.address for node in nodes], {"KEY_PREFIX": "other"})
    other.get("x")
    assert totals(cache)["misses"] == 1
    assert totals(cache)["pool_size"] == 1


def test_server_stats_per_node(cache, nodes):
    cache.set("a", 1)
    stats = cache.server_stats()
    assert list(stats) == [node.address for node in nodes]
    for node in nodes:
        assert stats[node.address]["pid"] == node.process.pid
    assert sum(s["curr_items"] for s in stats.values()) == 1


def test_server_stats_report_a_dead_node_without_raising(cache, nodes):
    nodes[1].kill()
    stats = cache.server_stats()
    assert stats[nodes[0].address]["pid"] == nodes[0].process.pid
    assert "error" in stats[nodes[1].address]
