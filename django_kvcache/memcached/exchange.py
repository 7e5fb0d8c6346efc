"""The exchange: every request to memcached, on either driver, through one state machine.

A single-key call is one :class:`Batch` (a node and a :mod:`wire` op); a multi-key call
is a batch per node. :func:`request` and :func:`fan_out` take them from checkout to their
end, as a plan (:mod:`django_kvcache.steps`) that yields the byte moving it needs — a
checkout that waits, a transfer, a send, a receive, a wait for a socket while settling —
as steps, to whichever driver runs the plan: the blocking one (``steps.run``:
:mod:`connection` sockets) or the asyncio one (``steps.arun``: :mod:`aio` connections).
The drivers only move bytes; everything else is decided here, once:

* **What is sent.** Before a node's first request, what it may still owe is settled
  (:func:`_repair`, one caller at a time): every write cut short on it earlier (timed
  out or cancelled) gets the rest of its request and a fence, whose reply is read; then
  the copies it missed are deleted (``stale``). Only then its request; a multi-key call
  writes every node's request before it reads any reply.
* **Which deadline applies.** IO_TIMEOUT, counted from the moment the requests start
  going out until every reply is complete: one deadline for a whole round of a fan-out,
  not one per read. Each settle has its own; waiting for another caller's repair too.
* **What goes out together.** On the event loop, with AUTOBATCH, a get for a node the
  loop is already busy with joins that node's pending gets (``autobatch``) instead of
  going out alone; its share of their reply is its result.
* **What an outcome does to the connection and the node** (:func:`_ended`, and the
  :class:`Attempt`'s states):

  - a reply: the connection goes back to the pool — unless the reply says it is out of
    step (an error reply to a command that carried a data block), then it is closed;
    the node answered;
  - an error reply: the same, and the batch's error is
    :class:`~django_kvcache.memcached.Refused` (``CLIENT_ERROR``, or a value refused:
    too large, out of memory) or :class:`~django_kvcache.memcached.ServerError` (any
    other ``SERVER_ERROR``: a proxy whose server for the key is down) — that request's
    failure, not the node's;
  - a pooled connection the server closed before it answered anything (it restarted):
    stale, not a node failure. It and the pool's other idle connections are closed and
    the request goes once more on a new connection — for every command (the request
    either never reached the old server process or died with it);
  - a failure (refused, reset, timeout, a reply we cannot read): the node's failure,
    counted by its health; the connection is closed — except a write whose request may
    have left and whose reply did not come: its socket is kept to be settled;
  - a new connection the server closed, before any reply, on an optional command
    (``wire.Op.optional``: how twemproxy refuses what it does not forward): the
    batch's error is :class:`~django_kvcache.memcached.Unsupported`, not counted; a
    clean-up flush refused so is given up, and the batch goes once more;
  - a node another caller is repairing, which this call cannot wait for
    (:class:`~django_kvcache.memcached.NodeBusy`): the batch's error, not counted; the
    connection, never used, goes back;
  - a cancellation (``CancelledError``, a ``KeyboardInterrupt``, anything else raised
    through the exchange): handled as a timeout is — a write in flight is kept to be
    settled, a read is closed, an unused connection goes back — but the node is not
    blamed, and the exception goes on.
"""
from __future__ import annotations

import asyncio
from time import monotonic
from typing import Any, Awaitable, Callable, Protocol, Sequence

from django_kvcache.memcached import (
    MemcachedError,
    NodeBusy,
    NodeError,
    Refused,
    ServerError,
    Unsupported,
    aio,
    autobatch,
    wire,
)
from django_kvcache.memcached.attempt import (
    Attempt,
    Checkout,
    Ready,
    Receive,
    Send,
    Share,
    State,
    TakeTurn,
    Transfer,
)
from django_kvcache.memcached.connection import TIMEOUTS, UnsettledSocket, deadline_after
from django_kvcache.steps import Plan, arun, run

#: Errors that mean the node (or the path to it) failed, not the request. (On Python
#: 3.10 ``asyncio.TimeoutError``, raised by ``asyncio.wait_for``, is not an OSError.)
NODE_FAILURES = (OSError, EOFError, wire.ProtocolError, asyncio.TimeoutError)
#: Timeouts, Python's or the kernel's, blocking or on the loop.
TIMEOUT_ERRORS = TIMEOUTS + (asyncio.TimeoutError,)


