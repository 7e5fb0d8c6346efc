#!/usr/bin/env python3
"""Build the sdist and the wheel, and prove each installs and works in a fresh venv.

    .venv/bin/python scripts/check_package.py   # run by `make test` before the test suite

Runs ``python -m build`` on a copy of the files git tracks (the sdist, then the wheel
built from that sdist, so a file missing from the sdist breaks the wheel too) into a
temporary directory, checks what each archive holds — every package of the tree,
``kvcache_bench`` (the benchmark app, shipped from ``benchmark_app/``) included — then
installs each one with one extra into its own new venv (the wheel with ``mysql``, the
sdist with ``memcached``: what a user installs) and, from outside the checkout, imports
that extra's backend and lists the management commands of both apps through Django.
Both archives pass ``twine check --strict`` (what PyPI would refuse), and the changelog's
latest release is the package's version. (tox's ``py311-extra-*`` environments run a
whole site on each extra, and on none; ``py311-wheel`` the contract on the wheel.) Needs
``build`` and ``twine`` (the ``dev`` extra) in the interpreter running it, and what
mysqlclient needs to compile (``scripts/services.py deps``).

Exits non-zero, saying what is wrong, at the first problem.
"""
from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
#: The extra each archive is installed with, and the backend module it must import.
EXTRAS = {"whl": ("mysql", "django_kvcache.backends.mysql"),
          "gz": ("memcached", "django_kvcache.backends.memcached")}
COMMANDS = ("kvcache_createtable", "kvcache_cull", "kvcache_migration", "kvcache_rotate_key",
            "kvcache_stats")
BENCH_COMMANDS = ("kvcache_benchmark",)
# Where each top-level package of the wheel lives in the tree (setup.cfg's package_dir).
PACKAGE_ROOTS = {"django_kvcache": "django_kvcache", "kvcache_bench": "benchmark_app/kvcache_bench"}
# Paths inside the package, and inside the sdist's top folder.
PACKAGE_FILES = ("py.typed", *(f"management/commands/{c}.py" for c in COMMANDS))
SDIST_FILES = ("LICENSE", "README.md", "CHANGELOG.md", "setup.cfg", "pyproject.toml", "tests/settings.py", "docs/conf.py")

# Run by the fresh venv's interpreter, in an empty directory, so nothing comes from the checkout.
INSTALLED_CHECK = f"""
import sys
from importlib import metadata
from pathlib import Path

import django
from django.conf import settings

import importlib
import django_kvcache

importlib.import_module(sys.argv[1])
package = Path(django_kvcache.__file__).parent
assert package.is_relative_to(sys.prefix), f"imported from {{package}}, not the venv"
for name in {PACKAGE_FILES!r}:
    assert (package / name).is_file(), f"installed package lacks {{name}}"
licenses = [f for f in metadata.files("django-kvcache") if f.name == "LICENSE"]
assert licenses and "dist-info" in str(licenses[0]), f"no LICENSE in dist-info: {{licenses}}"
assert metadata.version("django-kvcache") == django_kvcache.__version__

settings.configure(INSTALLED_APPS=["django_kvcache", "kvcache_bench"])
django.setup()
from django.core.management import get_commands

import kvcache_bench
assert Path(kvcache_bench.__file__).is_relative_to(sys.prefix), "kvcache_bench not installed"
missing = [c for c in {COMMANDS!r} if get_commands().get(c) != "django_kvcache"]
missing += [c for c in {BENCH_COMMANDS!r} if get_commands().get(c) != "kvcache_bench"]
assert not missing, f"management commands not found: {{missing}}"
print("installed and imported from", package)
"""


class PackageError(Exception):
    pass


def run(*command: str | Path, cwd: Path | None = None) -> None:
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise PackageError(
            f"`{' '.join(map(str, command))}` failed ({result.returncode}):\n"
            f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )
    if result.stdout.strip():
        print(result.stdout.strip().splitlines()[-1])


def source_tree(workdir: Path) -> Path:
    """A copy of the files git tracks or would track: what a clean clone builds from.

    Building in the checkout would reuse its ``*.egg-info/SOURCES.txt``, whose stale
    entries setuptools adds to the sdist, and would write into the working tree."""
    if not (PROJECT / ".git").exists():  # e.g. an unpacked sdist
        return PROJECT
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=PROJECT, capture_output=True, check=True,
    ).stdout.decode()
    copy = workdir / "source"
    for name in filter(None, listed.split("\0")):
        if (PROJECT / name).is_file():  # not deleted from the tree
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PROJECT / name, copy / name)
    return copy


