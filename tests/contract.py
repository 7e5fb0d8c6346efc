"""Django's cache contract, written once and run against every kvcache backend.

A backend's test module subclasses :class:`CacheContract`, says how to configure the
backend in :meth:`~CacheContract.backend_params` and, if its storage needs it, prepares it
in :meth:`~CacheContract.prepare`::

    @pytest.mark.django_db(transaction=True)
    class TestMySQLContract(CacheContract):
        def backend_params(self):
            return {"BACKEND": "django_kvcache.backends.mysql.MySQLCache", "LOCATION": "t"}

What is checked is what Django documents and its own generic cache tests expect of any
backend: return types, defaults, ``None``/``0``/negative/float timeouts, versions, key
functions and prefixes, value types (unicode, binary, models, large, unpicklable), the
cache middleware round trip and the async API. Backend-specific rules (key validation,
culling, routing) are tested in each backend's own modules.

Every contract test runs twice: on the sync API, and on the async API — the same test,
with the cache seen through :class:`AsyncAPI`, which turns ``cache.get(...)`` into
``await cache.aget(...)`` on an event loop of the test's own.
"""
from __future__ import annotations

import asyncio
import datetime
import decimal
import pickle
import time
from typing import Any, Callable, Iterator

import pytest
from django.core.cache import caches
from django.core.cache.backends.base import BaseCache
from django.http import HttpResponse
from django.middleware.cache import FetchFromCacheMiddleware, UpdateCacheMiddleware
from django.test import RequestFactory, override_settings
from django.utils.module_loading import import_string

from tests.models import Poll

# A whole-second timeout (memcached's clock counts whole seconds, and Django reads a
# TIMEOUT setting with int()); backends with a finer clock use SUBSECOND_TIMEOUT in the
# tests that set the timeout per call. A test waits past a timeout by the backend's clock
# resolution plus EXPIRY_MARGIN.
SHORT_TIMEOUT = 1
SUBSECOND_TIMEOUT = 0.5  # long enough to write and read back on a loaded machine
EXPIRY_MARGIN = 0.2


def custom_key_func(key: str, key_prefix: str, version: int) -> str:
    return f"CUSTOM-{key_prefix}-{version}-{key}"


class Unpicklable:
    def __reduce__(self):
        raise pickle.PickleError("this object refuses to be pickled")


def same_poll(a: Any, b: Any) -> bool:
    return isinstance(b, Poll) and (a.pk, a.question, a.answers) == (b.pk, b.question, b.answers)


class CacheFixture:
    """How to build the backend under test; subclasses provide ``backend_params``.

    The base of :class:`CacheContract` and of the hostile-input and concurrency suites.
    """

    def backend_params(self) -> dict[str, Any]:
        """The CACHES entry (BACKEND, LOCATION, OPTIONS) for the backend under test."""
        raise NotImplementedError

    def prepare(self, cache: BaseCache) -> None:
        """Make the storage ready (e.g. create a table). Called for every cache built."""

    def build(self, **overrides: Any) -> BaseCache:
        params = {**self.backend_params(), **overrides}
        backend = import_string(params.pop("BACKEND"))
        cache = backend(params.pop("LOCATION", ""), params)
        self.prepare(cache)
        return cache

    @pytest.fixture
    def cache(self):
        cache = self.build()
        cache.clear()
        yield cache
        cache.clear()
        cache.close()


#: The cache methods with an async twin (``get`` -> ``aget``) in Django's API.
ASYNC_TWINS = frozenset({
    "get", "set", "add", "touch", "delete", "get_many", "set_many", "delete_many",
    "has_key", "incr", "decr", "get_or_set", "incr_version", "decr_version", "clear", "close",
})


class AsyncAPI:
    """A cache driven through its async methods: ``get(...)`` runs ``aget(...)`` to
    completion on ``loop``; everything else (``make_key``, ``aget`` itself) is the cache's."""

    def __init__(self, cache: BaseCache, loop: asyncio.AbstractEventLoop) -> None:
        self.cache = cache
        self.loop = loop

    def __getattr__(self, name: str) -> Any:
        if name not in ASYNC_TWINS:
            return getattr(self.cache, name)
        method = getattr(self.cache, f"a{name}")
        return lambda *args, **kwargs: self.loop.run_until_complete(method(*args, **kwargs))


@pytest.fixture(params=["sync", "async"])
def api(request: Any) -> Iterator[Callable[[Any], Any]]:
    """How a test drives its cache: as it is, or through its native async methods
    (``cache.get`` runs ``await cache.aget`` on an event loop of the test's own). Import
    it into a test module to use it there."""
    if request.param == "sync":
        yield lambda cache: cache
        return
    loop = asyncio.new_event_loop()
    yield lambda cache: AsyncAPI(cache, loop)
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


