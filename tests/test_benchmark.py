"""The benchmark command, run for real (small sizes) against the shared servers, and its
value mixes.

Speed is not checked here; what is checked is that the command runs every scenario for
every requested cache and value mix, writes JSON, CSV and plots, refuses wrong results,
and that the storage and capacity figures are sane; and that the mixes are
deterministic, have their stated composition and sizes, and compress like real data.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import random
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.core.cache.backends.locmem import LocMemCache

PROJECT = Path(__file__).resolve().parent.parent
MANAGE = PROJECT / "benchmark_app" / "manage.py"
sys.path.insert(0, str(PROJECT / "benchmark_app"))
from kvcache_bench import data as value_mixes, payloads  # noqa: E402  (the benchmark's package)

from django_kvcache.zstd import zstd_engine  # noqa: E402

#: The benchmark's machinery does not change with Django's version: one tox env runs it
#: (setup.cfg, marker 'once').
pytestmark = pytest.mark.once

TABLE_CACHES = ["db-mariadb", "db-sqlite", "kv-mysql-innodb", "kv-mysql-myisam", "django-mysql"]
MEMCACHED_CACHES = ["kv-memcached-1", "pymemcache-4"]
REQUESTED = TABLE_CACHES + MEMCACHED_CACHES
ROUNDS, CALLS = 2, 4
ROWS = (100, 300)
NODES = (1, 2)
WORKERS = (1, 2)
MIXES = ("realistic", "random")
SCENARIOS = ["ops", "rows", "nodes", "concurrency", "stampede", "storage", "capacity", "codec",
             "encryption", "locks"]
STORAGE_ENTRIES = 60
CAPACITY_MB, CAPACITY_FILL = 16, 2.5
OPERATIONS = {"set", "set large", "set_many", "get hit", "get miss", "get large", "get_many hit",
              "get_many miss", "delete hit", "delete miss", "delete_many", "incr", "incr miss",
              "add new", "add existing", "touch hit", "touch miss"}


class WrongValueCache(LocMemCache):
    """Hands back a changed copy of every bytes value: a backend the benchmark must reject."""

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        value = super().get(key, default, version)
        return value[::-1] + b"!" if isinstance(value, bytes) else value


def benchmark(results: Path, *args: str) -> subprocess.CompletedProcess:
    # pytest-django exported the test settings; the command needs the benchmark's own.
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="benchmark_app.settings")
    return subprocess.run(
        [sys.executable, str(MANAGE), "kvcache_benchmark", "--no-progress",
         "--results", str(results), *args],
        # The default set on both mixes took 177 s on the 2-core VM at a load average of 5.
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    results = tmp_path_factory.mktemp("bench")
    numbers = lambda values: ",".join(map(str, values))  # noqa: E731
    completed = benchmark(
        results, "--caches", ",".join(REQUESTED), "--rounds", str(ROUNDS), "--calls", str(CALLS),
        "--rows", numbers(ROWS), "--nodes", numbers(NODES), "--workers", numbers(WORKERS),
        "--iterations", "8", "--callers", "6", "--values", ",".join(MIXES), "--storage-entries", str(STORAGE_ENTRIES),
        "--capacity-mb", str(CAPACITY_MB), "--capacity-fill", str(CAPACITY_FILL),
        "--lock-seconds", "0.5",
    )
    return completed, results


@pytest.fixture(scope="module")
def runs(run: tuple[subprocess.CompletedProcess, Path]) -> dict[str, dict[str, Any]]:
    """Each mix's results, by mix name."""
    completed, results = run
    assert completed.returncode == 0, completed.stderr[-3000:]
    return {mix: json.loads((results / f"benchmark-{mix}.json").read_text()) for mix in MIXES}


