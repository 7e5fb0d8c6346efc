#!/usr/bin/env python3
"""A new site, as a user makes one, in a virtualenv with one extra of django-kvcache.

    python scripts/extra_site.py mysql       # run by tox's py311-extra-mysql
    python scripts/extra_site.py memcached   # py311-extra-memcached
    python scripts/extra_site.py none        # py311-extra-none: no extra at all

tox installs the package (its sdist, not the checkout) with that extra and the ``bench``
extra, as a user who benchmarks their site does (``none``: no extra at all), plus Django
and pytest. This script then, outside the checkout:

1. checks that the venv holds what the extras bring and nothing of the other backend's
   (so the run proves what it claims: the ``bench`` extra brings no mysqlclient);
2. makes a project with ``django-admin startproject``, adds ``django_kvcache`` to
   INSTALLED_APPS and the backend's cache as docs/quickstart.rst says (the MySQL site on
   a database of its own on the test server, the memcached site on the test nodes with
   its SQLite database; with the mysql extra, the quick start's "both" set-up too), and
   an app whose views use ``cache_page``, ``get_or_set`` and the session, with a
   ``TestCase`` listing no database but ``default``;
3. runs ``check``, ``check --database default``, ``migrate``, ``test`` and every
   management command of the app (``kvcache_train_dictionary`` on entries it writes),
   expecting each to succeed — or, for a backend whose extra is not installed (every one
   in the ``none`` site), ``check`` to fail naming the extra and the package; then
   ``kvcache_benchmark --caches default --quick`` (four scenarios, small sizes), expecting
   it to measure the site's cache (without the ``bench`` extra: to fail naming it);
4. runs that backend's contract tests (the base class of tests/test_<backend>_contract.py)
   from a copy of the tests, so that the package under test is the installed one.

Exits non-zero, saying what is wrong, at the first problem. Needs the servers of
``scripts/services.py up`` (its ``KVCACHE_*`` variables).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
BACKENDS = {
    "mysql": "django_kvcache.backends.mysql.MySQLCache",
    "memcached": "django_kvcache.backends.memcached.MemcachedCache",
}
#: What each extra must bring, and what the backend's missing extra is named by.
BRINGS = {"mysql": ["MySQLdb", "zstandard", "mmh3"], "memcached": ["mmh3", "zstandard"],
          "none": []}
#: What the ``bench`` extra brings (installed beside each backend's extra, not in ``none``).
BENCH = ["tqdm", "matplotlib", "pymemcache"]
#: The benchmark on the site's cache, at the smallest sizes: the scenarios that import a
#: backend or a peer (ops, codec), fill a table (rows) or start processes (concurrency);
#: stampede, mostly fixed sleeps, is left to the suite (tests/test_benchmark_site.py).
BENCHMARK = ("kvcache_benchmark", "--caches", "default", "--quick", "--scenario",
             "ops,rows,concurrency,codec", "--rounds", "1", "--calls", "3", "--rows", "100",
             "--iterations", "5", "--workers", "1")
MISSING = {"mysql": "mysqlclient", "memcached": "mmh3"}
COMMANDS = (
    ["createcachetable"], ["kvcache_createtable"], ["kvcache_cull"], ["kvcache_migration"],
    ["kvcache_stats"],
)
CONTRACT = {
    "mysql": "tests/test_mysql_contract.py::TestMySQLCacheMeetsTheContract",
    "memcached": "tests/test_memcached_contract.py::TestMemcachedCacheMeetsTheContract",
}

VIEWS = '''
import time

from django.core.cache import cache
from django.http import JsonResponse
from django.views.decorators.cache import cache_page


@cache_page(60)
def page(request):
    answer = cache.get_or_set("answer", lambda: {"value": 42}, 60)
    return JsonResponse({"answer": answer, "rendered": time.time()})


def visits(request):
    request.session["visits"] = request.session.get("visits", 0) + 1
    return JsonResponse({"visits": request.session["visits"]})
'''

TESTS = '''
from django.core.cache import cache
from django.test import TestCase


class CacheInTests(TestCase):
    """A project's test: lists no database but "default", uses the cache."""

    def test_the_cache(self):
        cache.set("k", {"v": 1})
        self.assertEqual(cache.get("k"), {"v": 1})
        cache.add("n", 0)
        self.assertEqual(cache.incr("n"), 1)

    def test_a_cached_page(self):
        first = self.client.get("/page/")
        self.assertEqual(first.json()["answer"], {"value": 42})
        self.assertEqual(self.client.get("/page/").content, first.content)

    def test_a_session(self):
        self.client.get("/visits/")
        self.assertEqual(self.client.get("/visits/").json(), {"visits": 2})
