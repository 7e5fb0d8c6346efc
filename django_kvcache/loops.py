"""What both backends' asyncio drivers keep per event loop: the state of each loop
(:class:`PerLoop`), closed when the loop shuts down, and its connection pools
(:class:`LoopPool`, whose coroutines wait in a :class:`WaitingLine`).

An asyncio driver's connections belong to the loop that opened them: they are only
touched from that loop's thread (so they need no lock), and a process running several
loops (``async_to_sync`` in threads, a test runner's loops) has one set per loop. When a
loop shuts down — ``loop.shutdown_asyncgens()``, which ``asyncio.run``, asgiref and ASGI
servers call — its state is closed. A loop closed without that leaves it to the garbage
collector. After a fork the child forgets the parent's loops and sockets.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any, AsyncIterator, Callable, Generic, Protocol, TypeVar

from django_kvcache import forks


class Connection(Protocol):
    """What a :class:`LoopPool` needs of its connections."""

    def close(self) -> None: ...


T = TypeVar("T")
C = TypeVar("C", bound=Connection)


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

    def after_fork(self) -> None:
        self.lock = threading.Lock()
        self.states = weakref.WeakKeyDictionary()
        self.guards = weakref.WeakKeyDictionary()


class WaitingLine:
    """Coroutines of one loop waiting for a pooled connection, oldest first, each for at
    most ``timeout`` seconds — the one waiting rule of both backends' asyncio pools.

    :meth:`wait` returns what :meth:`hand_over` gives it (a connection, or ``None``: open
    one of your own) or raises ``exhausted()`` once its time is up. Whichever comes first
    settles the waiter's future, so no waiter is both served and timed out (no
    ``asyncio.wait_for``, which from Python 3.12 may raise TimeoutError after the future
    got its result). A waiter cancelled just after it was served passes what it got to
    ``give_back``. One timer runs, for the oldest waiter's deadline (deadlines come in
    arrival order), not one per waiter: under load most checkouts wait, and a timer each
    — made, pushed on the loop's heap, cancelled, popped — cost a tenth of a MySQL
    ``aget``'s CPU.
    """

    def __init__(self, timeout: float, exhausted: Callable[[], BaseException]) -> None:
        self.timeout, self.exhausted = timeout, exhausted
        self.waiters: deque[tuple[asyncio.Future, float]] = deque()
        self.timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self.waiters)

    async def wait(self, give_back: Callable[[Any], None]) -> Any:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        deadline = loop.time() + self.timeout
        self.waiters.append((waiter, deadline))
        if self.timer is None:
            self.timer = loop.call_at(deadline, self._expire)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                give_back(waiter.result())  # cancelled just as it was served: pass it on
            else:
                self._forget(waiter)
            raise

    def hand_over(self, item: Any) -> bool:
        """Give ``item`` to the oldest waiter still waiting; False if none is."""
        while self.waiters:
            waiter, _ = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(item)
                return True
        return False

    def _forget(self, waiter: asyncio.Future) -> None:
        for entry in self.waiters:
            if entry[0] is waiter:
                self.waiters.remove(entry)
                return

    def _expire(self) -> None:
        """Fail the waiters whose time is up; set the timer again for the next one."""
        self.timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.waiters:
            waiter, deadline = self.waiters[0]
            if waiter.done():
                self.waiters.popleft()
            elif deadline > now:
                self.timer = loop.call_at(deadline, self._expire)
                return
            else:
                self.waiters.popleft()
                waiter.set_exception(self.exhausted())


class LoopPool(Generic[C]):
    """One event loop's connections to one server, at most ``max_size``, a coroutine
    waiting at most ``timeout`` for one (:class:`WaitingLine`): the connection lifecycle
    of both backends' asyncio drivers. A pool belongs to its loop and is only touched from
    that loop's thread, so it needs no lock.

    A subclass says how a connection is opened (:meth:`open`), whether an idle one may
    still be used (:meth:`usable`), what a timed-out wait raises (:meth:`exhausted`) and
    how a connection is closed (its ``close()``). A slot (``size``) is taken before a
    connection is opened and freed when it is discarded or its opening failed; a freed
    slot goes to the oldest waiter, which opens a connection of its own.
    """

    def __init__(self, max_size: int, timeout: float) -> None:
        self.max_size = max_size
        self.idle: list[C] = []
        self.waiting = WaitingLine(timeout, self.exhausted)
        self.size = 0
        self.waits = 0
        self.connects = 0

    def open(self) -> C:
        raise NotImplementedError

    def usable(self, connection: C) -> bool:
        return True

    def exhausted(self) -> BaseException:
        raise NotImplementedError

    def try_checkout(self) -> C | None:
        """A connection if one is idle or may be opened now; None instead of waiting."""
        while self.idle and not self.waiting:
            connection = self.idle.pop()
            if self.usable(connection):
                return connection
            self.discard(connection)
        if self.size < self.max_size:
            self.size += 1
            return self._opened()
        return None

    async def checkout(self) -> C:
        connection = self.try_checkout()
        if connection is not None:
            return connection
        self.waits += 1
        handed = await self.waiting.wait(self._give_back)
        return handed if handed is not None else self._opened()

    def checkin(self, connection: C) -> None:
        if not self.waiting.hand_over(connection):
            self.idle.append(connection)

    def discard(self, connection: C) -> None:
        connection.close()
        self.free_slot()

    def free_slot(self) -> None:
        if not self.waiting.hand_over(None):  # None: the waiter opens a connection of its own
            self.size -= 1

    def close_idle(self) -> None:
        idle, self.idle = self.idle, []
        self.size -= len(idle)
        for connection in idle:
            connection.close()

    def _opened(self) -> C:
        """A new connection in a slot already taken (freed again if opening fails)."""
        try:
            connection = self.open()
        except BaseException:
            self.free_slot()
            raise
        self.connects += 1
        return connection

    def _give_back(self, handed: C | None) -> None:
        self.free_slot() if handed is None else self.checkin(handed)

