"""Whose table is it: a MySQLCache's LOCATION that names a table of another layout.

A site moving from django-mysql or Django's DatabaseCache may keep its LOCATION, and the
table of that name is theirs; every statement then fails with ``Unknown column 'flags'``
(1054). The system check (``kvcache.E002``), ``kvcache_createtable`` and every cache call
say instead which table it is, whose layout it looks like and what to do.

A call learns it from the error: the failure policy raises :class:`OtherLayout` (which
alias, which shard), and the plan's step reads the table's columns on the same driver
(never a blocking query on an event loop) at most once a minute per table, then raises
:class:`CacheTableLayout` with the description (:meth:`django_kvcache.mysql.plans.On.run`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db import ProgrammingError

#: The columns of a django-kvcache table, in order.
COLUMNS = ("cache_key", "value", "flags", "expires")
#: MySQL's "Unknown column": a statement met a table of another layout.
UNKNOWN_COLUMN = 1054
#: What to do, whoever's table it is (``{alias}``: the cache's aliases, space-separated).
FIX = (
    "Give the cache a table of its own: another LOCATION, then 'manage.py "
    "kvcache_createtable {alias}' (entries are not carried over: docs/mysql.rst, "
    "\"Coming from DatabaseCache or django-mysql\")."
)
COLUMNS_QUERY = (
    "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
    "AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION"
)


class CacheTableLayout(ProgrammingError):
    """A MySQLCache's table has another layout; the message names it and the fix.

    The server's error (1054) is chained as ``__cause__``."""


class OtherLayout(ProgrammingError):
    """A statement met a table of another layout on ``alias`` (of ``shard``): the plan's
    step describes it (:class:`CacheTableLayout`). The server's error is ``__cause__``."""

    def __init__(self, alias: str, shard: Any) -> None:
        super().__init__(f"The cache table in database {alias!r} has another layout")
        self.alias, self.shard = alias, shard


def column_names(reply: Any) -> list[str]:
    """The column names a :data:`COLUMNS_QUERY` found, in order."""
    return [row[0] for row in reply[0] or ()]


@dataclass(frozen=True)
class Layout:
    owner: str
    columns: frozenset[str]


#: The tables a django-kvcache LOCATION is known to meet, by the columns that tell them.
KNOWN = (
    Layout("django-mysql's MySQLCache table", frozenset({"cache_key", "value", "value_type",
                                                         "expires"})),
    Layout("Django's DatabaseCache table", frozenset({"cache_key", "value", "expires"})),
)


def whose(columns: list[str]) -> str | None:
    """``None`` for a django-kvcache table; else what the table looks like, naming its
    columns (``"django-mysql's MySQLCache table (columns cache_key, ...)"``)."""
    if set(COLUMNS) <= set(columns):
        return None
    listed = f"columns {', '.join(columns)}"
    for layout in KNOWN:
        if set(columns) == layout.columns:
            return f"{layout.owner} ({listed})"
    if "cache_key" in columns:
        return f"a cache table of another layout ({listed})"
    return f"not a cache table ({listed})"


def describe(
    table: str, owner: str, database: str, columns: list[str] | None, aliases: str,
    error: BaseException | None = None,
) -> tuple[str, str] | None:
    """What is wrong with ``table`` of ``owner`` in ``database``, and the fix; ``None`` if
    it is ours. ``columns`` unknown (they could not be read): the server's ``error``."""
    if columns is None:
        looks_like = f"not a django-kvcache table ({error})"
    else:
        looks_like = whose(columns)
        if looks_like is None:
            return None
        looks_like += f", not a django-kvcache table (columns {', '.join(COLUMNS)})"
    found = f"The table {table!r} of {owner} in database {database!r} is {looks_like}."
    return found, FIX.format(alias=aliases)


#: Seconds a table's columns, read after a 1054, are remembered: a misconfigured cache
#: fails every call, and each must not open a connection to ask again.
REMEMBER = 60.0
#: What :func:`remembered` answers for a table whose columns were not read lately.
UNKNOWN: Any = object()
_read: dict[tuple[str, str], tuple[float, list[str] | None]] = {}
_lock = threading.Lock()


def remembered(database: str, table: str) -> Any:
    """The columns of ``table`` in ``database`` read less than REMEMBER seconds ago
    (``None``: they could not be read), else :data:`UNKNOWN`."""
    with _lock:
        read = _read.get((database, table))
    if read is not None and time.monotonic() - read[0] < REMEMBER:
        return read[1]
    return UNKNOWN


def remember(database: str, table: str, columns: list[str] | None) -> None:
    with _lock:
        _read[(database, table)] = (time.monotonic(), columns)
