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
IO it needs and is told its driver's transport: ``get`` runs ``self._get(..., BLOCKING)``
with ``run`` on blocking sockets, ``aget`` runs ``self._get(..., ASYNCIO)`` with ``arun``
on the event loop's own connections — native asyncio, no thread (docs/async.rst). Inside
a plan a request goes through the node's exchange in the plan's own driver, one way:
``yield from node.request(op, io)``, or for many nodes at once ``yield from
fan_out(batches, io)``. Everything else (routing, failover, IGNORE_EXCEPTIONS, counters,
clean-up of outdated copies) is plain code in the plan, so the two APIs cannot drift
apart.
"""
from __future__ import annotations

import inspect
import logging
import random
import time
from typing import Any, Callable, Collection, Iterable, Mapping, NamedTuple

from django.core.cache.backends.base import DEFAULT_TIMEOUT, BaseCache, InvalidCacheKey

from django_kvcache import stampede
from django_kvcache.base import (
    MISSING,
    KVCache,
    check_delta,
    counter_overflow,
    delegate_to_sync,
    key_not_found,
)
from django_kvcache.codec import FLAG_INTEGER, FLAG_LONG, INT64_MAX, INT64_MIN
from django_kvcache.failure_log import FailureLog
from django_kvcache.memcached import (
    MemcachedError,
    NodeBusy,
    NodeDown,
    NodeError,
    PoolExhausted,
    Refused,
    ServerError,
    Unsupported,
)
from django_kvcache.memcached import aio, fanout, lease, sampling, wire
from django_kvcache.memcached.locks import MemcachedLockStore
from django_kvcache.memcached.cluster import Placement, Usable, cluster_for
from django_kvcache.memcached.node import Node
from django_kvcache.memcached.exchange import ASYNCIO, BLOCKING, Batch, Transport, fan_out
from django_kvcache.memcached.routing import parse_location
from django_kvcache.memcached.wire import EXPIRED, THIRTY_DAYS
from django_kvcache.options import THIS_CACHE, TOP_LEVEL, TOP_LEVEL_HINTS, flag
from django_kvcache.signals import node_up
from django_kvcache.steps import Plan, Sleep, arun, run

MAX_KEY_BYTES = 250
CAS_PATIENCE = 5.0  # seconds of compare-and-swap retries before incr gives up
#: Failures where the node did not answer (IGNORE_EXCEPTIONS turns them into misses).
UNREACHABLE = (NodeError, PoolExhausted)

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


def _unserved(line: bytes) -> bool:
    """A reply line that says the server could not serve the command (``SERVER_ERROR``
    other than a refused value: a proxy whose server for the key is down)."""
    return line.startswith(b"SERVER_ERROR") and not wire.refuses_value(line)


class Written(NamedTuple):
    """What a store round did, by stored key."""

    stored: list[str]
    refused: list[str]  # the value refused by its node (too large, out of memory)
    failed: list[str]  # the node failed, was down, or could not serve the key


class Round(NamedTuple):
    """One round of requests: where its keys went, and each node's batch."""

    placement: Placement
    batches: list[fanout.Batch]


NO_ROUND = Round(Placement({}, [], []), [])


