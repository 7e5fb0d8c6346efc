"""MemcachedCache operations beyond the shared contract: key rules in bytes, memcached
expiry times, incr/decr edge cases, refused values, corrupt entries, wire compatibility
and the pipelined multi-key paths (checked node by node with plain pymemcache clients)."""
from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import sys
import threading
import time
from contextlib import ExitStack

import pytest
from django.core.cache.backends.base import InvalidCacheKey, memcache_key_warnings
from pymemcache.client.base import Client
from pymemcache.serde import compressed_serde

from django_kvcache.backends.memcached import MemcachedCache, refusals
from django_kvcache.base import unreadable_entries
from django_kvcache.codec import FLAG_INTEGER, FLAG_PICKLE, INT64_MAX
from django_kvcache.memcached import wire
from django_kvcache.memcached.wire import EXPIRED
from django_kvcache.zstd import FLAG_ZSTD, zstd_engine
from tests.memcached_fault_proxy import MemcachedFaultProxy
from tests.codec_support import MAIN_ENTRIES, MAIN_TOKEN, alphanumeric, assert_read_back, html
from tests.servers import MemcachedNode, memcached_node
from tests.zstd_support import ZSTD_ENTRY, ZSTD_ENTRY_FLAGS

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
    return Client(node.pool.address.server, allow_unicode_keys=True, default_noreply=False)


# --- keys ---------------------------------------------------------------------------------


def test_key_length_counts_utf8_bytes(cache):
    ascii_key = "k" * (250 - len(":1:"))
    cache.set(ascii_key, "fits")
    assert cache.get(ascii_key) == "fits"
    with pytest.raises(InvalidCacheKey, match=r"\(longer than 250\)"):
        cache.set(ascii_key + "k", "too long")
    # 124 characters pass Django's character count but are 251 bytes with ":1:".
    with pytest.raises(InvalidCacheKey, match=r"\(longer than 250\)"):
        cache.get("é" * 124)
    cache.set("é" * 123, "fits")  # 249 bytes
    assert cache.get("é" * 123) == "fits"


@pytest.mark.parametrize("key", ["k" * 251, "with space", "nul\x00"])
def test_key_errors_are_djangos_messages_word_for_word(cache, key):
    with pytest.raises(InvalidCacheKey) as refused:
        cache.validate_key(key)
    assert str(refused.value) == next(memcache_key_warnings(key))


def test_key_too_long_in_bytes_only_gets_djangos_wording(cache):
    key = ":1:" + "é" * 124  # Django's check passes it: it counts characters
    assert list(memcache_key_warnings(key)) == []
    with pytest.raises(InvalidCacheKey) as refused:
        cache.validate_key(key)
    assert str(refused.value) == (
        f"Cache key will cause errors if used with memcached: {key!r} (longer than 250)"
    )


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


class PrefixedKeys(MemcachedCache):
    """Keys made its own way, by a subclass's ``make_key``."""

    def make_key(self, key, version=None):
        return "sub-" + super().make_key(key, version=version)


def test_keys_are_djangos_however_they_are_made(make_cache, locations):
    """The usual key is made inline (``make_and_validate_key``); every other way is still
    Django's: another version, a key that is not a str, a KEY_FUNCTION, a subclass's
    ``make_key`` — each checked by memcached's rules all the same."""
    cache = make_cache(KEY_PREFIX="site", VERSION=3)
    assert cache.make_and_validate_key("k") == cache.make_key("k") == "site:3:k"
    assert cache.make_and_validate_key("k", version=5) == "site:5:k"
    assert cache.make_and_validate_key(7) == "site:3:7"
    own = make_cache(KEY_FUNCTION=lambda key, prefix, version: f"own-{key}")
    assert own.make_and_validate_key("k") == "own-k"
    subclass = PrefixedKeys(locations, {})
    assert subclass.make_and_validate_key("k") == "sub-:1:k"
    subclass.set("k", "made by the subclass")
    assert raw_client(subclass, "sub-:1:k").get("sub-:1:k") is not None
    for made in (cache, own, subclass):
        with pytest.raises(InvalidCacheKey, match="characters"):
            made.get("with space")
        with pytest.raises(InvalidCacheKey):
            made.get("k" * 251)


# --- expiry -------------------------------------------------------------------------------


