"""MemcachedCache's lock store: a lease item and a token counter per lock name.

The shared rules (:mod:`django_kvcache.locks`) decide when to try, wait and give up;
this module gives them, for one name, two items on the name's home node (the node its
key routes to: never a failover node, where another counter would start over):

* the **lease** ``kvcache-lock:<digest>``: added only if absent (``ms … ME``, classic
  ``add``) with the caller's owner id as its value, and memcached's expiry as the
  lease's end. Release and extend compare its CAS (``md``/``ms`` with ``C<cas>``,
  classic ``gets`` then ``cas``), never delete blindly.
* the **token counter** ``kvcache-lock-token:<digest>``: never expires; every try of a
  grant increments it (``ma``) in the same request as the add, which follows it on the
  node at once. Created on a miss (first use, the node restarted, or evicted it) from
  the client's clock in microseconds, so it still exceeds every earlier token of the
  name as long as the clock moves forward and the name was granted fewer than a million
  times a second on average (docs/locks.rst, "What the token guarantees").

memcached counts expiry in whole seconds, and an item stored for n seconds lives
between n - 1 and n of them: a lease is stored for ``ceil(timeout) + 1`` seconds, so it
never ends before ``timeout``, and a holder that died blocks the name for at most
``timeout + 2`` seconds.

On a node or proxy without the meta commands (probed once per node) the classic
commands do the same: ``incr`` and ``add`` in one request, ``gets``/``cas`` to release
and extend (a classic ``cas`` with a past expiry deletes only an unchanged item).
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

from django_kvcache import locks, steps
from django_kvcache.memcached import MemcachedError, NodeError, PoolExhausted, Refused, wire
from django_kvcache.memcached.exchange import Transport
from django_kvcache.memcached.node import Node

#: A classic expiry in the past (an absolute Unix time just over 30 days from 1970): a
#: ``cas`` with it replaces the item with an expired one. (``-1`` means the same to
#: memcached, but proxies refuse it.)
EXPIRED = 60 * 60 * 24 * 30 + 1


def clock_us() -> int:
    """A new counter's first value: the client's clock in microseconds."""
    return time.time_ns() // 1000


class TwoLines:
    """The replies to a classic ``incr`` and an ``add`` sent in one request: the counter
    line and the add's status line, kept as they are; a refused add (it carried a data
    block) leaves the connection out of step."""

    __slots__ = ("result", "in_step")

    def __init__(self) -> None:
        self.result: list[bytes] = []
        self.in_step = True

    def parse(self, buffer: wire.Buffer) -> bool:
        while len(self.result) < 2:
            line = buffer.line()
            if line is None:
                return False
            carries_data = len(self.result) == 1
            if line.startswith(wire.ERROR_REPLIES):
                if carries_data:
                    self.in_step = False
                raise wire.ErrorReply(line, in_step=self.in_step)
            wire.check_line(line, "incr" if not carries_data else "add")
            self.result.append(line)
        return True


class MemcachedLockStore:
    """:class:`django_kvcache.locks.LockStore` for one name of a MemcachedCache."""

    def __init__(self, cluster: Any, host: Any, key: str, io: Transport) -> None:
        """``key``: the name as a stored key (it picks the node); ``host`` gives
        memcached's expiry times (``expire_time``); ``io``: the transport of the driver
        that runs the plans (the sync or the async API's)."""
        self.cluster = cluster
        self.host = host
        self.key = key
        self.io = io
        digest = hashlib.sha1(key.encode()).hexdigest().encode()
        self.lease_key = b"kvcache-lock:" + digest
        self.counter_key = b"kvcache-lock-token:" + digest
        self.home = cluster.home(key)
        self.where = f"memcached node {self.home.name}"

    def __repr__(self) -> str:
        return f"<MemcachedLockStore {self.key!r} on {self.where}>"

    def unreachable(self, exc: BaseException) -> bool:
        return isinstance(exc, (NodeError, PoolExhausted))

    def node(self) -> steps.Plan:
        """The name's home node and whether it speaks meta; ``NodeDown`` while it is
        marked down (a lock never moves to another node)."""
        node: Node = self.cluster.node(self.key, failover=False)
        return node, (yield from node.speaks_meta(self.io))

    def request(self, node: Node, op: wire.Op) -> steps.Plan:
        """``op`` on ``node``, in the driver running the plan."""
        return (yield from node.request(op, self.io))

    def lease_expire(self, seconds: float | None) -> int:
        """memcached's exptime for a lease of ``seconds`` (never shorter)."""
        if seconds is None:
            return 0
        return self.host.expire_time(seconds)  # wire.exptime: never shorter

    # --- the store -----------------------------------------------------------------------

    def grant(self, grant: locks.Grant, seconds: float | None) -> steps.Plan:
        node, meta = yield from self.node()
        expire = self.lease_expire(seconds)
        if meta:
            return (yield from self._meta_grant(node, grant, expire))
        return (yield from self._classic_grant(node, grant, expire))

    def _meta_grant(self, node: Node, grant: locks.Grant, expire: int) -> steps.Plan:
        draw = wire.meta_command(b"ma", self.counter_key, b"N0", b"J%d" % clock_us(), b"v")
        add = wire.meta_command(b"ms", self.lease_key, b"ME", b"T%d" % expire, b"c",
                                data=grant.owner)
        counter, lease = yield from self.request(node, wire.meta_sequence([draw, add], True))
        for reply in (counter, lease):
            if reply.code in wire.ERROR_REPLIES:
                raise Refused(node.name, f"lock not granted: {(reply.value or b'').decode()}")
        if counter.code != b"VA" or lease.code not in (b"HD", b"NS"):
            raise MemcachedError(node.name, f"unexpected replies to a lock grant: "
                                 f"{counter.code!r}, {lease.code!r}")
        if lease.code == b"NS":
            return False
        self._cas(node, lease.number(b"c"))  # a server without CAS cannot release safely
        grant.token = wire.number(counter.value or b"", "a lock token")
        return True

    def _classic_grant(self, node: Node, grant: locks.Grant, expire: int) -> steps.Plan:
        request = (b"incr %b 1\r\n" % self.counter_key
                   + wire.store_command(b"add", self.lease_key, grant.owner, 0, expire))
        counter, lease = yield from self.request(node, wire.Op(request, TwoLines, True))
        if lease not in (b"STORED", b"NOT_STORED"):
            raise MemcachedError(node.name, f"unexpected reply to add: {lease[:80]!r}")
        if counter == b"NOT_FOUND":
            # No counter (first use, or the node lost it): the lease taken without a
            # token is given back, the counter created, and the grant tried again — so
            # the increment and the add always travel together.
            if lease == b"STORED":
                yield from self.release(grant)
            yield from self.request(
                node, wire.store(b"add", self.counter_key, b"%d" % clock_us(), 0, 0))
            return (yield from self._classic_grant(node, grant, expire))
        if lease == b"NOT_STORED":
            return False
        grant.token = wire.number(counter, "a lock token")
        return True

    @staticmethod
    def _cas(node: Node, cas: int) -> int:
        if not cas:
            raise locks.LockError(
                f"memcached node {node.name} runs without CAS (-C): locks need it to tell "
                "one grant from another"
            )
        return cas

    def _current(self, node: Node, meta: bool, grant: locks.Grant) -> steps.Plan:
        """The lease's CAS if it holds ``grant``'s owner id, else None; with meta, also
        its remaining seconds."""
        if meta:
            (found,) = yield from self.request(node, wire.meta_sequence(
                [wire.meta_command(b"mg", self.lease_key, b"v", b"c", b"t")], False))
            if found.code != b"VA" or found.value != grant.owner:
                return None, None
            return self._cas(node, found.number(b"c")), wire.seconds_left(found.number(b"t"))
        found = yield from self.request(node, wire.gets_one(self.lease_key))
        if found is None or found[0] != grant.owner:
            return None, None
        return self._cas(node, found[2]), None

    def release(self, grant: locks.Grant) -> steps.Plan:
        # The lease is read first, even with the CAS of our own grant at hand: a node
        # that restarted counts CAS values from 1 again, so a successor's lease may have
        # the very CAS ours had; only the owner id tells them apart.
        node, meta = yield from self.node()
        cas, _ = yield from self._current(node, meta, grant)
        if cas is None:
            return False
        if meta:
            (reply,) = yield from self.request(node, wire.meta_sequence(
                [wire.meta_command(b"md", self.lease_key, b"C%d" % cas)], True))
            return reply.code == b"HD"
        return (yield from self.request(node, wire.cas(self.lease_key, b"", 0, EXPIRED, cas)))

    def extend(self, grant: locks.Grant, seconds: float, replace: bool) -> steps.Plan:
        node, meta = yield from self.node()
        cas, left = yield from self._current(node, meta, grant)
        if cas is None:
            return False
        if not replace:
            if left is None:  # classic: what this process reckons is left
                left = 0.0 if grant.ends is None else max(grant.ends - time.monotonic(), 0.0)
            seconds = left + seconds
        expire = self.lease_expire(seconds)
        if meta:
            (reply,) = yield from self.request(node, wire.meta_sequence([wire.meta_command(
                b"ms", self.lease_key, b"T%d" % expire, b"C%d" % cas, data=grant.owner)], True))
            return reply.code == b"HD"
        return (yield from self.request(
            node, wire.cas(self.lease_key, grant.owner, 0, expire, cas)))

    def peek(self) -> steps.Plan:
        node, meta = yield from self.node()
        found = yield from self.request(node, wire.get_one(self.lease_key))
        return None if found is None else found[0]

    def holder_token(self) -> steps.Plan:
        """Not kept with the lease on memcached (for tests: the counter's value)."""
        node, _ = yield from self.node()
        found = yield from self.request(node, wire.get_one(self.counter_key))
        return None if found is None else int(found[0])
