"""Each backend with its own extra alone: what a site that installed one of them sees.

Every test runs a fresh Python in which the other backend's packages cannot be imported
(an import hook refuses them and records each attempt), configures a site with
``django_kvcache`` in INSTALLED_APPS, and runs what a site runs: ``django.setup()``,
``check`` (with and without ``--database``), ``migrate`` and every management command of
the app. The tox environments ``extra-mysql``, ``extra-memcached`` and ``extra-none``
do the same with real installs of one extra (or none) in fresh virtualenvs
(``scripts/extra_site.py``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent

SITE = r'''
import json, os, sys, traceback
BLOCKED = set(sys.argv[1].split(",")) - {""}
ATTEMPTS = []

class Refuse:
    """Imports of the packages this site did not install fail, as they would there."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            ATTEMPTS.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse())

import django
from django.conf import settings
from io import StringIO

settings.configure(**json.loads(sys.argv[2]))
outcome = {}
try:
    django.setup()
    outcome["setup"] = "ok"
except Exception as exc:
    outcome["setup"] = f"{type(exc).__name__}: {exc}"
else:
    from django.core.management import call_command
    outcome["stdout"] = {}
    for argv in json.loads(sys.argv[3]):
        out = StringIO()
        try:
            call_command(*argv, stdout=out, stderr=StringIO())
            outcome[" ".join(argv)] = "ok"
        except Exception as exc:
            outcome[" ".join(argv)] = f"{type(exc).__name__}: {exc}"
        outcome["stdout"][" ".join(argv)] = out.getvalue()
