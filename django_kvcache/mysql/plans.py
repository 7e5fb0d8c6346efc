"""Each MySQLCache operation written once: which statements go to which shard, and what
their replies make.

A function here returns a step (:class:`On`) — calls on shards, each a
:class:`~django_kvcache.mysql.policy.Call` whose work gives the statements for the
shard's server flavour. The backend's plans (:mod:`django_kvcache.backends.mysql`)
yield these steps; the blocking driver runs them on the process's own connections, the
asyncio driver on the event loop's own, under the one failure policy
(:mod:`~django_kvcache.mysql.policy`). Statement builders are pure: a write-path cull,
say, is a call of its own (:func:`write_path_cull`), never a side effect of a builder.

Statements up to :data:`ALWAYS_FITS` bytes are sent without a look at the connection's
``max_allowed_packet``; larger ones first ask it (once per connection).
"""
from __future__ import annotations

import math
import random
from functools import partial
from typing import Any, Callable, Generator, Mapping, NamedTuple, Sequence

from django.db import DatabaseError

from django_kvcache import steps
from django_kvcache.codec import FLAG_INTEGER, FLAG_LONG, INT64_MAX, INT64_MIN
from django_kvcache.mysql import aio, blocking, budget, culling, layouts
from django_kvcache.mysql.cluster import ANY_KEY, Session
from django_kvcache.mysql.errors import error_code
from django_kvcache.mysql.keys import MAX_KEY_LENGTH
from django_kvcache.mysql.policy import EVERYTHING, RAISE, Access, Call
from django_kvcache.mysql.query import (
    PACKET_LIMIT,
    Query,
    Reply,
    first_row,
    lastrowid,
    live_expiry,
    live_row,
    live_rows,
    rowcount,
    rows,
    update_outcome,
)
from django_kvcache.mysql.server import statement_budget
from django_kvcache.mysql.shards import Shard
from django_kvcache.mysql.sql import HEX_LIMIT, Statements, now_ms, value_sql

#: Escaped size of the largest stored key (250 four-byte characters, every byte escaped).
KEY_BYTES = MAX_KEY_LENGTH * 4 * 2 + 8
#: Statements up to this size are sent without looking at the connection's
#: ``max_allowed_packet`` (MariaDB's default is 16 MiB, MySQL's 64 MiB).
ALWAYS_FITS = 512 * 1024
#: The bytes the client library escapes with a backslash inside a string literal.
ESCAPED_BYTES = tuple(bytes([byte]) for byte in b"\0\n\r\\'\"\x1a")
#: Rows one DELETE of clear() or delete_with_prefix() deletes at most.
DELETE_BATCH_ROWS = 10_000
#: MySQL error codes for a value that is not decimal text in an integer-flagged row.
BAD_NUMBER = frozenset({1292, 1366})
#: "BIGINT value is out of range": an increment past the signed 64-bit range.
OUT_OF_RANGE = 1690
INTEGER_FLAGS = (FLAG_INTEGER, FLAG_LONG)


class On:
    """A step of a plan: calls on shards, answered in order (one answer for a single
    call), by the blocking driver (``run``) or the asyncio one (``arun``).

    A call that met a table of another layout is told apart here, on the same driver:
    the table's columns are read (:func:`table_columns`), and the error says whose table
    it looks like (``layouts.CacheTableLayout``)."""

    __slots__ = ("session", "calls", "single")

    def __init__(self, session: Session, calls: Sequence[Call], single: bool = True) -> None:
        self.session, self.calls, self.single = session, calls, single

    def run(self) -> Any:
        try:
            answers = blocking.execute(self.session, self.calls)
        except layouts.OtherLayout as met:
            raise steps.run(self._described(met)) from met.__cause__
        return answers[0] if self.single else answers

    async def arun(self) -> Any:
        try:
            answers = await aio.execute(self.session, self.calls)
        except layouts.OtherLayout as met:
            raise await steps.arun(self._described(met)) from met.__cause__
        return answers[0] if self.single else answers

    def _described(self, met: layouts.OtherLayout) -> steps.Plan:
        columns = yield from table_columns(self.session, met.shard, met.alias)
        describe = self.session.describe_table_layout
        assert describe is not None
        return layouts.CacheTableLayout(describe(met.alias, columns, met.__cause__))


