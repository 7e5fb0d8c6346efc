"""Herd protection for ``get_or_set``: one recomputation per expired hot key.

When a popular entry expires, every request that misses would recompute it at once. With
``OPTIONS["LEASE_TIMEOUT"]`` set, a missing ``get_or_set`` first takes a *lease*: exactly
one caller wins it and computes; the others wait for the fresh value (or, with
``STALE_TIMEOUT``, get the previous value at once). A lease expires after LEASE_TIMEOUT,
so a winner that crashed or hangs is replaced by one new winner.

The decisions are written once, as a :func:`plan` that yields the steps to carry out
(read, compute, store, release, sleep) — no I/O of its own — and two drivers carry them
out: :func:`run` for the sync API and :func:`arun` for ``aget_or_set`` (which awaits an
async default). A backend supplies only its primitive, a :class:`LeaseStore`, whose
methods are written once too: as the cache calls they need, which each driver makes on
its own API.
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Generator, NamedTuple, Protocol

from django_kvcache.options import seconds

logger = logging.getLogger(__name__)

#: Nothing stored, fresh or stale.
MISSING: Any = object()
#: First and longest pause between two reads of a caller waiting for the winner.
FIRST_POLL = 0.005
LONGEST_POLL = 0.1


class Read(NamedTuple):
    """What a :class:`LeaseStore` read found."""

    value: Any  # MISSING, or the value (fresh or stale)
    fresh: bool  # the value is live: nothing to do
    won: bool  # this caller now holds the lease: it computes and stores


#: One call of a cache method, as a store asks for it: ``(name, args, kwargs)``. The sync
#: driver calls ``cache.<name>``, the async one awaits ``cache.a<name>``, so a store's
#: logic is written once for both APIs.
Call = tuple


class LeaseStore(Protocol):
    """A backend's primitive for one key (the caller's key, before versioning). Each
    method is a generator of :data:`Call` that returns its result."""

    cache: Any

    def read(self) -> Generator[Call, Any, Read]:
        """The value if fresh; else take the lease if nobody holds it, and give any stale
        value there is."""

    def store(self, value: Any) -> Generator[Call, Any, None]:
        """Store the computed value (fresh, and stale after it expires) and release."""

    def release(self) -> Generator[Call, Any, None]:
        """Give the lease up without a value (the computation failed)."""


def carry_out(cache: Any, calls: Generator[Call, Any, Any]) -> Any:
    """A store method's calls, on the sync API."""
    result: Any = None
    while True:
        try:
            name, args, kwargs = calls.send(result)
        except StopIteration as done:
            return done.value
        result = getattr(cache, name)(*args, **kwargs)


async def acarry_out(cache: Any, calls: Generator[Call, Any, Any]) -> Any:
    """A store method's calls, on the async API (``aget``, ``aadd``...)."""
    result: Any = None
    while True:
        try:
            name, args, kwargs = calls.send(result)
        except StopIteration as done:
            return done.value
        result = await getattr(cache, f"a{name}")(*args, **kwargs)


@dataclass(frozen=True)
class Policy:
    lease_timeout: float
    stale_timeout: float | None  # None: no stale values; waiters wait for the fresh one

    @classmethod
    def from_options(cls, options: Any) -> Policy | None:
        """OPTIONS LEASE_TIMEOUT and STALE_TIMEOUT; None when herd protection is off."""
        lease = seconds(options, "LEASE_TIMEOUT", None, allow_none=True)
        stale = seconds(options, "STALE_TIMEOUT", None, allow_none=True)
        if lease is None:
            if stale is not None:
                from django.core.exceptions import ImproperlyConfigured

                raise ImproperlyConfigured(
                    "OPTIONS['STALE_TIMEOUT'] needs OPTIONS['LEASE_TIMEOUT'] (stale values "
                    "are served only while a lease holder recomputes)"
                )
            return None
        return cls(lease, stale)


# --- the decisions ------------------------------------------------------------------------


Step = tuple  # ("read",) ("compute",) ("store", value) ("release",) ("sleep", seconds)


def plan(policy: Policy, clock: Callable[[], float] = time.monotonic) -> Generator[Step, Any, Any]:
    """One herd-proof ``get_or_set``: yields steps, receives their results, returns the
    value. A waiter polls with a growing pause; after twice LEASE_TIMEOUT without a fresh
    value or a lease of its own (a store that keeps failing), it computes anyway: the
    caller always gets a value, as Django's ``get_or_set`` promises."""
    give_up = clock() + 2 * policy.lease_timeout
    pause = FIRST_POLL
    while True:
        read: Read = yield ("read",)
        if read.fresh:
            return read.value
        if read.won:
            try:
                value = yield ("compute",)
            except BaseException:
                yield ("release",)
                raise
            yield ("store", value)
            return value
        if read.value is not MISSING:
            return read.value  # stale, while the lease holder recomputes
        if clock() >= give_up:
            logger.warning(
                "get_or_set waited %.1f s (twice LEASE_TIMEOUT) without a fresh value or "
                "the lease; computing without it", 2 * policy.lease_timeout,
            )
            return (yield ("compute",))
        yield ("sleep", pause)
        pause = min(pause * 2, LONGEST_POLL)


