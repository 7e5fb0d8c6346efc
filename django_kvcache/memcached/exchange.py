"""The exchange: every request to memcached, on either driver, through one state machine.

A single-key call is one :class:`Batch` (a node and a :mod:`wire` op); a multi-key call
is a batch per node. :func:`exchange` takes them from checkout to their end, as a plan
(:mod:`django_kvcache.steps`) that yields the byte moving it needs — a checkout that
waits, a transfer, a send, a receive, a settle — to whichever driver runs it: the
blocking one (``steps.run``: :mod:`connection` sockets) or the asyncio one
(``steps.arun``: :mod:`aio` connections). The drivers only move bytes; everything else
is decided here, once:

* **What is sent.** Before a node's first request, what it may still owe is settled:
  every write cut short on it earlier (timed out or cancelled) gets the rest of its
  request and a fence, whose reply is read; then the copies it missed are deleted
  (``stale``). Only then its request; a multi-key call writes every node's request
  before it reads any reply.
* **Which deadline applies.** IO_TIMEOUT, counted from the moment the requests start
  going out until every reply is complete: one deadline for a whole round of a fan-out,
  not one per read. Each settle has its own.
* **What goes out together.** On the event loop, with AUTOBATCH, a get for a node the
  loop is already busy with joins that node's pending gets (``autobatch``) instead of
  going out alone; its share of their reply is its result.
* **What an outcome does to the connection and the node** (:func:`_ended`,
  :meth:`Batch.interrupted`):

  - a reply: the connection goes back to the pool — unless the reply says it is out of
    step (an error reply to a command that carried a data block), then it is closed;
    the node answered;
  - an error reply (``SERVER_ERROR``/``CLIENT_ERROR``): the same, and the batch's error
    is :class:`~django_kvcache.memcached.Refused`;
  - a pooled connection the server closed before it answered anything (it restarted):
    stale, not a node failure. It and the pool's other idle connections are closed and
    the request goes once more on a new connection — for every command (the request
    either never reached the old server process or died with it);
  - a failure (refused, reset, timeout, a reply we cannot read): the node's failure,
    counted by its health; the connection is closed — except a write whose request may
    have left and whose reply did not come: its socket is kept to be settled;
  - a cancellation (``CancelledError``, a ``KeyboardInterrupt``, anything else raised
    through the exchange): handled as a timeout is — a write in flight is kept to be
    settled, a read is closed, an unused connection goes back — but the node is not
    blamed, and the exception goes on.
"""
from __future__ import annotations

import asyncio
import ssl
import threading
from time import monotonic
from typing import Any, Callable, Protocol, Sequence

from django_kvcache import steps
from django_kvcache.memcached import (
    MemcachedError,
    NodeError,
    Refused,
    aio,
    autobatch,
    connection,
    wire,
)
from django_kvcache.memcached.connection import TIMEOUTS, deadline_after

#: Errors that mean the node (or the path to it) failed, not the request. (On Python
#: 3.10 ``asyncio.TimeoutError``, raised by ``asyncio.wait_for``, is not an OSError.)
NODE_FAILURES = (OSError, EOFError, wire.ProtocolError, asyncio.TimeoutError)
#: Timeouts, Python's or the kernel's, blocking or on the loop.
TIMEOUT_ERRORS = TIMEOUTS + (asyncio.TimeoutError,)
#: How a connection the server closed shows itself.
CLOSED = (ConnectionError, EOFError, ssl.SSLEOFError, ssl.SSLZeroReturnError)


class Node(Protocol):
    """What the exchange needs of a node (``memcached.node.Node``)."""

    name: str
    pool: Any
    late: Any  # stale.LateWrites
    outdated: Any  # stale.OutdatedCopies
    health: Any
    ops: int
    bytes_sent: int
    bytes_received: int
    bytes_saved: int

    def failure(self, exc: BaseException) -> NodeError: ...