@pytest.fixture(scope="module")
def data(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The first mix's results: the only ones with every scenario."""
    return runs[MIXES[0]]


def test_every_requested_cache_ran_and_nothing_else(data: dict[str, Any]) -> None:
    assert data["skipped"] == {}
    assert [cache["name"] for cache in data["caches"]] == REQUESTED
    assert data["scenarios_run"] == SCENARIOS
    assert data["failures"] == []
    assert data["reference"] == "db-mariadb"


def test_each_mix_reruns_the_scenarios_that_depend_on_the_values(runs: dict[str, dict[str, Any]]) -> None:
    random_run = runs["random"]
    assert random_run["scenarios_run"] == ["ops", "storage", "capacity", "codec", "encryption"]
    assert random_run["failures"] == []
    for mix, results in runs.items():
        assert results["values"]["name"] == results["parameters"]["values"] == mix
        assert sum(kind["percent"] for kind in results["values"]["kinds"]) == 100
        ops = {(e["cache"], e["operation"]) for e in results["scenarios"]["ops"]["results"]}
        assert ops == {(cache, op) for cache in REQUESTED for op in OPERATIONS}
    kinds = {kind["kind"] for kind in runs["realistic"]["values"]["kinds"]}
    assert kinds == {"html", "json", "rows", "scalar", "bytes"}
    assert [kind["kind"] for kind in random_run["values"]["kinds"]] == ["bytes"]


def test_ops_measures_cpu_time_beside_wall_time(data: dict[str, Any]) -> None:
    for entry in data["scenarios"]["ops"]["results"]:
        # A call cannot use more CPU of this one-threaded process than its wall time,
        # bar the clocks' granularity; and every call does some work here.
        assert 0 < entry["cpu_us"] <= entry["mean_us"] * 1.2 + 5


def test_machine_is_described(data: dict[str, Any]) -> None:
    machine = data["machine"]
    assert machine["cores"] >= 1 and machine["cpu"]
    assert machine["django"] and machine["python"]
    assert machine["mariadb"] and machine["memcached"] and machine["sqlite"]


def test_ops_has_checked_figures_for_every_cache_and_operation(data: dict[str, Any]) -> None:
    ops = data["scenarios"]["ops"]
    assert set(ops["operations"]) == OPERATIONS
    by_key = {(e["cache"], e["operation"]): e for e in ops["results"]}
    assert set(by_key) == {(cache, op) for cache in REQUESTED for op in OPERATIONS}
    for entry in by_key.values():
        assert entry["correct"] and entry["wrong_results"] == 0
        assert entry["samples"] == ROUNDS * CALLS
        assert 0 < entry["min_us"] <= entry["median_us"] <= entry["p95_us"] <= entry["p99_us"]
        assert entry["ratio"] > 0
    assert all(by_key["db-mariadb", op]["ratio"] == 1 for op in OPERATIONS)


def test_ops_times_the_bare_select_floor_under_each_kvcache_mysql_read(data: dict[str, Any]) -> None:
    """On every kept round's rows, interleaved with the cache's own get and get_many."""
    ops = data["scenarios"]["ops"]
    mysql = [cache for cache in REQUESTED if cache.startswith("kv-mysql")]
    assert mysql and sorted((e["cache"], e["operation"]) for e in ops["floor"]) == sorted(
        (cache, operation) for cache in mysql for operation in ("get hit", "get_many hit"))
    for entry in ops["floor"]:
        assert entry["samples"] == ROUNDS * CALLS
        assert 0 < entry["min_us"] <= entry["median_us"] and entry["cpu_us"] > 0
        assert entry["interleaved_get_us"] > 0 and entry["interleaved_floor_us"] > 0
        assert entry["get_over_floor"] == round(entry["interleaved_get_us"] / entry["interleaved_floor_us"], 3)


def test_rows_measures_each_table_cache_at_each_size_and_culls(data: dict[str, Any]) -> None:
    rows = data["scenarios"]["rows"]
    assert rows["sizes"] == list(ROWS)
    found = {(e["cache"], e["operation"], e["rows"]) for e in rows["results"]}
    expected = {(cache, op, size) for cache in TABLE_CACHES for op in ("set", "get") for size in ROWS}
    assert found == expected | {(cache, "cull", ROWS[-1]) for cache in TABLE_CACHES}
    for cull in (e for e in rows["results"] if e["operation"] == "cull"):
        assert cull["rows_after"] < cull["rows_before"]
        assert cull["rows_before"] >= ROWS[-1]


def test_nodes_compares_both_clients_with_the_bare_floor(data: dict[str, Any]) -> None:
    nodes = data["scenarios"]["nodes"]
    found = {(e["client"], e["nodes"], e["operation"]) for e in nodes["results"]}
    clients = {(client, n, op) for client in ("kv-memcached", "pymemcache")
               for n in NODES for op in ("get", "get_many")}
    floor = {(client, 1, op) for op in ("get", "get_many")
             for client in ("bare pymemcache Client", "meta-memcache CacheClient")}
    assert found == clients | floor
    assert all(e["median_us"] > 0 for e in nodes["results"])
    assert set(nodes["single_node"]) == {"bare pymemcache Client", "meta-memcache CacheClient"}


def test_emcache_s_benchmark_measures_every_client_and_the_targets(tmp_path: Path) -> None:
    """emcache's method, shortened: every client, operation and node count measured, with
    CPU per call, the ratios at the targets, a table and a plot."""
    from kvcache_bench import plots, report
    from kvcache_bench.scenarios import async_peers

    nodes = os.environ["KVCACHE_MEMCACHED"].split(",")[:2]
    peers = async_peers.measure(nodes, [1, 2], "test", seconds=0.05, rounds=1)
    clients = {async_peers.EMCACHE, async_peers.EMCACHE_BATCHING, async_peers.OURS,
               async_peers.OURS_UNBATCHED}
    operations = {"set", "get", f"get_many({async_peers.BATCH})"}
    found = {(e["client"], e["operation"], e["nodes"]) for e in peers["results"]}
    assert found == {(c, o, n) for c in clients for o in operations for n in (1, 2)}
    assert all(e["ops_per_s"] > 0 and e["cpu_us"] > 0 for e in peers["results"])
    assert {(r["operation"], r["versus"]) for r in peers["ratios"]} == {
        (operation, versus) for _, operation, versus, _ in async_peers.TARGETS}
    text = report.emcache_text(peers)
    assert "kv-memcached (default OPTIONS) against emcache" in text
    results = {"machine": {"cpu": "cpu", "cores": 2, "date_utc": "now"},
               "values": {"name": "realistic", "label": "realistic"},
               "scenarios": {"async": {"results": [], "emcache": peers}}}
    assert [path.name for path in plots.write_all(results, tmp_path)] == [
        "benchmark-realistic-async-emcache.png"]


def test_django_s_rediscache_is_a_peer_in_ops_and_async(tmp_path: Path, monkeypatch) -> None:
    """On the Redis services.py starts: a row of ops (every result checked), ours against
    it and PyMemcacheCache per operation, and a client of async on its one server."""
    import importlib

    from kvcache_bench import report
    from kvcache_bench.caches import REDIS, redis_spec
    from kvcache_bench.context import Context, Parameters

    completed = benchmark(tmp_path, "--scenario", "ops", "--caches",
                          "kv-memcached-1,pymemcache-1,redis", "--rounds", "1", "--calls", "3",
                          "--values", "realistic")
    assert completed.returncode == 0, completed.stderr[-3000:]
    data = json.loads((tmp_path / "benchmark-realistic.json").read_text())
    assert data["skipped"] == {} and data["failures"] == []
    ops = data["scenarios"]["ops"]
    redis = {e["operation"]: e for e in ops["results"] if e["cache"] == REDIS}
    assert set(redis) == OPERATIONS and all(e["correct"] for e in redis.values())
    versus = {(e["peer"], e["operation"]): e["speedup"] for e in ops["versus"]
              if e["cache"] == "kv-memcached-1"}
    assert set(versus) == {(peer, op) for peer in ("pymemcache-1", REDIS) for op in OPERATIONS}
    assert all(speedup > 0 for speedup in versus.values())
    assert "ops, realistic values: kv-memcached-1 against its peers" in completed.stdout

    scenario = importlib.import_module("kvcache_bench.scenarios.async")
    monkeypatch.setattr(scenario, "COROUTINES", (1, 4))
    context = Context("test", Parameters(), [redis_spec("test")], None, [], show_progress=False)
    items = {f"async.test.{i}": b"v" * 100 for i in range(40)}
    entries = scenario._redis(context, items, 8)
    assert {(e["client"], e["nodes"], e["operation"], e["coroutines"]) for e in entries} == {
        (REDIS, 1, op, n) for op in ("aget", "aget_many(20)", "aset") for n in scenario.COROUTINES}
    ours = [{**e, "client": scenario.AUTOBATCH, "ops_per_s": 2 * e["ops_per_s"]} for e in entries]
    versus_redis = scenario._versus_redis(entries + ours)
    assert {e["speedup"] for e in versus_redis} == {2.0} and len(versus_redis) == len(entries)
    text = report.async_text({"results": entries + ours, "versus_redis": versus_redis})
    assert "one node against Django's RedisCache on one server" in text


def test_concurrency_counts_throughput_and_races(data: dict[str, Any]) -> None:
    entries = data["scenarios"]["concurrency"]["results"]
    found = {(e["cache"], e["mode"], e["workers"]) for e in entries}
    assert found == {(c, mode, n) for c in REQUESTED for mode in ("threads", "processes") for n in WORKERS}
    for entry in entries:
        assert entry["ops_per_s"] > 0 and entry["errors"] == 0
        assert entry["successful_incr"] == entry["workers"] * 8
        if entry["cache"].startswith("kv-"):  # ours must be atomic; DatabaseCache is as measured
            assert entry["lost_incr"] == 0 and entry["extra_add_winners"] == 0
            assert entry["races_without_winner"] == 0


def test_csv_holds_every_figure(run: tuple[subprocess.CompletedProcess, Path], data: dict[str, Any]) -> None:
    with (run[1] / "benchmark-realistic.csv").open() as source:
        rows = list(csv.DictReader(source))
    assert {row["scenario"] for row in rows} == {"machine", "values", "parameters", *SCENARIOS}
    assert ["values", "", "", "", "name", "realistic"] in [list(row.values()) for row in rows]
    medians = {(row["subject"], row["operation"]) for row in rows
               if row["scenario"] == "ops" and row["metric"] == "median_us"}
    assert medians == {(cache, op) for cache in REQUESTED for op in OPERATIONS}


def test_text_table_and_plots_are_written(run: tuple[subprocess.CompletedProcess, Path]) -> None:
    completed, results = run
    for cache in REQUESTED:
        assert cache in completed.stdout
    for mix in MIXES:
        assert f"values: {mix} (" in completed.stdout
        assert f"ops, {mix} values: median per call" in completed.stdout
        assert f"capacity, {mix} values: entries still readable" in completed.stdout
        assert f"codec, {mix} values: CPU per value" in completed.stdout
        assert f"encryption, {mix} values: ENCRYPTION_KEYS against" in completed.stdout
    pngs = {(mix, name): results / f"benchmark-{mix}-{name}.png"
            for mix in MIXES for name in SCENARIOS
            if mix == MIXES[0] or name in ("ops", "storage", "capacity", "codec", "encryption")}
    assert sorted(results.glob("*.png")) == sorted(pngs.values())
    for png in pngs.values():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 10_000


def test_wrong_values_fail_the_run_loudly(tmp_path: Path) -> None:
    completed = benchmark(
        tmp_path, "--scenario", "ops", "--caches", "db-sqlite", "--rounds", "1", "--calls", "3",
        "--values", "random", "--extra-cache", f"wrong={__name__}.WrongValueCache",
        "--extra-cache", "absent=no_such_module.Cache",
    )
    assert completed.returncode != 0
    assert "wrong results" in completed.stderr and "wrong get hit" in completed.stderr
    data = json.loads((tmp_path / "benchmark-random.json").read_text())
    assert "no_such_module" in data["skipped"]["absent"]
    verdicts = {(e["cache"], e["operation"]): e["correct"] for e in data["scenarios"]["ops"]["results"]}
    assert not verdicts["wrong", "get hit"] and not verdicts["wrong", "get_many hit"]
    assert all(correct for (cache, _), correct in verdicts.items() if cache == "db-sqlite")


def test_unknown_scenario_is_refused(tmp_path: Path) -> None:
    completed = benchmark(tmp_path, "--scenario", "ops,speed")
    assert completed.returncode != 0
    assert "unknown scenario(s) speed" in completed.stderr


def test_default_names_the_default_scenarios(tmp_path: Path) -> None:
    completed = benchmark(tmp_path, "--scenario", "default,shards,speed")
    assert completed.returncode != 0
    assert "unknown scenario(s) speed;" in completed.stderr  # "default" is not unknown


def test_unknown_value_mix_is_refused(tmp_path: Path) -> None:
    completed = benchmark(tmp_path, "--scenario", "ops", "--values", "realistic,lorem")
    assert completed.returncode != 0
    assert "unknown value mix 'lorem'" in completed.stderr


@pytest.mark.parametrize("option, value", [
    ("--capacity-mb", "8"), ("--capacity-fill", "0"), ("--storage-entries", "0"),
    ("--server-cpu", "0"), ("--client-processes", "0"), ("--shard-seconds", "0")])
def test_sizes_the_scenarios_cannot_use_are_refused(tmp_path: Path, option: str, value: str) -> None:
    completed = benchmark(tmp_path, "--scenario", "storage", option, value)
    assert completed.returncode != 0
    assert option in completed.stderr
    assert not list(tmp_path.iterdir())  # refused before anything ran


# --- shards, on servers of the benchmark's own ------------------------------------------------


def test_shards_measures_latency_and_capped_throughput(tmp_path: Path) -> None:
    completed = benchmark(
        tmp_path, "--scenario", "shards", "--server-cpu", "0.12", "--rounds", "1", "--calls", "3",
        "--shard-seconds", "0.5", "--shard-rounds", "1", "--client-processes", "2",
        "--client-threads", "2")
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((tmp_path / "benchmark-realistic.json").read_text())
    shards = results["scenarios"]["shards"]
    rates = {(e["operation"], e["shards"]): e for e in shards["results"] if "ops_per_s" in e}
    assert set(rates) == {(f"throughput {op}", n) for op in ("get", "set", "get_many(20)")
                          for n in (1, 2, 3)}
    for (_, n), entry in rates.items():
        assert entry["ops_per_s"] > 0 and entry["errors"] == 0
        assert len(entry["rounds_ops_per_s"]) == len(entry["rounds_vs_fewest"]) == 1
        if shards["server_cpu"] is not None:  # the quota binds: never more CPU than it gives
            assert entry["server_cores"] <= 0.12 * n * 1.25, entry
    if shards["server_cpu"] is None:
        assert any("shards:" in note and "uncapped" in note for note in results["notes"])
    else:
        assert rates["throughput get", 1]["throttled"] > 0.5  # one server, four callers: capped
    assert {e["operation"] for e in shards["results"] if "median_us" in e} >= {"get_many", "set_many"}
    assert "throughput (calls/s)" in completed.stdout and (tmp_path / "benchmark-realistic-shards.png").exists()


# --- replicas, on memcached nodes of the scenario's own ---------------------------------------


def test_replicas_measures_latency_memory_and_a_killed_node(tmp_path: Path) -> None:
    completed = benchmark(tmp_path, "--scenario", "replicas", "--rounds", "2", "--calls", "5",
                          "--replica-keys", "200", "--replica-seconds", "1")
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((tmp_path / "benchmark-realistic.json").read_text())
    entries = results["scenarios"]["replicas"]["results"]
    latency = {(e["replicas"], e["operation"]): e for e in entries if e["part"] == "latency"}
    assert set(latency) == {(r, op) for r in (1, 2) for op in ("set", "get", "get_many(20)")}
    assert all(e["median_us"] > 0 and e["vs_replicas_1"] > 0 for e in latency.values())
    memory = {e["replicas"]: e for e in entries if e["part"] == "memory"}
    assert memory[1]["items"] == 200 and memory[2]["items"] == 400  # every entry twice
    assert memory[2]["bytes"] > 1.5 * memory[1]["bytes"]
    outage = {e["replicas"]: e for e in entries if e["part"] == "outage"}
    assert all(e["stale_reads"] == 0 and e["errors"] == 0 for e in outage.values())
    assert all(e["gets_after_kill"] > 0 for e in outage.values())
    assert outage[1]["hit_ratio_after_kill"] < 0.99  # the killed node's keys missed
    assert outage[2]["hit_ratio_after_kill"] >= 0.99  # their other replica answered
    assert "stale reads" in completed.stdout
    assert (tmp_path / "benchmark-realistic-replicas.png").exists()


# --- storage and capacity, on the servers ---------------------------------------------------

def storage_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["cache"]: e for e in results["scenarios"]["storage"]["results"]}