class Node(Protocol):
    """What the exchange needs of a node (``memcached.node.Node``)."""

    name: str
    pool: Any
    unsettled: Any  # stale.UnsettledSockets
    outdated: Any  # stale.OutdatedCopies
    repair_turn: Any  # stale.RepairTurn
    health: Any
    behind_since: float
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
    ``keys``: the keys the op is about; ``side_keys``: keys it writes besides (stale
    copies), missed with them if the batch fails.
    ``gets``: a get's keys, which may go out with other gets (AUTOBATCH); ``one``: it is a
    single-key get, whose result is ``(data, flags)`` or None, not a dict. ``attempt``:
    the connection it holds meanwhile (:class:`Attempt`), if any.
    """

    # Optional fields as class attributes: a single-key call (the hot path) builds its
    # batch from two or four arguments (a keyword-rich constructor costs twice as much).
    keys: Sequence[str] = ()
    side_keys: Sequence[str] = ()
    ops = 1
    sent = 0
    saved = 0
    count_received = False
    on_result: Callable[[Any], None] | None = None
    gets: list[bytes] | None = None
    one = False
    result: Any = None
    error: MemcachedError | None = None
    attempt: Attempt | None = None

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

    def claim(self, io: Transport) -> bool:
        """Take a connection of the node's pool if one is free now (no waiting)."""
        pool = io.pool(self.node)
        client = pool.try_checkout()
        if client is None:
            return False
        self.attempt = Attempt(pool, client)
        return True

    def interrupted(self) -> None:
        """Cancelled (or interrupted by anything else) while it holds a connection."""
        attempt = self.attempt
        if attempt is not None and attempt.state is not State.DONE:
            attempt.interrupted(self.node.unsettled)


# --- the machine ------------------------------------------------------------------------


def fan_out(batches: Sequence[Batch], io: Transport) -> Plan:
    """Every batch's request on a connection of its node's pool, then every reply; fills
    each batch's ``result`` or ``error`` (``yield from fan_out(batches, io)``). Gets that
    joined others' (AUTOBATCH, on the loop) take their share once the batches that went
    on their own are done."""
    return _plan(batches, io, False)


def get_one(node: Node, key: bytes, io: Transport,
            on_result: Callable[[Any], Any]) -> Plan:
    """A single-key get, as a plan whose value is ``(data, flags)`` or None, passed to
    ``on_result`` first (the node's hit and miss counts). On the loop, with AUTOBATCH and
    company, it joins the node's pending gets (:func:`joined_get`); otherwise it is
    :func:`request`'s one batch."""
    if io.joins:
        share = joined_get(node, key, on_result)
        if share is not None:
            return _awaited(share)
    batch = Batch(node, wire.get_one(key))
    batch.gets, batch.one, batch.on_result = [key], True, on_result
    node.ops += 1
    return _rounds((batch,), io, batch)  # alone: no company to join (asked above)


def joined_get(node: Node, key: bytes,
               on_result: Callable[[Any], Any]) -> Awaitable[Any] | None:
    """On the event loop: a single-key get that joins the node's pending gets (AUTOBATCH,
    while they have company: ``autobatch.batch_for``), as an awaitable of its share of
    their reply — ``(data, flags)`` or None, passed to ``on_result`` first — or the
    node's error, raised. None: the get goes alone (:func:`get_one`). ``aget``'s usual
    case awaits it directly: no batch, wire op, plan or driver in between."""
    gets = autobatch.batch_for(node)
    if gets is None:
        return None
    node.ops += 1
    return _share_of(gets.get(key), on_result)


async def _share_of(share: asyncio.Future, on_result: Callable[[Any], Any]) -> Any:
    """A single-key get's share of the node's joint get (:func:`joined_get`).
    Cancelled, the share nobody will read is dropped."""
    try:
        found = await share
    except MemcachedError:
        raise
    except BaseException:
        share.cancel()
        raise
    on_result(found)
    return found


def _awaited(awaitable: Awaitable[Any]) -> Plan:
    """A plan of one step: what ``awaitable`` gives (the asyncio driver only)."""
    return (yield Share(awaitable))


