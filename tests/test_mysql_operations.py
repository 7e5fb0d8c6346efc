"""MySQLCache operations beyond the shared contract: schema, statements, keys, incr, options."""
from __future__ import annotations

import logging
import random
import warnings

import pytest
from django.core.cache.backends.base import CacheKeyWarning, memcache_key_warnings
from django.core.exceptions import ImproperlyConfigured

from django_kvcache.base import unreadable_entries
from django_kvcache.backends.mysql import ALWAYS_FITS, MySQLCache
from django_kvcache.codec import FLAG_INTEGER, FLAG_PICKLE, INT64_MAX, INT64_MIN
from django_kvcache.mysql.keys import DIGEST_MARKER, MAX_KEY_LENGTH, stored_key
from django_kvcache.mysql import blocking
from django_kvcache.mysql.blocking import server_info
from django_kvcache.mysql.query import PACKET_LIMIT
from django_kvcache.mysql.server import ServerInfo, parse_version
from django_kvcache.mysql.sql import (
    FOREVER,
    HEX_LIMIT,
    Statements,
    create_table_sql,
    quote_name,
    value_sql,
)
from tests.mysql_support import (  # noqa: F401  (fixtures)
    MYISAM_TABLE,
    TABLE,
    cache,
    drop_cache_tables,
    in_another_thread,
    insert_row,
    make_cache,
    mysql_tables,
    now_ms,
    rows,
    sent_statements,
    sql,
)
from django_kvcache.zstd import FLAG_ZSTD, zstd_engine
from tests.codec_support import MAIN_ENTRIES, MAIN_TOKEN, alphanumeric, assert_read_back, html
from tests.zstd_support import ZSTD_ENTRY, ZSTD_ENTRY_FLAGS

pytestmark = pytest.mark.django_db


# --- schema ------------------------------------------------------------------------------


def test_schema_has_exact_keys_raw_values_and_an_expiry_index(cache):
    (_, create), = sql(f"SHOW CREATE TABLE `{TABLE}`")
    assert "`cache_key` varchar(250)" in create and "utf8mb4_nopad_bin" in create
    assert "`value` longblob NOT NULL" in create
    assert "`flags` int(10) unsigned NOT NULL" in create
    assert "`expires` bigint(20) NOT NULL" in create
    assert "PRIMARY KEY (`cache_key`)" in create
    assert "KEY `kvcache_expires` (`expires`)" in create
    assert "ENGINE=InnoDB" in create


def test_engine_option(mysql_tables):
    (_, create), = sql(f"SHOW CREATE TABLE `{MYISAM_TABLE}`")
    assert "ENGINE=MyISAM" in create
    myisam = make_cache(MYISAM_TABLE)
    myisam.set("key", "value")
    assert myisam.get("key") == "value"
    myisam.clear()


def test_values_are_stored_as_raw_codec_bytes(cache):
    cache.set("number", 42)
    cache.set("text", "é")
    stored = {key: (bytes(value), flags) for key, value, flags, _ in rows()}
    assert stored[":1:number"] == (b"42", FLAG_INTEGER)
    assert stored[":1:text"] == cache.codec.encode("é")
    assert stored[":1:text"][1] == FLAG_PICKLE


@pytest.mark.parametrize("size", [0, 1, HEX_LIMIT - 64, HEX_LIMIT + 64])
def test_values_either_side_of_the_hex_literal_limit_round_trip(cache, size):
    """Up to HEX_LIMIT bytes a stored value is a hex literal in the statement, above it an
    escaped parameter: every byte (quotes, backslashes, NUL, %) survives both, in each
    statement that writes values."""
    special = b"'\\%s%%\0\""
    data = (special + random.Random(size).randbytes(size))[:size]
    stored = cache.codec.encode(data)[0]  # random: not compressed, pickled (a few bytes more)
    assert (value_sql(stored)[1] == ()) is (size < HEX_LIMIT)
    cache.set("set", data)
    assert cache.add("add", data) is True
    cache.set_many({"many": data, "other": b"x"})
    assert cache.get_many(["set", "add", "many"]) == {"set": data, "add": data, "many": data}


