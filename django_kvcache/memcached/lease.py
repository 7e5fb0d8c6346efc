"""``get_or_set``'s herd protection and ``ttl()`` on memcached's meta protocol (>= 1.6.6).

:class:`MetaLeaseStore` is the memcached :class:`~django_kvcache.stampede.LeaseStore`
on a node that speaks the meta commands. A protected key ``K`` has up to three items,
all on ``K``'s node (so one request can ask about all three):

* ``K`` itself: a plain item written by ``set``, with Django's timeout. It is never
  vivified, so ``get``/``get_many``/``has_key``/``add``/``incr`` — which use the classic
  commands and know nothing of leases — see exactly what Django's contract says. (An
  ``mg N`` placeholder on ``K`` would read as an empty value to every classic ``get``,
  ours and other clients'.) Early recomputation uses ``mg K R<secs>``, which only sets a
  token on the live item (the first reader past the threshold gets ``W``, the others
  ``Z``): it changes nothing a plain read sees. The window is the shared rule's
  (``stampede.Policy.early_window``: EARLY_RECOMPUTE, at most a quarter of the entry's
  lifetime), and the reader who gets ``W`` also takes the lease ``L`` before it
  recomputes, so a reader who finds ``K`` expired meanwhile waits for that value.
* the lease ``L``: the empty item ``mg L N<secs>`` vivifies on a miss. The caller whose
  ``mg`` created it gets ``W`` and computes; every other one gets ``Z``. It expires on
  its own (a holder that died is replaced), or its holder deletes it with
  ``md L C<cas>`` — its own lease only, by the CAS the vivifying ``mg`` returned.
* the stale copy ``S`` (with STALE_TIMEOUT): the last value ``get_or_set`` computed,
  stored with the entry's timeout plus STALE_TIMEOUT.

Round trips: a fresh hit is one ``mg K v f`` (a plain ``get``'s cost). A miss is that
and one pipelined request — ``mg L N c``, ``mg K v f``, ``mg S v f`` — that answers
whether this caller won, whether a value arrived meanwhile, and the stale value. The
winner's store is the plain ``set`` of ``K`` and one request ``ms S`` + ``md L C``.

On a node without the meta commands (probed once per node) the store falls back to
:class:`ClassicLeaseStore`, the add-based store whose release compares the lease's CAS.

The stores see their cache through :class:`LeaseHost` only.
"""
from __future__ import annotations

import hashlib
import logging
import math
from functools import cached_property
from typing import Any, Callable, NamedTuple, Protocol

from django_kvcache import steps, stampede
from django_kvcache.memcached import MemcachedError, Refused, Unsupported, wire
from django_kvcache.memcached.exchange import Transport
from django_kvcache.memcached.node import Node
from django_kvcache.stampede import EARLY_SHARE, MISSING, Read

logger = logging.getLogger(__name__)

REFUSALS = (b"SERVER_ERROR", b"CLIENT_ERROR")


class MetaCommandsMissing(Unsupported):
    """The node does not speak the meta commands (memcached < 1.6.6, or a proxy that does
    not forward them, such as twemproxy), which the call needs."""


def other_dialect(exc: MemcachedError) -> bool:
    """A meta reply we could not read: the node answered ``mn`` but speaks the older meta
    dialect of some 1.6 builds (``OK`` for ``HD``, the size as a flag)."""
    if isinstance(exc.__cause__, wire.ProtocolError):
        logger.warning("memcached node %s answers mn but not in the meta dialect of 1.6.6+ "
                       "(%s): herd protection falls back to add-based leases there",
                       exc.node, exc.__cause__)
        return True
    return False