def request(batch: Batch, io: Transport) -> Plan:
    """One batch, as a plan whose value is its result (or which raises its error):
    ``value = yield from request(batch, io)``."""
    if batch.gets is not None and io.joins:
        return _plan((batch,), io, True)
    batch.node.ops += batch.ops  # once per call, whatever is retried
    return _rounds((batch,), io, batch)  # nothing to join


def _plan(batches: Sequence[Batch], io: Transport, one: bool) -> Plan:
    """The exchange's plan (a plain function: the plan is the generator it returns, one
    generator per call on the hot path). ``one``: the plan's value is the lone batch's."""
    for batch in batches:
        batch.node.ops += batch.ops  # once per call, whatever is retried
    if io.joins:
        joined = io.join(batches)
        if joined:
            return _joined(batches, joined, io, one)
    return _rounds(batches, io, batches[0] if one else None)


def _joined(
    batches: Sequence[Batch], joined: dict[Batch, Any], io: Transport, one: bool
) -> Plan:
    """The batches that go on their own, then the shares of those that joined others'."""
    try:
        alone = [batch for batch in batches if batch not in joined]
        if alone:
            yield from _rounds(alone, io, None)
        for batch, share in joined.items():
            try:
                batch.shared((yield Share(share)))
            except MemcachedError as exc:
                batch.error = exc
    except BaseException:  # cancelled: the shares nobody will read are dropped
        for share in joined.values():
            share.cancel()
        raise
    return batches[0].outcome() if one else None


def claimed_alone(node: Node, op: wire.Op, sent: int = 0, saved: int = 0,
                  io: Transport | None = None) -> Batch | None:
    """The usual request — ``op`` for a node that owes nothing (no write cut short to
    settle, no copies to clean up) — as a batch holding a connection that is free now,
    of the loop's pool (for :func:`sent_alone`) or with ``io`` BLOCKING of the node's
    (for :func:`done_alone`); None when the request is :func:`request`'s (a plan's) to
    make."""
    if _owes(node):
        return None
    batch = Batch(node, op, sent, saved)
    return batch if batch.claim(io or ASYNCIO) else None


def claimed_get(node: Node, key: bytes, io: Transport) -> Batch | None:
    """:func:`claimed_alone` for a single-key get: its result ``(data, flags)`` or None,
    counted as a hit or a miss, as :func:`get_one`'s."""
    batch = claimed_alone(node, wire.get_one(key), io=io)
    if batch is not None:
        batch.gets, batch.one = [key], True
        batch.on_result = node.count_get  # type: ignore[attr-defined]
    return batch


async def sent_alone(batch: Batch) -> Any:
    """A batch of :func:`claimed_alone` sent and its reply awaited as one coroutine: no
    plan or driver in between. What the reply, an error, IO_TIMEOUT or a cancellation
    does is decided as in the plan's usual call (:func:`_rounds`), by the same functions
    (:func:`_deadline`, :func:`_finished`, :func:`_ended`, ``Batch.interrupted``); a
    pooled connection found stale goes once more on a new one in the plan."""
    stale: list[Batch] = []
    try:
        attempt, reply, deadline = _alone_started(batch)
        await attempt.connection.transfer(batch.op.request, reply, deadline)
        _finished(batch)
    except BaseException as exc:
        _alone_failed(batch, exc, stale)
    if stale:  # the second try is the plan's
        return await arun(_rounds(stale, ASYNCIO, batch, retry=False))
    return batch.outcome()


def done_alone(batch: Batch) -> Any:
    """:func:`sent_alone` on blocking sockets, for a batch claimed with BLOCKING: sent
    and its reply read in this thread, no plan or driver in between; decided by the same
    functions, a stale pooled connection's second try the plan's."""
    stale: list[Batch] = []
    try:
        attempt, reply, deadline = _alone_started(batch)
        attempt.connection.transfer(batch.op.request, reply, deadline)
        _finished(batch)
    except BaseException as exc:
        _alone_failed(batch, exc, stale)
    if stale:  # the second try is the plan's
        return run(_rounds(stale, BLOCKING, batch, retry=False))
    return batch.outcome()


def _alone_started(batch: Batch) -> tuple[Attempt, Any, float | None]:
    """A lone batch's request about to leave: its attempt, reply parser and deadline."""
    batch.node.ops += batch.ops
    attempt = batch.attempt
    assert attempt is not None
    return attempt, attempt.start(batch.op), _deadline(attempt)


