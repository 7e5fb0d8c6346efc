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

import logging
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

from django_kvcache.base import MISSING, KVCache, check_delta, delegate_to_sync
from django_kvcache.codec import FLAG_INTEGER, FLAG_LONG, INT64_MAX, INT64_MIN
from django_kvcache.failure_log import FailureLog
from django_kvcache.memcached import MemcachedError, NodeDown, ValueTooLarge
from django_kvcache.memcached import fanout, protocol
from django_kvcache.health import health_for
from django_kvcache.memcached.node import Node
from django_kvcache.memcached.pool import ConnectionSettings, pool_for
from django_kvcache.memcached.routing import (
    NodeAddress,
    check_scheme,
    make_router,
    parse_location,
)
from django_kvcache.options import check_known, flag, integer, seconds
from django_kvcache.routing import parse_weights
from django_kvcache.signals import node_up

MAX_KEY_BYTES = 250
THIRTY_DAYS = 60 * 60 * 24 * 30  # longer expiry times are Unix timestamps to memcached
CAS_PATIENCE = 5.0  # seconds of compare-and-swap retries before incr gives up

logger = logging.getLogger(__name__)
#: Failures ignored under IGNORE_EXCEPTIONS, per node: logged once, then summarized.
ignored_failures = FailureLog(logger, "memcached")
#: Values set_many's nodes refused (returned as failed keys, so never raised).
refusals = FailureLog(logger, "memcached set_many")


def _node_answers_again(sender: Any, node: str, **kwargs: Any) -> None:
    ignored_failures.recovered(f"node {node}")


