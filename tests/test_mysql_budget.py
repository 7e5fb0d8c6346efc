"""OPTIONS["MAX_SIZE"]: a MySQLCache table kept under a byte budget on real MariaDB.

What a table holds is measured here with SQL (``SUM(LENGTH(cache_key) + LENGTH(value))``),
never with the size table the cache itself reads, so each test checks the totals too.
"""
from __future__ import annotations

import random
from typing import Any, Iterator

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test.utils import override_settings

from django_kvcache import stats
from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.checks import check_mysql_cache_tables
from django_kvcache.mysql import budget
from tests.mysql_support import BACKEND, drop_table, make_cache, sql

TABLE = "kvcache_budget"
SHARDS = list(settings.SHARD_ALIASES)
MB = 10**6

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", *SHARDS])


def stored(table: str = TABLE, alias: str = "default") -> tuple[int, int]:
    """What ``table`` holds, summed by the server: (bytes of keys and values, rows)."""
    found = sql(f"SELECT COALESCE(SUM(LENGTH(`cache_key`) + LENGTH(`value`)), 0), COUNT(*) "
                f"FROM `{table}`", alias=alias)
    return int(found[0][0]), int(found[0][1])


def counted(table: str = TABLE, alias: str = "default") -> tuple[int, int]:
    """What the size table says ``table`` holds."""
    return budget.server_totals(alias, table)


def drop(table: str = TABLE, aliases: tuple[str, ...] = ("default",)) -> None:
    for alias in aliases:
        drop_table(table, alias)
        drop_table(budget.size_table(table), alias)


@pytest.fixture
def table() -> Iterator[str]:
    drop()
    yield TABLE
    drop()


def sizes(rng: random.Random, low: int, high: int) -> Iterator[int]:
    """Sizes spread evenly over orders of magnitude from ``low`` to ``high`` bytes."""
    while True:
        yield int(low * (high / low) ** rng.random())


# --- the option -------------------------------------------------------------------------------

@pytest.mark.parametrize("value, size", [
    (None, None), (4096, 4096), ("4096", 4096), ("20GB", 20 * 10**9), ("512MB", 512 * MB),
    ("1.5GiB", 3 * 2**29), ("64 KiB", 65536), ("10kb", 10_000), (2e9, 2 * 10**9),
])
def test_max_size_reads_bytes_and_sizes(value, size):
    assert budget.max_size({"MAX_SIZE": value}) == size


@pytest.mark.parametrize("value", [0, -1, "0MB", "20XB", "GB", "ten", True, [1], float("inf"),
                                   "1e9", 0.5])
def test_a_bad_max_size_names_the_cache_and_the_option(value):
    with pytest.raises(ImproperlyConfigured) as raised:
        MySQLCache("kvcache_budget_bad", {"OPTIONS": {"MAX_SIZE": value}})
    message = str(raised.value)
    assert "MySQLCache with LOCATION 'kvcache_budget_bad'" in message
    assert "OPTIONS['MAX_SIZE'] must be" in message and repr(value) in message
    entry = {"OPTIONS": {"MAX_SIZE": value}}
    with override_settings(CACHES={
        "bounded": {"BACKEND": BACKEND, "LOCATION": "kvcache_budget_bad", **entry}
    }):
        with pytest.raises(ImproperlyConfigured) as raised:
            MySQLCache("kvcache_budget_bad", entry)
    assert str(raised.value).startswith("CACHES['bounded']['OPTIONS']['MAX_SIZE'] must be")


def test_shares_split_the_budget_by_weight():
    assert budget.shares(900, [1.0, 1.0, 1.0]) == [300, 300, 300]
    assert budget.shares(900, [2.0, 1.0]) == [600, 300]
    assert budget.shares(None, [1.0, 1.0]) == [None, None]


def test_max_size_alone_is_the_only_bound_and_max_entries_applies_when_set(table):
    """Django's default MAX_ENTRIES (300) does not cap a cache bounded by MAX_SIZE."""
    budgeted = make_cache(table, OPTIONS={"MAX_SIZE": "20GB", "CULL_PROBABILITY": 1})
    budgeted.set_many({f"n{i}": i for i in range(400)})
    budgeted.set("one-more", 1)  # a write-path cull, drawn with probability 1
    budgeted.cull()
    assert stored(table)[1] == 401
    both = MySQLCache(table, {"OPTIONS": {"MAX_SIZE": "20GB", "MAX_ENTRIES": 300}})
    both.cull()
    assert stored(table)[1] <= 300