def _alone_failed(batch: Batch, exc: BaseException, stale: list[Batch]) -> None:
    """What ``exc`` from a lone batch's exchange does (as in :func:`_single`); raised
    again unless the exchange decided it (the batch's error, or stale: once more)."""
    if isinstance(exc, Exception) and _ended(batch, exc, True, stale):
        return
    batch.interrupted()  # a cancellation, or an error that is not the exchange's
    raise exc


def _rounds(
    batches: Sequence[Batch], io: Transport, lone: Batch | None, retry: bool = True
) -> Plan:
    """The batches in rounds: each round serves every batch once, as connections come
    (:func:`_claim`, :func:`_serve`); the batches whose pooled connection had gone stale
    go once more, on new connections (``retry``: whether a first round's may). ``lone``:
    the batch whose result is the plan's."""
    while batches:
        stale: list[Batch] = []
        pending: Sequence[Batch] = batches
        while pending:
            if len(pending) == 1 and pending[0].claim(io):
                batch, pending = pending[0], ()
                node = batch.node
                if not _owes(node):
                    # The usual call: one request on a node that owes nothing, one step.
                    try:
                        yield from _single(batch, retry, stale)
                    except BaseException:
                        batch.interrupted()
                        raise
                    continue
                claimed: list[Batch] = [batch]
            else:
                claimed, pending = yield from _claim(pending, io)
            if claimed:
                yield from _serve(claimed, retry, stale, io)
        batches, retry = stale, False
    return lone.outcome() if lone is not None else None


def _claim(pending: Sequence[Batch], io: Transport) -> Plan:
    """``(claimed, still pending)``: the batches whose pool has a connection free now
    take one; when none has, the first waits for its pool. A call never waits for one
    node's connection while holding another's: two callers could each hold what the
    other waits for."""
    claimed: list[Batch] = []
    waiting: list[Batch] = []
    for batch in pending:
        (claimed if batch.claim(io) else waiting).append(batch)
    if claimed:
        return claimed, waiting
    first, rest = waiting[0], waiting[1:]
    pool = io.pool(first.node)
    try:
        client = yield Checkout(pool)
    except MemcachedError as exc:  # PoolExhausted
        first.error = exc
        return [], rest
    first.attempt = Attempt(pool, client)
    return [first], rest


def _serve(claimed: list[Batch], retry: bool, stale: list[Batch], io: Transport) -> Plan:
    """Every claimed batch's node made ready (:func:`_ready`), then every request sent
    and every reply read, by one deadline (a lone request in one step). Whatever is
    raised through it leaves no connection checked out."""
    try:
        ready = claimed
        for batch in claimed:
            node = batch.node
            if _owes(node):
                ready = yield from _ready(claimed, retry, stale, io)
                break
        if len(ready) == 1:
            yield from _single(ready[0], retry, stale)
        elif ready:
            yield from _pipeline(ready, retry, stale)
    except BaseException:
        for batch in claimed:
            batch.interrupted()
        raise


def _single(batch: Batch, retry: bool, stale: list[Batch]) -> Plan:
    """One request and its reply, in one step."""
    attempt = batch.attempt
    assert attempt is not None
    try:
        attempt.start(batch.op)
        yield Transfer(attempt, _deadline(attempt))
        _finished(batch)
    except Exception as exc:
        if not _ended(batch, exc, retry, stale):
            raise


def _pipeline(batches: list[Batch], retry: bool, stale: list[Batch]) -> Plan:
    """Every request sent, then every reply read, all by one deadline: IO_TIMEOUT from
    when the first request starts to leave."""
    deadline = _deadline(batches[0].attempt)  # type: ignore[arg-type]
    sent = []
    for batch in batches:
        attempt = batch.attempt
        assert attempt is not None
        try:
            attempt.start(batch.op)
            yield Send(attempt, deadline)
        except Exception as exc:
            if not _ended(batch, exc, retry, stale):
                raise
            continue
        sent.append(batch)
    for batch in sent:
        try:
            yield Receive(batch.attempt, deadline)  # type: ignore[arg-type]
            _finished(batch)
        except Exception as exc:
            if not _ended(batch, exc, retry, stale):
                raise


