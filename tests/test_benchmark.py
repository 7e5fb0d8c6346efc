"""The benchmark command, run for real (small sizes) against the shared servers.

Speed is not checked here; what is checked is that the command runs every scenario for
every requested cache, writes JSON, CSV and plots, and refuses wrong results.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.cache.backends.locmem import LocMemCache

PROJECT = Path(__file__).resolve().parent.parent
MANAGE = PROJECT / "benchmark_app" / "manage.py"
TABLE_CACHES = ["db-mariadb", "db-sqlite", "kv-mysql-innodb", "kv-mysql-myisam", "django-mysql"]
MEMCACHED_CACHES = ["kv-memcached-1", "pymemcache-4"]
REQUESTED = TABLE_CACHES + MEMCACHED_CACHES
ROUNDS, CALLS = 2, 4
ROWS = (100, 300)
NODES = (1, 2)
WORKERS = (1, 2)
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
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=180,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    results = tmp_path_factory.mktemp("bench")
    numbers = lambda values: ",".join(map(str, values))  # noqa: E731
    completed = benchmark(
        results, "--caches", ",".join(REQUESTED), "--rounds", str(ROUNDS), "--calls", str(CALLS),
        "--rows", numbers(ROWS), "--nodes", numbers(NODES), "--workers", numbers(WORKERS),
        "--iterations", "8",
    )
    return completed, results


@pytest.fixture(scope="module")
def data(run: tuple[subprocess.CompletedProcess, Path]) -> dict[str, Any]:
    completed, results = run
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((results / "benchmark.json").read_text())


def test_every_requested_cache_ran_and_nothing_else(data: dict[str, Any]) -> None:
    assert data["skipped"] == {}
    assert [cache["name"] for cache in data["caches"]] == REQUESTED
    assert data["scenarios_run"] == ["ops", "rows", "nodes", "concurrency"]
    assert data["failures"] == []
    assert data["reference"] == "db-mariadb"


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
    floor = {("bare pymemcache Client", 1, op) for op in ("get", "get_many")}
    assert found == clients | floor
    assert all(e["median_us"] > 0 for e in nodes["results"])


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
    with (run[1] / "benchmark.csv").open() as source:
        rows = list(csv.DictReader(source))
    assert {row["scenario"] for row in rows} == {"machine", "parameters", "ops", "rows", "nodes", "concurrency"}
    medians = {(row["subject"], row["operation"]) for row in rows
               if row["scenario"] == "ops" and row["metric"] == "median_us"}
    assert medians == {(cache, op) for cache in REQUESTED for op in OPERATIONS}


def test_text_table_and_plots_are_written(run: tuple[subprocess.CompletedProcess, Path]) -> None:
    completed, results = run
    for cache in REQUESTED:
        assert cache in completed.stdout
    for name in ("ops", "rows", "nodes", "concurrency"):
        png = results / f"benchmark-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 10_000


def test_wrong_values_fail_the_run_loudly(tmp_path: Path) -> None:
    completed = benchmark(
        tmp_path, "--scenario", "ops", "--caches", "db-sqlite", "--rounds", "1", "--calls", "3",
        "--extra-cache", f"wrong={__name__}.WrongValueCache",
        "--extra-cache", "absent=no_such_module.Cache",
    )
    assert completed.returncode != 0
    assert "wrong results" in completed.stderr and "wrong get hit" in completed.stderr
    data = json.loads((tmp_path / "benchmark.json").read_text())
    assert "no_such_module" in data["skipped"]["absent"]
    verdicts = {(e["cache"], e["operation"]): e["correct"] for e in data["scenarios"]["ops"]["results"]}
    assert not verdicts["wrong", "get hit"] and not verdicts["wrong", "get_many hit"]
    assert all(correct for (cache, _), correct in verdicts.items() if cache == "db-sqlite")


def test_unknown_scenario_is_refused(tmp_path: Path) -> None:
    completed = benchmark(tmp_path, "--scenario", "ops,speed")
    assert completed.returncode != 0
    assert "unknown scenario(s) speed" in completed.stderr