node_up.connect(_node_answers_again, dispatch_uid="django_kvcache.memcached.ignored_failures")


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
        connect_timeout=seconds(options, "CONNECT_TIMEOUT", 1.0, allow_none=True),
        io_timeout=seconds(options, "IO_TIMEOUT", 1.0, allow_none=True),
        max_size=integer(options, "MAX_POOL_SIZE", 64),
        pool_timeout=seconds(options, "POOL_TIMEOUT", 1.0),
        tls=_tls_context(options.get("TLS")),
    )
    threshold = integer(options, "FAILURE_THRESHOLD", 2)
    retry_timeout = seconds(options, "RETRY_TIMEOUT", 10.0)
    scheme = check_scheme(options.get("HASHING", "kvcache"))
    weights = parse_weights(options.get("WEIGHTS"), [address.name for address in addresses])
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
        self.failover = flag(self.options, "FAILOVER")
        self.ignore_exceptions = flag(self.options, "IGNORE_EXCEPTIONS")
        self.cluster = cluster = cluster_for(parse_location(server), self.options)
        self._nodes = cluster.nodes
        self._node_for_key = cluster.router.node_for

    # --- keys and expiry --------------------------------------------------------------

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
        raise down.skipped()

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

    def _write(self, key: str, command: Any, *args: Any, sent: int = 0, saved: int = 0) -> Any:
        """A single-key write on the key's node (or its failover node), which is credited
        with ``sent`` and ``saved`` bytes."""
        try:
            return self._node(key).call(command, key, *args, sent=sent, saved=saved)
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
        # Logged once per episode and then summarized: a down node fails every call.
        ignored_failures.failed(f"node {error.node}", f"{type(error).__name__}: {error.reason}")
        node = self.cluster.by_name.get(error.node)
        if node is not None:
            node.ignored += 1
        return fallback

    # --- single keys ------------------------------------------------------------------

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        key = self.make_and_validate_key(key, version=version)
        try:
            found = self._node(key).get(key)
        except MemcachedError as exc:
            return self._failed(exc, default)
        if found is None:
            return default
        value = self.decode(found[0], found[1], key)
        return default if value is MISSING else value

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        key = self.make_and_validate_key(key, version=version)
        self._store(protocol.set_one, key, value, timeout, replaces=True)

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        key = self.make_and_validate_key(key, version=version)
        return self._store(protocol.add_one, key, value, timeout, replaces=False)

    def _store(self, command: Any, key: str, value: Any, timeout: Any, replaces: bool) -> bool:
        """``set`` (``replaces``) or ``add``. A value the server refuses leaves no older
        value behind for ``set``; for ``add`` the entry that is there stays."""
        data, flags, saved = self.codec.encode_measured(value)
        expire = self.expire_time(timeout)
        try:
            stored = self._write(
                key, command, (data, flags), expire, sent=len(key) + len(data), saved=saved
            )
        except MemcacheServerError as exc:  # too large, out of memory: refused, node fine
            if replaces:
                self._forget(key)
            refused = ValueTooLarge(self._home(key).name, f"{key!r} not stored: {exc}")
            return self._failed(refused, False)
        except MemcachedError as exc:
            return self._failed(exc, False)
        return bool(stored)

    def _forget(self, key: str) -> None:
        """Delete a key whose new value was refused, so the old one is never read again."""
        try:
            self._write(key, protocol.delete_one)
        except MemcachedError as exc:  # remembered as outdated by _write
            logger.warning("Could not delete %r after a failed set: %s", key, exc)

    def touch(self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None) -> bool:
        key = self.make_and_validate_key(key, version=version)
        try:
            return bool(self._write(key, protocol.touch_one, self.expire_time(timeout)))
        except MemcachedError as exc:
            return self._failed(exc, False)

    def delete(self, key: Any, version: int | None = None) -> bool:
        key = self.make_and_validate_key(key, version=version)
        try:
            return bool(self._write(key, protocol.delete_one))
        except MemcachedError as exc:
            return self._failed(exc, False)

    def has_key(self, key: Any, version: int | None = None) -> bool:
        return self.get(key, MISSING, version=version) is not MISSING

    # --- counters ---------------------------------------------------------------------

    def incr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        """Add ``delta`` (negative to subtract); the entry keeps its expiry time.

        Signed 64-bit counters, the same as MySQLCache's (docs/guarantees.rst): results
        below zero are stored; a result outside the range raises ``OverflowError`` and
        leaves the value unchanged. A missing key raises ``ValueError``, a value that is
        not an integer ``TypeError``.

        A value >= 0 plus 0 <= delta <= INT64_MAX is one server ``incr``. Everything
        else (negative deltas and values, deltas beyond 64 bits) is computed here and
        written with compare-and-swap, which keeps the item's remaining lifetime.
        """
        check_delta(delta)
        key = self.make_and_validate_key(key, version=version)
        # No IGNORE_EXCEPTIONS here: incr has no "unknown" answer, so failures always raise.
        try:
            node = self._node(key)
            if 0 <= delta <= INT64_MAX:
                value = self._incr_on_server(node, key, delta)
            else:
                value = self._add_with_cas(node, key, delta)
        except MemcachedError as exc:
            self._missed_write(key, exc)
            raise
        if value is None:
            raise ValueError(f"Key '{key}' not found")
        return value

    def _incr_on_server(self, node: Node, key: str, delta: int) -> int | None:
        """The server's ``incr``, which counts modulo 2**64, kept to the signed range.

        From a stored value v in [0, 2**64), the reply is v + delta, or v + delta - 2**64
        when it wrapped, which is then below ``delta``. A wrapped reply or one above
        INT64_MAX is undone by adding 2**64 - delta: modulo 2**64 that restores v exactly,
        whatever other increments ran in between. Until the undo lands (one round trip)
        other clients can read the out-of-range number, and their increments of the key
        raise ``OverflowError`` too.
        """
        try:
            value = node.call(protocol.incr_one, key, delta, retry=False)
        except MemcacheClientError:  # "non-numeric value": a negative or non-integer value
            return self._add_with_cas(node, key, delta)
        if value is None or delta <= value <= INT64_MAX:
            return value
        if delta:  # a failed undo raises, and the key is deleted as outdated (see incr)
            node.call(protocol.incr_one, key, 2**64 - delta, retry=False)
        raise self._overflow(key, delta)

    def _add_with_cas(self, node: Node, key: str, delta: int) -> int | None:
        """``incr`` computed here and stored only if the item did not change meanwhile.

        Like MySQLCache, only values stored as integers count (a pickled int beyond 64
        bits raises ``TypeError``); a corrupt one is a logged miss.
        """
        encoded_key = key.encode()
        deadline = time.monotonic() + CAS_PATIENCE
        while time.monotonic() < deadline:
            found = node.call(protocol.meta_get, encoded_key)
            if found is None:
                return None
            data, flags, ttl, cas = found
            if flags not in (FLAG_INTEGER, FLAG_LONG):
                raise TypeError(f"The value of key '{key}' is not an integer")
            value = self.decode(data, flags, key)
            if value is MISSING:
                return None
            result = value + delta
            if not (INT64_MIN <= value <= INT64_MAX and INT64_MIN <= result <= INT64_MAX):
                raise self._overflow(key, delta)  # (a value beyond: another's undo is due)
            if ttl > THIRTY_DAYS:  # memcached reads longer times as Unix timestamps, on its
                # own clock, which lags ours by up to 2 s: ours would stretch every update.
                ttl += node.call(Client.stats)[b"time"]
            new_data, new_flags = self.codec.encode(result)
            swapped = node.call(
                protocol.meta_cas, encoded_key, new_data, new_flags, ttl, cas, retry=False
            )
            if swapped:
                return result
            time.sleep(random.random() / 1000)  # someone else won: let them get out of the way
        raise MemcachedError(node.name, f"{key!r} kept changing for {CAS_PATIENCE} s of retries")

    @staticmethod
    def _overflow(key: str, delta: int) -> OverflowError:
        return OverflowError(
            f"Adding {delta} to key '{key}' leaves the signed 64-bit range; value unchanged"
        )

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
            node_saved = 0
            for key in node_keys:
                payload, flags, saved = self.codec.encode_measured(data[key_map[key]])
                node_saved += saved
                encoded.append((payload, flags))
            batches.append(fanout.set_batch(node, node_keys, encoded, expire, node_saved))
        fanout.run(batches)
        failed = list(placement.stranded)
        refused: list[str] = []
        for batch in batches:
            if batch.error is not None:
                failed.extend(batch.keys)
                continue
            for key, line in zip(batch.keys, batch.result):
                if line != b"STORED":  # too large, out of memory: the node is fine
                    refused.append(key)
                    refusals.failed(f"node {batch.node.name}", f"{key!r} not stored: {line.decode(errors='replace')}")
        if refused:
            self._delete_keys(refused)  # a failed set must not leave the old value behind
        self._missed_batch_writes(placement, batches)
        self._report(placement, batches)
        return [key_map[key] for key in failed + refused]

    def delete_many(self, keys: Iterable[Any], version: int | None = None) -> None:
        self._delete_keys(list(self.make_keys(keys, version)), report=True)

    def _delete_keys(self, keys: list[str], report: bool = False) -> None:
        """One delete request per node. Failures are raised like any call's if ``report``,
        else (a clean-up after refused writes) logged; either way the keys that were not
        deleted are remembered as outdated."""
        if not keys:
            return
        placement = self._place(keys)
        batches = [fanout.delete_batch(node, keys) for node, keys in placement.groups.items()]
        fanout.run(batches)
        self._missed_batch_writes(placement, batches)
        if report:
            self._report(placement, batches)
            return
        errors = placement.errors + [b.error for b in batches if b.error is not None]
        if errors:  # a clean-up delete (set_many): the keys are remembered as outdated
            undeleted = len(placement.stranded) + sum(len(b.keys) for b in batches if b.error)
            logger.warning(
                "Could not delete %d key(s) after a failed write; they are deleted when "
                "their node answers again: %s", undeleted, "; ".join(map(str, errors)),
            )

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

    def sample_entries(self, count: int) -> list[tuple[bytes, int]]:
        """Up to ``count`` entries picked at random across the nodes, as stored:
        ``(bytes, flags)``. For training a compression dictionary
        (``kvcache_train_dictionary``): it lists every key of every node, so it is no
        request-path call. A node that fails raises (no IGNORE_EXCEPTIONS here)."""
        per_node = -(-count // len(self._nodes))
        batches = []
        for node in self._nodes:
            keys = node.call(protocol.sample_keys, per_node)
            if keys:
                batches.append(fanout.get_batch(node, keys))
        fanout.run(batches)
        entries: list[tuple[bytes, int]] = []
        for batch in batches:
            if batch.error is not None:
                raise batch.error
            entries.extend(batch.result.values())
        random.shuffle(entries)
        return entries[:count]

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


def _tls_context(value: Any) -> ssl.SSLContext | None:
    """OPTIONS['TLS']: an ``ssl.SSLContext``, or a dict of ``ssl.create_default_context``
    arguments (``cafile``, ``capath``, ``cadata``) plus ``certfile``/``keyfile``.

    One context per distinct dict, so instances built from the same settings share pools
    (and Django's per-request instances do not load certificates every time).
    """
    if value is None or isinstance(value, ssl.SSLContext):
        return value
    known = {"cafile", "capath", "cadata", "certfile", "keyfile"}
    check_known(value, known, "OPTIONS['TLS'] (an ssl.SSLContext or a dict)")
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