def ttl(node: Node, key: str, io: Transport) -> steps.Plan:
    """Seconds ``key`` has left on ``node`` (django-redis's meaning: None never expires,
    0 missing). ``MetaCommandsMissing`` on a server without meta commands: the classic
    protocol has no way to read an expiry time."""
    missing = ("ttl() cannot know: the classic protocol has no way to read an expiry time, "
               "and this server does not speak the meta commands (mg <key> t; memcached "
               ">= 1.6.6, not forwarded by proxies such as twemproxy)")
    if not (yield from node.speaks_meta(io)):
        raise MetaCommandsMissing(node.name, missing)
    try:
        remaining = yield from node.request(wire.meta_ttl(key.encode()), io)
    except MemcachedError as exc:
        if not other_dialect(exc):
            raise
        node.meta = False
        raise MetaCommandsMissing(node.name, missing) from exc
    if remaining is None:
        return 0
    left = wire.seconds_left(remaining)
    return None if left is None else max(left, 1)  # a live entry: at least a second


def meta_stale_key(stored_key: str) -> str:
    """The key of the meta store's stale copy of the entry stored under ``stored_key``;
    the copy lives on the entry's node, whatever this key's own hash says."""
    return "kvcache-meta-stale:" + hashlib.sha1(stored_key.encode()).hexdigest()


def classic_stale_key(host: LeaseHost, key: Any, version: int | None) -> str:
    """The stored key of the add-based store's stale copy of the caller's ``key``: a key
    of its own, routed as any key is (``ClassicLeaseStore``, on nodes without meta)."""
    return host.make_and_validate_key(stampede.side_key("stale", key), version=version)


class StaleCopies(NamedTuple):
    """Where the stale copies ``get_or_set`` may keep of some entries are deleted, so that
    none outlives its entry or is older than the entry's last value (STALE_TIMEOUT)."""

    #: The meta store's copies, by node: each lives on its entry's node (whatever its own
    #: key's hash says) and is deleted in the entry's request, after the entry.
    riding: dict[Node, list[str]]
    #: Each meta copy's entry: its home is the entry's.
    entry_of: dict[str, str]
    #: The meta copies of entries whose node is down: missed with them.
    stranded: list[str]
    #: The add-based store's copies (where the entry's node is not known to speak the
    #: meta commands): keys of their own, routed as any key, deleted after the entries.
    apart: list[str]


def stale_copies(
    host: LeaseHost, groups: dict[Node, list[str]], stranded: list[str],
    key_map: dict[str, Any], version: int | None, home: Callable[[str], Node],
) -> StaleCopies:
    """The stale copies of the entries placed in ``groups`` (by node) and ``stranded``
    (their node down; ``home``: a key's node, up or down), by where they are deleted."""
    copies = StaleCopies({}, {}, [], [])
    for node, keys in [*groups.items(), *((None, [key]) for key in stranded)]:
        for key in keys:
            copy = meta_stale_key(key)
            copies.entry_of[copy] = key
            if node is None:
                copies.stranded.append(copy)
            else:
                copies.riding.setdefault(node, []).append(copy)
            if (node or home(key)).meta is not True:
                copies.apart.append(classic_stale_key(host, key_map[key], version))
    return copies


class LeaseHost(Protocol):
    """What the lease stores need of their cache (``MemcachedCache``, a ``KVCache``), and
    no more: its Django API (``get``/``set``/``add``/``delete`` and their async twins,
    run as ``CacheCall`` steps) and how its keys, values and timeouts look on the wire.
    Where a key lives now and what a failure becomes are handed to the store apart
    (``node_for``, ``failed``)."""

    #: How log lines name the cache (``CACHES['default']``).
    cache_name: str

    def make_and_validate_key(self, key: Any, version: int | None = None) -> str: ...

    def decode(self, data: bytes, flags: int, key: str) -> Any:
        """The value stored under the stored key ``key``, or MISSING when it is corrupt
        or fails authentication (logged with ``key``)."""

    def encode(self, value: Any, key: str) -> tuple[bytes, int]:
        """A value as stored under the stored key ``key``: ``(data, flags)``."""

    def timeout_seconds(self, timeout: Any = ...) -> float | None:
        """Seconds an entry stored with Django's ``timeout`` lives (None: forever)."""

    def expire_time(self, timeout: Any = ...) -> int:
        """memcached's exptime for an entry living ``timeout`` seconds."""

    def store_entry(
        self, key: Any, value: Any, timeout: Any, version: int | None, io: Transport,
        copy: tuple[bytes, float | None] | None = None, after: list[wire.Op] | None = None,
    ) -> steps.Plan:
        """The winner's ``set`` of the entry, leaving its stale copies alone; with
        ``copy`` (a meta copy's key and lifetime) that copy first and ``after`` after it,
        in the same request on the entry's node."""