def test_expiry_is_epoch_milliseconds_and_forever_sorts_last(cache):
    before = now_ms()
    cache.set("bounded", "v", timeout=100)
    cache.set("forever", "v", timeout=None)
    cache.set("fraction", "v", timeout=2.5)
    after = now_ms()
    expires = {key: expires for key, _, _, expires in rows()}
    assert before + 100_000 <= expires[":1:bounded"] <= after + 100_000
    assert before + 2_500 <= expires[":1:fraction"] <= after + 2_500
    assert expires[":1:forever"] == FOREVER


def test_keys_differing_only_in_trailing_space_case_or_accent_are_distinct(cache):
    family = ["a", "a ", "A", "á", "a\u0301", "\U0001f600", "\U0001f601"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheKeyWarning)
        for index, key in enumerate(family):
            cache.set(key, index)
        assert [cache.get(key) for key in family] == list(range(len(family)))
        assert cache.get_many(family) == {key: index for index, key in enumerate(family)}


# --- one statement per operation ----------------------------------------------------------


def statements(cache, operation):
    with sent_statements() as sent:
        result = operation()
    return result, sent


@pytest.mark.parametrize(
    "name, operation",
    [
        ("get", lambda c: c.get("a")),
        ("get miss", lambda c: c.get("missing")),
        ("has_key", lambda c: c.has_key("a")),
        ("set", lambda c: c.set("a", "new")),
        ("set forever", lambda c: c.set("a", "new", timeout=None)),
        ("set timeout 0", lambda c: c.set("a", "new", timeout=0)),
        ("add new", lambda c: c.add("new", 1)),
        ("add existing", lambda c: c.add("a", 1)),
        ("add timeout 0", lambda c: c.add("new", 1, timeout=0)),
        ("get_many", lambda c: c.get_many(["a", "n", "missing"])),
        ("set_many 20", lambda c: c.set_many({f"k{i}": i for i in range(20)})),
        ("set_many timeout 0", lambda c: c.set_many({"a": 1, "b": 2}, timeout=0)),
        ("delete_many", lambda c: c.delete_many(["a", "n", "missing"])),
        ("incr", lambda c: c.incr("n")),
        ("decr", lambda c: c.decr("n", 5)),
        ("touch", lambda c: c.touch("a", 60)),
        ("touch 0", lambda c: c.touch("a", 0)),
        ("delete", lambda c: c.delete("a")),
        ("clear", lambda c: c.clear()),
        ("keys_with_prefix", lambda c: c.keys_with_prefix("a")),
        ("get_with_prefix", lambda c: c.get_with_prefix("a")),
        ("delete_with_prefix", lambda c: c.delete_with_prefix("a")),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_one_statement_per_operation(cache, name, operation):
    cache.set_many({"a": "A", "n": 10})
    _, executed = statements(cache, lambda: operation(cache))
    assert len(executed) == 1, executed
    assert "COUNT(" not in executed[0].upper()


def test_empty_batches_run_no_statement(cache):
    assert statements(cache, lambda: cache.get_many([]))[1] == []
    assert statements(cache, lambda: cache.set_many({}))[1] == []
    assert statements(cache, lambda: cache.delete_many([]))[1] == []


# --- add -----------------------------------------------------------------------------------


def test_add_overwrites_only_an_expired_row(cache):
    insert_row(":1:old", b"stale", 0, now_ms() - 1000)
    assert cache.add("old", "fresh", timeout=None) is True
    assert cache.get("old") == "fresh"
    (_, _, _, expires), = rows()
    assert expires == FOREVER


def test_add_leaves_a_live_row_untouched(cache):
    cache.set("key", "first", timeout=100)
    before = rows()
    assert cache.add("key", "second", timeout=None) is False
    assert rows() == before


def test_add_reports_correctly_after_an_incr_set_last_insert_id(cache):
    cache.set("n", 5)
    cache.incr("n", 1000)  # leaves LAST_INSERT_ID() = 1005 on the connection
    assert cache.add("fresh", 1) is True
    assert cache.add("fresh", 2) is False


# --- incr / decr -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "start, delta, result",
    [
        (0, -1, -1),
        (-5, 3, -2),
        (INT64_MAX - 1, 1, INT64_MAX),
        (INT64_MIN + 1, -1, INT64_MIN),
        (INT64_MIN, 2**64 - 1, INT64_MAX),
        (INT64_MAX, -(2**64) + 1, INT64_MIN),
        (INT64_MIN, INT64_MAX, -1),
    ],
)
def test_incr_covers_the_signed_64_bit_range(cache, start, delta, result):
    cache.set("n", start)
    assert cache.incr("n", delta) == result
    assert cache.get("n") == result


@pytest.mark.parametrize(
    "start, delta", [(INT64_MAX, 1), (INT64_MIN, -1), (0, 2**63), (0, 2**64), (5, 2**70)]
)
def test_incr_overflow_raises_and_leaves_the_value(cache, start, delta):
    cache.set("n", start)
    with pytest.raises(OverflowError):
        cache.incr("n", delta)
    assert cache.get("n") == start


def test_incr_keeps_the_expiry(cache):
    cache.set("n", 1, timeout=100)
    (_, _, _, expires), = rows()
    cache.incr("n", 5)
    assert rows()[0][3] == expires
    assert cache.get("n") == 6


def test_incr_of_expired_or_missing_key_raises_value_error(cache):
    insert_row(":1:gone", b"5", FLAG_INTEGER, now_ms() - 1)
    for key, delta in [("gone", 1), ("missing", 1), ("missing", 2**70)]:
        with pytest.raises(ValueError, match="not found"):
            cache.incr(key, delta)


@pytest.mark.parametrize("value", ["12", 1.5, True, b"7", 2**64])
def test_incr_of_non_integer_raises_type_error(cache, value):
    cache.set("v", value)
    with pytest.raises(TypeError):
        cache.incr("v")
    assert cache.get("v") == value


def test_incr_rejects_a_non_integer_delta(cache):
    cache.set("n", 1)
    with pytest.raises(TypeError):
        cache.incr("n", 1.5)
    assert cache.get("n") == 1


def test_incr_of_a_corrupt_integer_row_is_a_logged_miss(cache, caplog):
    insert_row(":1:bad", b"12abc", FLAG_INTEGER, FOREVER)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        for _ in range(50):  # a counter hit in a loop: one line, not one per call
            with pytest.raises(ValueError, match="not found"):
                cache.incr("bad")
    assert caplog.text.count("corrupt integer cache entry ':1:bad'") == 1


def test_incr_with_a_version_names_that_version_s_entry(cache, caplog):
    """incr(key, version=3) reads and reports the entry of version 3, not version 1's."""
    insert_row(":3:bad", b"12abc", FLAG_INTEGER, FOREVER)
    insert_row(":1:bad", b"1", FLAG_INTEGER, FOREVER)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        with pytest.raises(ValueError, match="not found"):
            cache.incr("bad", version=3)
    assert "corrupt integer cache entry ':3:bad'" in caplog.text
    assert ":1:bad" not in caplog.text
    cache.set("big", 2**70, version=3)  # a Python int stored pickled
    with pytest.raises(TypeError, match="beyond the signed 64-bit range"):
        cache.incr("big", version=3)


# --- corrupt rows ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, flags", [(b"\x80\x04garbage", FLAG_PICKLE), (b"not zlib", FLAG_PICKLE | 8), (b"x", 999)]
)
def test_corrupt_row_reads_as_a_logged_miss(cache, caplog, value, flags):
    insert_row(":1:bad", value, flags, FOREVER)
    cache.set("good", "fine")
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert cache.get("bad", "default") == "default"
        assert caplog.text.count("corrupt") == 1
        unreadable_entries.episodes.clear()  # else summarized with the first, later
        assert cache.get_many(["bad", "good"]) == {"good": "fine"}
    assert caplog.text.count("corrupt") == 2
    cache.set("bad", "repaired")
    assert cache.get("bad") == "repaired"


