"""Checking MySQLCache's LOCATION and OPTIONS, and the model stand-in for routers."""
from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured

DEFAULT_CULL_PROBABILITY = 0.01


def check_table(location: Any) -> str:
    # Django's MySQL quote_name does not escape backticks, so they are refused here.
    if not isinstance(location, str) or not 0 < len(location) <= 64 or "`" in location:
        raise ImproperlyConfigured(
            "MySQLCache LOCATION must be a table name of 1 to 64 characters without "
            f"backticks, got {location!r}"
        )
    return location


class _Options:
    """Enough of a model's ``_meta`` for database routers (as Django's DatabaseCache)."""

    app_label = "django_kvcache"
    model_name = "cacheentry"
    object_name = "CacheEntry"
    verbose_name = "cache entry"
    verbose_name_plural = "cache entries"
    abstract = False
    managed = True
    proxy = False
    swapped = False

    def __init__(self, table: str) -> None:
        self.db_table = table


def router_model(table: str) -> type:
    """A class routers can be asked about: ``db_for_read(model)`` / ``db_for_write(model)``."""
    return type("CacheEntry", (), {"_meta": _Options(table)})
