"""Settings of the benchmark project: the same servers as the test suite.

The KVCACHE_* variables are the ones ``scripts/services.py up`` prints, with the same
defaults as tests/settings.py, so the benchmark runs right after ``services.py up``.
The caches themselves are not configured here: the command builds each benchmarked
cache with its own table and key prefix (see ``kvcache_bench.caches``).
"""
import os
import tempfile

# The servers: the same KVCACHE_* variables and defaults as the test suite, read in one place.
from tests.settings import MEMCACHED_NODES, MYSQL, MYSQL_DATABASE  # noqa: F401

SQLITE_PATH = os.environ.get(
    "KVCACHE_BENCH_SQLITE", os.path.join(tempfile.gettempdir(), "kvcache-benchmark.sqlite3")
)

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
