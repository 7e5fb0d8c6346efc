"""Which entries of ``CACHES`` are kvcache caches, found without building them.

The app (its ``ready()``, system checks, ``pre_migrate`` receiver and commands) works
over these lists and imports a backend only when ``CACHES`` names it: a site with one
backend's extra never imports the other backend's modules or packages. A backend whose
package is missing raises :class:`~django_kvcache.dependencies.MissingDependency`,
naming the extra to install.
"""
from __future__ import annotations

import sys
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

from django_kvcache.base import KVCache
from django_kvcache.dependencies import MissingDependency

MYSQL_BACKEND_MODULE = "django_kvcache.backends.mysql"


def backend_class(alias: str, importable: bool = False) -> Any:
    """The class ``CACHES[alias]["BACKEND"]`` names; ``None`` when it names nothing
    importable (Django's own check reports that). A kvcache backend whose package is
    missing raises :class:`MissingDependency`, unless ``importable``: then it is
    ``None`` too (for the system checks: Django's cache checks build every cache and
    report it, and the order of checks is not fixed)."""
    try:
        return import_string(settings.CACHES[alias]["BACKEND"])
    except MissingDependency:
        if importable:
            return None
        raise
    except (KeyError, ImportError):
        return None


def loaded_class(module: str, name: str) -> type | None:
    """``module.name`` if that module has been imported, else ``None``: a class of a
    backend that no cache configured has imported cannot be an instance's class."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def is_mysql_cache(alias: str, importable: bool = False) -> bool:
    """Whether ``CACHES[alias]`` is a MySQLCache (or a subclass), without building it."""
    backend = backend_class(alias, importable)
    # Importing such a class imported the MySQL backend: not loaded, not a MySQLCache.
    mysql_cache = loaded_class(MYSQL_BACKEND_MODULE, "MySQLCache")
    return isinstance(backend, type) and mysql_cache is not None and issubclass(backend, mysql_cache)


def mysql_cache_aliases(importable: bool = False) -> list[str]:
    """The aliases of every MySQLCache in ``CACHES``, in settings order."""
    return [alias for alias in settings.CACHES if is_mysql_cache(alias, importable)]


def kvcache_aliases() -> list[str]:
    """The aliases of every kvcache cache (either backend), in settings order."""
    found = []
    for alias in settings.CACHES:
        backend = backend_class(alias)
        if isinstance(backend, type) and issubclass(backend, KVCache):
            found.append(alias)
    return found
