"""``cache.lock()`` and ``cache.alock()``: lease locks with fencing tokens, on both backends.

A lock is a *lease*: whoever acquires it holds it until it releases it or until
``timeout`` seconds pass, whichever comes first, so a holder that died never blocks the
others for longer than that. Every grant carries a **fencing token**, a number that grows
with every grant of the name. A holder that stalls past its timeout (a GC pause, a
stopped VM) may still believe it holds the lock while the next holder works; the
resource the lock protects refuses its late writes by their older token
(:func:`fenced_update`, ``docs/locks.rst``).

The rules — waiting, giving up, what a lost grant means, what a cancellation cleans up —
are written once here, as plans (:mod:`django_kvcache.steps`) that :class:`Lock` runs
on blocking sockets and :class:`AsyncLock` on the event loop. Each backend gives a
:class:`LockStore` for one name: four plans of its own statements or wire commands
(``django_kvcache.mysql.locks``, ``django_kvcache.memcached.locks``).

The API is redis-py's ``Lock`` (what django-redis's ``cache.lock()`` returns), with
the differences listed in ``docs/locks.rst``.
"""
from __future__ import annotations

import logging
import math
import os
import random
import secrets
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

from django_kvcache import steps
from django_kvcache.failure_log import FailureLog

logger = logging.getLogger(__name__)
#: Non-blocking acquires that found the server unreachable (answered False): one line
#: per episode and lock store, then a summary.
unreachable = FailureLog(logger, "lock")

#: First pause between two tries of a waiting acquire; it doubles up to ``sleep``.
FIRST_PAUSE = 0.002


class LockError(Exception):
    """A lock could not be used as asked: not acquired in time by a ``with`` block,
    released or extended while not held, bad arguments (redis-py's ``LockError``)."""


class LockNotOwned(LockError):
    """The grant this lock held is gone: it expired (and someone else may hold the lock
    now), or the server lost it. Raised by ``release()`` and ``extend()``; redis-py's
    ``LockNotOwnedError``."""


#: redis-py's name, for code written against django-redis.
LockNotOwnedError = LockNotOwned


@dataclass
class Grant:
    """One grant of a lock, as this process knows it. ``owner`` is random per acquire
    attempt and stored with the grant, so the store can tell this grant from any other
    (release and extend compare it, never delete blindly); ``token`` is the fencing
    token the server gave."""

    owner: bytes = field(default_factory=lambda: secrets.token_hex(16).encode())
    token: int | None = None
    pid: int = field(default_factory=os.getpid)
    #: ``time.monotonic()`` when the grant's lease ends, as this process reckons it
    #: (None: no timeout). Only the memcached classic store reads it (for extend).
    ends: float | None = None