#: Ours once more with the compact setting (zstd + a trained dictionary: MySQL's installed in
#: its table, COMPRESS_DICTIONARY "auto"), where zstd is installed.
COMPACT = {"kv-mysql-innodb auto": "kv-mysql-innodb", "kv-memcached zstd+dict": "kv-memcached"}
HAS_ZSTD = zstd_engine() is not None


def test_storage_counts_every_entry_of_every_cache(runs: dict[str, dict[str, Any]]) -> None:
    expected = set(TABLE_CACHES) | {"kv-memcached", "pymemcache"} | (set(COMPACT) if HAS_ZSTD else set())
    for results in runs.values():
        storage = results["scenarios"]["storage"]
        assert storage["entries"] == STORAGE_ENTRIES and storage["payload_bytes"] > 0
        assert set(storage_of(results)) == expected
        for entry in storage["results"]:
            assert entry["entries"] == STORAGE_ENTRIES and entry["stored_bytes"] > 0
            assert entry["variant_of"] == COMPACT.get(entry["cache"])
            cache = entry["variant_of"] or entry["cache"]
            on_mariadb = cache in TABLE_CACHES and cache != "db-sqlite"
            assert (entry["data_length"] is not None) == on_mariadb


@pytest.mark.skipif(not HAS_ZSTD, reason="the compact setting needs zstd")
def test_the_compact_setting_stores_less_than_the_defaults_and_names_its_peer(
    runs: dict[str, dict[str, Any]]
) -> None:
    realistic, random_bytes = storage_of(runs["realistic"]), storage_of(runs["random"])
    for compact, default in COMPACT.items():
        assert realistic[compact]["stored_bytes"] < 0.9 * realistic[default]["stored_bytes"]
        assert random_bytes[compact]["stored_bytes"] == pytest.approx(
            random_bytes[default]["stored_bytes"], rel=0.02)
        peer = realistic[default]["peer"]
        assert realistic[compact]["peer"] == peer
        assert realistic[compact]["vs_peer"] == pytest.approx(  # rounded to 3 decimals
            realistic[compact]["stored_bytes"] / realistic[peer]["stored_bytes"], abs=5e-4)