class Batch:
    """One node's share of a call: ``op`` on one of its connections. Afterwards either
    ``result`` (what ``op`` makes of the reply) or ``error`` (a ``MemcachedError``) is set.

    ``ops`` is counted once, whatever is retried; ``sent`` and ``saved`` bytes are
    credited once the node answered, and with ``count_received`` the reply's bytes too.
    ``on_result`` bumps the node's counters with the result (hits and misses).
    ``gets``: a get's keys, which may go out with other gets (AUTOBATCH); ``one``: it is a
    single-key get, whose result is ``(data, flags)`` or None, not a dict.

    While the batch holds a connection (an *attempt*: from checkout until the connection
    is checked in, closed or kept to be settled) it also records what happened on it:
    ``in_flight`` is the op whose request has (perhaps partly) left and whose reply is not
    all read — what an interruption must settle — and ``mark`` the connection's received
    bytes when that request left (nothing came since: a stale connection).
    """

    # Optional fields as class attributes: a single-key call (the hot path) builds its
    # batch from two or four arguments (a keyword-rich constructor costs twice as much).
    keys: Sequence[str] = ()
    ops = 1
    sent = 0
    saved = 0
    count_received = False
    on_result: Callable[[Any], None] | None = None
    gets: list[bytes] | None = None
    one = False
    result: Any = None
    error: MemcachedError | None = None
    connection: Any = None

    def __init__(self, node: Node, op: wire.Op, sent: int = 0, saved: int = 0) -> None:
        self.node = node
        self.op = op
        self.sent = sent
        self.saved = saved

    def __repr__(self) -> str:
        return f"<Batch {self.node.name} {self.op.request[:40]!r}>"

    def outcome(self) -> Any:
        """After the exchange: the result, or the error raised."""
        if self.error is not None:
            raise self.error
        return self.result

    def shared(self, found: dict[bytes, tuple[bytes, int]]) -> None:
        """Its share of a joint get (AUTOBATCH) arrived: the result, and the counters."""
        result = self.result = found.get(self.gets[0]) if self.one else found  # type: ignore
        if self.count_received:  # no connection of its own to count: the values' bytes
            self.node.bytes_received += sum(len(data) for data, _ in found.values())
        if self.on_result is not None:
            self.on_result(result)

    # --- an attempt: the batch on one connection ---------------------------------------

    def claim(self, transport: Transport) -> bool:
        """Take a connection of the node's pool if one is free now (no waiting)."""
        pool = transport.pool(self.node)
        client = pool.try_checkout()
        if client is None:
            return False
        self.attach(pool, client)
        return True

    def attach(self, pool: Any, connection: Any) -> None:
        self.pool = pool
        self.connection = connection
        self.reused = connection.sock is not None  # a pooled connection, maybe gone stale
        self.in_flight: wire.Op | None = None

    def start(self, op: wire.Op) -> Any:
        """``op``'s request is about to leave: a fresh parser for its reply."""
        self.in_flight = op
        self.mark = self.connection.received
        self.reply = reply = op.make_reply()
        return reply

    def found_stale(self, exc: BaseException) -> bool:
        """The server closed this pooled connection before it answered anything."""
        return (self.reused and isinstance(exc, CLOSED)
                and self.connection.received == self.mark)

    def answered(self) -> None:
        """The node answered: the connection goes back unless the reply put it out of
        step (an error reply to a command that carried a data block)."""
        client, self.connection = self.connection, None
        if self.reply.in_step:
            self.pool.checkin(client)
        else:
            self.pool.discard(client)
        if self.node.health.failures:
            self.node.health.succeeded()

    def checkin(self) -> None:
        client, self.connection = self.connection, None
        self.pool.checkin(client)

    def discard(self) -> None:
        client, self.connection = self.connection, None
        self.pool.discard(client)

    def keep_to_settle(self) -> None:
        """A write that may still land: its socket goes to the node's late writes, to be
        settled before the node serves again (a TLS connection on the loop cannot be
        handed over: it is closed)."""
        client, self.connection = self.connection, None
        late = client.detach()
        if late is None:
            self.pool.discard(client)
            return
        self.node.late.add(late)
        self.pool.free_slot()  # the connection object is gone; its socket lives on in ``late``

    def interrupted(self) -> None:
        """Cancelled (or interrupted by anything else) with this connection out: as after
        a timeout, a write in flight is kept to settle; the node is not blamed."""
        if self.in_flight is None:
            self.checkin()  # nothing on the wire: still in step
        elif self.in_flight.writes:
            self.keep_to_settle()
        else:
            self.discard()


