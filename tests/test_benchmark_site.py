"""The benchmark as an app in a user's own site: a fresh ``django-admin startproject``
with ``django_kvcache`` and ``kvcache_bench`` in INSTALLED_APPS, a MySQLCache on its own
database alias and a MemcachedCache on two memcached nodes, measured with
``manage.py kvcache_benchmark --caches default,mc`` on those servers.

What is checked: the run measures those caches beside Django's DatabaseCache and
PyMemcacheCache, writes the JSON, CSV and plots, and leaves the site's servers as it found
them — the site's entries still there, no table or key of its own left behind (a
MySQLCache with ``COMPRESS_DICTIONARY: "auto"``'s dictionary table included; the stale
copies MemcachedCache's get_or_set keeps beside its keys go with them), at the end of a
run and when it is interrupted with Ctrl-C.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from django.conf import settings
from django.db import connections

#: The benchmark's machinery does not change with Django's version: one tox env runs it
#: (setup.cfg, marker 'once').
pytestmark = pytest.mark.once

RUN_TIMEOUT = 240
#: A small run: every site scenario, a few calls each.
QUICK = ("--quick", "--no-progress", "--rounds", "1", "--calls", "3", "--rows", "100",
         "--iterations", "5", "--workers", "1,2", "--callers", "4")
SITE_SETTINGS = """
INSTALLED_APPS += ["django_kvcache", "kvcache_bench"]
MAIN = {{"ENGINE": "django.db.backends.mysql", "NAME": {name!r}, "HOST": {host!r},
         "PORT": {port!r}, "USER": {user!r}, "PASSWORD": {password!r},
         "OPTIONS": {{"charset": "utf8mb4"}}}}