def test_storage_figures_are_what_each_cache_stores(runs: dict[str, dict[str, Any]]) -> None:
    random_bytes, realistic = storage_of(runs["random"]), storage_of(runs["realistic"])
    # Random bytes do not compress: the bytes kept are the payload plus the key, the
    # pickle's few bytes and, in memcached, the item header; base64 text adds a third.
    for cache in ("kv-mysql-innodb", "kv-mysql-myisam", "django-mysql"):
        assert 1.0 < random_bytes[cache]["vs_payload"] < 1.15
    for cache in ("kv-memcached", "pymemcache"):
        assert 1.0 < random_bytes[cache]["vs_payload"] < 1.3
    for cache in ("db-mariadb", "db-sqlite"):
        assert 1.33 < random_bytes[cache]["vs_payload"] < 1.5
    # On the realistic mix compression shows: ours compresses everything worth it,
    # django-mysql from 5000 bytes on, PyMemcacheCache never.
    assert realistic["kv-mysql-innodb"]["vs_payload"] < realistic["django-mysql"]["vs_payload"] < 1
    assert realistic["kv-memcached"]["vs_payload"] < 0.7 < 1 < realistic["pymemcache"]["vs_payload"]
    assert realistic["kv-memcached"]["peer"] == "pymemcache"
    assert realistic["kv-memcached"]["vs_peer"] == pytest.approx(  # rounded to 3 decimals
        realistic["kv-memcached"]["stored_bytes"] / realistic["pymemcache"]["stored_bytes"], abs=5e-4)


