"""incr/decr give the same answers on both backends: signed 64-bit counters.

One suite, run on MySQLCache (the test database) and on MemcachedCache (nodes of this
module's own). Every result that fits a signed 64-bit integer is returned and stored,
negative ones included; anything beyond raises ``OverflowError`` and leaves the value as
it was. memcached's own ``incr`` counts modulo 2**64 and its ``decr`` stops at 0: none
of that may show through.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
from django.core.cache.backends.base import BaseCache

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.codec import INT64_MAX, INT64_MIN
from django_kvcache.memcached import wire
from django_kvcache.mysql.sql import FOREVER
from tests.mysql_support import cache, mysql_tables, now_ms, rows  # noqa: F401  (fixtures)

DAY = 24 * 3600


@dataclass
class Backend:
    cache: BaseCache
    #: Seconds the entry of a caller's key has left; None if it never expires.
    remaining_ttl: Callable[[str], float | None]


def mysql_backend(request: pytest.FixtureRequest) -> Backend:
    mysql_cache = request.getfixturevalue("cache")

    def remaining_ttl(key: str) -> float | None:
        (expires,) = [row[3] for row in rows() if row[0] == mysql_cache.make_key(key)]
        return None if expires == FOREVER else (expires - now_ms()) / 1000

    return Backend(mysql_cache, remaining_ttl)


def memcached_backend(request: pytest.FixtureRequest) -> Backend:
    memcached = MemcachedCache(request.getfixturevalue("private_memcached_nodes"), {})
    memcached.clear()
    request.addfinalizer(memcached.clear)

    def remaining_ttl(key: str) -> float | None:
        key = memcached.make_key(key)
        node = memcached._node(key)
        ttl = node.call(wire.meta_get(key.encode()))[2]
        return wire.seconds_left(ttl)

    return Backend(memcached, remaining_ttl)


@pytest.fixture(params=[mysql_backend, memcached_backend], ids=["mysql", "memcached"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param(request)


@pytest.fixture
def counters(backend: Backend) -> BaseCache:
    return backend.cache


def add(cache: BaseCache, how: str, key: str, delta: int) -> int:
    """``incr(key, delta)``, or the same through ``decr(key, -delta)``."""
    return cache.incr(key, delta) if how == "incr" else cache.decr(key, -delta)


BOTH_WAYS = pytest.mark.parametrize("how", ["incr", "decr"])


# --- results in range: exact, negative ones included --------------------------------------


@BOTH_WAYS
@pytest.mark.parametrize(
    "start, delta, result",
    [
        (41, 1, 42),
        (3, -5, -2),  # below zero, where memcached's decr would stop at 0
        (5, -5, 0),
        (-5, 3, -2),  # a negative value, which memcached's incr refuses
        (-5, 10, 5),
        (7, 0, 7),
        (-7, 0, -7),
        (INT64_MAX - 1, 1, INT64_MAX),
        (INT64_MIN + 1, -1, INT64_MIN),
        (0, INT64_MAX, INT64_MAX),  # the largest delta the server's incr is given
        (INT64_MAX, -INT64_MAX, 0),
        (-5, 2**63, INT64_MAX - 4),  # a delta beyond int64 whose result fits
        (INT64_MIN, 2**64 - 1, INT64_MAX),
        (INT64_MAX, -(2**64) + 1, INT64_MIN),
        (INT64_MIN, INT64_MAX, -1),
    ],
)
def test_results_in_the_signed_64_bit_range_are_exact(counters, how, start, delta, result):
    counters.set("n", start)
    assert add(counters, how, "n", delta) == result
    assert counters.get("n") == result


def test_counting_goes_on_from_a_negative_value(counters):
    counters.set("n", 3)
    assert counters.decr("n", 5) == -2
    assert counters.incr("n", 2) == 0
    assert counters.incr("n", 2) == 2
    assert counters.decr("n", 4) == -2


# --- results out of range: OverflowError, value unchanged ---------------------------------


def test_the_wraps_of_memcached_s_own_incr_raise_instead(counters):
    counters.set("n", INT64_MAX)
    with pytest.raises(OverflowError):
        counters.incr("n", 2**63)  # memcached's incr gave 2**64 - 1 ...
    with pytest.raises(OverflowError):
        counters.incr("n", 1)  # ... and then 0
    assert counters.get("n") == INT64_MAX
    counters.set("m", 10)
    with pytest.raises(OverflowError):
        counters.incr("m", 2**64 - 5)  # memcached's incr gave 5
    assert counters.get("m") == 10


@BOTH_WAYS
@pytest.mark.parametrize(
    "start, delta",
    [
        (INT64_MAX, 1),
        (INT64_MIN, -1),
        (1, INT64_MAX),  # the server's incr does not wrap, the result is too large
        (INT64_MAX, INT64_MAX),
        (0, 2**63),
        (0, 2**64),
        (5, 2**70),
        (-1, -(2**63)),
        (0, -(2**70)),
    ],
)
def test_results_out_of_range_raise_overflow_error_and_keep_the_value(
    counters, how, start, delta
):
    counters.set("n", start)
    with pytest.raises(OverflowError, match="signed 64-bit range"):
        add(counters, how, "n", delta)
    assert counters.get("n") == start
    assert counters.incr("n", 0) == start  # still a counter


# --- errors -------------------------------------------------------------------------------


@BOTH_WAYS
@pytest.mark.parametrize("delta", [1, -1, 0, 2**70, -(2**70)])
def test_missing_key_raises_value_error(counters, how, delta):
    with pytest.raises(ValueError, match="not found"):
        add(counters, how, "missing", delta)
    assert counters.get("missing", "absent") == "absent"


@BOTH_WAYS
@pytest.mark.parametrize("value", ["12", 1.5, True, b"7", [1], 2**64, -(2**63) - 1])
@pytest.mark.parametrize("delta", [1, -1, 0, 2**70])
def test_non_integer_value_raises_type_error(counters, how, value, delta):
    counters.set("v", value)
    with pytest.raises(TypeError):
        add(counters, how, "v", delta)
    assert counters.get("v") == value


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.incr("n", True),
        lambda c: c.decr("n", True),  # -True is -1: checked before negating
        lambda c: c.incr("n", 1.0),
        lambda c: c.decr("n", 1.5),
    ],
)
def test_bool_or_float_delta_raises_type_error(counters, call):
    counters.set("n", 5)
    with pytest.raises(TypeError):
        call(counters)
    assert counters.get("n") == 5


# --- expiry -------------------------------------------------------------------------------


@BOTH_WAYS
@pytest.mark.parametrize("start, delta", [(1, 5), (-1, 5), (5, -1), (5, 2**63)])
def test_counting_keeps_the_remaining_lifetime(backend, how, start, delta):
    counters = backend.cache
    counters.set("n", start, timeout=100)
    try:
        add(counters, how, "n", delta)
    except OverflowError:
        pass  # (5, 2**63): the failed attempt must not touch the lifetime either
    assert 90 < backend.remaining_ttl("n") <= 100


@pytest.mark.parametrize("timeout, expected", [(60 * DAY, 60 * DAY), (None, None)])
def test_counting_keeps_long_and_endless_lifetimes(backend, timeout, expected):
    counters = backend.cache
    counters.set("n", -5, timeout=timeout)  # negative: memcached computes it in Python
    assert counters.incr("n") == -4
    for _ in range(10):  # the lifetime must not creep with each update
        counters.decr("n")
    assert counters.get("n") == -14
    remaining = backend.remaining_ttl("n")
    if expected is None:
        assert remaining is None
    else:  # memcached's clock lags ours by up to 2 s, once, when set() sends a Unix time
        assert expected - 60 < remaining <= expected + 3


# --- messages: the same words on both backends, naming the caller's key -------------------


@BOTH_WAYS
@pytest.mark.parametrize("delta", [1, 2**70, -(2**70)])
def test_a_missing_key_is_named_as_the_caller_wrote_it(counters, how, delta):
    with pytest.raises(ValueError) as raised:
        add(counters, how, "missing", delta)
    assert str(raised.value) == "Key 'missing' not found"


def test_a_missing_key_of_another_version_names_the_version(counters):
    counters.set("v1", 1)  # at the default version
    with pytest.raises(ValueError) as raised:
        counters.incr("v1", version=3)
    assert str(raised.value) == "Key 'v1' (version 3) not found"
    with pytest.raises(ValueError) as raised:
        counters.decr("v1", version=3)
    assert str(raised.value) == "Key 'v1' (version 3) not found"
    with pytest.raises(ValueError) as raised:
        counters.incr_version("v1", version=3)
    assert str(raised.value) == "Key 'v1' (version 3) not found"
    with pytest.raises(ValueError) as raised:
        counters.incr_version("nothing")
    assert str(raised.value) == "Key 'nothing' not found"


def test_async_counters_say_the_same(counters):
    import asyncio

    async def missing() -> str:
        try:
            await counters.aincr("missing", version=2)
        except ValueError as exc:
            return str(exc)
        return "no error"

    assert asyncio.run(missing()) == "Key 'missing' (version 2) not found"


@pytest.mark.parametrize("start, delta", [(INT64_MAX, 1), (INT64_MIN, -1), (0, 2**70)])
def test_overflow_and_type_errors_name_the_callers_key(counters, start, delta):
    counters.set("n", start)
    with pytest.raises(OverflowError) as raised:
        counters.incr("n", delta)
    assert str(raised.value) == (
        f"Adding {delta} to key 'n' leaves the signed 64-bit range; value unchanged")
    counters.set("s", "text")
    with pytest.raises(TypeError) as raised:
        counters.incr("s", delta)
    assert str(raised.value) == "The value of key 's' is not an integer"
