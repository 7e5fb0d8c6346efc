"""State kept per asyncio event loop, closed when the loop shuts down.

An asyncio driver's connections belong to the loop that opened them: they are only
touched from that loop's thread (so they need no lock), and a process running several
loops (``async_to_sync`` in threads, a test runner's loops) has one set per loop. When a
loop shuts down — ``loop.shutdown_asyncgens()``, which ``asyncio.run``, asgiref and ASGI
servers call — its state is closed. A loop closed without that leaves it to the garbage
collector. After a fork the child forgets the parent's loops and sockets.
"""
from __future__ import annotations

import asyncio
import os
import threading
import weakref
from typing import AsyncIterator, Callable, Generic, TypeVar

T = TypeVar("T")


class PerLoop(Generic[T]):
    """One ``T`` per event loop: made by ``make`` on first use, ``close``\\ d with the loop."""

    def __init__(self, make: Callable[[], T], close: Callable[[T], None]) -> None:
        self.make, self.close = make, close
        self.states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = (
            weakref.WeakKeyDictionary()
        )
        # Each loop's guard (below), kept alive: collected, it would close the state.
        self.guards: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncIterator[None]] = (
            weakref.WeakKeyDictionary()
        )
        self.lock = threading.Lock()
        _instances.add(self)

    def get(self) -> T:
        """The running loop's state (call it on the loop)."""
        loop = asyncio.get_running_loop()
        state = self.states.get(loop)
        return state if state is not None else self._start(loop)

    def existing(self) -> T | None:
        """The running loop's state, if it has one."""
        return self.states.get(asyncio.get_running_loop())

    def every(self) -> list[T]:
        """Every loop's state (read from any thread: for monitoring)."""
        with self.lock:
            return list(self.states.values())

    def _start(self, loop: asyncio.AbstractEventLoop) -> T:
        with self.lock:
            state = self.states.get(loop)
            if state is not None:
                return state
            state = self.states[loop] = self.make()
        # An async generator that the loop finalizes at shutdown: its first step runs
        # here (a coroutine step, driven by hand), so the loop's asyncgen hook adopts it.
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
            self.close(state)
            with self.lock:
                if self.states.get(loop) is state:
                    del self.states[loop]

    def _after_fork(self) -> None:
        self.lock = threading.Lock()
        self.states = weakref.WeakKeyDictionary()
        self.guards = weakref.WeakKeyDictionary()


_instances: weakref.WeakSet[PerLoop] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for per_loop in list(_instances):
        per_loop._after_fork()


os.register_at_fork(after_in_child=_forget_after_fork)
