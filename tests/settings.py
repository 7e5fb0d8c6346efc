"""Settings for the test suite: real servers, from the env vars `scripts/services.py up` prints.

The defaults match the script's defaults, so `pytest` works right after `services.py up`.
Point the tests at your own servers by setting the KVCACHE_* variables.
"""
import importlib.util
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
# The twemproxy (nutcracker) `services.py up` starts, and the memcached servers behind it
# (emptied directly between tests: twemproxy forwards no flush_all). Empty: none.
TWEMPROXY = os.environ.get("KVCACHE_TWEMPROXY", "127.0.0.1:21300").strip()
TWEMPROXY_SERVERS = [
    node
    for node in os.environ.get(
        "KVCACHE_TWEMPROXY_SERVERS", "127.0.0.1:21301,127.0.0.1:21302,127.0.0.1:21303"
    ).split(",")
    if node
]
# The Redis `services.py up` starts for the benchmark's RedisCache peer ("host:port"; empty: none).
REDIS = os.environ.get("KVCACHE_REDIS", "127.0.0.1:21379").strip()

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
# shard2's replica for the REPLICAS and READ_YOUR_WRITES tests: the real replica
# `services.py up` starts (binlog + GTID, a server of its own, which tests may delay or stop;
# see tests/servers.py), whose test database arrives by replication. Without one
# (KVCACHE_MYSQL_REPLICA_PORT empty) a second connection to shard2's test database stands
# in: it shows where reads are routed, never lag.
MYSQL_REPLICA_PORT = os.environ.get("KVCACHE_MYSQL_REPLICA_PORT", "23309").strip()
if "shard2" in DATABASES:
    DATABASES["shard2_replica"] = {
        **DATABASES["shard2"],
        **({"PORT": MYSQL_REPLICA_PORT} if MYSQL_REPLICA_PORT else {}),
        "TEST": {"MIRROR": "shard2"},
    }
SHARD_ALIASES = [alias for alias in DATABASES if alias.startswith("shard") and "_" not in alias]
# A Galera cluster, when `services.py galera up` runs one (KVCACHE_GALERA, the nodes'
# host:port): an alias per node. The test database is created through the first node and
# reaches the others by replication.
GALERA_NODES = [node for node in os.environ.get("KVCACHE_GALERA", "").split(",") if node.strip()]
for number, node in enumerate(GALERA_NODES, start=1):
    host, port = node.strip().rsplit(":", 1)
    DATABASES[f"galera{number}"] = {
        "ENGINE": "django.db.backends.mysql",
        "NAME": MYSQL_DATABASE,
        **MYSQL,
        "HOST": host,
        "PORT": port,
        "OPTIONS": {"charset": "utf8mb4"},
        # No dependency on "default": the Galera tests need no other server.
        "TEST": {"NAME": TEST_DATABASE, "CHARSET": "utf8mb4", "DEPENDENCIES": []}
        if number == 1 else {"MIRROR": "galera1"},
    }
GALERA_ALIASES = [f"galera{number}" for number in range(1, len(GALERA_NODES) + 1)]
if importlib.util.find_spec("MySQLdb") is None:
    # The memcached extra alone (tox's py311-extra-memcached): no MySQL driver, so no
    # MySQL database; the memcached tests that store models need a database all the same.
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    SHARD_ALIASES, GALERA_ALIASES = [], []
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
ROOT_URLCONF = "tests.urls"
MIDDLEWARE = []
LOGGING_CONFIG = None
STATIC_URL = "/static/"