def _ended(batch: Batch, exc: Exception, retry: bool, stale: list[Batch]) -> bool:
    """What ``exc``, raised by the batch's exchange, does to its connection, its node and
    the batch (module docstring). False: not for the exchange to decide (re-raise)."""
    node = batch.node
    if isinstance(exc, wire.ErrorReply):
        batch.answered()
        batch.error = Refused(node.name, str(exc), client_error=exc.client_error)
        batch.error.__cause__ = exc
        return True
    if not isinstance(exc, NODE_FAILURES):
        return False
    if retry and batch.found_stale(exc):
        batch.discard()
        batch.pool.close_idle()  # its neighbours in the pool are just as stale
        stale.append(batch)
        return True
    if batch.in_flight is None:
        batch.checkin()  # failed before its request (settling another write): in step
    elif batch.in_flight.writes and isinstance(exc, TIMEOUT_ERRORS):
        batch.keep_to_settle()
    else:
        batch.discard()
    batch.error = node.failure(exc)
    return True


def _finished(batch: Batch) -> None:
    """The reply is complete: the batch's result, the node's counters, the connection."""
    node = batch.node
    batch.result = batch.op.result(batch.reply)
    batch.in_flight = None
    node.bytes_sent += batch.sent
    node.bytes_saved += batch.saved
    if batch.count_received:
        node.bytes_received += batch.connection.received - batch.mark
    batch.answered()
    if batch.on_result is not None:
        batch.on_result(batch.result)


def _deadline(batch: Batch) -> float | None:
    """IO_TIMEOUT from now, as a ``time.monotonic`` time (None: no limit)."""
    seconds = batch.pool.settings.io_timeout
    return None if seconds is None else monotonic() + seconds


# --- the machine ------------------------------------------------------------------------


def exchange(batches: Sequence[Batch], transport: Transport) -> steps.Plan:
    """Every batch's request on a connection of its node's pool, then every reply; fills
    each batch's ``result`` or ``error`` (a plan: ``yield from exchange(...)``). Gets that
    joined others' (AUTOBATCH, on the loop) take their share once the batches that went
    on their own are done."""
    return _plan(batches, transport, False)


def call(batch: Batch, transport: Transport) -> steps.Plan:
    """One batch, as a plan whose value is its result (or which raises its error):
    ``value = yield from call(batch, io)``."""
    return _plan((batch,), transport, True)


def _plan(batches: Sequence[Batch], transport: Transport, one: bool) -> steps.Plan:
    """``exchange``'s plan (a plain function: the plan is the generator it returns, one
    generator per call on the hot path). ``one``: the plan's value is the lone batch's."""
    for batch in batches:
        batch.node.ops += batch.ops  # once per call, whatever is retried
    if transport.joins:
        joined = transport.join(batches)
        if joined:
            return _joined(batches, joined, transport, one)
    return _rounds(batches, transport, one)


def _joined(
    batches: Sequence[Batch], joined: dict[Batch, Any], transport: Transport, one: bool
) -> steps.Plan:
    """The batches that go on their own, then the shares of those that joined others'."""
    try:
        yield from _rounds([batch for batch in batches if batch not in joined], transport, False)
        for batch, share in joined.items():
            try:
                batch.shared((yield (_awaited, (share,))))
            except MemcachedError as exc:
                batch.error = exc
    except BaseException:  # cancelled: the shares nobody will read are dropped
        for share in joined.values():
            share.cancel()
        raise
    return batches[0].outcome() if one else None