def one(session: Session, call: Call) -> On:
    return On(session, (call,))


def each(session: Session, calls: list[Call]) -> On:
    return On(session, calls, single=False)


class TooLarge(NamedTuple):
    """A row no statement on this connection can carry: nothing stored, the older value
    deleted."""

    size: int  # bytes the row takes in a statement
    budget: int  # bytes a statement may carry


def row_size(data: bytes) -> int:
    """Statement bytes one row takes: a hex literal's for values up to HEX_LIMIT, exact
    escaping for larger ones (``value_sql``)."""
    if len(data) <= HEX_LIMIT:
        return KEY_BYTES + 2 * len(data) + 3
    return KEY_BYTES + len(data) + sum(data.count(byte) for byte in ESCAPED_BYTES)


def keys_fit(keys: Sequence[str]) -> bool:
    return len(keys) * KEY_BYTES <= ALWAYS_FITS


def key_chunks(keys: list[str]) -> Generator[Query, Any, list[list[str]]]:
    """``keys`` in as few statements as ``max_allowed_packet`` allows (usually one)."""
    if keys_fit(keys):
        return [keys]
    per_statement = statement_budget((yield PACKET_LIMIT)) // KEY_BYTES
    return [keys[start : start + per_statement] for start in range(0, len(keys), per_statement)]


# --- reading --------------------------------------------------------------------------------


def get(session: Session, key: str) -> On:
    """The row of ``key``: ``(value, flags)`` or None."""
    return one(session, Call(
        session.cluster.shard_for(key), Access.READ,
        lambda sql: Query(sql.get, (key,), partial(live_row, now_ms())), None, keys=(key,),
    ))


def has_key(session: Session, key: str) -> On:
    return one(session, Call(
        session.cluster.shard_for(key), Access.READ,
        lambda sql: Query(sql.has_key, (key,), partial(is_live, now_ms())), False, keys=(key,),
    ))


def get_many(session: Session, keys: list[str]) -> On:
    """Each shard's ``(key, value, flags)`` rows."""
    return each(session, [
        Call(shard, Access.READ, partial(_select_many, group), (), keys=group)
        for shard, group in session.cluster.by_shard(keys)
    ])


def _select_many(keys: list[str], sql: Statements) -> Any:
    now = now_ms()
    if keys_fit(keys):
        return Query(sql.get_many(len(keys)), keys, partial(live_rows, now))
    return _select_chunks(keys, sql, now)


def _select_chunks(keys: list[str], sql: Statements, now: int) -> Generator[Query, Any, list]:
    found_rows: list[Any] = []
    for chunk in (yield from key_chunks(keys)):
        found_rows += yield Query(sql.get_many(len(chunk)), chunk, partial(live_rows, now))
    return found_rows


def ttl(session: Session, key: str) -> On:
    """``(expires, now)`` of a live ``key``, or None."""

    def work(sql: Statements) -> Generator[Query, Any, Any]:
        now = now_ms()
        expires = yield Query(sql.ttl, (key,), partial(live_expiry, now))
        return None if expires is None else (expires, now)

    return one(session, Call(session.cluster.shard_for(key), Access.READ, work, None,
                             keys=(key,)))


def is_live(now: int, reply: Any) -> bool:
    return live_expiry(now, reply) is not None


# --- writing --------------------------------------------------------------------------------


def set(session: Session, key: str, data: bytes, flags: int, expires: int) -> On:
    """Upsert one row; a :class:`TooLarge` answer when it cannot be sent (the older
    value deleted)."""
    return one(session, Call(
        session.cluster.shard_for(key), Access.WRITE,
        partial(_set_row, key, data, flags, expires), None, missed=(key,), keys=(key,),
    ))


def _set_row(key: str, data: bytes, flags: int, expires: int, sql: Statements) -> Any:
    if row_size(data) > ALWAYS_FITS:
        return _set_large_row(key, data, flags, expires, sql)
    value, blob = value_sql(data)
    return Query(sql.set_row(value), (key, *blob, flags, expires), _nothing)


