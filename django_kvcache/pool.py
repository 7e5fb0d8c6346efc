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
* :class:`LoopPool` — coroutines of one event loop (one pool per loop and server, used
  from that loop's thread; once the loop is closed it may be closed from another):
  a waiting coroutine awaits a future (:class:`LoopLine`).

A subclass says how a connection is opened (:meth:`Pool.open`), whether an idle one may
still be used (:meth:`Pool.usable`), what a timed-out wait raises
(:meth:`Pool.exhausted`), and each connection how it closes (its ``close()``).

Whatever ends a wait — a timeout, a cancelled coroutine, an exception a signal handler
raises in a waiting thread (Celery's soft time limit) — the waiter leaves the line, or,
if it was served meanwhile, passes on what it was given: a wait loses no slot and no
connection. (What a caller does with a connection once ``checkout`` returned it is the
caller's.)

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


class Line(Protocol):
    """The callers waiting for a pool, oldest first (guarded by the pool's lock)."""

    #: The waiters themselves: looked at directly on every checkout and checkin.
    waiters: Any

    def __len__(self) -> int: ...

    def hand_over(self, item: Any) -> bool:
        """Give ``item`` to the oldest caller still waiting; False if none is."""

    def forget(self, waiter: Any) -> bool:
        """Take ``waiter`` out of the line; False if it was not in it (served)."""


C = TypeVar("C", bound=Connection)
#: What :meth:`Pool._take_now` gives when the caller must wait.
WAIT: Any = object()
#: The names of :meth:`Pool.figures`.
FIGURES = ("size", "idle", "waiters", "waits", "wait_seconds", "connects", "reuses")


class Pool(Generic[C]):
    """The core both ways of waiting share: slots, idle connections, hand-over, counters.

    Counters (read from any thread, for monitoring; :meth:`figures`): ``size`` (open),
    ``idle``, the callers waiting now, ``connects`` (opened), ``reuses`` (checkouts an
    idle connection served), ``waits`` (checkouts that waited) and ``wait_time``
    (seconds they waited, in all).
    """

    line: Line

    def __init__(self, max_size: int, timeout: float) -> None:
        self.max_size = max_size
        self.timeout = timeout
        self.lock = threading.Lock()
        self.idle: list[C] = []
        self.size = 0
        #: Whether ``usable`` asks anything of an idle connection (a subclass's rule);
        #: when it does not, a checkout takes an idle connection without asking.
        self.asks_usable = type(self).usable is not Pool.usable
        self.reset_counters()

    def reset_counters(self) -> None:
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
        connection = self._idle_now()
        if connection is not None:
            return connection
        with self.lock:
            got = self._take_now()
        return None if got is WAIT else self._served(got)

    def checkin(self, connection: C) -> None:
        self.idle.append(connection)
        if self.line.waiters:  # read after the append: see the module docstring
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
        """The counters, named as ``metrics()`` shows them (after a prefix)."""
        return {
            "size": self.size, "idle": len(self.idle), "waiters": len(self.line),
            "waits": self.waits, "wait_seconds": round(self.wait_time, 6),
            "connects": self.connects, "reuses": self.reuses,
        }

    # --- inside ---------------------------------------------------------------------------

    def _idle_now(self) -> C | None:
        """An idle connection, taken without the lock while nobody waits."""
        if self.line.waiters:  # (every request's path: the deque itself, not len(line))
            return None
        while (connection := self._pop_idle()) is not None:
            if not self.asks_usable:
                self.reuses += 1
                return connection
            if self._usable(connection, locked=False):
                return connection
        return None

    def _take_now(self) -> Any:
        """With the lock held: an idle connection, ``None`` for a slot reserved for a new
        one, or :data:`WAIT`."""
        if not self.line:
            while (connection := self._pop_idle()) is not None:
                if self._usable(connection, locked=True):
                    return connection
        if self.size < self.max_size:
            self.size += 1
            return None
        return WAIT

    def _usable(self, connection: C, locked: bool) -> bool:
        """Whether an idle connection just taken may be used; if not (or if asking
        fails) it is closed and its slot freed — given up directly when the lock is
        held, since nobody waits then."""
        try:
            if self.usable(connection):
                self.reuses += 1
                return True
        except BaseException:
            self._drop(connection, locked)
            raise
        self._drop(connection, locked)
        return False

    def _drop(self, connection: C, locked: bool) -> None:
        if not locked:
            self.discard(connection)
            return
        self.size -= 1
        connection.close()

    def _pop_idle(self) -> C | None:
        if not self.idle:  # the usual case when a connection is opened: no raise and catch
            return None
        try:
            return self.idle.pop()
        except IndexError:  # another thread took the last one since we looked
            return None

    def _hand_over_idle(self) -> None:
        """Give idle connections to waiters, first come first served (lock held)."""
        while self.line and (connection := self._pop_idle()) is not None:
            if not self.line.hand_over(connection):
                self.idle.append(connection)
                return

    def _served(self, handed: C | None) -> C:
        """What a caller was given: a connection, or a slot to open one in."""
        return handed if handed is not None else self._opened()

    def _give_back(self, handed: C | None) -> None:
        """A caller was served but will not use what it got: pass it on."""
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

    def _waited(self, seconds: float) -> None:
        with self.lock:
            self.wait_time += seconds


# --- waiting threads ------------------------------------------------------------------------


class ThreadWaiter:
    """A thread waiting for a :class:`BlockingPool`: ``ready`` is released when it is
    served (``served``, with ``handed``); ``taken`` once its caller owns what it got."""

    __slots__ = ("ready", "served", "handed", "taken")

    def __init__(self) -> None:
        self.ready = threading.Lock()
        self.ready.acquire()
        self.served = False
        self.handed: Any = None
        self.taken = False

    def serve(self, item: Any) -> None:
        self.handed, self.served = item, True
        self.ready.release()


class ThreadLine:
    """Threads waiting for one :class:`BlockingPool`, oldest first."""

    def __init__(self) -> None:
        self.waiters: deque[ThreadWaiter] = deque()

    def __len__(self) -> int:
        return len(self.waiters)

    def join(self, waiter: ThreadWaiter) -> None:
        self.waiters.append(waiter)

    def hand_over(self, item: Any) -> bool:
        if not self.waiters:
            return False
        self.waiters.popleft().serve(item)
        return True

    def forget(self, waiter: ThreadWaiter) -> bool:
        try:
            self.waiters.remove(waiter)
        except ValueError:
            return False
        return True


class BlockingPool(Pool[C]):
    """A pool threads share; :meth:`checkout` blocks (see the module docstring)."""

    def __init__(self, max_size: int, timeout: float) -> None:
        super().__init__(max_size, timeout)
        self.line: ThreadLine = ThreadLine()
        forks.register(self)

    def checkout(self) -> C:
        connection = self._idle_now()
        if connection is not None:
            return connection
        waiter = ThreadWaiter()  # before anything can be handed to it
        try:
            with self.lock:
                got = self._take_now()
                if got is WAIT:
                    self.line.join(waiter)
                    self.waits += 1
                    # Look again after joining: a checkin that read the line before we
                    # joined has put its connection in ``idle`` (see the module docstring).
                    self._hand_over_idle()
                else:
                    waiter.handed, waiter.served = got, True
            if not waiter.served:
                self._wait(waiter)
            handed, waiter.taken = waiter.handed, True
            return self._served(handed)
        except BaseException:  # a timeout, or an exception from a signal handler
            self._leave(waiter)
            raise

    def _wait(self, waiter: ThreadWaiter) -> None:
        """Until ``waiter`` is served; :meth:`exhausted` once the time is up."""
        started = time.monotonic()
        try:
            served = waiter.ready.acquire(timeout=self.timeout)
        finally:
            self._waited(time.monotonic() - started)
        if not served:
            with self.lock:
                if self.line.forget(waiter):
                    raise self.exhausted()
            # served just as it gave up: it takes what it got

    def _leave(self, waiter: ThreadWaiter) -> None:
        """The checkout ended in an exception: out of the line, or — served and not yet
        taken — what it got passed on. Safe to call whatever point it was at."""
        with self.lock:
            if self.line.forget(waiter) or not waiter.served or waiter.taken:
                return
            waiter.taken = True
        self._give_back(waiter.handed)

    def after_fork(self) -> None:
        """Start empty without closing anything (the sockets are the parent's)."""
        self.lock = threading.Lock()
        self.idle = []
        self.line = ThreadLine()
        self.size = 0
        self.reset_counters()


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
        while self.waiters:
            waiter, _ = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(item)
                return True
        return False

    def forget(self, waiter: asyncio.Future) -> bool:
        for entry in self.waiters:
            if entry[0] is waiter:
                self.waiters.remove(entry)
                return True
        return False

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
                error = self.exhausted()  # before it leaves the line: nothing can strand it
                self.waiters.popleft()
                waiter.set_exception(error)


class LoopPool(Pool[C]):
    """One event loop's connections to one server; :meth:`checkout` is a coroutine (see
    the module docstring)."""

    def __init__(self, max_size: int, timeout: float) -> None:
        super().__init__(max_size, timeout)
        self.line: LoopLine = LoopLine(self.exhausted)

    async def checkout(self) -> C:
        connection = self._idle_now()
        if connection is not None:
            return connection
        with self.lock:
            got = self._take_now()
            if got is WAIT:
                waiter = self.line.join(self.timeout)
                self.waits += 1
                self._hand_over_idle()
        if got is not WAIT:
            return self._served(got)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            handed = await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give_back(waiter.result())  # cancelled just as it was served
            else:
                self.line.forget(waiter)
            raise
        finally:
            self._waited(loop.time() - started)
        return self._served(handed)
