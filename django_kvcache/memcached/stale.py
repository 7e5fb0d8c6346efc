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

One caller repairs a node at a time (:class:`RepairTurn`).
"""
from __future__ import annotations

import asyncio
import threading

from django_kvcache import forks, outdated
from django_kvcache.memcached import wire
from django_kvcache.memcached.connection import UnsettledSocket


class OutdatedCopies(outdated.OutdatedCopies):
    """The shared record (:mod:`django_kvcache.outdated`, which flushes the node past
    its ``LIMIT`` keys) with memcached's clean-up."""

    @staticmethod
    def op(keys: set[str], flush: bool) -> wire.Op:
        """The pipelined commands that clean up."""
        if flush:
            return wire.flush_all()
        return wire.delete_many(key.encode() for key in keys)


class UnsettledSockets:
    """The node's sockets whose write was cut short (timed out or cancelled), each with
    the part of its request that was never sent: settled before the node serves again."""

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
        """Every unsettled socket, now owned by the caller (``put_back`` the rest)."""
        with self.lock:
            taken, self.connections, self.pending = self.connections, [], False
        return taken

    def put_back(self, connections: list[UnsettledSocket]) -> None:
        with self.lock:
            self.connections[:0] = connections
            self.pending = True

    def done(self) -> None:
        """Everything taken is settled."""

    def after_fork(self) -> None:
        # The sockets are the parent's, which settles them: forget them, keep them open.
        self.connections, self.pending, self.timeouts = [], False, 0
        self.lock = threading.Lock()


class RepairTurn:
    """Who repairs the node now. One caller at a time: another must not clean up while
    writes that this one took to settle can still land after its clean-up. A thread's
    lock, held across the repair: a thread waits for it, a coroutine polls it."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.lock = threading.Lock()
        forks.register(self)

    def take(self, deadline: float | None) -> None:
        self.lock.acquire()

    async def atake(self, deadline: float | None) -> None:
        while not self.lock.acquire(blocking=False):  # a thread holds it: let it finish
            await asyncio.sleep(0.001)

    def give_back(self) -> None:
        self.lock.release()

    def after_fork(self) -> None:
        self.lock = threading.Lock()
