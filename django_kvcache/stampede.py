"""Herd protection for ``get_or_set``: one recomputation per expired hot key.

When a popular entry expires, every request that misses would recompute it at once. With
``OPTIONS["LEASE_TIMEOUT"]`` set, a missing ``get_or_set`` first takes a *lease*: exactly
one caller wins it and computes; the others wait for the fresh value (or, with
``STALE_TIMEOUT``, get the previous value at once). A lease expires after LEASE_TIMEOUT,
so a winner that crashed or hangs is replaced by one new winner.

The decisions are written once, as a :func:`plan` (:mod:`django_kvcache.steps`) that
yields the steps to carry out — the cache calls of the backend's :class:`LeaseStore`, the
computation, the pauses — with no I/O of its own; the shared drivers carry it out on the
sync API (:func:`run`) or the async one (:func:`arun`, which awaits an async default).
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol

from django.core.exceptions import ImproperlyConfigured

from django_kvcache import steps
from django_kvcache.options import seconds

logger = logging.getLogger(__name__)

#: Nothing stored, fresh or stale.
MISSING: Any = object()
#: First and longest pause between two reads of a caller waiting for the winner.
FIRST_POLL = 0.005
LONGEST_POLL = 0.1
#: The early window is at most this share of the entry's lifetime: whatever
#: EARLY_RECOMPUTE says, an entry is served as it is for three quarters of its life.
EARLY_SHARE = 0.25
#: Steepness of the draw inside the window (XFetch's exponential): with ``r`` seconds
#: left of a window of ``w``, a reader recomputes with probability ``exp(-3 r / w)`` —
#: 5 % as the window opens, 37 % two thirds of the way in, 100 % at expiry.
EARLY_STEEPNESS = 3.0


class Read(NamedTuple):
    """What a :class:`LeaseStore` read found."""

    value: Any  # MISSING, or the value (fresh or stale)
    fresh: bool  # the value is live: nothing to do unless this caller won the lease
    won: bool  # this caller now holds the lease: it computes and stores (with a fresh
    # value too: an early recomputation, Policy.early_recompute)


class LeaseStore(Protocol):
    """A backend's primitive for one key (the caller's key, before versioning). Each
    method is a plan (:mod:`django_kvcache.steps`) of the cache calls it needs, so it is
    written once for the sync and the async API."""

    def read(self) -> steps.Plan:
        """The value if fresh; else take the lease if nobody holds it, and give any stale
        value there is: a :class:`Read`. A store that supports early recomputation may
        also hand the lease out with a fresh value close to its expiry."""

    def store(self, value: Any) -> steps.Plan:
        """Store the computed value (fresh, and stale after it expires) and release."""

    def release(self) -> steps.Plan:
        """Give the lease up without a value (the computation failed)."""


def cache_of(store: LeaseStore) -> str:
    """How a log line names the store's cache (``CACHES['default']``): every store keeps
    the cache it works for, as ``cache`` or (memcached's) ``host``."""
    cache = getattr(store, "cache", None) or getattr(store, "host", None)
    return getattr(cache, "cache_name", "the cache")


class CacheCall:
    """A step: one method of the cache, ``name`` on the sync API, ``a<name>`` awaited on
    the async one (``get``/``aget``, ``add``/``aadd``...)."""

    __slots__ = ("cache", "name", "args", "kwargs")

    def __init__(self, cache: Any, name: str, *args: Any, **kwargs: Any) -> None:
        self.cache, self.name, self.args, self.kwargs = cache, name, args, kwargs

    def run(self) -> Any:
        return getattr(self.cache, self.name)(*self.args, **self.kwargs)

    def arun(self) -> Any:
        return getattr(self.cache, f"a{self.name}")(*self.args, **self.kwargs)


class Compute:
    """A step: the caller's ``default``, called if callable; awaited on the async API
    when it gives an awaitable (an ``async def`` default)."""

    __slots__ = ("default",)

    def __init__(self, default: Any) -> None:
        self.default = default

    def run(self) -> Any:
        return self.default() if callable(self.default) else self.default

    async def arun(self) -> Any:
        value = self.run()
        return (await value) if inspect.isawaitable(value) else value


@dataclass(frozen=True)
class Policy:
    lease_timeout: float
    stale_timeout: float | None  # None: no stale values; waiters wait for the fresh one
    #: Seconds before expiry in which one caller may recompute a still fresh entry while
    #: the others keep getting it (bounded by the entry's lifetime: ``early_window``);
    #: None: recompute only after expiry.
    early_recompute: float | None = None

    @classmethod
    def from_options(cls, options: Any) -> Policy | None:
        """OPTIONS LEASE_TIMEOUT, STALE_TIMEOUT and EARLY_RECOMPUTE; None when herd
        protection is off."""
        lease = seconds(options, "LEASE_TIMEOUT", None, allow_none=True)
        stale = seconds(options, "STALE_TIMEOUT", None, allow_none=True)
        early = seconds(options, "EARLY_RECOMPUTE", None, allow_none=True)
        if lease is None:
            for name, given in (("STALE_TIMEOUT", stale), ("EARLY_RECOMPUTE", early)):
                if given is not None:
                    raise ImproperlyConfigured(
                        f"OPTIONS[{name!r}] needs OPTIONS['LEASE_TIMEOUT'] (only a lease "
                        "holder recomputes)"
                    )
            return None
        return cls(lease, stale, early)

    def early_window(self, lifetime: float | None) -> float | None:
        """Seconds before expiry in which one caller may recompute a fresh entry stored
        for ``lifetime`` seconds (the timeout ``get_or_set`` stores it with): EARLY_RECOMPUTE,
        but at most a quarter of that lifetime — an EARLY_RECOMPUTE longer than the
        timeout must not turn caching off. None: no early recomputation (none asked
        for, or an entry that never expires)."""
        if self.early_recompute is None or lifetime is None or lifetime <= 0:
            return None
        return min(self.early_recompute, lifetime * EARLY_SHARE)


def recompute_early(left: float, window: float | None, draw: float) -> bool:
    """XFetch-style: whether a reader of a fresh entry with ``left`` seconds to live
    recomputes it now, given a uniform ``draw`` in [0, 1) and the early ``window``
    (:meth:`Policy.early_window`). Never before the window opens, always at expiry."""
    if window is None or left >= window:
        return False
    return draw < math.exp(-EARLY_STEEPNESS * max(left, 0.0) / window)


# --- the decisions ------------------------------------------------------------------------


def plan(
    policy: Policy, store: LeaseStore, default: Any, clock: Callable[[], float] = time.monotonic
) -> steps.Plan:
    """One herd-proof ``get_or_set``, as steps; returns the value. A waiter polls with a
    growing pause; after twice LEASE_TIMEOUT (a store's ``patience``, if it has one)
    without a fresh value or a lease of its own
    (a store that keeps failing), it computes anyway: the caller always gets a value, as
    Django's ``get_or_set`` promises."""
    # A store whose leases may outlive LEASE_TIMEOUT (memcached's whole seconds) says how
    # long to wait instead, so nobody gives up while a live lease is still in force.
    patience = getattr(store, "patience", 2 * policy.lease_timeout)
    give_up = clock() + patience
    pause = FIRST_POLL
    while True:
        read: Read = yield from store.read()
        if read.fresh and not read.won:
            return read.value
        if read.won:
            try:
                value = yield Compute(default)
            except Exception:
                yield from store.release()
                if not read.fresh:
                    raise
                # An early recomputation that failed: the entry is still fresh, and a
                # get_or_set that finds its entry never raises the default's errors.
                logger.warning("Early recomputation failed in %s; serving the present value",
                               cache_of(store), exc_info=True)
                return read.value
            except BaseException:
                yield from store.release()
                raise
            try:
                yield from store.store(value)
            except BaseException:  # not stored (too large...): others need not wait for it
                yield from store.release()
                raise
            return value
        if read.value is not MISSING:
            return read.value  # stale, while the lease holder recomputes
        if clock() >= give_up:
            logger.warning(
                "get_or_set on %s waited %.1f s (twice the lease's lifetime) without a fresh "
                "value or the lease; computing without it", cache_of(store), patience,
            )
            return (yield Compute(default))
        yield steps.Sleep(pause)
        pause = min(pause * 2, LONGEST_POLL)


def run(policy: Policy, store: LeaseStore, default: Any) -> Any:
    """:func:`plan` on the sync API."""
    return steps.run(plan(policy, store, default))


async def arun(policy: Policy, store: LeaseStore, default: Any) -> Any:
    """:func:`plan` on the async API (native where the backend's is)."""
    return await steps.arun(plan(policy, store, default))


# --- a store any cache can give: leases taken with add() ---------------------------------


SIDE_KINDS = ("lease", "stale")


def side_key(kind: str, key: Any) -> str:
    """The key of a lease or stale copy of ``key``: short and valid on every backend."""
    return f"kvcache-{kind}:{hashlib.sha1(str(key).encode()).hexdigest()}"


def is_side_key(key: Any) -> bool:
    """Whether ``key`` (a caller's key) is a lease or stale copy's (:func:`side_key`):
    an item of the store's own, which has no stale copies of its own."""
    return isinstance(key, str) and key.startswith(tuple(f"kvcache-{k}:" for k in SIDE_KINDS))


class AddLeaseStore:
    """Leases as ``add()`` of a lease key that expires after LEASE_TIMEOUT; the stale value
    as a copy under its own key that outlives the entry by STALE_TIMEOUT.

    Works on any cache whose ``add`` is atomic (both kvcache backends). Plain ``get`` and
    ``set`` are untouched; only entries written by ``get_or_set`` have a stale copy.

    ``release`` reads the lease and deletes it if it holds this caller's token: with the
    Django API alone a lease that expires between the two, and is taken by another
    caller, would be deleted. A store whose cache can compare and delete overrides it
    (memcached's ``ClassicLeaseStore``).
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

    def call(self, name: str, *args: Any) -> CacheCall:
        return CacheCall(self.cache, name, *args, version=self.version)

    def read(self) -> steps.Plan:
        value = yield self.call("get", self.key, MISSING)
        if value is not MISSING:
            return Read(value, True, False)
        won = yield self.call("add", self.lease_key, self.token, self.policy.lease_timeout)
        if won:
            # A winner that stored and released between our get and our add: its value is
            # fresh, and computing again would make two computations of one miss.
            value = yield self.call("get", self.key, MISSING)
            if value is not MISSING:
                yield from self.release()
                return Read(value, True, False)
            return Read(MISSING, False, True)
        stale = MISSING
        if self.policy.stale_timeout is not None:
            stale = yield self.call("get", self.stale_key, MISSING)
        return Read(stale, False, False)

    def store(self, value: Any) -> steps.Plan:
        # The copy first: a delete between the two writes (which removes the entry, then
        # the copy) must not leave the deleted value behind as the stale copy.
        yield from self.store_copy(value)
        yield self.call("set", self.key, value, self.timeout)
        yield from self.release()

    def store_copy(self, value: Any) -> steps.Plan:
        """With STALE_TIMEOUT, the stale copy of ``value``: the entry's lifetime and
        STALE_TIMEOUT more."""
        stale_timeout = self.policy.stale_timeout
        if stale_timeout is not None:
            seconds_left = self.cache.timeout_seconds(self.timeout)
            if seconds_left is None or seconds_left > 0:
                stale_for = None if seconds_left is None else seconds_left + stale_timeout
                yield self.call("set", self.stale_key, value, stale_for)

    def release(self) -> steps.Plan:
        # Only our own lease: after LEASE_TIMEOUT another caller may hold it.
        if (yield self.call("get", self.lease_key)) == self.token:
            yield self.call("delete", self.lease_key)