def _set_large_row(
    key: str, data: bytes, flags: int, expires: int, sql: Statements
) -> Generator[Query, Any, TooLarge | None]:
    too_large = yield from _too_large(data)
    if too_large is not None:
        yield Query(sql.delete, (key,), rowcount)  # never leave an older value
        return too_large
    value, blob = value_sql(data)
    yield Query(sql.set_row(value), (key, *blob, flags, expires), rowcount)
    return None


def _too_large(data: bytes) -> Generator[Query, Any, TooLarge | None]:
    size = row_size(data)
    if size <= ALWAYS_FITS:
        return None
    budget = statement_budget((yield PACKET_LIMIT))
    return TooLarge(size, budget) if size > budget else None


def _nothing(reply: Any) -> None:
    return None


def add(session: Session, key: str, data: bytes, flags: int, expires: int) -> On:
    """Insert one row unless a live one is there: whether it was added, or TooLarge."""

    def work(sql: Statements) -> Generator[Query, Any, Any]:
        too_large = yield from _too_large(data)
        if too_large is not None:
            return too_large
        now = now_ms()
        value, blob = value_sql(data)
        params = (key, *blob, flags, expires, now, now, now)
        # A live row reports its expiry through LAST_INSERT_ID: 0 only when added.
        return (yield Query(sql.add_row(value), params, lastrowid, idempotent=False)) == 0

    return one(session, Call(session.cluster.shard_for(key), Access.WRITE, work, False,
                             keys=(key,)))


def live_on_primary(session: Session, key: str) -> On:
    """Whether a live entry is there, asked where writes go (``add`` with a timeout that
    stores nothing); an unreachable shard (IGNORE_EXCEPTIONS) answers "yes": not added."""
    return one(session, Call(
        session.cluster.shard_for(key), Access.WRITE,
        lambda sql: Query(sql.has_key, (key,), partial(is_live, now_ms())), True, keys=(key,),
    ))


def delete(session: Session, key: str, drop_stale: bool) -> On:
    """Whether a live entry was deleted; with ``drop_stale``, an expired row kept for
    STALE_TIMEOUT goes too."""
    return one(session, Call(
        session.cluster.shard_for(key), Access.WRITE, partial(_delete_live, key, drop_stale),
        False, missed=(key,), keys=(key,),
    ))


def _delete_live(key: str, drop_stale: bool, sql: Statements) -> Any:
    # Not sent again after a lost reply: the row may be gone by our own hand, and a rerun
    # would answer False for a delete that happened.
    now = now_ms()
    deleting = Query(sql.delete_live, (key, now), rowcount, idempotent=False)
    if not drop_stale:
        return _deleted(deleting)
    return _delete_live_and_stale(deleting, key, now, sql)


def _deleted(query: Query) -> Query:
    return Query(query.sql, query.params, lambda reply: rowcount(reply) > 0, False)


def _delete_live_and_stale(
    deleting: Query, key: str, now: int, sql: Statements
) -> Generator[Query, Any, bool]:
    deleted = (yield deleting) > 0
    if not deleted:  # never served stale after a delete; a concurrent set stays
        yield Query(sql.delete_expired_key, (key, now), rowcount)
    return deleted


def delete_row(session: Session, key: str) -> On:
    """Delete ``key``'s row whatever it holds (a set that expires at once)."""
    return one(session, Call(
        session.cluster.shard_for(key), Access.WRITE,
        lambda sql: Query(sql.delete, (key,), rowcount), None, missed=(key,), keys=(key,),
    ))


def touch(session: Session, key: str, expires: int) -> On:
    return one(session, Call(
        session.cluster.shard_for(key), Access.WRITE,
        lambda sql: Query(sql.touch, (expires, key, now_ms()), lambda r: rowcount(r) > 0),
        False, keys=(key,),
    ))


class NotReached(list):
    """set_many's answer for a shard IGNORE_EXCEPTIONS did not reach: its keys."""