# --- the totals -------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    {},
    {"COMPRESS_MIN_LENGTH": 100},
    {"ENCRYPTION_KEYS": ["the budget tests' key, 41 characters long"]},
], ids=["plain", "compressed", "encrypted"])
def test_the_totals_follow_every_operation_exactly(table, options):
    cache = make_cache(table, OPTIONS={"MAX_SIZE": "10MB", **options})
    cache.set("a", "x" * 5000)
    cache.set("a", "y" * 300)  # overwritten: the difference
    cache.set_many({f"m{i}": "é" * i for i in range(20)})
    cache.add("b", b"\x00" * 999)
    cache.add("b", b"ignored")
    cache.set("n", 5)
    cache.incr("n", 123456)
    cache.touch("m3", 60)
    cache.delete("m4")
    cache.delete_many(["m5", "m6", "missing"])
    cache.set("gone", 1, timeout=0)
    cache.get_or_set("c", lambda: "z" * 70000)
    sql(f"DELETE FROM `{table}` WHERE `cache_key` LIKE %s", [":1:m1%"])  # behind its back
    assert counted(table) == stored(table) != (0, 0)
    cache.clear()
    assert counted(table) == stored(table) == (0, 0)


def test_compression_and_encryption_count_stored_bytes(table):
    cache = make_cache(table, OPTIONS={"MAX_SIZE": MB, "COMPRESS_MIN_LENGTH": 100,
                                       "ENCRYPTION_KEYS": ["the budget tests' key, 41 chars"]})
    text = "compressible " * 20_000  # 260 kB each, 5.2 MB in all: a few hundred bytes stored
    for i in range(20):
        cache.set(f"t{i}", text)
    assert stored(table)[0] < MB
    assert all(cache.get(f"t{i}") == text for i in range(20))  # nothing evicted


# --- holding the budget ---------------------------------------------------------------------

def test_a_stream_of_three_budgets_leaves_the_table_at_its_budget(table):
    limit = 16 * MB
    cache = make_cache(table, OPTIONS={"MAX_SIZE": "16MB"})
    rng = random.Random(41)
    written, samples, last = 0, [], []
    for i, size in enumerate(sizes(rng, 100, MB)):
        value = rng.randbytes(size)
        cache.set(f"k{i}", value, timeout=3600)
        written += size
        last = (last + [(f"k{i}", value)])[-5:]
        if i % 10 == 0:
            samples.append(stored(table)[0])
        if written >= 3 * limit:
            break
    final = stored(table)
    assert max(samples + [final[0]]) <= 1.2 * limit, samples
    assert 0.9 * limit <= final[0] <= 1.1 * limit, final
    assert counted(table) == final
    for key, value in last:
        assert cache.get(key) == value


def test_the_entries_closest_to_expiry_go_first(table):
    cache = make_cache(table, OPTIONS={"MAX_SIZE": 100_000})
    for i in range(20):  # 10 kB each; the later ones expire sooner
        cache.set(f"e{i:02}", random.randbytes(10_000), timeout=10_000 - i * 100)
    gone = [i for i in range(20) if cache.get(f"e{i:02}") is None]
    kept = [i for i in range(20) if i not in gone]
    assert stored(table)[0] <= 100_000
    assert gone and min(gone) > max(kept[:-1])  # the last write always stays


def test_kvcache_cull_brings_a_table_under_a_new_budget(table):
    unbounded = make_cache(table)
    # 2 MB, written before the cache had a budget: no size table yet
    unbounded.set_many({f"u{i}": random.randbytes(50_000) for i in range(40)})
    bounded = MySQLCache(table, {"OPTIONS": {"MAX_SIZE": 500_000, "CULL_PROBABILITY": 0}})
    assert bounded.missing_tables("default") == [budget.size_table(table)]
    bounded.create_table()  # the upgrade: size table, totals of the rows there, triggers
    assert bounded.missing_tables("default") == []
    assert counted(table) == stored(table)
    assert bounded.cull() > 0
    assert 0.9 * 500_000 <= stored(table)[0] <= 500_000
    assert counted(table) == stored(table)


