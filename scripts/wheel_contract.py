#!/usr/bin/env python3
"""Django's cache contract on both backends, run against the installed wheel.

    python scripts/wheel_contract.py   # run by tox's py311-wheel

tox builds the wheel (``package = wheel``) and installs it, with the ``mysql`` and
``memcached`` extras, into a fresh venv. This script checks that ``django_kvcache`` and
``kvcache_bench`` are imported from that venv's site-packages and are the checkout's
version, then runs each backend's contract tests from a copy of the tests, outside the
checkout (``scripts/extra_site.py``'s ``run_contract``), where the checkout's
``django_kvcache`` cannot be imported: the package under test is the wheel's.

Exits non-zero, saying what is wrong, at the first problem. Needs the servers of
``scripts/services.py up`` (its ``KVCACHE_*`` variables).
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

from extra_site import PROJECT, SiteError, run, run_contract, say

#: Run in the copy of the tests, where pytest runs: what ``import django_kvcache`` finds.
INSTALLED = """
import sys, sysconfig
from importlib import metadata
from pathlib import Path
import django_kvcache, kvcache_bench
site = Path(sysconfig.get_paths()["purelib"]).resolve()
for module in (django_kvcache, kvcache_bench):
    where = Path(module.__file__).resolve()
    assert where.is_relative_to(site), f"{module.__name__} imported from {where}, not {site}"
assert metadata.version("django-kvcache") == django_kvcache.__version__ == sys.argv[1], (
    metadata.version("django-kvcache"), django_kvcache.__version__, sys.argv[1])
print("django_kvcache", django_kvcache.__version__, "from", site)
"""


def checkout_version() -> str:
    init = (PROJECT / "django_kvcache" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', init, re.MULTILINE)[1]


def main() -> int:
    started = time.monotonic()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="kvcache-wheel-") as temp:
        try:
            for backend in ("mysql", "memcached"):
                root = Path(temp) / backend
                root.mkdir()
                run_contract(backend, root, env)
                run(sys.executable, "-c", INSTALLED, checkout_version(), cwd=root / "contract",
                    env=env)
        except SiteError as exc:
            print(f"wheel_contract: FAILED: {exc}", file=sys.stderr)
            return 1
    say(f"the contract passed on the installed wheel in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