def build(source: Path, outdir: Path) -> tuple[Path, Path]:
    run(sys.executable, "-m", "build", "--outdir", outdir, source)
    sdists, wheels = sorted(outdir.glob("*.tar.gz")), sorted(outdir.glob("*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        raise PackageError(f"expected one sdist and one wheel in {outdir}, found {sdists + wheels}")
    return sdists[0], wheels[0]


def require(names: set[str], wanted: list[str], archive: Path) -> None:
    missing = [name for name in wanted if name not in names]
    if missing:
        raise PackageError(f"{archive.name} lacks {missing}")


def tree_modules(source: Path) -> list[str]:
    """Every Python file of the packages in the tree, as the wheel names it."""
    modules = []
    for package, folder in PACKAGE_ROOTS.items():
        for path in sorted((source / folder).rglob("*.py")):
            if (path.parent / "__init__.py").is_file():
                modules.append(f"{package}/{path.relative_to(source / folder).as_posix()}")
    return modules


def check_wheel(wheel: Path, source: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    require(names, [f"django_kvcache/{name}" for name in PACKAGE_FILES], wheel)
    missing = [name for name in tree_modules(source) if name not in names]
    if missing:
        raise PackageError(
            f"{wheel.name} lacks {missing}: list their packages in setup.cfg [options] packages"
        )
    if not any(re.fullmatch(r"[^/]+\.dist-info/(licenses/)?LICENSE", name) for name in names):
        raise PackageError(f"{wheel.name} has no LICENSE in its dist-info")
    tops = {name.split("/")[0] for name in names}
    strays = sorted(t for t in tops if t not in PACKAGE_ROOTS and not t.endswith(".dist-info"))
    if strays:
        raise PackageError(f"{wheel.name} installs more than {sorted(PACKAGE_ROOTS)}: {strays}")
    metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = zipfile.ZipFile(wheel).read(metadata_name).decode()
    check_classifiers(metadata)
    check_changelog(metadata)


def check_classifiers(metadata: str) -> None:
    """Every Django version tox.ini tests is declared, so the matrix and PyPI agree."""
    tox = configparser.ConfigParser()
    tox.read(PROJECT / "tox.ini")
    tested = re.findall(r"Django>=(\d+\.\d+),", tox["testenv"]["deps"])
    missing = [v for v in tested if f"Classifier: Framework :: Django :: {v}" not in metadata]
    if not tested or missing:
        raise PackageError(f"classifiers lack the Django versions tox tests: {missing or 'none found'}")


def check_changelog(metadata: str) -> None:
    """The long description (the package's page) ends with the changelog, whole, whose
    latest release is the package's version."""
    changelog = (PROJECT / "CHANGELOG.md").read_text().strip()
    release = release_heading(changelog)
    if changelog.splitlines()[0] not in metadata or release not in metadata:
        raise PackageError("the long description lacks CHANGELOG.md (setup.cfg long_description)")
    version = re.search(r"^Version: (.+)$", metadata, re.MULTILINE)
    if version is None or not release.startswith(f"## {version[1]} — "):
        raise PackageError(f"the package is version {version and version[1]} but the "
                           f"changelog's latest release is {release!r}")


def release_heading(changelog: str) -> str:
    """The changelog's first release heading (``## 1.0.0 — 2026-11-29``); an
    ``## Unreleased`` section may come before it."""
    found = re.search(r"^## \d+\.\d+\.\d+ — \d{4}-\d\d-\d\d$", changelog, re.MULTILINE)
    if found is None:
        raise PackageError("CHANGELOG.md has no release heading ('## X.Y.Z — YYYY-MM-DD')")
    return found[0]


def twine_check(archives: list[Path]) -> None:
    """What PyPI would refuse (metadata, a long description it cannot render), as
    ``twine upload`` checks it, warnings included."""
    run(sys.executable, "-m", "twine", "--no-color", "check", "--strict", *archives)


def check_sdist(sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    wanted = [*SDIST_FILES, *(f"django_kvcache/{name}" for name in PACKAGE_FILES)]
    require(names, wanted, sdist)


def install_and_import(archive: Path, workdir: Path) -> None:
    venv = workdir / f"venv-{archive.name}"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    extra, backend = EXTRAS[archive.name.rsplit(".", 1)[-1]]
    run(python, "-m", "pip", "install", "-q", f"django-kvcache[{extra}] @ {archive.as_uri()}")
    run(python, "-c", INSTALLED_CHECK, backend, cwd=workdir)


def main() -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvcache-package-") as temp:
        workdir = Path(temp)
        try:
            source = source_tree(workdir)
            sdist, wheel = build(source, workdir / "dist")
            check_sdist(sdist)
            check_wheel(wheel, source)
            twine_check([sdist, wheel])
            for archive in (wheel, sdist):
                install_and_import(archive, workdir)
        except PackageError as exc:
            print(f"check_package: FAILED: {exc}", file=sys.stderr)
            return 1
    print(f"check_package: {sdist.name} and {wheel.name} OK in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