def set_many(
    session: Session, rows_by_key: dict[str, tuple[bytes, int]], expires: int
) -> On:
    """Each shard's upserts; per shard ``(stored key, TooLarge)`` of the rows too large
    for a statement (their older values deleted), or :class:`NotReached`."""
    return each(session, [
        Call(shard, Access.WRITE, partial(_upsert_rows, group, rows_by_key, expires),
             NotReached(group), missed=group, keys=group)
        for shard, group in session.cluster.by_shard(list(rows_by_key))
    ])


def _upsert_rows(
    keys: list[str], rows_by_key: dict[str, tuple[bytes, int]], expires: int, sql: Statements
) -> Any:
    sizes = [row_size(rows_by_key[key][0]) for key in keys]
    if sum(sizes) <= ALWAYS_FITS:  # the usual batch: one statement, nothing too large
        return _upsert(sql, keys, rows_by_key, expires, lambda reply: [])
    return _upsert_in_statements(keys, sizes, rows_by_key, expires, sql)


def _upsert(
    sql: Statements, keys: list[str], rows_by_key: dict[str, tuple[bytes, int]], expires: int,
    read: Any = rowcount,
) -> Query:
    values: list[str] = []
    params: list[Any] = []
    for key in keys:
        data, flags = rows_by_key[key]
        value, blob = value_sql(data)
        values.append(value)
        params += (key, *blob, flags, expires)
    return Query(sql.set_many(values), params, read)


def _upsert_in_statements(
    keys: list[str], sizes: list[int], rows_by_key: dict[str, tuple[bytes, int]],
    expires: int, sql: Statements,
) -> Generator[Query, Any, list[tuple[str, TooLarge]]]:
    """Rows in as few statements as ``max_allowed_packet`` allows; the ones too large
    for any are deleted instead and answered with their sizes."""
    budget = statement_budget((yield PACKET_LIMIT))
    too_large: list[tuple[str, TooLarge]] = []
    batch: list[str] = []
    size = 0
    for key, size_of_row in zip(keys, sizes):
        if size_of_row > budget:
            too_large.append((key, TooLarge(size_of_row, budget)))
            continue
        if batch and size + size_of_row > budget:
            yield _upsert(sql, batch, rows_by_key, expires)
            batch, size = [], 0
        batch.append(key)
        size += size_of_row
    if batch:
        yield _upsert(sql, batch, rows_by_key, expires)
    if too_large:  # an older value must not outlive a failed write
        yield Query(sql.delete_keys(len(too_large)), [key for key, _ in too_large], rowcount)
    return too_large


def delete_many(session: Session, keys: list[str]) -> On:
    return each(session, [
        Call(shard, Access.WRITE, partial(_delete_keys, group), None, missed=group, keys=group)
        for shard, group in session.cluster.by_shard(keys)
    ])


def _delete_keys(keys: list[str], sql: Statements) -> Any:
    if keys_fit(keys):
        return Query(sql.delete_keys(len(keys)), keys, rowcount)
    return _delete_key_chunks(keys, sql)


def _delete_key_chunks(keys: list[str], sql: Statements) -> Generator[Query, Any, None]:
    for chunk in (yield from key_chunks(keys)):
        yield Query(sql.delete_keys(len(chunk)), chunk, rowcount)


# --- counters -------------------------------------------------------------------------------


class Refused(NamedTuple):
    """Why an ``incr`` did not apply: ``reason`` is MISSING, NOT_INTEGER (with the row's
    ``data`` and ``flags``), OVERFLOW or CORRUPT (with the server's ``error``)."""

    reason: str
    data: bytes = b""
    flags: int = 0
    error: Exception | None = None


MISSING, NOT_INTEGER, OVERFLOW, CORRUPT = "missing", "not an integer", "overflow", "corrupt"
NOT_FOUND = Refused(MISSING)
#: What the UPDATE of an ``incr`` says when a row it matched was left unchanged (expired,
#: not an integer) or would leave the signed 64-bit range: a second statement says why.
UNEXPLAINED: Any = object()


