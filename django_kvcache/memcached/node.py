"""One memcached server as the backend sees it: address, pool, health and counters.

Every exchange with the server — a single-key call or a node's share of a fan-out —
holds its connection through a :class:`Lease`, the one place that decides what becomes
of it: checked in after a success, kept open as a late write after a write timed out,
discarded after anything else (including ``KeyboardInterrupt``). The node's counters
(``ops``, ``hits``, ``bytes_sent``…) are bumped here and in ``fanout``, never above.

This is also the one layer that translates what the sockets and the wire parser raise
into the backend's errors (:mod:`django_kvcache.memcached`): the sync path here, the
asyncio path in ``aio`` with the same :class:`Lease` and :meth:`Node.failure`.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from django_kvcache.health import NodeHealth
from django_kvcache import steps
from django_kvcache.memcached import NodeDown, NodeError, Refused, aio, wire
from django_kvcache.memcached.connection import (
    TIMEOUTS,
    Connection,
    WriteTimeout,
    asettle,
    settle,
)
from django_kvcache.memcached.pool import NodePool
from django_kvcache.memcached.routing import NodeAddress
from django_kvcache.memcached.stale import LateWrites, OutdatedCopies

#: Errors that mean the node (or the path to it) failed, not the request. (On Python
#: 3.10 ``asyncio.TimeoutError``, raised by ``asyncio.wait_for``, is not an OSError.)
NODE_FAILURES = (OSError, EOFError, wire.ProtocolError, asyncio.TimeoutError)
#: Errors a pooled connection shows when the server restarted since its last use.
STALE_CONNECTION = (ConnectionError, EOFError)

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

    def call(
        self, op: wire.Op, retry: bool = True, sent: int = 0, saved: int = 0, ops: int = 1
    ) -> Any:
        """``op`` on a connection of the blocking pool: what ``op`` returns, counted as
        one operation.

        A connection that broke while it sat in the pool (server restarted) is replaced
        and the op retried once, unless ``retry`` is off (``incr``/``decr``).
        ``sent`` and ``saved`` are credited to ``bytes_sent``/``bytes_saved`` on success.
        A request the server refused raises ``Refused`` (the connection is fine).
        What a failure does is decided once, for both transports, by ``Lease.ended_by``.
        ``ops``: how many operations it counts as (an autobatch's callers count theirs).
        """
        self.ops += ops
        pool = self.pool
        while True:
            lease = Lease(self, pool.checkout(), pool)
            try:
                if self.late.pending or self.outdated.pending:
                    self.repair(lease.client)
                result = lease.client.exchange(op)
            except BaseException as exc:
                retry = lease.ended_by(exc, retry)  # raises, or says "retry once"
                continue
            lease.release()
            self.bytes_sent += sent
            self.bytes_saved += saved
            return result

    async def acall(
        self, op: wire.Op, retry: bool = True, sent: int = 0, saved: int = 0, ops: int = 1
    ) -> Any:
        """``call`` on the running event loop's pool for this node: the same steps, awaited."""
        self.ops += ops
        pool = aio.pool_of(self)
        while True:
            lease = Lease(self, await pool.checkout(), pool)
            try:
                if self.late.pending or self.outdated.pending:
                    await self.arepair(lease.client)
                result = await lease.client.exchange(op)
            except BaseException as exc:
                retry = lease.ended_by(exc, retry)
                continue
            lease.release()
            self.bytes_sent += sent
            self.bytes_saved += saved
            return result

    def call_plan(
        self, op: wire.Op, retry: bool = True, sent: int = 0, saved: int = 0
    ) -> steps.Plan:
        """``call`` as a plan step: ``yield from node.call_plan(op)`` (or ``yield
        Call(node, op)``) runs it on whichever transport drives the plan."""
        return (yield Call(self, op, retry, sent, saved))

    def get(self, key: str) -> tuple[bytes, int] | None:
        """``get`` of one key: ``(data, flags)`` or None, counted as a hit or a miss."""
        return self.count_get(self.call(wire.get_one(key.encode())))

    def count_get(self, found: tuple[bytes, int] | None) -> tuple[bytes, int] | None:
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
            self.bytes_received += len(found[0])
        return found

    # --- before the node serves again ---------------------------------------------------

    def ready(self, client: Connection) -> None:
        """Settle late writes and delete outdated copies first, if any (two bool reads)."""
        if self.late.pending or self.outdated.pending:
            self.repair(client)

    def repair(self, client: Connection) -> None:
        """Let every write that may still land land, then clean up (on ``client``).

        One thread at a time: another must not clean up while writes that this one took
        to settle can still land after its clean-up.
        """
        timeouts = self.late.timeouts
        with self.late.repairing:
            self.check_not_queued_behind_a_timeout(timeouts)
            steps.run(self.repair_plan(client))

    async def arepair(self, client: Any) -> None:
        """``repair`` on the event loop (``client`` an asyncio connection): the lock is
        taken without blocking the loop."""
        lock, timeouts = self.late.repairing, self.late.timeouts
        while not lock.acquire(blocking=False):  # a thread is repairing: let it finish
            await asyncio.sleep(0.001)
        try:
            self.check_not_queued_behind_a_timeout(timeouts)
            await steps.arun(self.repair_plan(client))
        finally:
            lock.release()

    def check_not_queued_behind_a_timeout(self, timeouts_before: int) -> None:
        if self.late.pending and self.late.timeouts != timeouts_before:
            raise TimeoutError("a late write is still not settled (it timed out just now)")

    def repair_plan(self, client: Any) -> steps.Plan:
        """Settle every timed-out write — its unsent rest and a fence, then the fence's
        reply — then delete this node's outdated copies (see ``stale``) on ``client``.

        A timeout means the node still does not serve: the request fails and the clean-up
        waits. A closed or reset connection can apply nothing more: settled.
        """
        io_timeout = self.pool.settings.io_timeout
        late = self.late.take()
        try:
            while late:
                sock, unsent = late[-1]
                try:
                    yield Settle(sock, unsent, io_timeout)
                except WriteTimeout as exc:  # not the caller's write: a plain timeout
                    late[-1] = (sock, exc.unsent)
                    self.late.timeouts += 1
                    raise TimeoutError("a late write is still not settled") from exc
                except TIMEOUTS:
                    late[-1] = (sock, b"")  # all sent: a retry only reads
                    self.late.timeouts += 1
                    raise
                except NODE_FAILURES:
                    pass
                late.pop()
                sock.close()
        finally:
            if late:
                self.late.put_back(late)
        if self.outdated.pending:
            keys, flush = self.outdated.take()
            try:
                if keys or flush:
                    yield steps.Invoke(client.exchange, OutdatedCopies.op(keys, flush))
            except BaseException:
                self.outdated.put_back(keys, flush)
                raise
            self.outdated.done()

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

    def refused(self, exc: wire.ErrorReply) -> Refused:
        """A request the server refused (too large, out of memory, not a number)."""
        return Refused(self.name, str(exc), client_error=exc.client_error)

    def failure(self, exc: BaseException) -> NodeError:
        """Count a failed exchange and tell the health record; the error to raise."""
        self.errors += 1
        if isinstance(exc, TIMEOUTS + (asyncio.TimeoutError,)):  # Python's or the kernel's
            self.timeouts += 1
            reason = f"timed out ({type(exc).__name__}: {exc})"
        else:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.health.failed(reason)
        return NodeError(self.name, reason)

    def metrics(self) -> dict[str, Any]:
        counters = {name: getattr(self, name) for name in COUNTERS}
        pool = self.pool
        counters.update(
            pool_size=pool.size,
            pool_idle=len(pool.idle),
            pool_waits=pool.waits,
            pool_connects=pool.connects,
            down=self.health.down,
            consecutive_failures=self.health.failures,
            outdated_keys=len(self.outdated.keys),
            flush_pending=self.outdated.flush,
            late_writes=len(self.late.connections),
        )
        counters.update(aio.pool_figures(self))
        return counters


class Lease:
    """One connection checked out of a node's pool, until it is checked in (``release``:
    the node counts as answering) or dropped (``drop``, ``fail``, ``ended_by``)."""

    __slots__ = ("node", "pool", "client", "reused")

    def __init__(self, node: Node, client: Any, pool: Any = None) -> None:
        self.node = node
        self.pool = node.pool if pool is None else pool  # the sync pool, or a loop's
        self.client: Any = client
        self.reused = client.sock is not None  # a pooled connection that may have gone stale

    def release(self) -> None:
        """The exchange succeeded: back to the pool."""
        client, self.client = self.client, None
        assert client is not None
        self.pool.checkin(client)
        if self.node.health.failures:
            self.node.health.succeeded()

    def drop(self, exc: BaseException) -> None:
        """The exchange failed: keep a timed-out write's socket to settle, close the rest."""
        client, self.client = self.client, None
        assert client is not None
        pool = self.pool
        if isinstance(exc, WriteTimeout):
            self.node.late.add(exc.sock, exc.unsent)
            pool.free_slot()  # the client object is dropped; its socket lives on in ``late``
        else:
            pool.discard(client)

    def ended_by(self, exc: BaseException, retry: bool) -> bool:
        """An exchange on this lease raised ``exc``: end the lease and raise what the
        caller sees — unless it was a stale pooled connection worth one retry on a new
        one: then False (no further retry). The one failure policy of ``Node.call`` and
        ``Node.acall``."""
        if isinstance(exc, wire.ErrorReply):
            self.release()  # refused, but the connection is in step
            raise self.node.refused(exc) from exc
        if not isinstance(exc, NODE_FAILURES):
            self.drop(exc)  # interrupted or cancelled: the connection cannot be trusted
            raise exc
        error = self.fail(exc, retry)
        if error is not None:
            raise error from exc
        return False

    def fail(self, exc: BaseException, retry: bool) -> NodeError | None:
        """Drop the connection after a node failure; the error to report, or None when
        it was a pooled connection gone stale and one retry on a new one is due."""
        self.drop(exc)
        if retry and self.reused and isinstance(exc, STALE_CONNECTION):
            self.pool.close_idle()  # its neighbours in the pool are just as stale
            return None
        return self.node.failure(exc)



class Call:
    """The step of one op on one node: ``Node.call`` blocking, ``Node.acall`` on the loop."""

    __slots__ = ("node", "op", "retry", "sent", "saved")

    def __init__(self, node: Node, op: wire.Op, retry: bool = True, sent: int = 0,
                 saved: int = 0) -> None:
        self.node, self.op, self.retry, self.sent, self.saved = node, op, retry, sent, saved

    def run(self) -> Any:
        return self.node.call(self.op, self.retry, self.sent, self.saved)

    def arun(self) -> Any:
        return self.node.acall(self.op, self.retry, self.sent, self.saved)


class Get:
    """The step of a single-key ``get``: ``(data, flags)`` or None. On the event loop,
    with AUTOBATCH, it may join the loop iteration's other gets for the node
    (``autobatch``)."""

    __slots__ = ("node", "key")

    def __init__(self, node: Node, key: bytes) -> None:
        self.node, self.key = node, key

    def run(self) -> Any:
        return self.node.call(wire.get_one(self.key))

    def arun(self) -> Any:
        node = self.node
        batch = aio.batch_for(node)
        if batch is None:
            return node.acall(wire.get_one(self.key))
        node.ops += 1
        return batch.get_one(self.key)


class Repair:
    """The step that settles and cleans up before a node serves again."""

    __slots__ = ("node", "client")

    def __init__(self, node: Node, client: Any) -> None:
        self.node, self.client = node, client

    def run(self) -> None:
        self.node.repair(self.client)

    def arun(self) -> Any:
        return self.node.arepair(self.client)


class Settle:
    """The step that finishes one timed-out write (see ``Node.repair_plan``)."""

    __slots__ = ("sock", "unsent", "timeout")

    def __init__(self, sock: Any, unsent: bytes, timeout: float | None) -> None:
        self.sock, self.unsent, self.timeout = sock, unsent, timeout

    def run(self) -> None:
        settle(self.sock, self.unsent)

    def arun(self) -> Any:
        return asettle(self.sock, self.unsent, self.timeout)
