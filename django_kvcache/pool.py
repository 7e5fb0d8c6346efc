"""One connection pool for both backends, with a blocking and an asyncio way to wait.

A pool holds the connections to one server: at most ``max_size`` open, idle or in use.
A slot (``size``) is taken before a connection is opened and freed when it is discarded
(or its opening failed). A caller that finds no idle connection and no free slot joins
the pool's waiting line and waits at most ``timeout`` seconds; whatever comes back — a
connection checked in, or a freed slot (``None``: open a connection of your own) — goes
to the caller that has waited longest, so a burst of newcomers cannot starve it.

:class:`Pool` is that core. Its two ways to wait:

* :class:`BlockingPool` — threads (a process-wide pool per server): a waiting thread
  blocks on a lock of its own (:class:`ThreadLine`). A forked child starts empty, without
  closing the parent's sockets.
* :class:`LoopPool` — coroutines of one event loop (one pool per loop and server, only
  touched from that loop's thread): a waiting coroutine awaits a future
  (:class:`LoopLine`).

A subclass says how a connection is opened (:meth:`Pool.open`), whether an idle one may
still be used (:meth:`Pool.usable`), what a timed-out wait raises
(:meth:`Pool.exhausted`), and each connection how it closes (its ``close()``).

Whatever stops a wait — a timeout, a cancelled coroutine, an exception a signal handler
raises in a waiting thread — the waiter leaves the line, or, if it was served at that
very moment, passes on what it was given: no slot and no connection is ever lost.

Taking and returning an idle connection while nobody waits is a plain ``list.pop`` /
``list.append`` (atomic under the GIL); the lock is taken only when the pool is empty or
someone waits. No waiter is stranded next to an idle connection: :meth:`Pool.checkin`
appends to ``idle`` *then* looks at the line; a waiter joins the line *then* looks at
``idle`` (under the lock), so one of the two sees the other.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, Callable, Generic, Protocol, TypeVar

from django_kvcache import forks


class Connection(Protocol):
    """What a pool needs of its connections."""

    def close(self) -> None: ...


C = TypeVar("C", bound=Connection)


class Pool(Generic[C]):
    """The core both ways of waiting share: slots, idle connections, hand-over, counters.

    Counters (read from any thread, for monitoring): ``size`` (open), ``idle``,
    ``waiting`` (callers in the line now), ``connects`` (opened), ``reuses`` (checkouts an
    idle connection served), ``waits`` (checkouts that waited) and ``wait_time``
    (seconds they waited, in all).
    """

    line: ThreadLine | LoopLine

    def __init__(self, max_size: int, timeout: float) -> None:
        self.max_size = max_size
        self.timeout = timeout
        self.lock = threading.Lock()
        self.idle: list[C] = []
        self.size = 0
        self.connects = 0
        self.reuses = 0
        self.waits = 0
        self.wait_time = 0.0

    # --- what a subclass says -----------------------------------------------------------

    def open(self) -> C:
        raise NotImplementedError

    def usable(self, connection: C) -> bool:
        return True

    def exhausted(self) -> BaseException:
        raise NotImplementedError

    # --- taking and returning ------------------------------------------------------------

    def try_checkout(self) -> C | None:
        """A connection if one is idle or may be opened now; None instead of waiting."""
        if not self.line:
            connection = self._pop_usable()
            if connection is not None:
                return connection
        with self.lock:
            if not self.line:
                connection = self._pop_usable(locked=True)
                if connection is not None:
                    return connection
            if self.size >= self.max_size:
                return None
            self.size += 1
        return self._opened()

    def checkin(self, connection: C) -> None:
        self.idle.append(connection)
        if self.line:  # read after the append: see the module docstring
            with self.lock:
                self._hand_over_idle()

    def discard(self, connection: C) -> None:
        """Close a connection that failed; a waiter may open one in its place."""
        connection.close()
        self.free_slot()

    def free_slot(self) -> None:
        """Stop counting a connection that left the pool (closed, or kept elsewhere)."""
        with self.lock:
            if not self.line.hand_over(None):  # None: the waiter opens a connection
                self.size -= 1

    def close_idle(self) -> None:
        """Close every idle connection (the ones in use close when they come back). Each
        freed slot goes to a waiter first, as :meth:`free_slot` does."""
        closed = []
        with self.lock:
            while (connection := self._pop_idle()) is not None:
                closed.append(connection)
                if not self.line.hand_over(None):
                    self.size -= 1
        for connection in closed:
            connection.close()

    def figures(self) -> dict[str, float]:
        return {
            "size": self.size, "idle": len(self.idle), "waiting": len(self.line),
            "connects": self.connects, "reuses": self.reuses, "waits": self.waits,
            "wait_time": self.wait_time,
        }

    # --- inside ---------------------------------------------------------------------------

    def _pop_idle(self) -> C | None:
        try:
            return self.idle.pop()
        except IndexError:  # another thread took the last one since we looked
            return None

    def _pop_usable(self, locked: bool = False) -> C | None:
        """An idle connection that may still be used; ``locked``: the lock is held and
        nobody waits, so the slot of one that may not is simply given up."""
        while (connection := self._pop_idle()) is not None:
            if self.usable(connection):
                self.reuses += 1
                return connection
            if locked:
                connection.close()
                self.size -= 1
            else:
                self.discard(connection)
        return None

    def _hand_over_idle(self) -> None:
        """Give idle connections to waiters, first come first served (lock held)."""
        while self.line and (connection := self._pop_idle()) is not None:
            if not self.line.hand_over(connection):
                self.idle.append(connection)
                return

    def _reserve_or_join(self) -> tuple[bool, Any]:
        """Under the lock: (True, connection-or-None-for-a-new-slot) when served at once,
        else (False, the waiter now in the line)."""
        with self.lock:
            if not self.line:
                connection = self._pop_usable(locked=True)
                if connection is not None:
                    return True, connection
            if self.size < self.max_size:
                self.size += 1
                return True, None
            waiter = self.line.join(self.timeout)
            self.waits += 1
            # Look again after joining: a checkin that read the line before we joined
            # has put its connection in ``idle`` by now (see the module docstring).
            self._hand_over_idle()
            return False, waiter

    def _served(self, handed: C | None) -> C:
        return handed if handed is not None else self._opened()

    def _give_back(self, handed: C | None) -> None:
        """A waiter was served just as it stopped waiting: pass on what it got."""
        if handed is None:
            self.free_slot()
        else:
            self.checkin(handed)

    def _opened(self) -> C:
        """A new connection in a slot already taken (freed again if opening fails)."""
        try:
            connection = self.open()
        except BaseException:
            self.free_slot()
            raise
        self.connects += 1
        return connection


# --- waiting threads ------------------------------------------------------------------------


class ThreadWaiter:
    """A thread in the line; ``ready`` is released when it is served."""

    __slots__ = ("handed", "ready", "deadline")

    def __init__(self, deadline: float) -> None:
        self.handed: Any = None
        self.ready = threading.Lock()
        self.ready.acquire()
        self.deadline = deadline


class ThreadLine:
    """Threads waiting for one :class:`BlockingPool`, oldest first (its lock guards it)."""

    def __init__(self) -> None:
        self.waiters: deque[ThreadWaiter] = deque()

    def __len__(self) -> int:
        return len(self.waiters)

    def join(self, timeout: float) -> ThreadWaiter:
        waiter = ThreadWaiter(time.monotonic() + timeout)
        self.waiters.append(waiter)
        return waiter

    def hand_over(self, item: Any) -> bool:
        if not self.waiters:
            return False
        waiter = self.waiters.popleft()
        waiter.handed = item
        waiter.ready.release()
        return True


class BlockingPool(Pool[C]):
    """A pool threads share; :meth:`checkout` blocks (see the module docstring)."""

    def __init__(self, max_size: int, timeout: float) -> None:
        super().__init__(max_size, timeout)
        self.line = ThreadLine()
        forks.register(self)

    def checkout(self) -> C:
        if not self.line:
            connection = self._pop_usable()
            if connection is not None:
                return connection
        served, got = self._reserve_or_join()
        if served:
            return got if got is not None else self._opened()
        return self._wait(got)

    def _wait(self, waiter: ThreadWaiter) -> C:
        started = time.monotonic()
        try:
            served = waiter.ready.acquire(timeout=max(waiter.deadline - started, 0.0))
        except BaseException:  # raised by a signal handler while it waited
            self._leave(waiter)
            raise
        finally:
            self.wait_time += time.monotonic() - started
        if not served:
            with self.lock:
                if waiter in self.line.waiters:
                    self.line.waiters.remove(waiter)
                    raise self.exhausted()
            # served just as it gave up: take what it got
        return self._served(waiter.handed)

    def _leave(self, waiter: ThreadWaiter) -> None:
        """The wait ended in an exception (a timeout, or one a signal handler raised):
        out of the line, or — served meanwhile — what it got passed on."""
        with self.lock:
            if waiter in self.line.waiters:
                self.line.waiters.remove(waiter)
                return
        self._give_back(waiter.handed)

    def after_fork(self) -> None:
        """Start empty without closing anything (the sockets are the parent's)."""
        self.lock = threading.Lock()
        self.idle = []
        self.line = ThreadLine()
        self.size = 0


# --- waiting coroutines ---------------------------------------------------------------------


class LoopLine:
    """Coroutines of one loop waiting for a :class:`LoopPool`, oldest first, each for at
    most its pool's timeout.

    Whichever comes first — a hand-over or the deadline — settles the waiter's future, so
    no waiter is both served and timed out (no ``asyncio.wait_for``, which from Python
    3.12 may raise TimeoutError after the future got its result). One timer runs, for the
    oldest waiter's deadline (deadlines come in arrival order), not one per waiter: under
    load most checkouts wait, and a timer each — made, pushed on the loop's heap,
    cancelled, popped — cost a tenth of a MySQL ``aget``'s CPU.
    """

    def __init__(self, exhausted: Callable[[], BaseException]) -> None:
        self.exhausted = exhausted
        self.waiters: deque[tuple[asyncio.Future, float]] = deque()
        self.timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self.waiters)

    def join(self, timeout: float) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        deadline = loop.time() + timeout
        self.waiters.append((waiter, deadline))
        if self.timer is None:
            self.timer = loop.call_at(deadline, self._expire)
        return waiter

    def hand_over(self, item: Any) -> bool:
        """Give ``item`` to the oldest waiter still waiting; False if none is."""
        while self.waiters:
            waiter, _ = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(item)
                return True
        return False

    def forget(self, waiter: asyncio.Future) -> None:
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


class LoopPool(Pool[C]):
    """One event loop's connections to one server; :meth:`checkout` is a coroutine (see
    the module docstring). It belongs to its loop and is only touched from that loop's
    thread: the lock is never contended."""

    def __init__(self, max_size: int, timeout: float) -> None:
        super().__init__(max_size, timeout)
        self.line = LoopLine(self.exhausted)

    async def checkout(self) -> C:
        if not self.line:
            connection = self._pop_usable()
            if connection is not None:
                return connection
        served, got = self._reserve_or_join()
        if served:
            return got if got is not None else self._opened()
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            handed = await got
        except BaseException:
            if got.done() and not got.cancelled() and got.exception() is None:
                self._give_back(got.result())  # cancelled just as it was served
            else:
                self.line.forget(got)
            raise
        finally:
            self.wait_time += loop.time() - started
        return self._served(handed)
