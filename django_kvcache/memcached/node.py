"""One memcached server as the backend sees it: address, pools, health and counters.

Every request to it goes through the exchange (:mod:`django_kvcache.memcached.exchange`),
one state machine for both drivers: :meth:`Node.call` runs it on blocking sockets,
:meth:`Node.acall` on the running event loop, and a plan that knows its driver's
transport runs it inline (:meth:`Node.exchange`, :meth:`Node.get`); a plan that does not
yields :class:`Call`, which picks the driver by how the plan is run. The node's counters
(``ops``, ``hits``, ``bytes_sent``…) are bumped by the exchange and by the plans' own
counting (``count_get``), never above.
"""
from __future__ import annotations

import time
from typing import Any

from django_kvcache import steps
from django_kvcache.health import NodeHealth
from django_kvcache.memcached import NodeDown, NodeError, aio, wire
from django_kvcache.memcached.connection import TIMEOUTS
from django_kvcache.memcached.exchange import (
    ASYNCIO,
    BLOCKING,
    TIMEOUT_ERRORS,
    Batch,
    Transport,
    call,
)
from django_kvcache.memcached.pool import NodePool
from django_kvcache.memcached.routing import NodeAddress
from django_kvcache.memcached.stale import LateWrites, OutdatedCopies

__all__ = ["ASYNCIO", "BLOCKING", "COUNTERS", "Call", "Node", "TIMEOUTS"]

COUNTERS = (
    "ops", "hits", "misses", "errors", "timeouts", "ignored",
    "bytes_sent", "bytes_received", "bytes_saved",
)


class Node:
    """Counters are plain ints: cheap, and exact enough under the GIL for monitoring."""

    def __init__(self, address: NodeAddress, pool: NodePool, health: NodeHealth) -> None:
        self.name = address.name
        self.pool = pool
        self.health = health
        self.outdated = OutdatedCopies()
        self.late = LateWrites()
        self.meta: bool | None = None  # speaks the meta commands? asked once (wire.meta_probe)
        self.ops = self.hits = self.misses = self.errors = self.timeouts = self.ignored = 0
        self.bytes_sent = self.bytes_received = self.bytes_saved = 0

    def __repr__(self) -> str:
        return f"<memcached node {self.name}>"

    def call(self, op: wire.Op, sent: int = 0, saved: int = 0, ops: int = 1) -> Any:
        """``op`` on a connection of the blocking pool: what ``op`` makes of the reply.

        Counted as ``ops`` operations; ``sent`` and ``saved`` bytes are credited once the
        node answered. A refused request raises ``Refused``, a failure ``NodeError``,
        a busy pool ``PoolExhausted`` (``exchange`` decides which, for both drivers).
        """
        batch = Batch(self, op, sent, saved)
        batch.ops = ops
        return steps.run(call(batch, BLOCKING))

    async def acall(self, op: wire.Op, sent: int = 0, saved: int = 0, ops: int = 1) -> Any:
        """``call`` on the running event loop's pool for this node: the same exchange."""
        batch = Batch(self, op, sent, saved)
        batch.ops = ops
        return await steps.arun(call(batch, ASYNCIO))

    def call_plan(self, op: wire.Op, sent: int = 0, saved: int = 0) -> steps.Plan:
        """``call`` as a plan step: ``yield from node.call_plan(op)`` (or ``yield
        Call(node, op)``) runs it on whichever driver runs the plan."""
        return (yield Call(self, op, sent, saved))

    def exchange(
        self, op: wire.Op, transport: Transport, sent: int = 0, saved: int = 0
    ) -> steps.Plan:
        """``call`` inside a plan that knows its driver's ``transport`` (``BLOCKING`` for
        ``steps.run``, ``ASYNCIO`` for ``steps.arun``): ``value = yield from
        node.exchange(op, io)`` runs the exchange in the plan's own driver, with no step
        and no driver of its own."""
        return call(Batch(self, op, sent, saved), transport)

    def get(self, key: bytes, transport: Transport) -> steps.Plan:
        """A single-key ``get`` in a plan: ``(data, flags)`` or None, counted as a hit or
        a miss. On the event loop, with AUTOBATCH, it may go out with the loop
        iteration's other gets for the node (the exchange decides)."""
        batch = Batch(self, wire.get_one(key))
        batch.gets, batch.one, batch.on_result = [key], True, self.count_get
        return call(batch, transport)

    def count_get(self, found: tuple[bytes, int] | None) -> tuple[bytes, int] | None:
        """A single-key read's outcome, counted as a hit or a miss."""
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
            self.bytes_received += len(found[0])
        return found

    # --- failures and observability ----------------------------------------------------

    def skipped(self) -> NodeDown:
        """The error of a request not sent because the node is marked down (counted)."""
        self.errors += 1
        retry_in = max(0.0, self.health.down_until - time.monotonic())
        return NodeDown(
            self.name,
            f"marked down after {self.health.failures} consecutive failures; "
            f"next try in {retry_in:.1f} s (RETRY_TIMEOUT)",
        )

    def failure(self, exc: BaseException) -> NodeError:
        """Count a failed exchange and tell the health record; the error to raise."""
        self.errors += 1
        if isinstance(exc, TIMEOUT_ERRORS):  # Python's or the kernel's
            self.timeouts += 1
            reason = f"timed out ({type(exc).__name__}: {exc})"
        else:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.health.failed(reason)
        error = NodeError(self.name, reason)
        error.__cause__ = exc
        return error

    def gets_to_fetch(self, op: wire.Op) -> Any:
        """The request of an autobatched get (``autobatch``): the callers count their ops."""
        return self.acall(op, ops=0)

    def metrics(self) -> dict[str, Any]:
        counters = {name: getattr(self, name) for name in COUNTERS}
        counters.update({f"pool_{name}": value for name, value in self.pool.figures().items()})
        counters.update(
            down=self.health.down,
            consecutive_failures=self.health.failures,
            outdated_keys=len(self.outdated.keys),
            flush_pending=self.outdated.flush,
            late_writes=len(self.late.connections),
        )
        counters.update(aio.pool_figures(self))
        return counters


# --- the steps a plan yields for one node --------------------------------------------------


class Call:
    """One op on one node: ``Node.call`` blocking, ``Node.acall`` on the loop."""

    __slots__ = ("node", "op", "sent", "saved")

    def __init__(self, node: Node, op: wire.Op, sent: int = 0, saved: int = 0) -> None:
        self.node, self.op, self.sent, self.saved = node, op, sent, saved

    def run(self) -> Any:
        return self.node.call(self.op, self.sent, self.saved)

    def arun(self) -> Any:
        return self.node.acall(self.op, self.sent, self.saved)
