"""One memcached server as the backend sees it: address, pools, health and counters.

Every request to it goes through the exchange (:mod:`django_kvcache.memcached.exchange`),
one state machine for both drivers. Inside a plan it is one way, whatever the driver:
``value = yield from node.request(op, io)`` (and :meth:`Node.get`), with the plan's own
transport ``io`` (``BLOCKING`` for ``steps.run``, ``ASYNCIO`` for ``steps.arun``).
Outside a plan, :meth:`Node.call` runs one request on blocking sockets and
:meth:`Node.acall` on the running event loop. The node's counters (``ops``, ``hits``,
``bytes_sent``…) are bumped by the exchange and by the plans' own counting
(``count_get``), never above.
"""
from __future__ import annotations

import time
from typing import Any, Awaitable

from django_kvcache import steps
from django_kvcache.health import NodeHealth
from django_kvcache.memcached import NodeDown, NodeError, Unsupported, aio, wire
from django_kvcache.memcached.connection import TIMEOUTS, ConnectTimeout, SendTimeout
from django_kvcache.memcached.exchange import (
    ASYNCIO,
    BLOCKING,
    TIMEOUT_ERRORS,
    Batch,
    Transport,
    get_one,
    request,
)
from django_kvcache.memcached.pool import NodePool
from django_kvcache.memcached.routing import NodeAddress
from django_kvcache.memcached.stale import OutdatedCopies, RepairTurn, UnsettledSockets

__all__ = ["ASYNCIO", "BLOCKING", "COUNTERS", "Node", "TIMEOUTS"]

COUNTERS = (
    "ops", "hits", "misses", "errors", "timeouts", "ignored",
    "bytes_sent", "bytes_received", "bytes_saved",
)


class Node:
    """Counters are plain ints: cheap, and exact enough under the GIL for monitoring."""

    #: The last event loop that used the node, and that loop's pool for it (``aio.pool_of``),
    #: as weak references.
    loop_pool: tuple[Any, Any] | None = None
    #: The last loop's gets waiting to go out together (``autobatch.batch_for``), as a
    #: weak reference.
    loop_gets: Any = None

    def __init__(self, address: NodeAddress, pool: NodePool, health: NodeHealth) -> None:
        self.name = address.name
        self.pool = pool
        self.health = health
        self.outdated = OutdatedCopies(self.name)
        self.unsettled = UnsettledSockets()
        self.repair_turn = RepairTurn(self.name)
        self.meta: bool | None = None  # speaks the meta commands? asked once (speaks_meta)
        self.flushes: bool | None = None  # forwards flush_all? learned at the first clear()
        self.ops = self.hits = self.misses = self.errors = self.timeouts = self.ignored = 0
        #: When the node last failed or was found restarted (monotonic; 0: never, in this
        #: process): with REPLICAS, it may lack entries the others have (``behind``).
        self.behind_since = 0.0
        self.bytes_sent = self.bytes_received = self.bytes_saved = 0

    def __repr__(self) -> str:
        return f"<memcached node {self.name}>"

    def request(
        self, op: wire.Op, io: Transport, sent: int = 0, saved: int = 0
    ) -> steps.Plan:
        """``op`` on a connection of this node, inside a plan run by the driver of
        ``io``: ``value = yield from node.request(op, io)``, what ``op`` makes of the
        reply. ``sent`` and ``saved`` bytes are credited once the node answered. A
        refused request raises ``Refused``, a failure ``NodeError``, a busy pool
        ``PoolExhausted`` (the exchange decides which, for both drivers)."""
        return request(Batch(self, op, sent, saved), io)

    def get(self, key: bytes, io: Transport) -> steps.Plan:
        """A single-key ``get`` in a plan: ``(data, flags)`` or None, counted as a hit or
        a miss. On the event loop, with AUTOBATCH, it may go out with the loop
        iteration's other gets for the node (the exchange decides)."""
        return get_one(self, key, io, self.count_get)

    def speaks_meta(self, io: Transport) -> steps.Plan:
        """Whether the server speaks the meta commands: asked once (``mn``), remembered
        for the process. memcached before 1.6.6 answers ``ERROR``; a proxy that does not
        forward them (twemproxy) closes the connection — a refusal once the node answers
        a ``version`` (a node that fails it raises, counted as any failure)."""
        if self.meta is None:
            self.meta = yield from self.supports(wire.meta_probe(), io)
        return self.meta

    def supports(self, op: wire.Op, io: Transport) -> steps.Plan:
        """What the optional ``op`` makes of its reply, or False when the server closed
        the connection on it and still answers a ``version``: it does not support it."""
        try:
            return (yield from self.request(op, io))
        except Unsupported:
            yield from self.request(wire.fence(), io)  # the node answers: the command it is
            return False

    def call(self, op: wire.Op, ops: int = 1) -> Any:
        """``request`` outside a plan, on blocking sockets; counted as ``ops``
        operations."""
        batch = Batch(self, op)
        batch.ops = ops
        return steps.run(request(batch, BLOCKING))

    def acall(self, op: wire.Op, ops: int = 1) -> Awaitable[Any]:
        """``request`` outside a plan, on the running event loop (an awaitable)."""
        batch = Batch(self, op)
        batch.ops = ops
        return steps.arun(request(batch, ASYNCIO))

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
        self.behind_since = time.monotonic()
        if isinstance(exc, TIMEOUT_ERRORS):  # Python's or the kernel's
            self.timeouts += 1
        reason = failure_reason(exc, self.pool.settings.io_timeout)
        self.health.failed(reason)
        error = NodeError(self.name, reason)
        error.problem = failure_problem(exc)
        error.__cause__ = exc
        return error

    def gets_to_fetch(self, op: wire.Op) -> Awaitable[Any]:
        """The request of an autobatched get (``autobatch``), an awaitable: the callers
        count their ops."""
        return self.acall(op, ops=0)

    def metrics(self) -> dict[str, Any]:
        counters = {name: getattr(self, name) for name in COUNTERS}
        counters.update({f"pool_{name}": value for name, value in self.pool.figures().items()})
        counters.update(
            down=self.health.down,
            consecutive_failures=self.health.failures,
            outdated_keys=len(self.outdated.keys),
            flush_pending=self.outdated.flush,
            late_writes=len(self.unsettled.connections),
        )
        counters.update(aio.pool_figures(self))
        return counters


def failure_reason(exc: BaseException, io_timeout: float | None) -> str:
    """What a node's failure was, in the settings' words: a kernel timeout surfaces as
    ``BlockingIOError`` (EAGAIN), which is the deadline, not the cause."""
    if isinstance(exc, ConnectTimeout):
        return str(exc)  # no connection within CONNECT_TIMEOUT (1 s)
    if isinstance(exc, TIMEOUT_ERRORS):
        limit = "" if io_timeout is None else f" ({io_timeout:g} s)"
        detail = str(exc)  # kept where it says more than that time ran out
        plain = isinstance(exc, (BlockingIOError, SendTimeout)) or detail in ("", "timed out")
        return f"did not answer within IO_TIMEOUT{limit}" + ("" if plain else f": {detail}")
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused: nothing listens there (memcached down, or a wrong LOCATION)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def failure_problem(exc: BaseException) -> str:
    """``failure_reason`` in a word (``NodeError.problem``)."""
    if isinstance(exc, TIMEOUT_ERRORS):
        return "timeout"
    return "refused" if isinstance(exc, ConnectionRefusedError) else "failed"
