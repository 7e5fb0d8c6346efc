"""An attempt: one batch on one connection, its named states, and the steps it yields.

From checkout until its connection goes back, is closed or is kept to be settled, a
batch's :class:`Attempt` knows where it stands (:class:`State`, as h11 names a
connection's states) — which is what an interruption does to the connection. The
exchange (:mod:`django_kvcache.memcached.exchange`) decides every transition; the steps
below are the byte moving it asks the driver for, each with a blocking form (``run``)
and an asyncio one (``arun``: an awaitable), on the connection the attempt holds —
:mod:`connection`'s for the blocking driver, :mod:`aio`'s for the asyncio one.
"""
from __future__ import annotations

import enum
import ssl
from typing import TYPE_CHECKING, Any, Awaitable

from django_kvcache.memcached import aio, connection, wire

if TYPE_CHECKING:
    from django_kvcache.memcached.stale import UnsettledSockets

#: How a connection the server closed shows itself.
CLOSED = (ConnectionError, EOFError, ssl.SSLEOFError, ssl.SSLZeroReturnError)


class State(enum.Enum):
    """Where an :class:`Attempt` stands, as h11 names a connection's states: each says
    what may be done next and what an interruption does to the connection."""

    #: Holds a connection with nothing of its own unanswered on it: in step. Interrupted:
    #: the connection goes back to its pool.
    IDLE = "idle"
    #: A request (perhaps partly) sent, its reply not all read. Interrupted: a write's
    #: socket is kept to be settled, a read's connection closed.
    IN_FLIGHT = "in flight"
    #: The connection went back to its pool, was closed, or was kept to be settled.
    DONE = "done"


class Attempt:
    """A batch on one connection of ``pool``: from checkout until the connection goes
    back, is closed or is kept to be settled. ``op`` is what is (or was last) in flight,
    ``reply`` its parser; ``mark``: the connection's received bytes when it left (none
    since: the connection went stale); ``reused``: a pooled connection, which may have."""

    __slots__ = ("pool", "connection", "reused", "state", "op", "reply", "mark")

    def __init__(self, pool: Any, client: Any) -> None:
        self.pool = pool
        self.connection = client
        self.reused = client.sock is not None
        self.state = State.IDLE
        self.op: wire.Op | None = None
        self.reply: Any = None
        self.mark = 0

    def start(self, op: wire.Op) -> Any:
        """IDLE → IN_FLIGHT: ``op``'s request is about to leave; its reply's parser."""
        self.state = State.IN_FLIGHT
        self.op = op
        self.mark = self.connection.received
        self.reply = reply = op.make_reply()
        return reply

    def finished(self) -> None:
        """IN_FLIGHT → IDLE: the reply is complete (or the server refused the request)."""
        self.state = State.IDLE

    def found_stale(self, exc: BaseException) -> bool:
        """The server closed this pooled connection before it answered anything."""
        return (self.reused and isinstance(exc, CLOSED)
                and self.connection.received == self.mark)

    def refused_by_closing(self, exc: BaseException) -> bool:
        """A new connection the server closed on an optional command before answering
        anything (``wire.Op.optional``): how twemproxy refuses what it does not forward.
        A connection refused never opened: that is the node's failure (nothing listens)."""
        return (self.state is State.IN_FLIGHT and self.op is not None and self.op.optional
                and not self.reused and isinstance(exc, CLOSED)
                and not isinstance(exc, ConnectionRefusedError)
                and self.connection.received == self.mark)

    def give_back(self) -> None:
        """IDLE (or IN_FLIGHT with its reply complete) → DONE: the connection goes back
        to its pool — unless the last reply put it out of step (an error reply to a
        command that carried a data block)."""
        self.state = State.DONE
        if self.reply is None or self.reply.in_step:
            self.pool.checkin(self.connection)
        else:
            self.pool.discard(self.connection)

    def close(self) -> None:
        """→ DONE: the connection is closed (a failure, or a read cut short)."""
        self.state = State.DONE
        self.pool.discard(self.connection)

    def keep_to_settle(self, unsettled: UnsettledSockets) -> None:
        """IN_FLIGHT → DONE: a write that may still land. Its socket goes to the node's
        unsettled sockets, settled before the node serves again (a TLS connection on
        the loop cannot be handed over: it is closed)."""
        self.state = State.DONE
        sock = self.connection.detach()
        if sock is None:
            self.pool.discard(self.connection)
            return
        unsettled.add(sock)
        self.pool.free_slot()  # the connection object is gone; its socket lives on

    def interrupted(self, unsettled: UnsettledSockets) -> None:
        """Cancelled or failed: what the state says (:class:`State`)."""
        if self.state is State.IDLE:
            self.give_back()
        elif self.op is not None and self.op.writes:
            self.keep_to_settle(unsettled)
        else:
            self.close()