class MemcachedCache(KVCache):
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
        #: REPLICAS: each key on its first N nodes (docs/memcached.rst, Replicas).
        self.replicated = self.cluster.replicas > 1
        #: get_or_set keeps stale copies beside its entries, which deletes remove too.
        self._stale_copies = self.stampede is not None and self.stampede.stale_timeout is not None

    # --- the Django API: each sync method and its async twin run the same plan ---------

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        return run(self._get(key, default, version, BLOCKING))

    async def aget(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        return await arun(self._get(key, default, version, ASYNCIO))

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        run(self._store(b"set", key, value, timeout, version, BLOCKING))

    async def aset(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        await arun(self._store(b"set", key, value, timeout, version, ASYNCIO))

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        return run(self._store(b"add", key, value, timeout, version, BLOCKING))

    async def aadd(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        return await arun(self._store(b"add", key, value, timeout, version, ASYNCIO))

    def touch(self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None) -> bool:
        return run(self._touch(key, timeout, version, BLOCKING))

    async def atouch(
        self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        return await arun(self._touch(key, timeout, version, ASYNCIO))

    def delete(self, key: Any, version: int | None = None) -> bool:
        return run(self._delete(key, version, BLOCKING))

    async def adelete(self, key: Any, version: int | None = None) -> bool:
        return await arun(self._delete(key, version, ASYNCIO))

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
            failed=self._failed, io=io, elsewhere=self._held_elsewhere if self.replicated else None,
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

    def validate_key(self, key: str) -> None:
        """memcached's rules in UTF-8 bytes: at most 250, no spaces or control characters.

        The messages are Django's own (``memcache_key_warnings``), word for word; only
        the length is counted in bytes, where Django counts characters.
        """
        if key.isascii() and len(key) <= MAX_KEY_BYTES and key.isprintable() and " " not in key:
            return  # the common case, in three C calls
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
        return wire.exptime(self.timeout_seconds(timeout))

    # --- routing and failure policy (the cluster's, with this cache's FAILOVER) -------

    def _node(self, key: str, failed: Collection[Node] = ()) -> Node:
        """The key's node; with REPLICAS the deciding replica (``Cluster.primary``: the
        first up, for every process alike), passing over those that ``failed`` earlier in
        the call."""
        if self.replicated:
            return self.cluster.primary(key, self.failover, failed)
        return self.cluster.node(key, self.failover)

    def _behind(self, node: Node) -> bool:
        """With REPLICAS: whether ``node`` may lack entries its key's other replicas hold
        — it is down, or it failed (or was found restarted) less than this cache's
        default TIMEOUT ago (forever with TIMEOUT None): entries written before with
        that timeout have expired since. A miss there is asked of another replica."""
        if node.health.down_until:
            return True
        since = node.behind_since
        if not since:
            return False
        return self.default_timeout is None or time.monotonic() - since < self.default_timeout

    def _read_order(self, key: str, turn: int) -> list[Node]:
        """The replicas a read of ``key`` asks, in turn: starting at ``turn`` (spread over
        calls), those that are behind last."""
        replicas = self.cluster.replica_set(key)
        start = turn % len(replicas)
        rotated = replicas[start:] + replicas[:start]
        if any(map(self._behind, rotated)):
            rotated.sort(key=self._behind)  # stable: the rotation stays otherwise
        return rotated

    def _home(self, key: str) -> Node:
        return self.cluster.home(key)

    def _place(self, keys: Iterable[str]) -> Placement:
        """Where a write (or a get without replicas) goes: with REPLICAS, every replica
        that may be tried."""
        if self.replicated:
            side = (lambda key: (lease.meta_stale_key(key),)) if self._stale_copies else None
            return self.cluster.place_everywhere(keys, self.failover, side)
        return self.cluster.place(keys, self.failover)

    def _failed_softly(self, error: MemcachedError) -> None:
        """A replica's failure that cost the call nothing (another replica answered):
        logged once per episode, never raised; the key is outdated on that replica."""
        ignored_failures.failed(f"node {error.node}", f"{type(error).__name__}: {error.reason} "
                                "(another replica answered)",
                                label=f"node {error.node} of {self.cache_name}")

    def _batch_errors(self, batches: list[fanout.Batch]) -> list[MemcachedError]:
        """The errors of a round's batches that are the call's. With REPLICAS, a batch
        whose every key another replica answered for cost nothing: logged, not returned."""
        errors = [batch.error for batch in batches if batch.error is not None]
        if not self.replicated or not errors:
            return errors
        answered = self._answered_keys(batches)
        errors = []
        for batch in batches:
            if batch.error is None:
                continue
            if all(key in answered for key in batch.keys):
                self._failed_softly(batch.error)
            else:
                errors.append(batch.error)
        return errors

    @staticmethod
    def _answered_keys(batches: list[fanout.Batch]) -> set[str]:
        """The keys some node answered for (a reply other than a proxy's SERVER_ERROR)."""
        return {key for batch in batches if batch.error is None and isinstance(batch.result, list)
                for key, line in zip(batch.keys, batch.result) if not _unserved(line)}

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

    def _report(
        self, placement: Placement, batches: list[fanout.Batch], after: Round | None = None,
        more: list[MemcachedError] | None = None,
    ) -> None:
        """After a multi-key call (and the round ``after`` it): raise (or log) what went
        wrong, once every node is done, and a node that was down once only; ``more``:
        errors found in the replies (keys a proxy could not serve)."""
        errors = placement.errors + self._batch_errors(batches)
        if after is not None:
            reported = {error.node for error in placement.errors}
            errors += [e for e in after.placement.errors if e.node not in reported]
            errors += self._batch_errors(after.batches)
        for error in errors + (more or []):
            self._failed(error)

    # --- plans: single keys -----------------------------------------------------------

    def _get(self, key: Any, default: Any, version: int | None, io: Transport) -> Plan:
        stored_key = self.make_and_validate_key(key, version=version)
        try:
            if self.replicated:
                found = yield from self._read_replicas(stored_key, io)
            else:
                node = self.cluster.node(stored_key, self.failover)
                found = yield from node.get(stored_key.encode(), io)
        except MemcachedError as exc:
            return self._failed(exc, default)
        if found is None:
            return default
        value = self.decode(found[0], found[1], stored_key)
        return default if value is MISSING else value

    def _read_replicas(self, stored_key: str, io: Transport) -> Plan:
        """A single-key read with REPLICAS: one replica asked (``_read_order``); the next
        when it is down or fails, or when it misses and may lack the entry (``_behind``).
        Nothing older than the last acknowledged write can be read: a replica that
        missed a write deletes the key before it serves again (``stale``). The last error
        is raised when no replica answered."""
        encoded = stored_key.encode()
        error: MemcachedError | None = None
        turn = next(self.cluster.turns)
        replicas = self.cluster.replica_set(stored_key)
        node = replicas[turn % len(replicas)]
        asked = None
        if not node.health.down_until and not node.behind_since:
            asked = node
            # The usual case: this turn's replica is up and never failed: it answers —
            # unless this very request found it restarted (a miss there is then asked on).
            try:
                found = yield from node.get(encoded, io)
            except MemcachedError as exc:
                error = exc  # then every replica in turn
            else:
                if found is not None or not node.behind_since:
                    return found
        answered = asked is not None and error is None  # a miss there is an answer
        nodes = [n for n in self._read_order(stored_key, turn) if n is not asked]
        if self.failover:
            nodes.append(None)  # type: ignore[arg-type]  # every replica down: the next node
        for node in nodes:
            if node is None:
                if answered:
                    break
                node = self.cluster.beyond_replicas(stored_key)
                if node is None:
                    break
            elif node.health.down_until and not node.health.may_try():
                error = error or node.skipped()
                continue
            try:
                found = yield from node.get(encoded, io)
            except MemcachedError as exc:
                error = exc
                continue
            answered = True
            if found is not None or not self._behind(node):
                break
        else:
            found = None
        if not answered:
            assert error is not None
            raise error
        if error is not None:
            self._failed_softly(error)
        return found

    def _write_everywhere(
        self, key: str, op: wire.Op, io: Transport, sent: int = 0, saved: int = 0,
        riders: tuple[str, ...] = (), first_op: wire.Op | None = None,
    ) -> Plan:
        """A single-key write with REPLICAS: ``op`` on every replica that may be tried, in
        one round trip to each, all at once (``first_op`` instead on the one that decides,
        ``Cluster.primary``'s choice). A replica that is skipped or fails has the key and
        its ``riders`` marked outdated there. Returns the replies, the deciding replica's
        first; raises when no replica answered, and ``Refused`` when one refused the
        value (the caller deletes it everywhere, as after any refused ``set``)."""
        nodes = []
        for node in self.cluster.replica_set(key):
            if not node.health.down_until or node.health.may_try():
                nodes.append(node)
            else:
                node.outdated.add((key, *riders))
        if not nodes:  # every replica down: FAILOVER's next node, or the call fails
            side = (lambda _: riders) if riders else None
            placement = self.cluster.place_everywhere((key,), self.failover, side)
            if placement.stranded:
                raise placement.errors[0]
            nodes = list(placement.groups)
        # The deciding replica, as Cluster.primary picks it: the first up, else the first
        # that may be probed (the lease of get_or_set is released there).
        first = next((node for node in nodes if not node.health.down_until), nodes[0])
        nodes.remove(first)
        batches = [Batch(first, first_op or op, sent, saved)]
        batches += [Batch(node, op, sent, saved) for node in nodes]
        yield from self._write_round(batches, io, (key, *riders))
        replies, errors = [], []
        for batch in batches:
            if batch.error is None:
                replies.append(batch.result)
            elif isinstance(batch.error, Refused):
                errors.insert(0, batch.error)
            else:
                batch.node.outdated.add((key, *riders))
                errors.append(batch.error)
        if errors and isinstance(errors[0], Refused) or not replies:
            raise errors[0]
        for error in errors:
            self._failed_softly(error)
        return replies

    def _write_round(
        self, batches: list[fanout.Batch], io: Transport, keys: tuple[str, ...] = ()
    ) -> Plan:
        """A write's batches, all nodes at once. With REPLICAS, a round cut short (the
        call cancelled) has each batch not answered yet marked missed on its node (its
        keys, or ``keys`` for a single-key batch): it may have landed or not, and a
        replica never keeps a value its partners do not have."""
        try:
            yield from fan_out(batches, io)
        except BaseException:
            if self.replicated:
                for batch in batches:
                    if batch.result is None and batch.error is None:
                        batch.node.outdated.add([*(batch.keys or keys), *batch.side_keys])
            raise

    def _write(
        self, key: str, op: wire.Op, io: Transport, sent: int = 0, saved: int = 0,
        riders: tuple[str, ...] = (),
    ) -> Plan:
        """A single-key write on the key's node (or its failover node), which is credited
        with ``sent`` and ``saved`` bytes. A write that fails or is skipped is remembered
        as missed, with the ``riders`` (side keys written in the same request). With
        REPLICAS, on every replica (``_write_everywhere``): the deciding one's reply."""
        if self.replicated:
            return (yield from self._write_everywhere(key, op, io, sent, saved, riders))[0]
        try:
            return (yield from self._node(key).request(op, io, sent, saved))
        except Refused:
            raise  # refused, not missed: the node answered
        except MemcachedError as exc:
            self.cluster.missed_write(key, exc)
            if riders:
                self._home(key).outdated.add(riders)
            raise

    def _store(
        self, name: bytes, key: Any, value: Any, timeout: Any, version: int | None, io: Transport
    ) -> Plan:
        """``set`` or ``add``. A value the server refuses (too large even compressed, out
        of memory) fails no call, whatever IGNORE_EXCEPTIONS says: it is logged (once,
        then summarized), ``set`` deletes the older value so it is never read again and
        returns, ``add`` returns False and leaves the entry that is there."""
        stored_key = self.make_and_validate_key(key, version=version)
        expire = self.expire_time(timeout)
        if name == b"add" and self.replicated:
            return (yield from self._add_replicated(stored_key, key, value, expire, version, io))
        if self._stale_copies and not stampede.is_side_key(key):
            # get_or_set's stale copies of the entry go with it (docs/stampede.rst).
            if expire == EXPIRED and name == b"set":
                # Nothing to cache (a timeout of 0): the entry goes, and with it the
                # stale copies, as after delete (and as on MySQL).
                yield from self._delete_entries({stored_key: key}, version, io)
                return None
            written = yield from self._store_entries(
                name, {stored_key: key}, {key: value}, timeout, version, io
            )
            return stored_key in written.stored if name == b"add" else None
        data, flags, saved = self.codec.encode_measured(value, stored_key)
        op = wire.store(name, stored_key.encode(), data, flags, expire)
        try:
            stored = yield from self._write(stored_key, op, io, len(stored_key) + len(data), saved)
        except Refused as exc:
            refusals.failed(f"node {exc.node}", f"{key!r}: {exc.reason}",
                            label=f"node {exc.node} of {self.cache_name}")
            if name == b"set":
                yield from self._forget(stored_key, key, io)
            return False if name == b"add" else None
        except MemcachedError as exc:
            return self._failed(exc, False if name == b"add" else None)
        return bool(stored) if name == b"add" else None

    def _add_replicated(
        self, stored_key: str, key: Any, value: Any, expire: int, version: int | None,
        io: Transport,
    ) -> Plan:
        """``add`` with REPLICAS: one winner, and it loses to a value any replica holds.
        The ``add`` goes to the deciding replica (``Cluster.primary``: the first up, the
        same for every process) alone: one process stores there, the others lose. The
        winner there then copies the value to the other replicas with ``add`` too
        (:meth:`_add_elsewhere`): one that holds a live value (the decider restarted
        empty, or lost the key) makes the ``add`` lose, and that value is given back
        where ours was stored. Then, with STALE_TIMEOUT, the entry's stale copies are
        deleted after it, as after ``set``."""
        data, flags, saved = self.codec.encode_measured(value, stored_key)
        op = wire.store(b"add", stored_key.encode(), data, flags, expire)
        sent = len(stored_key) + len(data)
        failed: list[Node] = []  # deciders that failed this call: the next one decides
        while True:
            try:
                primary = self._node(stored_key, failed)
                stored = yield from primary.request(op, io, sent, saved)
            except Refused as exc:
                refusals.failed(f"node {exc.node}", f"{key!r}: {exc.reason}",
                                label=f"node {exc.node} of {self.cache_name}")
                return False
            except MemcachedError as exc:
                self._missed_on(stored_key, exc)  # (an add that may have landed: deleted)
                if self._next_decides(exc, len(failed)):
                    failed.append(self.cluster.by_name[exc.node])
                    continue
                return self._failed(exc, False)
            break
        if not stored:
            return False
        try:
            won = yield from self._add_elsewhere(primary, stored_key, op, data, io, saved)
        except BaseException:  # cancelled before every replica was asked: ours withdrawn
            primary.outdated.add((stored_key,))
            raise
        if won and self._stale_copies and not stampede.is_side_key(key):
            yield from self._delete_stale_copies({stored_key: key}, version, io)
        return won

    def _add_elsewhere(
        self, primary: Node, stored_key: str, op: wire.Op, data: bytes, io: Transport,
        saved: int,
    ) -> Plan:
        """After the deciding replica stored an ``add``: the same ``add`` on the other
        replicas. Whether the add won — no replica that answered held a live value. A
        replica that is down or fails has the key marked outdated there."""
        others = [node for node in self.cluster.replica_set(stored_key) if node is not primary]
        sent = len(stored_key) + len(data)
        copies = [Batch(node, op, sent, saved) for node in others if node.health.may_try()]
        for node in others:
            if node.health.down_until and all(batch.node is not node for batch in copies):
                node.outdated.add((stored_key,))
        if copies:
            yield from fan_out(copies, io)
        holder = None
        ours = [primary]
        for batch in copies:
            if batch.error is not None and not isinstance(batch.error, Refused):
                batch.node.outdated.add((stored_key,))
                self._failed_softly(batch.error)
            elif batch.error is None:
                if batch.result:
                    ours.append(batch.node)
                else:
                    holder = holder or batch.node
        if holder is None:
            return True
        yield from self._give_back(holder, ours, stored_key, data, io)
        return False

    def _give_back(
        self, holder: Node, ours: list[Node], stored_key: str, data: bytes, io: Transport
    ) -> Plan:
        """An ``add`` that lost to the live value ``holder`` has: on each replica of
        ``ours`` where our value still is (``gets``, then ``cas``: a write since then is
        left alone), the live value instead, with its remaining lifetime (meta commands),
        or without them a miss. A replica that fails has the key marked outdated."""
        encoded = stored_key.encode()
        live = None
        try:
            if (yield from holder.speaks_meta(io)):
                live = yield from holder.request(wire.meta_get(encoded), io)
        except MemcachedError as exc:
            self._failed_softly(exc)
        for node in ours:
            try:
                mine = yield from node.request(wire.gets_one(encoded), io)
                if mine is None or mine[0] != data:
                    continue  # written since: not ours to replace
                if live is None:
                    op = wire.cas(encoded, b"", 0, EXPIRED, mine[2])
                else:
                    lifetime = None if live[2] < 0 else max(live[2], 1)
                    op = wire.cas(encoded, live[0], live[1], wire.exptime(lifetime), mine[2])
                yield from node.request(op, io)
            except MemcachedError as exc:
                node.outdated.add((stored_key,))
                self._failed_softly(exc)

    def _delete_stale_copies(
        self, key_map: dict[str, Any], version: int | None, io: Transport
    ) -> Plan:
        """The stale copies of the entries (not the entries) deleted on every replica."""
        placement = self._place(key_map)
        copies = self._stale_copies_of(placement, key_map, version)
        assert copies is not None
        batches = [fanout.delete_batch(node, [], copies.riding.get(node))
                   for node in placement.groups]
        yield from self._write_round(batches, io)
        apart = yield from self._delete_round(copies.apart, io)
        self._missed(placement, batches, copies, apart)
        self._report(placement, batches, apart)

    def _next_decides(self, error: MemcachedError, attempt: int) -> bool:
        """With REPLICAS, after the deciding replica of ``add`` or ``incr`` failed on its
        ``attempt``-th try: whether the next replica decides instead (the failure then
        logged, not raised). So it does when the node failed — it is behind from then
        on, and ``Cluster.primary`` passes it over — and replicas are left."""
        if not (self.replicated and isinstance(error, NodeError)
                and not isinstance(error, (NodeDown, NodeBusy))):
            return False
        if error.node not in self.cluster.by_name or attempt + 1 >= self.cluster.replicas:
            return False
        self._failed_softly(error)
        return True

    def _missed_on(self, key: str, error: MemcachedError) -> None:
        """A single-key write that failed on one node: with REPLICAS the failed node only
        (the others did not miss it), or every replica when none could be tried."""
        if not self.replicated:
            self.cluster.missed_write(key, error)
            return
        failed = self.cluster.by_name.get(error.node)
        if isinstance(error, NodeDown) or failed is None:
            for node in self.cluster.replica_set(key):
                node.outdated.add((key,))
        else:
            failed.outdated.add((key,))

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
            if self.replicated:  # the lease's release (``after``) on the deciding replica only
                every = yield from self._write_everywhere(
                    stored_key, wire.pipeline(ops[:entry + 1]), io, sent, saved, riders,
                    first_op=wire.pipeline(ops),
                )
            else:
                every = [(yield from self._write(stored_key, wire.pipeline(ops), io, sent, saved,
                                                 riders))]
        except MemcachedError as exc:
            self._failed(exc)
            return
        refused = next((r[entry] for r in every if isinstance(r[entry], wire.ErrorReply)), None)
        if refused is not None:
            refusals.failed(f"node {self._node(stored_key).name}", f"{key!r}: {refused}",
                            label=f"node {self._node(stored_key).name} of {self.cache_name}")
            yield from self._forget(stored_key, key, io)

    def _forget(self, stored_key: str, key: Any, io: Transport) -> Plan:
        """Delete a key whose new value was refused, so the old one is never read again."""
        try:
            yield from self._write(stored_key, wire.delete(stored_key.encode()), io)
        except MemcachedError as exc:  # remembered as outdated by _write
            logger.warning("Could not delete %r of %s after its value was refused (it is "
                           "deleted when its node answers again): %s", key, self.cache_name, exc)

    def _touch(self, key: Any, timeout: Any, version: int | None, io: Transport) -> Plan:
        key = self.make_and_validate_key(key, version=version)
        op = wire.touch(key.encode(), self.expire_time(timeout))
        try:
            if self.replicated:
                return any((yield from self._write_everywhere(key, op, io)))
            return bool((yield from self._write(key, op, io)))
        except MemcachedError as exc:
            return self._failed(exc, False)

    def _delete(self, key: Any, version: int | None, io: Transport) -> Plan:
        if self._stale_copies and not stampede.is_side_key(key):
            stored_key = self.make_and_validate_key(key, version=version)
            deleted, _ = yield from self._delete_entries({stored_key: key}, version, io)
            return stored_key in deleted
        key = self.make_and_validate_key(key, version=version)
        try:
            if self.replicated:
                return any((yield from self._write_everywhere(key, wire.delete(key.encode()), io)))
            return bool((yield from self._write(key, wire.delete(key.encode()), io)))
        except MemcachedError as exc:
            return self._failed(exc, False)

    def _ttl(self, key: Any, version: int | None, io: Transport) -> Plan:
        key = self.make_and_validate_key(key, version=version)
        try:
            if self.replicated:  # the first replica that holds the key answers
                found = yield from self._first_holding(key, (), io, self._remaining)
                return 0 if found is None else found[0]
            return (yield from lease.ttl(self._node(key), key, io))
        except Unsupported:
            raise  # the server's version, not a failure: IGNORE_EXCEPTIONS does not hide it
        except MemcachedError as exc:
            return self._failed(exc, 0)

    @staticmethod
    def _remaining(node: Node, key: str, io: Transport) -> Plan:
        """``(seconds left,)`` of ``key`` on ``node`` (None: it never expires), or None
        when the node lacks it."""
        remaining = yield from lease.ttl(node, key, io)
        return None if remaining == 0 else (remaining,)

    def _held_elsewhere(self, key: str, asked: Node, io: Transport) -> Plan:
        """``(data, flags)`` of ``key`` on its first replica but ``asked`` that holds it,
        or None (get_or_set's lease store, when the decider lacks the entry)."""
        return (yield from self._first_holding(
            key, (asked,), io, lambda node, key, io: node.get(key.encode(), io)))

    def _first_holding(
        self, key: str, asked: Collection[Node], io: Transport,
        ask: Callable[[Node, str, Transport], Plan],
    ) -> Plan:
        """With REPLICAS: ``ask`` of the key's replicas but ``asked``, in rendezvous order,
        until one holds it (a reply other than None); None when none does. A replica down
        or failing is passed over (logged); the last error is raised when none answered."""
        error: MemcachedError | None = None
        answered = bool(asked)
        for node in self.cluster.replica_set(key):
            if node in asked:
                continue
            if node.health.down_until and not node.health.may_try():
                error = error or node.skipped()
                continue
            try:
                found = yield from ask(node, key, io)
            except Unsupported:
                raise
            except MemcachedError as exc:
                error = exc
                continue
            answered = True
            if found is not None:
                break
        else:
            found = None
        if error is not None:
            if not answered:
                raise error
            self._failed_softly(error)
        return found

    # --- plans: counters --------------------------------------------------------------

    def _incr(self, key: Any, delta: int, version: int | None, io: Transport) -> Plan:
        """Add ``delta`` (negative to subtract); the entry keeps its expiry time.

        Signed 64-bit counters, the same as MySQLCache's (docs/guarantees.rst): results
        below zero are stored; a result outside the range raises ``OverflowError`` and
        leaves the value unchanged. A missing key raises ``ValueError``, a value that is
        not an integer ``TypeError``.

        A value >= 0 plus 0 <= delta <= INT64_MAX is one server ``incr``. Everything
        else (negative deltas and values, deltas beyond 64 bits) is computed here and
        written with compare-and-swap, which keeps the item's remaining lifetime — on a
        node without the meta commands, what the classic protocol can do instead
        (:meth:`_incr_classic`).
        """
        check_delta(delta)
        caller_key, key = key, self.make_and_validate_key(key, version=version)
        # With REPLICAS: replicas that failed this call or lack the key, passed over.
        failed: list[Node] = []
        while True:
            try:
                node = self._node(key, failed)
                value = yield from self._count(node, key, delta, caller_key, io)
            except (Refused, Unsupported):
                raise  # refused, not missed: the node answered and changed nothing
            except MemcachedError as exc:
                self._missed_on(key, exc)
                if not isinstance(exc, UNREACHABLE):
                    raise  # the node answered (no meta commands, a key that kept changing)
                if self._next_decides(exc, len(failed)):
                    failed.append(self.cluster.by_name[exc.node])
                    continue
                # An unreachable node: raised, or under IGNORE_EXCEPTIONS (logged, counted)
                # the answer for a missing key: Django's contract has incr return the new
                # value or raise ValueError, which callers handle (django-ratelimit counts
                # from its initial value then). Django's PyMemcacheCache with ignore_exc
                # returns False instead — neither a count nor a miss (docs/memcached.rst,
                # incr and decr).
                self._failed(exc)
                value = None
            except BaseException as exc:
                if not isinstance(exc, Exception):  # cancelled: it may count there yet
                    self._count_cut_short(key, [node])
                raise
            else:
                if value is None and self._next_may_hold(key, failed + [node]):
                    failed.append(node)  # restarted empty, or lost the key: the next counts
                    continue
            break
        if value is None:
            raise key_not_found(caller_key, version)
        if self.replicated:
            yield from self._incr_other_replicas(node, key, delta, caller_key, io, failed)
        return value

    def _next_may_hold(self, key: str, asked: list[Node]) -> bool:
        """With REPLICAS, after a replica answered that it lacks a counter: whether a
        replica not ``asked`` yet is up, so that the counter is counted on the first
        replica that holds it."""
        return self.replicated and any(
            node not in asked and not node.health.down_until
            for node in self.cluster.replica_set(key)
        )

    def _count(self, node: Node, key: str, delta: int, caller_key: Any, io: Transport) -> Plan:
        """``delta`` added on ``node``: the new value, or None when it lacks the key."""
        if 0 <= delta <= INT64_MAX:
            return (yield from self._incr_on_server(node, key, delta, caller_key, io))
        return (yield from self._incr_here(node, key, delta, caller_key, io))

    def _incr_other_replicas(
        self, primary: Node, key: str, delta: int, caller_key: Any, io: Transport,
        failed: list[Node],
    ) -> Plan:
        """With REPLICAS, once the deciding replica counted: every other replica applies
        the same delta itself (one after another), so they converge — increments
        commute; their results are not compared (concurrent calls make them differ on
        the way). One that is down, fails or cannot apply the delta (it overflows there,
        holds no integer) has the key marked outdated: deleted there before it serves
        again. One that has no such key stays
        without it. A replica that was unreachable during the call is skipped: the key
        is outdated there."""
        # (a failed one has the key marked outdated already)
        others = [node for node in self.cluster.replica_set(key)
                  if node is not primary and node not in failed]
        for index, node in enumerate(others):
            if node.health.down_until and not node.health.may_try():
                node.outdated.add((key,))
                continue
            try:
                yield from self._count(node, key, delta, caller_key, io)
            except MemcachedError as exc:
                node.outdated.add((key,))
                self._failed_softly(exc)
            except (OverflowError, TypeError) as exc:
                node.outdated.add((key,))
                logger.warning("memcached node %s: the replica of %r differs from the counter "
                               "on %s (%s); deleted there", node.name, caller_key,
                               primary.name, exc)
            except BaseException:  # cancelled: this replica and the next may lack it
                self._count_cut_short(key, [primary, *others[:index]])
                raise

    def _count_cut_short(self, key: str, counted: list[Node]) -> None:
        """With REPLICAS, an ``incr`` cut short (cancelled, interrupted) once it may have
        counted on some replica: every replica but those that ``counted`` (for the one
        asked then, it may land) has the key marked missed, so that none keeps a count
        below the others' — an ``aincr`` acknowledged later would otherwise be read
        lower there."""
        if self.replicated:
            for node in self.cluster.replica_set(key):
                if node not in counted:
                    node.outdated.add((key,))

    def _incr_on_server(
        self, node: Node, key: str, delta: int, caller_key: Any, io: Transport
    ) -> Plan:
        """The server's ``incr``, which counts modulo 2**64, kept to the signed range.

        From a stored value v in [0, 2**64), the reply is v + delta, or v + delta - 2**64
        when it wrapped, which is then below ``delta``. A wrapped reply or one above
        INT64_MAX is undone by adding 2**64 - delta: modulo 2**64 that restores v exactly,
        whatever other increments ran in between (a CAS-conditional undo would not: an
        overflow on top of ours can wrap the value back into range, which looks like a
        ``set``). Until the undo lands (one round trip) other clients can read the
        out-of-range number, and their increments of the key raise ``OverflowError``
        too; a ``set`` landing inside that round trip is shifted by the undo
        (docs/guarantees.rst, Counters).
        """
        try:
            value = yield from node.request(wire.incr(key.encode(), delta), io)
        except Refused as exc:
            if not exc.client_error:
                raise
            # "non-numeric value": a negative or non-integer value
            return (yield from self._incr_here(node, key, delta, caller_key, io))
        if value is None or delta <= value <= INT64_MAX:
            return value
        if delta:  # a failed undo raises, and the key is deleted as outdated (see incr)
            yield from node.request(wire.incr(key.encode(), 2**64 - delta), io)
        raise counter_overflow(caller_key, delta)

    def _incr_here(
        self, node: Node, key: str, delta: int, caller_key: Any, io: Transport
    ) -> Plan:
        """What the server's ``incr`` cannot do (negative deltas and values, deltas beyond
        64 bits): compare-and-swap on the meta commands, or without them (memcached
        before 1.6.6, a proxy such as twemproxy) what the classic protocol can do."""
        if (yield from node.speaks_meta(io)):
            return (yield from self._add_with_cas(node, key, delta, caller_key, io))
        return (yield from self._incr_classic(node, key, delta, caller_key, io))

    def _incr_classic(
        self, node: Node, key: str, delta: int, caller_key: Any, io: Transport
    ) -> Plan:
        """Without the meta commands: a decrement is memcached's own ``decr`` — atomic,
        the lifetime kept, and like it (and Django's ``PyMemcacheCache``) it stops at 0,
        never below. Anything else (a negative stored value, a delta beyond 64 bits)
        would have to rewrite the counter without its lifetime, which the classic
        protocol cannot read: ``MetaCommandsMissing``, the counter unchanged — after the
        answers that need no write: a missing key (None), a value that is not an integer
        (``TypeError``), a result beyond 64 bits (``OverflowError``)."""
        encoded_key = key.encode()
        if -INT64_MAX <= delta < 0:
            try:
                return (yield from node.request(wire.decr(encoded_key, -delta), io))
            except Refused as exc:
                if not exc.client_error:
                    raise  # "non-numeric value": read it to say which
        found = yield from node.request(wire.get_one(encoded_key), io)
        if found is None:
            return None
        value = self._counter_value(found[0], found[1], key, caller_key)
        if value is MISSING:
            return None
        if not INT64_MIN <= value + delta <= INT64_MAX:
            raise counter_overflow(caller_key, delta)
        raise lease.MetaCommandsMissing(
            node.name, f"incr/decr of {caller_key!r} (from {value}, by {delta}) needs the meta "
            "commands (memcached >= 1.6.6; proxies such as twemproxy do not forward them): "
            "the classic protocol cannot keep the entry's lifetime; unchanged"
        )

    def _add_with_cas(
        self, node: Node, key: str, delta: int, caller_key: Any, io: Transport
    ) -> Plan:
        """``incr`` computed here and stored only if the item did not change meanwhile
        (compare-and-swap on the meta commands, which keep the item's lifetime); retried
        while others change it, for up to CAS_PATIENCE seconds.

        Like MySQLCache, only values stored as integers count (a pickled int beyond 64
        bits raises ``TypeError``); a corrupt one is a logged miss.
        """
        encoded_key = key.encode()
        deadline = time.monotonic() + CAS_PATIENCE
        while time.monotonic() < deadline:
            found = yield from node.request(wire.meta_get(encoded_key), io)
            if found is None:
                return None
            data, flags, ttl, cas = found
            value = self._counter_value(data, flags, key, caller_key)
            if value is MISSING:
                return None
            result = value + delta
            if not (INT64_MIN <= value <= INT64_MAX and INT64_MIN <= result <= INT64_MAX):
                raise counter_overflow(caller_key, delta)  # (beyond: another's undo is due)
            ttl = yield from self._absolute_if_long(node, ttl, io)
            new_data, new_flags = self.codec.encode(result, key)
            swapped = yield from node.request(
                wire.meta_cas(encoded_key, new_data, new_flags, ttl, cas), io
            )
            if swapped:
                return result
            yield Sleep(random.random() / 1000)  # someone else won: let them get out of the way
        raise MemcachedError(node.name, f"{key!r} kept changing for {CAS_PATIENCE} s of retries")

    def _counter_value(self, data: bytes, flags: int, key: str, caller_key: Any) -> Any:
        """A stored integer (read under the stored ``key``); ``TypeError`` naming the
        ``caller_key`` for any other value, MISSING when corrupt."""
        if flags not in (FLAG_INTEGER, FLAG_LONG):
            raise TypeError(f"The value of key '{caller_key}' is not an integer")
        return self.decode(data, flags, key)

    @staticmethod
    def _absolute_if_long(node: Node, ttl: int, io: Transport) -> Plan:
        """A remaining lifetime as memcached takes it back: over 30 days, a Unix time on
        the server's own clock (ours runs up to 2 s ahead: it would stretch the lifetime
        at every update)."""
        if ttl <= THIRTY_DAYS:
            return ttl
        return ttl + (yield from node.request(wire.stats(), io))["time"]

    # --- plans: many keys, one pipelined request per node, all nodes at once -----------

    def _get_many(self, keys: Iterable[Any], version: int | None, io: Transport) -> Plan:
        key_map = self.make_keys(keys, version)
        if not key_map:
            return {}
        if self.replicated:
            return (yield from self._get_many_replicated(key_map, io))
        placement = self._place(key_map)
        batches = [fanout.get_batch(node, keys) for node, keys in placement.groups.items()]
        yield from fan_out(batches, io)
        # A proxy answers SERVER_ERROR for a whole get when one of its servers is down:
        # those keys are asked one by one, so that only that server's keys miss.
        retried = [fanout.get_each_batch(batch.node, list(batch.keys)) for batch in batches
                   if isinstance(batch.error, ServerError) and len(batch.keys) > 1]
        if retried:
            yield from fan_out(retried, io)
            batches = [batch for batch in batches if batch.node not in
                       {retry.node for retry in retried}]
        found: dict[Any, Any] = {}
        for batch in batches:
            if batch.error is None:
                self._decoded(batch.result, key_map, found)
        for batch in retried:
            if batch.error is None:
                values, failed = batch.result
                self._decoded(values, key_map, found)
                if failed:
                    batch.error = ServerError(
                        batch.node.name, f"SERVER_ERROR for {len(failed)} of "
                        f"{len(batch.keys)} key(s) asked one by one (a proxy's server down?)"
                    )
        self._report(placement, batches + retried)
        return found

    def _get_many_replicated(self, key_map: dict[str, Any], io: Transport) -> Plan:
        """``get_many`` with REPLICAS: each key asked of one replica (the same turn for the
        whole call, so its keys go to as few nodes as without replicas), in one request
        per node; the keys of a node that is down or fails, and the misses of a replica
        that may lack them (``_behind``), asked of their next replica in one more round.
        Errors are the call's only for keys no replica answered."""
        turn = next(self.cluster.turns)
        replica_set, count = self.cluster.replica_set, self.cluster.replicas
        if any(self._behind(node) for node in self._nodes):
            order = {key: self._read_order(key, turn) for key in key_map}
        else:  # the usual case: each key's replica of this turn, then the others in turn
            start = turn % count
            order = {}
            for key in key_map:
                replicas = replica_set(key)
                order[key] = replicas[start:] + replicas[:start]
        usable = Usable()
        errors: dict[str, MemcachedError] = {}
        answered: set[str] = set()
        found: dict[Any, Any] = {}
        pending = list(key_map)
        while pending:
            groups: dict[Node, list[str]] = {}
            for key in pending:
                nodes = order[key]
                while nodes:
                    node = nodes.pop(0)
                    if usable[node]:
                        groups.setdefault(node, []).append(key)
                        break
                    if node.name not in errors:  # counted once per call, not per key
                        errors[node.name] = node.skipped()
                else:
                    if key not in answered and self.failover:
                        extra = self.cluster.beyond_replicas(key)
                        if extra is not None:
                            groups.setdefault(extra, []).append(key)
            if not groups:
                break
            batches = [fanout.get_batch(node, keys) for node, keys in groups.items()]
            yield from fan_out(batches, io)
            pending = []
            for batch in batches:
                if batch.error is not None:
                    errors.setdefault(batch.node.name, batch.error)
                    pending.extend(key for key in batch.keys if key not in answered)
                    continue
                self._decoded(batch.result, key_map, found)
                answered.update(batch.keys)
                if self._behind(batch.node):
                    pending.extend(key for key in batch.keys if key.encode() not in batch.result)
        if len(answered) < len(key_map):
            for error in errors.values():
                self._failed(error)
        else:
            for error in errors.values():
                self._failed_softly(error)
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
            _, failed = yield from self._delete_entries(key_map, version, io)
            return [key_map[key] for key in failed]
        written = yield from self._store_entries(b"set", key_map, data, timeout, version, io)
        return [key_map[key] for key in written.failed + written.refused]

    def _store_entries(
        self, name: bytes, key_map: dict[str, Any], data: Mapping[Any, Any], timeout: Any,
        version: int | None, io: Transport,
    ) -> Plan:
        """``set`` (or ``add``) of the entries: one pipelined request per node, all nodes
        at once. With STALE_TIMEOUT, the stale copies ``get_or_set`` keeps of them are
        deleted after them (:meth:`_stale_copies_of`), so that none is ever older than
        the last value written. A value a node refused is logged, and after ``set`` its
        older value deleted; failures are raised, or logged under IGNORE_EXCEPTIONS, once
        every node is done, and what they leave behind is remembered as outdated.
        Returns what was stored, what failed and what was refused (stored keys)."""
        placement = self._place(key_map)
        copies = self._stale_copies_of(placement, key_map, version)
        batches = [
            self._store_batch(name, node, keys, key_map, data, timeout, copies)
            for node, keys in placement.groups.items()
        ]
        yield from self._write_round(batches, io)
        apart = yield from self._delete_round(copies.apart if copies else [], io)
        written = self._written(batches, key_map)
        failed = [*placement.stranded, *(k for b in batches if b.error for k in b.keys)]
        if self.replicated:  # stored if some replica stored it; failed if none answered
            assert name == b"set", "add with REPLICAS is _add_replicated's"
            answered = self._answered_keys(batches)
            refused = list(dict.fromkeys(written.refused))
            stored = [key for key in dict.fromkeys(written.stored) if key not in refused]
            written = Written(stored, refused, [])
            failed = [key for key in key_map if key not in answered]
        self._missed(placement, batches, copies, apart)
        unserved = self._unserved(batches + apart.batches)
        if written.refused and name == b"set":  # a refused value leaves no older one
            yield from self._delete_keys(written.refused, io)
        self._report(placement, batches, apart, unserved)
        return written._replace(failed=failed + written.failed)

    def _store_batch(
        self, name: bytes, node: Node, keys: list[str], key_map: dict[str, Any],
        data: Mapping[Any, Any], timeout: Any, copies: lease.StaleCopies | None,
    ) -> fanout.Batch:
        """``keys``' values encoded, as one node's share of a store; the stale copies
        that ride on the node deleted after them, in the same request."""
        encoded = []
        saved = 0
        for key in keys:
            payload, flags, saving = self.codec.encode_measured(data[key_map[key]], key)
            encoded.append((payload, flags))
            saved += saving
        riding = copies.riding.get(node) if copies else None
        return fanout.store_batch(node, name, keys, encoded, self.expire_time(timeout), saved,
                                  riding)

    def _written(self, batches: list[fanout.Batch], key_map: dict[str, Any]) -> Written:
        """What the nodes that answered did with each value: stored, not stored (``add``
        over an entry), refused (each refusal logged with the caller's key), or not
        served (``SERVER_ERROR``: behind a proxy, the key's server is down: failed)."""
        written = Written([], [], [])
        for batch in batches:
            if batch.error is not None:
                continue
            for key, line in zip(batch.keys, batch.result):
                if line == b"STORED":
                    written.stored.append(key)
                elif _unserved(line):
                    written.failed.append(key)
                elif line != b"NOT_STORED":
                    written.refused.append(key)
                    reason = line.partition(b" ")[2].decode(errors="replace") or line.decode()
                    refusals.failed(f"node {batch.node.name}", f"{key_map[key]!r}: {reason}",
                                    label=f"node {batch.node.name} of {self.cache_name}")
        return written

    @staticmethod
    def _unserved(batches: list[fanout.Batch]) -> list[MemcachedError]:
        """The keys of answered pipelined writes that the server could not serve
        (``SERVER_ERROR`` other than a refused value: behind a proxy, their server is
        down): missed writes, remembered as outdated on their node; a ``ServerError`` per
        node, to report."""
        errors: list[MemcachedError] = []
        for batch in batches:
            if batch.error is not None or not isinstance(batch.result, list):
                continue
            lines = zip([*batch.keys, *batch.side_keys], batch.result)
            missed = [key for key, line in lines if _unserved(line)]
            if missed:
                batch.node.outdated.add(missed)
                errors.append(ServerError(
                    batch.node.name, f"SERVER_ERROR for {len(missed)} key(s), remembered as "
                    "missed (a proxy whose server for them is down?)"
                ))
        return errors

    def _delete_many(self, keys: Iterable[Any], version: int | None, io: Transport) -> Plan:
        key_map = self.make_keys(keys, version)
        if self._stale_copies:
            yield from self._delete_entries(key_map, version, io)
        else:
            yield from self._delete_keys(list(key_map), io, report=True)

    def _delete_entries(
        self, key_map: dict[str, Any], version: int | None, io: Transport
    ) -> Plan:
        """``delete``/``delete_many`` with STALE_TIMEOUT: each entry, then the stale copies
        ``get_or_set`` may keep of it (:meth:`_stale_copies_of`), which must not outlive
        it. A delete that fails or is skipped is raised or logged like any, and what it
        leaves is remembered as outdated. Returns the stored keys of the entries deleted,
        and of those whose delete failed or was skipped."""
        if not key_map:
            return set(), []
        placement = self._place(key_map)
        copies = self._stale_copies_of(placement, key_map, version)
        batches = [
            fanout.delete_batch(node, keys, copies.riding.get(node) if copies else None)
            for node, keys in placement.groups.items()
        ]
        yield from self._write_round(batches, io)
        apart = yield from self._delete_round(copies.apart if copies else [], io)
        deleted = {key for batch in batches if batch.error is None
                   for key, line in zip(batch.keys, batch.result) if line == b"DELETED"}
        failed = [*placement.stranded, *(k for b in batches if b.error for k in b.keys)]
        if self.replicated:
            answered = self._answered_keys(batches)
            failed = [key for key in key_map if key not in answered]
        self._missed(placement, batches, copies, apart)
        self._report(placement, batches, apart, self._unserved(batches + apart.batches))
        return deleted, failed

    def _stale_copies_of(
        self, placement: Placement, key_map: dict[str, Any], version: int | None
    ) -> lease.StaleCopies | None:
        """With STALE_TIMEOUT, where the stale copies ``get_or_set`` keeps of the placed
        entries are deleted when the entries are written or deleted: the meta store's in
        the entry's own request, after it; the add-based store's (a key of its own) in a
        round after the entries'. Entry first, copy after: a winner of ``get_or_set``
        writes the copy first (``lease``), so no interleaving leaves a copy older than
        the entry's last value, or a deleted value as the copy. None without."""
        if not self._stale_copies:
            return None
        return lease.stale_copies(self, placement.groups, placement.stranded, key_map,
                                  version, self._home)

    def _missed(
        self, placement: Placement, batches: list[fanout.Batch],
        copies: lease.StaleCopies | None, apart: Round,
    ) -> None:
        """What a write round and its copies' round left undone, remembered as outdated:
        the keys of failed batches (their riding copies with them) and skipped keys."""
        if copies is not None:
            placement.stranded.extend(copies.stranded)
        self.cluster.missed_batch_writes(placement, batches, copies.entry_of if copies else None)
        self.cluster.missed_batch_writes(apart.placement, apart.batches)

    def _delete_round(self, keys: list[str], io: Transport) -> Plan:
        """One delete request per node, all at once: a :class:`Round`, nothing raised."""
        if not keys:
            return NO_ROUND
        placement = self._place(keys)
        batches = [fanout.delete_batch(node, keys) for node, keys in placement.groups.items()]
        yield from self._write_round(batches, io)
        return Round(placement, batches)

    def _delete_keys(self, keys: list[str], io: Transport, report: bool = False) -> Plan:
        """One delete request per node. Failures are raised like any call's if ``report``,
        else (a clean-up after refused writes) logged; either way the keys that were not
        deleted are remembered as outdated."""
        deletes = yield from self._delete_round(keys, io)
        placement, batches = deletes
        self.cluster.missed_batch_writes(placement, batches)
        unserved = self._unserved(batches)
        if report:
            self._report(placement, batches, None, unserved)
            return
        errors = placement.errors + [b.error for b in batches if b.error is not None] + unserved
        if errors:  # a clean-up delete (set_many): the keys are remembered as outdated
            undeleted = len(placement.stranded) + sum(len(b.keys) for b in batches if b.error)
            logger.warning(
                "Could not delete %d key(s) of %s after a failed write; they are deleted "
                "when their node answers again: %s", undeleted, self.cache_name,
                "; ".join(map(str, errors)),
            )

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