def test_writes_go_on_while_the_size_table_is_missing(table, caplog):
    make_cache(table).set("x", 1)  # a table from before MAX_SIZE
    bounded = MySQLCache(table, {"OPTIONS": {"MAX_SIZE": 1000, "CULL_PROBABILITY": 0}})
    bounded.set("big", random.randbytes(5000))  # draws a check: it fails, logged
    assert bounded.get("big") is not None and bounded.get("x") == 1
    assert budget.size_table(table) in caplog.text


def test_the_system_check_reports_a_budget_without_its_size_table(table):
    make_cache(table).set("x", 1)
    entry = {"BACKEND": BACKEND, "LOCATION": table, "OPTIONS": {"MAX_SIZE": "1MB"}}
    with override_settings(CACHES={"default": entry}):
        warnings = [m for m in check_mysql_cache_tables(databases=["default"])
                    if m.id == "kvcache.W001"]
        assert [m.msg for m in warnings] == [
            f"The table '{budget.size_table(table)}' of cache 'default' does not exist in "
            "database 'default'."]
        assert "kvcache_createtable default" in warnings[0].hint
        make_cache(table, OPTIONS={"MAX_SIZE": "1MB"})  # creates what is missing
        assert check_mysql_cache_tables(databases=["default"]) == []
        sql(f"DROP TRIGGER `{budget.trigger_names(table)[2]}`")  # a trigger lost: missing
        assert [m.id for m in check_mysql_cache_tables(databases=["default"])] == ["kvcache.W001"]


def test_figures_show_the_budget_and_what_the_table_holds(table):
    entry = {"BACKEND": BACKEND, "LOCATION": table,
             "OPTIONS": {"MAX_SIZE": 200_000, "CULL_PROBABILITY": 0}}
    with override_settings(CACHES={"default": entry}):
        cache = make_cache(table, OPTIONS=entry["OPTIONS"])
        for i in range(10):
            cache.set(f"f{i}", random.randbytes(30_000))
        size, rows = stored(table)
        server = stats.server_figures("default")["default"]
        assert (server["max_size"], server["stored_bytes"], server["stored_entries"]) == (
            200_000, size, rows)
        shard = cache.metrics()["shards"]["default"]
        assert shard["max_size"] == 200_000
        assert 0 < shard["stored_bytes"] <= 200_000  # as the last check read it
        pytest.importorskip("prometheus_client")  # the prometheus extra
        from django_kvcache.prometheus import KVCacheCollector

        exported = {(sample.name, sample.labels["node"]): sample.value
                    for family in KVCacheCollector().collect() for sample in family.samples
                    if sample.labels.get("cache") == "default"}
        assert exported["kvcache_max_size", "default"] == 200_000
        assert exported["kvcache_stored_bytes", "default"] == shard["stored_bytes"]


@pytest.mark.skipif(len(SHARDS) < 3, reason="needs KVCACHE_MYSQL_SHARD_PORTS (two ports)")
def test_shards_split_the_budget_and_each_holds_its_share():
    aliases = tuple(SHARDS)
    drop(aliases=aliases)
    try:
        limit = 3 * MB
        cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASES": list(aliases), "MAX_SIZE": limit,
                                               "CULL_PROBABILITY": 0}})
        cache.create_table()
        share = limit // len(aliases)
        assert cache.max_sizes == (share,) * len(aliases)
        rng, written, i = random.Random(42), 0, 0
        draw = sizes(rng, 100, 64_000)
        while written < 3 * limit:
            batch = {f"s{i + j}": rng.randbytes(next(draw)) for j in range(20)}
            cache.set_many(batch, timeout=3600)
            written += sum(map(len, batch.values()))
            i += 20
        held = {alias: stored(TABLE, alias) for alias in aliases}
        for alias, (size, _) in held.items():
            assert 0.9 * share <= size <= 1.1 * share, held
            assert counted(TABLE, alias) == held[alias]
        assert cache.get_many(list(batch)) == batch
    finally:
        drop(aliases=aliases)