def test_capacity_overflows_a_small_node_and_counts_what_it_kept(runs: dict[str, dict[str, Any]]) -> None:
    kept = {}
    for mix, results in runs.items():
        capacity = results["scenarios"]["capacity"]
        assert capacity["memory_mb"] == CAPACITY_MB
        written_bytes = capacity["written"] * capacity["mean_value_bytes"]
        assert written_bytes == pytest.approx(CAPACITY_FILL * CAPACITY_MB * 2**20, rel=0.01)
        entries = {e["client"]: e for e in capacity["results"]}
        compact = {"kv-memcached zstd+dict"} if HAS_ZSTD else set()
        assert set(entries) == {"kv-memcached", "pymemcache"} | compact
        kinds = {kind["kind"] for kind in results["values"]["kinds"]}
        for entry in entries.values():
            assert entry["written"] == capacity["written"] and entry["refused"] == 0
            assert 0 < entry["kept"] < entry["written"] and entry["evictions"] > 0
            assert entry["node_bytes"] <= CAPACITY_MB * 2**20
            assert sum(entry[f"kept_{kind}"] for kind in kinds) == entry["kept"]
        kept[mix] = {client: entry["kept"] for client, entry in entries.items()}
    # Incompressible values: the same entries fit; compressible ones: ours keeps more.
    assert kept["random"]["kv-memcached"] == pytest.approx(kept["random"]["pymemcache"], rel=0.1)
    assert kept["realistic"]["kv-memcached"] > 1.2 * kept["realistic"]["pymemcache"]
    if HAS_ZSTD:  # smaller entries with a dictionary: more of them fit
        assert kept["realistic"]["kv-memcached zstd+dict"] > kept["realistic"]["kv-memcached"]
        assert kept["random"]["kv-memcached zstd+dict"] == pytest.approx(
            kept["random"]["pymemcache"], rel=0.1)


