"""A MySQL/MariaDB cache backend: one indexed table, one statement per operation.

    CACHES = {
        "default": {
            "BACKEND": "django_kvcache.backends.mysql.MySQLCache",
            "LOCATION": "kvcache",  # the table; `manage.py migrate` creates it
            "OPTIONS": {"DATABASE": "default"},
        }
    }

The cache opens connections of its own to the alias's database (never Django's
connection: no transaction, test case or query log of the caller sees its statements).
``OPTIONS["DATABASES"]`` spreads the keys over several aliases (shards) instead, with
optional read replicas (see ``docs/scale-out.rst``). An unreachable or overloaded
server gives misses and no-ops (``IGNORE_EXCEPTIONS``, on by default).

This module is Django's API over plans, as Django's own backends are over their
client: each operation is written once, as a plan that turns the caller's keys,
timeouts and values into stored ones and back; ``get`` runs it on the process's pooled
connections, ``aget`` on the event loop's own — native asyncio, no thread
(docs/async.rst). Everything else has a room of its own under :mod:`django_kvcache.mysql`:
the statements and the shards they go to (``plans``), what a failure does (``policy``),
the tables' DDL and what to say of a missing or foreign one (``tables``), locks
(``locks``), herd protection (``lease``), key rotation (``rotation``), culling
(``culling``) and the counters (``metrics``). See ``docs/mysql.rst`` for the schema,
every option and the SQL of each operation.
"""
from __future__ import annotations

import logging
import re
from functools import partial
from typing import Any, Iterable, Mapping

from django.core.cache.backends.base import (
    DEFAULT_TIMEOUT,
    MEMCACHE_MAX_KEY_LENGTH,
    default_key_func,
)

from django_kvcache import stampede
from django_kvcache.base import MISSING, KVCache, check_delta, counter_overflow, key_not_found
from django_kvcache.configured import is_mysql_cache, mysql_cache_aliases  # noqa: F401  (API)
from django_kvcache.failure_log import FailureLog
from django_kvcache.mysql import aio, blocking, budget, dictionaries, metrics, plans, rotation
from django_kvcache.mysql.cluster import Session, cluster_for, own_keys_pattern
from django_kvcache.mysql.config import DEFAULT_CULL_PROBABILITY, check_table, router_model
from django_kvcache.mysql.errors import CacheTableMissing  # noqa: F401  (part of the API)
from django_kvcache.mysql.keys import MAX_KEY_LENGTH, like_prefix, stored_key
from django_kvcache.mysql.lease import MySQLLeaseStore, Work
from django_kvcache.mysql.locks import MySQLLockStore
from django_kvcache.mysql.rotation import ROTATION_BATCH_ROWS, Rotation
from django_kvcache.mysql.server import PACKET_HEADROOM
from django_kvcache.mysql.sql import FOREVER, expires_at, now_ms  # noqa: F401  (now_ms: for tools)
from django_kvcache.mysql.tables import CacheTables
from django_kvcache.options import THIS_CACHE, TOP_LEVEL, TOP_LEVEL_HINTS, fraction
from django_kvcache.stampede import Compute
from django_kvcache.steps import Plan, arun, run

logger = logging.getLogger(__name__)
#: Values too large for any statement: not stored (never a failed page), one line per
#: episode and table, then a summary.
oversized = FailureLog(logger, "MySQL oversized value")

#: The characters Django warns about in keys (``memcache_key_warnings``).
KEY_WARNING_CHARACTERS = re.compile(r"[\x00-\x20\x7f]")
ALWAYS_FITS = plans.ALWAYS_FITS


