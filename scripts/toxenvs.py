#!/usr/bin/env python3
"""Print the tox environments whose Python interpreter this machine has.

    python3 scripts/toxenvs.py default   # py311-dj42,py311-dj52,py311-nozstd,py311-extra-*,
                                         # py311-wheel,py312-dj61
    python3 scripts/toxenvs.py all       # Python 3.10-3.13 x Django 4.2/5.2/6.0/6.1

Interpreters are looked up as ``pythonX.Y`` on PATH and, failing that, in pyenv's
versions folder (pyenv's shims answer only for the active version). Each one found is
linked into ``.runtime/pythons/`` so tox finds it once that folder is on PATH. Missing
interpreters are reported on stderr; the exit status is 1 if no environment can run.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

LINK_DIR = Path(__file__).resolve().parent.parent / ".runtime" / "pythons"

# "nozstd": the codec and backend round-trip tests in a virtualenv without zstd; "extra-X":
# the package with one extra (or none) in a fresh venv and a startproject site; "wheel":
# the contract on the installed wheel (tox.ini).
EXTRAS = [("3.11", "extra-mysql"), ("3.11", "extra-memcached"), ("3.11", "extra-none"),
          ("3.11", "wheel")]
DEFAULT = [("3.11", "dj42"), ("3.11", "dj52"), ("3.12", "dj61"), ("3.11", "nozstd"), *EXTRAS]
# Django's supported Pythons: 4.2 -> 3.8-3.12, 5.2 -> 3.10-3.14, 6.0 and 6.1 -> 3.12+.
ALL = [
    ("3.10", "dj42"), ("3.10", "dj52"),
    ("3.11", "dj42"), ("3.11", "dj52"),
    ("3.12", "dj42"), ("3.12", "dj52"), ("3.12", "dj60"), ("3.12", "dj61"),
    ("3.13", "dj52"), ("3.13", "dj60"), ("3.13", "dj61"),
    ("3.11", "nozstd"), *EXTRAS,
]


def search_path() -> str:
    """PATH without LINK_DIR: the Makefile puts LINK_DIR first, and an interpreter found
    through a link there would become a link to itself."""
    return os.pathsep.join(
        entry for entry in os.environ.get("PATH", "").split(os.pathsep)
        if entry and Path(entry).resolve() != LINK_DIR.resolve()
    )


def executable(path: str) -> str | None:
    """The interpreter that ``path`` runs (a pyenv shim runs another), if it runs."""
    try:
        result = subprocess.run(
            [path, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
            timeout=30, env={**os.environ, "PATH": search_path()},
        )
    except OSError:
        return None
    found = result.stdout.strip()
    return found if result.returncode == 0 and found else None


def find_interpreter(version: str) -> str | None:
    candidates = [shutil.which(f"python{version}", path=search_path())]
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"))
    return next((found for path in candidates if path and (found := executable(path))), None)


def main() -> int:
    matrix = ALL if sys.argv[1:] == ["all"] else DEFAULT
    LINK_DIR.mkdir(parents=True, exist_ok=True)
    envs = []
    for version in sorted({version for version, _ in matrix}):
        interpreter = find_interpreter(version)
        names = [f"py{version.replace('.', '')}-{django}" for v, django in matrix if v == version]
        if interpreter is None:
            print(f"toxenvs: no python{version} here; skipping {', '.join(names)}", file=sys.stderr)
            continue
        link = LINK_DIR / f"python{version}"
        link.unlink(missing_ok=True)
        link.symlink_to(interpreter)
        envs += names
    if not envs:
        print("toxenvs: none of the required Python versions is installed", file=sys.stderr)
        return 1
    print(",".join(envs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
