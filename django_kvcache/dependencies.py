"""The third-party packages each backend needs, and the error that says how to get them.

Each backend has an extra that brings what it needs (``pip install
'django-kvcache[mysql]'``: mysqlclient; ``[memcached]``: mmh3; both: zstandard). A
module of one backend is only imported when a configured cache needs it, so a site with
one extra never imports the other backend's packages; and a package that is missing
stops the start-up with :class:`MissingDependency`, which names the extra and the
package instead of a bare ``No module named ...``.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from django.core.exceptions import ImproperlyConfigured

#: What to ``pip install`` for each module a backend imports.
PACKAGES = {"MySQLdb": "mysqlclient", "mmh3": "mmh3"}


class MissingDependency(ImproperlyConfigured, ImportError):
    """A package a configured cache needs is not installed.

    An ``ImportError``, so that Django's ``caches[alias]`` reports it as
    ``InvalidCacheBackendError: Could not find backend '...': <this message>``; an
    ``ImproperlyConfigured``, so that the management commands print it as one line."""


def install_hint(extra: str, module: str) -> str:
    package = PACKAGES.get(module, module)
    return f"pip install 'django-kvcache[{extra}]' (or pip install {package})"


def require(module: str, needed_by: str, extra: str) -> ModuleType:
    """``module`` imported, or :class:`MissingDependency` saying which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = PACKAGES.get(module, module)
        if isinstance(exc, ModuleNotFoundError) and exc.name == module:
            state = "which is not installed here"
        else:  # installed, but broken (a shared library missing, say)
            state = f"which cannot be imported here ({exc})"
        raise MissingDependency(
            f"{needed_by} needs the {package} package, {state}: {install_hint(extra, module)}."
        ) from exc