def incr(session: Session, key: str, delta: int) -> steps.Plan:
    """Add ``delta`` in one UPDATE (the entry keeps its expiry): the new value, or why
    not (:class:`Refused`), asked in a second statement only when the key's row is there
    and was refused. Under IGNORE_EXCEPTIONS an unreachable shard (or a reply lost) is
    answered as a missing key, ``ValueError``, as on memcached: Django's contract has no
    other answer that code built on it (a rate limiter) handles as "start again"."""
    shard, now = session.cluster.shard_for(key), now_ms()
    outcome = UNEXPLAINED  # a delta beyond 2**64 either way overflows every stored value
    if -(2**64) < delta < 2**64:
        try:
            outcome = yield one(session, Call(shard, Access.WRITE, partial(_add, key, delta, now),
                                              NOT_FOUND, keys=(key,)))
        except DatabaseError as exc:
            if error_code(exc) in BAD_NUMBER:
                return Refused(CORRUPT, error=exc)
            if error_code(exc) != OUT_OF_RANGE:
                raise
    if outcome is UNEXPLAINED:
        outcome = yield one(session, Call(shard, Access.PRIMARY_READ,
                                          partial(_why_not, key, delta, now), NOT_FOUND))
    return outcome


def _add(key: str, delta: int, now: int, sql: Statements) -> Query:
    if delta and INT64_MIN <= delta <= INT64_MAX:
        return Query(sql.incr, (now, delta, key), _added, idempotent=False)
    # Outside BIGINT (and 0, whose "Changed: 0" would say nothing): DECIMAL arithmetic,
    # matching the row only when it is live, an integer and the result in range.
    return Query(sql.incr_wide, (delta, key, now, delta), _added_wide, idempotent=False)


def _added(reply: Reply) -> Any:
    matched, changed, value = update_outcome(reply)
    if not matched:  # no row under this key: the usual miss, answered at once
        return NOT_FOUND
    return signed(value) if changed else UNEXPLAINED


def _added_wide(reply: Reply) -> Any:
    return signed(lastrowid(reply)) if rowcount(reply) else UNEXPLAINED


def signed(value: int) -> int:
    """LAST_INSERT_ID is unsigned: negative results come back as 2**64 + value."""
    return value - 2**64 if value > INT64_MAX else value


def _why_not(key: str, delta: int, now: int, sql: Statements) -> Query:
    """Why the UPDATE did not apply to a row (only ever asked after a refused incr)."""
    return Query(sql.incr_failure, (key, now), partial(_refusal, delta))


def _refusal(delta: int, reply: Reply) -> Refused:
    row = first_row(reply)
    if row is None:
        return NOT_FOUND
    flags, data = row
    if flags not in INTEGER_FLAGS:
        return Refused(NOT_INTEGER, bytes(data), flags)
    try:
        in_range = INT64_MIN <= int(data) + delta <= INT64_MAX
    except ValueError:  # not decimal text: corrupt, and a miss like in get()
        in_range = True
    # In range: the key was missing when the UPDATE ran, and was set since.
    return NOT_FOUND if in_range else Refused(OVERFLOW)


# --- every shard ----------------------------------------------------------------------------


def clear(session: Session, pattern: str | None) -> On:
    """Delete this cache's rows (``pattern``: its own keys; None: every row) on every
    shard, in bounded batches. A shard that misses it is flushed when it returns."""
    return each(session, [
        Call(shard, Access.WRITE, partial(_clear, pattern), None, missed=EVERYTHING)
        for shard in session.cluster.shards
    ])


def _clear(pattern: str | None, sql: Statements) -> Generator[Query, Any, None]:
    # DELETE, not TRUNCATE: TRUNCATE commits the caller's open transaction.
    batch = DELETE_BATCH_ROWS
    while True:
        if pattern is None:
            deleted = yield Query(sql.clear_batch, (batch,), rowcount)
        else:
            deleted = yield Query(sql.clear_prefix_batch, (pattern, batch), rowcount)
        if deleted < batch:
            return


def delete_with_prefix(session: Session, pattern: str, drop_stale: bool) -> On:
    """Each shard's count of live entries deleted under ``pattern`` (a LIKE pattern), in
    bounded batches; with ``drop_stale`` the expired rows kept for STALE_TIMEOUT too."""
    return each(session, [
        Call(shard, Access.WRITE, partial(_delete_with_prefix, pattern, drop_stale), 0,
             missed=EVERYTHING, keys=ANY_KEY)
        for shard in session.cluster.shards
    ])


