"""OPTIONS["MAX_SIZE"]: a MySQLCache table kept under a byte budget on real MariaDB.

What a table holds is measured here with SQL (``SUM(LENGTH(cache_key) + LENGTH(value))``),
never with the estimate the cache itself reads, so each test checks the estimate too.
"""
from __future__ import annotations

import io
import random
import threading
import time
from typing import Any, Iterator

import MySQLdb
import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test.utils import override_settings

from django_kvcache import maintenance, stats
from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.checks import check_mysql_cache_tables
from django_kvcache.mysql import budget
from django_kvcache.mysql.connect import connection_params
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
    """What the budget's estimate says ``table`` holds (summed when it has no more rows
    than the sample)."""
    held = budget.server_estimate(alias, table)
    return held.bytes, held.entries


def drop(table: str = TABLE, aliases: tuple[str, ...] = ("default",)) -> None:
    for alias in aliases:
        drop_table(table, alias)
        drop_table(budget.size_table(table), alias)
        drop_table(table + "_locks", alias)


@pytest.fixture
def table() -> Iterator[str]:
    # Each test makes the table again, some with raw DDL the cache does not see: what a
    # process remembers of its layout (budget.REMEMBER_LAYOUT) must not outlive a test.
    drop()
    budget.forget_layouts()
    yield TABLE
    drop()
    budget.forget_layouts()


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
def test_a_table_no_larger_than_the_sample_is_summed_exactly(table, options):
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
    assert budget.server_estimate("default", table).exact
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


def test_a_budget_of_more_rows_than_the_sample_holds_by_the_estimate(table):
    """Small values: the table holds more rows than the sample, so every check reads an
    estimate; a stream of three budgets still ends within 10 % of it."""
    limit = 8 * MB
    cache = make_cache(table, OPTIONS={"MAX_SIZE": limit})
    rng = random.Random(43)
    draw = sizes(rng, 100, 2000)
    written, samples, i = 0, [], 0
    while written < 3 * limit:
        batch = {f"s{i + j}": rng.randbytes(next(draw)) for j in range(100)}
        cache.set_many(batch, timeout=3600)
        written += sum(map(len, batch.values()))
        i += 100
        if i % 5000 == 0:
            samples.append(stored(table)[0])
    final = stored(table)
    assert final[1] > budget.SAMPLE_ROWS  # the checks read estimates
    assert not budget.server_estimate("default", table).exact
    assert max(samples + [final[0]]) <= 1.2 * limit, samples
    assert 0.9 * limit <= final[0] <= 1.1 * limit, final
    assert cache.get_many(list(batch)) == batch


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
    # 2 MB, written before the cache had a budget: no columns for the estimate yet
    unbounded.set_many({f"u{i}": random.randbytes(50_000) for i in range(40)})
    bounded = MySQLCache(table, {"OPTIONS": {"MAX_SIZE": 500_000, "CULL_PROBABILITY": 0}})
    assert bounded.missing_tables("default") == []
    assert bounded.outdated_table("default") == [
        "column key_hash", "column byte_size", f"index {budget.SAMPLE_INDEX}"]
    assert not bounded.table_exists()
    bounded.create_table()  # the upgrade: the generated columns and their index
    assert bounded.outdated_table("default") == [] and bounded.table_exists()
    assert counted(table) == stored(table)
    assert bounded.cull() > 0
    assert 0.9 * 500_000 <= stored(table)[0] <= 500_000
    assert counted(table) == stored(table)


def test_writes_go_on_while_the_table_lacks_the_estimate(table, caplog):
    make_cache(table).set("x", 1)  # a table from before MAX_SIZE
    bounded = MySQLCache(table, {"OPTIONS": {"MAX_SIZE": 1000, "CULL_PROBABILITY": 0}})
    bounded.set("big", random.randbytes(5000))  # draws a check: nothing to read, logged
    bounded.cull()  # nor does kvcache_cull fail: it says so
    assert bounded.get("big") is not None and bounded.get("x") == 1
    assert "kvcache_createtable" in caplog.text and budget.SAMPLE_INDEX in caplog.text
    assert "error" in stats.budget_size("default", table, 1000)