def _rounds(batches: Sequence[Batch], transport: Transport, one: bool) -> steps.Plan:
    """The batches in rounds: those whose pool has a connection free now take one (a
    call never waits for one node's connection while holding another's: two callers
    could each hold what the other waits for), or, when none has, the first waits for
    its pool; then every node of the round is made ready (:func:`_repair`), every request
    sent and every reply read, by one deadline (a lone request in one step). Batches
    whose pooled connection had gone stale go once more, on new connections. ``one``:
    the plan's value is the lone batch's result."""
    lone = batches[0] if one else None
    retry = True
    while batches:
        stale: list[Batch] = []
        pending = batches
        while pending:
            if len(pending) == 1 and pending[0].claim(transport):
                claimed, pending = pending, ()
            else:
                claimed, pending = _claim(pending, transport)
            if not claimed:
                first = pending[0]
                pool = transport.pool(first.node)
                try:
                    client = yield (pool.checkout, ())
                except MemcachedError as exc:  # PoolExhausted
                    first.error = exc
                    pending = pending[1:]
                    continue
                first.attach(pool, client)
                claimed, pending = [first], pending[1:]
            try:
                for batch in claimed:
                    if batch.node.late.pending or batch.node.outdated.pending:
                        claimed = yield from _ready(claimed, transport, retry, stale)
                        break
                if len(claimed) == 1:
                    batch = claimed[0]
                    op = batch.op
                    try:
                        reply = batch.start(op)
                        yield (batch.connection.transfer, (op.request, reply, _deadline(batch)))
                        _finished(batch)
                    except Exception as exc:
                        if not _ended(batch, exc, retry, stale):
                            raise
                elif claimed:
                    yield from _pipeline(claimed, retry, stale)
            except BaseException:
                for batch in claimed:
                    if batch.connection is not None:
                        batch.interrupted()
                raise
        batches, retry = stale, False
    return lone.outcome() if lone is not None else None


def _awaited(share: Any) -> Any:
    """A call whose result the asyncio driver awaits: the share's future itself."""
    return share


def _claim(pending: Sequence[Batch], transport: Transport) -> tuple[list[Batch], list[Batch]]:
    """The batches that got a connection free now, and the others (no waiting)."""
    if len(pending) == 1:
        return ([pending[0]], []) if pending[0].claim(transport) else ([], list(pending))
    claimed: list[Batch] = []
    waiting: list[Batch] = []
    for batch in pending:
        (claimed if batch.claim(transport) else waiting).append(batch)
    return claimed, waiting


def _pipeline(batches: list[Batch], retry: bool, stale: list[Batch]) -> steps.Plan:
    """Every request sent, then every reply read, all by one deadline: IO_TIMEOUT from
    when the first request starts to leave."""
    deadline = _deadline(batches[0])
    sent = []
    for batch in batches:
        op = batch.op
        try:
            batch.start(op)
            yield (batch.connection.send, (op.request, deadline))
        except Exception as exc:
            if not _ended(batch, exc, retry, stale):
                raise
            continue
        sent.append(batch)
    for batch in sent:
        try:
            yield (batch.connection.receive, (batch.reply, deadline))
            _finished(batch)
        except Exception as exc:
            if not _ended(batch, exc, retry, stale):
                raise


def _ready(
    batches: list[Batch], transport: Transport, retry: bool, stale: list[Batch]
) -> steps.Plan:
    """The batches whose node is ready for their request, each repaired (``_repair``)
    first if it needs it; a batch whose repair failed has ended."""
    ready = []
    for batch in batches:
        if batch.node.late.pending or batch.node.outdated.pending:
            try:
                yield from _repair(batch, transport)
            except Exception as exc:
                if not _ended(batch, exc, retry, stale):
                    raise
                continue
        ready.append(batch)
    return ready


# --- before a node serves again -----------------------------------------------------------