class MetaLeaseStore:
    """The lease, the stale copy and early recomputation for one key (module docstring).

    ``node_for`` picks the node of a key now (routing, health, FAILOVER) and may raise;
    ``failed`` raises a ``MemcachedError`` or, under IGNORE_EXCEPTIONS, logs it — then
    the caller computes without protection, as it would without a cache. ``io``: the
    transport of the driver that runs the store's plans (``BLOCKING``, ``ASYNCIO``).
    ``elsewhere`` (with REPLICAS) reads a key on its other replicas than the node asked,
    ``(data, flags)`` or None: the entry a deciding replica lacks (restarted empty) is
    not recomputed while another replica holds it.
    """

    def __init__(
        self,
        host: LeaseHost,
        policy: stampede.Policy,
        key: Any,
        timeout: Any,
        version: Any,
        node_for: Callable[[str], Node],
        failed: Callable[[MemcachedError], Any],
        io: Transport,
        elsewhere: Callable[[str, Node, Transport], steps.Plan] | None = None,
    ) -> None:
        self.host = host
        self.io = io
        self.elsewhere = elsewhere
        self.policy = policy
        self.caller_key, self.timeout, self.version = key, timeout, version
        self.node_for = node_for
        self.failed = failed
        self.key = host.make_and_validate_key(key, version=version)
        self.encoded = self.key.encode()
        self.lifetime = host.timeout_seconds(timeout)
        # wire.exptime keeps a lease alive for at least LEASE_TIMEOUT (whole seconds).
        self.lease_seconds = math.ceil(policy.lease_timeout)
        #: How long a waiter waits before computing without the lease (stampede.plan):
        #: the longest a lease lives (what ``wire.exptime`` sends: lease_seconds + 1),
        #: twice, as with LEASE_TIMEOUT elsewhere.
        self.patience = 2.0 * (self.lease_seconds + 1)
        self.recache = recache_flag(policy, self.lifetime)
        self.node: Node | None = None
        self.cas: int | None = None  # of the lease this caller holds
        self.fallback: ClassicLeaseStore | None = None  # on a node without meta

    # The side items' keys: only a miss needs them, not the usual hit.
    @cached_property
    def lease_key(self) -> bytes:
        return b"kvcache-meta-lease:" + self.digest

    @cached_property
    def stale_item(self) -> str:
        """The stale copy's key, as its value is bound to it (ENCRYPTION_KEYS)."""
        return meta_stale_key(self.key)

    @cached_property
    def stale_key(self) -> bytes:
        return self.stale_item.encode()

    @cached_property
    def digest(self) -> bytes:
        return hashlib.sha1(self.encoded).hexdigest().encode()

    # --- LeaseStore -------------------------------------------------------------------

    def read(self) -> steps.Plan:
        if self.fallback is not None:
            return (yield from self.fallback.read())
        self.node = None
        try:
            node = self.node = self.node_for(self.key)
            if not (yield from node.speaks_meta(self.io)):
                self.fallback = ClassicLeaseStore(
                    self.host, self.policy, self.caller_key, self.timeout, self.version,
                    self.node_for, self.io,
                )
                return (yield from self.fallback.read())
            found = node.count_get(
                (yield from node.request(wire.meta_get_fresh(self.encoded, self.recache), self.io))
            )
            if found is not None:
                value = self.host.decode(found[0], found[1], self.key)
                if value is not MISSING:
                    if not found[2]:
                        return Read(value, True, False)
                    # The first reader in the early window: it recomputes only if it also
                    # takes the lease, so that a reader who finds the entry expired before
                    # the new value is in waits for it instead of computing too.
                    won = yield from self.take_lease(node)
                    return Read(value, True, won)
            elif self.elsewhere is not None:
                found = yield from self.elsewhere(self.key, node, self.io)
                value = MISSING if found is None else self.host.decode(*found, self.key)
                if value is not MISSING:
                    return Read(value, True, False)
            replies = yield from node.request(
                wire.meta_sequence(self.lease_request(), True), self.io
            )
        except MemcachedError as exc:
            if self.node is not None and other_dialect(exc):
                self.node.meta = False  # from now on, the add-based store on this node
                return (yield from self.read())
            return self.unprotected(exc)
        return (yield from self.outcome(node, replies))

    def store(self, value: Any) -> steps.Plan:
        """One request on the entry's node: the stale copy (``ms``) first, then the
        entry, then the lease's release — a delete landing between them removes the
        entry and then the copy, never leaving the deleted value as the copy."""
        if self.fallback is not None:
            return (yield from self.fallback.store(value))
        copy = self.stale_copy()
        release = [self.release_op()] if self.cas is not None else []
        yield from self.host.store_entry(self.caller_key, value, self.timeout, self.version,
                                         self.io, copy, release)

    def release(self) -> steps.Plan:
        if self.fallback is not None:
            return (yield from self.fallback.release())
        if self.cas is None or self.node is None:
            return
        try:
            yield from self.node.request(self.release_op(), self.io)
        except MemcachedError as exc:  # not raised: it would hide the computation's error
            logger.warning("Could not release the lease of %r in %s (it expires by itself): "
                           "%s", self.caller_key, self.host.cache_name, exc)

    # --- the commands and what their replies mean ------------------------------------

    def lease_command(self) -> bytes:
        """Take the lease if nobody holds it (``W``), with its CAS to release it by."""
        return wire.meta_command(
            b"mg", self.lease_key, b"N%d" % wire.exptime(self.lease_seconds), b"c"
        )

    def lease_request(self) -> list[bytes]:
        """Take the lease, read the entry again (a winner may have stored it since our
        first read) and the stale copy: one request, in this order."""
        commands = [self.lease_command(), wire.meta_command(b"mg", self.encoded, b"v", b"f")]
        if self.policy.stale_timeout is not None:
            commands.append(wire.meta_command(b"mg", self.stale_key, b"v", b"f"))
        return commands

    def take_lease(self, node: Node) -> steps.Plan:
        """Whether this caller took the lease (an early recomputation's); a refusal or a
        failure means no: the entry is fresh, nobody needs to wait."""
        try:
            (lease,) = yield from node.request(
                wire.meta_sequence([self.lease_command()], True), self.io
            )
        except MemcachedError as exc:
            self.failed(exc)
            return False
        return self.hold(lease)

    def hold(self, lease: wire.MetaReply) -> bool:
        """Whether the reply to ``lease_command`` gave this caller the lease."""
        if b"W" not in lease.flags:
            return False
        # CAS 0: a server started with -C (no CAS), where ``md C0`` would delete any
        # holder's lease. Then ours is not released: it expires by itself.
        self.cas = lease.number(b"c") or None
        return True

    def outcome(self, node: Node, replies: list[wire.MetaReply]) -> steps.Plan:
        lease, entry = replies[0], replies[1]
        if lease.code in REFUSALS:  # out of memory even for an empty item
            reason = (lease.value or b"").decode(errors="replace")
            return self.unprotected(Refused(node.name, f"lease not taken: {reason}"))
        won = self.hold(lease)
        value = self.value_of(entry, self.key)
        if value is not MISSING:
            yield from self.release()  # stored (and released) by a winner since our read
            self.cas = None
            return Read(value, True, False)
        if won:
            return Read(MISSING, False, True)
        stale = self.value_of(replies[2], self.stale_item) if len(replies) > 2 else MISSING
        return Read(stale, False, False)

    def value_of(self, reply: wire.MetaReply, key: str) -> Any:
        """The value in an ``mg`` reply of the item stored under ``key``."""
        if reply.code != b"VA" or reply.value is None:
            return MISSING
        return self.host.decode(reply.value, reply.number(b"f"), key)

    def stale_copy(self) -> tuple[bytes, float | None] | None:
        """The stale copy's key and lifetime — the entry's lifetime plus STALE_TIMEOUT —
        or None (no STALE_TIMEOUT, or an entry that expires at once)."""
        stale_timeout = self.policy.stale_timeout
        if stale_timeout is None:
            return None
        seconds = self.lifetime
        if seconds is not None and seconds <= 0:
            return None
        return self.stale_key, None if seconds is None else seconds + stale_timeout

    def release_op(self) -> wire.Op:
        """Delete the lease only if it is still ours (after it expired, another caller's
        lease has another CAS)."""
        cas, self.cas = self.cas, None
        return wire.meta_delete(self.lease_key, cas)  # type: ignore[arg-type]

    def unprotected(self, exc: MemcachedError) -> Read:
        """The node failed: raise, or (IGNORE_EXCEPTIONS) log and let this caller compute
        — no herd protection without the node, as without a cache."""
        self.failed(exc)
        self.cas = None
        return Read(MISSING, False, True)


