"""A Prometheus collector for the kvcache caches (the ``prometheus`` extra: prometheus_client).

It exports, at each scrape, the ``metrics()`` counters of the process it runs in — the
figures ``manage.py kvcache_stats`` shows first — labelled with the cache alias, the
backend and the memcached node or MySQL shard (database alias)::

    kvcache_hits_total{cache="default",backend="MemcachedCache",node="10.0.0.1:11211"} 1234
    kvcache_pool_size{cache="default",backend="MemcachedCache",node="10.0.0.1:11211"} 4
    kvcache_errors_total{cache="db",backend="MySQLCache",node="cache"} 0

Counters that only grow end in ``_total``; the others (pools, ``down``, outdated keys)
are gauges. A MySQL cache's table counters (values written, bytes stored and saved)
have ``node=""``. Register it once, e.g. in an AppConfig's ``ready()``::

    from django_kvcache.prometheus import register
    register()  # into prometheus_client's default REGISTRY

django-prometheus's ``/metrics`` then exports it; without it, ``metrics_view`` serves
the registry (``path("metrics", metrics_view)``). Scraping asks no server: it reads
counters in memory.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator

from django.http import HttpRequest, HttpResponse
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from django_kvcache import stats

LABELS = ("cache", "backend", "node")
PREFIX = "kvcache_"


class KVCacheCollector:
    """Reads every kvcache cache's ``metrics()`` at each scrape."""

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for alias in stats.kvcache_aliases():
            try:
                figures = stats.process_figures(alias)
            except Exception:  # a cache that cannot be built has no figures to export
                continue
            rows = [("", figures.figures)] + [(p.name, p.figures) for p in figures.places]
            for node, values in rows:
                for name, value in values.items():
                    family = families.get(name)
                    if family is None:
                        family = families[name] = new_family(name)
                    family.add_metric([alias, figures.backend, node], value)
        yield from families.values()

    def describe(self) -> list[Metric]:
        """Nothing up front: the figures depend on CACHES, read at each scrape."""
        return []


def new_family(name: str) -> Metric:
    meaning = stats.MEANINGS.get(name, f"metrics() figure {name}")
    if name in stats.COUNTERS:
        return CounterMetricFamily(PREFIX + name, meaning, labels=LABELS)
    return GaugeMetricFamily(PREFIX + name, meaning, labels=LABELS)


_registered: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()
_lock = threading.Lock()


def register(registry: CollectorRegistry = REGISTRY) -> KVCacheCollector | None:
    """Register the collector in ``registry`` once; returns it, or None if it was."""
    with _lock:
        if registry in _registered:
            return None
        collector = KVCacheCollector()
        registry.register(collector)
        _registered.add(registry)
        return collector


def metrics_view(request: HttpRequest, registry: Any = REGISTRY) -> HttpResponse:
    """The registry in Prometheus' text format, for a site without django-prometheus."""
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
