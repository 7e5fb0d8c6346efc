"""The shared KVCache layer: OPTIONS checking, timeouts, corrupt entries, async delegation.

The layer is exercised through a dict-backed subclass that records which sync method
each call reached; the real backends run the same checks in their own test modules.
"""
from __future__ import annotations

import asyncio
import logging

import pytest
from django.core.cache.backends.base import DEFAULT_TIMEOUT, BaseCache
from django.core.exceptions import ImproperlyConfigured

from django_kvcache.base import MISSING, KVCache, unreadable_entries


class RecordingCache(KVCache):
    backend_options = frozenset({"EXTRA"})

    def __init__(self, params):
        super().__init__(params)
        self.data: dict = {}
        self.calls: list[str] = []

    def get(self, key, default=None, version=None):
        self.calls.append("get")
        return self.data.get(self.make_and_validate_key(key, version=version), default)

    def set(self, key, value, timeout=DEFAULT_TIMEOUT, version=None):
        self.calls.append("set")
        self.data[self.make_and_validate_key(key, version=version)] = value

    def add(self, key, value, timeout=DEFAULT_TIMEOUT, version=None):
        self.calls.append("add")
        return self.data.setdefault(self.make_and_validate_key(key, version=version), value) is value

    def get_many(self, keys, version=None):
        self.calls.append("get_many")
        found = {}
        for made, key in self.make_keys(keys, version).items():
            if made in self.data:
                found[key] = self.data[made]
        return found

    def set_many(self, data, timeout=DEFAULT_TIMEOUT, version=None):
        self.calls.append("set_many")
        for key, value in data.items():
            self.data[self.make_and_validate_key(key, version=version)] = value
        return []

    def delete_many(self, keys, version=None):
        self.calls.append("delete_many")

    def has_key(self, key, version=None):
        self.calls.append("has_key")
        return self.make_and_validate_key(key, version=version) in self.data

    def incr(self, key, delta=1, version=None):
        self.calls.append("incr")
        return 99

    def close(self, **kwargs):
        self.calls.append("close")


def make(options=None, **params):
    return RecordingCache({"OPTIONS": options or {}, **params})


@pytest.mark.parametrize(
    "options, message",
    [
        ({"NOPE": 1}, "OPTIONS has unknown keys: NOPE"),
        ({"MAX_ENTRIES": -1}, "MAX_ENTRIES"),
        ({"MAX_ENTRIES": "-1"}, "MAX_ENTRIES"),
        ({"MAX_ENTRIES": "many"}, "MAX_ENTRIES"),
        ({"MAX_ENTRIES": True}, "MAX_ENTRIES"),
        ({"CULL_FREQUENCY": "1.5"}, "CULL_FREQUENCY"),
        ({"COMPRESS_LEVEL": 99}, "COMPRESS_LEVEL"),  # beyond zlib's and zstd's
        ({"SERIALIZER": "nowhere.Serializer"}, "SERIALIZER"),
    ],
)
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        make(options)


def test_backend_options_and_shared_options_are_accepted():
    cache = make({"EXTRA": 1, "MAX_ENTRIES": 10, "COMPRESS_LEVEL": 6})
    assert cache.options["EXTRA"] == 1
    assert cache._max_entries == 10
    assert cache.codec.compressor.level == 6


@pytest.mark.parametrize(
    "timeout", ["ten", "1.5", "", True, [1], float("nan"), float("inf")], ids=repr
)
def test_junk_timeout_setting_is_refused(timeout):
    # Django silently uses 300 seconds for these; a typo should not pass unnoticed.
    with pytest.raises(ImproperlyConfigured, match="TIMEOUT"):
        make(TIMEOUT=timeout)


@pytest.mark.parametrize(
    "setting, expected", [("60", 60), (" 60 ", 60), ("-1", -1), (60.9, 60), (0.5, 0)], ids=repr
)
def test_timeout_setting_is_read_as_django_reads_it(setting, expected):
    assert make(TIMEOUT=setting).default_timeout == expected
    assert BaseCache({"TIMEOUT": setting}).default_timeout == expected  # Django's own reading


def test_numeric_string_culling_settings_are_read_as_django_reads_them():
    cache = make({"MAX_ENTRIES": "30", "CULL_FREQUENCY": "4"})
    assert (cache._max_entries, cache._cull_frequency) == (30, 4)


