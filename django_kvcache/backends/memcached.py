"""Multi-node memcached cache backend: rendezvous routing, shared pools and node health.

    CACHES = {
        "default": {
            "BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
            "LOCATION": ["10.0.0.1:11211", "10.0.0.2:11211", "unix:/run/memcached.sock"],
            "OPTIONS": {"FAILOVER": False, "IGNORE_EXCEPTIONS": False},
        }
    }

The options are described in docs/memcached.rst. Everything shared between backend
instances (pools, node health, counters, routing) lives in a process-wide
:class:`Cluster`, found again by every instance built with the same settings.
"""
from __future__ import annotations

import math
import os
import random
import ssl
import threading
import time
from typing import Any, Iterable, Mapping, NamedTuple

from django.core.cache.backends.base import DEFAULT_TIMEOUT, InvalidCacheKey
from django.core.exceptions import ImproperlyConfigured
from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheClientError, MemcacheServerError

from django_kvcache.base import MISSING, KVCache, delegate_to_sync, logger
from django_kvcache.memcached import MemcachedError, NodeDown, ValueTooLarge
from django_kvcache.memcached import fanout, protocol
from django_kvcache.memcached.health import health_for
from django_kvcache.memcached.node import Node
from django_kvcache.memcached.pool import ConnectionSettings, pool_for
from django_kvcache.memcached.routing import (
    NodeAddress,
    check_scheme,
    make_router,
    parse_location,
    parse_weights,
)

MAX_KEY_BYTES = 250
THIRTY_DAYS = 60 * 60 * 24 * 30  # longer expiry times are Unix timestamps to memcached
CAS_PATIENCE = 5.0  # seconds of compare-and-swap retries before incr gives up


class Cluster:
    """The nodes and router of one configuration, shared process-wide."""

    def __init__(self, nodes: list[Node], router: Any) -> None:
        self.nodes = nodes
        self.router = router
        self.by_name = {node.name: node for node in nodes}


_clusters: dict[tuple, Cluster] = {}
_clusters_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    global _clusters_lock
    _clusters_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_new_lock_after_fork)


def cluster_for(addresses: list[NodeAddress], options: Mapping[str, Any]) -> Cluster:
    """The process-wide cluster for these nodes and OPTIONS (checked here)."""
    settings = ConnectionSettings(
        connect_timeout=_seconds(options, "CONNECT_TIMEOUT", 1.0, allow_none=True),
        io_timeout=_seconds(options, "IO_TIMEOUT", 1.0, allow_none=True),
        max_size=_count(options, "MAX_POOL_SIZE", 64),
        pool_timeout=_seconds(options, "POOL_TIMEOUT", 1.0),
        tls=_tls_context(options.get("TLS")),
    )
    threshold = _count(options, "FAILURE_THRESHOLD", 2)
    retry_timeout = _seconds(options, "RETRY_TIMEOUT", 10.0)
    scheme = check_scheme(options.get("HASHING", "kvcache"))
    weights = parse_weights(options.get("WEIGHTS"), addresses)
    identity = (
        tuple(a.name for a in addresses), scheme, tuple(weights), settings,
        threshold, retry_timeout,
    )
    cluster = _clusters.get(identity)
    if cluster is not None:
        return cluster
    nodes = [
        Node(a, pool_for(a, settings), health_for(a.name, threshold, retry_timeout))
        for a in addresses
    ]
    with _clusters_lock:
        cluster = Cluster(nodes, make_router(scheme, addresses, weights))
        return _clusters.setdefault(identity, cluster)


