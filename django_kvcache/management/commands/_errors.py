"""What every kvcache command does with a failure: one line naming the cache alias and
the fix, a non-zero exit (``CommandError``), the traceback only with ``--traceback``.

Expected failures — a database or memcached node that cannot be reached, a missing
table, a configuration error, a file that cannot be written — become that line; the
original exception is chained, so ``--traceback`` still shows where it came from.
Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError
from django.db import DatabaseError, OperationalError

from django_kvcache.configured import loaded_class

# Each backend's errors, when that backend is in use: a site with one extra never imports
# the other backend (a class not loaded has no instances to catch).
MYSQL_ERRORS, MEMCACHED_ERRORS = "django_kvcache.mysql.errors", "django_kvcache.memcached"
MYSQL_LAYOUTS = "django_kvcache.mysql.layouts"


def _is(exc: BaseException, module: str, name: str) -> bool:
    cls = loaded_class(module, name)
    return cls is not None and isinstance(exc, cls)


def failure_line(alias: str, cache: Any, exc: BaseException) -> str:
    """``exc`` met while working on the cache ``alias``, as one line saying what to do."""
    if (isinstance(exc, ImproperlyConfigured) or _is(exc, MYSQL_ERRORS, "CacheTableMissing")
            or _is(exc, MYSQL_LAYOUTS, "CacheTableLayout")):
        return f"{alias}: {exc}"  # these say what to fix already
    if isinstance(exc, OperationalError):
        where = " or ".join(f"DATABASES[{name!r}]" for name in _databases(alias, cache))
        code, reason = _database_error(exc)
        return (
            f"{alias}: cannot use its database ({type(exc).__name__} {code}: {reason}). "
            f"Check that the server is running and {where or 'DATABASES'} (HOST, PORT, "
            "NAME, USER, PASSWORD)."
        )
    if isinstance(exc, DatabaseError):
        code, reason = _database_error(exc)
        return f"{alias}: {type(exc).__name__} {code}: {reason}"
    if _is(exc, MEMCACHED_ERRORS, "MemcachedError"):
        return (
            f"{alias}: {exc}. Check that the memcached server is running and the cache's "
            "LOCATION."
        )
    return f"{alias}: {type(exc).__name__}: {exc}"


def _database_error(exc: BaseException) -> tuple[Any, str]:
    """(error code, message) of a driver error, the message on one line."""
    args = exc.args
    if len(args) >= 2 and isinstance(args[0], int):
        return args[0], " ".join(str(args[1]).split())
    return "", " ".join(str(exc).split())


def _databases(alias: str, cache: Any) -> list[str]:
    """The database aliases of the cache ``alias`` (none known: an empty list)."""
    if cache is None:
        try:
            cache = caches[alias]
        except Exception:  # not a cache alias, or one that cannot be built
            return []
    return list(getattr(cache, "database_aliases", list)())


def expected(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure a command reports as one line."""
    return isinstance(exc, (DatabaseError, ImproperlyConfigured, OSError)) or _is(
        exc, MEMCACHED_ERRORS, "MemcachedError"
    )


@contextlib.contextmanager
def failing(alias: str, cache: Any = None) -> Iterator[None]:
    """Around the work on one cache: an expected failure becomes ``CommandError``."""
    try:
        yield
    except Exception as exc:
        if not expected(exc):
            raise
        raise CommandError(failure_line(alias, cache, exc)) from exc