# --- the value mixes, without servers ---------------------------------------------------------

def test_mixes_are_the_same_for_a_seed_and_differ_between_seeds() -> None:
    for mix in value_mixes.MIXES:
        first, again = (value_mixes.make_values(7, 60, mix, 4096) for _ in range(2))
        assert first == again
        other = value_mixes.make_values(8, 60, mix, 4096)
        assert other.entries != first.entries and other.large != first.large


def test_each_kind_has_its_share_and_stays_in_its_size_range() -> None:
    for mix in value_mixes.MIXES.values():
        values = value_mixes.make_values(3, 200, mix.name, 0)
        counts = {share.kind: values.kinds.count(share.kind) for share in mix.shares}
        assert counts == {share.kind: round(share.percent * 2) for share in mix.shares}
        shares = {share.kind: share for share in mix.shares}
        for value, kind in zip(values.entries, values.kinds):
            size, share = payloads.payload_size(value), shares[kind]
            if kind == "scalar":
                assert isinstance(value, (int, str)) and size <= share.max_bytes
            else:
                assert share.min_bytes <= size <= share.max_bytes, (mix.name, kind, size)
        types = {kind: {type(v) for v, k in zip(values.entries, values.kinds) if k == kind}
                 for kind in counts}
        assert types.get("html", {str}) == {str} and types.get("json", {str}) == {str}
        assert types.get("rows", {list}) == {list} and types.get("bytes", {bytes}) == {bytes}


