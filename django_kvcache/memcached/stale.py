"""What a node may owe before it serves again, and who pays it.

A write that fails, times out or is skipped because the node is down leaves the node's
previous value in place. Once the node answers again — it may only have been
unreachable, not restarted — that value would be served as if current. So every such
key is remembered for its node (:class:`OutdatedCopies`) and deleted there before the
node serves anything else (past ``outdated.LIMIT`` keys the whole node is flushed
instead).

This covers the writes this process dropped; another process that dropped writes does
the same when it next uses the node.

A write that *timed out* or was *cancelled* may also still be applied: a paused node
reads what waits in its socket buffers when it resumes, perhaps after the clean-up or
after a later write. So its socket is kept (:class:`UnsettledSockets`) and settled first
— the rest of its request and a fence are sent, and the fence's reply read — and only
then are the outdated copies deleted and the node used again.

One caller repairs a node at a time (:class:`RepairTurn`): a thread, or a coroutine on
some thread's event loop, holding its turn across the repair's IO; the others wait for it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Iterable

from django_kvcache import forks, outdated
from django_kvcache.memcached import NodeBusy, wire
from django_kvcache.memcached.connection import UnsettledSocket

logger = logging.getLogger("django_kvcache.backends.memcached")


class OutdatedCopies(outdated.OutdatedCopies):
    """The shared record (:mod:`django_kvcache.outdated`, which flushes the node past
    its ``LIMIT`` keys) with memcached's clean-up.

    Behind a proxy, the server of some keys may be down while the node (the proxy)
    answers: their deletes get ``SERVER_ERROR``. Those keys stay outdated, and their next
    clean-up waits ``retry_after`` (the node's RETRY_TIMEOUT) instead of costing every
    request a round trip meanwhile — unless a new missed write comes first. A proxy that
    does not forward ``flush_all`` (twemproxy) cannot be flushed: a flush pending there
    is given up, said once."""

    def __init__(self, node: str = "") -> None:
        super().__init__()
        self.node = node
        self.not_before = 0.0  # monotonic time before which no clean-up is due
        self.flush_refusals = 0

    @staticmethod
    def op(keys: list[str], flush: bool) -> wire.Op:
        """The pipelined commands that clean up."""
        if flush:
            return wire.flush_all()
        return wire.delete_many(key.encode() for key in keys)

    def due(self) -> bool:
        """Whether a clean-up is pending and may run now."""
        return self.pending and (not self.not_before or time.monotonic() >= self.not_before)

    def add(self, keys: Iterable[str]) -> None:
        super().add(keys)
        self.not_before = 0.0  # a new missed write is cleaned up at once

    def done_except(self, refused: list[str], retry_after: float) -> None:
        """The clean-up landed, but the server could not delete ``refused``: they stay
        outdated, cleaned up again from ``retry_after`` seconds on."""
        if not refused:
            self.done()
            return
        with self.lock:
            if not self.flush:
                self.keys.update(refused)
            self.pending = True
        self.not_before = time.monotonic() + retry_after

    def flush_refused(self) -> None:
        """The node refused the ``flush_all`` of a clean-up: given up (a warning, once)."""
        with self.lock:
            self.flush = False
            self.pending = bool(self.keys)
        self.flush_refusals += 1
        if self.flush_refusals == 1:
            logger.warning(
                "memcached node %s closed the connection on flush_all (a proxy that does not "
                "forward it, such as twemproxy): the writes it missed before cannot be "
                "flushed away; the keys listed are still deleted", self.node,
            )


class UnsettledSockets:
    """The node's sockets whose write was cut short (timed out or cancelled), each with
    the part of its request that was never sent: settled before the node serves again.

    ``pending`` stays set from the first one kept until a repair has settled them all —
    also while a caller has taken them to settle — so that no request goes out ahead of
    a write that may still land."""

    def __init__(self) -> None:
        self.connections: list[UnsettledSocket] = []
        self.pending = False  # read without the lock on every request: keep it a plain bool
        #: Settles that timed out so far. A caller that queued behind one fails at once
        #: instead of trying again: each waiting its own IO_TIMEOUT would make the k-th
        #: caller wait k timeouts on a node that still sleeps.
        self.timeouts = 0
        self.lock = threading.Lock()  # guards the list; never held while talking
        forks.register(self)

    def add(self, unsettled: UnsettledSocket) -> None:
        with self.lock:
            self.connections.append(unsettled)
            self.pending = True

    def take(self) -> list[UnsettledSocket]:
        """Every unsettled socket, now owned by the caller: ``done`` once all are
        settled, ``put_back`` the rest otherwise."""
        with self.lock:
            taken, self.connections = self.connections, []
        return taken

    def put_back(self, connections: list[UnsettledSocket]) -> None:
        with self.lock:
            self.connections[:0] = connections
            self.pending = True

    def done(self) -> None:
        """Everything taken is settled: nothing pending unless more was kept meanwhile."""
        with self.lock:
            self.pending = bool(self.connections)

    def after_fork(self) -> None:
        # The sockets are the parent's, which settles them: forget them, keep them open.
        self.connections, self.pending, self.timeouts = [], False, 0
        self.lock = threading.Lock()


class RepairTurn:
    """Who repairs the node now. One caller at a time: another must not clean up while
    writes that this one took to settle can still land after its clean-up.

    The holder keeps its turn across the repair's IO, so nothing a thread can wait for is
    ever a lock held there: the lock here guards who holds the turn, for a few
    instructions. Waiting for a turn is bounded, in both worlds:

    * a thread waits at most until ``deadline`` — the holder may be a coroutine on a
      loop that is busy, and cannot go on — and never for a coroutine of its own
      thread: that coroutine cannot run until the thread's call returns, so the call
      would wait for itself (a sync cache call on the event loop's thread). Either way
      it gets ``NodeBusy``;
    * a coroutine waits on its loop, never blocking it, until ``deadline`` too.
    """

    #: How often a coroutine looks again (a thread is woken when the turn is given back).
    POLL = 0.001

    def __init__(self, node: str) -> None:
        self.node = node
        self.lock = threading.Lock()
        self.given_back = threading.Condition(self.lock)
        self.holder: int | None = None  # the thread holding the turn (or running its loop)
        self.held_by_coroutine = False
        forks.register(self)

    def take(self, deadline: float | None) -> None:
        """Hold the turn (this thread, blocking), waiting for it until ``deadline``."""
        me = threading.get_ident()
        with self.lock:
            while self.holder is not None:
                if self.holder == me:
                    raise NodeBusy(self.node, self._busy_here())
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise NodeBusy(self.node, self._still_busy())
                self.given_back.wait(left)
            self.holder, self.held_by_coroutine = me, False

    async def atake(self, deadline: float | None) -> None:
        """Hold the turn (a coroutine of the running loop), waiting for it on the loop."""
        me = threading.get_ident()
        while True:
            with self.lock:
                if self.holder is None:
                    self.holder, self.held_by_coroutine = me, True
                    return
            if deadline is not None and time.monotonic() >= deadline:
                raise NodeBusy(self.node, self._still_busy())
            await asyncio.sleep(self.POLL)

    def give_back(self) -> None:
        with self.lock:
            self.holder = None
            self.given_back.notify()

    def _busy_here(self) -> str:
        who = "a coroutine of this thread's event loop" if self.held_by_coroutine else \
            "this thread"
        return (f"being repaired by {who} (settling writes cut short): a blocking call "
                "here cannot wait for it")

    @staticmethod
    def _still_busy() -> str:
        return ("timed out waiting for another caller's repair (settling writes cut "
                "short) to end: IO_TIMEOUT passed")

    def after_fork(self) -> None:
        # The holder, if any, was another thread of the parent: gone in the child.
        self.lock = threading.Lock()
        self.given_back = threading.Condition(self.lock)
        self.holder, self.held_by_coroutine = None, False
