"""The operators' view, against real servers: ``manage.py kvcache_stats`` and the
Prometheus collector, scraped through a real test-client response."""
from __future__ import annotations

import asyncio
import json
from io import StringIO
from typing import Any, Iterator

import pytest
from django.core.cache import caches
from django.core.management import CommandError, call_command
from django.test import Client, override_settings
from django.urls import path

from django_kvcache.management.commands.kvcache_stats import PROCESS_NOTE
from tests.mysql_support import BACKEND as MYSQL, drop_table

MEMCACHED = "django_kvcache.backends.memcached.MemcachedCache"
TABLE = "kvcache_stats_test"
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def configured(memcached_node_factory) -> Iterator[dict[str, Any]]:
    """A memcached cache on two nodes of its own (counters start at 0) and a MySQLCache,
    each after some traffic: on memcached 3 hits and 2 misses."""
    nodes = [memcached_node_factory().address, memcached_node_factory().address]
    settings = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "mc": {"BACKEND": MEMCACHED, "LOCATION": nodes},
        "db": {"BACKEND": MYSQL, "LOCATION": TABLE, "OPTIONS": {"CULL_PROBABILITY": 0}},
    }
    drop_table(TABLE)
    with override_settings(CACHES=settings):
        caches["db"].create_table()
        caches["mc"].set_many({"a": 1, "b": 2, "c": "text " * 200})
        assert caches["mc"].get_many(["a", "b", "c", "x", "y"]) == {"a": 1, "b": 2,
                                                                   "c": "text " * 200}
        caches["db"].set("page", "<p>page</p>" * 2000)
        yield {"nodes": nodes}
    drop_table(TABLE)


def stats(*args: str) -> str:
    out = StringIO()
    call_command("kvcache_stats", *args, stdout=out)
    return out.getvalue()


def test_json_has_every_node_and_shard_with_metrics_and_the_servers_figures(configured):
    document = json.loads(stats("--json"))
    assert list(document) == ["mc", "db"]
    mc = document["mc"]
    assert mc["backend"] == "MemcachedCache"
    nodes = mc["process"]["nodes"]
    assert list(nodes) == configured["nodes"]
    assert sum(node["hits"] for node in nodes.values()) == 3
    assert sum(node["misses"] for node in nodes.values()) == 2
    assert sum(node["bytes_saved"] for node in nodes.values()) > 500  # "text " * 200
    for node in nodes.values():
        if node["hits"] + node["misses"]:
            assert node["hit_ratio"] == round(node["hits"] / (node["hits"] + node["misses"]), 4)
    # The servers count every client's reads: these nodes saw only this test's.
    assert sum(s["get_hits"] for s in mc["server"].values()) == 3
    assert sum(s["curr_items"] for s in mc["server"].values()) == 3
    db = document["db"]
    assert db["process"]["cache"]["values_encoded"] >= 1
    assert db["process"]["cache"]["bytes_saved"] > 10_000  # the page compresses
    assert list(db["process"]["shards"]) == ["default"]
    assert db["process"]["shards"]["default"]["errors"] == 0
    assert db["server"]["default"]["rows_estimate"] >= 0
    assert db["server"]["default"]["data_bytes"] > 0


def test_mysql_hits_and_misses_are_counted_for_the_table_sync_and_async(configured):
    """MySQLCache counts the keys its reads found and missed, per table (every instance
    and shard of it), on both APIs; the JSON gives the hit ratio beside them."""
    cache = caches["db"]
    before = cache.metrics()
    cache.set_many({"h1": 1, "h2": 2})
    assert cache.get("h1") == 1 and cache.get("nope") is None
    assert cache.get_many(["h1", "h2", "nope", "nada"]) == {"h1": 1, "h2": 2}
    assert cache.get_or_set("h2", 0) == 2

    async def reads() -> None:
        assert await cache.aget("h2") == 2
        assert await cache.aget_many(["h1", "nope"]) == {"h1": 1}
        await cache.aclose()

    asyncio.run(reads())
    after = cache.metrics()
    assert after["hits"] - before["hits"] == 1 + 2 + 1 + 1 + 1
    assert after["misses"] - before["misses"] == 1 + 2 + 1
    figures = json.loads(stats("--json", "db"))["db"]["process"]["cache"]
    assert figures["hits"] == after["hits"] and figures["misses"] == after["misses"]
    assert figures["hit_ratio"] == round(after["hits"] / (after["hits"] + after["misses"]), 4)
    lines = stats("db").splitlines()
    assert "hit ratio" in lines[lines.index(f"  {PROCESS_NOTE}") + 1]  # the table's, as a whole