class Placement(NamedTuple):
    groups: dict[Node, list[str]]
    stranded: list[str]  # keys whose node is down (and no failover node is up)
    errors: list[MemcachedError]


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
        }
    )

    def __init__(self, server: Any, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.failover = _flag(self.options, "FAILOVER")
        self.ignore_exceptions = _flag(self.options, "IGNORE_EXCEPTIONS")
        self.cluster = cluster = cluster_for(parse_location(server), self.options)
        self._nodes = cluster.nodes
        self._node_for_key = cluster.router.node_for

    # --- keys and expiry --------------------------------------------------------------

    def validate_key(self, key: str) -> None:
        """memcached's rules in UTF-8 bytes: at most 250, no spaces or control characters."""
        if key.isascii() and len(key) <= MAX_KEY_BYTES and key.isprintable() and " " not in key:
            return  # the common case, in three C calls
        if len(key.encode()) > MAX_KEY_BYTES:
            raise InvalidCacheKey(
                f"Cache key will cause errors if used with memcached: {key!r} "
                f"(longer than {MAX_KEY_BYTES} bytes in UTF-8)"
            )
        if any(ord(char) < 33 or ord(char) == 127 for char in key):
            raise InvalidCacheKey(
                f"Cache key contains characters that will cause errors if used with "
                f"memcached: {key!r}"
            )

    def expire_time(self, timeout: Any = DEFAULT_TIMEOUT) -> int:
        """memcached's exptime: 0 forever, -1 already expired, a Unix time past 30 days.

        Fractions of a second round up, so a positive timeout never means "expired".
        """
        seconds = self.timeout_seconds(timeout)
        if seconds is None:
            return 0
        if seconds <= 0:
            return -1
        seconds = math.ceil(seconds)
        if seconds > THIRTY_DAYS:
            return int(time.time()) + seconds
        return seconds

    # --- routing and failure policy ---------------------------------------------------

    def _node(self, key: str) -> Node:
        node = self._nodes[self._node_for_key(key)]
        if node.health.down_until and not node.health.may_try():
            return self._failover_node(key, node)
        return node

    def _failover_node(self, key: str, down: Node) -> Node:
        if self.failover:
            for index in self.cluster.router.ranking(key)[1:]:
                node = self._nodes[index]
                if node.health.may_try():
                    return node
        down.errors += 1
        retry_in = max(0.0, down.health.down_until - time.monotonic())
        raise NodeDown(
            down.name,
            f"marked down after {down.health.failures} consecutive failures; "
            f"next try in {retry_in:.1f} s (RETRY_TIMEOUT)",
        )

    def _place(self, keys: Iterable[str]) -> Placement:
        """Keys by the node that serves them now; keys no node can take, with the errors."""
        placement = Placement({}, [], [])
        groups = placement.groups
        for index, node_keys in self.cluster.router.group(keys).items():
            node = self._nodes[index]
            if not node.health.down_until or node.health.may_try():
                groups.setdefault(node, []).extend(node_keys)
                continue
            reported = False
            for key in node_keys:
                try:
                    groups.setdefault(self._failover_node(key, node), []).append(key)
                except NodeDown as exc:  # counted per key, reported once per node
                    placement.stranded.append(key)
                    if not reported:
                        placement.errors.append(exc)
                        reported = True
        return placement

    def _home(self, key: str) -> Node:
        return self._nodes[self._node_for_key(key)]

    def _write(self, key: str, command: Any, *args: Any) -> Any:
        """A single-key write on the key's node (or its failover node)."""
        try:
            return self._node(key).call(command, key, *args)
        except MemcachedError as exc:
            self._missed_write(key, exc)
            raise

    def _missed_write(self, key: str, error: MemcachedError) -> None:
        """A write that failed or was skipped leaves the old value on the key's node (and
        on the node that failed): delete it there before that node serves again."""
        home = self._home(key)
        home.outdated.add((key,))
        failed = self.cluster.by_name.get(error.node)
        if failed is not None and failed is not home:
            failed.outdated.add((key,))

    def _missed_batch_writes(self, placement: Placement, batches: list[fanout.Batch]) -> None:
        for key in placement.stranded:
            self._home(key).outdated.add((key,))
        for batch in batches:
            if batch.error is None:
                continue
            batch.node.outdated.add(batch.keys)
            for key in batch.keys:
                if self._home(key) is not batch.node:  # a failover batch
                    self._home(key).outdated.add((key,))

    def _failed(self, error: MemcachedError, fallback: Any = None) -> Any:
        """Raise ``error``, or with IGNORE_EXCEPTIONS log and count it, giving ``fallback``."""
        if not self.ignore_exceptions:
            raise error
        logger.warning("Ignored memcached failure in %s: %s", self.backend_name, error)
        node = self.cluster.by_name.get(error.node)
        if node is not None:
            node.ignored += 1
        return fallback

    # --- single keys ------------------------------------------------------------------

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        key = self.make_and_validate_key(key, version=version)
        try:
            node = self._node(key)
            found = node.call(protocol.get_one, key)
        except MemcachedError as exc:
            return self._failed(exc, default)
        if found is None:
            node.misses += 1
            return default
        node.hits += 1
        node.bytes_received += len(found[0])
        value = self.decode(found[0], found[1], key)
        return default if value is MISSING else value

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        key = self.make_and_validate_key(key, version=version)
        self._store(Client.set, key, value, timeout)

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        key = self.make_and_validate_key(key, version=version)
        return self._store(Client.add, key, value, timeout)

    def _store(self, command: Any, key: str, value: Any, timeout: Any) -> bool:
        data, flags, saved = self.codec.encode_measured(value)
        expire = self.expire_time(timeout)
        try:
            stored = self._write(key, command, (data, flags), expire)
        except MemcacheServerError as exc:  # too large, out of memory: refused, node fine
            self._forget(key)
            refused = ValueTooLarge(self._home(key).name, f"{key!r} not stored: {exc}")
            return self._failed(refused, False)
        except MemcachedError as exc:
            return self._failed(exc, False)
        node = self._home(key)
        node.bytes_sent += len(key) + len(data)
        node.bytes_saved += saved
        return bool(stored)

    def _forget(self, key: str) -> None:
        """Delete a key whose new value was refused, so the old one is never read again."""
        try:
            self._write(key, Client.delete)
        except MemcachedError as exc:  # remembered as outdated by _write
            logger.warning("Could not delete %r after a failed set: %s", key, exc)

    def touch(self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None) -> bool:
        key = self.make_and_validate_key(key, version=version)
        try:
            return bool(self._write(key, Client.touch, self.expire_time(timeout)))
        except MemcachedError as exc:
            return self._failed(exc, False)

    def delete(self, key: Any, version: int | None = None) -> bool:
        key = self.make_and_validate_key(key, version=version)
        try:
            return bool(self._write(key, Client.delete))
        except MemcachedError as exc:
            return self._failed(exc, False)

    def has_key(self, key: Any, version: int | None = None) -> bool:
        return self.get(key, MISSING, version=version) is not MISSING

    # --- counters ---------------------------------------------------------------------

    def incr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        """Atomic on the server for values >= 0; ``decr`` there stops at 0.

        A value memcached cannot count with (stored negative, or beyond 64 bits) is
        updated with a compare-and-swap loop instead, keeping its expiry time.
        """
        key = self.make_and_validate_key(key, version=version)
        # No IGNORE_EXCEPTIONS here: incr has no "unknown" answer, so failures always raise.
        try:
            node = self._node(key)
            try:
                if delta >= 0:
                    value = node.call(Client.incr, key, delta, retry=False)
                else:
                    value = node.call(Client.decr, key, -delta, retry=False)
            except MemcacheClientError:  # "non-numeric value" or "invalid numeric delta"
                value = self._add_with_cas(node, key, delta)
        except MemcachedError as exc:
            self._missed_write(key, exc)
            raise
        if value is None:
            raise ValueError(f"Key '{key}' not found")
        return value

    def decr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        return self.incr(key, -delta, version=version)

    def _add_with_cas(self, node: Node, key: str, delta: int) -> int | None:
        encoded_key = key.encode()
        deadline = time.monotonic() + CAS_PATIENCE
        while time.monotonic() < deadline:
            found = node.call(protocol.meta_get, encoded_key)
            if found is None:
                return None
            data, flags, ttl, cas = found
            value = self.decode(data, flags, key)
            if value is MISSING:
                return None
            if type(value) is not int:
                raise TypeError(f"Cannot increment or decrement the non-integer value of {key!r}")
            new_data, new_flags = self.codec.encode(value + delta)
            swapped = node.call(
                protocol.meta_cas, encoded_key, new_data, new_flags, ttl, cas, retry=False
            )
            if swapped:
                return value + delta
            time.sleep(random.random() / 1000)  # someone else won: let them get out of the way
        raise MemcachedError(node.name, f"{key!r} kept changing for {CAS_PATIENCE} s of retries")

    # --- many keys: one pipelined request per node, all nodes at once ------------------

    def get_many(self, keys: Iterable[Any], version: int | None = None) -> dict[Any, Any]:
        key_map = self.make_keys(keys, version)
        if not key_map:
            return {}
        placement = self._place(key_map)
        batches = [fanout.get_batch(node, keys) for node, keys in placement.groups.items()]
        fanout.run(batches)
        found: dict[Any, Any] = {}
        decode = self.decode
        for batch in batches:
            if batch.error is not None:
                continue
            node = batch.node
            node.hits += len(batch.result)
            node.misses += len(batch.keys) - len(batch.result)
            for key_bytes, (data, flags) in batch.result.items():
                key = key_bytes.decode()
                value = decode(data, flags, key)
                if value is not MISSING:
                    found[key_map[key]] = value
        self._report(placement, batches)
        return found

    def set_many(
        self, data: Mapping[Any, Any], timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> list[Any]:
        key_map = self.make_keys(data, version)
        if not key_map:
            return []
        expire = self.expire_time(timeout)
        placement = self._place(key_map)
        batches = []
        for node, node_keys in placement.groups.items():
            encoded = []
            for key in node_keys:
                payload, flags, saved = self.codec.encode_measured(data[key_map[key]])
                node.bytes_saved += saved
                encoded.append((payload, flags))
            batches.append(fanout.set_batch(node, node_keys, encoded, expire))
        fanout.run(batches)
        failed = list(placement.stranded)
        refused: list[str] = []
        for batch in batches:
            if batch.error is not None:
                failed.extend(batch.keys)
            else:
                refused.extend(k for k, line in zip(batch.keys, batch.result) if line != b"STORED")
        if refused:
            self._delete_keys(refused)  # a failed set must not leave the old value behind
        self._missed_batch_writes(placement, batches)
        self._report(placement, batches)
        return [key_map[key] for key in failed + refused]

    def delete_many(self, keys: Iterable[Any], version: int | None = None) -> None:
        self._delete_keys(list(self.make_keys(keys, version)), report=True)

    def _delete_keys(self, keys: list[str], report: bool = False) -> None:
        if not keys:
            return
        placement = self._place(keys)
        batches = [fanout.delete_batch(node, keys) for node, keys in placement.groups.items()]
        fanout.run(batches)
        self._missed_batch_writes(placement, batches)
        if report:
            self._report(placement, batches)

    def _report(self, placement: Placement, batches: list[fanout.Batch]) -> None:
        """After a multi-key call: raise (or log) what went wrong, once every node is done."""
        for error in placement.errors + [b.error for b in batches if b.error is not None]:
            self._failed(error)

    def clear(self) -> None:
        """Flush every node (memcached has no per-prefix delete).

        A node that misses the flush (down, or failing now) is flushed when it returns,
        before it serves anything.
        """
        reachable = [node for node in self._nodes if node.health.may_try()]
        batches = [fanout.flush_batch(node) for node in reachable]
        fanout.run(batches)
        errors: list[MemcachedError] = [b.error for b in batches if b.error is not None]
        for node in self._nodes:
            if node not in reachable:
                errors.append(NodeDown(node.name, "marked down: flushed when it returns"))
        for error in errors:
            self.cluster.by_name[error.node].outdated.add_everything()
        for error in errors:
            self._failed(error)

    # --- connections and observability -----------------------------------------------

    def close(self, **kwargs: Any) -> None:
        """Called at the end of every request: the pooled connections stay open."""

    def disconnect_all(self) -> None:
        """Really close this cache's idle connections (e.g. before a fork or at shutdown)."""
        for node in self._nodes:
            node.pool.close_idle()

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per-node counters of this process, shared by every instance of this cache."""
        return {node.name: node.metrics() for node in self._nodes}

    def server_stats(self) -> dict[str, dict[str, Any]]:
        """memcached's ``stats`` of every node; ``{"error": ...}`` for a node that fails."""
        stats: dict[str, dict[str, Any]] = {}
        for node in self._nodes:
            try:
                raw = node.call(Client.stats)
            except MemcachedError as exc:
                stats[node.name] = {"error": str(exc)}
            else:
                stats[node.name] = {
                    (k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()
                }
        return stats

    adisconnect_all = delegate_to_sync("disconnect_all")


# --- OPTIONS checks -------------------------------------------------------------------


def _flag(options: Mapping[str, Any], name: str) -> bool:
    value = options.get(name, False)
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"OPTIONS[{name!r}] must be True or False, got {value!r}")
    return value


def _seconds(
    options: Mapping[str, Any], name: str, default: float, allow_none: bool = False
) -> Any:
    value = options.get(name, default)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ImproperlyConfigured(
            f"OPTIONS[{name!r}] must be a positive number of seconds"
            f"{' or None' if allow_none else ''}, got {value!r}"
        )
    return float(value)


def _count(options: Mapping[str, Any], name: str, default: int) -> int:
    value = options.get(name, default)
    if type(value) is not int or value < 1:
        raise ImproperlyConfigured(f"OPTIONS[{name!r}] must be a positive integer, got {value!r}")
    return value


def _tls_context(value: Any) -> ssl.SSLContext | None:
    """OPTIONS['TLS']: an ``ssl.SSLContext``, or a dict of ``ssl.create_default_context``
    arguments (``cafile``, ``capath``, ``cadata``) plus ``certfile``/``keyfile``.

    One context per distinct dict, so instances built from the same settings share pools
    (and Django's per-request instances do not load certificates every time).
    """
    if value is None or isinstance(value, ssl.SSLContext):
        return value
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(
            f"OPTIONS['TLS'] must be an ssl.SSLContext or a dict, got {value!r}"
        )
    known = {"cafile", "capath", "cadata", "certfile", "keyfile"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ImproperlyConfigured(
            f"OPTIONS['TLS'] has unknown keys {unknown}; known: {sorted(known)}"
        )
    key = tuple(sorted((k, str(v)) for k, v in value.items()))
    if key not in _contexts:
        try:
            context = ssl.create_default_context(
                cafile=value.get("cafile"), capath=value.get("capath"), cadata=value.get("cadata")
            )
            if value.get("certfile"):
                context.load_cert_chain(value["certfile"], value.get("keyfile"))
        except (OSError, ssl.SSLError) as exc:
            raise ImproperlyConfigured(f"OPTIONS['TLS']: {exc}") from exc
        _contexts.setdefault(key, context)
    return _contexts[key]


_contexts: dict[tuple, ssl.SSLContext] = {}