def test_expire_times_follow_memcached_rules(make_cache):
    cache = make_cache(TIMEOUT=300)
    # Whole seconds rounded up, and one more: memcached's clock ticks whole seconds and
    # an item given n lives to the n-th tick, n - 1 to n seconds: n + 1 lives at least n.
    assert cache.expire_time() == 301
    assert cache.expire_time(None) == 0
    assert cache.expire_time(0) == EXPIRED  # a past Unix time: twemproxy refuses -1
    assert cache.expire_time(-20) == EXPIRED
    assert cache.expire_time(0.4) == 2
    assert cache.expire_time(100.2) == 102
    assert cache.expire_time(THIRTY_DAYS - 1) == THIRTY_DAYS
    assert abs(cache.expire_time(THIRTY_DAYS) - (time.time() + THIRTY_DAYS + 1)) < 5
    absolute = cache.expire_time(THIRTY_DAYS + 10)
    assert abs(absolute - (time.time() + THIRTY_DAYS + 10)) < 5
    assert make_cache(TIMEOUT=None).expire_time() == 0
    assert make_cache(TIMEOUT=0).expire_time() == EXPIRED
    # A default over 30 days is a Unix time: worked out at each call, never kept.
    far = make_cache(TIMEOUT=THIRTY_DAYS + 10)
    assert abs(far.expire_time() - (time.time() + THIRTY_DAYS + 10)) < 5


def test_an_entry_lives_at_least_its_timeout_whatever_memcached_s_clock_says(cache):
    """memcached's clock ticks whole seconds: an item sent with exptime 1 is gone at the
    next tick, which may come a microsecond later. Each write here starts just before a
    tick of the server's clock (``stats`` ``time``, waited for), where a one-second
    entry sent as 1 would expire before it is read back."""
    for attempt in range(3):
        key = f"brief-{attempt}"
        node = raw_client(cache, cache.make_key(key))
        start = node.stats()[b"time"]  # the node's clock, in whole seconds
        while node.stats()[b"time"] == start:
            time.sleep(0.002)  # just after a tick: the next is about a second away
        time.sleep(0.97)  # now just before the next tick
        cache.set(key, "kept", timeout=1)
        time.sleep(0.06)  # past it
        assert cache.get(key) == "kept"
        node.close()


def test_timeout_over_thirty_days_is_stored_as_a_unix_time(cache):
    cache.set("long", "value", timeout=THIRTY_DAYS + 3600)
    assert cache.get("long") == "value"  # sent as seconds it would have expired at once
    ttl = meta_ttl(cache, ":1:long")
    assert THIRTY_DAYS < ttl <= THIRTY_DAYS + 3600 + 2  # memcached's clock ticks coarsely


#: memcached reads an expiry time over 30 days as a signed 32-bit Unix time.
LATEST_EXPIRY = 2**31 - 1


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_timeout_beyond_what_memcached_can_date_is_clamped(cache, api):
    """Past 2038 memcached's 32-bit expiry wraps (stored "fine", already expired), and
    from 2**63 s it refuses the command line without reading the value, whose bytes would
    then run as commands. Such timeouts are clamped to the latest time it takes."""
    def call(name, *args, **kwargs):
        if api == "sync":
            return getattr(cache, name)(*args, **kwargs)
        return asyncio.run(getattr(cache, f"a{name}")(*args, **kwargs))

    call("set", "long", "kept", 20 * 365 * 86400)
    assert call("get", "long") == "kept"
    assert cache.ttl("long") > 10 * 365 * 86400
    injected = "a\r\nset :1:victim 1 0 5\r\nI42\n.\r\n"  # a pickled 42, as a command
    call("set", "k", injected, timeout=sys.maxsize)
    assert call("add", "k2", "a\r\nflush_all\r\n", timeout=10**20) is True
    assert call("get", "victim") is None
    assert call("get_many", ["k", "k2", "long"]) == {
        "k": injected, "k2": "a\r\nflush_all\r\n", "long": "kept"}
    call("touch", "long", 10**20)
    assert call("get", "long") == "kept"
    assert call("set_many", {"m": 1}, timeout=sys.maxsize) == []
    assert call("get", "m") == 1
    assert cache.expire_time(20 * 365 * 86400) == LATEST_EXPIRY
    assert cache.expire_time(10**20) == cache.expire_time(float("inf")) == LATEST_EXPIRY