def _delete_with_prefix(
    pattern: str, drop_stale: bool, sql: Statements
) -> Generator[Query, Any, int]:
    now = now_ms()
    batch = DELETE_BATCH_ROWS
    total = 0
    while True:  # the count is the answer: not sent again after a lost reply
        deleted = yield Query(sql.delete_with_prefix, (pattern, now, batch), rowcount, False)
        total += deleted
        if deleted < batch:
            break
    while drop_stale:  # as delete(): a deleted entry is never served stale
        if (yield Query(sql.delete_expired_with_prefix, (pattern, now, batch), rowcount)) < batch:
            break
    return total


def with_prefix(session: Session, pattern: str, entries: bool) -> On:
    """Every shard's live rows under ``pattern``: ``(key,)`` or ``(key, value, flags)``;
    a key the shard still owes (a missed write left its older copy) is left out."""

    def work(shard: Shard, sql: Statements) -> Generator[Query, Any, list[Any]]:
        statement = sql.get_with_prefix if entries else sql.keys_with_prefix
        found = yield Query(statement, (pattern, now_ms()), rows)
        owed = session.cluster.missed(shard).owed([row[0] for row in found])
        if not owed:
            return list(found)
        stale = frozenset(owed)
        return [row for row in found if row[0] not in stale]

    return each(session, [
        Call(shard, Access.READ, partial(work, shard), (), keys=ANY_KEY)
        for shard in session.cluster.shards
    ])