def run(policy: Policy, store: LeaseStore, default: Any) -> Any:
    """Carry out :func:`plan` with the sync API; ``default`` as Django takes it."""
    steps = plan(policy)
    result: Any = None
    while True:
        try:
            step = steps.send(result)
        except StopIteration as done:
            return done.value
        result = None
        name = step[0]
        if name == "compute":
            try:
                result = default() if callable(default) else default
            except BaseException as exc:
                steps.throw(exc)  # the plan's answer: release the lease
                carry_out(store.cache, store.release())
                raise
        elif name == "sleep":
            time.sleep(step[1])
        else:  # read, store, release: the store's calls
            result = carry_out(store.cache, getattr(store, name)(*step[1:]))


async def arun(policy: Policy, store: LeaseStore, default: Any) -> Any:
    """Carry out :func:`plan` with the async API (native where the backend's is); an
    async ``default`` is awaited."""
    steps = plan(policy)
    result: Any = None
    while True:
        try:
            step = steps.send(result)
        except StopIteration as done:
            return done.value
        result = None
        name = step[0]
        if name == "compute":
            try:
                result = default() if callable(default) else default
                if inspect.isawaitable(result):
                    result = await result
            except BaseException as exc:
                steps.throw(exc)  # the plan's answer: release the lease
                await acarry_out(store.cache, store.release())
                raise
        elif name == "sleep":
            await asyncio.sleep(step[1])
        else:
            result = await acarry_out(store.cache, getattr(store, name)(*step[1:]))


# --- a store any cache can give: leases taken with add() ---------------------------------


def side_key(kind: str, key: Any) -> str:
    """The key of a lease or stale copy of ``key``: short and valid on every backend."""
    return f"kvcache-{kind}:{hashlib.sha1(str(key).encode()).hexdigest()}"


class AddLeaseStore:
    """Leases as ``add()`` of a lease key that expires after LEASE_TIMEOUT; the stale value
    as a copy under its own key that outlives the entry by STALE_TIMEOUT.

    Works on any cache whose ``add`` is atomic (both kvcache backends). Plain ``get`` and
    ``set`` are untouched; only entries written by ``get_or_set`` have a stale copy.
    """

    def __init__(self, cache: Any, policy: Policy, key: Any, timeout: Any, version: Any) -> None:
        self.cache = cache
        self.policy = policy
        self.key = key
        self.timeout = timeout
        self.version = version
        self.lease_key = side_key("lease", key)
        self.stale_key = side_key("stale", key)
        self.token = uuid.uuid4().hex

    def read(self) -> Generator[Call, Any, Read]:
        version = {"version": self.version}
        value = yield ("get", (self.key, MISSING), version)
        if value is not MISSING:
            return Read(value, True, False)
        won = yield ("add", (self.lease_key, self.token, self.policy.lease_timeout), version)
        if won:
            # A winner that stored and released between our get and our add: its value is
            # fresh, and computing again would make two computations of one miss.
            value = yield ("get", (self.key, MISSING), version)
            if value is not MISSING:
                yield from self.release()
                return Read(value, True, False)
            return Read(MISSING, False, True)
        stale = MISSING
        if self.policy.stale_timeout is not None:
            stale = yield ("get", (self.stale_key, MISSING), version)
        return Read(stale, False, False)

    def store(self, value: Any) -> Generator[Call, Any, None]:
        version = {"version": self.version}
        yield ("set", (self.key, value, self.timeout), version)
        stale_timeout = self.policy.stale_timeout
        if stale_timeout is not None:
            seconds_left = self.cache.timeout_seconds(self.timeout)
            if seconds_left is None or seconds_left > 0:
                stale_for = None if seconds_left is None else seconds_left + stale_timeout
                yield ("set", (self.stale_key, value, stale_for), version)
        yield from self.release()

    def release(self) -> Generator[Call, Any, None]:
        # Only our own lease: after LEASE_TIMEOUT another caller may hold it.
        version = {"version": self.version}
        if (yield ("get", (self.lease_key,), version)) == self.token:
            yield ("delete", (self.lease_key,), version)