def test_timeout_rules():
    cache = make(TIMEOUT=60)
    assert cache.timeout_seconds() == 60
    assert cache.timeout_seconds(DEFAULT_TIMEOUT) == 60
    assert cache.timeout_seconds(None) is None
    assert cache.timeout_seconds(0) == 0
    assert cache.timeout_seconds(-5) == -5
    assert cache.timeout_seconds(0.25) == 0.25
    assert make(TIMEOUT=None).timeout_seconds() is None
    with pytest.raises(TypeError):
        cache.timeout_seconds("10")


def test_corrupt_entry_is_a_logged_miss(caplog):
    cache = make()
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert cache.decode(b"garbage", 1, "key:1:x") is MISSING
    assert "corrupt cache entry 'key:1:x'" in caplog.text


def test_a_zstd_entry_where_zstd_is_missing_is_logged_as_unreadable_here_not_corrupt(
    without_zstd, caplog
):
    from tests.zstd_support import ZSTD_ENTRY, ZSTD_ENTRY_FLAGS

    cache = make({"COMPRESSOR": "django_kvcache.codec.ZlibCompressor"})
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert cache.decode(ZSTD_ENTRY, ZSTD_ENTRY_FLAGS, "key:1:z") is MISSING
    assert "cache entry 'key:1:z' read as missing, unreadable here: compressed with zstd" in (
        caplog.text
    )
    assert "corrupt" not in caplog.text


def test_corrupt_entries_do_not_flood_the_log(caplog, monkeypatch):
    # A host without zstd reads every zstd entry as corrupt: thousands a second.
    now = [1000.0]
    monkeypatch.setattr(unreadable_entries, "clock", lambda: now[0])
    cache = make()
    caplog.clear()  # where zstd is missing, making the first cache warned of zlib (once)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        for n in range(500):  # 50 s of them
            assert cache.decode(b"garbage", 1, f"key:1:{n}") is MISSING
            now[0] += 0.1
        assert len(caplog.records) == 1 and "'key:1:0'" in caplog.text
        now[0] = 1000.0 + unreadable_entries.interval
        assert cache.decode(b"garbage", 1, "key:1:last") is MISSING
    assert len(caplog.records) == 2
    assert "500 more cache read failure(s)" in caplog.records[1].getMessage()
    assert "'key:1:last'" in caplog.records[1].getMessage()


def test_each_kind_of_damage_starts_its_own_episode(caplog):
    # Misses of one kind (entries of a compressor this host lacks, say) must not hide the
    # first tampered entry: a bad signature gets its own line at once.
    cache = make({"SERIALIZER": "django_kvcache.codec.SignedPickleSerializer",
                  "SIGNING_KEY": "secret"})
    signed = cache.codec.serializer.flag
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        for n in range(100):
            assert cache.decode(b"x", 999, f"key:1:{n}") is MISSING
        assert cache.decode(b"\0" * 40, signed, "key:1:tampered") is MISSING
        assert cache.decode(b"x", 999, "key:1:more") is MISSING
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert "unknown flags" in messages[0] and "'key:1:0'" in messages[0]
    assert "'key:1:tampered'" in messages[1] and "bad signature" in messages[1]


def test_make_keys_maps_backend_keys_to_caller_keys():
    cache = make(KEY_PREFIX="p", VERSION=3)
    assert cache.make_keys(["a", "b"]) == {"p:3:a": "a", "p:3:b": "b"}
    assert cache.make_keys(iter(["a"]), version=5) == {"p:5:a": "a"}


def test_async_composites_call_the_batched_sync_methods():
    cache = make()

    async def scenario():
        await cache.aset_many({"a": 1, "b": 2})
        found = await cache.aget_many(["a", "b", "c"])
        assert await cache.ahas_key("a") is True
        assert await cache.aincr("a") == 99
        await cache.adelete_many(["a", "b"])
        await cache.aclose()
        return found

    found = asyncio.run(scenario())
    assert found == {"a": 1, "b": 2}
    assert cache.calls == ["set_many", "get_many", "has_key", "incr", "delete_many", "close"]


def test_async_get_or_set_goes_through_sync_get_or_set():
    cache = make()
    assert asyncio.run(cache.aget_or_set("k", 5)) == 5
    assert cache.calls == ["get", "add", "get"]