def _finished(batch: Batch) -> None:
    """The reply is complete: the batch's result, the node's counters, the connection."""
    node, attempt = batch.node, batch.attempt
    assert attempt is not None
    batch.result = batch.op.result(attempt.reply)
    node.bytes_sent += batch.sent
    node.bytes_saved += batch.saved
    if batch.count_received:
        node.bytes_received += attempt.connection.received - attempt.mark
    attempt.give_back()
    if node.health.failures:  # the node answered: a failure count it had is over
        node.health.succeeded()
    if batch.on_result is not None:
        batch.on_result(batch.result)


def _ended(batch: Batch, exc: Exception, retry: bool, stale: list[Batch]) -> bool:
    """What ``exc``, raised by the batch's exchange, does to its connection, its node and
    the batch (module docstring). False: not for the exchange to decide (re-raise)."""
    node, attempt = batch.node, batch.attempt
    assert attempt is not None
    if isinstance(exc, wire.ErrorReply):
        attempt.finished()
        attempt.give_back()
        _answered(node)
        if exc.client_error or exc.refuses_value:
            batch.error = Refused(node.name, str(exc), client_error=exc.client_error)
        else:  # the server could not serve this request (a proxy's server is down)
            batch.error = ServerError(node.name, f"SERVER_ERROR {exc}")
        batch.error.__cause__ = exc
        return True
    if isinstance(exc, NodeBusy):
        attempt.give_back()  # nothing of this batch's was sent on it
        batch.error = exc
        return True
    if not isinstance(exc, NODE_FAILURES):
        return False
    if retry and attempt.found_stale(exc):
        node.behind_since = monotonic()  # restarted: empty, whatever its replicas hold
        attempt.close()
        attempt.pool.close_idle()  # its neighbours in the pool are just as stale
        stale.append(batch)
        return True
    if attempt.refused_by_closing(exc):
        return _refused_by_closing(batch, exc, retry, stale)
    if attempt.state is State.IN_FLIGHT and attempt.op.writes and isinstance(  # type: ignore
        exc, TIMEOUT_ERRORS
    ):
        attempt.keep_to_settle(node.unsettled)
    elif attempt.state is State.IDLE:
        attempt.give_back()  # failed before its request (settling another write): in step
    else:
        attempt.close()
    batch.error = node.failure(exc)
    return True


def _refused_by_closing(
    batch: Batch, exc: Exception, retry: bool, stale: list[Batch]
) -> bool:
    """A new connection closed by the server on an optional command, before any answer:
    the command's refusal (twemproxy on what it does not forward), not the node's
    failure. The batch's own command: its error is ``Unsupported``, not counted (the
    caller may ask the node whether it still answers). The node's clean-up (a flush it
    cannot forward): the flush is given up and the batch's request goes once more, on a
    new connection — a pending flush never fails every later request."""
    node, attempt = batch.node, batch.attempt
    assert attempt is not None and attempt.op is not None
    attempt.close()
    if attempt.op is not batch.op:
        node.outdated.flush_refused()
        if retry:
            stale.append(batch)
            return True
    batch.error = Unsupported(
        node.name, f"it closed the connection on {attempt.op.command} instead of answering: "
        "it does not support it (a proxy such as twemproxy forwards neither the meta "
        "commands nor flush_all, stats or lru_crawler)"
    )
    batch.error.__cause__ = exc
    return True


def _owes(node: Node) -> bool:
    """Whether the node owes a repair before its next request: a write cut short to
    settle, or copies it missed to clean up (:func:`_ready`)."""
    return node.unsettled.pending or node.outdated.pending


def _answered(node: Node) -> None:
    """The node answered: a failure count it had is over."""
    if node.health.failures:
        node.health.succeeded()


def _deadline(attempt: Attempt) -> float | None:
    """IO_TIMEOUT from now, as a ``time.monotonic`` time (None: no limit)."""
    seconds = attempt.pool.settings.io_timeout
    return None if seconds is None else monotonic() + seconds


# --- before a node serves again -----------------------------------------------------------


def _ready(claimed: list[Batch], retry: bool, stale: list[Batch], io: Transport) -> Plan:
    """The batches whose node is ready for their request, each repaired (:func:`_repair`)
    first if it needs it; a batch whose repair failed has ended."""
    ready = []
    for batch in claimed:
        node = batch.node
        if node.unsettled.pending or node.outdated.due():
            try:
                yield from _repair(batch)
            except Exception as exc:
                if not _ended(batch, exc, retry, stale):
                    raise
                continue
        ready.append(batch)
    return ready


