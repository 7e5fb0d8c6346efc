"""What both backends' asyncio drivers keep per event loop (:class:`PerLoop`): their
connection pools (:class:`django_kvcache.pool.LoopPool`) and what else a loop needs of
its own, closed when the loop shuts down.

An asyncio driver's connections belong to the loop that opened them: they are only
touched from that loop's thread (so they need no lock), and a process running several
loops (``async_to_sync`` in threads, a test runner's loops) has one set per loop. When a
loop shuts down — ``loop.shutdown_asyncgens()``, which ``asyncio.run``, asgiref and ASGI
servers call — its state is closed at once. A loop closed without that (``loop.close()``
alone) cannot tell us: its state is closed and forgotten by the next event loop that
makes state of its own, or by a call that lists every loop's (``metrics()``), so a
process that makes loop after loop keeps at most one closed loop's connections. After a
fork the child forgets the parent's loops and sockets, and never closes them.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable, Generic, TypeVar

from django_kvcache import forks

T = TypeVar("T")
logger = logging.getLogger(__name__)


class PerLoop(Generic[T]):
    """One ``T`` per event loop: made by ``make`` on first use, ``close``\\ d with the loop
    (``close`` may be called from another thread once the loop is closed).

    Getting the running loop's state is a plain dict lookup: no lock, no weak reference.
    """

    def __init__(self, make: Callable[[], T], close: Callable[[T], None]) -> None:
        self.make, self.close = make, close
        self.after_fork()
        forks.register(self)

    def get(self) -> T:
        """The running loop's state (call it on the loop)."""
        loop = asyncio.get_running_loop()
        state = self.states.get(loop)
        return state if state is not None else self._start(loop)

    def existing(self) -> T | None:
        """The running loop's state, if it has one."""
        return self.states.get(asyncio.get_running_loop())

    def every(self) -> list[T]:
        """Every open loop's state (read from any thread: for monitoring)."""
        self._close_closed_loops()
        with self.lock:
            return list(self.states.values())

    def _start(self, loop: asyncio.AbstractEventLoop) -> T:
        self._close_closed_loops()
        with self.lock:
            state = self.states.get(loop)
            if state is not None:
                return state
            state = self.states[loop] = self.make()
        # An async generator that the loop finalizes at shutdown: its first step runs
        # here (a coroutine step, driven by hand), so the loop's asyncgen hook adopts it.
        # The loop holds it only weakly: kept here, or collected it would close the state.
        guard = self._closed_with(loop, state)
        try:
            guard.__anext__().send(None)
        except StopIteration:  # reached its ``yield``: registered, now waits for shutdown
            pass
        self.guards[loop] = guard
        return state

    async def _closed_with(self, loop: asyncio.AbstractEventLoop, state: T) -> AsyncIterator[None]:
        try:
            yield
        finally:
            with self.lock:  # not ours to close if forgotten (a forked child's copy)
                mine = self.states.get(loop) is state
                if mine:
                    del self.states[loop]
                    self.guards.pop(loop, None)
            if mine:
                self.close(state)

    def _close_closed_loops(self) -> None:
        """Close and forget the state of every loop closed without shutting down. The
        guard of such a loop refers to it (as every async generator refers to the loop
        that adopted it), so only forgetting it here lets the loop be collected."""
        with self.lock:
            closed = [loop for loop in self.states if loop.is_closed()]
            if not closed:
                return
            states = [self.states.pop(loop) for loop in closed]
            for loop in closed:
                self.guards.pop(loop, None)
        for state in states:
            try:
                self.close(state)
            except Exception:  # the caller is another loop's: it must not fail for this
                logger.warning("Closing the connections of a closed event loop failed",
                               exc_info=True)

    def after_fork(self) -> None:
        """Forget the parent's loops (their sockets are the parent's)."""
        self.lock = threading.Lock()
        self.states: dict[asyncio.AbstractEventLoop, T] = {}
        self.guards: dict[asyncio.AbstractEventLoop, AsyncIterator[None]] = {}
