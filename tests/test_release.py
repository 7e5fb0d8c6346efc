"""The release: one version everywhere, and docs/api.rst, the public API 1.x keeps, true to
the package (every name imports, every list matches the code), so neither can drift."""
from __future__ import annotations

import importlib
import importlib.util
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from django.core.management import get_commands

import django_kvcache
from django_kvcache import checks
from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.backends.mysql import MySQLCache

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.rst"
BACKENDS = {"MySQLCache": MySQLCache, "MemcachedCache": MemcachedCache}
APPS = ("django_kvcache", "kvcache_bench")


def docs_release() -> str:
    """``release`` as docs/conf.py sets it (Sphinx runs the file)."""
    namespace: dict[str, Any] = {"__file__": str(ROOT / "docs" / "conf.py")}
    exec(compile((ROOT / "docs" / "conf.py").read_text(), "docs/conf.py", "exec"), namespace)
    return namespace["release"]


def changelog_release() -> str:
    """The version of the changelog's first release heading (an ``## Unreleased``
    section may come before it)."""
    found = re.search(r"^## (\d+\.\d+\.\d+) — \d{4}-\d\d-\d\d$",
                      (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert found, "CHANGELOG.md has no release heading ('## X.Y.Z — YYYY-MM-DD')"
    return found[1]


def test_the_package_pip_the_docs_and_the_changelog_give_one_version():
    assert django_kvcache.__version__ == "1.0.0"
    assert metadata.version("django-kvcache") == django_kvcache.__version__  # pip list
    assert docs_release() == django_kvcache.__version__
    assert changelog_release() == django_kvcache.__version__


def test_a_stable_release_says_so_in_its_classifiers():
    classifiers = metadata.metadata("django-kvcache").get_all("Classifier")
    assert "Development Status :: 5 - Production/Stable" in classifiers


# --- docs/api.rst ------------------------------------------------------------------------------


def section(title: str) -> str:
    """The text of the section of docs/api.rst under ``title``, up to the next one."""
    text = API.read_text()
    found = re.search(rf"^{re.escape(title)}\n-+\n(.*?)(?=^\S[^\n]*\n-+\n|\Z)", text,
                      re.MULTILINE | re.DOTALL)
    assert found, f"docs/api.rst has no section {title!r}"
    return found[1]


def table(title: str) -> list[list[str]]:
    """The rows (after the header) of the section's list-table, each a list of cells."""
    rows: list[list[str]] = []
    for line in section(title).splitlines():
        if line.startswith("   * - "):
            rows.append([line[7:]])
        elif line.startswith("     - ") and rows:
            rows[-1].append(line[7:])
        elif line.startswith("       ") and rows:
            rows[-1][-1] += " " + line.strip()  # a cell's next line
    assert len(rows) > 1, f"no table in {title!r}"
    return rows[1:]


def literals(text: str) -> list[str]:
    return re.findall(r"``([^`]+)``", text)


def resolve(dotted: str) -> Any:
    """The object ``dotted`` names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(dotted)


def test_every_name_the_api_page_lists_imports_from_the_path_it_gives():
    names = sorted(set(re.findall(r"``((?:django_kvcache|kvcache_bench)(?:\.\w+)+)``",
                                  API.read_text())))
    assert len(names) > 30
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc!r}")
    assert missing == []


def test_the_api_page_lists_every_option_each_backend_takes():
    listed: dict[str, set[str]] = {name: set() for name in BACKENDS}
    for option, mysql, memcached, _ in table("Options"):
        for backend, says in (("MySQLCache", mysql), ("MemcachedCache", memcached)):
            assert says in ("yes", "no"), (option, says)
            if says == "yes":
                listed[backend].add(literals(option)[0])
    for name, backend in BACKENDS.items():
        taken = (backend.shared_options | backend.backend_options) - set(
            backend.inapplicable_options)
        assert listed[name] == taken, name


def test_the_api_page_lists_methods_each_backend_has():
    rows = table("Methods beyond Django's")
    for methods, mysql, memcached, _ in rows:
        for name in literals(methods):
            for backend, says in (("MySQLCache", mysql), ("MemcachedCache", memcached)):
                assert says in ("yes", "no"), (methods, says)
                present = callable(getattr(BACKENDS[backend], name, None))
                assert present == (says == "yes"), f"{backend}.{name}: the page says {says}"
    async_twins = [name for methods, *_ in rows for name in literals(methods)[1:]]
    assert all(name.startswith("a") for name in async_twins), async_twins


def test_the_api_page_lists_every_management_command_of_the_apps():
    listed = {literals(command)[0]: literals(app)[0]
              for command, app, _ in table("Management commands")}
    found = {name: app for name, app in get_commands().items() if app in APPS}
    if "kvcache_bench" not in found.values():  # the tests' settings do not install it
        found.update(kvcache_benchmark="kvcache_bench")
        assert importlib.util.find_spec("kvcache_bench.management.commands.kvcache_benchmark")
    assert listed == found


def test_the_api_page_lists_every_system_check_id():
    listed = set(re.findall(r"kvcache\.[EW]\d{3}", section("System checks")))
    defined = set(re.findall(r'id="(kvcache\.[EW]\d{3})"',
                             Path(checks.__file__).read_text()))
    assert listed == defined


@pytest.mark.parametrize("name", ["Lock", "AsyncLock"])
def test_the_locks_the_page_lists_are_what_the_backends_return(name):
    cache = MemcachedCache("127.0.0.1:1", {})  # nothing is sent before acquire()
    made = cache.lock("x") if name == "Lock" else cache.alock("x")
    assert type(made) is resolve(f"django_kvcache.locks.{name}")
