"""MemcachedCache operations beyond the shared contract: key rules in bytes, memcached
expiry times, incr/decr edge cases, refused values, corrupt entries, wire compatibility
and the pipelined multi-key paths (checked node by node with plain pymemcache clients)."""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import ExitStack

import pytest
from django.core.cache.backends.base import InvalidCacheKey
from pymemcache.client.base import Client
from pymemcache.serde import compressed_serde

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import ValueTooLarge, protocol
from tests.servers import memcached_node

THIRTY_DAYS = 30 * 24 * 3600
ITEM_SIZE_MAX = 1024 * 1024


@pytest.fixture(scope="module")
def locations():
    with ExitStack() as stack:
        yield [stack.enter_context(memcached_node()).address for _ in range(3)]


@pytest.fixture
def make_cache(locations):
    built = []

    def make(**params):
        cache = MemcachedCache(locations, params)
        built.append(cache)
        return cache

    yield make
    built[0].clear()


@pytest.fixture
def cache(make_cache):
    return make_cache()


def raw_client(cache, key):
    """A plain pymemcache client on the node that owns ``key`` (a backend key)."""
    node = cache._node(key)
    return Client(node.address.server, allow_unicode_keys=True, default_noreply=False)


# --- keys ---------------------------------------------------------------------------------


def test_key_length_counts_utf8_bytes(cache):
    ascii_key = "k" * (250 - len(":1:"))
    cache.set(ascii_key, "fits")
    assert cache.get(ascii_key) == "fits"
    with pytest.raises(InvalidCacheKey, match="250 bytes"):
        cache.set(ascii_key + "k", "too long")
    # 124 characters pass Django's character count but are 251 bytes with ":1:".
    with pytest.raises(InvalidCacheKey, match="250 bytes"):
        cache.get("é" * 124)
    cache.set("é" * 123, "fits")  # 249 bytes
    assert cache.get("é" * 123) == "fits"


def test_key_prefix_and_version_count_towards_the_limit(make_cache):
    cache = make_cache(KEY_PREFIX="p" * 40)
    with pytest.raises(InvalidCacheKey):
        cache.set("k" * 210, 1, version=12)


@pytest.mark.parametrize("key", ["with space", "tab\there", "new\nline", "nul\x00", "del\x7f"])
def test_keys_with_spaces_or_control_characters_are_refused(cache, key):
    for call in (
        lambda: cache.get(key),
        lambda: cache.set(key, 1),
        lambda: cache.get_many(["fine", key]),
        lambda: cache.set_many({"fine": 1, key: 2}),
        lambda: cache.delete_many([key]),
        lambda: cache.incr(key),
    ):
        with pytest.raises(InvalidCacheKey, match="characters"):
            call()
    assert cache.get("fine") is None  # refused before anything was sent


def test_non_ascii_keys_without_spaces_work(cache):
    cache.set_many({"ключ": 1, "鍵": 2, "emoji-😀": 3, "nbsp\u00a0inside": 4})
    assert cache.get_many(["ключ", "鍵", "emoji-😀", "nbsp\u00a0inside"]) == {
        "ключ": 1, "鍵": 2, "emoji-😀": 3, "nbsp\u00a0inside": 4,
    }


# --- expiry -------------------------------------------------------------------------------


def test_expire_times_follow_memcached_rules(make_cache):
    cache = make_cache(TIMEOUT=300)
    assert cache.expire_time() == 300
    assert cache.expire_time(None) == 0
    assert cache.expire_time(0) == -1
    assert cache.expire_time(-20) == -1
    assert cache.expire_time(0.4) == 1  # rounds up: a positive timeout is never "expired"
    assert cache.expire_time(100.2) == 101
    assert cache.expire_time(THIRTY_DAYS) == THIRTY_DAYS
    absolute = cache.expire_time(THIRTY_DAYS + 10)
    assert abs(absolute - (time.time() + THIRTY_DAYS + 10)) < 5
    assert make_cache(TIMEOUT=None).expire_time() == 0


def test_timeout_over_thirty_days_is_stored_as_a_unix_time(cache):
    cache.set("long", "value", timeout=THIRTY_DAYS + 3600)
    assert cache.get("long") == "value"  # sent as seconds it would have expired at once
    ttl = meta_ttl(cache, ":1:long")
    assert THIRTY_DAYS < ttl <= THIRTY_DAYS + 3600 + 2  # memcached's clock ticks coarsely


def meta_ttl(cache, key):
    node = cache._node(key)
    client = node.pool.checkout()
    try:
        return protocol.meta_get(client, key.encode())[2]
    finally:
        node.pool.checkin(client)


# --- incr / decr --------------------------------------------------------------------------


def test_decr_stops_at_zero_like_memcached(cache):
    cache.set("n", 3)
    assert cache.decr("n", 5) == 0
    assert cache.get("n") == 0


def test_negative_values_count_exactly(cache):
    cache.set("n", -5)
    assert cache.incr("n", 2) == -3
    assert cache.decr("n", 10) == -13
    assert cache.incr("n", 20) == 7
    assert cache.get("n") == 7
    assert cache.incr("n", -2) == 5  # a negative delta decrements


def test_counting_past_64_bits(cache):
    cache.set("n", 2**64 - 2)  # beyond int64: stored pickled, counted in Python
    assert cache.incr("n") == 2**64 - 1
    cache.set("m", 5)
    assert cache.incr("m", 2**70) == 2**70 + 5


def test_cas_counting_keeps_the_expiry_time(cache):
    cache.set("n", -1, timeout=100)
    cache.incr("n", 5)
    assert 0 < meta_ttl(cache, ":1:n") <= 100


