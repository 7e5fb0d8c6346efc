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
        "TEST": {"NAME": "test_kvcache", "CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"},
    },
}
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
ROOT_URLCONF = "tests.urls"
MIDDLEWARE = []
LOGGING_CONFIG = None