DATABASES = {{"default": MAIN, "cache": {{**MAIN, "TEST": {{"MIRROR": "default"}}}}}}
CACHES = {{
    "default": {{"BACKEND": "django_kvcache.backends.mysql.MySQLCache",
                 "LOCATION": "site_cache", "OPTIONS": {{"DATABASE": "cache"}}}},
    "auto": {{"BACKEND": "django_kvcache.backends.mysql.MySQLCache",
              "LOCATION": "site_auto", "OPTIONS": {{"COMPRESS_DICTIONARY": "auto"}}}},
    "mc": {{"BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
            "LOCATION": {nodes!r}}},
}}
"""
#: The site's own entries, written before the benchmark and read after it.
WRITE_ENTRIES = (
    "from django.core.cache import caches; "
    "caches['default'].set('site-key', 'kept', None); caches['mc'].set('site-key', 'kept', None)"
)
READ_ENTRIES = (
    "from django.core.cache import caches; "
    "print(caches['default'].get('site-key'), caches['mc'].get('site-key'))"
)


def node_keys(address: str) -> list[str]:
    """Every key a memcached node holds (``lru_crawler metadump``)."""
    from kvcache_bench.servers import ask

    reply = ask(address, b"lru_crawler metadump all\r\n")
    return [line.split()[0][4:] for line in reply.splitlines() if line.startswith("key=")]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, django_db_blocker: Any) -> Iterator[dict[str, Any]]:
    """A new project on a database of its own and two memcached nodes of its own."""
    from tests.servers import MemcachedNode

    nodes = [MemcachedNode(), MemcachedNode()]
    database = f"{os.environ['KVCACHE_TEST_DATABASE']}_site"
    folder = tmp_path_factory.mktemp("site")
    with django_db_blocker.unblock():
        with connections["default"].cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4")
    try:
        for node in nodes:
            node.start()
        subprocess.run([sys.executable, "-m", "django", "startproject", "mysite", str(folder)],
                       check=True, capture_output=True)
        with (folder / "mysite" / "settings.py").open("a") as out:
            out.write(SITE_SETTINGS.format(
                name=database, host=settings.MYSQL["HOST"], port=str(settings.MYSQL["PORT"]),
                user=settings.MYSQL["USER"], password=settings.MYSQL["PASSWORD"],
                nodes=[node.address for node in nodes]))
        yield {"folder": folder, "database": database, "nodes": [n.address for n in nodes]}
    finally:
        for node in nodes:
            node.kill()
        with django_db_blocker.unblock():
            with connections["default"].cursor() as cursor:
                cursor.execute(f"DROP DATABASE IF EXISTS `{database}`")


def manage(site: dict[str, Any], *args: str) -> subprocess.CompletedProcess:
    # The site's own settings, not the test suite's that pytest-django exported.
    env = {name: value for name, value in os.environ.items() if name != "DJANGO_SETTINGS_MODULE"}
    return subprocess.run([sys.executable, "manage.py", *args], cwd=site["folder"], env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)


def site_tables(site: dict[str, Any]) -> set[str]:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s",
                       [site["database"]])
        return {row[0] for row in cursor.fetchall()}


@pytest.fixture(scope="module")
def benchmarked(site: dict[str, Any], django_db_blocker: Any) -> dict[str, Any]:
    """migrate (which creates the cache table), the site's entries, then one small run."""
    migrated = manage(site, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert ("Created the tables 'site_cache' and 'site_cache_locks' of cache 'default'."
            in migrated.stdout)
    assert manage(site, "shell", "-c", WRITE_ENTRIES).returncode == 0
    with django_db_blocker.unblock():
        before = {"tables": site_tables(site),
                  "keys": {node: node_keys(node) for node in site["nodes"]}}
    results = site["folder"] / "results"
    run = manage(site, "kvcache_benchmark", "--caches", "default,auto,mc", *QUICK,
                 "--results", str(results))
    with django_db_blocker.unblock():
        after = {"tables": site_tables(site),
                 "keys": {node: node_keys(node) for node in site["nodes"]}}
    return {"run": run, "results": results, "before": before, "after": after}


def test_the_site_s_caches_are_measured_beside_django_s_own(benchmarked):
    run = benchmarked["run"]
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((benchmarked["results"] / "benchmark-realistic.json").read_text())
    assert [cache["name"] for cache in data["caches"]] == [
        "default", "default-databasecache", "auto", "auto-databasecache", "mc",
        "mc-pymemcache"]
    backends = {cache["name"]: cache["backend"] for cache in data["caches"]}
    assert backends["default-databasecache"] == "django.core.cache.backends.db.DatabaseCache"
    assert backends["mc-pymemcache"] == "django.core.cache.backends.memcached.PyMemcacheCache"
    assert data["reference"] == "default-databasecache"
    assert data["scenarios_run"] == ["ops", "rows", "concurrency", "stampede", "codec"]
    assert data["failures"] == []
    ops = {(e["cache"], e["operation"]) for e in data["scenarios"]["ops"]["results"]}
    assert ("default", "get hit") in ops and ("mc-pymemcache", "set_many") in ops
    # The site's MySQLCache as configured: on its own alias, in a table of the run's own.
    described = next(cache for cache in data["caches"] if cache["name"] == "default")
    assert described["options"] == {"DATABASE": "cache"}
    assert described["location"].startswith("kvbench_")
    assert "default" in run.stdout and "mc-pymemcache" in run.stdout


def test_json_csv_and_plots_are_written(benchmarked):
    results = benchmarked["results"]
    assert (results / "benchmark-realistic.csv").stat().st_size > 1000
    plots = sorted(path.name for path in results.glob("*.png"))
    assert plots == [f"benchmark-realistic-{name}.png"
                     for name in sorted(["ops", "rows", "concurrency", "stampede", "codec"])]


def test_the_site_s_servers_are_left_as_they_were(benchmarked, site):
    before, after = benchmarked["before"], benchmarked["after"]
    assert after["tables"] == before["tables"]  # its tables dropped, the site's untouched
    assert {"site_cache", "site_auto", "site_auto_dictionaries"} <= after["tables"]
    for node in site["nodes"]:
        left = set(after["keys"][node]) - set(before["keys"][node])
        assert left == set(), left
        assert set(before["keys"][node]) <= set(after["keys"][node])
    assert sum(len(keys) for keys in before["keys"].values()) == 1  # the site's own key
    assert manage(site, "shell", "-c", READ_ENTRIES).stdout.split()[-2:] == ["kept", "kept"]


def test_an_interrupted_run_leaves_nothing_behind(site, django_db_blocker, tmp_path):
    """Ctrl-C while the scenarios run (the tables and keys of the run exist): the run
    drops its tables, with "auto" dictionaries, as at the end of a run."""
    with django_db_blocker.unblock():
        before = site_tables(site)
    env = {name: value for name, value in os.environ.items() if name != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONFAULTHANDLER"] = "1"  # a SIGABRT prints every thread's stack (see below)
    run = subprocess.Popen(
        [sys.executable, "manage.py", "kvcache_benchmark", "--caches", "default,auto",
         *QUICK, "--calls", "200", "--results", str(tmp_path)],
        cwd=site["folder"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        with django_db_blocker.unblock():
            while not any(t.endswith("_auto_dictionaries") and t.startswith("kvbench_")
                          for t in site_tables(site)):
                assert run.poll() is None and time.monotonic() < deadline, run.communicate()
                time.sleep(0.05)
        time.sleep(0.5)  # into the scenarios
        run.send_signal(signal.SIGINT)
        try:
            _, stderr = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Seen once in CI (not replayed here at 25 points of the run, nor under load):
            # where it hangs is the finding.
            run.send_signal(signal.SIGABRT)
            _, stderr = run.communicate(timeout=30)
            pytest.fail("the benchmark did not stop within 60 s of Ctrl-C; its threads:\n"
                        + stderr[-8000:])
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    with django_db_blocker.unblock():
        assert site_tables(site) == before, stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (("--caches", "nope"), "--caches names no cache of CACHES: nope (CACHES has default, auto, mc)"),
    (("--caches", "mc", "--scenario", "capacity"),
     "scenario(s) capacity start servers of their own"),
])
def test_what_a_site_cannot_run_is_refused_in_one_line(site, args, message):
    refused = manage(site, "kvcache_benchmark", "--no-progress", *args)
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"CommandError: {message}"), refused.stderr