# --- the steps the exchange yields: each has a blocking and an asyncio form -------------------


class Checkout:
    """Wait for a connection of ``pool`` (``PoolExhausted`` after POOL_TIMEOUT)."""

    __slots__ = ("pool",)

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def run(self) -> connection.Connection:
        return self.pool.checkout()

    def arun(self) -> Awaitable[aio.AsyncConnection]:
        return self.pool.checkout()


class Transfer:
    """Send the attempt's request and read its whole reply, by ``deadline``."""

    __slots__ = ("attempt", "deadline")

    def __init__(self, attempt: Attempt, deadline: float | None) -> None:
        self.attempt, self.deadline = attempt, deadline

    def run(self) -> None:
        attempt = self.attempt
        attempt.connection.transfer(attempt.op.request, attempt.reply, self.deadline)

    def arun(self) -> Awaitable[None]:
        attempt = self.attempt
        return attempt.connection.transfer(attempt.op.request, attempt.reply, self.deadline)


class Send:
    """Send the attempt's request, by ``deadline`` (its reply is read later)."""

    __slots__ = ("attempt", "deadline")

    def __init__(self, attempt: Attempt, deadline: float | None) -> None:
        self.attempt, self.deadline = attempt, deadline

    def run(self) -> None:
        self.attempt.connection.send(self.attempt.op.request, self.deadline)

    def arun(self) -> Awaitable[None]:
        return self.attempt.connection.send(self.attempt.op.request, self.deadline)


class Receive:
    """Read the attempt's whole reply, by ``deadline``."""

    __slots__ = ("attempt", "deadline")

    def __init__(self, attempt: Attempt, deadline: float | None) -> None:
        self.attempt, self.deadline = attempt, deadline

    def run(self) -> None:
        self.attempt.connection.receive(self.attempt.reply, self.deadline)

    def arun(self) -> Awaitable[None]:
        return self.attempt.connection.receive(self.attempt.reply, self.deadline)


class Ready:
    """Wait until a socket being settled is ready for ``events``, by ``deadline``."""

    __slots__ = ("sock", "events", "deadline")

    def __init__(self, sock: Any, events: int, deadline: float | None) -> None:
        self.sock, self.events, self.deadline = sock, events, deadline

    def run(self) -> None:
        connection.poll(self.sock, self.deadline, self.events)

    def arun(self) -> Awaitable[None]:
        return aio.wait_ready(self.sock, self.events, self.deadline)


class TakeTurn:
    """Hold the node's repair turn, waiting for it by ``deadline`` (``NodeBusy``)."""

    __slots__ = ("turn", "deadline")

    def __init__(self, turn: Any, deadline: float | None) -> None:
        self.turn, self.deadline = turn, deadline

    def run(self) -> None:
        self.turn.take(self.deadline)

    def arun(self) -> Awaitable[None]:
        return self.turn.atake(self.deadline)


class Share:
    """Await a joint get's share (AUTOBATCH: the event loop only): its future, or the
    awaitable ``exchange.joined_get`` gives."""

    __slots__ = ("future",)

    def __init__(self, future: Awaitable[Any]) -> None:
        self.future = future

    def run(self) -> Any:
        raise RuntimeError("a joint get's share is awaited on the event loop only")

    def arun(self) -> Awaitable[Any]:
        return self.future