outcome["attempts"] = ATTEMPTS
outcome["modules"] = sorted(m for m in sys.modules if m.startswith("django_kvcache"))
print(json.dumps(outcome))
'''


def run_site(blocked: list[str], config: dict, commands: list[list[str]]) -> dict:
    """``SITE`` in a fresh interpreter, from the repository root (the package under test)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", SITE, ",".join(blocked), json.dumps(config), json.dumps(commands)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def site(caches: dict, databases: dict | None = None) -> dict:
    return {
        "INSTALLED_APPS": ["django.contrib.contenttypes", "django.contrib.auth",
                           "django_kvcache"],
        "DATABASES": databases or {"default": {"ENGINE": "django.db.backends.sqlite3",
                                               "NAME": ":memory:"}},
        "CACHES": caches,
        "USE_TZ": True,
        "DEFAULT_AUTO_FIELD": "django.db.models.AutoField",
    }


MEMCACHED = {"BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
             "LOCATION": settings.MEMCACHED_NODES[:1]}
MYSQL = {"BACKEND": "django_kvcache.backends.mysql.MySQLCache", "LOCATION": "kvcache_extras"}


def every_command(alias: str) -> list[list[str]]:
    return [
        ["check"], ["check", "--database", "default"], ["migrate", "--verbosity", "0"],
        ["createcachetable"], ["kvcache_createtable"], ["kvcache_cull"],
        ["kvcache_migration"], ["kvcache_stats"],
        ["kvcache_train_dictionary", alias, "--output", os.devnull],
        ["kvcache_rotate_key", alias],
    ]


def assert_no_import_error(outcome: dict) -> None:
    failures = {step: said for step, said in outcome.items()
                if isinstance(said, str) and ("Import" in said or "No module" in said)}
    assert not failures


def test_a_memcached_site_never_imports_mysqlclient():
    """The memcached extra alone (no mysqlclient): the app, its checks and every command
    work, and nothing of the MySQL backend is imported."""
    outcome = run_site(["MySQLdb"], site({"default": MEMCACHED}), every_command("default"))
    assert outcome["setup"] == "ok"
    assert_no_import_error(outcome)
    for step in ("check", "check --database default", "migrate --verbosity 0",
                 "createcachetable", "kvcache_createtable", "kvcache_cull", "kvcache_stats"):
        assert outcome[step] == "ok", (step, outcome[step])
    looked_for = ("no MySQLCache in CACHES (no BACKEND of 'default' is "
                  "django_kvcache.backends.mysql.MySQLCache or a subclass)")
    assert outcome["kvcache_migration"] == f"CommandError: {looked_for}: no migration to write."
    assert outcome["kvcache_rotate_key default"] == (
        "CommandError: Cache 'default' is not a MySQLCache")
    assert outcome["stdout"]["kvcache_cull"] == f"{looked_for}: nothing to cull.\n"
    assert outcome["stdout"]["kvcache_createtable"] == f"{looked_for}: no table to create.\n"
    # The shared node may hold enough entries to learn from, or too few: either is fine.
    trained = outcome[f"kvcache_train_dictionary default --output {os.devnull}"]
    assert trained == "ok" or trained.startswith("CommandError: Cache 'default' gave "), trained
    assert outcome["attempts"] == []
    assert not [m for m in outcome["modules"] if ".mysql" in m]


@pytest.fixture
def own_database():
    """A database of this test's own on the test server, dropped afterwards."""
    import MySQLdb

    name = f"kvcache_extras_{os.getpid()}"
    server = settings.DATABASES["default"]
    connect = dict(host=server["HOST"], port=int(server["PORT"]), user=server["USER"],
                   password=server["PASSWORD"])
    connection = MySQLdb.connect(**connect)
    try:
        connection.cursor().execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        yield {"default": {"ENGINE": "django.db.backends.mysql", "NAME": name,
                           **{k: server[k] for k in ("HOST", "PORT", "USER", "PASSWORD")},
                           "OPTIONS": {"charset": "utf8mb4"}}}
    finally:
        connection.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
        connection.close()


def test_a_mysql_site_never_imports_mmh3(own_database):
    """mysqlclient and zstandard by name (no mmh3): a MySQLCache on one database works
    with the app, its checks and every command."""
    outcome = run_site(["mmh3"], site({"default": MYSQL}, own_database),
                       every_command("default"))
    assert outcome["setup"] == "ok"
    assert_no_import_error(outcome)
    for step in ("check", "check --database default", "migrate --verbosity 0",
                 "createcachetable", "kvcache_createtable", "kvcache_cull",
                 "kvcache_migration", "kvcache_stats"):
        assert outcome[step] == "ok", (step, outcome[step])
    assert outcome[f"kvcache_train_dictionary default --output {os.devnull}"].startswith(
        "CommandError: Cache 'default' gave 0 usable entries")
    assert outcome["kvcache_rotate_key default"] == (
        "CommandError: default: the cache has no OPTIONS['ENCRYPTION_KEYS']: nothing to "
        "re-encrypt")
    assert outcome["attempts"] == []
    assert not [m for m in outcome["modules"] if ".memcached" in m]


def test_a_memcached_cache_without_its_extra_names_it():
    outcome = run_site(["mmh3", "MySQLdb"], site({"default": MEMCACHED}), [["check"]])
    assert outcome["check"] == (
        "InvalidCacheBackendError: Could not find backend "
        "'django_kvcache.backends.memcached.MemcachedCache': MemcachedCache needs the mmh3 "
        "package, which is not installed here: pip install 'django-kvcache[memcached]' (or "
        "pip install mmh3)."
    )


def test_a_mysql_cache_without_its_extra_names_it():
    outcome = run_site(["mmh3", "MySQLdb"], site({"default": MYSQL}), [["check"]])
    assert outcome["check"] == (
        "InvalidCacheBackendError: Could not find backend "
        "'django_kvcache.backends.mysql.MySQLCache': MySQLCache needs the mysqlclient "
        "package, which is not installed here: pip install 'django-kvcache[mysql]' (or "
        "pip install mysqlclient)."
    )


def test_mysql_shards_without_mmh3_name_the_extra(own_database):
    """One database needs no hashing; spreading keys over several does."""
    # Real databases: Django 6.1's model checks ask the server's version, and an alias
    # with no server behind it failed there first (or not, where a MariaDB listened on
    # the default socket with no such database).
    databases = {alias: own_database["default"] for alias in ("default", "other")}
    sharded = {**MYSQL, "OPTIONS": {"DATABASES": ["default", "other"]}}
    outcome = run_site(["mmh3"], site({"default": sharded}, databases), [["check"]])
    assert outcome["check"] == (
        "ImproperlyConfigured: CACHES['default']: A MySQLCache over several shards (OPTIONS['DATABASES']) needs "
        "the mmh3 package, which is not installed here: pip install 'django-kvcache[mysql]' "
        "(or pip install mmh3)."
    )


def test_a_command_names_the_missing_extra_in_one_line():
    outcome = run_site(["mmh3", "MySQLdb"], site({"default": MYSQL}), [["kvcache_cull"]])
    assert outcome["kvcache_cull"] == (
        "CommandError: MySQLCache needs the mysqlclient package, which is not installed "
        "here: pip install 'django-kvcache[mysql]' (or pip install mysqlclient)."
    )


def test_the_mysql_commands_say_once_that_there_is_no_mysql_cache():
    """On a site without a MySQLCache, kvcache_cull and kvcache_createtable say so in one
    line and succeed (nothing to do is no failure); with -v 0, as a cron line runs them,
    they print nothing, so cron mails nothing."""
    commands = [["kvcache_cull"], ["kvcache_createtable"], ["kvcache_cull", "-v", "0"],
                ["kvcache_createtable", "-v", "0"]]
    outcome = run_site(["MySQLdb"], site({"default": MEMCACHED}), commands)
    assert [outcome[" ".join(argv)] for argv in commands] == ["ok"] * 4
    assert [outcome["stdout"][" ".join(argv)].count("\n") for argv in commands] == [1, 1, 0, 0]
    assert outcome["stdout"]["kvcache_cull"].startswith("no MySQLCache in CACHES")


#: The benchmark on a site's cache at its smallest, a few calls of each site scenario but
#: concurrency: its processes set Django up from DJANGO_SETTINGS_MODULE, which these
#: sites (settings.configure) have not (scripts/extra_site.py runs it in a real site).
BENCHMARK = ["kvcache_benchmark", "--caches", "default", "--quick", "--no-progress",
             "--scenario", "ops,rows,stampede,codec", "--rounds", "1", "--calls", "3",
             "--rows", "100", "--callers", "4"]


@pytest.mark.once
@pytest.mark.parametrize("backend, blocked", [("memcached", "MySQLdb"), ("mysql", "mmh3")])
def test_the_benchmark_runs_on_a_site_with_one_backend(backend, blocked, tmp_path, request):
    """``kvcache_benchmark --caches default --quick`` on a site with one backend's extra
    and the bench extra: it measures the site's cache (and Django's peer beside it), and
    imports nothing of the other backend (it used to import the MySQL modules in every
    run: MissingDependency on a memcached-only site)."""
    if backend == "memcached":
        config = site({"default": MEMCACHED})
        peer = "default-pymemcache"
    else:
        config = site({"default": MYSQL}, request.getfixturevalue("own_database"))
        peer = "default-databasecache"
    config["INSTALLED_APPS"].append("kvcache_bench")
    outcome = run_site([blocked], config, [BENCHMARK + ["--results", str(tmp_path)]])
    assert outcome[" ".join(BENCHMARK + ["--results", str(tmp_path)])] == "ok"
    assert outcome["attempts"] == []
    other = ".mysql" if backend == "memcached" else ".memcached"
    assert not [m for m in outcome["modules"] if other in m]
    data = json.loads((tmp_path / "benchmark-realistic.json").read_text())
    measured = {e["cache"] for e in data["scenarios"]["ops"]["results"] if e["correct"]}
    assert {"default", peer} <= measured


def test_a_site_with_neither_backend_runs_the_app():
    """django_kvcache installed without any extra and no kvcache cache: nothing breaks."""
    locmem = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    commands = [["check"], ["migrate", "--verbosity", "0"], ["kvcache_stats"],
                ["kvcache_cull"], ["kvcache_createtable"]]
    outcome = run_site(["mmh3", "MySQLdb"], site({"default": locmem}), commands)
    assert {step: outcome[step] for step in map(" ".join, commands)} == dict.fromkeys(
        map(" ".join, commands), "ok")
    assert outcome["attempts"] == []
    assert outcome["stdout"]["kvcache_stats"] == (
        "no django-kvcache cache in CACHES (no BACKEND of 'default' is a django_kvcache "
        "backend or a subclass): nothing to show.\n")

