"""MySQLCache culling: expired rows first, then the entries closest to expiry, never COUNT(*)."""
from __future__ import annotations


import pytest

from django_kvcache.mysql import culling
from django_kvcache.mysql.sql import FOREVER
from tests.mysql_support import (  # noqa: F401  (fixtures)
    cache,
    insert_row,
    make_cache,
    mysql_tables,
    now_ms,
    rows,
    sent_statements,
    sql,
)

pytestmark = pytest.mark.django_db


def culling_cache(max_entries: int, cull_frequency: int, probability: float = 0):
    cache = make_cache(
        OPTIONS={
            "MAX_ENTRIES": max_entries,
            "CULL_FREQUENCY": cull_frequency,
            "CULL_PROBABILITY": probability,
        }
    )
    cache.clear()
    return cache


def live_keys() -> list[str]:
    return [key.removeprefix(":1:") for key, _, _, expires in rows() if expires > now_ms()]


def test_cull_deletes_expired_rows_first(cache):
    for i in range(5):
        insert_row(f":1:expired{i}", b"x", 0, now_ms() - 1000 * (i + 1))
    cache.set_many({"live1": 1, "live2": 2})
    assert cache.cull() == 5
    assert sorted(live_keys()) == ["live1", "live2"]
    assert len(rows()) == 2
    assert cache.cull() == 0


def test_eviction_takes_the_entries_closest_to_expiry_not_key_order(mysql_tables):
    cache = culling_cache(max_entries=6, cull_frequency=3)
    # Key order is the reverse of expiry order: "a" lives longest.
    for index, key in enumerate("abcdefghij"):
        cache.set(key, index, timeout=1000 - index * 10)
    deleted = cache.cull()
    keep = 6 - 6 // 3
    assert deleted == 10 - keep
    assert sorted(live_keys()) == list("abcd")