class LockStore(Protocol):
    """One lock name on one backend: plans of the backend's own statements or commands.
    Each compares the caller's :class:`Grant` (its ``owner``), never deletes blindly."""

    def grant(self, grant: Grant, seconds: float | None) -> steps.Plan:
        """Take the lock for ``seconds`` (None: until released) if nobody holds it: True,
        with ``grant.token`` set; False while someone else holds it."""

    def release(self, grant: Grant) -> steps.Plan:
        """End ``grant`` if it is the live one: True; False if it is not (expired,
        another's now, or never granted). The name's token is kept."""

    def extend(self, grant: Grant, seconds: float, replace: bool) -> steps.Plan:
        """Add ``seconds`` to the live ``grant``'s remaining time (``replace``: make it
        ``seconds`` from now): True; False if it is not the live grant."""

    def peek(self) -> steps.Plan:
        """The ``owner`` of the live grant, or None when nobody holds the lock."""

    #: Where the name lives, for log lines ("MySQL shard 'default'").
    where: str

    def unreachable(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the server could not be reached (not a bad request)."""


def check_seconds(value: Any, name: str, allow_none: bool = True, positive: bool = True) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise LockError(f"{name} must be a number of seconds, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise LockError(f"{name} must be {'positive' if positive else 'zero or more'}, "
                        f"got {value!r}")
    return value


class _Rules:
    """What :class:`Lock` and :class:`AsyncLock` do, as plans: written once."""

    def __init__(
        self,
        store: LockStore,
        name: Any,
        timeout: float | None = None,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: float | None = None,
        thread_local: bool = True,
        cache_name: str = "",
    ) -> None:
        self.store = store
        self.name = name
        #: How log lines name the cache (``CACHES['default']``), beside the server.
        self.cache_name = cache_name
        self.timeout = check_seconds(timeout, "timeout")
        self.sleep = check_seconds(sleep, "sleep", allow_none=False, positive=False)
        self.blocking = blocking
        self.blocking_timeout = check_seconds(blocking_timeout, "blocking_timeout",
                                              positive=False)
        if self.timeout is not None and self.sleep > self.timeout:
            raise LockError("'sleep' must be less than 'timeout'")
        #: The grant held, per thread by default (redis-py's ``thread_local``): a lock
        #: object shared by threads is held by the thread that acquired it.
        self.local: Any = threading.local() if thread_local else SimpleNamespace()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} token={self.token}>"

    # --- the grant held by this lock object --------------------------------------------

    @property
    def grant(self) -> Grant | None:
        """The grant this object holds in this thread (if ``thread_local``) and this
        process: a forked child does not own its parent's grant."""
        grant = getattr(self.local, "grant", None)
        if grant is None or grant.pid != os.getpid():
            return None
        return grant

    @grant.setter
    def grant(self, grant: Grant | None) -> None:
        self.local.grant = grant

    @property
    def token(self) -> int | None:
        """The fencing token of the grant this object holds, or None. It is larger than
        the token of every earlier grant of the name (docs/locks.rst says when that
        holds on each backend): pass it to the protected resource with each write."""
        grant = self.grant
        return None if grant is None else grant.token

    # --- the plans -----------------------------------------------------------------------

    def _acquire(self, blocking: bool | None, blocking_timeout: float | None) -> steps.Plan:
        if blocking is None:
            blocking = self.blocking
        if blocking_timeout is None:
            blocking_timeout = self.blocking_timeout
        else:
            check_seconds(blocking_timeout, "blocking_timeout", positive=False)
        give_up = None if blocking_timeout is None else time.monotonic() + blocking_timeout
        pause = min(FIRST_PAUSE, self.sleep)
        while True:
            grant = Grant()
            try:
                granted = yield from self._take(grant)
            except Exception as exc:
                if blocking or not self.store.unreachable(exc):
                    raise
                unreachable.failed(
                    self.store.where, f"lock {self.name!r} not acquired: the server could "
                    f"not be reached ({type(exc).__name__}: {exc})",
                    label=self._where(),
                )
                return False
            if granted:
                if self.timeout is not None:
                    grant.ends = time.monotonic() + self.timeout
                self.grant = grant
                return True
            if not blocking:
                return False
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                return False
            # No busy loop: a pause that grows to ``sleep``, drawn at random below it so
            # that waiters that collided do not collide again in step, and never past
            # the moment the caller gives up (one last try is made then).
            wait = random.uniform(pause / 2, pause)
            if give_up is not None:
                wait = min(wait, give_up - now)
            yield steps.Sleep(wait)
            pause = min(pause * 2, self.sleep) if self.sleep else 0.0

    def _take(self, grant: Grant) -> steps.Plan:
        """One try. If it is interrupted once its request may have left (a cancelled
        coroutine, a KeyboardInterrupt), the grant may exist with nobody knowing of it:
        it is released by its owner before the interruption goes on. (A server error
        leaves a grant it may have made to expire: the server is what failed.)"""
        try:
            return (yield from self.store.grant(grant, self.timeout))
        except (GeneratorExit, Exception):
            raise
        except BaseException:
            yield from self._let_go(grant)
            raise

    def _let_go(self, grant: Grant) -> steps.Plan:
        """Release ``grant`` if it exists, after an interruption: any error of its own is
        logged (the interruption's is the one raised)."""
        try:
            yield from self.store.release(grant)
        except Exception as exc:
            logger.warning("Could not release lock %r on %s after an interrupted call; it "
                           "expires after its timeout: %s: %s", self.name, self._where(),
                           type(exc).__name__, exc)

    def _where(self) -> str:
        """The server and the cache, for log lines: ``memcached node h:p of CACHES['x']``."""
        return f"{self.store.where} of {self.cache_name}" if self.cache_name else self.store.where

    def _release(self) -> steps.Plan:
        grant = self.grant
        if grant is None:
            raise LockError("Cannot release an unlocked lock")
        self.grant = None
        try:
            released = yield from self.store.release(grant)
        except GeneratorExit:
            raise
        except BaseException as exc:
            if not isinstance(exc, Exception):  # interrupted: its outcome is unknown
                yield from self._let_go(grant)
            raise
        if not released:
            raise LockNotOwned("Cannot release a lock that's no longer owned")

    def _extend(self, additional_time: float, replace_ttl: bool) -> steps.Plan:
        grant = self.grant
        if grant is None:
            raise LockError("Cannot extend an unlocked lock")
        if self.timeout is None:
            raise LockError("Cannot extend a lock with no timeout")
        check_seconds(additional_time, "additional_time", allow_none=False,
                      positive=replace_ttl)
        if not (yield from self.store.extend(grant, additional_time, replace_ttl)):
            raise LockNotOwned("Cannot extend a lock that's no longer owned")
        now = time.monotonic()
        if replace_ttl or grant.ends is None:
            grant.ends = now + additional_time
        else:
            grant.ends = max(grant.ends, now) + additional_time
        return True

    def _reacquire(self) -> steps.Plan:
        grant = self.grant
        if grant is None:
            raise LockError("Cannot reacquire an unlocked lock")
        if self.timeout is None:
            raise LockError("Cannot reacquire a lock with no timeout")
        if not (yield from self.store.extend(grant, self.timeout, True)):
            raise LockNotOwned("Cannot reacquire a lock that's no longer owned")
        grant.ends = time.monotonic() + self.timeout
        return True

    def _locked(self) -> steps.Plan:
        return (yield from self.store.peek()) is not None

    def _owned(self) -> steps.Plan:
        grant = self.grant
        if grant is None:
            return False
        return (yield from self.store.peek()) == grant.owner


class Lock(_Rules):
    """A lock for the sync API (``cache.lock()``), redis-py's ``Lock`` API:

        with cache.lock("import-feed", timeout=60) as lock:
            import_feed(fence=lock.token)

    ``timeout``: seconds the lock lives unless released or extended (None: until
    released — a holder that dies then blocks the name for good; give one).
    ``blocking``/``blocking_timeout``: whether ``acquire()`` waits, and at most how
    long (None: as long as it takes). ``sleep``: the longest pause between two tries.
    ``thread_local``: the grant belongs to the thread that acquired it.
    """

    def acquire(self, blocking: bool | None = None, blocking_timeout: float | None = None) -> bool:
        """Take the lock: True, or False if it was not free (within ``blocking_timeout``
        when blocking). An unreachable server raises the backend's error — or, for a
        non-blocking acquire, gives False (logged) — whatever IGNORE_EXCEPTIONS says."""
        return steps.run(self._acquire(blocking, blocking_timeout))  # type: ignore[no-any-return]

    def release(self) -> None:
        """Release the lock; ``LockNotOwned`` if its grant is gone (expired)."""
        steps.run(self._release())

    def extend(self, additional_time: float, replace_ttl: bool = False) -> bool:
        """Add ``additional_time`` seconds to what is left of the lease (``replace_ttl``:
        make it ``additional_time`` from now); ``LockNotOwned`` if the grant is gone.
        The token stays the same."""
        return steps.run(self._extend(additional_time, replace_ttl))  # type: ignore[no-any-return]

    def reacquire(self) -> bool:
        """Make the lease ``timeout`` seconds from now again; ``LockNotOwned`` if lost."""
        return steps.run(self._reacquire())  # type: ignore[no-any-return]

    def locked(self) -> bool:
        """Whether anyone holds the lock now."""
        return steps.run(self._locked())  # type: ignore[no-any-return]

    def owned(self) -> bool:
        """Whether this lock object (in this thread) holds the live grant."""
        return steps.run(self._owned())  # type: ignore[no-any-return]

    def __enter__(self) -> Lock:
        if self.acquire():
            return self
        raise LockError("Unable to acquire lock within the time specified")

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


class AsyncLock(_Rules):
    """:class:`Lock` for async code (``cache.alock()``), on the event loop's own
    connections: ``async with cache.alock("feed", timeout=60) as lock: ...``.

    A cancelled ``acquire()`` holds nothing afterwards (a grant that its last request
    may have made is released first); a cancelled holder's ``async with`` releases its
    own grant on the way out, and nobody else's.
    """

    async def acquire(
        self, blocking: bool | None = None, blocking_timeout: float | None = None
    ) -> bool:
        return await steps.arun(self._acquire(blocking, blocking_timeout))  # type: ignore[no-any-return]

    async def release(self) -> None:
        await steps.arun(self._release())

    async def extend(self, additional_time: float, replace_ttl: bool = False) -> bool:
        return await steps.arun(self._extend(additional_time, replace_ttl))  # type: ignore[no-any-return]

    async def reacquire(self) -> bool:
        return await steps.arun(self._reacquire())  # type: ignore[no-any-return]

    async def locked(self) -> bool:
        return await steps.arun(self._locked())  # type: ignore[no-any-return]

    async def owned(self) -> bool:
        return await steps.arun(self._owned())  # type: ignore[no-any-return]

    async def __aenter__(self) -> AsyncLock:
        if await self.acquire():
            return self
        raise LockError("Unable to acquire lock within the time specified")

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.release()


# --- the protected side ------------------------------------------------------------------


def _fenced(queryset: Any, token: int, field: str) -> Any:
    from django.db.models import Q

    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"a fencing token is an int (lock.token), got {token!r}")
    return queryset.filter(Q(**{f"{field}__isnull": True}) | Q(**{f"{field}__lte": token}))


def fenced_update(queryset: Any, token: int, field: str = "fencing_token", **values: Any) -> int:
    """Update the rows of ``queryset`` with ``values`` only where ``field`` (an integer
    column beside the protected data) is NULL or at most ``token``, and store ``token``
    there: one ``UPDATE … WHERE field <= token``. Returns the number of rows updated;
    0 means a newer grant has written (this holder's lease is over): do not go on.

        updated = fenced_update(Feed.objects.filter(pk=feed.pk), lock.token, items=items)
    """
    fenced = _fenced(queryset, token, field)
    return fenced.update(**{field: token, **values})  # type: ignore[no-any-return]


async def afenced_update(
    queryset: Any, token: int, field: str = "fencing_token", **values: Any
) -> int:
    """:func:`fenced_update` for async code (``QuerySet.aupdate``)."""
    fenced = _fenced(queryset, token, field)
    return await fenced.aupdate(**{field: token, **values})  # type: ignore[no-any-return]
