"""MySQLCache's herd-protection primitive: a lease row beside the entry, and stale rows.

The shared policy (:mod:`django_kvcache.stampede`) decides when to compute, wait or serve
stale; this module gives it, for one key, the two things MySQL can do in one statement:

* **read** — ``SELECT … WHERE cache_key IN (entry, lease)``: the entry with its expiry,
  live or not, and its lease row. Fresh, stale (expired less than ``STALE_TIMEOUT``
  ago: the row is still there, since culling keeps it that long) and missing are told
  apart in Python from that one answer, with the application's clock as everywhere.
* **take the lease** — one conditional upsert of the lease row (``Statements.lease_take``):
  inserted if absent, taken over if expired or still exactly as the caller read it
  (compared by its ``value``: a token or a released marker, unique to each holder).
  The winner is known from ``LAST_INSERT_ID`` (0 only for the winner).

A lease row lives under a derived key on the entry's shard (routing follows the entry's
key), so the table's schema is unchanged. Its key is 250 characters without the digest
marker at the digest position: no caller's key is ever stored in that form
(:func:`django_kvcache.mysql.keys.stored_key`), and it starts with ``kvcache-lease:``,
which no prefix operation of a cache with the default ``KEY_FUNCTION`` can match. Its
``value`` is the holder's token while held, and a released marker with that token once
released; a released row stays for LEASE_TIMEOUT (then culling deletes it), so a caller
that read the lease free just before someone else took, used and released it finds the
row changed and does not compute a second time.
"""
from __future__ import annotations

import hashlib
import math
import random
import uuid
from functools import partial
from typing import Any, Callable, Generator, Protocol

from django_kvcache import steps
from django_kvcache.mysql.keys import MAX_KEY_LENGTH
from django_kvcache.mysql.query import Query, lastrowid, rowcount, rows
from django_kvcache.mysql.sql import FOREVER, Statements, now_ms
from django_kvcache.stampede import MISSING, CacheCall, Policy, Read, recompute_early

LEASE_KEY_HEAD = "kvcache-lease:"
#: ``flags`` of a lease row (never read as an entry: its key is no caller's).
LEASE_FLAGS = 0
#: A released lease row's value starts with this, followed by the releaser's token (so
#: no two states of a lease row are alike); a held one holds its holder's token.
RELEASED = b"released:"

Work = Callable[[Statements], Any]  # a Query, or a generator of them (a shard's work)
Row = tuple[bytes, int, int]  # value, flags, expires


def lease_key(entry_key: str) -> str:
    """The lease row's key for an entry's stored key: exactly 250 characters, with dots
    (not the digest marker) where a digested key has its marker."""
    digest = hashlib.sha256(entry_key.encode("utf-8", "surrogatepass")).hexdigest()
    return (LEASE_KEY_HEAD + digest).ljust(MAX_KEY_LENGTH, ".")


class LeaseHost(Protocol):
    """What the store needs of MySQLCache (``django_kvcache.backends.mysql``)."""

    def make_and_validate_key(self, key: Any, version: int | None = None) -> str: ...

    def decode(self, data: bytes, flags: int, key: str) -> Any: ...

    def timeout_seconds(self, timeout: Any = ...) -> float | None: ...

    def set(self, key: Any, value: Any, timeout: Any = ..., version: int | None = None) -> None: ...

    def _lease_call(self, key: str, write: bool, work: Work, fallback: Any) -> Any:
        """A plan step: ``work(statements)`` on the primary of ``key``'s shard;
        ``fallback`` when IGNORE_EXCEPTIONS hides an unreachable server."""


#: What the read found when the shard was unreachable under IGNORE_EXCEPTIONS.
UNREACHABLE: Any = object()


def _won(reply: Any) -> bool:
    """A take's answer: LAST_INSERT_ID is 0 only for the caller that took the lease."""
    return lastrowid(reply) == 0


