"""The layer every kvcache backend shares on top of Django's ``BaseCache``.

It owns what must behave the same in both backends: OPTIONS checking (and errors that
name the cache), the value codec, Django's timeout rules, key building, corrupt-entry
handling and the async methods.
"""
from __future__ import annotations

import inspect
import logging
from functools import cached_property
from typing import Any, Callable, Iterable, Mapping

from asgiref.sync import async_to_sync, sync_to_async
from django.core.cache.backends.base import DEFAULT_TIMEOUT, BaseCache
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_kvcache import locks, stampede
from django_kvcache.codec import (
    DEFAULT_COMPRESS_MIN_LENGTH,
    DEFAULT_COMPRESS_MIN_SAVING,
    Codec,
    CorruptValue,
    StoredDictionaries,
)
from django_kvcache.failure_log import FailureLog
from django_kvcache.options import (
    TOP_LEVEL_HINTS,
    check_known,
    django_integer,
    name_the_cache,
    read_number_options,
    timeout_setting,
)
from django_kvcache.zstd import FLAG_ZSTD

logger = logging.getLogger(__name__)
#: Corrupt entries, per cache and kind of damage: one line when they start, then a
#: summary at most every minute. Entries another host wrote with a compressor this one
#: lacks (zstd in a rolling deploy) make every read of them a miss, and must not write a
#: line each; nor may they hide the first entry of another kind (a bad signature).
unreadable_entries = FailureLog(logger, "cache read")

#: A value no cache entry can hold, for "not found" where ``None`` is a valid value.
MISSING: Any = object()


def delegate_to_sync(name: str) -> Callable[..., Any]:
    """An async method that runs the sync method ``name`` in Django's sync thread.

    Django's own composite async methods (``aget_many``, ``ahas_key``, ``aincr``...) loop
    over single-key async calls before 6.1; delegating every one of them to the sync
    method keeps one batched round trip and the same behaviour on every Django version.
    """

    async def method(self: BaseCache, *args: Any, **kwargs: Any) -> Any:
        return await sync_to_async(getattr(self, name), thread_sensitive=True)(*args, **kwargs)

    method.__name__ = method.__qualname__ = f"a{name}"
    method.__doc__ = f"Async version of :meth:`{name}`."
    return method


def check_delta(delta: Any) -> None:
    """``incr``/``decr`` count in integers: a bool or float delta is a mistake, not 1 or 1.5."""
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(f"delta must be an integer, got {delta!r}")


def key_not_found(key: Any, version: int | None) -> ValueError:
    """``incr``/``decr``/``incr_version`` of a missing key, in Django's words and with
    the caller's key on both backends; a version the caller gave is named too (the key
    may well exist at another)."""
    at = "" if version is None else f" (version {version})"
    return ValueError(f"Key '{key}'{at} not found")


def counter_overflow(key: Any, delta: int) -> OverflowError:
    return OverflowError(
        f"Adding {delta} to key '{key}' leaves the signed 64-bit range; value unchanged"
    )


def cache_aliases(backend: type, location: Any, params: Mapping[str, Any]) -> list[str]:
    """The CACHES aliases Django would build as ``backend(location, params)``.

    Django builds a cache from a copy of its CACHES entry without BACKEND and LOCATION,
    and never tells the backend its alias: an entry of the same class whose LOCATION and
    other settings are equal is the one (two equal entries are both named).
    """
    from django.conf import settings

    try:
        configured = settings.CACHES
    except ImproperlyConfigured:  # no settings: a cache built by hand
        return []
    found = []
    for alias, entry in configured.items():
        others = {name: v for name, v in entry.items() if name not in ("BACKEND", "LOCATION")}
        if entry.get("LOCATION", "") != location or others != dict(params):
            continue
        try:
            if import_string(entry["BACKEND"]) is backend:
                found.append(alias)
        except (ImportError, KeyError):  # another entry's problem, reported when it is built
            continue
    return found


def describe_cache(backend: type, location: Any, params: Mapping[str, Any]) -> str:
    """``CACHES['mc']`` for a configured cache, else what it is and where."""
    aliases = cache_aliases(backend, location, params)
    if aliases:
        return " or ".join(f"CACHES[{alias!r}]" for alias in aliases)
    where = "" if location is None else f" with LOCATION {location!r}"
    return f"a {backend.__qualname__}{where} built outside CACHES"


