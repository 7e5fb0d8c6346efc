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
from typing import Any, Callable, Protocol

from django_kvcache import steps, stampede
from django_kvcache.memcached import MemcachedError, Refused, wire
from django_kvcache.memcached.node import Node
from django_kvcache.stampede import MISSING, CacheCall, Read

logger = logging.getLogger(__name__)

REFUSALS = (b"SERVER_ERROR", b"CLIENT_ERROR")


class MetaCommandsMissing(MemcachedError, NotImplementedError):
    """The node does not speak the meta commands (memcached < 1.6.6), which the call needs."""


def other_dialect(exc: MemcachedError) -> bool:
    """A meta reply we could not read: the node answered ``mn`` but speaks the older meta
    dialect of some 1.6 builds (``OK`` for ``HD``, the size as a flag)."""
    if isinstance(exc.__cause__, wire.ProtocolError):
        logger.warning("memcached node %s answers mn but not in the meta dialect of 1.6.6+ "
                       "(%s): herd protection falls back to add-based leases there",
                       exc.node, exc.__cause__)
        return True
    return False


def speaks_meta(node: Node) -> steps.Plan:
    """Whether ``node`` speaks the meta commands; asked once per node (``mn``)."""
    if node.meta is None:
        node.meta = yield from node.call_plan(wire.meta_probe())
    return node.meta


def ttl(node: Node, key: str) -> steps.Plan:
    """Seconds ``key`` has left on ``node`` (django-redis's meaning: None never expires,
    0 missing). ``MetaCommandsMissing`` on a server without meta commands: the classic
    protocol has no way to read an expiry time."""
    missing = "ttl() needs memcached >= 1.6.6 (meta commands: mg <key> t)"
    if not (yield from speaks_meta(node)):
        raise MetaCommandsMissing(node.name, missing)
    try:
        remaining = yield from node.call_plan(wire.meta_ttl(key.encode()))
    except MemcachedError as exc:
        if not other_dialect(exc):
            raise
        node.meta = False
        raise MetaCommandsMissing(node.name, missing) from exc
    if remaining is None:
        return 0
    return None if remaining < 0 else remaining


def meta_stale_key(stored_key: str) -> str:
    """The key of the meta store's stale copy of the entry stored under ``stored_key``;
    the copy lives on the entry's node, whatever this key's own hash says."""
    return "kvcache-meta-stale:" + hashlib.sha1(stored_key.encode()).hexdigest()


def classic_stale_key(host: LeaseHost, key: Any, version: int | None) -> str:
    """The stored key of the add-based store's stale copy of the caller's ``key``: a key
    of its own, routed as any key is (``ClassicLeaseStore``, on nodes without meta)."""
    return host.make_and_validate_key(stampede.side_key("stale", key), version=version)


class LeaseHost(Protocol):
    """What the lease stores need of their cache (``MemcachedCache``, a ``KVCache``), and
    no more: its Django API (``get``/``set``/``add``/``delete`` and their async twins,
    run as ``CacheCall`` steps) and how its keys, values and timeouts look on the wire.
    Where a key lives now and what a failure becomes are handed to the store apart
    (``node_for``, ``failed``)."""

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