def test_heavy_and_small_mixes_have_their_stated_sizes() -> None:
    heavy = value_mixes.describe(value_mixes.make_values(1234, 256, "heavy", 0), 1234)
    assert 5.0 * 1024 < heavy["mean_bytes"] < 5.8 * 1024
    means = {kind["kind"]: kind["mean_bytes"] for kind in heavy["kinds"]}
    assert 10 * 1024 < means["html"] < 11.5 * 1024 and 4.5 * 1024 < means["json"] < 5.5 * 1024
    assert 2.6 * 1024 < means["rows"] < 3.4 * 1024 and 1.3 * 1024 < means["bytes"] < 1.7 * 1024
    small = value_mixes.make_values(1234, 256, "small", 0)
    assert max(map(payloads.payload_size, small.entries)) <= 3 * 1024


def test_rows_are_what_queryset_values_gives() -> None:
    rows = payloads.row_list(random.Random(1), 2048)
    assert len(rows) > 5 and all(isinstance(row, dict) for row in rows)
    kinds = {type(value) for row in rows for value in row.values()}
    assert {int, str, bool, Decimal, datetime.datetime, type(None)} <= kinds
    assert all(row["created_at"].tzinfo is not None for row in rows)
    json.loads(payloads.json_response(random.Random(1), 3000, 4000))  # valid JSON text


@pytest.mark.parametrize("kind, size, low, high", [
    # Rendered HTML: ~2.6x at 1 KB with zlib-6 (measured on real pages), 3-5x larger.
    ("html", 1024, 2.2, 3.0), ("html", 4096, 3.2, 5.0),
    ("json", 1024, 1.6, 2.6), ("json", 4096, 2.2, 3.5),
    # Pickled query results: ~1.6x at 1 KB, up to ~2.5x for larger ones.
    ("rows", 1024, 1.4, 1.9), ("rows", 4096, 1.7, 2.5),
])
def test_text_compresses_like_real_data_not_like_a_template_loop(kind: str, size: int, low: float,
                                                                 high: float) -> None:
    assert low <= value_mixes.reference_ratios(1234)[kind][value_mixes.size_label(size)] <= high


def test_random_mix_is_incompressible_and_the_original_values() -> None:
    values = value_mixes.make_values(1234, 256, "random", 0).entries
    assert payloads.compression_ratio(values) < 1.0
    rng = random.Random(1234)  # how the benchmark drew its values before it had mixes
    assert values == tuple(rng.randbytes(rng.randint(1, 3072)) for _ in range(256))