class MySQLCache(KVCache):
    """Django cache backend storing entries in a MySQL/MariaDB table (LOCATION)."""

    backend_options = frozenset(
        {
            "DATABASE",
            "DATABASES",
            "WEIGHTS",
            "REPLICAS",
            "READ_YOUR_WRITES",
            "MAX_REPLICA_LAG",
            "IGNORE_EXCEPTIONS",
            "FAILURE_THRESHOLD",
            "RETRY_TIMEOUT",
            "ENGINE",
            "CULL_PROBABILITY",
            "MAX_SIZE",
            "MAX_POOL_SIZE",
            "POOL_TIMEOUT",
            "CONNECT_TIMEOUT",
            "IO_TIMEOUT",
        }
    )
    option_hints = {
        **TOP_LEVEL_HINTS,
        "TIMEOUT": f"{TOP_LEVEL}: the entries' default expiry in seconds; the connections' "
        "timeouts are CONNECT_TIMEOUT and IO_TIMEOUT",
        "timeout": "the connections' timeout: here IO_TIMEOUT, in seconds; the entries' "
        f"default expiry is TIMEOUT, at the top level of {THIS_CACHE}",
        "connect_timeout": "here CONNECT_TIMEOUT, in seconds; connect_timeout belongs in the "
        "OPTIONS of a DATABASES entry",
        "io_timeout": "here IO_TIMEOUT, in seconds",
        "read_timeout": "here IO_TIMEOUT, in seconds; read_timeout belongs in the OPTIONS of "
        "a DATABASES entry",
        "socket_timeout": "django-redis's name: here IO_TIMEOUT",
        "tls": "a connection setting: ssl in the OPTIONS of the cache's DATABASES entry",
        "ignore_exc": "pymemcache's name: here IGNORE_EXCEPTIONS",
        "reverse_key_function": "django-mysql's option: not needed here, the prefix "
        "operations read keys made by the default KEY_FUNCTION",
    }
    #: Compress from 1000 bytes: with zstandard's reused decompressors, reading the
    #: realistic mix costs about what django-mysql's policy (zlib level 6 from 5000 bytes)
    #: costs, and it stores 0.64x its bytes; from 2000, 0.71x (docs/codec.rst, "Choosing
    #: compression": the curve it was chosen from).
    default_compress_min_length = 1000
    #: Store compressed what saves a quarter (docs/codec.rst, "Values compression does not
    #: pay for"): high-entropy text saves 19-23 %, for a compression per write and a
    #: decompression per read of every such row (strings mix: 13 and 8 µs of CPU a value).
    default_compress_min_saving = 0.25

    def __init__(self, location: str, params: Mapping[str, Any]) -> None:
        # COMPRESS_DICTIONARY "auto": zstd dictionaries in a table beside the cache's.
        super().__init__(
            params, partial(dictionaries.table_dictionaries, location),
            encryption_scope=f"mysql table {location}",
        )
        self.table = check_table(location)
        self.tables = CacheTables(self.table, self.options, self.backend_name)
        self.engine = self.tables.engine  # OPTIONS['ENGINE'], checked
        self.cull_probability = fraction(
            self.options, "CULL_PROBABILITY", DEFAULT_CULL_PROBABILITY
        )
        self.cache_model_class = router_model(self.table)
        scope = own_keys_pattern(self.key_prefix, self.key_func is default_key_func)
        self.cluster = cluster_for(self.table, self.options, scope)
        self.session = Session(self.cluster, self.tables.missing_message,
                               self.tables.layout_message)
        self.shards, self.router = self.cluster.shards, self.cluster.router
        #: The one alias of OPTIONS['DATABASE']; None for shards or the routers' choice.
        self.database: str | None = self.shards[0].alias if self.router is None else None
        self.stats = metrics.table_stats(self.cluster)
        #: OPTIONS['MAX_SIZE'] in bytes (None: no budget), and each shard's share of it.
        self.max_size = budget.max_size(self.options)
        weights = self.router.weights if self.router is not None else [1.0]
        self.max_sizes = tuple(budget.shares(self.max_size, weights)) if self.max_size else ()
        #: Whether MAX_ENTRIES bounds the table: always without MAX_SIZE (Django's default
        #: of 300 included), beside MAX_SIZE only when set explicitly; a budget of "20GB"
        #: must not also mean "at most 300 entries".
        self.counts_entries = (self.max_size is None or "MAX_ENTRIES" in self.options
                               or "max_entries" in params)

    # --- the Django API: each sync method and its async twin run the same plan ---------

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        return run(self._get(key, default, version))

    async def aget(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        return await arun(self._get(key, default, version))

    def has_key(self, key: Any, version: int | None = None) -> bool:
        return run(self._has_key(key, version))  # type: ignore[no-any-return]

    async def ahas_key(self, key: Any, version: int | None = None) -> bool:
        return await arun(self._has_key(key, version))  # type: ignore[no-any-return]

    def get_many(self, keys: Iterable[Any], version: int | None = None) -> dict[Any, Any]:
        return run(self._get_many(keys, version))  # type: ignore[no-any-return]

    async def aget_many(self, keys: Iterable[Any], version: int | None = None) -> dict[Any, Any]:
        return await arun(self._get_many(keys, version))  # type: ignore[no-any-return]

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        run(self._set(key, value, timeout, version))

    async def aset(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        await arun(self._set(key, value, timeout, version))

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        return run(self._add(key, value, timeout, version))  # type: ignore[no-any-return]

    async def aadd(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        return await arun(self._add(key, value, timeout, version))  # type: ignore[no-any-return]

    def set_many(
        self, data: Mapping[Any, Any], timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> list[Any]:
        """Returns the caller's keys not stored: too large for a statement, or (with
        IGNORE_EXCEPTIONS) on a shard that could not be reached."""
        return run(self._set_many(data, timeout, version))  # type: ignore[no-any-return]

    async def aset_many(
        self, data: Mapping[Any, Any], timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> list[Any]:
        return await arun(self._set_many(data, timeout, version))  # type: ignore[no-any-return]

    def touch(self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None) -> bool:
        return run(self._touch(key, timeout, version))  # type: ignore[no-any-return]

    async def atouch(
        self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        return await arun(self._touch(key, timeout, version))  # type: ignore[no-any-return]

    def incr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        """Add ``delta`` atomically in one UPDATE; the entry keeps its expiry.

        Raises ``ValueError`` for a missing key, ``TypeError`` for a value that is not an
        integer, and ``OverflowError`` (value unchanged) past the signed 64-bit range.
        An unreachable shard raises even under IGNORE_EXCEPTIONS: no answer is right.
        """
        return run(self._incr(key, delta, version))  # type: ignore[no-any-return]

    async def aincr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        return await arun(self._incr(key, delta, version))  # type: ignore[no-any-return]

    async def adecr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        check_delta(delta)  # before negating: -True would pass as -1
        return await self.aincr(key, -delta, version=version)

    def delete(self, key: Any, version: int | None = None) -> bool:
        return run(self._delete(key, version))  # type: ignore[no-any-return]

    async def adelete(self, key: Any, version: int | None = None) -> bool:
        return await arun(self._delete(key, version))  # type: ignore[no-any-return]

    def delete_many(self, keys: Iterable[Any], version: int | None = None) -> None:
        run(self._delete_many(keys, version))

    async def adelete_many(self, keys: Iterable[Any], version: int | None = None) -> None:
        await arun(self._delete_many(keys, version))

    def clear(self) -> None:
        """Delete this cache's entries on every shard: those under its KEY_PREFIX (every
        version) when it has one and the default KEY_FUNCTION, else every row of the table."""
        run(self._clear())

    async def aclear(self) -> None:
        await arun(self._clear())

    def incr_version(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        return run(self._incr_version(key, delta, version))  # type: ignore[no-any-return]

    async def aincr_version(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        return await arun(self._incr_version(key, delta, version))  # type: ignore[no-any-return]

    async def adecr_version(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        return await self.aincr_version(key, -delta, version)

    def ttl(self, key: Any, version: int | None = None) -> float | None:
        """Seconds until ``key`` expires, as a float (millisecond precision); ``None`` if
        it never expires; ``0.0`` if it is missing or expired — also while an expired
        entry is kept for STALE_TIMEOUT (only ``get_or_set`` serves it). An unreachable
        shard under IGNORE_EXCEPTIONS gives ``0.0``, logged as for ``get``."""
        return run(self._ttl(key, version))  # type: ignore[no-any-return]

    async def attl(self, key: Any, version: int | None = None) -> float | None:
        return await arun(self._ttl(key, version))  # type: ignore[no-any-return]

    async def aget_or_set(
        self, key: Any, default: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> Any:
        """``get_or_set`` on the event loop's own connections: never inside a caller's
        transaction, so the lease is taken whenever herd protection is on."""
        store = self._lease_store(key, timeout, version)
        if store is None:
            return await arun(self._get_or_set(key, default, timeout, version))
        return await stampede.arun(self.stampede, store, default)  # type: ignore[arg-type]

    def keys_with_prefix(self, prefix: str, version: int | None = None) -> list[str]:
        """The caller's keys that start with ``prefix``, in key order.

        Keys over 250 characters are listed in their stored digest form.
        """
        return run(self._with_prefix(prefix, version, entries=False))  # type: ignore[no-any-return]

    async def akeys_with_prefix(self, prefix: str, version: int | None = None) -> list[str]:
        return await arun(self._with_prefix(prefix, version, entries=False))  # type: ignore[no-any-return]

    def get_with_prefix(self, prefix: str, version: int | None = None) -> dict[str, Any]:
        """``{key: value}`` of every live entry whose key starts with ``prefix``."""
        return run(self._with_prefix(prefix, version, entries=True))  # type: ignore[no-any-return]

    async def aget_with_prefix(self, prefix: str, version: int | None = None) -> dict[str, Any]:
        return await arun(self._with_prefix(prefix, version, entries=True))  # type: ignore[no-any-return]

    def delete_with_prefix(self, prefix: str, version: int | None = None) -> int:
        """Delete every live entry whose key starts with ``prefix``; returns how many.
        With STALE_TIMEOUT, expired entries kept for ``get_or_set`` go too (uncounted)."""
        return run(self._delete_with_prefix(prefix, version))  # type: ignore[no-any-return]

    async def adelete_with_prefix(self, prefix: str, version: int | None = None) -> int:
        return await arun(self._delete_with_prefix(prefix, version))  # type: ignore[no-any-return]

    def cull(self, max_batches: int | None = None, *, fail_open: bool | None = None) -> int:
        """On every shard, delete what it owes after an outage, then the expired entries,
        then evict the ones closest to expiry while its table holds more than
        MAX_ENTRIES, or more bytes than its share of MAX_SIZE. Returns the number of rows culled. A shard that fails is tried after
        the others are done: raised then, or (IGNORE_EXCEPTIONS, unless ``fail_open`` is
        False: ``kvcache_cull`` fails loudly) logged and counted."""
        return run(self._cull(max_batches, fail_open))  # type: ignore[no-any-return]

    async def acull(self, max_batches: int | None = None, *, fail_open: bool | None = None) -> int:
        return await arun(self._cull(max_batches, fail_open))  # type: ignore[no-any-return]

    def rotate_encryption_key(
        self,
        batch_rows: int = ROTATION_BATCH_ROWS,
        max_batches: int | None = None,
        after: str = "",
    ) -> Rotation:
        """Re-encrypt with the first of ENCRYPTION_KEYS every live entry of this cache
        that another of its keys encrypted, in batches of ``batch_rows`` rows in key
        order on each shard (after the stored key ``after``); stops after ``max_batches``
        batches, and tells where to resume. A row written or deleted meanwhile is left
        as it is; running it again skips what is done (``kvcache_rotate_key``)."""
        return run(self._rotate(batch_rows, max_batches, after))  # type: ignore[no-any-return]

    def close(self, **kwargs: Any) -> None:
        """Called at the end of every request: the pooled connections stay open."""

    async def aclose(self, **kwargs: Any) -> None:
        """The event loop's own connections stay open (they close with their loop)."""

    def disconnect_all(self) -> None:
        """Close this process's idle connections to this cache's databases (e.g. before
        a fork, or at shutdown)."""
        blocking.close_pools([alias for _, alias in self.cluster.aliases()])

    async def adisconnect_all(self) -> None:
        """Close the running loop's idle connections to this cache's databases, and the
        process's idle blocking ones."""
        aliases = [alias for _, alias in self.cluster.aliases()]
        aio.close_pools(aliases)
        blocking.close_pools(aliases)

    # --- plans: reading ------------------------------------------------------------------

    def _get(self, key: Any, default: Any, version: int | None) -> Plan:
        key = self.make_and_validate_key(key, version)
        row = yield plans.get(self.session, key)
        value = MISSING if row is None else self.decode(row[0], row[1], key)
        if value is MISSING:
            self.stats.misses += 1
            return default
        self.stats.hits += 1
        return value

    def _has_key(self, key: Any, version: int | None) -> Plan:
        return (yield plans.has_key(self.session, self.make_and_validate_key(key, version)))

    def _get_many(self, keys: Iterable[Any], version: int | None) -> Plan:
        key_map = self.make_keys(keys, version)
        if not key_map:
            return {}
        found = {}
        for rows in (yield plans.get_many(self.session, list(key_map))):
            for key, data, flags in rows:
                value = self.decode(data, flags, key)
                if value is not MISSING:
                    found[key_map[key]] = value
        self.stats.hits += len(found)
        self.stats.misses += len(key_map) - len(found)
        return found

    def _ttl(self, key: Any, version: int | None) -> Plan:
        row = yield plans.ttl(self.session, self.make_and_validate_key(key, version))
        if row is None:
            return 0.0
        expires, now = row
        return None if expires >= FOREVER else max(expires - now, 0) / 1000

    def _with_prefix(self, prefix: str, version: int | None, entries: bool) -> Plan:
        pattern = self._prefix_pattern(prefix, version)
        head = self.make_key("", version=version)
        found = sorted(row for rows in (yield plans.with_prefix(self.session, pattern, entries))
                       for row in rows)
        if not entries:
            return [self._caller_key(stored, head) for (stored,) in found]
        values = {}
        for stored, data, flags in found:
            value = self.decode(data, flags, stored)
            if value is not MISSING:
                values[self._caller_key(stored, head)] = value
        return values

    def _prefix_pattern(self, prefix: str, version: int | None) -> str:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, got {prefix!r}")
        return like_prefix(self.make_key(prefix, version=version))

    @staticmethod
    def _caller_key(stored: str, head: str) -> str:
        return stored[len(head) :] if stored.startswith(head) else stored

    # --- plans: writing --------------------------------------------------------------------

    def _set(self, key: Any, value: Any, timeout: Any, version: int | None) -> Plan:
        stored = self.make_and_validate_key(key, version)
        expires = self._expires(timeout)
        if expires is None:
            yield plans.delete_row(self.session, stored)
            return None
        data, flags = self._encode(value, stored)
        yield from self._cull_before({stored: data})
        too_large = yield plans.set(self.session, stored, data, flags, expires)
        if too_large is not None:
            self._not_stored(key, too_large)
        return None

    def _add(self, key: Any, value: Any, timeout: Any, version: int | None) -> Plan:
        stored = self.make_and_validate_key(key, version)
        expires = self._expires(timeout)
        if expires is None:  # nothing is stored; "added" when no live entry was there
            return not (yield plans.live_on_primary(self.session, stored))
        data, flags = self._encode(value, stored)
        yield from self._cull_before({stored: data})
        added = yield plans.add(self.session, stored, data, flags, expires)
        if isinstance(added, plans.TooLarge):
            self._not_stored(key, added)
            return False
        return added

    def _set_many(self, data: Mapping[Any, Any], timeout: Any, version: int | None) -> Plan:
        if not data:
            return []
        expires = self._expires(timeout)
        if expires is None:
            yield from self._delete_many(data, version)
            return []
        # Every key and value is checked and encoded before anything is written, so a bad
        # key or an unpicklable value leaves the whole batch unwritten.
        callers: dict[str, Any] = {}
        rows: dict[str, tuple[bytes, int]] = {}
        for key, value in data.items():
            stored = self.make_and_validate_key(key, version)
            callers[stored] = key
            rows[stored] = self._encode(value, stored)
        yield from self._cull_before({stored: data for stored, (data, _) in rows.items()})
        failed: list[Any] = []
        for answer in (yield plans.set_many(self.session, rows, expires)):
            if isinstance(answer, plans.NotReached):  # IGNORE_EXCEPTIONS: logged by the policy
                failed += [callers[stored] for stored in answer]
                continue
            for stored, too_large in answer:
                self._not_stored(callers[stored], too_large)
                failed.append(callers[stored])
        return failed

    def _touch(self, key: Any, timeout: Any, version: int | None) -> Plan:
        stored = self.make_and_validate_key(key, version)
        expires = self._expires(timeout)
        if expires is None:  # touched into the past: deleted, as Django's backends do
            return (yield plans.delete(self.session, stored, self._drops_stale))
        return (yield plans.touch(self.session, stored, expires))

    def _incr(self, key: Any, delta: int, version: int | None) -> Plan:
        check_delta(delta)
        stored = self.make_and_validate_key(key, version)
        outcome = yield from plans.incr(self.session, stored, delta)
        if isinstance(outcome, plans.Refused):
            raise self._incr_refused(key, stored, delta, version, outcome)
        return outcome

    def _incr_refused(
        self, key: Any, stored: str, delta: int, version: int | None, refused: plans.Refused
    ) -> Exception:
        """The exception for an incr that did not apply, naming the caller's key and the
        version it gave (the row, read back, is decoded under its stored key: with
        ENCRYPTION_KEYS it opens under no other)."""
        if refused.reason == plans.OVERFLOW:
            return counter_overflow(key, delta)
        if refused.reason == plans.NOT_INTEGER:
            value = self.decode(refused.data, refused.flags, stored)
            if isinstance(value, int) and not isinstance(value, bool):
                return TypeError(
                    f"The value of key '{key}' is an int beyond the signed 64-bit range of "
                    "counters (stored pickled): incr and decr count in 64 bits"
                )
            return TypeError(f"The value of key '{key}' is not an integer")
        if refused.reason == plans.CORRUPT:
            self.report_unreadable(
                "corrupt integer",
                f"corrupt integer cache entry {stored!r} read as missing: {refused.error}",
            )
        return key_not_found(key, version)

    def _incr_version(self, key: Any, delta: int, version: int | None) -> Plan:
        """Django's ``incr_version``, as one plan for both APIs."""
        asked = version
        if version is None:
            version = self.version
        value = yield from self._get(key, MISSING, version)
        if value is MISSING:
            raise key_not_found(key, asked)
        yield from self._set(key, value, DEFAULT_TIMEOUT, version + delta)
        yield from self._delete(key, version)
        return version + delta

    def _get_or_set(self, key: Any, default: Any, timeout: Any, version: int | None) -> Plan:
        """Django's ``get_or_set``, as a plan (an async default is awaited on the loop)."""
        value = yield from self._get(key, MISSING, version)
        if value is not MISSING:
            return value
        value = yield Compute(default)
        yield from self._add(key, value, timeout, version)
        # Read again: another caller may have added a value between our get and add.
        return (yield from self._get(key, value, version))

    def _not_stored(self, key: Any, too_large: plans.TooLarge) -> None:
        """A value too large for any statement: its older value is gone (never served),
        and the log says so once per episode, naming the caller's key."""
        oversized.failed(
            f"table {self.table}",
            f"not caching {key!r} in {self.cache_name}: its row takes {too_large.size} "
            "bytes in a statement (escaped, with the key), over the limit of "
            f"{too_large.budget} bytes (the connection's max_allowed_packet minus "
            f"{PACKET_HEADROOM})",
        )

    def _cull_before(self, rows: Mapping[str, bytes]) -> Plan:
        """With CULL_PROBABILITY, and with MAX_SIZE as the bytes written say, a small cull
        of the shards written to, on the side (``rows``: stored key -> stored value)."""
        cull = plans.write_path_cull(self.session, rows, self._culling(), self.cull_probability)
        if cull is not None:
            yield cull

    def _encode(self, value: Any, stored: str) -> tuple[bytes, int]:
        data, flags, saved = self.codec.encode_measured(value, stored)
        stats = self.stats
        stats.values_encoded += 1
        stats.bytes_encoded += len(data)
        stats.bytes_saved += saved
        return data, flags

    # --- plans: deleting -------------------------------------------------------------------

    def _delete(self, key: Any, version: int | None) -> Plan:
        stored = self.make_and_validate_key(key, version)
        return (yield plans.delete(self.session, stored, self._drops_stale))

    def _delete_many(self, keys: Iterable[Any], version: int | None) -> Plan:
        stored = list(self.make_keys(keys, version))
        if stored:
            yield plans.delete_many(self.session, stored)

    def _clear(self) -> Plan:
        yield plans.clear(self.session, self.cluster.scope)

    def _delete_with_prefix(self, prefix: str, version: int | None) -> Plan:
        pattern = self._prefix_pattern(prefix, version)
        return sum((yield plans.delete_with_prefix(self.session, pattern, self._drops_stale)))

    def _cull(self, max_batches: int | None, fail_open: bool | None = None) -> Plan:
        strict = fail_open is False
        return sum((yield plans.cull(self.session, self._culling(), max_batches, strict)))

    def _rotate(self, batch_rows: int, max_batches: int | None, after: str) -> Plan:
        return rotation.rotate(self, batch_rows, max_batches, after)

    @property
    def _drops_stale(self) -> bool:
        """Whether a delete also drops an expired row kept for STALE_TIMEOUT."""
        return bool(self.stampede is not None and self.stampede.stale_timeout)

    def _culling(self) -> plans.Culling:
        stale = self.stampede.stale_timeout if self.stampede is not None else None
        max_entries = self._max_entries if self.counts_entries else None
        return plans.Culling(max_entries, self._cull_frequency, plans.stale_ms(stale),
                             self.max_sizes)

    # --- herd protection and locks ---------------------------------------------------------

    def _lease_store(self, key: Any, timeout: Any, version: Any) -> MySQLLeaseStore | None:
        """A lease row beside the entry, and expired rows kept for STALE_TIMEOUT
        (``django_kvcache.mysql.lease``)."""
        if self.stampede is None or self._expires(timeout) is None:
            return None
        return MySQLLeaseStore(self, self.stampede, key, timeout, version)

    def _lease_call(self, key: str, write: bool, work: Work, fallback: Any) -> plans.On:
        """The lease store's statements: a step on the primary of ``key``'s shard."""
        return plans.lease(self.session, key, write, work, fallback)

    def _lock_store(self, key: Any, version: int | None, asynchronous: bool) -> MySQLLockStore:
        """A row of the lock table (``django_kvcache.mysql.locks``) on the shard the
        name's key routes to (either API: the plans' steps have both drivers)."""
        stored = self.make_and_validate_key(key, version)
        return MySQLLockStore(self.session, stored, self.tables.lock_table_missing)

    # --- keys and timeouts -----------------------------------------------------------------

    def validate_key(self, key: str) -> None:
        """Django's key warnings, with a fast path for the keys that need none."""
        if len(key) > MEMCACHE_MAX_KEY_LENGTH or KEY_WARNING_CHARACTERS.search(key):
            super().validate_key(key)

    def make_and_validate_key(self, key: Any, version: int | None = None) -> str:
        """The key as stored: Django's key, or its digest form when it overflows the column.

        Every key goes through here, so ``make_keys`` maps stored keys to callers' keys too.
        """
        key = self.make_key(key, version)
        self.validate_key(key)
        return key if len(key) < MAX_KEY_LENGTH else stored_key(key)

    def _expires(self, timeout: Any) -> int | None:
        """Expiry in epoch ms; ``None`` when the entry is expired at once (timeout <= 0)."""
        return expires_at(self.timeout_seconds(timeout))

    # --- shards and observability ----------------------------------------------------------

    def db_alias(self, write: bool) -> str:
        """The alias of a single-shard cache: OPTIONS['DATABASE'], else what the routers
        say (as for DatabaseCache). With OPTIONS['DATABASES'], the first shard's."""
        shard = self.shards[0]
        return shard.primary() if write else self.session.reader(shard)

    def storage(self) -> frozenset[str]:
        return frozenset(f"table {self.table!r} in database {alias!r}"
                         for alias in self.database_aliases())

    def database_aliases(self) -> list[str]:
        """Every shard's primary alias, in OPTIONS order (one alias without shards)."""
        return [shard.primary() for shard in self.shards]

    def _shard_for(self, key: str) -> Any:
        return self.cluster.shard_for(key)

    def metrics(self) -> dict[str, Any]:
        """This process's counters for the table: values written, their stored bytes and
        the bytes compression saved (``bytes_encoded + bytes_saved`` is the serialized
        size), hits and misses; then each shard's and replica's
        (:func:`django_kvcache.mysql.metrics.figures`; with MAX_SIZE, each shard's budget
        and its stored bytes at this process's last budget check)."""
        return metrics.figures(self.cluster, self.stats, self.max_sizes)

    def sample_entries(self, count: int) -> list[tuple[str, bytes, int]]:
        """Up to ``count`` live entries picked at random, as stored: ``(stored key, bytes,
        flags)``, the same share from each shard (``codec.opened`` decrypts one).

        For training a compression dictionary (``kvcache_train_dictionary``); it scans
        the table, so it is no request-path call.
        """
        return run(plans.sample(self.session, count))  # type: ignore[no-any-return]

    # --- the tables (django_kvcache.mysql.tables) ------------------------------------------

    # ``database`` defaults to the cache's own (write) alias, or for ``create_table`` and
    # ``table_exists`` to every shard; the tables of test databases are made through the
    # alias being set up, which a TEST MIRROR alias is not yet.

    def create_table_sql(self, database: str | None = None, collation: str | None = None) -> str:
        """The tables' DDL for ``database``'s server (``collation``: another name of its
        binary NO PAD collation, or a placeholder for a migration)."""
        return self.tables.create_sql(database or self.db_alias(write=True), collation)

    def drop_table_sql(self, database: str | None = None) -> str:
        return self.tables.drop_sql()

    def create_table(self, database: str | None = None) -> str:
        """Create the tables where they are missing and upgrade an outdated table
        (``database``, else every shard); returns the DDL it ran (the last shard's)."""
        return self.tables.create([database] if database else self.database_aliases())

    def table_exists(self, database: str | None = None) -> bool:
        """Whether the tables exist, up to date, in ``database``, else on every shard."""
        databases = [database] if database else self.database_aliases()
        return not any(self.tables.missing(alias) or self.tables.outdated(alias)
                       for alias in databases)

    def missing_tables(self, database: str) -> list[str]:
        """Which of the cache's tables ``database`` lacks: the table, its lock table,
        and with ``COMPRESS_DICTIONARY: "auto"`` its dictionary table."""
        return self.tables.missing(database)

    def outdated_table(self, database: str) -> list[str]:
        """What the existing table in ``database`` lacks for MAX_SIZE's estimate, or keeps
        of the old size table and triggers (``["column key_hash", ...]``); [] when up to
        date. ``create_table`` upgrades it."""
        return self.tables.outdated(database)

    def upgrade_table_sql(self, database: str) -> list[str]:
        """The statements ``create_table`` runs to upgrade the table in ``database``."""
        return self.tables.upgrade_sql(database)

    def table_layout_problem(self, database: str) -> tuple[str, str] | None:
        """What is wrong with the layout of the table in ``database`` and the fix, or
        ``None``: it is ours, or missing."""
        return self.tables.layout_problem(database)

    @property
    def lock_table(self) -> str:
        """The table of this cache's locks: ``<LOCATION>_locks``."""
        return self.tables.lock_table
