"""Two MySQLCache caches on one table: ``clear()`` of one leaves the other's entries."""
from __future__ import annotations

import pytest
from django.core.cache import CacheKeyWarning

from tests.mysql_support import (  # noqa: F401  (fixtures)
    cache,
    insert_row,
    make_cache,
    mysql_tables,
    now_ms,
    rows,
)

pytestmark = pytest.mark.django_db


def stored_keys() -> list[str]:
    return [key for key, *_ in rows()]


def test_clear_with_a_key_prefix_deletes_only_that_prefix_in_every_version(cache):
    first = make_cache(KEY_PREFIX="first")
    second = make_cache(KEY_PREFIX="second")
    first.set("a", 1)
    first.set("a", 2, version=7)
    with pytest.warns(CacheKeyWarning):
        first.set("long" * 100, 3)  # stored in its digest form, which keeps the prefix
    insert_row("first:1:expired", b"x", 0, now_ms() - 1000)
    second.set_many({"a": 1, "b": 2})
    first.clear()
    assert stored_keys() == ["second:1:a", "second:1:b"]
    assert second.get_many(["a", "b"]) == {"a": 1, "b": 2}


@pytest.mark.parametrize("prefix, other", [("a_", "ab"), ("a%", "abc"), ("a!", "a!!")])
def test_clear_prefix_matches_literally(cache, prefix, other):
    """``_`` and ``%`` are no wildcards, ``!`` (the escape character) is itself."""
    mine = make_cache(KEY_PREFIX=prefix)
    theirs = make_cache(KEY_PREFIX=other)
    mine.set("k", 1)
    theirs.set("k", 2)
    mine.clear()
    assert stored_keys() == [f"{other}:1:k"]


def test_clear_without_a_key_prefix_empties_the_table(cache):
    make_cache(KEY_PREFIX="other").set("a", 1)
    cache.set("b", 2)
    cache.clear()  # Django's DatabaseCache.clear(): every row
    assert stored_keys() == []


def test_clear_with_another_key_function_empties_the_table(cache):
    custom = make_cache(KEY_PREFIX="custom", KEY_FUNCTION=lambda key, prefix, version: f"{key}")
    make_cache(KEY_PREFIX="other").set("a", 1)
    custom.set("b", 2)
    custom.clear()  # where its keys are is unknown: every row, as Django does
    assert stored_keys() == []