def test_the_system_check_reports_a_table_without_the_estimate(table):
    make_cache(table).set("x", 1)
    entry = {"BACKEND": BACKEND, "LOCATION": table, "OPTIONS": {"MAX_SIZE": "1MB"}}
    with override_settings(CACHES={"default": entry}):
        warnings = check_mysql_cache_tables(databases=["default"])
        assert [(m.id, m.msg) for m in warnings] == [(
            "kvcache.W004", f"The table '{table}' of cache 'default' in database 'default' is "
            f"outdated for MAX_SIZE: column key_hash, column byte_size, index "
            f"{budget.SAMPLE_INDEX}.")]
        assert "kvcache_createtable default" in warnings[0].hint
        make_cache(table, OPTIONS={"MAX_SIZE": "1MB"})  # upgrades it
        assert check_mysql_cache_tables(databases=["default"]) == []
        sql(f"ALTER TABLE `{table}` DROP INDEX `{budget.SAMPLE_INDEX}`")  # an index lost
        assert [m.id for m in check_mysql_cache_tables(databases=["default"])] == [
            "kvcache.W004"]


def create_as_the_trigger_release(table: str) -> None:
    """``table`` as kvcache_createtable made it with MAX_SIZE before the estimate: the
    table without its columns, a side table of 16 slot rows of totals, three triggers."""
    from django_kvcache.mysql.sql import create_lock_table_sql, create_table_sql, quote_name

    sql(create_table_sql(table, quote_name, mariadb=True))
    sql(create_lock_table_sql(table, quote_name, mariadb=True))
    size = budget.size_table(table)
    ins, upd, dele = budget.trigger_names(table)
    slot = "WHERE `slot` = CONNECTION_ID() % 16"
    row = "LENGTH({0}.`cache_key`) + LENGTH({0}.`value`)"
    for statement in [
        f"CREATE TABLE IF NOT EXISTS `{size}` (`slot` SMALLINT UNSIGNED NOT NULL, `bytes` "
        "BIGINT NOT NULL, `entries` BIGINT NOT NULL, PRIMARY KEY (`slot`)) ENGINE=InnoDB",
        f"INSERT IGNORE INTO `{size}` (`slot`, `bytes`, `entries`) SELECT 0, COALESCE(SUM("
        f"LENGTH(`cache_key`) + LENGTH(`value`)), 0), COUNT(*) FROM `{table}`",
        f"INSERT IGNORE INTO `{size}` (`slot`, `bytes`, `entries`) VALUES "
        + ", ".join(f"({i}, 0, 0)" for i in range(1, 16)),
        f"CREATE TRIGGER IF NOT EXISTS `{ins}` AFTER INSERT ON `{table}` FOR EACH ROW UPDATE "
        f"`{size}` SET `bytes` = `bytes` + {row.format('NEW')}, `entries` = `entries` + 1 {slot}",
        f"CREATE TRIGGER IF NOT EXISTS `{upd}` AFTER UPDATE ON `{table}` FOR EACH ROW UPDATE "
        f"`{size}` SET `bytes` = `bytes` + {row.format('NEW')} - ({row.format('OLD')}) {slot}",
        f"CREATE TRIGGER IF NOT EXISTS `{dele}` AFTER DELETE ON `{table}` FOR EACH ROW UPDATE "
        f"`{size}` SET `bytes` = `bytes` - ({row.format('OLD')}), `entries` = `entries` - 1 "
        f"{slot}",
    ]:
        sql(statement)


def triggers_on(table: str) -> list[str]:
    return sorted(row[0] for row in sql(budget.TRIGGERS_QUERY, [table]))