@pytest.mark.django_db(transaction=True, databases=["default", "shard2", "shard2_replica"])
def test_one_table_name_on_two_databases_is_two_sets_of_counters(configured):
    """The hits and misses of a table are its own on each database: two caches with the
    same LOCATION on different databases do not share them."""
    settings = {"here": {"BACKEND": MYSQL, "LOCATION": TABLE},
                "there": {"BACKEND": MYSQL, "LOCATION": TABLE, "OPTIONS": {"DATABASE": "shard2"}}}
    with override_settings(CACHES=settings):
        here, there = caches["here"], caches["there"]
        there.create_table()
        try:
            before_here, before_there = here.metrics(), there.metrics()
            here.set("k", 1)
            assert here.get("k") == 1 and here.get("nope") is None
            assert there.get("k") is None
            after_here, after_there = here.metrics(), there.metrics()
        finally:
            drop_table(TABLE, "shard2")
    assert (after_here["hits"] - before_here["hits"], after_here["misses"] - before_here["misses"]) == (1, 1)
    assert (after_there["hits"] - before_there["hits"], after_there["misses"] - before_there["misses"]) == (0, 1)


@pytest.mark.django_db(transaction=True, databases=["default", "shard2", "shard2_replica"])
def test_a_replica_is_listed_as_a_replica_not_as_a_shard(configured):
    settings = {"replicated": {"BACKEND": MYSQL, "LOCATION": TABLE, "OPTIONS": {
        "DATABASE": "shard2", "REPLICAS": {"shard2": "shard2_replica"}}}}
    with override_settings(CACHES=settings):
        caches["replicated"].create_table()
        try:
            text = stats("replicated", "--no-server")
            document = json.loads(stats("replicated", "--json", "--no-server"))
        finally:
            drop_table(TABLE, "shard2")
    assert "replicated (MySQLCache, 1 server, 1 replica)" in text  # one server: no shards
    process = document["replicated"]["process"]
    assert list(process["shards"]) == ["shard2"]
    assert list(process["replicas"]) == ["shard2_replica"]


def test_json_process_figures_are_metrics(configured):
    before = caches["mc"].metrics()
    nodes = json.loads(stats("mc", "--json", "--no-server"))["mc"]["process"]["nodes"]
    for name, counters in before.items():
        for key, value in counters.items():
            assert nodes[name][key] == int(value)  # booleans as 0/1
    assert json.loads(stats("mc", "--json", "--no-server"))["mc"]["server"] == {}


def test_the_table_shows_each_node_as_a_column_with_the_hit_ratio(configured):
    text = stats("mc")
    first, second = configured["nodes"]
    header = next(line for line in text.splitlines() if first in line)
    assert header.index(first) < header.index(second)
    assert "mc (MemcachedCache, 2 nodes)" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[3:]
            if line.strip() and not line.startswith("  the ")}
    metrics = caches["mc"].metrics()
    assert rows["hits"] == [f"{metrics[node]['hits']:,}" for node in (first, second)]
    assert "ratio" in rows["hit"]  # "hit ratio" row
    assert "get_hits" in text and "curr_items" in text


def test_a_node_that_is_down_is_shown_not_fatal(configured, memcached_node_factory):
    down = memcached_node_factory()
    down.kill()
    settings = {"gone": {"BACKEND": MEMCACHED, "LOCATION": [down.address]}}
    with override_settings(CACHES=settings):
        document = json.loads(stats("--json"))
    assert "error" in document["gone"]["server"][down.address]