def _repair(batch: Batch, transport: Transport) -> steps.Plan:
    """Settle the node's writes cut short, then delete its outdated copies (on the
    batch's connection). One caller at a time: another must not clean up while writes
    that this one took to settle can still land after its clean-up. A caller that queued
    behind a settle that timed out fails at once (each waiting its own IO_TIMEOUT would
    make the k-th caller wait k timeouts on a node that still sleeps)."""
    node = batch.node
    late = node.late
    timeouts = late.timeouts
    yield (transport.exclusive, (late.repairing,))
    try:
        if late.pending and late.timeouts != timeouts:
            raise TimeoutError("a write cut short is still not settled (it timed out just now)")
        if late.pending:
            yield from _settle(node, transport)
        if node.outdated.pending:
            yield from _clean_up(batch)
    finally:
        late.repairing.release()


def _settle(node: Node, transport: Transport) -> steps.Plan:
    """Finish every write cut short on the node: the rest of its request and a fence,
    then the fence's reply. A timeout means the node still does not serve: the request
    fails and the settling waits. A connection the server closed can apply nothing more:
    settled."""
    pending = node.late.take()
    try:
        while pending:
            late = pending[-1]
            try:
                yield (transport.settle, (late, deadline_after(node.pool.settings.io_timeout)))
            except TIMEOUT_ERRORS as exc:
                node.late.timeouts += 1
                raise TimeoutError("a write cut short is still not settled") from exc
            except NODE_FAILURES:
                pass
            pending.pop()
            late.close()
    finally:
        if pending:
            node.late.put_back(pending)


def _clean_up(batch: Batch) -> steps.Plan:
    """Delete the copies the node missed writes to (or flush it), on the batch's
    connection; put back if that does not complete."""
    node = batch.node
    keys, flush = node.outdated.take()
    try:
        if keys or flush:
            op = node.outdated.op(keys, flush)
            reply = batch.start(op)
            yield (batch.connection.transfer, (op.request, reply, _deadline(batch)))
            batch.in_flight = None
    except BaseException:
        node.outdated.put_back(keys, flush)
        raise
    node.outdated.done()


# --- the two drivers' sides ---------------------------------------------------------------


class Transport(Protocol):
    """What differs between the drivers, besides the connections themselves."""

    def pool(self, node: Any) -> Any:
        """The pool this driver's connections to ``node`` come from."""

    def settle(self, late: connection.LateWrite, deadline: float | None) -> Any:
        """``connection.settle`` (blocking) or ``aio.settle`` (awaitable)."""

    def exclusive(self, lock: threading.Lock) -> Any:
        """Take ``lock`` (a thread's lock): blocking, or polling on the loop."""

    #: Whether gets may join others (``join``).
    joins: bool

    def join(self, batches: Sequence[Batch]) -> dict[Batch, Any]:
        """The get batches that joined gets already going to their node, each with the
        future of its share of their reply (AUTOBATCH)."""


class Blocking:
    """The blocking driver: the node's process-wide pool, blocking calls."""

    joins = False

    @staticmethod
    def pool(node: Any) -> Any:
        return node.pool

    @staticmethod
    def join(batches: Sequence[Batch]) -> dict[Batch, Any]:
        return {}

    settle = staticmethod(connection.settle)

    @staticmethod
    def exclusive(lock: threading.Lock) -> None:
        lock.acquire()


class Asyncio:
    """The asyncio driver: the running loop's pool for the node; nothing blocks."""

    joins = True
    pool = staticmethod(aio.pool_of)
    settle = staticmethod(aio.settle)

    @staticmethod
    def join(batches: Sequence[Batch]) -> dict[Batch, Any]:
        joined = {}
        for batch in batches:
            if batch.gets is not None:
                gets = autobatch.batch_for(batch.node)
                if gets is not None:
                    joined[batch] = gets.get(batch.gets)
        return joined

    @staticmethod
    async def exclusive(lock: threading.Lock) -> None:
        while not lock.acquire(blocking=False):  # a thread holds it: let it finish
            await asyncio.sleep(0.001)


BLOCKING = Blocking()
ASYNCIO = Asyncio()