@pytest.mark.parametrize("upgrade", ["kvcache_createtable", "migrate"])
def test_a_table_of_the_trigger_release_is_read_until_upgraded_then_upgraded(table, upgrade):
    create_as_the_trigger_release(table)
    entry = {"BACKEND": BACKEND, "LOCATION": table,
             "OPTIONS": {"MAX_SIZE": 100_000, "CULL_PROBABILITY": 0}}
    with override_settings(CACHES={"default": entry}):
        cache = MySQLCache(table, {"OPTIONS": entry["OPTIONS"]})
        [warning] = check_mysql_cache_tables(databases=["default"])
        assert warning.id == "kvcache.W004"
        assert all(name in warning.msg for name in budget.trigger_names(table))
        # Not upgraded yet: the budget is held by the old totals, which the triggers keep.
        for i in range(20):
            cache.set(f"o{i:02}", random.randbytes(10_000), timeout=10_000 - i * 100)
        assert stored(table)[0] <= 100_000 and cache.get("o19") is not None
        assert counted(table) == stored(table)
        assert sql(budget.LAYOUT_QUERY, [table, table, budget.size_table(table)])[0][2] == 1

        out = io.StringIO()
        if upgrade == "migrate":  # what its pre_migrate receiver runs
            maintenance.prepare_migrate(sender=None, using="default", stdout=out)
            assert "Upgraded the table of cache 'default' for MAX_SIZE" in out.getvalue()
        else:
            call_command("kvcache_createtable", "default", "--dry-run", stdout=out)
            assert f"DROP TABLE IF EXISTS `{budget.size_table(table)}`" in out.getvalue()
            assert triggers_on(table) == sorted(budget.trigger_names(table))  # a dry run
            out = io.StringIO()
            call_command("kvcache_createtable", "default", stdout=out)
            assert out.getvalue() == "default: upgraded table\n"
        assert triggers_on(table) == []
        assert sql("SHOW TABLES LIKE %s", [budget.size_table(table)]) == []
        assert cache.outdated_table("default") == []
        assert check_mysql_cache_tables(databases=["default"]) == []
        assert counted(table) == stored(table)  # now the estimate, the rows there included
        for i in range(20, 40):
            cache.set(f"o{i:02}", random.randbytes(10_000), timeout=10_000 - i * 100)
        assert stored(table)[0] <= 100_000 and cache.get("o39") is not None


def test_the_upgrade_adds_the_columns_at_once_and_builds_the_index_with_writes_going_on(
        table):
    """The server takes the upgrade's statements with ALGORITHM=INSTANT (the columns: no
    copy of a large table) and ALGORITHM=INPLACE, LOCK=NONE (the index), or refuses."""
    from django_kvcache.mysql.sql import quote_name

    make_cache(table).set_many({f"i{i}": i for i in range(100)})
    lacks = budget.outdated("default", table)
    columns, index = budget.upgrade_sql(table, quote_name, True, "InnoDB", lacks)
    sql(columns + ", ALGORITHM=INSTANT")
    sql(index + ", ALGORITHM=INPLACE, LOCK=NONE")
    assert budget.outdated("default", table) == []
    assert counted(table) == stored(table)


def test_a_table_made_again_another_way_is_read_again(table, caplog):
    """The layout a process remembers for a table is forgotten when reading by it fails:
    a table dropped and made again as the trigger release made it (by another process)
    costs one check, not a minute of checks."""
    cache = make_cache(table, OPTIONS={"MAX_SIZE": 100_000})
    cache.set("first", random.randbytes(10_000))  # a check: the sampled layout remembered
    drop()
    create_as_the_trigger_release(table)
    cache.set("fails", random.randbytes(10_000))  # its check fails: logged, forgotten
    assert "Cull of" in caplog.text and cache.get("fails") is not None
    for i in range(20):
        cache.set(f"a{i:02}", random.randbytes(10_000), timeout=10_000 - i * 100)
    assert stored(table)[0] <= 100_000 and cache.get("a19") is not None


#: The estimate's test table: more rows than the sample, sizes spread over two orders of
#: magnitude, made by the server (MariaDB's sequence engine) from the row number alone.
ESTIMATED_ROWS = 5 * budget.SAMPLE_ROWS


def test_the_estimate_of_a_table_larger_than_the_sample_is_within_its_bound(table):
    """The estimate is the sample's mean size times the k-minimum-values row count, both
    unbiased and independent; its relative standard deviation is about
    ``sqrt((1 + cv²) (1 - k/N) / k)`` (cv: the sizes' coefficient of variation, k the
    sample's rows, N the table's). Fixed rows and keys (the hash is CRC32): the same
    estimate every run, checked against four of those deviations."""
    make_cache(table, OPTIONS={"MAX_SIZE": "1GB"})
    if not sql("SELECT COUNT(*) FROM information_schema.ENGINES WHERE ENGINE = 'SEQUENCE'"
               )[0][0]:
        pytest.skip("needs MariaDB's sequence engine")
    sql(f"INSERT INTO `{table}` (`cache_key`, `value`, `flags`, `expires`) "
        f"SELECT CONCAT(':1:est', `seq`), REPEAT('v', FLOOR(20 * POW(100, "
        f"MOD(`seq` * 2654435761, 1000003) / 1000003))), 0, 9223372036854775807 "
        f"FROM `seq_1_to_{ESTIMATED_ROWS}`")
    size, rows = stored(table)
    assert rows == ESTIMATED_ROWS
    cv = float(sql(f"SELECT STDDEV_POP(`byte_size`) / AVG(`byte_size`) FROM `{table}`")[0][0])
    k = budget.SAMPLE_ROWS + 1
    deviation = ((1 - k / rows) / k) ** 0.5
    held = budget.server_estimate("default", table)
    assert not held.exact
    assert abs(held.entries - rows) <= 4 * deviation * rows, (held, rows, deviation)
    assert abs(held.bytes - size) <= 4 * deviation * (1 + cv * cv) ** 0.5 * size, (
        held, size, deviation, cv)
    shown = stats.budget_size("default", table, 10**9)
    assert (shown["stored_bytes"], shown["stored_estimated"]) == (held.bytes, 1)