def test_a_refused_node_a_hung_node_and_a_proxy_are_told_apart(configured, memcached_node_factory):
    """A closed port says "refused", a SIGSTOPped memcached "timeout" (it did not answer
    within IO_TIMEOUT), twemproxy "no stats": each in a word in the servers' table, which
    comes first, with the full text in a note under it (a refused connection used to be
    reported as "it closed the connection on stats … a proxy such as twemproxy")."""
    from django.conf import settings as django_settings

    from tests.servers import free_port
    from tests.test_faults_memcached import stop_process

    live, hung = memcached_node_factory(), memcached_node_factory()
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    stop_process(hung.process.pid)
    settings = {
        "mc": {"BACKEND": MEMCACHED, "LOCATION": [live.address, hung.address, closed],
               "OPTIONS": {"IO_TIMEOUT": 0.3}},
        "proxy": {"BACKEND": MEMCACHED, "LOCATION": [django_settings.TWEMPROXY]},
    }
    with override_settings(CACHES=settings):
        mc, proxy = stats("mc"), stats("proxy")
    lines = mc.splitlines()
    assert lines[1].startswith("  the servers' own figures")
    assert mc.index("the servers' own figures") < mc.index("this process's counters")
    assert lines[3].split() == ["answer", "ok", "timeout", "[1]", "refused", "[2]"]
    assert f"  [1] memcached node {hung.address}: did not answer within IO_TIMEOUT (0.3 s)" in lines
    assert (f"  [2] memcached node {closed}: connection refused: nothing listens there "
            "(memcached down, or a wrong LOCATION)") in lines
    table = lines[2:lines.index(f"  [1] memcached node {hung.address}: did not answer within "
                                "IO_TIMEOUT (0.3 s)")]
    assert max(map(len, table)) == len(lines[2]) < 100  # no cell wider than its node's name
    answer = proxy.splitlines()[3]
    assert answer.split() == ["answer", "no", "stats", "[1]"]
    assert "it closed the connection on stats instead of answering" in proxy


@pytest.mark.parametrize("alias, message", [
    ("nope", "No cache named 'nope' in CACHES"),
    ("default", "Cache 'default' is not a django-kvcache cache"),
])
def test_unknown_aliases_are_refused(configured, alias, message):
    with pytest.raises(CommandError, match=message):
        stats(alias)


# --- Prometheus ----------------------------------------------------------------------------


def test_the_collector_exports_metrics_with_cache_and_node_labels(configured):
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from django_kvcache.prometheus import metrics_view, register

    registry = prometheus_client.CollectorRegistry()
    assert register(registry) is not None
    assert register(registry) is None  # once
    urlpatterns = [path("metrics", metrics_view, {"registry": registry})]
    with override_settings(ROOT_URLCONF=type("urls", (), {"urlpatterns": urlpatterns})):
        response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    samples = {
        (sample.name, sample.labels.get("cache"), sample.labels.get("node")): sample
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }
    metrics = caches["mc"].metrics()
    for node in configured["nodes"]:
        hits = samples["kvcache_hits_total", "mc", node]
        assert hits.value == metrics[node]["hits"]
        assert hits.labels == {"cache": "mc", "backend": "MemcachedCache", "node": node}
        assert samples["kvcache_misses_total", "mc", node].value == metrics[node]["misses"]
        assert samples["kvcache_pool_size", "mc", node].value == metrics[node]["pool_size"]
        assert samples["kvcache_down", "mc", node].value == 0
    assert sum(samples["kvcache_hits_total", "mc", node].value
               for node in configured["nodes"]) == 3
    db = caches["db"].metrics()
    assert samples["kvcache_bytes_saved_total", "db", ""].value == db["bytes_saved"]
    assert samples["kvcache_errors_total", "db", "default"].value == 0
    assert samples["kvcache_outdated_keys", "db", "default"].value == 0