def test_a_zstd_row_where_zstd_is_missing_is_a_miss_that_says_why(cache, without_zstd, caplog):
    # Written by a host with zstd, read by one without (a rolling deploy): never a wrong
    # value, one warning for all such rows, and the key can be written again.
    here = make_cache(OPTIONS={"COMPRESSOR": "django_kvcache.codec.ZlibCompressor"})
    insert_row(":1:z", ZSTD_ENTRY, ZSTD_ENTRY_FLAGS, FOREVER)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        assert here.get("z", "default") == "default"
        assert here.get_many(["z"]) == {}
    assert caplog.text.count("compressed with zstd, which is not installed here") == 1
    here.set("z", "written here")
    assert here.get("z") == "written here"


# --- values compression does not pay for are stored as they are ----------------------------


def test_tokens_are_stored_as_they_are_and_html_compressed(cache):
    """A token saves a fifth, under this backend's default of a quarter."""
    assert cache.codec.min_saving == 0.25
    values = {"token": alphanumeric(2000), "tokens": alphanumeric(3000, 2), "page": html()}
    cache.set("token", values["token"])
    cache.set_many({"tokens": values["tokens"], "page": values["page"]})
    stored = {key: (bytes(value), flags) for key, value, flags, _ in rows()}
    assert stored[":1:token"][1] == stored[":1:tokens"][1] == FLAG_PICKLE
    assert stored[":1:page"][1] == FLAG_PICKLE | cache.codec.compressor.flag
    assert_read_back(cache, values)