def test_cas_counting_is_atomic_across_threads(cache):
    cache.set("n", -1000)
    threads = [threading.Thread(target=lambda: [cache.incr("n") for _ in range(40)])
               for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.get("n") == -1000 + 6 * 40


@pytest.mark.parametrize("value", ["12", 3.5, [1], True])
def test_incr_of_non_integers_raises_type_error(cache, value):
    cache.set("v", value)
    with pytest.raises(TypeError):
        cache.incr("v")
    assert cache.get("v") == value


def test_incr_of_missing_key_raises_value_error(cache):
    with pytest.raises(ValueError):
        cache.incr("absent")
    with pytest.raises(ValueError):
        cache.decr("absent")


def test_stored_integers_are_decimal_text_the_server_can_count(cache):
    cache.set("n", 41)
    assert raw_client(cache, ":1:n").get(":1:n") == b"41"
    assert cache.incr("n") == 42


# --- refused values -----------------------------------------------------------------------


def test_refused_set_deletes_the_old_value_and_raises(cache):
    cache.set("key", "old")
    noise = os.urandom(2 * ITEM_SIZE_MAX)  # incompressible
    with pytest.raises(ValueTooLarge, match="too large"):
        cache.set("key", noise)
    assert cache.get("key") is None


def test_refused_set_with_ignore_exceptions_returns_quietly(make_cache, caplog):
    cache = make_cache(OPTIONS={"IGNORE_EXCEPTIONS": True})
    cache.set("key", "old")
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert cache.set("key", os.urandom(2 * ITEM_SIZE_MAX)) is None
    assert cache.get("key") is None
    assert "too large" in caplog.text
    assert sum(node["ignored"] for node in cache.metrics().values()) >= 1


def test_compression_lets_large_values_fit(cache):
    value = "repetitive " * 300_000  # 3.3 MB of text, far below 1 MB compressed
    cache.set("big", value)
    assert cache.get("big") == value


def test_set_many_reports_refused_keys_and_deletes_their_old_values(cache):
    cache.set_many({"small": "old", "big": "old"})
    big = os.urandom(2 * ITEM_SIZE_MAX)
    assert cache.set_many({"small": "new", "big": big, "other": 1}) == ["big"]
    assert cache.get_many(["small", "big", "other"]) == {"small": "new", "other": 1}


# --- corrupt entries and other writers ----------------------------------------------------


def test_corrupt_entry_is_a_logged_miss(cache, caplog):
    raw_client(cache, ":1:bad").set(":1:bad", b"not a pickle", flags=1)
    cache.set("good", "value")
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert cache.get("bad", "default") == "default"
        assert cache.get_many(["bad", "good"]) == {"good": "value"}
    assert "corrupt" in caplog.text
    assert cache.get("good") == "value"  # the connection is still in step


def test_values_are_readable_by_pymemcache_compressed_serde_and_back(cache):
    value = {"text": "compressible " * 500}
    cache.set("shared", value)
    theirs = Client(
        cache._node(":1:shared").address.server, serde=compressed_serde, default_noreply=False
    )
    assert theirs.get(":1:shared") == value
    theirs.set(":1:shared", ["from pymemcache"] * 300)
    assert cache.get("shared") == ["from pymemcache"] * 300
    theirs.close()
    text_writer = Client(
        cache._node(":1:text").address.server, serde=compressed_serde, default_noreply=False
    )
    text_writer.set(":1:text", "plain text")  # flag 16
    assert cache.get("text") == "plain text"
    text_writer.close()


# --- multi-key paths ----------------------------------------------------------------------


def test_set_many_puts_every_key_on_its_own_node(cache):
    data = {f"key-{i}": i for i in range(90)}
    cache.set_many(data)
    holders = {}
    for node in cache._nodes:
        client = Client(node.address.server)
        found = client.get_many([f":1:{key}" for key in data])
        client.close()
        for backend_key in found:
            holders[backend_key] = node.name
    assert len(holders) == 90
    assert set(holders.values()) == {node.name for node in cache._nodes}
    for key in data:
        assert holders[f":1:{key}"] == cache._node(f":1:{key}").name


@pytest.mark.parametrize(
    "value",
    [b"", b"\r\nEND\r\n", b"x\r\nEND", b"VALUE k 0 1\r\n", b"END", b"\r\n" * 50],
)
def test_values_that_look_like_protocol_lines(cache, value):
    cache.set("tricky", value)
    cache.set("after", "next")
    assert cache.get("tricky") == value
    assert cache.get_many(["tricky", "after"]) == {"tricky": value, "after": "next"}


def test_get_many_with_more_keys_than_one_get_line(cache):
    data = {f"key-{i}": f"value-{i}" * (i % 7) for i in range(protocol.GET_KEYS_PER_LINE * 3 + 7)}
    assert cache.set_many(data) == []
    assert cache.get_many([*data, "missing"]) == data
    cache.delete_many(list(data)[:150])
    assert cache.get_many(data) == dict(list(data.items())[150:])


def test_get_many_of_large_values_spanning_many_reads(cache):
    import random

    rng = random.Random(3)
    data = {f"big-{i}": rng.randbytes(300_000) for i in range(8)}
    cache.set_many(data)
    assert cache.get_many(data) == data
    assert cache.get("big-0") == data["big-0"]


def test_clear_flushes_every_node(cache):
    cache.set_many({f"key-{i}": i for i in range(30)})
    cache.clear()
    assert cache.get_many([f"key-{i}" for i in range(30)]) == {}