def sample(session: Session, count: int) -> steps.Plan:
    """Up to ``count`` live rows picked at random, as stored: ``(key, value, flags)``, the
    same share from each shard."""
    per_shard = -(-count // len(session.cluster.shards))
    found = yield each(session, [
        Call(shard, Access.READ, lambda sql: Query(sql.sample, (now_ms(), per_shard), rows))
        for shard in session.cluster.shards
    ])
    picked = [(key, bytes(data), flags) for shard_rows in found for key, data, flags in shard_rows]
    random.shuffle(picked)
    return picked[:count]


# --- the tables -----------------------------------------------------------------------------


def table_columns(session: Session, shard: Shard, alias: str) -> steps.Plan:
    """The cache table's columns on ``alias`` (``shard``'s primary or replica), in order
    ([]: no such table; ``None``: they could not be read), read at most once a minute
    per table and alias (``layouts.remembered``), on the plan's own driver."""
    table = session.cluster.table
    columns = layouts.remembered(alias, table)
    if columns is not layouts.UNKNOWN:
        return columns
    # On the alias that met the table: the shard's primary, or its replica.
    there = shard if alias == shard.primary() else Shard(shard.index, alias, None, shard.model)
    read = Call(there, Access.PRIMARY_READ,
                lambda sql: Query(layouts.COLUMNS_QUERY, (table,), layouts.column_names), None)
    try:
        columns = yield one(session, read)
    except DatabaseError:  # the message goes without them
        columns = None
    layouts.remember(alias, table, columns)
    return columns


# --- culling --------------------------------------------------------------------------------


CullPlan = Generator[Query, Any, int]


class Culling(NamedTuple):
    """A cache's culling numbers, as Django's tests may set them on a live cache."""

    max_entries: int | None  # None: no bound on the count (MAX_SIZE alone)
    cull_frequency: int
    stale_ms: int  # expired rows kept this long for get_or_set (STALE_TIMEOUT)
    #: MAX_SIZE's share of each shard (by Shard.index), or ``()`` without a budget.
    max_sizes: tuple[int | None, ...] = ()

    def max_size(self, shard: Shard) -> int | None:
        return self.max_sizes[shard.index] if self.max_sizes else None


def cull(session: Session, numbers: Culling, max_batches: int | None, strict: bool = False) -> On:
    """On every shard: expired rows, then eviction over MAX_ENTRIES and over MAX_SIZE;
    each shard's count. Maintenance: what a shard owes is deleted first, its failure
    never marks it down. ``strict``: a shard's failure is raised even under
    IGNORE_EXCEPTIONS."""

    def work(shard: Shard) -> Callable[[Statements], CullPlan]:
        def on(sql: Statements) -> Generator[Query, Any, int]:
            return (yield from culling.Cull(
                sql, numbers.max_entries or 0, numbers.cull_frequency, max_batches,
                check_limit=numbers.max_entries is not None,
                batch_size=culling.FULL_CULL_BATCH_SIZE, keep_stale_ms=numbers.stale_ms,
                max_size=numbers.max_size(shard), observe=observer(session, shard),
                where=(shard.primary(), session.cluster.table),
            ).run(now_ms()))
        return on

    return each(session, [
        Call(shard, Access.MAINTENANCE, work(shard), RAISE if strict else 0, keys=ANY_KEY,
             owed_budget=max_batches)
        for shard in session.cluster.shards
    ])


def write_path_cull(
    session: Session, rows: Mapping[str, bytes], numbers: Culling, probability: float
) -> On | None:
    """Before writing ``rows`` (stored key -> stored value), a small cull on
    the side of each shard written to that draws one: with ``probability``, and with
    MAX_SIZE as often as :func:`budget.draw` says for the bytes it is sent. Rows locked
    by concurrent writers (or any failure) skip it, logged; the next cull or
    ``kvcache_cull`` gets them. None when no shard draws one."""
    if not probability and not numbers.max_sizes:
        return None
    works = []
    for shard, keys in session.cluster.by_shard(list(rows)):
        culls = bool(probability) and random.random() < probability
        max_size = numbers.max_size(shard)
        incoming = 0 if max_size is None else sum(budget.row_bytes_of(key, rows[key])
                                                  for key in keys)
        checks = max_size is not None and budget.draw(incoming, max_size, random.random())
        if culls or checks:
            works.append((shard, dict(
                check_limit=culls and numbers.max_entries is not None
                and culling.draw_limit_check(numbers.max_entries, random.random()),
                max_size=max_size if checks else None, incoming=incoming,
                delete_expired=culls,
            )))
    if not works:
        return None

    def work(shard: Shard, choices: dict[str, Any]) -> Callable[[Statements], CullPlan]:
        def on(sql: Statements) -> Generator[Query, Any, int]:
            return (yield from culling.Cull(
                sql, numbers.max_entries or 0, numbers.cull_frequency,
                max_batches=culling.WRITE_PATH_BATCHES, keep_stale_ms=numbers.stale_ms,
                observe=observer(session, shard),
                where=(shard.primary(), session.cluster.table), **choices,
            ).run(now_ms()))
        return on

    return each(session, [
        Call(shard, Access.MAINTENANCE, work(shard, choices), 0, quiet=True)
        for shard, choices in works
    ])


def observer(session: Session, shard: Shard) -> budget.Observer:
    """Keeps what a budget check read in the shard's process-wide figures."""
    def observe(held: budget.Estimate) -> None:
        stats = session.cluster.stats(shard.primary())
        stats.stored_bytes, stats.stored_entries = held.bytes, held.entries
        stats.stored_estimated = int(not held.exact)
    return observe


# --- herd protection ------------------------------------------------------------------------


def lease(session: Session, key: str, write: bool, work: Any, fallback: Any) -> On:
    """``work(statements)`` on the primary of the shard that owns ``key`` (an entry's
    stored key: its lease row lives beside it); reads there too, without counting as a
    write (:mod:`django_kvcache.mysql.lease`)."""
    access = Access.WRITE if write else Access.PRIMARY_READ
    return one(session, Call(session.cluster.shard_for(key), access, work, fallback,
                             keys=(key,)))


# --- locks ----------------------------------------------------------------------------------


def lock(session: Session, key: str, work: Any) -> On:
    """``work(statements)`` on the primary of the shard that owns lock name ``key`` (a
    stored key), never a replica; an unreachable server raises even under
    IGNORE_EXCEPTIONS: no answer about a lock is right then (:mod:`~.locks`)."""
    return one(session, Call(session.cluster.shard_for(key), Access.PRIMARY_READ, work, RAISE))


def stale_ms(stale_timeout: float | None) -> int:
    """Milliseconds culling keeps an expired row: STALE_TIMEOUT, else 0."""
    return 0 if stale_timeout is None else math.ceil(stale_timeout * 1000)