'''


class SiteError(Exception):
    pass


def say(message: str) -> None:
    print(f"extra_site: {message}", flush=True)


def run(*argv: str, cwd: Path, env: dict[str, str], expect_failure: bool = False
        ) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    result = subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True)
    failed = result.returncode != 0
    shown = " ".join(arg if "\n" not in arg else "<script>"
                     for arg in (argv[1:] if argv[0] == sys.executable else argv))
    if failed != expect_failure:
        raise SiteError(
            f"`{shown}` {'failed' if failed else 'succeeded'} ({result.returncode}):\n"
            f"{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    said = (result.stderr.strip().splitlines() or ["?"])[-1] if failed else "ok"
    say(f"{shown}: {said} ({time.monotonic() - started:.1f} s)")
    return result


def check_environment(extra: str) -> None:
    """The venv holds the extra's packages and not the other backend's."""
    import django_kvcache

    if not Path(django_kvcache.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()):
        raise SiteError(f"django_kvcache imported from {django_kvcache.__file__}, not the venv")
    present = {name for name in ("MySQLdb", "mmh3", "zstandard", *BENCH)
               if importlib.util.find_spec(name) is not None}
    wanted = set(BRINGS[extra]) | (set() if extra == "none" else set(BENCH))
    if present != wanted:
        raise SiteError(f"the {extra!r} environment has {sorted(present)}, "
                        f"expected exactly {sorted(wanted)}")
    say(f"installed: django_kvcache from {Path(django_kvcache.__file__).parent}, "
        f"with {sorted(present) or 'no extra package'}")


def mysql_server() -> dict[str, str]:
    return {
        "HOST": os.environ.get("KVCACHE_MYSQL_HOST", "127.0.0.1"),
        "PORT": os.environ.get("KVCACHE_MYSQL_PORT", "23306"),
        "USER": os.environ.get("KVCACHE_MYSQL_USER", "kvcache"),
        "PASSWORD": os.environ.get("KVCACHE_MYSQL_PASSWORD", ""),
    }


def mysql_statement(statement: str) -> None:
    import MySQLdb

    server = mysql_server()
    connection = MySQLdb.connect(host=server["HOST"], port=int(server["PORT"]),
                                 user=server["USER"], password=server["PASSWORD"])
    try:
        connection.cursor().execute(statement)
    finally:
        connection.close()


def site_settings(backend: str, database: str | None) -> str:
    """What the quick start adds to a new project's settings.py, for ``backend``."""
    lines = ['INSTALLED_APPS += ["django_kvcache", "kvcache_bench", "pages"]']
    if database is not None:
        lines.append("DATABASES = " + repr({"default": {
            "ENGINE": "django.db.backends.mysql", "NAME": database, **mysql_server(),
            "OPTIONS": {"charset": "utf8mb4"},
        }}))
    nodes = os.environ.get("KVCACHE_MEMCACHED", "127.0.0.1:21211").split(",")[:2]
    memcached = {"BACKEND": BACKENDS["memcached"], "LOCATION": nodes,
                 "KEY_PREFIX": f"site{os.getpid()}"}  # the nodes are shared: a prefix
    mysql = {"BACKEND": BACKENDS["mysql"], "LOCATION": "kvcache_entries",
             "OPTIONS": {"MAX_ENTRIES": 100_000}}
    if backend == "mysql":  # the quick start's "One MySQL or MariaDB server"
        caches = {"default": mysql}
        session = ["cached_db"]
    elif backend == "memcached":  # "A memcached cluster"
        caches = {"default": memcached}
        session = ["cached_db"]
    elif backend == "both":  # "Both": sessions in a MySQL cache of their own
        caches = {"default": memcached, "db": mysql,
                  "sessions": {**mysql, "LOCATION": "kvcache_sessions"}}
        session = ["cache", 'SESSION_CACHE_ALIAS = "sessions"']
    else:
        caches = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
        session = ["cached_db"]
    lines.append("CACHES = " + repr(caches))
    lines.append(f'SESSION_ENGINE = "django.contrib.sessions.backends.{session[0]}"')
    lines += session[1:]
    return "\n".join(lines) + "\n"


def make_site(root: Path, backend: str, database: str | None, env: dict[str, str]) -> Path:
    site = root / "site"
    site.mkdir()
    run(sys.executable, "-m", "django", "startproject", "mysite", str(site), cwd=root, env=env)
    settings = site / "mysite" / "settings.py"
    settings.write_text(settings.read_text() + "\n" + site_settings(backend, database))
    pages = site / "pages"
    pages.mkdir()
    (pages / "__init__.py").write_text("")
    (pages / "views.py").write_text(VIEWS)
    (pages / "tests.py").write_text(TESTS)
    urls = site / "mysite" / "urls.py"
    urls.write_text(urls.read_text().replace(
        "urlpatterns = [",
        "from pages.views import page, visits\n\nurlpatterns = [\n    path('page/', page),\n"
        "    path('visits/', visits),"
    ))
    return site


def fill_cache(site: Path, env: dict[str, str]) -> None:
    """Entries for the dictionary trainer: JSON documents as a site caches them."""
    script = textwrap.dedent('''
        import json
        from django.core.cache import cache
        cache.set_many({f"doc{i}": json.dumps({"id": i, "title": f"Article {i}",
            "tags": ["django", "cache", str(i % 7)], "body": "lorem ipsum " * (40 + i % 50)})
            for i in range(300)}, 600)
    ''')
    run(sys.executable, "manage.py", "shell", "-c", script, cwd=site, env=env)


def run_contract(extra: str, root: Path, env: dict[str, str]) -> None:
    """The backend's contract tests, from a copy of the tests (no checkout on sys.path)."""
    copy = root / "contract"
    shutil.copytree(PROJECT / "tests", copy / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "scripts").mkdir()
    shutil.copy2(PROJECT / "scripts" / "services.py", copy / "scripts" / "services.py")
    (copy / "pytest.ini").write_text(
        "[pytest]\nDJANGO_SETTINGS_MODULE = tests.settings\npythonpath = .\n"
        "addopts = -ra --strict-markers -p no:cacheprovider\n"
        "markers =\n    soak: -\n    once: -\n    galera: -\n"
    )
    run(sys.executable, "-m", "pytest", "-q", CONTRACT[extra], cwd=copy, env=env)


def main(extra: str) -> int:
    if extra not in BRINGS:
        print(__doc__, file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        check_environment(extra)
    except SiteError as exc:
        print(f"extra_site: FAILED: {exc}", file=sys.stderr)
        return 1
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    database = f"kvcache_site_{os.getpid()}" if extra == "mysql" else None
    with tempfile.TemporaryDirectory(prefix=f"kvcache-site-{extra}-") as temp:
        root = Path(temp)
        if database:
            mysql_statement(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4")
        try:
            site = make_site(root, extra, database, env)
            manage = (sys.executable, "manage.py")
            run(*manage, "check", cwd=site, env=env)
            run(*manage, "check", "--database", "default", cwd=site, env=env)
            run(*manage, "migrate", "--verbosity", "0", cwd=site, env=env)
            run(*manage, "test", "pages", "--noinput", cwd=site, env=env)
            for command in COMMANDS:
                if command == ["kvcache_migration"] and extra != "mysql":
                    run(*manage, *command, cwd=site, env=env, expect_failure=True)
                    continue
                run(*manage, *command, cwd=site, env=env)
            # Re-encrypting needs a MySQLCache with ENCRYPTION_KEYS: each site says why not.
            run(*manage, "kvcache_rotate_key", "default", cwd=site, env=env,
                expect_failure=True)
            if extra != "none":
                fill_cache(site, env)
                run(*manage, "kvcache_train_dictionary", "default", "--samples", "300",
                    "--output", str(root / "dictionary"), cwd=site, env=env)
            benchmark(extra, root, site, env)
            check_missing_extras(extra, site, env)
            if extra == "mysql":  # the mysql extra brings mmh3: memcached works too
                both(site, database, env)
            if extra in CONTRACT:
                run_contract(extra, root, env)
        except SiteError as exc:
            print(f"extra_site: FAILED: {exc}", file=sys.stderr)
            return 1
        finally:
            if database:
                mysql_statement(f"DROP DATABASE IF EXISTS `{database}`")
    say(f"the {extra!r} site passed in {time.monotonic() - started:.0f} s")
    return 0


def benchmark(extra: str, root: Path, site: Path, env: dict[str, str]) -> None:
    """``kvcache_benchmark`` on the site's cache: it measures it (and Django's peer beside
    it) and exits 0; without the ``bench`` extra it fails naming it."""
    import json

    results = root / "results"
    if extra == "none":
        result = run(sys.executable, "manage.py", *BENCHMARK, cwd=site, env=env,
                     expect_failure=True)
        if "pip install 'django-kvcache[bench]'" not in result.stderr:
            raise SiteError(f"kvcache_benchmark without the bench extra does not name it:\n"
                            f"{result.stderr[-2000:]}")
        return
    run(sys.executable, "manage.py", *BENCHMARK, "--results", str(results), cwd=site, env=env)
    data = json.loads((results / "benchmark-realistic.json").read_text())
    measured = {entry["cache"] for entry in data["scenarios"]["ops"]["results"]
                if entry["correct"] and entry["median_us"]}
    wanted = {"default", "default-databasecache" if extra == "mysql" else "default-pymemcache"}
    if not wanted <= measured:
        raise SiteError(f"the benchmark measured {sorted(measured)}, not {sorted(wanted)}")


def both(site: Path, database: str | None, env: dict[str, str]) -> None:
    """The quick start's third set-up, memcached and MySQL, in the same site."""
    settings = site / "mysite" / "settings.py"
    original = settings.read_text()
    try:
        caches = site_settings("both", database).split("\n", 1)[1]  # not INSTALLED_APPS again
        settings.write_text(original + caches)
        for command in (("check", "--database", "default"), ("migrate", "--verbosity", "0"),
                        ("test", "pages", "--noinput")):
            run(sys.executable, "manage.py", *command, cwd=site, env=env)
    finally:
        settings.write_text(original)


def check_missing_extras(extra: str, site: Path, env: dict[str, str]) -> None:
    """A backend whose extra is not installed stops ``check`` naming extra and package."""
    settings = site / "mysite" / "settings.py"
    original = settings.read_text()
    try:
        for backend, module in MISSING.items():
            if backend == extra or (backend == "memcached" and extra == "mysql"):
                continue  # installed (the mysql extra brings mmh3, all MemcachedCache needs)
            settings.write_text(original + "CACHES = " + repr({"default": {
                "BACKEND": BACKENDS[backend], "LOCATION": "kvcache_entries"}}) + "\n")
            result = run(sys.executable, "manage.py", "check", cwd=site, env=env,
                         expect_failure=True)
            wanted = f"pip install 'django-kvcache[{backend}]' (or pip install {module})"
            if wanted not in result.stderr:
                raise SiteError(f"check without the {backend!r} extra does not say "
                                f"{wanted!r}:\n{result.stderr[-2000:]}")
    finally:
        settings.write_text(original)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) == 2 else ""))