class MetaLeaseStore:
    """The lease, the stale copy and early recomputation for one key (module docstring).

    ``node_for`` picks the node of a key now (routing, health, FAILOVER) and may raise;
    ``failed`` raises a ``MemcachedError`` or, under IGNORE_EXCEPTIONS, logs it — then
    the caller computes without protection, as it would without a cache.
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
    ) -> None:
        self.host = host
        self.policy = policy
        self.caller_key, self.timeout, self.version = key, timeout, version
        self.node_for = node_for
        self.failed = failed
        self.key = host.make_and_validate_key(key, version=version)
        self.encoded = self.key.encode()
        self.lifetime = host.timeout_seconds(timeout)
        # memcached counts whole seconds and an item set for n seconds lives between
        # n - 1 and n of them: one more keeps a lease alive for at least LEASE_TIMEOUT.
        self.lease_seconds = math.ceil(policy.lease_timeout) + 1
        #: How long a waiter waits before computing without the lease (stampede.plan):
        #: the longest a lease lives, twice, as with LEASE_TIMEOUT elsewhere.
        self.patience = 2.0 * self.lease_seconds
        self.recache = recache_flag(policy.early_window(self.lifetime))
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
            if not (yield from speaks_meta(node)):
                self.fallback = ClassicLeaseStore(
                    self.host, self.policy, self.caller_key, self.timeout, self.version,
                    self.node_for,
                )
                return (yield from self.fallback.read())
            found = node.count_get(
                (yield from node.call_plan(wire.meta_get_fresh(self.encoded, self.recache)))
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
            replies = yield from node.call_plan(wire.meta_sequence(self.lease_request(), True))
        except MemcachedError as exc:
            if self.node is not None and other_dialect(exc):
                self.node.meta = False  # from now on, the add-based store on this node
                return (yield from self.read())
            return self.unprotected(exc)
        return (yield from self.outcome(node, replies))

    def store(self, value: Any) -> steps.Plan:
        if self.fallback is not None:
            return (yield from self.fallback.store(value))
        yield CacheCall(self.host, "set", self.caller_key, value, self.timeout,
                        version=self.version)
        commands = []
        stale = self.stale_command(value)
        if stale is not None:
            commands.append(stale)
        if self.cas is not None:
            commands.append(self.release_command())
        if commands and self.node is not None:
            try:
                yield from self.node.call_plan(wire.meta_sequence(commands, True))
            except MemcachedError as exc:
                self.failed(exc)

    def release(self) -> steps.Plan:
        if self.fallback is not None:
            return (yield from self.fallback.release())
        if self.cas is None or self.node is None:
            return
        try:
            yield from self.node.call_plan(wire.meta_sequence([self.release_command()], True))
        except MemcachedError as exc:  # not raised: it would hide the computation's error
            logger.warning("Could not release the lease of %r (it expires by itself): %s",
                           self.caller_key, exc)

    # --- the commands and what their replies mean ------------------------------------

    def lease_command(self) -> bytes:
        """Take the lease if nobody holds it (``W``), with its CAS to release it by."""
        return wire.meta_command(b"mg", self.lease_key, b"N%d" % self.lease_seconds, b"c")

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
            (lease,) = yield from node.call_plan(wire.meta_sequence([self.lease_command()], True))
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

    def stale_command(self, value: Any) -> bytes | None:
        """The ``ms`` of the stale copy: the entry's lifetime plus STALE_TIMEOUT."""
        stale_timeout = self.policy.stale_timeout
        if stale_timeout is None:
            return None
        seconds = self.lifetime
        if seconds is not None and seconds <= 0:
            return None
        expire = self.host.expire_time(None if seconds is None else seconds + stale_timeout)
        data, flags = self.host.encode(value, self.stale_item)
        return wire.meta_command(b"ms", self.stale_key, b"T%d" % expire, b"F%d" % flags,
                                 data=data)

    def release_command(self) -> bytes:
        """Delete the lease only if it is still ours (after it expired, another caller's
        lease has another CAS)."""
        cas, self.cas = self.cas, None
        return wire.meta_command(b"md", self.lease_key, b"C%d" % cas)

    def unprotected(self, exc: MemcachedError) -> Read:
        """The node failed: raise, or (IGNORE_EXCEPTIONS) log and let this caller compute
        — no herd protection without the node, as without a cache."""
        self.failed(exc)
        self.cas = None
        return Read(MISSING, False, True)


def recache_flag(window: float | None) -> int | None:
    """The ``R`` of ``mg … R<secs>`` for an early window of ``window`` seconds: memcached
    hands ``W`` to the first reader that finds fewer than R whole seconds left, and a
    live item has at least one, so R - 1 whole seconds is the window it gives — never
    more than the rule allows. Under a second: none (memcached's clock has no finer
    step)."""
    if window is None or window < 1:
        return None
    return math.floor(window) + 1


class ClassicLeaseStore(stampede.AddLeaseStore):
    """The add-based store on a node without meta commands, whose holder releases its
    lease only if it is unchanged since its read: classic ``gets`` for the lease's CAS,
    then ``cas`` with an exptime of -1 (replaced by an expired item: deleted). A holder
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
    ) -> None:
        super().__init__(host, policy, key, timeout, version)
        self.host = host
        self.node_for = node_for

    def release(self) -> steps.Plan:
        key = self.host.make_and_validate_key(self.lease_key, version=self.version)
        try:
            node = self.node_for(key)
            found = yield from node.call_plan(wire.gets_one(key.encode()))
            if found is None:
                return
            data, flags, cas = found
            if self.host.decode(data, flags, key) != self.token:
                return  # not ours: a successor's, after ours expired
            yield from node.call_plan(wire.cas(key.encode(), b"", 0, -1, cas))
        except MemcachedError as exc:  # not raised: it would hide the computation's error
            logger.warning("Could not release the lease of %r (it expires by itself): %s",
                           self.key, exc)