def test_entries_that_never_expire_go_last_and_ties_split_exactly(mysql_tables):
    cache = culling_cache(max_entries=5, cull_frequency=2)
    cache.set_many({f"forever{i}": i for i in range(8)}, timeout=None)
    cache.set_many({f"bounded{i}": i for i in range(3)}, timeout=600)
    assert cache.cull() == 11 - (5 - 5 // 2)
    survivors = live_keys()
    assert len(survivors) == 3
    assert all(key.startswith("forever") for key in survivors)


def test_nothing_is_evicted_at_exactly_max_entries(mysql_tables):
    cache = culling_cache(max_entries=4, cull_frequency=2)
    cache.set_many({f"k{i}": i for i in range(4)})
    assert cache.cull() == 0
    assert len(live_keys()) == 4


@pytest.mark.parametrize("max_entries", [0, 1, 5])
@pytest.mark.parametrize("cull_frequency", [0, 1, 2, 3, 10])
@pytest.mark.parametrize("entries", [0, 1, 5, 12])
def test_every_limit_combination(mysql_tables, max_entries, cull_frequency, entries):
    cache = culling_cache(max_entries, cull_frequency)
    cache.set_many({f"k{i:02}": i for i in range(entries)}, timeout=None)
    if entries <= max_entries:
        expected = entries
    elif cull_frequency == 0:  # Django's meaning: clear everything
        expected = 0
    else:
        expected = max_entries - max_entries // cull_frequency
    assert cache.cull() == entries - expected
    assert len(rows()) == expected


def test_cull_runs_in_bounded_batches(mysql_tables, monkeypatch):
    cache = culling_cache(max_entries=100, cull_frequency=3)
    for i in range(10):
        insert_row(f":1:old{i}", b"x", 0, now_ms() - 1000)
    monkeypatch.setattr(culling, "FULL_CULL_BATCH_SIZE", 3)
    with sent_statements() as captured:
        assert cache.cull(max_batches=2) == 6
    deletes = [q for q in captured if q.startswith("DELETE")]
    assert len(deletes) == 2 and all(d.endswith("LIMIT 3") for d in deletes)
    assert cache.cull() == 4


def test_cull_never_counts_the_table(mysql_tables):
    cache = culling_cache(max_entries=3, cull_frequency=3)
    cache.set_many({f"k{i}": i for i in range(10)})
    insert_row(":1:old", b"x", 0, now_ms() - 1)
    with sent_statements() as captured:
        cache.cull()
    statements = [q.upper() for q in captured]
    assert statements and not any("COUNT(" in s for s in statements)


def test_write_path_culls_with_the_configured_probability(mysql_tables):
    always = culling_cache(max_entries=5, cull_frequency=5, probability=1)
    for i in range(30):
        always.set(f"k{i}", i)
        assert len(rows()) <= 5 + 1
    never = culling_cache(max_entries=5, cull_frequency=5, probability=0)
    with sent_statements() as captured:
        for i in range(30):
            never.set(f"k{i}", i)
    assert len(captured) == 30
    assert len(rows()) == 30


def test_add_and_set_many_cull_too(mysql_tables):
    cache = culling_cache(max_entries=2, cull_frequency=1, probability=1)
    cache.set_many({"a": 1, "b": 2, "c": 3})
    assert cache.add("d", 4) is True
    assert live_keys() == ["d"]  # three entries were over the limit: all evicted first
    cache.set_many({"e": 5})
    assert live_keys() == ["d", "e"]


def test_a_write_path_cull_is_bounded(mysql_tables, monkeypatch):
    cache = culling_cache(max_entries=1000, cull_frequency=3, probability=1)
    for i in range(25):
        insert_row(f":1:old{i:02}", b"x", 0, now_ms() - 1000)
    monkeypatch.setattr(culling, "BATCH_SIZE", 2)
    cache.set("new", 1)
    assert len(rows()) == 1 + 25 - 2 * culling.WRITE_PATH_BATCHES


def test_culling_an_empty_table(cache):
    assert cache.cull() == 0
    assert culling_cache(0, 0).cull() == 0


def test_forever_rows_are_never_deleted_as_expired(cache):
    cache.set("forever", 1, timeout=None)
    assert cache.cull() == 0
    assert rows()[0][3] == FOREVER


@pytest.mark.parametrize(
    "max_entries, draw, checks",
    [
        (0, 0.999, True),
        (culling.LIMIT_CHECK_ENTRIES, 0.999, True),
        (10 * culling.LIMIT_CHECK_ENTRIES, 0.099, True),
        (10 * culling.LIMIT_CHECK_ENTRIES, 0.1, False),
        (10**9, 0.5, False),
    ],
)
def test_write_path_limit_checks_are_amortised_over_large_limits(max_entries, draw, checks):
    # The check reads up to MAX_ENTRIES index entries: with a large limit it runs on a
    # matching fraction of the culls, so a write's average cost does not grow with it.
    assert culling.draw_limit_check(max_entries, draw) is checks


def test_a_write_path_cull_without_limit_check_still_deletes_expired_rows(mysql_tables):
    cache = culling_cache(max_entries=10**9, cull_frequency=3, probability=1)
    insert_row(":1:old", b"x", 0, now_ms() - 1)
    with sent_statements() as captured:
        cache.set("new", 1)
    assert live_keys() == ["new"] and len(rows()) == 1
    assert not any("OFFSET" in q for q in captured)


def index_used(statement: str, params) -> str:
    (plan,) = sql("EXPLAIN " + statement, params)
    return plan[5]  # EXPLAIN's `key` column


def test_statements_use_the_index_meant_for_them(cache):
    for batch in range(4):
        cache.set_many({f"k{batch}-{i}": i for i in range(500)}, timeout=600 + batch)
    statements = cache.cluster.statements("default")
    now = now_ms()
    assert index_used(statements.delete_expired, (now, 1000)) == "kvcache_expires"
    assert index_used(statements.nth_latest, (100,)) == "kvcache_expires"
    assert index_used(statements.evict_through, (now, now, "k", 1000)) == "kvcache_expires"
    assert index_used(statements.get_many(2), (":1:k1-1", ":1:k2-2")) == "PRIMARY"
    assert index_used(statements.get, (":1:k1-1",)) == "PRIMARY"
    assert index_used(statements.keys_with_prefix, (":1:k1-1%", now)) == "PRIMARY"
    assert index_used(statements.incr, (1, ":1:k1-1", now)) == "PRIMARY"


@pytest.mark.parametrize(
    "max_entries, cull_frequency, survivors",
    [
        (-1, 3, 1),  # Django's tests force a cull this way: every cull empties the table
        (-1, 0, 1),
        (-7, 1, 1),
        (4, -2, 5),  # a negative frequency keeps no more than MAX_ENTRIES (+ the new one)
    ],
)
def test_culling_numbers_set_on_a_live_cache_build_valid_sql(
    mysql_tables, max_entries, cull_frequency, survivors
):
    cache = culling_cache(max_entries=100, cull_frequency=3, probability=1)
    cache.set_many({f"old{i}": i for i in range(6)})
    cache._max_entries, cache._cull_frequency = max_entries, cull_frequency
    cache.set("new", "value")  # culls first, then writes
    assert cache.get("new") == "value"
    assert len(live_keys()) == survivors


def test_max_entries_beyond_what_offset_takes_is_never_reached(mysql_tables):
    cache = culling_cache(max_entries=100, cull_frequency=3)
    cache.set_many({f"old{i}": i for i in range(6)})
    cache._max_entries = 2**70
    assert cache.cull() == 0
    assert len(live_keys()) == 6