def recache_flag(policy: stampede.Policy, lifetime: float | None) -> int | None:
    """The ``R`` of ``mg … R<secs>`` for an entry stored for ``lifetime`` seconds: memcached
    hands ``W`` to the first reader that finds fewer than R whole seconds left on its
    clock, which ticks once a second. So that reader has at most R - 1 seconds left —
    within EARLY_RECOMPUTE: R is at most EARLY_RECOMPUTE + 1 — and, since an entry is
    stored with lifetime + 1 whole seconds on that clock (``wire.exptime``), more than
    lifetime - R have passed: at least three quarters of the lifetime when R is at most a quarter of
    it (``stampede.Policy.early_window``'s rule, kept on a whole-second clock). None: no
    early recomputation (none asked for, or a window under a second)."""
    if policy.early_window(lifetime) is None:
        return None
    assert lifetime is not None and policy.early_recompute is not None
    flag = min(math.floor(policy.early_recompute) + 1, math.floor(lifetime * EARLY_SHARE))
    return flag if flag >= 2 else None  # R 1: a live item always has a second left


class ClassicLeaseStore(stampede.AddLeaseStore):
    """The add-based store on a node without meta commands, whose holder releases its
    lease only if it is unchanged since its read: classic ``gets`` for the lease's CAS,
    then ``cas`` with a past exptime (replaced by an expired item: deleted). A holder
    whose lease expired meanwhile never deletes its successor's, which a plain ``get``
    and ``delete`` could."""

    def __init__(
        self,
        host: LeaseHost,
        policy: stampede.Policy,
        key: Any,
        timeout: Any,
        version: Any,
        node_for: Callable[[str], Node],
        io: Transport,
    ) -> None:
        super().__init__(host, policy, key, timeout, version)
        self.host = host
        self.node_for = node_for
        self.io = io

    def store(self, value: Any) -> steps.Plan:
        # The copy (a key of its own) first, then the entry — whose stale copies a
        # winner writes and must not delete, unlike a plain ``set``.
        yield from self.store_copy(value)
        yield from self.host.store_entry(self.key, value, self.timeout, self.version, self.io)
        yield from self.release()

    def release(self) -> steps.Plan:
        key = self.host.make_and_validate_key(self.lease_key, version=self.version)
        try:
            node = self.node_for(key)
            found = yield from node.request(wire.gets_one(key.encode()), self.io)
            if found is None:
                return
            data, flags, cas = found
            if self.host.decode(data, flags, key) != self.token:
                return  # not ours: a successor's, after ours expired
            yield from node.request(wire.cas(key.encode(), b"", 0, wire.EXPIRED, cas), self.io)
        except MemcachedError as exc:  # not raised: it would hide the computation's error
            logger.warning("Could not release the lease of %r in %s (it expires by itself): "
                           "%s", self.key, self.host.cache_name, exc)