def meta_ttl(cache, key):
    node = cache._node(key)
    return node.call(wire.meta_get(key.encode()))[2]


# --- incr / decr (the results both backends share are in tests/test_counters.py) --------


def test_cas_counting_is_atomic_across_threads(cache):
    cache.set("n", -1000)
    threads = [threading.Thread(target=lambda: [cache.incr("n") for _ in range(40)])
               for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.get("n") == -1000 + 6 * 40


def test_stored_integers_are_decimal_text_the_server_can_count(cache):
    cache.set("n", 41)
    assert raw_client(cache, ":1:n").get(":1:n") == b"41"
    assert cache.incr("n") == 42


def test_overflowing_increments_are_undone_exactly_amid_other_counting(cache):
    # Each incr(INT64_MAX) reaches the server and is undone; the threads counting by one
    # meanwhile may be refused (OverflowError) but whatever succeeds must add up. The
    # counters go on until each has counted its share, and the overflows until both
    # counters are done: how the threads interleave decides how many refusals there are,
    # never whether both kinds counted amid the overflows.
    cache.set("n", 1000)
    wanted = {"incr": 100, "decr": 50}
    succeeded = {"incr": 0, "decr": 0}
    attempts = {"incr": 0, "decr": 0}

    def count(how):
        while succeeded[how] < wanted[how] and attempts[how] < 100 * wanted[how]:
            attempts[how] += 1
            try:
                getattr(cache, how)("n")
            except OverflowError:
                continue
            succeeded[how] += 1  # one thread per kind: no lost updates here

    counters = [
        threading.Thread(target=count, args=("incr",)),
        threading.Thread(target=count, args=("decr",)),  # the compare-and-swap path
    ]
    wrongly_counted = []

    def overflow():
        rounds = 0
        while rounds < 100 or any(thread.is_alive() for thread in counters):
            rounds += 1
            try:
                wrongly_counted.append(cache.incr("n", INT64_MAX))
            except OverflowError:
                pass

    threads = [threading.Thread(target=overflow), threading.Thread(target=overflow), *counters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrongly_counted == []
    assert cache.get("n") == 1000 + succeeded["incr"] - succeeded["decr"]
    assert succeeded == wanted, f"refused too often amid the overflows: {attempts} attempts"


@pytest.fixture
def behind_a_fault_proxy():
    """A strict cache on one memcached node of its own, through a proxy that simulates
    rare answers of memcached's (tests/memcached_fault_proxy.py)."""
    with memcached_node() as node:
        proxy = MemcachedFaultProxy("127.0.0.1", node.port)
        cache = MemcachedCache(proxy.address, {"OPTIONS": {"IGNORE_EXCEPTIONS": False}})
        try:
            yield proxy, cache
        finally:
            cache.close()
            proxy.stop()


def test_a_decrement_never_writes_back_a_value_an_increment_replaced_as_it_was_read(
    behind_a_fault_proxy,
):
    # memcached can answer an mg with an item's old value and the CAS of the item an
    # incr replaced it with: a compare-and-swap from that read would overwrite the
    # increment. Seen as counters off by INT64_MAX amid overflowing increments (the test
    # above), once in a few hundred runs.
    proxy, cache = behind_a_fault_proxy
    cache.set("n", 10)
    proxy.race_next_read(b":1:n", 5)
    assert cache.decr("n") == 14
    assert proxy.races == 1
    assert cache.get("n") == 14


def test_an_undo_memcached_refuses_to_count_is_made_by_compare_and_swap(behind_a_fault_proxy):
    # memcached 1.6.18 can refuse to incr a number of 2**63 or more, the very numbers an
    # overflow's undo counts from: the counter stayed out of range, and every later incr
    # of it raised OverflowError (CI, py311-dj42).
    proxy, cache = behind_a_fault_proxy
    cache.set("n", 1000)
    proxy.refuse_next(b"incr :1:n %d" % (2**64 - INT64_MAX),
                      b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n")
    with pytest.raises(OverflowError):
        cache.incr("n", INT64_MAX)
    assert proxy.refusals == 1
    assert cache.get("n") == 1000
    assert cache.incr("n") == 1001


def test_incr_of_a_corrupt_integer_is_a_logged_miss(cache, caplog):
    raw_client(cache, ":1:bad").set(":1:bad", b"-12abc", flags=FLAG_INTEGER)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"), pytest.raises(ValueError):
        cache.incr("bad")
    assert "corrupt" in caplog.text


# --- refused values -----------------------------------------------------------------------


@pytest.mark.parametrize("ignore_exceptions", [False, True])
@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_refused_value_never_fails_the_call(make_cache, caplog, api, ignore_exceptions):
    """A value memcached refuses (over its item size even compressed) fails no page, with
    or without IGNORE_EXCEPTIONS: ``set`` and ``set_many`` delete the older value, log
    the caller's key (rate-limited) and return; ``add`` returns False and leaves the live
    entry alone. The node answered: nothing counts against it."""
    cache = make_cache(OPTIONS={"IGNORE_EXCEPTIONS": ignore_exceptions})

    def call(name, *args, **kwargs):
        if api == "sync":
            return getattr(cache, name)(*args, **kwargs)
        return asyncio.run(getattr(cache, f"a{name}")(*args, **kwargs))

    refusals.episodes.clear()
    cache.set_many({"key": "old", "kept": "live", "many": "old", "small": "old"})
    noise = os.urandom(2 * ITEM_SIZE_MAX)  # incompressible
    with caplog.at_level(logging.DEBUG, logger="django_kvcache.backends.memcached"):
        assert call("set", "key", noise) is None
        assert call("add", "kept", noise) is False
        assert call("set_many", {"small": "new", "many": noise, "other": 1}) == ["many"]
    assert call("get_many", ["key", "kept", "many", "small", "other"]) == {
        "kept": "live", "small": "new", "other": 1}
    first = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert 1 <= len(first) <= len(cache._nodes), first  # a line per node, then summaries
    for line in first:
        assert line.startswith("memcached node") and "refused the value of '" in line
        assert f" of {cache.cache_name} refused" in line  # the node and its cache
        assert "too large" in line and "Ignored" not in line and ":1:" not in line
    logged = " ".join(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
    for key in ("'key'", "'kept'", "'many'"):  # each by the caller's key, at DEBUG or above
        assert key in logged
    metrics = cache.metrics()
    assert sum(node["errors"] + node["ignored"] for node in metrics.values()) == 0


def test_a_refused_value_that_was_never_stored_logs_its_key_on_a_single_node(make_cache, caplog):
    """set_many's refusals are logged with the caller's key, as set's are."""
    cache = make_cache(OPTIONS={"IGNORE_EXCEPTIONS": False})
    refusals.episodes.clear()
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert cache.set_many({"big": os.urandom(2 * ITEM_SIZE_MAX)}) == ["big"]
    assert "refused the value of 'big'" in caplog.text
    assert "Ignored" not in caplog.text and "':1:big'" not in caplog.text


def test_compression_lets_large_values_fit(cache):
    value = "repetitive " * 300_000  # 3.3 MB of text, far below 1 MB compressed
    cache.set("big", value)
    assert cache.get("big") == value


class DeleteBreaker:
    """A TCP proxy in front of a memcached node; while ``armed`` it drops every connection
    on which a ``delete`` arrives: a node that fails right after refusing a value."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.armed = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.stopping = threading.Event()
        self.acceptor = threading.Thread(target=self.accept, daemon=True)
        self.acceptor.start()

    def accept(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            client.settimeout(None)
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self.pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self.pump, args=(server, client, False), daemon=True).start()

    def pump(self, source: socket.socket, target: socket.socket, from_client: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data or (from_client and self.armed and data.startswith(b"delete ")):
                    break
                target.sendall(data)
        except OSError:
            pass
        for sock in (source, target):  # shutdown wakes the other pump's recv
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.stopping.set()
        self.acceptor.join(timeout=5)
        self.listener.close()


@pytest.fixture
def delete_breaker(locations):
    proxy = DeleteBreaker(locations[0])
    yield proxy
    proxy.close()


def test_set_many_logs_a_failed_clean_up_delete_and_deletes_later(delete_breaker, caplog):
    cache = MemcachedCache([delete_breaker.address], {})
    cache.set("big", "old")
    delete_breaker.armed = True
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        refused = cache.set_many({"small": "new", "big": os.urandom(2 * ITEM_SIZE_MAX)})
    assert refused == ["big"]
    assert f"Could not delete 1 key(s) of {cache.cache_name} after a failed write" in caplog.text
    assert "deleted when their node answers again" in caplog.text
    assert cache.metrics()[delete_breaker.address]["outdated_keys"] == 1
    delete_breaker.armed = False
    assert cache.get_many(["small", "big"]) == {"small": "new"}  # "old" is deleted first
    assert cache.metrics()[delete_breaker.address]["outdated_keys"] == 0
    cache.clear()


# --- logging of ignored failures ----------------------------------------------------------


def test_a_dead_node_logs_a_few_lines_however_many_calls_fail(locations, caplog):
    dead = MemcachedNode()  # a free port nothing listens on, until started below
    retry = 0.2 + random.random() / 1000  # a health record of this test's own
    cache = MemcachedCache(
        [locations[0], dead.address],
        {"OPTIONS": {"IGNORE_EXCEPTIONS": True, "RETRY_TIMEOUT": retry}},
    )
    key = next(
        key for key in (f"k{i}" for i in range(1000))
        if cache._home(cache.make_key(key)).name == dead.address
    )
    try:
        with caplog.at_level(logging.INFO, logger="django_kvcache"):
            for _ in range(500):
                assert cache.get(key, "default") == "default"
            assert cache.metrics()[dead.address]["ignored"] == 500
            assert "Ignored memcached failure" in caplog.text
            dead.start()
            deadline = time.monotonic() + 10
            while cache.metrics()[dead.address]["down"] and time.monotonic() < deadline:
                cache.get(key)  # ignored until the retry time is up, then the probe
                time.sleep(0.02)
    finally:
        dead.kill()
    lines = [record.getMessage() for record in caplog.records]
    # Our first line and end line, the health's "down" and "back up", maybe a summary.
    assert len(lines) <= 5, lines
    ignored = cache.metrics()[dead.address]["ignored"]
    assert (f"node {dead.address} of {cache.cache_name} answers again: {ignored} failure(s) "
            "ignored") in caplog.text


# --- corrupt entries and other writers ----------------------------------------------------


def test_corrupt_entry_is_a_logged_miss(cache, caplog):
    raw_client(cache, ":1:bad").set(":1:bad", b"not a pickle", flags=1)
    cache.set("good", "value")
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert cache.get("bad", "default") == "default"
        assert caplog.text.count("corrupt") == 1
        unreadable_entries.episodes.clear()  # else summarized with the first, later
        assert cache.get_many(["bad", "good"]) == {"good": "value"}
    assert caplog.text.count("corrupt") == 2
    assert cache.get("good") == "value"  # the connection is still in step


def test_a_zstd_entry_where_zstd_is_missing_is_a_miss_that_says_why(
    make_cache, without_zstd, caplog
):
    # Written by a host with zstd, read by one without (a rolling deploy): never a wrong
    # value, one warning for all such entries, and the key can be written again.
    cache = make_cache(OPTIONS={"COMPRESSOR": "django_kvcache.codec.ZlibCompressor"})
    raw_client(cache, ":1:z").set(":1:z", ZSTD_ENTRY, flags=ZSTD_ENTRY_FLAGS)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert cache.get("z", "default") == "default"
        assert cache.get_many(["z"]) == {}
        assert asyncio.run(cache.aget("z", "default")) == "default"  # the asyncio path
        assert asyncio.run(cache.aget_many(["z"])) == {}
    assert caplog.text.count("compressed with zstd, which is not installed here") == 1
    cache.set("z", "written here")
    assert cache.get("z") == "written here"


def test_values_are_readable_by_pymemcache_compressed_serde_and_back(make_cache):
    # pymemcache decompresses zlib (flag 8) only, and only with compressed_serde (Django's
    # PyMemcacheCache uses pickle_serde, hence COMPRESSOR None there: docs/memcached.rst).
    cache = make_cache(OPTIONS={"COMPRESSOR": "django_kvcache.codec.ZlibCompressor"})
    value = {"text": "compressible " * 500}
    cache.set("shared", value)
    theirs = Client(
        cache._node(":1:shared").pool.address.server, serde=compressed_serde, default_noreply=False
    )
    assert theirs.get(":1:shared") == value
    theirs.set(":1:shared", ["from pymemcache"] * 300)
    assert cache.get("shared") == ["from pymemcache"] * 300
    theirs.close()
    text_writer = Client(
        cache._node(":1:text").pool.address.server, serde=compressed_serde, default_noreply=False
    )
    text_writer.set(":1:text", "plain text")  # flag 16
    assert cache.get("text") == "plain text"
    text_writer.close()


def test_pymemcache_reads_our_zstd_values_as_misses_never_as_wrong_values(cache):
    if cache.codec.compressor is None or cache.codec.compressor.flag != FLAG_ZSTD:
        pytest.skip("the default compressor is zlib here (zstd not installed)")
    cache.set("zstd", {"text": "compressible " * 500})
    theirs = Client(
        cache._node(":1:zstd").pool.address.server, serde=compressed_serde, default_noreply=False
    )
    try:
        assert theirs.get(":1:zstd") is None  # flag 1024 is not theirs: the unpickle fails
    finally:
        theirs.close()


# --- multi-key paths ----------------------------------------------------------------------


def test_set_many_puts_every_key_on_its_own_node(cache):
    data = {f"key-{i}": i for i in range(90)}
    cache.set_many(data)
    holders = {}
    for node in cache._nodes:
        client = Client(node.pool.address.server)
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
    data = {f"key-{i}": f"value-{i}" * (i % 7) for i in range(wire.GET_KEYS_PER_LINE * 3 + 7)}
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


def test_incr_on_an_unreachable_node_as_documented():
    """docs/memcached.rst, "incr and decr": ours raises ValueError under IGNORE_EXCEPTIONS
    (Django's contract: the new value or ValueError); Django's PyMemcacheCache returns
    False with ignore_exc, and without it raises the connection error once, then returns
    False while pymemcache keeps the node out — never ValueError."""
    from django.core.cache.backends.memcached import PyMemcacheCache

    from tests.servers import free_port

    dead = f"127.0.0.1:{free_port()}"
    ours = MemcachedCache(dead, {"OPTIONS": {"IGNORE_EXCEPTIONS": True}})
    for _ in range(3):
        with pytest.raises(ValueError):
            ours.incr("n")
    ignoring = PyMemcacheCache(dead, {"OPTIONS": {"ignore_exc": True}})
    assert [ignoring.incr("n") for _ in range(3)] == [False] * 3
    assert [ignoring.decr("n") for _ in range(3)] == [False] * 3
    strict = PyMemcacheCache(dead, {})
    with pytest.raises(ConnectionRefusedError):
        strict.incr("n")
    assert strict.incr("n") is False


# --- values compression does not pay for are stored as they are ----------------------------


def stored_flags(cache, key):
    """The client flags memcached holds for ``key`` (a backend key)."""
    reply = raw_client(cache, key).raw_command(f"get {key}".encode(), b"END\r\n")
    return int(reply.split(b"\r\n", 1)[0].split()[2])


def test_what_does_not_save_the_threshold_is_stored_as_it_is(make_cache):
    """Random bytes save nothing; a token a fifth, over this backend's default of a tenth
    (memory is what memcached lacks) and under a quarter."""
    values = {"noise": random.Random(5).randbytes(2000), "token": alphanumeric(2000),
              "page": html()}
    compressed = FLAG_PICKLE | make_cache().codec.compressor.flag
    for threshold, token_flags in ((None, compressed), (0.25, FLAG_PICKLE)):
        cache = make_cache(OPTIONS={} if threshold is None else {"COMPRESS_MIN_SAVING": threshold})
        cache.set("noise", values["noise"])
        cache.set_many({"token": values["token"], "page": values["page"]})
        assert stored_flags(cache, ":1:noise") == FLAG_PICKLE
        assert stored_flags(cache, ":1:token") == token_flags
        assert stored_flags(cache, ":1:page") == compressed
        assert_read_back(cache, values)


@pytest.mark.parametrize("data, flags", MAIN_ENTRIES, ids=["zstd", "zlib"])
def test_entries_mains_code_compressed_read_back(cache, data, flags):
    if flags & FLAG_ZSTD and zstd_engine() is None:
        pytest.skip("zstd not installed (a backend extra brings it)")
    raw_client(cache, ":1:old").set(":1:old", data, flags=flags)
    assert_read_back(cache, {"old": MAIN_TOKEN})
