"""Settings of the benchmark project: the same servers as the test suite.

The KVCACHE_* variables are the ones ``scripts/services.py up`` prints, with the same
defaults as tests/settings.py, so the benchmark runs right after ``services.py up``.
The caches themselves are not configured here: the command builds each benchmarked
cache with its own table and key prefix (see ``kvcache_bench.caches``).
"""
import atexit
import os
import tempfile
from pathlib import Path

# The servers: the same KVCACHE_* variables and defaults as the test suite, read in one place.
from tests.settings import MEMCACHED_NODES, MYSQL, MYSQL_DATABASE, REDIS  # noqa: F401

# DatabaseCache on SQLite: a file of each run's own, so that runs at the same time on one
# machine never share it; set in the environment, so the processes a run spawns open the
# same file, and removed when the run's process exits (KVCACHE_BENCH_SQLITE: a file of
# yours instead, left in place).
_OWN_SQLITE = "KVCACHE_BENCH_SQLITE" not in os.environ
SQLITE_PATH = os.environ.setdefault(
    "KVCACHE_BENCH_SQLITE",
    os.path.join(tempfile.gettempdir(), f"kvcache-benchmark-{os.getpid()}.sqlite3"),
)


def _remove_sqlite() -> None:
    for end in ("", "-journal", "-wal", "-shm"):
        Path(SQLITE_PATH + end).unlink(missing_ok=True)


if _OWN_SQLITE:
    atexit.register(_remove_sqlite)

#: The project's benchmark: every cache kvcache_bench knows, on the servers services.py starts
#: (a site that installs kvcache_bench measures its own CACHES instead).
KVCACHE_BENCH_PROJECT = True

SECRET_KEY = "django-kvcache-benchmark"
USE_TZ = True
INSTALLED_APPS = [
    "django_kvcache",
    "kvcache_bench",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": MYSQL_DATABASE,
        **MYSQL,
        "OPTIONS": {"charset": "utf8mb4"},
    },
    "sqlite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": SQLITE_PATH,
        # Concurrent writers wait for the lock instead of failing at once.
        "OPTIONS": {"timeout": 30},
    },
}
# DatabaseCache finds its database through the routers; this one sends the SQLite
# cache's table to the "sqlite" alias.
DATABASE_ROUTERS = ["kvcache_bench.routers.CacheTableRouter"]
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"},
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
LOGGING_CONFIG = None
