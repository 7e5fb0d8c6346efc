"""Re-encrypting a MySQLCache's entries with the newest of its ENCRYPTION_KEYS
(``cache.rotate_encryption_key()``, ``manage.py kvcache_rotate_key``).

On every shard at once, in bounded batches in key order: a batch reads the next rows of
this cache (:func:`scan`: each value only where another key id encrypted it and it is
still readable), re-encrypts them in Python, and writes each back only if it is
unchanged since it was read (:func:`reseal`: a row written or deleted meanwhile is left
as it is). Stopped after ``max_batches``, it says where to resume; run again from the
start, it only reads what is done already.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Generator, NamedTuple, Protocol

from django_kvcache import steps
from django_kvcache.codec import Codec
from django_kvcache.encryption import FLAG_ENCRYPTED, NONCE_BYTES, NotOpened, key_id_of
from django_kvcache.mysql.cluster import ANY_KEY, Session
from django_kvcache.mysql.plans import On, each, stale_ms
from django_kvcache.mysql.policy import Access, Call
from django_kvcache.mysql.query import Query, rowcount, rows
from django_kvcache.mysql.sql import Statements, now_ms, value_sql
from django_kvcache.stampede import Policy

#: Rows a batch examines on each shard (``kvcache_rotate_key --batch-size``).
ROTATION_BATCH_ROWS = 1000


@dataclass
class Rotation:
    """What ``rotate_encryption_key`` did: rows examined, re-encrypted, found encrypted
    with the newest key already, found unreadable (another key, altered: left as they
    are, misses until they expire); ``resume_after``: the key to continue after, or None
    when every row was examined."""

    key_id: int
    examined: int = 0
    resealed: int = 0
    current: int = 0
    unreadable: int = 0
    batches: int = 0
    resume_after: str | None = None


class RotatingCache(Protocol):
    """What the rotation needs of MySQLCache (``django_kvcache.backends.mysql``)."""

    session: Session
    codec: Codec
    stampede: Policy | None
    table: str

    @property
    def backend_name(self) -> str: ...

    def report_unreadable(self, reason: str, message: str) -> None: ...


def rotate(cache: RotatingCache, batch_rows: int, max_batches: int | None,
           after: str) -> steps.Plan:
    """The rotation of ``cache``'s entries as a plan (see the module); its
    :class:`Rotation`."""
    encryption = cache.codec.encryption
    if encryption is None:
        raise ValueError(f"{cache.cache_name} (table {cache.table!r}) has no ENCRYPTION_KEYS")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    done = Rotation(encryption.writer_id)
    session = cache.session
    cursors = {shard.index: after for shard in session.cluster.shards}  # shards left to scan
    keep_ms = stale_ms(cache.stampede.stale_timeout if cache.stampede is not None else None)
    while cursors and (max_batches is None or done.batches < max_batches):
        done.batches += 1
        scans = yield scan(session, cursors, batch_rows, encryption.writer_id, keep_ms)
        work: dict[int, list[Resealed]] = {}
        for index, found in zip(list(cursors), scans):
            work[index] = resealed(cache, found, done)
            if len(found) < batch_rows:
                del cursors[index]
            else:
                cursors[index] = found[-1][0]
        if any(work.values()):
            done.resealed += sum((yield reseal(session, work)))
    done.resume_after = min(cursors.values()) if cursors else None
    return done


class Resealed(NamedTuple):
    """A row read by :func:`scan` and its value encrypted with the newest key."""

    key: str
    flags: int  # as read
    nonce: bytes  # as read: with ``flags``, what tells the row unchanged since
    data: bytes  # the new value
    new_flags: int


def resealed(cache: RotatingCache, found: list[tuple[str, int, Any]],
             done: Rotation) -> list[Resealed]:
    """The rows of a scan that need the newest key, encrypted with it."""
    encryption = cache.codec.encryption
    assert encryption is not None
    fresh = []
    for key, flags, data in found:
        done.examined += 1
        if not flags & FLAG_ENCRYPTED:
            continue  # an integer, a lease row, another cache's unencrypted entry
        if key_id_of(flags) == encryption.writer_id:
            done.current += 1
            continue
        if data is None:
            continue  # expired: culling deletes it
        data = bytes(data)
        try:
            new = encryption.resealed(data, flags, key)
        except NotOpened as exc:
            done.unreadable += 1
            cache.report_unreadable(exc.reason, f"cache entry {key!r} not re-encrypted: {exc}")
            continue
        assert new is not None
        fresh.append(Resealed(key, flags, data[:NONCE_BYTES], *new))
    return fresh


# --- the statements ---------------------------------------------------------------------------


def scan(
    session: Session, cursors: dict[int, str], rows_per_batch: int, key_id: int, keep_ms: int,
) -> On:
    """One batch on each shard in ``cursors`` (shard index: the last key done there):
    the next ``rows_per_batch`` rows of this cache in key order, as ``(key, flags,
    value)``, the value None unless it is encrypted with a key id other than ``key_id``
    and readable (expired less than ``keep_ms`` ago, or live)."""
    scope = session.cluster.scope

    def work(after: str, sql: Statements) -> Query:
        readable_from = now_ms() - keep_ms
        if scope is None:
            return Query(sql.rotation_scan, (key_id, readable_from, after, rows_per_batch), rows)
        return Query(sql.rotation_scan_prefix,
                     (key_id, readable_from, after, scope, rows_per_batch), rows)

    shards = session.cluster.shards
    return each(session, [
        Call(shards[index], Access.MAINTENANCE, partial(work, after), keys=ANY_KEY)
        for index, after in cursors.items()
    ])


def reseal(session: Session, rows_by_shard: dict[int, list[Resealed]]) -> On:
    """Write each shard's re-encrypted rows, each only if unchanged since it was read;
    each shard's count of rows written."""

    def work(resealed: list[Resealed], sql: Statements) -> Generator[Query, Any, int]:
        written = 0
        for row in resealed:
            value, blob = value_sql(row.data)
            # A rerun after a lost reply finds the row changed, and writes nothing.
            written += yield Query(sql.reseal(value, row.nonce),
                                   (*blob, row.new_flags, row.key, row.flags), rowcount)
        return written

    shards = session.cluster.shards
    return each(session, [
        Call(shards[index], Access.MAINTENANCE, partial(work, resealed), keys=ANY_KEY)
        for index, resealed in rows_by_shard.items() if resealed
    ])