class NamedConfiguration(type):
    """Every kvcache backend is built through ``__call__`` here, once, whatever its
    ``__init__`` reads and in which order: an ``ImproperlyConfigured`` it raises comes out
    naming the cache (``CACHES['mc']['OPTIONS']['IO_TIMEOUT'] must be ...``)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        params = kwargs.get("params", args[-1] if args else {})
        location = kwargs.get("location", args[0] if len(args) > 1 else None)
        try:
            cache = super().__call__(*args, **kwargs)
        except ImproperlyConfigured as exc:
            if not isinstance(params, Mapping):
                raise
            name = describe_cache(cls, location, params)
            raise ImproperlyConfigured(name_the_cache(str(exc), name)) from exc
        cache.built_from = (location, params)  # for ``cache_name``, worked out when needed
        return cache


class KVCache(BaseCache, metaclass=NamedConfiguration):
    """Base class of the kvcache backends.

    Subclasses list their extra OPTIONS in ``backend_options``; any other key raises
    ``ImproperlyConfigured`` when the cache is created, naming the cache and the nearest
    known key. Number options are read once, as Django reads numbers
    (``django_kvcache.options``), before anything else looks at them.
    """

    shared_options: frozenset[str] = frozenset(
        {
            "MAX_ENTRIES",
            "CULL_FREQUENCY",
            "SERIALIZER",
            "COMPRESSOR",
            "COMPRESS_MIN_LENGTH",
            "COMPRESS_MIN_SAVING",
            "COMPRESS_LEVEL",
            "COMPRESS_DICTIONARY",
            "LEASE_TIMEOUT",
            "STALE_TIMEOUT",
            "EARLY_RECOMPUTE",
            "SIGNING_KEY",
            "ENCRYPTION_KEYS",
        }
    )
    backend_options: frozenset[str] = frozenset()
    #: Unknown OPTIONS a user carries over from Django, pymemcache, django-redis or
    #: django-mysql, and what to use here instead (``options.THIS_CACHE`` names the cache).
    option_hints: Mapping[str, str] = TOP_LEVEL_HINTS
    #: Known OPTIONS that this backend has no use for, and why.
    inapplicable_options: Mapping[str, str] = {}
    #: COMPRESS_MIN_LENGTH when OPTIONS do not set it: each backend weighs what
    #: compression saves (memory, disk) against what it costs (CPU on every read).
    default_compress_min_length: int = DEFAULT_COMPRESS_MIN_LENGTH
    #: COMPRESS_MIN_SAVING when OPTIONS do not set it, likewise.
    default_compress_min_saving: float = DEFAULT_COMPRESS_MIN_SAVING

    def __init__(
        self,
        params: Mapping[str, Any],
        stored_dictionaries: StoredDictionaries | None = None,
        encryption_scope: str = "",
    ) -> None:
        """``stored_dictionaries``: a backend keeping zstd dictionaries itself gives their
        source, for ``COMPRESS_DICTIONARY: "auto"``. ``encryption_scope``: where the
        entries live (a table, memcached), bound into each one with ENCRYPTION_KEYS, so
        an entry copied from elsewhere does not decrypt here."""
        options = params.get("OPTIONS") or {}
        self.check_options(options)
        options = read_number_options(options)
        # Checked here, then read by Django's BaseCache with int() as it always does.
        timeout_setting(params.get("timeout", params.get("TIMEOUT", 300)))
        super().__init__(params)
        self.options: dict[str, Any] = options
        self.codec = Codec.from_options(
            options, self.default_compress_min_length, stored_dictionaries=stored_dictionaries,
            encryption_scope=encryption_scope,
            default_min_saving=self.default_compress_min_saving,
        )
        self.stampede = stampede.Policy.from_options(options)

    # --- configuration ---------------------------------------------------------------

    def check_options(self, options: Mapping[str, Any]) -> None:
        for name, reason in self.inapplicable_options.items():
            if name in options:
                raise ImproperlyConfigured(
                    f"OPTIONS[{name!r}] does not apply to {type(self).__name__}: {reason}. "
                    "Remove it."
                )
        # What it refuses (above) it never offers: not in "Known:", nor as "did you mean"
        # (a refused option in lower case is told why it does not apply).
        known = (self.shared_options | self.backend_options) - set(self.inapplicable_options)
        refused = {name.lower(): f"{name} does not apply to {type(self).__name__}: {reason}"
                   for name, reason in self.inapplicable_options.items()}
        check_known(options, known, "OPTIONS", {**refused, **self.option_hints})
        for name in ("MAX_ENTRIES", "CULL_FREQUENCY"):
            if name in options:
                django_integer(options[name], f"OPTIONS[{name!r}]", minimum=0)

    @property
    def backend_name(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}"

    @cached_property
    def cache_name(self) -> str:
        """How log lines and errors name this cache: ``CACHES['default']`` (Django never
        tells a backend its alias: found once, from the settings it was built with), or
        what it is and where when it was built outside CACHES."""
        location, params = getattr(self, "built_from", (None, {}))
        return describe_cache(type(self), location, params)

    # --- timeouts --------------------------------------------------------------------

    def timeout_seconds(self, timeout: Any = DEFAULT_TIMEOUT) -> float | None:
        """Seconds until the entry expires: ``None`` means never, ``<= 0`` already expired.

        As Django: ``DEFAULT_TIMEOUT`` takes the cache's TIMEOUT (which may itself be
        ``None``); ``0`` and negative numbers expire at once; floats are allowed. A
        timeout that is not a number raises ``TypeError`` (Django fails on it too).
        """
        if timeout is DEFAULT_TIMEOUT:
            timeout = self.default_timeout
        if timeout is None:
            return None
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number or None, got {timeout!r}")
        return timeout

    # --- keys and values -------------------------------------------------------------

    def make_keys(self, keys: Iterable[Any], version: int | None = None) -> dict[str, Any]:
        """Map each backend key to the caller's key, validating every one."""
        return {self.make_and_validate_key(key, version=version): key for key in keys}

    def decode(self, data: bytes, flags: int, key: str) -> Any:
        """The value stored under ``key`` (the stored key), or ``MISSING`` (with a
        rate-limited warning) when the entry is corrupt, fails authentication
        (ENCRYPTION_KEYS), or was written with a compressor this process lacks (zstd where
        it is not installed: the entry is fine, only unreadable here)."""
        try:
            return self.codec.decode(data, flags, key)
        except CorruptValue as exc:
            if flags & FLAG_ZSTD and FLAG_ZSTD not in self.codec.decompressors:
                message = f"cache entry {key!r} read as missing, unreadable here: {exc}"
            else:
                message = f"corrupt cache entry {key!r}: {exc}"
            self.report_unreadable(exc.reason, message)
            return MISSING

    def report_unreadable(self, reason: str, message: str) -> None:
        """Log an entry read as missing because it is corrupt: rate-limited per cache
        and ``reason`` (the kind of damage)."""
        unreadable_entries.failed(f"{self.cache_name} ({reason})", message)

    def get_or_set(
        self, key: Any, default: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> Any:
        """Django's ``get_or_set``; with LEASE_TIMEOUT, one caller computes a missing value
        while the others wait for it or get the stale one (``django_kvcache.stampede``)."""
        store = self._lease_store(key, timeout, version)
        if store is None:
            return super().get_or_set(key, default, timeout=timeout, version=version)
        return stampede.run(self.stampede, store, default)

    async def aget_or_set(
        self, key: Any, default: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> Any:
        """``get_or_set`` for async code: a coroutine function as ``default`` is awaited."""
        store = self._lease_store(key, timeout, version)
        if store is None:
            return await self._aget_or_set_unprotected(key, default, timeout, version)
        return await stampede.arun(self.stampede, store, default)

    async def _aget_or_set_unprotected(
        self, key: Any, default: Any, timeout: Any, version: Any
    ) -> Any:
        """Django's ``get_or_set`` in the sync thread (one hop); native backends override."""
        return await sync_to_async(self._get_or_set_awaiting, thread_sensitive=True)(
            key, default, timeout, version
        )

    def _get_or_set_awaiting(self, key: Any, default: Any, timeout: Any, version: Any) -> Any:
        """Django's get_or_set, run in the sync thread, with an async default awaited."""
        if callable(default):
            compute = default

            def default() -> Any:
                value = compute()
                if inspect.isawaitable(value):
                    awaitable = value

                    async def wait() -> Any:
                        return await awaitable

                    value = async_to_sync(wait)()
                return value

        return super().get_or_set(key, default, timeout=timeout, version=version)

    def _lease_store(self, key: Any, timeout: Any, version: Any) -> stampede.LeaseStore | None:
        """The herd-protection primitive for ``key``; None when it is off (or the entry
        would expire at once, where there is nothing to protect)."""
        if not self._protects(timeout):
            return None
        return stampede.AddLeaseStore(self, self.stampede, key, timeout, version)

    def _protects(self, timeout: Any) -> bool:
        """Whether get_or_set with ``timeout`` takes a lease: herd protection is on and
        the entry would not expire at once."""
        if self.stampede is None:
            return False
        seconds = self.timeout_seconds(timeout)
        return seconds is None or seconds > 0

    def storage(self) -> frozenset[str]:
        """Where the entries live, one name per place (a table in a database, a node):
        caches whose places meet share their entries' storage (the ``kvcache.W011``
        check compares their ENCRYPTION_KEYS)."""
        return frozenset()

    # --- locks (django_kvcache.locks, docs/locks.rst) ----------------------------------

    def lock(
        self,
        key: Any,
        version: int | None = None,
        timeout: float | None = None,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: float | None = None,
        thread_local: bool = True,
    ) -> locks.Lock:
        """A lock named ``key`` (made into a key as any cache key is: KEY_PREFIX,
        ``version``), with a fencing token per grant: django-redis's ``cache.lock()``.

        ``timeout``: seconds the lock lives unless released (None: until released);
        ``blocking``, ``blocking_timeout`` and ``sleep``: how ``acquire()`` waits.
        Nothing happens until ``acquire()`` or ``with``."""
        return locks.Lock(self._lock_store(key, version, asynchronous=False), key, timeout,
                          sleep, blocking, blocking_timeout, thread_local, self.cache_name)

    def alock(
        self,
        key: Any,
        version: int | None = None,
        timeout: float | None = None,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: float | None = None,
        thread_local: bool = True,
    ) -> locks.AsyncLock:
        """:meth:`lock` for async code: ``async with cache.alock("feed", timeout=60):``
        (not a coroutine: it builds the lock; its methods are awaited)."""
        return locks.AsyncLock(self._lock_store(key, version, asynchronous=True), key,
                               timeout, sleep, blocking, blocking_timeout, thread_local,
                               self.cache_name)

    def _lock_store(self, key: Any, version: int | None, asynchronous: bool) -> locks.LockStore:
        """The backend's primitive for one lock name, for the sync or the async API."""
        raise NotImplementedError(f"{self.backend_name} does not implement locks")

    def ttl(self, key: Any, version: int | None = None) -> float | None:
        """Seconds until ``key`` expires, with django-redis's meaning: ``None`` for an
        entry that never expires, ``0`` for a missing (or expired) one."""
        raise NotImplementedError(f"{self.backend_name} does not implement ttl()")

    def decr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        check_delta(delta)  # before negating: -True would pass as -1
        return self.incr(key, -delta, version=version)

    def incr_version(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        """Django's ``incr_version``, whose missing key is named as ``incr`` names it."""
        current = self.version if version is None else version
        value = self.get(key, MISSING, version=current)
        if value is MISSING:
            raise key_not_found(key, version)
        self.set(key, value, version=current + delta)
        self.delete(key, version=current)
        return current + delta

    # --- async: every method delegates to its sync counterpart -----------------------

    aadd = delegate_to_sync("add")
    aget = delegate_to_sync("get")
    aset = delegate_to_sync("set")
    atouch = delegate_to_sync("touch")
    adelete = delegate_to_sync("delete")
    aget_many = delegate_to_sync("get_many")
    aset_many = delegate_to_sync("set_many")
    adelete_many = delegate_to_sync("delete_many")
    ahas_key = delegate_to_sync("has_key")
    aincr = delegate_to_sync("incr")
    adecr = delegate_to_sync("decr")
    attl = delegate_to_sync("ttl")
    aincr_version = delegate_to_sync("incr_version")
    adecr_version = delegate_to_sync("decr_version")
    aclear = delegate_to_sync("clear")
    aclose = delegate_to_sync("close")