def test_figures_show_the_budget_and_what_the_table_holds(table):
    entry = {"BACKEND": BACKEND, "LOCATION": table,
             "OPTIONS": {"MAX_SIZE": 200_000, "CULL_PROBABILITY": 0}}
    with override_settings(CACHES={"default": entry}):
        cache = make_cache(table, OPTIONS=entry["OPTIONS"])
        for i in range(10):
            cache.set(f"f{i}", random.randbytes(30_000))
        size, rows = stored(table)
        server = stats.server_figures("default")["default"]
        assert (server["max_size"], server["stored_bytes"], server["stored_entries"],
                server["stored_estimated"]) == (200_000, size, rows, 0)  # few rows: summed
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


# --- the upgrade, as a deploy runs it (found by review) ---------------------------------


def table_lock_held_for(seconds: float, table: str) -> threading.Thread:
    """Another session reads ``table`` in an open transaction for ``seconds``: its
    metadata lock makes any ALTER of the table wait that long (as a long ALTER or a busy
    table does), then commits."""
    reader = MySQLdb.connect(**connection_params("default").kwargs)
    reader.query(b"START TRANSACTION")
    reader.query(f"SELECT 1 FROM `{table}` LIMIT 1".encode())
    reader.store_result()

    def release() -> None:
        time.sleep(seconds)
        reader.query(b"COMMIT")
        reader.close()

    thread = threading.Thread(target=release)
    thread.start()
    return thread


def test_two_upgrades_at_once_longer_than_io_timeout_both_complete(table):
    """``migrate`` on two hosts at a deploy, on a table whose ALTER takes longer than the
    pool's IO_TIMEOUT (2 s): before, the command gave up on the reply half way (the
    server went on altering, the old triggers stayed), and the second host's upgrade
    failed on the first's columns (1060 duplicate column)."""
    create_as_the_trigger_release(table)
    caches_ = [MySQLCache(table, {"OPTIONS": {"MAX_SIZE": "1GB"}}) for _ in range(2)]
    errors: list[BaseException] = []

    def upgrade(cache: MySQLCache) -> None:
        try:
            cache.create_table()
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    holder = table_lock_held_for(3.0, table)
    upgrades = [threading.Thread(target=upgrade, args=(cache,)) for cache in caches_]
    for thread in upgrades:
        thread.start()
    for thread in [holder, *upgrades]:
        thread.join(60)
    assert errors == []
    assert caches_[0].outdated_table("default") == [] and triggers_on(table) == []


def test_a_table_dropped_and_made_again_needs_one_create_table(table):
    """The drop leaves nothing of the earlier release's totals behind, and a table made
    again is brought up to date by the same run."""
    create_as_the_trigger_release(table)
    cache = MySQLCache(table, {"OPTIONS": {"MAX_SIZE": 100_000}})
    for statement in cache.drop_table_sql().split(";\n"):
        sql(statement)
    assert sql("SHOW TABLES LIKE %s", [budget.size_table(table)]) == []
    create_as_the_trigger_release(table)
    sql(f"DROP TABLE `{table}`")  # a manual drop: the old totals table stays
    cache.create_table()
    assert cache.outdated_table("default") == [] and cache.table_exists()


def test_an_engine_that_cannot_index_a_virtual_column_stores_them(table):
    """Aria refuses an index on a VIRTUAL column (1904): the table could not be made."""
    cache = make_cache(table, OPTIONS={"MAX_SIZE": 100_000, "ENGINE": "Aria"})
    for number in range(50):
        cache.set(f"k{number}", "x" * 5_000)
    cache.cull()
    assert 0 < stored(table)[0] <= 100_000 * 1.1
    assert counted(table) == stored(table)