class CacheContract(CacheFixture):
    """Django's cache contract as tests, on the sync and on the async API."""

    #: How finely the backend's expiry clock counts, in seconds: memcached's whole
    #: seconds unless a class says otherwise (the MySQL table counts milliseconds).
    clock_resolution = 1.0

    @property
    def short_timeout(self) -> float:
        return SHORT_TIMEOUT if self.clock_resolution >= 1 else SUBSECOND_TIMEOUT

    def wait_past(self, timeout: float) -> None:
        """Sleep until an entry written with ``timeout`` before this call has expired."""
        time.sleep(timeout + self.clock_resolution + EXPIRY_MARGIN)

    @pytest.fixture(autouse=True, params=["sync", "async"])
    def api(self, request):
        """Which API the test's caches are driven through; the async one gets an event
        loop of its own, shut down (pools closed with it) after the test."""
        self.loop = asyncio.new_event_loop() if request.param == "async" else None
        yield request.param
        if self.loop is not None:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def build(self, **overrides: Any) -> Any:
        cache = super().build(**overrides)
        return cache if self.loop is None else AsyncAPI(cache, self.loop)

    # --- basic operations and their return types -------------------------------------

    def test_get_missing_returns_default(self, cache):
        assert cache.get("nothing") is None
        assert cache.get("nothing", "fallback") == "fallback"
        sentinel = object()
        assert cache.get("nothing", sentinel) is sentinel

    def test_set_returns_none_and_get_reads_it(self, cache):
        assert cache.set("key", "value") is None
        assert cache.get("key") == "value"

    def test_set_overwrites(self, cache):
        cache.set("key", "one")
        cache.set("key", "two")
        assert cache.get("key") == "two"

    def test_falsy_values_are_not_misses(self, cache):
        for key, value in [("zero", 0), ("false", False), ("empty", ""), ("nobytes", b""),
                           ("nolist", []), ("none", None)]:
            cache.set(key, value)
            got = cache.get(key, "default")
            assert got == value and type(got) is type(value), key
            assert cache.has_key(key) is True, key

    def test_add_only_when_missing(self, cache):
        assert cache.add("key", "first") is True
        assert cache.add("key", "second") is False
        assert cache.get("key") == "first"

    def test_delete_returns_whether_something_was_deleted(self, cache):
        cache.set("key", "value")
        assert cache.delete("key") is True
        assert cache.get("key") is None
        assert cache.delete("key") is False

    def test_has_key(self, cache):
        cache.set("key", "value")
        assert cache.has_key("key") is True
        assert cache.has_key("other") is False

    def test_clear_removes_everything(self, cache):
        cache.set_many({"a": 1, "b": 2})
        assert cache.clear() is None
        assert cache.get_many(["a", "b"]) == {}

    def test_touch(self, cache):
        cache.set("key", "value", timeout=self.short_timeout)
        assert cache.touch("key", timeout=None) is True
        assert cache.touch("missing") is False
        self.wait_past(self.short_timeout)
        assert cache.get("key") == "value"

    def test_touch_with_zero_expires(self, cache):
        cache.set("key", "value")
        assert cache.touch("key", timeout=0) is True
        assert cache.get("key") is None

    # --- multi-key operations --------------------------------------------------------

    def test_get_many_returns_found_keys_only(self, cache):
        cache.set_many({"a": "A", "b": "B", "c": None})
        assert cache.get_many(["a", "b", "c", "missing"]) == {"a": "A", "b": "B", "c": None}

    def test_get_many_accepts_any_iterable(self, cache):
        cache.set_many({"a": 1, "b": 2})
        assert cache.get_many(key for key in ["a", "b"]) == {"a": 1, "b": 2}
        assert cache.get_many(("a",)) == {"a": 1}
        assert cache.get_many(iter([])) == {}
        assert cache.get_many([]) == {}

    def test_set_many_returns_empty_list_on_success(self, cache):
        assert cache.set_many({"a": 1, "b": "two", "c": [3]}) == []
        assert cache.get_many(["a", "b", "c"]) == {"a": 1, "b": "two", "c": [3]}
        assert cache.set_many({}) == []

    def test_set_many_overwrites(self, cache):
        cache.set("a", "old")
        cache.set_many({"a": "new", "b": "fresh"})
        assert cache.get_many(["a", "b"]) == {"a": "new", "b": "fresh"}

    def test_set_many_with_timeout(self, cache):
        cache.set_many({"a": 1, "b": 2}, timeout=self.short_timeout)
        cache.set_many({"c": 3}, timeout=None)
        self.wait_past(self.short_timeout)
        assert cache.get_many(["a", "b", "c"]) == {"c": 3}

    def test_delete_many(self, cache):
        cache.set_many({"a": 1, "b": 2, "c": 3})
        assert cache.delete_many(["a", "b", "missing"]) is None
        assert cache.get_many(["a", "b", "c"]) == {"c": 3}
        assert cache.delete_many([]) is None
        assert cache.delete_many(key for key in ["c"]) is None
        assert cache.get("c") is None

    # --- incr / decr -----------------------------------------------------------------

    def test_incr_and_decr(self, cache):
        cache.set("n", 41)
        assert cache.incr("n") == 42
        assert cache.get("n") == 42
        assert cache.incr("n", 10) == 52
        assert cache.decr("n") == 51
        assert cache.decr("n", 50) == 1
        assert cache.incr("n", -1) == 0
        assert cache.get("n") == 0

    def test_incr_missing_key_raises_value_error(self, cache):
        with pytest.raises(ValueError):
            cache.incr("missing")
        with pytest.raises(ValueError):
            cache.decr("missing")
        assert cache.has_key("missing") is False

    def test_incr_of_non_integer_raises_type_error(self, cache):
        cache.set("text", "not a number")
        with pytest.raises(TypeError):
            cache.incr("text")
        assert cache.get("text") == "not a number"

    def test_incr_of_value_from_set_many(self, cache):
        cache.set_many({"n": 5})
        assert cache.incr("n", 2) == 7

    # --- timeouts --------------------------------------------------------------------

    def test_zero_timeout_stores_nothing(self, cache):
        cache.set("key", "value", timeout=0)
        assert cache.get("key") is None
        assert cache.add("added", "value", timeout=0) is True
        assert cache.get("added") is None
        assert cache.set_many({"many": 1}, timeout=0) == []
        assert cache.get("many") is None

    def test_negative_timeout_stores_nothing(self, cache):
        cache.set("key", "value", timeout=-1)
        assert cache.get("key") is None
        assert cache.has_key("key") is False

    def test_zero_timeout_set_removes_old_value(self, cache):
        cache.set("key", "old")
        cache.set("key", "new", timeout=0)
        assert cache.get("key") is None

    def test_add_over_expired_entry(self, cache):
        cache.set("key", "stale", timeout=-1)
        assert cache.add("key", "fresh") is True
        assert cache.get("key") == "fresh"

    def test_float_timeout(self, cache):
        cache.set("key", "value", timeout=30.5)
        assert cache.get("key") == "value"
        cache.set("brief", "value", timeout=0.4)  # under a second: expired or not, no error
        cache.get("brief")

    def test_entries_expire(self, cache):
        cache.set("short", "value", timeout=self.short_timeout)
        cache.add("short-add", "value", timeout=self.short_timeout)
        cache.set("long", "value", timeout=60)
        self.wait_past(self.short_timeout)
        assert cache.get("short") is None
        assert cache.has_key("short-add") is False
        assert cache.get_many(["short", "short-add", "long"]) == {"long": "value"}
        assert cache.add("short", "again") is True

    def test_timeout_none_setting_keeps_entries_by_default(self):
        cache = self.build(TIMEOUT=None)
        try:
            cache.set("forever", "value")
            assert cache.get("forever") == "value"
            cache.set("bounded", "value", timeout=self.short_timeout)
            self.wait_past(self.short_timeout)
            assert cache.get("forever") == "value"
            assert cache.get("bounded") is None
        finally:
            cache.clear()
            cache.close()

    # Django reads TIMEOUT with int(): its own cache-middleware tests configure a string.
    @pytest.mark.parametrize("setting", [SHORT_TIMEOUT, str(SHORT_TIMEOUT)], ids=repr)
    def test_default_timeout_setting_applies(self, setting):
        cache = self.build(TIMEOUT=setting)
        try:
            cache.set("key", "value")
            assert cache.get("key") == "value"
            cache.set("kept", "value", timeout=None)
            self.wait_past(SHORT_TIMEOUT)
            assert cache.get("key") is None
            assert cache.get("kept") == "value"
        finally:
            cache.clear()
            cache.close()

    # --- values ----------------------------------------------------------------------

    @pytest.mark.parametrize(
        "value",
        [
            "ascii",
            "Iñtërnâtiônàlizætiøn",
            "4-byte: \U0001f600\U0001f680 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
            b"\x00\x01\xff\xfe binary \r\n\x00",
            12345,
            -98765,
            2**63 - 1,
            -(2**63),
            2**70,
            1.25,
            True,
            decimal.Decimal("1.10"),
            datetime.datetime(2026, 11, 21, 12, 30, tzinfo=datetime.timezone.utc),
            {"nested": {"list": [1, 2, (3, 4)], "set": {5}}},
            (1, "two"),
        ],
        ids=repr,
    )
    def test_value_types_round_trip(self, cache, value):
        cache.set("value", value)
        got = cache.get("value")
        assert got == value and type(got) is type(value)
        assert cache.get_many(["value"]) == {"value": value}

    def test_unicode_keys(self, cache):
        data = {"ключ": "значение", "鍵": "値", "emoji-\U0001f511": "\U0001f5dd", "é": 1, "e": 2}
        for key, value in data.items():
            cache.set(key, value)
        for key, value in data.items():
            assert cache.get(key) == value
        assert cache.get_many(data) == data
        cache.delete("é")
        assert cache.get("e") == 2 and cache.get("é") is None

    def test_keys_are_case_sensitive(self, cache):
        cache.set("Key", "upper")
        cache.set("key", "lower")
        assert cache.get("Key") == "upper"
        assert cache.get("key") == "lower"

    def test_non_string_keys(self, cache):
        cache.set(42, "int key")
        assert cache.get(42) == "int key"
        assert cache.get("42") == "int key"  # keys are made with str(), as in Django

    def test_model_instance(self, cache):
        poll = Poll(id=3, question="Cached?", answers=2)
        cache.set("poll", poll)
        assert same_poll(poll, cache.get("poll"))

    def test_large_compressible_value(self, cache):
        value = "django-kvcache large value " * 20000  # ~540 KB before compression
        cache.set("large", value)
        assert cache.get("large") == value
        assert cache.get_many(["large"]) == {"large": value}

    def test_binary_incompressible_value(self, cache):
        import random

        value = random.Random(7).randbytes(100_000)
        cache.set("noise", value)
        assert cache.get("noise") == value

    def test_values_compression_does_not_pay_for_round_trip_beside_those_it_does(self, cache):
        """kvcache stores a value compressed only when that saves enough (random bytes and
        tokens are stored as they are): both kinds, alone and in one batch."""
        import random
        import string

        rng = random.Random(11)
        values = {
            "noise": rng.randbytes(3000),
            "token": "".join(rng.choices(string.ascii_letters + string.digits, k=2500)),
            "page": "<li class='item'>entry</li>\n" * 300,
            "rows": [{"id": n, "name": f"row {n}", "price": decimal.Decimal(n) / 7} for n in range(40)],
        }
        for key, value in values.items():
            cache.set(key, value)
            assert cache.get(key) == value
        cache.set_many({f"many-{key}": value for key, value in values.items()})
        assert cache.get_many([f"many-{key}" for key in values]) == {
            f"many-{key}": value for key, value in values.items()}

    def test_unpicklable_value_raises_and_keeps_old_value(self, cache):
        cache.set("key", "old")
        with pytest.raises(pickle.PickleError):
            cache.set("key", Unpicklable())
        with pytest.raises(pickle.PickleError):
            cache.add("new", Unpicklable())
        with pytest.raises(pickle.PickleError):
            cache.set_many({"key": Unpicklable()})
        assert cache.get("key") == "old"
        assert cache.has_key("new") is False

    def test_get_or_set(self, cache):
        assert cache.get_or_set("key", "default") == "default"
        assert cache.get_or_set("key", "other") == "default"
        assert cache.get_or_set("made", lambda: "computed") == "computed"
        assert cache.get("made") == "computed"
        assert cache.get_or_set("none", None) is None
        assert cache.has_key("none") is True

    def test_get_or_set_callable_not_called_on_hit(self, cache):
        cache.set("key", "cached")
        calls = []
        assert cache.get_or_set("key", lambda: calls.append(1) or "new") == "cached"
        assert calls == []

    # --- versions, prefixes and key functions ----------------------------------------

    def test_versions_are_separate(self, cache):
        cache.set("key", "v1")
        cache.set("key", "v2", version=2)
        assert cache.get("key") == "v1"
        assert cache.get("key", version=1) == "v1"
        assert cache.get("key", version=2) == "v2"
        assert cache.get("key", version=3) is None
        assert cache.get_many(["key"], version=2) == {"key": "v2"}
        cache.set_many({"other": "x"}, version=3)
        assert cache.get("other") is None and cache.get("other", version=3) == "x"
        cache.delete_many(["key"], version=2)
        assert cache.get("key", version=2) is None and cache.get("key") == "v1"
        assert cache.has_key("key", version=2) is False

    def test_version_setting(self):
        v2 = self.build(VERSION=2)
        v1 = self.build()
        try:
            v2.set("key", "from v2")
            assert v1.get("key") is None
            assert v1.get("key", version=2) == "from v2"
            assert v2.incr_version("key") == 3
            assert v2.get("key") is None and v2.get("key", version=3) == "from v2"
        finally:
            v1.clear()
            v1.close()
            v2.close()

    def test_incr_and_decr_version(self, cache):
        cache.set("key", "value")
        assert cache.incr_version("key") == 2
        assert cache.get("key") is None
        assert cache.get("key", version=2) == "value"
        assert cache.decr_version("key", version=2) == 1
        assert cache.get("key") == "value"
        with pytest.raises(ValueError):
            cache.incr_version("missing")

    def test_incr_respects_version(self, cache):
        cache.set("n", 1, version=2)
        assert cache.incr("n", version=2) == 2
        with pytest.raises(ValueError):
            cache.incr("n")

    def test_key_prefix_isolates_caches(self):
        first = self.build(KEY_PREFIX="first")
        second = self.build(KEY_PREFIX="second")
        try:
            first.set("key", "one")
            second.set("key", "two")
            assert first.get("key") == "one"
            assert second.get("key") == "two"
            second.delete("key")
            assert first.get("key") == "one"
            assert first.make_key("key").startswith("first:")
        finally:
            first.clear()
            first.close()
            second.close()

    @pytest.mark.parametrize("key_function", [custom_key_func, "tests.contract.custom_key_func"])
    def test_custom_key_function(self, key_function):
        custom = self.build(KEY_FUNCTION=key_function)
        plain = self.build()
        try:
            custom.set("key", "custom")
            assert custom.get("key") == "custom"
            assert plain.get("key") is None
            assert custom.make_key("key") == "CUSTOM--1-key"
            assert custom.get_many(["key"]) == {"key": "custom"}
            assert custom.incr_version("key") == 2
            assert custom.get("key", version=2) == "custom"
        finally:
            plain.clear()
            plain.close()
            custom.close()

    # --- lifecycle, middleware, async ------------------------------------------------

    def test_close_keeps_the_cache_usable(self, cache):
        cache.set("key", "value")
        cache.close()
        assert cache.get("key") == "value"
        cache.set("key", "after close")
        assert cache.get("key") == "after close"

    def test_cache_middleware_round_trip(self):
        calls = []

        def view(request):
            calls.append(request.path)
            return HttpResponse(f"response #{len(calls)}")

        settings = {
            "CACHES": {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
                       "contract": self.backend_params()},
            "CACHE_MIDDLEWARE_ALIAS": "contract",
            "CACHE_MIDDLEWARE_SECONDS": 30,
            "CACHE_MIDDLEWARE_KEY_PREFIX": "middleware",
        }
        with override_settings(**settings):
            self.prepare(caches["contract"])
            caches["contract"].clear()
            try:
                fetch = FetchFromCacheMiddleware(view)
                update = UpdateCacheMiddleware(view)
                factory = RequestFactory()

                def serve(path):
                    request = factory.get(path)
                    cached = fetch.process_request(request)
                    if cached is not None:
                        return cached
                    return update.process_response(request, view(request))

                first = serve("/page/")
                second = serve("/page/")
                other = serve("/other/")
                assert first.content == b"response #1"
                assert second.content == b"response #1"  # served from the cache
                assert other.content == b"response #2"
                assert calls == ["/page/", "/other/"]
            finally:
                caches["contract"].clear()
                caches["contract"].close()

    def test_async_api(self, cache):
        async def scenario():
            await cache.aset("key", "value")
            assert await cache.aget("key") == "value"
            assert await cache.aadd("key", "other") is False
            assert await cache.aset_many({"a": 1, "b": 2}) == []
            assert await cache.aget_many(["a", "b", "x"]) == {"a": 1, "b": 2}
            assert await cache.ahas_key("a") is True
            assert await cache.aincr("a", 5) == 6
            assert await cache.adecr("a") == 5
            assert await cache.atouch("a") is True
            assert await cache.adelete_many(["a", "b"]) is None
            assert await cache.adelete("key") is True
            assert await cache.aget_or_set("made", "default") == "default"
            assert await cache.aincr_version("made") == 2
            await cache.aclose()
            await cache.aclear()
            assert await cache.aget("made", version=2) is None

        asyncio.run(scenario())