def test_codec_weighs_each_compression_setting_against_django_mysql_s(
    runs: dict[str, dict[str, Any]]
) -> None:
    realistic = {e["setting"]: e for e in runs["realistic"]["scenarios"]["codec"]["results"]}
    assert {"django-mysql policy", "none", "zlib-1 from 400", "zstd-3 from 400",
            "zstd-3 + dictionary from 400"} <= set(realistic)
    assert realistic["none"]["vs_payload"] == 1.0
    for entry in realistic.values():
        assert entry["encode_us"] > 0 and entry["decode_us"] > 0
    # Each row is the compressor it is named after, whatever the default is here.
    for setting, entry in realistic.items():
        if setting.startswith(("zlib", "zstd")):
            expected = "ZlibCompressor" if setting.startswith("zlib") else "ZstdCompressor"
            assert entry["compressor"] == expected, setting
    # Compressing small values shrinks them, and a trained dictionary shrinks them more.
    assert realistic["zlib-1 from 400"]["vs_payload"] < 0.5
    assert (realistic["zstd-3 + dictionary from 400"]["stored_bytes"]
            < 0.9 * realistic["zstd-3 from 400"]["stored_bytes"])
    if zstd_engine() is not None:  # each backend's defaults, thresholds of length and saving
        defaults = {e["default_of"]: setting for setting, e in realistic.items()
                    if e.get("default_of")}
        assert defaults == {"memcached": "zstd-3 from 400", "MySQL": "zstd-3 from 1000 saving 25%"}
    # Random bytes come out of every setting as they went in: nothing to gain.
    for entry in runs["random"]["scenarios"]["codec"]["results"]:
        assert entry["vs_payload"] == 1.0


def test_stampede_computes_once_with_protection_and_once_per_caller_without(
    data: dict[str, Any]
) -> None:
    results = data["scenarios"]["stampede"]["results"]
    assert {(e["cache"], e["state"]) for e in results} == {
        (cache, state) for cache in REQUESTED
        for state in ("fresh", "cold", "expired", "early")}
    for entry in results:
        assert entry["answers_ok"], entry
        if entry["state"] == "fresh":
            assert entry["computations"] == 0
        elif entry["state"] == "early":  # present: only EARLY_RECOMPUTE computes, once
            expected = {0, 1} if entry["cache"].startswith("kv-mysql") else {0}
            if entry["cache"].startswith("kv-memcached"):
                expected = {1}
            assert entry["computations"] in expected, entry
        elif entry["cache"].startswith("kv-"):
            assert entry["computations"] == 1, entry
        else:  # Django's and django-mysql's get_or_set: every caller computes
            assert entry["computations"] == entry["callers"], entry



def test_locks_times_our_locks_beside_the_add_delete_recipe(data: dict[str, Any]) -> None:
    """Uncontended pairs and contended turns for lock() (alock() alone too) on each
    kvcache backend and the add + delete recipe on them and on Django's caches; the run
    fails if two holders ever overlapped (none did: failures is empty)."""
    results = data["scenarios"]["locks"]["results"]
    subjects = {"kv-mysql-innodb": ["lock", "alock", "add+delete"],
                "kv-memcached-1": ["lock", "alock", "add+delete"],
                "db-mariadb": ["add+delete"], "pymemcache-4": ["add+delete"]}
    uncontended = {(e["cache"], e["method"]) for e in results if e["mode"] == "uncontended"}
    assert uncontended == {(c, m) for c, methods in subjects.items() for m in methods}
    contended = [e for e in results if e["mode"] == "contended"]
    assert {(e["cache"], e["method"]) for e in contended} == {
        (c, m) for c, methods in subjects.items() for m in methods if m != "alock"}
    for entry in results:
        if entry["mode"] == "uncontended":
            assert entry["samples"] == ROUNDS * CALLS and entry["median_us"] > 0
        else:
            assert entry["grants"] > 0 and entry["wait_max_ms"] >= entry["wait_p50_ms"]
            assert entry["worker_max_grants"] >= entry["worker_min_grants"] >= 0
    assert data["failures"] == []


def test_encryption_times_both_backends_with_and_without_keys_and_counts_the_bytes(
        runs: dict[str, dict[str, Any]]) -> None:
    for mix, results in runs.items():
        scenario = results["scenarios"]["encryption"]
        measured = {(e["cache"], e["operation"]) for e in scenario["results"]}
        assert measured == {(cache, operation) for cache in ("kv-mysql-innodb", "kv-memcached-1")
                            for operation in ("get hit", "get_many hit", "set", "set_many")}
        for entry in scenario["results"]:
            assert entry["samples"] == ROUNDS * CALLS
            assert entry["plain_cpu_us"] > 0 and entry["encrypted_cpu_us"] > 0
            assert entry["time_ratio"] == round(
                entry["encrypted_median_us"] / entry["plain_median_us"], 3)
        for sizes in scenario["bytes"]:
            # Every value but the mix's integers carries a 12-byte nonce and a 16-byte tag.
            assert 0 < sizes["extra_bytes_per_entry"] <= 28
            if mix == "random":
                assert sizes["extra_bytes_per_entry"] == 28
