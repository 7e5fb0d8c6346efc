"""Instructions a single-key ``get`` costs the client process, counted by callgrind.

    .venv/bin/python scripts/callgrind_get.py HOST:PORT [ours|bare|django ...]

Each client makes N gets of one 64-byte value in a process run under ``valgrind
--tool=callgrind``, and none in another: the difference over N is one get's instructions,
whatever else the machine runs (docs/benchmarks.rst). ``ours``: MemcachedCache.get;
``bare``: pymemcache's ``Client.get``; ``django``: Django's ``PyMemcacheCache.get``.
Needs valgrind and Django settings (it uses the tests' own).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

CALLS = 2000


def child(location: str, client: str, calls: int) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    value = b"x" * 64
    if client == "bare":
        from pymemcache.client.base import Client

        host, port = location.rsplit(":", 1)
        cache: object = Client((host, int(port)))
        key = ":1:k"
    else:
        if client == "ours":
            from django_kvcache.backends.memcached import MemcachedCache as Backend
        else:
            from django.core.cache.backends.memcached import PyMemcacheCache as Backend
        cache, key = Backend(location, {}), "k"
    cache.set(key, value)  # type: ignore[attr-defined]
    get = cache.get  # type: ignore[attr-defined]
    get(key), get(key)  # connected, warm
    for _ in range(calls):
        get(key)


def instructions(location: str, client: str, calls: int) -> int:
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         __file__, "--child", location, client, str(calls)],
        capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    return int(re.search(r"refs:\s*([\d,]+)", run.stderr)[1].replace(",", ""))


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], int(argv[3]))
        return
    location, clients = argv[0], argv[1:] or ["ours", "bare", "django"]
    for client in clients:
        per_get = (instructions(location, client, CALLS) - instructions(location, client, 0))
        print(f"{client}: {per_get // CALLS} instructions a get")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