def _repair(batch: Batch) -> Plan:
    """Settle the node's writes cut short, then delete its outdated copies (on the
    batch's connection), holding the node's repair turn (``stale.RepairTurn``), waited
    for at most IO_TIMEOUT. A caller that queued behind a settle that timed out fails at
    once (each waiting its own IO_TIMEOUT would make the k-th caller wait k timeouts on a
    node that still sleeps)."""
    node = batch.node
    unsettled = node.unsettled
    timeouts = unsettled.timeouts
    io_timeout = batch.attempt.pool.settings.io_timeout  # type: ignore[union-attr]
    yield TakeTurn(node.repair_turn, deadline_after(io_timeout))
    try:
        if unsettled.pending and unsettled.timeouts != timeouts:
            raise TimeoutError("a write cut short is still not settled (it timed out just now)")
        if unsettled.pending:
            yield from _settle_all(node, io_timeout)
        if node.outdated.due():
            yield from _clean_up(batch)
    finally:
        node.repair_turn.give_back()


def _settle_all(node: Node, io_timeout: float | None) -> Plan:
    """Finish every write cut short on the node (:func:`_settle`), each within an
    IO_TIMEOUT of its own. A timeout means the node still does not serve: the request
    fails and the settling waits. A connection the server closed can apply nothing more:
    settled."""
    pending = node.unsettled.take()
    try:
        while pending:
            unsettled = pending[-1]
            try:
                yield from _settle(unsettled, deadline_after(io_timeout))
            except TIMEOUT_ERRORS as exc:
                node.unsettled.timeouts += 1
                raise TimeoutError("a write cut short is still not settled") from exc
            except NODE_FAILURES:
                pass
            pending.pop()
            unsettled.close()
    finally:
        if pending:
            node.unsettled.put_back(pending)
        else:
            node.unsettled.done()


def _settle(unsettled: UnsettledSocket, deadline: float | None) -> Plan:
    """The rest of a write cut short and a fence, then up to the fence's reply: after
    that the server has applied (or refused) everything sent on the socket. The socket
    moves what it can without waiting (``UnsettledSocket.advance``); the driver waits
    for it in between (:class:`Ready`)."""
    with unsettled.nonblocking():
        while events := unsettled.advance():
            yield Ready(unsettled.sock, events, deadline)


def _clean_up(batch: Batch) -> Plan:
    """Delete the copies the node missed writes to (or flush it), on the batch's
    connection; put back if that does not complete. Keys the server could not delete
    (``SERVER_ERROR``: behind a proxy, their server is down) stay outdated, their clean-up
    retried after the node's RETRY_TIMEOUT (``stale.OutdatedCopies``)."""
    node, attempt = batch.node, batch.attempt
    assert attempt is not None
    keys, flush = node.outdated.take()
    listed = [] if flush else list(keys)
    refused: list[str] = []
    try:
        if listed or flush:
            op = node.outdated.op(listed, flush)
            attempt.start(op)
            yield Transfer(attempt, _deadline(attempt))
            attempt.finished()
            refused = [key for key, line in zip(listed, op.result(attempt.reply))
                       if line.startswith(wire.ERROR_REPLIES)]
    except BaseException:
        node.outdated.put_back(keys, flush)
        raise
    node.outdated.done_except(refused, node.health.retry_timeout)


# --- the two drivers' sides ---------------------------------------------------------------


class Transport(Protocol):
    """What differs between the drivers, besides the connections themselves."""

    def pool(self, node: Any) -> Any:
        """The pool this driver's connections to ``node`` come from."""

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


class Asyncio:
    """The asyncio driver: the running loop's pool for the node; nothing blocks."""

    joins = True
    pool = staticmethod(aio.pool_of)

    @staticmethod
    def join(batches: Sequence[Batch]) -> dict[Batch, Any]:
        joined = {}
        for batch in batches:
            if batch.gets is not None:
                gets = autobatch.batch_for(batch.node)
                if gets is not None:
                    joined[batch] = gets.get(batch.gets)
        return joined


BLOCKING = Blocking()
ASYNCIO = Asyncio()