@pytest.mark.parametrize("data, flags", MAIN_ENTRIES, ids=["zstd", "zlib"])
def test_rows_mains_code_compressed_read_back(cache, data, flags):
    if flags & FLAG_ZSTD and zstd_engine() is None:
        pytest.skip("zstd not installed (a backend extra brings it)")
    insert_row(":1:old", data, flags, FOREVER)
    assert_read_back(cache, {"old": MAIN_TOKEN})


# --- long keys ---------------------------------------------------------------------------


def test_long_keys_are_digested_never_truncated_and_warn(cache):
    head = "k" * 300
    with pytest.warns(CacheKeyWarning):
        cache.set(head + "1", "one")
    with pytest.warns(CacheKeyWarning):
        cache.set(head + "2", "two")
    with pytest.warns(CacheKeyWarning):
        assert cache.get(head + "1") == "one"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheKeyWarning)
        assert cache.get_many([head + "1", head + "2"]) == {head + "1": "one", head + "2": "two"}
        assert cache.incr_version(head + "1") == 2
    stored = [key for key, *_ in rows()]
    assert all(len(key) == MAX_KEY_LENGTH and DIGEST_MARKER in key for key in stored)


@pytest.mark.parametrize(
    "key", ["plain", "with space", "tab\t", "nul\x00", "del\x7f", "é" * 260, "x" * 247]
)
def test_key_warnings_are_exactly_djangos(cache, key):
    expected = list(memcache_key_warnings(cache.make_key(key)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.set(key, 1)
        assert cache.get(key) == 1
    assert [str(w.message) for w in caught if w.category is CacheKeyWarning] == expected * 2


def test_key_of_250_characters_is_stored_verbatim_without_warning(cache):
    key = "x" * (MAX_KEY_LENGTH - len(":1:"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheKeyWarning)
        cache.set(key, "fits")
        assert cache.get(key) == "fits"
    assert rows()[0][0] == ":1:" + key


def test_a_key_shaped_like_a_digest_cannot_collide_with_one(cache):
    long_key = "z" * 400
    digest_form = stored_key(cache.make_key(long_key))
    lookalike = digest_form[len(":1:") :]  # its made key *is* the digest form
    assert cache.make_key(lookalike) == digest_form
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheKeyWarning)
        cache.set(long_key, "long")
        cache.set(lookalike, "lookalike")
        assert cache.get(long_key) == "long"
        assert cache.get(lookalike) == "lookalike"
    assert len(rows()) == 2


# --- timeouts ------------------------------------------------------------------------------


def test_set_many_with_zero_timeout_removes_old_values(cache):
    cache.set_many({"a": 1, "b": 2})
    assert cache.set_many({"a": 3, "b": 4}, timeout=0) == []
    assert rows() == []


@pytest.mark.parametrize("timeout", [10**30, 1e300, float("inf")])
def test_huge_timeouts_are_forever(cache, timeout):
    cache.set("key", "value", timeout=timeout)
    assert rows()[0][3] == FOREVER
    assert cache.get("key") == "value"


def test_delete_of_an_expired_row_is_false(cache):
    insert_row(":1:old", b"x", 0, now_ms() - 1)
    assert cache.delete("old") is False
    assert cache.touch("old") is False
    assert cache.has_key("old") is False


# --- statements over max_allowed_packet ------------------------------------------------------


@pytest.fixture
def max_packet(cache):
    return server_info("default").max_allowed_packet


def test_values_near_max_allowed_packet(cache, max_packet, caplog):
    rng = random.Random(3)
    fits = rng.randbytes(max_packet * 3 // 4)
    cache.set("big", fits)
    assert cache.get("big") == fits
    too_big = rng.randbytes(max_packet + 1024)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        cache.set("big", too_big)  # the server would drop the connection; nothing is sent
        assert cache.add("other", too_big) is False
    assert "max_allowed_packet" in caplog.text
    assert cache.get("big") is None  # the older value does not outlive the failed write
    assert cache.get("other") is None


def test_set_many_splits_only_beyond_max_allowed_packet(cache, max_packet, caplog):
    rng = random.Random(4)
    data = {f"part{i}": rng.randbytes(max_packet // 3) for i in range(4)}
    data["huge"] = rng.randbytes(max_packet + 1024)
    cache.set("huge", "old")
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        failed, executed = statements(cache, lambda: cache.set_many(data))
    assert failed == ["huge"]
    inserts = [s for s in executed if s.startswith("INSERT")]
    assert 2 <= len(inserts) < len(data)  # together over one packet, but batched
    assert cache.get_many(list(data)) == {k: v for k, v in data.items() if k != "huge"}


def test_many_keys_in_one_statement(cache):
    keys = [f"key-{i}" for i in range(3000)]
    _, executed = statements(cache, lambda: cache.set_many(dict.fromkeys(keys, 1)))
    assert len(without_packet_limit_read(executed)) == 1
    found, executed = statements(cache, lambda: cache.get_many(keys))
    assert found == dict.fromkeys(keys, 1) and len(without_packet_limit_read(executed)) == 1


def without_packet_limit_read(executed: list[str]) -> list[str]:
    """The operation's statements. A statement that may be large first asks the pooled
    connection its packet limit, once per connection (test_the_packet_limit_is_read_once_…):
    whether the connection this test gets was asked before depends on the tests before."""
    assert PACKET_LIMIT.sql not in executed[1:], executed
    return [statement for statement in executed if statement != PACKET_LIMIT.sql]


# --- options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "location, options, named",
    [
        (TABLE, {"CULL_PROBABILITY": 2}, "CULL_PROBABILITY"),
        (TABLE, {"CULL_PROBABILITY": "often"}, "CULL_PROBABILITY"),
        (TABLE, {"ENGINE": "InnoDB; DROP TABLE x"}, "ENGINE"),
        (TABLE, {"DATABASE": "nowhere"}, "DATABASE"),
        (TABLE, {"MAX_ENTRIES": -1}, "MAX_ENTRIES"),
        (TABLE, {"CULL_FREQUENCY": "three"}, "CULL_FREQUENCY"),
        (TABLE, {"TABLE": "x"}, "TABLE"),
        ("evil`name", {}, "LOCATION"),
        ("", {}, "LOCATION"),
        ("t" * 65, {}, "LOCATION"),
    ],
)
def test_bad_configuration_names_the_option(location, options, named):
    with pytest.raises(ImproperlyConfigured, match=named):
        MySQLCache(location, {"OPTIONS": options})


@pytest.mark.django_db(transaction=True)
def test_database_option_uses_that_alias(mysql_tables):
    dedicated = make_cache(OPTIONS={"DATABASE": "cache"})
    dedicated.has_key("warm-up")  # the server is detected once per alias, on first use
    with sent_statements("cache") as on_cache, sent_statements("default") as on_default:
        dedicated.set("key", "value")
        assert dedicated.get("key") == "value"
    assert len(on_cache) == 2 and len(on_default) == 0
    dedicated.clear()


class ReadsFromCacheAlias:
    def db_for_read(self, model, **hints):
        return "cache" if model._meta.app_label == "django_kvcache" else None

    def db_for_write(self, model, **hints):
        return "default" if model._meta.app_label == "django_kvcache" else None


@pytest.mark.django_db(transaction=True)
def test_routers_choose_the_connection(mysql_tables, settings):
    settings.DATABASE_ROUTERS = [f"{__name__}.ReadsFromCacheAlias"]
    routed = make_cache()
    # server detection, once per alias; from another thread, whose write opens no window here
    in_another_thread(lambda: (routed.has_key("warm-up"), routed.delete("warm-up")))
    fresh = make_cache()  # this thread has written nothing yet: reads go where db_for_read says
    fresh.has_key("warm-up")
    with sent_statements("cache") as reads, sent_statements("default") as writes:
        in_another_thread(lambda: (fresh.get("key"), fresh.get_many(["key"])))  # no window
        routed.set("key", "value")
        routed.get("key")  # read-your-writes: from the alias just written to
    assert [statement.split()[0] for statement in reads] == ["SELECT", "SELECT"]
    assert [statement.split()[0] for statement in writes] == ["INSERT", "SELECT"]
    routed.clear()


# --- server flavours -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, row_alias",
    [
        ("10.11.19-MariaDB-0+deb12u1", False),
        ("11.4.2-MariaDB", False),
        ("8.0.18", False),
        ("8.0.19", True),
        ("8.4.3-commercial", True),
    ],
)
def test_row_alias_form_only_where_the_server_has_it(version, row_alias):
    info = ServerInfo("mariadb" in version.lower(), parse_version(version), 16 << 20)
    assert info.row_alias is row_alias
    statements = Statements("t", quote_name, info.row_alias)
    hex_value = value_sql(b"v")[0]
    upserts = [
        statements.set_row(hex_value), statements.add_row(hex_value),
        statements.set_many([hex_value] * 3),
    ]
    for upsert in upserts:
        if row_alias:
            assert " AS `kvcache_new` ON DUPLICATE KEY UPDATE " in upsert
            assert "VALUES(`" not in upsert
        else:
            assert "VALUES(`value`)" in upsert and "kvcache_new" not in upsert


@pytest.mark.parametrize("table", ["new", "NEW", "kvcache_new", "Kvcache_New"])
def test_the_row_alias_is_never_the_table_s_name(table):
    """MySQL 8's upsert names the inserted row (``AS alias``) beside the table, whose
    columns it qualifies by the table's name: the two names must differ, or every
    qualified column is ambiguous (a table named ``new`` met ``AS new``)."""
    statements = Statements(table, quote_name, row_alias=True)
    hex_value = value_sql(b"v")[0]
    for upsert in (statements.set_row(hex_value), statements.add_row(hex_value),
                   statements.set_many([hex_value]), statements.lease_take):
        alias = upsert.split(" AS ", 1)[1].split()[0].strip("`")
        assert alias.lower() != table.lower(), upsert
        assert f"`{alias}`.`value`" in upsert


def test_table_collation_per_flavour():
    quote = quote_name
    assert "COLLATE utf8mb4_nopad_bin" in create_table_sql("t", quote, mariadb=True)
    assert "COLLATE utf8mb4_0900_bin" in create_table_sql("t", quote, mariadb=False)


# --- table names and packet limits per connection ------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("table", ["t%s", "t%_x", "t%%", "t%(x)s"])
def test_percent_signs_in_the_table_name(table):
    options = {"CULL_PROBABILITY": 1, "MAX_ENTRIES": 2, "CULL_FREQUENCY": 1}
    cache = make_cache(table, OPTIONS=options)
    try:
        assert cache.set_many({"a": 1, "b": 2, "c": 3}) == []
        assert cache.add("d", 4) is True
        assert cache.incr("d") == 5
        assert cache.keys_with_prefix("") == ["d"]  # culled down, in this very table
        assert [key for key, *_ in rows(table)] == [":1:d"]
        assert cache.cull() == 0
        cache.clear()
        assert rows(table) == []
    finally:
        drop_cache_tables(cache)


@pytest.mark.django_db(transaction=True)
def test_the_packet_limit_is_read_once_per_connection_and_only_for_large_statements(
    mysql_tables,
):
    cache = make_cache()
    big = random.Random(5).randbytes(ALWAYS_FITS + 1)

    def limit_reads(operation) -> int:
        _, executed = statements(cache, operation)
        return sum("@@max_allowed_packet" in statement for statement in executed)

    blocking.close_pools(["default"])
    assert limit_reads(lambda: cache.set("small", "x" * 1000)) == 0
    assert limit_reads(lambda: cache.get_many([f"k{i}" for i in range(200)])) == 0
    assert limit_reads(lambda: cache.set("big", big)) == 1
    assert limit_reads(lambda: cache.set_many({"a": big, "b": big})) == 0
    blocking.close_pools(["default"])  # a new session may have another limit
    assert limit_reads(lambda: cache.set("big", big)) == 1
    assert cache.get("big") == big
    cache.clear()


def test_metrics_count_what_compression_saves(cache):
    before = cache.metrics()
    text = "compressible text " * 400  # above MySQLCache's 4000-byte threshold
    cache.set("text", text)
    cache.set_many({"a": text, "b": 7})
    after = cache.metrics()
    serialized = len(cache.codec.serializer.dumps(text))
    assert after["values_encoded"] - before["values_encoded"] == 3
    saved = after["bytes_saved"] - before["bytes_saved"]
    assert 0 < saved < 2 * serialized
    stored = after["bytes_encoded"] - before["bytes_encoded"]
    assert stored + saved == 2 * serialized + len(b"7")


# --- issue 21: caller's keys in messages; bounded deletes ------------------------------------


def test_incr_messages_name_the_caller_s_key(cache):
    """Defect 6: Django's messages name the key the caller gave, not the stored ':1:' one."""
    cache.set("text", "abc")
    cache.set("huge", 2**70)  # an int, stored pickled beyond 64 bits
    cache.set("top", INT64_MAX)
    with pytest.raises(ValueError) as missing:
        cache.incr("missing")
    with pytest.raises(TypeError) as text:
        cache.incr("text")
    with pytest.raises(TypeError) as huge:
        cache.incr("huge")
    with pytest.raises(OverflowError) as top:
        cache.incr("top")
    assert str(missing.value) == "Key 'missing' not found"
    assert str(text.value) == "The value of key 'text' is not an integer"
    assert "'huge'" in str(huge.value) and "not an integer" not in str(huge.value)
    assert "64-bit" in str(huge.value)
    assert "key 'top'" in str(top.value)
    assert not any(":1:" in str(e.value) for e in (missing, text, huge, top))
    assert cache.get("huge") == 2**70


def test_a_value_too_large_for_a_statement_is_logged_rate_limited_with_the_caller_s_key(
    cache, max_packet, caplog
):
    """Issue 24's MySQL side: never a failed page. set and set_many delete the old value
    and log (once per episode, then summarized), add says False; the line names the
    caller's key."""
    too_big = random.Random(9).randbytes(max_packet + 1024)
    cache.set_many({"a": "old", "b": "old"})
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        for _ in range(5):
            assert cache.set("a", too_big) is None
            assert cache.set_many({"b": too_big, "c": 1}) == ["b"]
            assert cache.add("d", too_big) is False
    assert cache.get_many(["a", "b", "c", "d"]) == {"c": 1}
    lines = [r.getMessage() for r in caplog.records if "max_allowed_packet" in r.getMessage()]
    assert len(lines) == 1, lines  # rate-limited: one line for the episode
    assert "'a'" in lines[0] and ":1:" not in lines[0]


@pytest.mark.django_db(transaction=True)
def test_clear_and_delete_with_prefix_delete_in_bounded_batches(mysql_tables, monkeypatch):
    """Defect 4: like culling, no DELETE of clear() or delete_with_prefix() is unbounded."""
    from django_kvcache.mysql import plans

    monkeypatch.setattr(plans, "DELETE_BATCH_ROWS", 40, raising=False)
    for prefix in (None, "kp"):
        cache = make_cache(KEY_PREFIX=prefix) if prefix else make_cache()
        cache.set_many({f"page:{i}": i for i in range(100)})
        cache.set_many({f"other:{i}": i for i in range(30)})
        deleted, executed = statements(cache, lambda: cache.delete_with_prefix("page:"))
        assert deleted == 100
        assert len(executed) == 3 and all(" LIMIT " in s for s in executed), executed
        _, executed = statements(cache, cache.clear)
        assert len(executed) == 1 and " LIMIT " in executed[0]
        assert rows() == []
