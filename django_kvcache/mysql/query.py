"""One statement and what the cache reads from its reply, as plain values.

A :class:`Query` is what a plan sends; a :data:`Reply` is what either driver makes of
the server's answer, the same on every path (the backend's own connection or Django's
cursor, blocking or asyncio): ``(rows, rowcount, lastrowid, info)``.

* ``rows``: the result set as a tuple of tuples (of dicts by column name for a ``named``
  query), ``None`` for a statement without one;
* ``rowcount``: affected rows (Django connects with CLIENT.FOUND_ROWS: an UPDATE counts
  the rows it matched);
* ``lastrowid``: ``LAST_INSERT_ID()`` as the statement left it;
* ``info``: the server's info line ("Rows matched: 1  Changed: 1  Warnings: 0"), or None.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Sequence

Reply = tuple[Any, int, int, Any]
ROWS, ROWCOUNT, LASTROWID, INFO = range(4)


class Query:
    """``sql`` (``%s`` placeholders) with ``params``; ``read`` turns the reply into the
    statement's answer. ``idempotent=False``: running it twice is not harmless (``add``,
    ``incr``, a delete whose count is its answer), so it is not sent again after a lost
    reply. ``named=True``: each row of the reply is a dict keyed by column name (a
    ``SHOW`` statement, whose columns are known by name only)."""

    __slots__ = ("sql", "params", "read", "idempotent", "named")

    def __init__(
        self,
        sql: str,
        params: Sequence[Any],
        read: Callable[[Reply], Any],
        idempotent: bool = True,
        named: bool = False,
    ) -> None:
        self.sql, self.params, self.read, self.idempotent = sql, params, read, idempotent
        self.named = named

    def __repr__(self) -> str:
        return f"<Query {redacted(self.sql)[:60]!r}>"


#: What a statement's text may carry of the data: hex literals (values up to 512 KiB)
#: and quoted strings. Keys and larger values are parameters, never in the text.
LITERALS = re.compile(r"[Xx]'[0-9A-Fa-f]*'|'(?:[^'\\]|\\.|'')*'")


def redacted(sql: str, limit: int = 200) -> str:
    """``sql`` with every literal left out (``X'…'``, ``'…'``), at most ``limit``
    characters: what a log line may show of a statement (a value may be session data)."""
    shown = LITERALS.sub(lambda found: "X'…'" if found.group()[0] in "Xx" else "'…'", sql)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def rows(reply: Reply) -> Any:
    return reply[ROWS] or ()


def first_row(reply: Reply) -> Any:
    found = reply[ROWS]
    return found[0] if found else None


def rowcount(reply: Reply) -> int:
    return reply[ROWCOUNT]


def lastrowid(reply: Reply) -> int:
    return reply[LASTROWID]


def found(reply: Reply) -> bool:
    return bool(reply[ROWS])


def live_row(now: int, reply: Reply) -> Any:
    """The row of a primary-key read whose last column is ``expires``, without it, if it
    is live at ``now`` (epoch ms); None for a missing or expired one."""
    found = reply[ROWS]
    if found and found[0][-1] > now:
        return found[0][:-1]
    return None


def live_rows(now: int, reply: Reply) -> list[Any]:
    """The rows live at ``now`` of a read whose last column is ``expires``, without it."""
    return [row[:-1] for row in reply[ROWS] or () if row[-1] > now]


def live_expiry(now: int, reply: Reply) -> int | None:
    """``expires`` of a row read alone by its key, if it is live at ``now``."""
    found = reply[ROWS]
    if found and found[0][0] > now:
        return int(found[0][0])
    return None


def update_outcome(reply: Reply) -> tuple[int, int, int]:
    """Rows matched, rows changed and LAST_INSERT_ID of an UPDATE.

    CLIENT.FOUND_ROWS makes ``rowcount`` count matched rows; the changed count is only
    in the info line. No info line at all only when no row matched (seen on an empty
    MyISAM table).
    """
    counts = (reply[INFO] or "").partition("Changed: ")[2].split()
    return reply[ROWCOUNT], int(counts[0]) if counts else 0, reply[LASTROWID]


class PacketLimit(Query):
    """``@@max_allowed_packet`` of the connection the statement runs on. A session keeps
    the limit it started with, so the drivers remember the answer per connection and ask
    the server only once per connection (:mod:`django_kvcache.mysql.server`)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__("SELECT @@max_allowed_packet", (), _first_int)


def _first_int(reply: Reply) -> int:
    return int(reply[ROWS][0][0])


PACKET_LIMIT = PacketLimit()
