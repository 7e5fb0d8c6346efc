"""MySQLCache prefix operations: key order, live entries only, wildcards matched literally."""
from __future__ import annotations

import asyncio
import time
import warnings

import pytest
from django.core.cache.backends.base import CacheKeyWarning

from django_kvcache.mysql.keys import DIGEST_MARKER
from tests.mysql_support import cache, insert_row, make_cache, mysql_tables, rows  # noqa: F401

pytestmark = pytest.mark.django_db

AWKWARD = ["a%b", "a_b", "axb", "a\\b", "a!b", "a!%", "ab", "a", "b"]


def test_keys_with_prefix_lists_caller_keys_in_key_order(cache):
    cache.set_many({"user:2": 2, "user:10": 10, "user:1": 1, "other": 0})
    assert cache.keys_with_prefix("user:") == ["user:1", "user:10", "user:2"]
    assert cache.keys_with_prefix("") == ["other", "user:1", "user:10", "user:2"]
    assert cache.keys_with_prefix("nothing") == []


def test_only_live_entries_of_the_version_are_seen(cache):
    cache.set("user:1", "v1")
    cache.set("user:2", "v2", version=2)
    insert_row(":1:user:old", b"x", 0, int(time.time() * 1000) - 1)
    assert cache.keys_with_prefix("user:") == ["user:1"]
    assert cache.keys_with_prefix("user:", version=2) == ["user:2"]
    assert cache.get_with_prefix("user:", version=2) == {"user:2": "v2"}
    assert cache.delete_with_prefix("user:") == 1
    assert cache.get("user:2", version=2) == "v2"


@pytest.mark.parametrize(
    "prefix, expected",
    [
        ("a%", ["a%b"]),
        ("a_", ["a_b"]),
        ("a\\", ["a\\b"]),
        ("a!", ["a!%", "a!b"]),
        ("a!%", ["a!%"]),
        ("a", ["a", "a!%", "a!b", "a%b", "a\\b", "a_b", "ab", "axb"]),
    ],
)
def test_wildcards_in_prefixes_match_literally(cache, prefix, expected):
    cache.set_many({key: key for key in AWKWARD})
    assert cache.keys_with_prefix(prefix) == expected
    assert cache.get_with_prefix(prefix) == {key: key for key in expected}
    assert cache.delete_with_prefix(prefix) == len(expected)
    assert sorted(cache.get_many(AWKWARD)) == sorted(set(AWKWARD) - set(expected))


@pytest.mark.parametrize("key_prefix", ["p%", "p_", "p\\", "p!"])
def test_wildcards_in_key_prefix_match_literally(mysql_tables, key_prefix):
    mine = make_cache(KEY_PREFIX=key_prefix)
    neighbour = make_cache(KEY_PREFIX="px")
    mine.clear()
    mine.set("k", "mine")
    neighbour.set("k", "neighbour")
    assert mine.keys_with_prefix("") == ["k"]
    assert mine.get_with_prefix("") == {"k": "mine"}
    assert mine.delete_with_prefix("") == 1
    assert neighbour.get("k") == "neighbour"
    mine.clear()


def test_long_keys_are_listed_in_their_digest_form(cache):
    long_key = "long:" + "x" * 300
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheKeyWarning)
        cache.set(long_key, "value")
    (listed,) = cache.keys_with_prefix("long:")
    assert DIGEST_MARKER in listed and long_key.startswith(listed.split(DIGEST_MARKER)[0])
    assert cache.get_with_prefix("long:") == {listed: "value"}
    assert cache.delete_with_prefix("long:") == 1
    assert rows() == []


def test_corrupt_rows_are_skipped(cache):
    cache.set("p:good", 1)
    insert_row(":1:p:bad", b"x", 999, 2**63 - 1)
    assert cache.get_with_prefix("p:") == {"p:good": 1}


def test_prefix_must_be_text(cache):
    with pytest.raises(TypeError):
        cache.keys_with_prefix(None)


@pytest.mark.django_db(transaction=True)  # the async methods run on another thread's connection
def test_async_prefix_operations(cache):
    cache.set_many({"p:1": 1, "p:2": 2})

    async def scenario():
        assert await cache.akeys_with_prefix("p:") == ["p:1", "p:2"]
        assert await cache.aget_with_prefix("p:") == {"p:1": 1, "p:2": 2}
        assert await cache.adelete_with_prefix("p:") == 2

    asyncio.run(scenario())