class MySQLLeaseStore:
    """:class:`django_kvcache.stampede.LeaseStore` for one key of a MySQLCache."""

    def __init__(
        self,
        cache: LeaseHost,
        policy: Policy,
        key: Any,
        timeout: Any,
        version: int | None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.key = key
        self.timeout = timeout
        self.version = version
        self.draw = draw
        self.entry_key = cache.make_and_validate_key(key, version)
        self.lease_key = lease_key(self.entry_key)
        self.token = uuid.uuid4().hex.encode()
        self.lease_ms = math.ceil(policy.lease_timeout * 1000)
        stale = policy.stale_timeout
        self.stale_ms = None if stale is None else math.ceil(stale * 1000)
        # The shared rule (stampede.recompute_early) within a window bounded by the
        # entry's lifetime: the timeout this get_or_set stores it with.
        self.early_window = policy.early_window(cache.timeout_seconds(timeout))

    def _call(self, write: bool, work: Work, fallback: Any) -> Any:
        return self.cache._lease_call(self.entry_key, write, work, fallback)

    # --- the statements ----------------------------------------------------------------

    def _select(self, sql: Statements) -> Generator[Query, Any, tuple[int, list[Any]]]:
        now = now_ms()
        found = yield Query(sql.lease_read, (self.entry_key, self.lease_key), rows)
        return now, found

    def _take(self, seen: bytes | None, sql: Statements) -> Query:
        """``seen``: the lease row's value as read (None: no row)."""
        now = now_ms()
        params = (self.lease_key, self.token, LEASE_FLAGS, now + self.lease_ms, now, seen,
                  self.token, now, seen)
        # Not retried after a lost reply: a second run would find our own row and lose.
        return Query(sql.lease_take, params, _won, idempotent=False)

    def _release(self, sql: Statements) -> Query:
        params = (RELEASED + self.token, now_ms() + self.lease_ms, self.lease_key, self.token)
        return Query(sql.lease_release, params, rowcount)

    def _drop(self, sql: Statements) -> Query:
        return Query(sql.lease_drop, (self.lease_key, self.token), rowcount)

    # --- the plans ---------------------------------------------------------------------

    def read(self) -> steps.Plan:
        found = yield self._call(False, self._select, UNREACHABLE)
        if found is UNREACHABLE:  # logged by the cache; compute, as a plain miss would
            return Read(MISSING, False, True)
        now, rows = found
        entry: Row | None = None
        lease: Row | None = None
        for key, data, flags, expires in rows:
            if key == self.entry_key:
                entry = (data, flags, expires)
            else:
                lease = (data, flags, expires)
        value, fresh = self._entry_value(entry, now)
        if fresh and not self._recompute_early(entry, now):
            return Read(value, True, False)
        seen = None if lease is None else bytes(lease[0])
        if seen is not None and lease[2] > now and not seen.startswith(RELEASED):
            return Read(value, fresh, False)  # someone holds it: fresh, stale or nothing
        won = yield self._call(True, partial(self._take, seen), True)
        return Read(value if fresh or not won else MISSING, fresh, won)

    def _entry_value(self, entry: Row | None, now: int) -> tuple[Any, bool]:
        """The entry's value and whether it is fresh; MISSING when there is no value to
        give (none, past the stale window, or corrupt: a logged miss)."""
        if entry is None:
            return MISSING, False
        data, flags, expires = entry
        fresh = expires > now
        if not fresh and (self.stale_ms is None or expires + self.stale_ms <= now):
            return MISSING, False
        value = self.cache.decode(data, flags, self.entry_key)
        return value, fresh and value is not MISSING

    def _recompute_early(self, entry: Row | None, now: int) -> bool:
        if self.early_window is None or entry is None or entry[2] >= FOREVER:
            return False
        return recompute_early((entry[2] - now) / 1000, self.early_window, self.draw())

    def store(self, value: Any) -> steps.Plan:
        yield CacheCall(self.cache, "set", self.key, value, self.timeout, version=self.version)
        yield self._call(True, self._release, None)

    def release(self) -> steps.Plan:
        yield self._call(True, self._drop, None)
