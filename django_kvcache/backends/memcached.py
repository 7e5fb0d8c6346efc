"""Multi-node memcached cache backend: rendezvous routing, shared pools and node health.

    CACHES = {
        "default": {
            "BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
            "LOCATION": ["10.0.0.1:11211", "10.0.0.2:11211", "unix:/run/memcached.sock"],
            "OPTIONS": {"FAILOVER": False, "IGNORE_EXCEPTIONS": True},
        }
    }

The options are described in docs/memcached.rst. Everything shared between backend
instances (pools, node health, counters, routing) lives in a process-wide
:class:`~django_kvcache.memcached.cluster.Cluster`, found again by every instance built
with the same settings.

Each operation is written once, as a plan (:mod:`django_kvcache.steps`) that yields the
IO it needs and is told its driver's transport: ``set`` runs ``self._set(...,
BLOCKING)`` with ``run`` on blocking sockets, ``aset`` runs ``self._set(..., ASYNCIO)``
with ``arun`` on the event loop's own connections — native asyncio, no thread
(docs/async.rst). The usual call of one key goes without its plan where that is the
same (:mod:`django_kvcache.memcached.usual`). Inside
a plan a request goes through the node's exchange in the plan's own driver, one way:
``yield from node.request(op, io)``, or for many nodes at once ``yield from
fan_out(batches, io)``. Everything else (routing, failover, IGNORE_EXCEPTIONS, counters,
clean-up of outdated copies) is plain code in the plan, so the two APIs cannot drift
apart. The usual async call of one key awaits its one request on the node's exchange
without a plan (``memcached.usual``), by the same functions, and is the plan's whenever
anything is unusual.

This module is Django's API over those plans. Where a key is read and written and who
decides (REPLICAS, one replica the degenerate case) is ``memcached.replicas``; how a
node counts, ``memcached.counters``; the multi-key write plans, ``memcached.writes``.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Iterable, Mapping

from django.core.cache.backends.base import (
    DEFAULT_TIMEOUT,
    BaseCache,
    InvalidCacheKey,
    default_key_func,
)

from django_kvcache import stampede
from django_kvcache.base import (
    MISSING,
    KVCache,
    check_delta,
    delegate_to_sync,
    key_not_found,
)
from django_kvcache.failure_log import FailureLog
from django_kvcache.memcached import (
    MemcachedError,
    NodeDown,
    Refused,
    Unsupported,
)
from django_kvcache.memcached import aio, fanout, lease, sampling, wire
from django_kvcache.memcached.locks import MemcachedLockStore
from django_kvcache.memcached.cluster import cluster_for
from django_kvcache.memcached.counters import Counters
from django_kvcache.memcached.replicas import replicas_for
from django_kvcache.memcached.usual import UsualCalls
from django_kvcache.memcached.writes import Writes
from django_kvcache.memcached.node import Node
from django_kvcache.memcached.exchange import ASYNCIO, BLOCKING, Transport, fan_out
from django_kvcache.memcached.routing import parse_location
from django_kvcache.memcached.wire import EXPIRED
from django_kvcache.options import THIS_CACHE, TOP_LEVEL, TOP_LEVEL_HINTS, flag
from django_kvcache.signals import node_up
from django_kvcache.steps import Plan, arun, run

MAX_KEY_BYTES = 250

#: IGNORE_EXCEPTIONS when OPTIONS do not say: fail open, as Django's memcached backends
#: do once their client drops a dead node — a down node's keys miss, pages keep working.
IGNORE_EXCEPTIONS_DEFAULT = True

logger = logging.getLogger(__name__)
#: Failures ignored under IGNORE_EXCEPTIONS, per node: logged once, then summarized.
ignored_failures = FailureLog(logger, "memcached")


class RefusedValues(FailureLog):
    """Values a node refused to store (over its item size, out of memory), per node:
    never raised, whatever IGNORE_EXCEPTIONS says, so worded as what they are."""

    FIRST = ("%s %s refused the value of %s; not stored (further refusals there are "
             "summarized at most every %g s)")
    SUMMARY = "%d more value(s) refused by %s %s in %.1f s (last: %s)"
    COUNTED = "%s %s refused the value of %s (counted for its summary)"


#: Values the nodes refused, named by the caller's key: logged once, then summarized.
refusals = RefusedValues(logger, "memcached")


def _node_answers_again(sender: Any, node: str, **kwargs: Any) -> None:
    ignored_failures.recovered(f"node {node}")


node_up.connect(_node_answers_again, dispatch_uid="django_kvcache.memcached.ignored_failures")


def _plain_key(key: str) -> bool:
    """The usual key, valid for memcached at a glance (three C calls): ASCII, printable,
    no space, at most 250 characters (which are then bytes too)."""
    return key.isascii() and len(key) <= MAX_KEY_BYTES and key.isprintable() and " " not in key


def _key_head(cache: BaseCache) -> str | None:
    """What every key of ``cache`` at its own VERSION starts with, when keys are Django's
    default (``default_key_func``, ``make_key``, ``make_and_validate_key`` and this
    backend's ``validate_key`` left as they are); None when they are made otherwise."""
    cls = type(cache)
    if (cache.key_func is not default_key_func or cls.make_key is not BaseCache.make_key
            or cls.make_and_validate_key is not MemcachedCache.make_and_validate_key
            or cls.validate_key is not MemcachedCache.validate_key):
        return None
    return default_key_func("", cache.key_prefix, cache.version)


class MemcachedCache(UsualCalls, KVCache):
    backend_options = frozenset(
        {
            "HASHING",
            "WEIGHTS",
            "CONNECT_TIMEOUT",
            "IO_TIMEOUT",
            "MAX_POOL_SIZE",
            "POOL_TIMEOUT",
            "RETRY_TIMEOUT",
            "FAILURE_THRESHOLD",
            "FAILOVER",
            "IGNORE_EXCEPTIONS",
            "TLS",
            "AUTOBATCH",
            "REPLICAS",
        }
    )
    option_hints = {
        **TOP_LEVEL_HINTS,
        "TIMEOUT": f"{TOP_LEVEL}: the entries' default expiry in seconds; the socket "
        "timeouts are CONNECT_TIMEOUT and IO_TIMEOUT",
        # pymemcache's HashClient (Django's PyMemcacheCache passes OPTIONS to it)
        "ignore_exc": "pymemcache's name: here IGNORE_EXCEPTIONS, True by default",
        "no_delay": "pymemcache's option: TCP_NODELAY is always on here",
        "connect_timeout": "pymemcache's name: here CONNECT_TIMEOUT, in seconds",
        "timeout": "pymemcache's socket timeout: here IO_TIMEOUT, in seconds; the entries' "
        f"default expiry is TIMEOUT, at the top level of {THIS_CACHE}",
        "retry_attempts": "pymemcache's option: here a node is skipped after "
        "FAILURE_THRESHOLD failures in a row, for RETRY_TIMEOUT seconds",
        "retry_timeout": "pymemcache's name: here RETRY_TIMEOUT, the seconds a node that "
        "failed is skipped",
        "dead_timeout": "pymemcache's name: here RETRY_TIMEOUT, the seconds a node that "
        "failed is skipped",
        "use_pooling": "pymemcache's option: connections are always pooled here, see "
        "MAX_POOL_SIZE and POOL_TIMEOUT",
        "tls_context": "pymemcache's name: here TLS, an ssl.SSLContext or a dict",
        "serde": "pymemcache's option: here SERIALIZER",
        "allow_unicode_keys": "pymemcache's option: keys are always unicode here",
        "default_noreply": "pymemcache's option: every reply is read here",
        # pylibmc and django-redis
        "behaviors": "pylibmc's option: here CONNECT_TIMEOUT, IO_TIMEOUT and HASHING",
        "socket_timeout": "django-redis's name: here IO_TIMEOUT",
        "socket_connect_timeout": "django-redis's name: here CONNECT_TIMEOUT",
    }
    inapplicable_options = dict.fromkeys(
        ("MAX_ENTRIES", "CULL_FREQUENCY"),
        "memcached evicts the least recently used items when its memory (memcached -m) is "
        "full, so there is no entry count to keep",
    )

    def __init__(self, server: Any, params: Mapping[str, Any]) -> None:
        # Every node's entries share one scope: a key may move between nodes (failover,
        # a node added), never between caches (the stored key carries KEY_PREFIX).
        super().__init__(params, encryption_scope="memcached")
        self.failover = flag(self.options, "FAILOVER")
        self.ignore_exceptions = flag(self.options, "IGNORE_EXCEPTIONS", IGNORE_EXCEPTIONS_DEFAULT)
        self.cluster = cluster_for(parse_location(server), self.options)
        self._nodes = self.cluster.nodes
        #: get_or_set keeps stale copies beside its entries, which deletes remove too.
        self._stale_copies = self.stampede is not None and self.stampede.stale_timeout is not None
        #: Where keys are read and written, and who decides: REPLICAS, each key on its
        #: first N nodes (docs/memcached.rst, Replicas), one the degenerate case.
        self.replicas = replicas_for(self.cluster, self, self.failover, self._stale_copies)
        self._writes = Writes(self, self.replicas, self._stale_copies)
        self._counters = Counters(self)
        #: Every key at this cache's VERSION starts so (``make_and_validate_key``).
        self._key_head = _key_head(self)
        #: The exptime of the default TIMEOUT, when it is the same at every call (not an
        #: absolute time: up to 30 days, forever, or already expired).
        default_exptime = wire.exptime(self.default_timeout)
        self._default_exptime = default_exptime if default_exptime <= EXPIRED else None

    # --- the Django API: each sync method and its async twin run the same plan ---------
    # (get, aget, aset, aadd, adelete and atouch: memcached.usual.UsualCalls, a base
    # class, which makes the usual call of one key on its node's exchange without a plan)

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        run(self._set(key, value, timeout, version, BLOCKING))

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        return run(self._add(key, value, timeout, version, BLOCKING))

    def touch(self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None) -> bool:
        return run(self._touch(key, timeout, version, BLOCKING))

    def delete(self, key: Any, version: int | None = None) -> bool:
        return run(self._delete(key, version, BLOCKING))

    def has_key(self, key: Any, version: int | None = None) -> bool:
        return self.get(key, MISSING, version=version) is not MISSING

    async def ahas_key(self, key: Any, version: int | None = None) -> bool:
        return await self.aget(key, MISSING, version=version) is not MISSING

    def incr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        return run(self._incr(key, delta, version, BLOCKING))

    async def aincr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        return await arun(self._incr(key, delta, version, ASYNCIO))

    async def adecr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        check_delta(delta)  # before negating: -True would pass as -1
        return await self.aincr(key, -delta, version=version)

    def get_many(self, keys: Iterable[Any], version: int | None = None) -> dict[Any, Any]:
        return run(self._get_many(keys, version, BLOCKING))

    async def aget_many(self, keys: Iterable[Any], version: int | None = None) -> dict[Any, Any]:
        return await arun(self._get_many(keys, version, ASYNCIO))

    def set_many(
        self, data: Mapping[Any, Any], timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> list[Any]:
        return run(self._set_many(data, timeout, version, BLOCKING))

    async def aset_many(
        self, data: Mapping[Any, Any], timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> list[Any]:
        return await arun(self._set_many(data, timeout, version, ASYNCIO))

    def delete_many(self, keys: Iterable[Any], version: int | None = None) -> None:
        run(self._delete_many(keys, version, BLOCKING))

    async def adelete_many(self, keys: Iterable[Any], version: int | None = None) -> None:
        await arun(self._delete_many(keys, version, ASYNCIO))

    async def _aget_or_set_unprotected(
        self, key: Any, default: Any, timeout: Any, version: Any
    ) -> Any:
        """``aget_or_set`` without LEASE_TIMEOUT, on the loop; a callable default may
        return an awaitable. (With LEASE_TIMEOUT, KVCache.aget_or_set runs the stampede
        plan on these same native methods.)"""
        value = await self.aget(key, MISSING, version=version)
        if value is not MISSING:
            return value
        if callable(default):
            default = default()
            if inspect.isawaitable(default):
                default = await default
        await self.aadd(key, default, timeout=timeout, version=version)
        # Read again: another caller may have added a value between our get and add.
        return await self.aget(key, default, version=version)

    def get_or_set(
        self, key: Any, default: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> Any:
        """Django's ``get_or_set``; with LEASE_TIMEOUT herd-proof (docs/stampede.rst)."""
        store = self._lease_store(key, timeout, version, BLOCKING)
        if store is None:
            return BaseCache.get_or_set(self, key, default, timeout=timeout, version=version)
        return stampede.run(self.stampede, store, default)  # type: ignore[arg-type]

    async def aget_or_set(
        self, key: Any, default: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> Any:
        """``get_or_set`` on the loop; a coroutine function as ``default`` is awaited."""
        store = self._lease_store(key, timeout, version, ASYNCIO)
        if store is None:
            return await self._aget_or_set_unprotected(key, default, timeout, version)
        return await stampede.arun(self.stampede, store, default)  # type: ignore[arg-type]

    def _lease_store(
        self, key: Any, timeout: Any, version: Any, io: Transport = BLOCKING
    ) -> Any:
        """get_or_set's herd protection on the meta commands (``memcached.lease``), for
        the driver of ``io``; on a node without them it falls back to leases by ``add``."""
        if not self._protects(timeout):
            return None
        return lease.MetaLeaseStore(
            self, self.stampede, key, timeout, version, node_for=self._node,
            failed=self._failed, io=io, elsewhere=self.replicas.elsewhere,
        )

    def _lock_store(self, key: Any, version: int | None, asynchronous: bool) -> MemcachedLockStore:
        """A lease item and a token counter on the name's home node, whatever FAILOVER
        and IGNORE_EXCEPTIONS say (``django_kvcache.memcached.locks``), for the driver
        of the API asking."""
        return MemcachedLockStore(self.cluster, self, self.make_and_validate_key(key, version),
                                  ASYNCIO if asynchronous else BLOCKING)

    def ttl(self, key: Any, version: int | None = None) -> float | None:
        """Seconds until ``key`` expires (whole seconds, memcached's): ``None`` if it never
        does, ``0`` if it is missing or expired — also while get_or_set still serves a
        stale copy of it. Needs memcached >= 1.6.6 (``mg <key> t``): on an older node it
        raises ``MetaCommandsMissing`` (a ``NotImplementedError``), whatever
        IGNORE_EXCEPTIONS says."""
        return run(self._ttl(key, version, BLOCKING))

    async def attl(self, key: Any, version: int | None = None) -> float | None:
        return await arun(self._ttl(key, version, ASYNCIO))

    def clear(self) -> None:
        run(self._clear(BLOCKING))

    async def aclear(self) -> None:
        await arun(self._clear(ASYNCIO))

    def close(self, **kwargs: Any) -> None:
        """Called at the end of every request: the pooled connections stay open."""

    async def aclose(self, **kwargs: Any) -> None:
        """The pooled connections stay open (they close with their event loop)."""

    def disconnect_all(self) -> None:
        """Really close this cache's idle connections (e.g. before a fork or at shutdown)."""
        for node in self._nodes:
            node.pool.close_idle()

    async def adisconnect_all(self) -> None:
        """Close this cache's idle connections: the running loop's and the blocking ones."""
        aio.close_pools(self._nodes)
        self.disconnect_all()

    aincr_version = delegate_to_sync("incr_version")
    adecr_version = delegate_to_sync("decr_version")

    # --- keys and expiry --------------------------------------------------------------

    def encode(self, value: Any, key: str) -> tuple[bytes, int]:
        """A value as stored under the stored key ``key``: ``(data, flags)`` (for the
        lease stores, ``memcached.lease``)."""
        return self.codec.encode(value, key)

    def make_and_validate_key(self, key: Any, version: int | None = None) -> str:
        """Django's (``make_key``, then ``validate_key``) — every call's first step, so
        the usual one is done inline: a ``str`` key at this cache's VERSION, with Django's
        default KEY_FUNCTION, is the cache's key head (``KEY_PREFIX:VERSION:``, made once)
        and the key; a subclass that makes or checks keys its own way is always asked."""
        head = self._key_head
        if head is not None and version is None and type(key) is str:
            stored_key = head + key
            if _plain_key(stored_key):
                return stored_key
        return super().make_and_validate_key(key, version=version)

    def validate_key(self, key: str) -> None:
        """memcached's rules in UTF-8 bytes: at most 250, no spaces or control characters.

        The messages are Django's own (``memcache_key_warnings``), word for word; only
        the length is counted in bytes, where Django counts characters.
        """
        if _plain_key(key):
            return  # the common case
        if len(key.encode()) > MAX_KEY_BYTES:
            raise InvalidCacheKey(
                f"Cache key will cause errors if used with memcached: {key!r} "
                f"(longer than {MAX_KEY_BYTES})"
            )
        if any(ord(char) < 33 or ord(char) == 127 for char in key):
            raise InvalidCacheKey(
                f"Cache key contains characters that will cause errors if used with "
                f"memcached: {key!r}"
            )

    def expire_time(self, timeout: Any = DEFAULT_TIMEOUT) -> int:
        """memcached's exptime for Django's ``timeout`` (``wire.exptime``): 0 forever, a
        past Unix time for 0 and below, whole seconds rounded up, a Unix time past 30
        days, at most ``LATEST_EXPIRY``."""
        if timeout is DEFAULT_TIMEOUT and self._default_exptime is not None:
            return self._default_exptime
        return wire.exptime(self.timeout_seconds(timeout))

    # --- routing and failure policy (the cluster's, with this cache's FAILOVER) -------

    def _node(self, key: str) -> Node:
        """The key's node now; with REPLICAS the deciding replica."""
        return self.replicas.decider(key)

    def _home(self, key: str) -> Node:
        return self.cluster.home(key)

    def _failed_softly(self, error: MemcachedError) -> None:
        """A replica's failure that cost the call nothing (another replica answered):
        logged once per episode, never raised; the key is outdated on that replica."""
        ignored_failures.failed(f"node {error.node}", f"{type(error).__name__}: {error.reason} "
                                "(another replica answered)",
                                label=f"node {error.node} of {self.cache_name}")

    def _failed(self, error: MemcachedError, fallback: Any = None) -> Any:
        """Raise ``error``, or with IGNORE_EXCEPTIONS (the default) log and count it,
        giving ``fallback``."""
        if not self.ignore_exceptions:
            raise error.of_cache(self.cache_name)
        # Logged once per episode and then summarized: a down node fails every call.
        ignored_failures.failed(f"node {error.node}", f"{type(error).__name__}: {error.reason}",
                                label=f"node {error.node} of {self.cache_name}")
        node = self.cluster.by_name.get(error.node)
        if node is not None:
            node.ignored += 1
        return fallback

    # --- plans: single keys -----------------------------------------------------------

    def _read(self, stored_key: str, default: Any, io: Transport) -> Plan:
        try:
            found = yield from self.replicas.read(stored_key, io)
        except MemcachedError as exc:
            return self._failed(exc, default)
        return self._found(found, default, stored_key)

    def _found(self, found: tuple[bytes, int] | None, default: Any, stored_key: str) -> Any:
        """A read's ``(data, flags)`` (None: a miss) as the caller's value, or ``default``
        (a corrupt entry is a logged miss)."""
        if found is None:
            return default
        value = self.decode(found[0], found[1], stored_key)
        return default if value is MISSING else value

    def _set(self, key: Any, value: Any, timeout: Any, version: int | None, io: Transport) -> Plan:
        """A value the server refuses (too large even compressed, out of memory) fails no
        call, whatever IGNORE_EXCEPTIONS says: it is logged (once, then summarized), and
        the older value deleted so it is never read again."""
        stored_key = self.make_and_validate_key(key, version=version)
        expire = self.expire_time(timeout)
        if self._stale_copies and not stampede.is_side_key(key):
            # get_or_set's stale copies of the entry go with it (docs/stampede.rst).
            if expire == EXPIRED:
                # Nothing to cache (a timeout of 0): the entry goes, and with it the
                # stale copies, as after delete (and as on MySQL).
                yield from self._writes.delete_entries({stored_key: key}, version, io)
            else:
                yield from self._writes.store_entries(
                    b"set", {stored_key: key}, {key: value}, timeout, version, io)
            return
        op, data, saved = self._store_request(b"set", stored_key, value, expire)
        yield from self._stored(stored_key, key, op, data, saved, io)

    def _store_request(self, name: bytes, stored_key: str, value: Any,
                       expire: int) -> tuple[wire.Op, bytes, int]:
        """What a ``set`` or an ``add`` (``name``) sends: its op, the value's bytes and
        the bytes compression saved."""
        data, flags, saved = self.codec.encode_measured(value, stored_key)
        return wire.store(name, stored_key.encode(), data, flags, expire), data, saved

    def _stored(self, stored_key: str, key: Any, op: wire.Op, data: bytes, saved: int,
                io: Transport) -> Plan:
        """``set``'s request (``op``, a store of ``data``) written where the key goes."""
        try:
            yield from self.replicas.write(stored_key, op, io, len(stored_key) + len(data), saved)
        except MemcachedError as exc:
            yield from self._set_failed(exc, stored_key, key, io)

    def _set_failed(self, error: MemcachedError, stored_key: str, key: Any, io: Transport) -> Plan:
        """What a failed ``set`` does: a refused value is logged and the older value
        deleted; any other failure is ``_failed``'s."""
        if isinstance(error, Refused):
            self._refused(error, key)
            yield from self._forget(stored_key, key, io)
        else:
            self._failed(error)

    def _add(self, key: Any, value: Any, timeout: Any, version: int | None, io: Transport) -> Plan:
        """A refused value (as ``set``'s) makes ``add`` return False and leaves the entry
        that is there. One winner, with REPLICAS too (``Replicas.add``)."""
        stored_key = self.make_and_validate_key(key, version=version)
        return (yield from self.replicas.add(stored_key, key, value, self.expire_time(timeout),
                                             timeout, version, io))

    def _refused(self, error: Refused, key: Any) -> None:
        """A value the node refused to store, logged with the caller's ``key``."""
        self._refused_line(error.node, key, error.reason)

    def _refused_line(self, node: str, key: Any, reason: str) -> None:
        """A value ``node`` refused to store (``reason``), logged with the caller's ``key``."""
        refusals.failed(f"node {node}", f"{key!r}: {reason}",
                        label=f"node {node} of {self.cache_name}")

    def _store_entries(self, *args: Any) -> Plan:
        """(``Replicas.add``'s, with REPLICAS 1 and STALE_TIMEOUT: ``Writes.store_entries``)"""
        return self._writes.store_entries(*args)

    def _delete_stale_copies(self, *args: Any) -> Plan:
        """(``Replicas.add``'s, with STALE_TIMEOUT: ``Writes.delete_stale_copies``)"""
        return self._writes.delete_stale_copies(*args)

    def store_entry(
        self, key: Any, value: Any, timeout: Any, version: int | None, io: Transport,
        copy: tuple[bytes, float | None] | None = None, after: list[wire.Op] | None = None,
    ) -> Plan:
        """get_or_set's winner stores its value (``memcached.lease``): a ``set`` of the
        entry that leaves its stale copies alone (they are the winner's to write, not to
        delete, unlike a plain ``set``'s). With ``copy`` (the meta store's copy: its key
        and lifetime), the copy first, the entry, then ``after``, in one request on the
        entry's node. A refused value and a failure are handled as ``set``'s."""
        stored_key = self.make_and_validate_key(key, version=version)
        data, flags, saved = self.codec.encode_measured(value, stored_key)
        ops = []
        riders: tuple[str, ...] = ()
        if copy is not None:
            copy_key = copy[0].decode()
            # Encrypted, each item is bound to its own key; else the same bytes serve both.
            copy_data, copy_flags = (data, flags) if self.codec.encryption is None else \
                self.codec.encode(value, copy_key)
            ops.append(wire.meta_store(copy[0], copy_data, copy_flags, wire.exptime(copy[1])))
            riders = (copy_key,)
        entry = len(ops)
        ops.append(wire.store(b"set", stored_key.encode(), data, flags,
                              self.expire_time(timeout)))
        ops.extend(after or ())
        sent = len(stored_key) + len(data)
        try:
            # The lease's release (``after``) on the deciding replica only.
            every = yield from self.replicas.write(
                stored_key, wire.pipeline(ops[:entry + 1]), io, sent, saved, riders,
                first_op=wire.pipeline(ops),
            )
        except MemcachedError as exc:
            self._failed(exc)
            return
        refused = next((r[entry] for r in every if isinstance(r[entry], wire.ErrorReply)), None)
        if refused is not None:
            self._refused_line(self._node(stored_key).name, key, str(refused))
            yield from self._forget(stored_key, key, io)

    def _forget(self, stored_key: str, key: Any, io: Transport) -> Plan:
        """Delete a key whose new value was refused, so the old one is never read again."""
        try:
            yield from self.replicas.write(stored_key, wire.delete(stored_key.encode()), io)
        except MemcachedError as exc:  # remembered as outdated by the write
            logger.warning("Could not delete %r of %s after its value was refused (it is "
                           "deleted when its node answers again): %s", key, self.cache_name, exc)

    def _touch(self, key: Any, timeout: Any, version: int | None, io: Transport) -> Plan:
        key = self.make_and_validate_key(key, version=version)
        return (yield from self._changed(key, self._touch_op(key, timeout), io))

    def _touch_op(self, stored_key: str, timeout: Any) -> wire.Op:
        return wire.touch(stored_key.encode(), self.expire_time(timeout))

    def _changed(self, stored_key: str, op: wire.Op, io: Transport) -> Plan:
        """A ``touch`` or a ``delete`` where the key goes: whether it found the key."""
        try:
            return any((yield from self.replicas.write(stored_key, op, io)))
        except MemcachedError as exc:
            return self._failed(exc, False)

    def _delete(self, key: Any, version: int | None, io: Transport) -> Plan:
        if self._stale_copies and not stampede.is_side_key(key):
            stored_key = self.make_and_validate_key(key, version=version)
            deleted, _ = yield from self._writes.delete_entries({stored_key: key}, version, io)
            return stored_key in deleted
        key = self.make_and_validate_key(key, version=version)
        return (yield from self._changed(key, wire.delete(key.encode()), io))

    def _ttl(self, key: Any, version: int | None, io: Transport) -> Plan:
        key = self.make_and_validate_key(key, version=version)
        try:
            return (yield from self.replicas.ttl(key, io))
        except Unsupported:
            raise  # the server's version, not a failure: IGNORE_EXCEPTIONS does not hide it
        except MemcachedError as exc:
            return self._failed(exc, 0)

    # --- plans: counters --------------------------------------------------------------

    def _incr(self, key: Any, delta: int, version: int | None, io: Transport) -> Plan:
        """Add ``delta`` (negative to subtract); the entry keeps its expiry time.

        Signed 64-bit counters, the same as MySQLCache's (docs/guarantees.rst): results
        below zero are stored; a result outside the range raises ``OverflowError`` and
        leaves the value unchanged. A missing key raises ``ValueError``, a value that is
        not an integer ``TypeError``. How a node counts: ``memcached.counters``.
        """
        check_delta(delta)
        stored_key = self.make_and_validate_key(key, version=version)
        value = yield from self.replicas.incr(stored_key, delta, key, self._counters.count, io)
        if value is None:
            raise key_not_found(key, version)
        return value

    # --- plans: many keys, one pipelined request per node, all nodes at once -----------

    def _get_many(self, keys: Iterable[Any], version: int | None, io: Transport) -> Plan:
        key_map = self.make_keys(keys, version)
        if not key_map:
            return {}
        found: dict[Any, Any] = {}
        self._decoded((yield from self.replicas.get_many(key_map, io)), key_map, found)
        return found

    def _decoded(
        self, values: dict[bytes, tuple[bytes, int]], key_map: dict[str, Any],
        found: dict[Any, Any],
    ) -> None:
        """The values read, decoded (each under its stored key) into ``found`` under the
        caller's keys; a corrupt one is a logged miss."""
        for key_bytes, (data, flags) in values.items():
            stored_key = key_bytes.decode()
            value = self.decode(data, flags, stored_key)
            if value is not MISSING:
                found[key_map[stored_key]] = value

    def _set_many(
        self, data: Mapping[Any, Any], timeout: Any, version: int | None, io: Transport
    ) -> Plan:
        """The keys returned are those not stored: their node failed or was down, or it
        refused the value (too large, out of memory; logged, and its older value deleted,
        as ``set`` does)."""
        key_map = self.make_keys(data, version)
        if not key_map:
            return []
        if self._stale_copies and self.expire_time(timeout) == EXPIRED:  # as set's
            _, failed = yield from self._writes.delete_entries(key_map, version, io)
            return [key_map[key] for key in failed]
        written = yield from self._writes.store_entries(b"set", key_map, data, timeout, version, io)
        return [key_map[key] for key in written.failed + written.refused]

    def _delete_many(self, keys: Iterable[Any], version: int | None, io: Transport) -> Plan:
        key_map = self.make_keys(keys, version)
        if self._stale_copies:
            yield from self._writes.delete_entries(key_map, version, io)
        else:
            yield from self._writes.delete_keys(list(key_map), io, report=True)

    def _clear(self, io: Transport) -> Plan:
        """Flush every node (memcached has no per-prefix delete).

        A node that misses the flush (down, or failing now) is flushed when it returns,
        before it serves anything. A node that does not forward ``flush_all`` — a proxy
        such as twemproxy, known by its first refusal — cannot be flushed: the others
        are, then ``Unsupported`` is raised, whatever IGNORE_EXCEPTIONS says, and nothing
        is left pending there (later calls are not affected).
        """
        refusing = [node for node in self._nodes if node.flushes is False]
        reachable = [node for node in self._nodes
                     if node.flushes is not False and node.health.may_try()]
        batches = [fanout.flush_batch(node) for node in reachable]
        yield from fan_out(batches, io)
        errors: list[MemcachedError] = []
        for batch in batches:
            if isinstance(batch.error, Unsupported):  # it closed the connection on it
                try:  # still answering: it is flush_all that it refuses, not a failure
                    yield from batch.node.request(wire.fence(), io)
                except MemcachedError as exc:
                    errors.append(exc)  # it fails now: as any node that missed the flush
                    continue
                self._refuses_flush(batch.node)
                refusing.append(batch.node)
            elif batch.error is not None:
                errors.append(batch.error)
            else:
                batch.node.flushes = True
        for node in self._nodes:
            if node not in reachable and node not in refusing:
                errors.append(NodeDown(node.name, "marked down: flushed when it returns"))
        for error in errors:
            self.cluster.by_name[error.node].outdated.add_everything()
        for error in errors:
            self._failed(error)
        if refusing:
            names = ", ".join(node.name for node in refusing)
            raise Unsupported(names, "clear() cannot empty it: it does not forward flush_all "
                              "(a proxy such as twemproxy); flush the servers behind it")

    @staticmethod
    def _refuses_flush(node: Node) -> None:
        """Remember that ``node`` does not forward ``flush_all``, and say so once."""
        if node.flushes is not False:
            node.flushes = False
            logger.warning(
                "memcached node %s refused flush_all (a proxy such as twemproxy does not "
                "forward it): clear() cannot empty it, and raises Unsupported", node.name,
            )

    # --- observability and maintenance (blocking only: not request-path calls) --------

    def storage(self) -> frozenset[str]:
        return frozenset(f"memcached node {node.name}" for node in self._nodes)

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per-node counters of this process, shared by every instance of this cache."""
        return {node.name: node.metrics() for node in self._nodes}

    def sample_entries(self, count: int) -> list[tuple[str, bytes, int]]:
        """Up to ``count`` entries picked at random across the nodes, as stored:
        ``(stored key, bytes, flags)`` (``codec.opened`` decrypts one). For training a compression dictionary
        (``kvcache_train_dictionary``): it lists every key of every node, so it is no
        request-path call. A node that fails raises (no IGNORE_EXCEPTIONS here)."""
        return sampling.sample_entries(self._nodes, count)

    def server_stats(self) -> dict[str, dict[str, Any]]:
        """memcached's ``stats`` of every node; ``{"error": ..., "problem": ...}`` for a
        node that fails (``MemcachedError.problem``: refused, timeout, unsupported...)."""
        stats: dict[str, dict[str, Any]] = {}
        for node in self._nodes:
            try:
                stats[node.name] = node.call(wire.stats())
            except MemcachedError as exc:
                stats[node.name] = {"error": str(exc),
                                    "problem": exc.problem}
        return stats

