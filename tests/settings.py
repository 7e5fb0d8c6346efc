"""Settings for the test suite: real servers, from the env vars `scripts/services.py up` prints.

The defaults match the script's defaults, so `pytest` works right after `services.py up`.
Point the tests at your own servers by setting the KVCACHE_* variables.
"""
import os

MYSQL = {
    "HOST": os.environ.get("KVCACHE_MYSQL_HOST", "127.0.0.1"),
    "PORT": os.environ.get("KVCACHE_MYSQL_PORT", "23306"),
    "USER": os.environ.get("KVCACHE_MYSQL_USER", "kvcache"),
    "PASSWORD": os.environ.get("KVCACHE_MYSQL_PASSWORD", ""),
}
MYSQL_DATABASE = os.environ.get("KVCACHE_MYSQL_DATABASE", "kvcache")
# One test database per pytest session, so two sessions on one server never drop each
# other's; set in the environment so worker processes the tests start use the same one.
TEST_DATABASE = os.environ.setdefault("KVCACHE_TEST_DATABASE", f"test_kvcache_{os.getpid()}")
# The extra MariaDB servers `services.py up` starts for the shard tests.
MYSQL_SHARD_PORTS = [
    port
    for port in os.environ.get("KVCACHE_MYSQL_SHARD_PORTS", "23307,23308").split(",")
    if port.strip()
]
MEMCACHED_NODES = [
    node
    for node in os.environ.get(
        "KVCACHE_MEMCACHED", "127.0.0.1:21211,127.0.0.1:21212,127.0.0.1:21213,127.0.0.1:21214"
    ).split(",")
    if node
]

SECRET_KEY = "django-kvcache-tests"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_kvcache",
    "tests",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": MYSQL_DATABASE,
        **MYSQL,
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {
            "NAME": TEST_DATABASE,
            "CHARSET": "utf8mb4",
            "COLLATION": "utf8mb4_unicode_ci",
        },
    },
    # A second connection to the same test database, for MySQLCache's OPTIONS["DATABASE"]:
    # its writes commit on their own, outside the transactions of "default".
    "cache": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": MYSQL_DATABASE,
        **MYSQL,
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {"MIRROR": "default"},
    },
    # Three shards for OPTIONS["DATABASES"]: one on the main server (its own connection to
    # the test database, as "cache"), one on each extra server (with its own test database).
    "shard1": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": MYSQL_DATABASE,
        **MYSQL,
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {"MIRROR": "default"},
    },
    **{
        f"shard{number}": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": MYSQL_DATABASE,
            **MYSQL,
            "PORT": port,
            "OPTIONS": {"charset": "utf8mb4"},
            "TEST": {"NAME": TEST_DATABASE, "CHARSET": "utf8mb4"},
        }
        for number, port in enumerate(MYSQL_SHARD_PORTS, start=2)
    },
}
# A "replica" of shard2 for the read-your-writes tests: a second connection to shard2's
# test database (a real replica would lag; this one proves where reads are routed).
if "shard2" in DATABASES:
    DATABASES["shard2_replica"] = {**DATABASES["shard2"], "TEST": {"MIRROR": "shard2"}}
SHARD_ALIASES = [alias for alias in DATABASES if alias.startswith("shard") and "_" not in alias]
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
ROOT_URLCONF = "tests.urls"
MIDDLEWARE = []
LOGGING_CONFIG = None
