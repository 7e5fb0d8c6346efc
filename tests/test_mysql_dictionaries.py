"""COMPRESS_DICTIONARY "auto" on real MariaDB servers: the dictionary table beside the cache
table, installing (``kvcache_train_dictionary --install``), each process loading an id
once, writers switching to the newest dictionary, a removed dictionary as a logged miss,
shards, and a lookup from inside an event loop.

"A new process" is this process with the table registry emptied: what a process that
has met no dictionary yet holds (``django_kvcache.mysql.dictionaries._tables``).
"""
from __future__ import annotations

import asyncio
import io
import logging
import pickle
import random
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import override_settings

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.base import unreadable_entries
from django_kvcache.codec import FLAG_PICKLE
from django_kvcache.forks import Registry
from django_kvcache.mysql import dictionaries
from django_kvcache.mysql.dictionaries import dictionary_table, table_dictionaries
from django_kvcache.zstd import (
    DICTIONARY_MAGIC,
    FLAG_ZSTD,
    Dictionary,
    train_dictionary,
    zstd_engine,
)
from tests.settings import MYSQL_SHARD_PORTS
from tests.test_zstd import api_response
from tests.zstd_support import frame_dictionary_id

SHARDS = ["shard1", *(f"shard{n}" for n in range(2, 2 + len(MYSQL_SHARD_PORTS)))]
pytestmark = [
    pytest.mark.skipif(zstd_engine() is None, reason="zstd not installed (extra 'zstd')"),
    pytest.mark.django_db(transaction=True, databases=["default", "cache", *SHARDS]),
]
TABLE = "kvcache_auto"
AUTO = {"COMPRESS_DICTIONARY": "auto", "COMPRESS_MIN_LENGTH": 400, "CULL_PROBABILITY": 0}


def value(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [api_response(rng) for _ in range(3)]


def trained(seed: int) -> bytes:
    """A dictionary trained on values like ``value()``'s (other seeds than those stored)."""
    samples = [pickle.dumps(value(seed * 1000 + n), pickle.HIGHEST_PROTOCOL) for n in range(300)]
    return train_dictionary(samples, 4096)


@pytest.fixture(scope="module")
def first() -> bytes:
    return trained(1)


@pytest.fixture(scope="module")
def second() -> bytes:
    return trained(2)


@pytest.fixture(autouse=True)
def new_process(monkeypatch) -> Iterator[None]:
    monkeypatch.setattr(dictionaries, "_tables", Registry())
    dictionaries.failures.episodes.clear()  # each test's first failure is logged
    yield


def new_process_now() -> None:
    dictionaries._tables.items.clear()
    dictionaries.failures.episodes.clear()
    unreadable_entries.episodes.clear()


def make(table: str = TABLE, **options: Any) -> MySQLCache:
    cache = MySQLCache(table, {"OPTIONS": {**AUTO, "DATABASE": "cache", **options}})
    cache.create_table()
    return cache


@pytest.fixture
def cache() -> Iterator[MySQLCache]:
    cache = make()
    yield cache
    for alias in ("cache",):
        with connections[alias].cursor() as cursor:
            for statement in connections[alias].ops.prepare_sql_script(cache.drop_table_sql()):
                cursor.execute(statement)


def stored(cache: MySQLCache, key: str) -> bytes:
    with connections["cache"].cursor() as cursor:
        cursor.execute(f"SELECT `value` FROM `{cache.table}` WHERE `cache_key` = %s",
                       [cache.make_and_validate_key(key)])
        return bytes(cursor.fetchone()[0])


@contextmanager
def dictionary_queries() -> Iterator[list[str]]:
    """The statements the dictionary lookups send while the block runs."""
    sent: list[str] = []
    query = dictionaries.query

    def recording(alias: str, statement: str, params: Any) -> Any:
        sent.append(statement)
        return query(alias, statement, params)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dictionaries, "query", recording)
        yield sent


def install(cache: MySQLCache, content: bytes) -> Dictionary:
    return table_dictionaries(cache.table, cache.options).install(content)


# --- the table ---------------------------------------------------------------------------


def test_createtable_makes_the_dictionary_table_beside_the_cache_table():
    plain = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": "cache"}})
    settings = {"auto": {"BACKEND": "django_kvcache.backends.mysql.MySQLCache",
                         "LOCATION": TABLE, "OPTIONS": {**AUTO, "DATABASE": "cache"}}}
    try:
        plain.create_table()  # a cache table from before "auto" was set
        with override_settings(CACHES=settings):
            assert not caches["auto"].table_exists()
            out = io.StringIO()
            call_command("kvcache_createtable", "auto", "--dry-run", stdout=out)
            assert f"CREATE TABLE IF NOT EXISTS `{TABLE}_dictionaries`" in out.getvalue()
            call_command("kvcache_createtable", "auto", stdout=io.StringIO())
            assert caches["auto"].table_exists()
            tables = connections["cache"].introspection.table_names()
            assert {TABLE, f"{TABLE}_dictionaries"} <= set(tables)
            migration = io.StringIO()
            call_command("kvcache_migration", "auto", stdout=migration)
            assert f"`{TABLE}_dictionaries`" in migration.getvalue()
            caches["auto"].close()
    finally:
        with connections["cache"].cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS `{TABLE}`, `{TABLE}_dictionaries`")


def test_a_long_table_name_gets_a_dictionary_table_of_at_most_64_characters():
    first, second = "t" * 60 + "_one", "t" * 60 + "_two"
    names = {dictionary_table(first), dictionary_table(second)}
    assert len(names) == 2 and all(len(name) <= 64 for name in names)
    assert dictionary_table("kvcache") == "kvcache_dictionaries"


def test_memcached_takes_no_auto():
    with pytest.raises(ImproperlyConfigured, match="'auto' keeps dictionaries in a MySQLCache"):
        MemcachedCache("127.0.0.1:1", {"OPTIONS": {"COMPRESS_DICTIONARY": "auto"}})


# --- writing and reading -------------------------------------------------------------------


def test_without_a_dictionary_it_writes_plain_zstd_and_switches_at_install(cache, first):
    cache.set("before", value(1))
    assert frame_dictionary_id(stored(cache, "before")) == 0
    installed = install(cache, first)
    cache.set("after", value(2))  # this process: at once
    assert frame_dictionary_id(stored(cache, "after")) == installed.id
    assert len(stored(cache, "after")) < 0.8 * len(stored(cache, "before"))
    assert cache.get_many(["before", "after"]) == {"before": value(1), "after": value(2)}


def test_a_process_loads_each_dictionary_once_and_checks_for_a_newer_one_once(cache, first):
    installed = install(cache, first)
    cache.set_many({f"k{n}": value(n) for n in range(50)})
    new_process_now()
    reader = make()
    with dictionary_queries() as queries:
        assert reader.get_many([f"k{n}" for n in range(50)]) == {f"k{n}": value(n) for n in range(50)}
        assert all(reader.get(f"k{n}") == value(n) for n in range(50))
        reader.set_many({f"w{n}": value(100 + n) for n in range(100)})
    # One load of the dictionary, one check for the newest (the first write); then none.
    assert len(queries) == 2, queries
    assert sum("ORDER BY `installed` DESC" in q for q in queries) == 1
    assert frame_dictionary_id(stored(reader, "w7")) == installed.id


def test_writers_switch_to_the_newest_dictionary_at_their_next_check(cache, first, second, monkeypatch):
    old = install(cache, first)
    cache.set("old", value(1))
    # Another process installs a newer one: this one learns it at its next check.
    new = dictionaries.TableDictionaries(TABLE, cache.codec.compressor.dictionaries.shards).install(second)
    cache.set("still-old", value(2))
    assert frame_dictionary_id(stored(cache, "still-old")) == old.id
    monkeypatch.setattr(dictionaries, "CHECK_INTERVAL", 0.0)  # the minute has passed
    cache.set("new", value(3))
    assert frame_dictionary_id(stored(cache, "new")) == new.id
    new_process_now()
    assert make().get_many(["old", "still-old", "new"]) == {
        "old": value(1), "still-old": value(2), "new": value(3)}


def test_installing_an_older_dictionary_again_makes_it_the_newest(cache, first, second):
    old = install(cache, first)
    install(cache, second)
    install(cache, first)
    new_process_now()
    writer = make()
    writer.set("key", value(1))
    assert frame_dictionary_id(stored(writer, "key")) == old.id


def test_an_entry_whose_dictionary_row_is_gone_is_a_logged_miss(cache, first, caplog):
    installed = install(cache, first)
    cache.set("key", value(1))
    with connections["cache"].cursor() as cursor:
        cursor.execute(f"DELETE FROM `{TABLE}_dictionaries`")
    new_process_now()
    reader = make()
    with caplog.at_level(logging.WARNING), dictionary_queries() as queries:
        assert [reader.get("key", "missing") for _ in range(20)] == ["missing"] * 20
    assert f"zstd dictionary {installed.id}" in caplog.text and "removed" in caplog.text
    assert len(queries) == 1  # asked once, not once per read
    assert cache.get("key") == value(1)  # a process that loaded it before still reads it


def test_a_missing_dictionary_table_leaves_writes_plain_and_says_so(caplog):
    cache = MySQLCache(TABLE, {"OPTIONS": {**AUTO, "DATABASE": "cache"}})
    MySQLCache(TABLE, {"OPTIONS": {"DATABASE": "cache"}}).create_table()  # only the cache table
    try:
        with caplog.at_level(logging.WARNING):
            cache.set("key", value(1))
        assert frame_dictionary_id(stored(cache, "key")) == 0
        assert cache.get("key") == value(1)
        assert f"{TABLE}_dictionaries" in caplog.text
    finally:
        with connections["cache"].cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS `{TABLE}`")


def test_a_dictionary_is_loaded_from_inside_an_event_loop(cache, first):
    # An async driver decodes in the event loop, where Django's connections refuse to
    # run: the lookup runs on the cache's own connection (no worker thread).
    install(cache, first)
    cache.set("key", value(1))
    data = stored(cache, "key")
    new_process_now()
    reader = make()

    async def decode() -> Any:
        return reader.codec.decode(data, FLAG_PICKLE | FLAG_ZSTD)

    assert asyncio.run(decode()) == value(1)


# --- installing ------------------------------------------------------------------------------


def test_another_dictionary_with_a_taken_id_is_refused(cache, first, second):
    installed = install(cache, first)
    impostor = bytearray(second)
    impostor[4:8] = installed.id.to_bytes(4, "little")
    with pytest.raises(dictionaries.DictionaryConflict, match=f"another dictionary with id {installed.id}"):
        install(cache, bytes(impostor))
    cache.set("key", value(1))
    assert frame_dictionary_id(stored(cache, "key")) == installed.id


# --- with ENCRYPTION_KEYS --------------------------------------------------------------------

ENCRYPTED = {"ENCRYPTION_KEYS": ["the key of the dictionary tests, 0123456789abcdef"]}


def dictionary_row(cache: MySQLCache, dictionary_id: int) -> bytes:
    with connections["cache"].cursor() as cursor:
        cursor.execute(f"SELECT `content` FROM `{dictionary_table(cache.table)}` "
                       "WHERE `dictionary_id` = %s", [dictionary_id])
        return bytes(cursor.fetchone()[0])


def test_an_encrypting_cache_keeps_its_dictionaries_sealed(cache, first):
    """A dictionary is made of the site's values: in the database it is encrypted too."""
    sealed = make(**ENCRYPTED)
    installed = install(sealed, first)
    row = dictionary_row(sealed, installed.id)
    assert not row.startswith(DICTIONARY_MAGIC)
    assert first[-64:] not in row and len(row) <= len(first) + 64
    sealed.set("key", value(1))
    new_process_now()
    reader = make(**ENCRYPTED)
    assert reader.get("key") == value(1)
    assert reader.codec.compressor.dictionaries.for_writing().id == installed.id


def test_an_encrypting_cache_never_uses_a_dictionary_row_it_cannot_authenticate(cache, first,
                                                                                 caplog):
    """Whoever can write the dictionary table could otherwise choose bytes of what an
    authentic entry decompresses to, and so of what is unpickled."""
    sealed = make(**ENCRYPTED)
    installed = install(sealed, first)
    sealed.set("key", value(1))
    for replacement in (first, dictionary_row(sealed, installed.id)[:-1] + b"?"):
        with connections["cache"].cursor() as cursor:
            cursor.execute(f"UPDATE `{TABLE}_dictionaries` SET `content` = %s", [replacement])
        new_process_now()
        reader = make(**ENCRYPTED)
        with caplog.at_level(logging.WARNING):
            assert reader.get("key", "missing") == "missing"
        assert f"dictionary {installed.id}" in caplog.text
        caplog.clear()


def test_a_cache_without_keys_cannot_use_a_sealed_dictionary(cache, first, caplog):
    installed = install(make(**ENCRYPTED), first)
    new_process_now()
    with caplog.at_level(logging.WARNING):
        cache.set("key", value(1))
    assert frame_dictionary_id(stored(cache, "key")) == 0  # plain zstd: no dictionary to use
    assert f"dictionary {installed.id}" in caplog.text and "encrypted" in caplog.text
    assert cache.get("key") == value(1)


# --- shards ----------------------------------------------------------------------------------


@pytest.mark.skipif(len(SHARDS) < 3, reason="needs KVCACHE_MYSQL_SHARD_PORTS (two ports)")
def test_every_shard_holds_the_dictionaries(first):
    options = {**AUTO, "DATABASES": SHARDS}
    settings = {"sharded": {"BACKEND": "django_kvcache.backends.mysql.MySQLCache",
                            "LOCATION": "kvcache_auto_shards", "OPTIONS": options}}
    try:
        with override_settings(CACHES=settings):
            call_command("kvcache_createtable", "sharded", stdout=io.StringIO())
            cache = caches["sharded"]
            cache.set_many({f"seed{n}": value(n) for n in range(40)})
            out = io.StringIO()
            call_command("kvcache_train_dictionary", "sharded", "--install", "--samples", "40",
                         "--size", "2048", stdout=out, stderr=io.StringIO())
            for alias in SHARDS:
                with connections[alias].cursor() as cursor:
                    cursor.execute("SELECT COUNT(*) FROM `kvcache_auto_shards_dictionaries`")
                    assert cursor.fetchone()[0] == 1, alias
            cache.set_many({f"k{n}": value(500 + n) for n in range(60)})
            with connections["shard1"].cursor() as cursor:  # gone from one shard only
                cursor.execute("DELETE FROM `kvcache_auto_shards_dictionaries`")
            cache.close()
            new_process_now()
            reader = MySQLCache("kvcache_auto_shards", {"OPTIONS": options})
            found = reader.get_many([f"k{n}" for n in range(60)])
            assert found == {f"k{n}": value(500 + n) for n in range(60)}
            ids = {frame_dictionary_id(data) for _, data, flags in reader.sample_entries(100)
                   if flags & FLAG_ZSTD}
            assert len(ids - {0}) == 1 and f"zstd dictionary {max(ids)}" in out.getvalue()
    finally:
        for alias in SHARDS:
            with connections[alias].cursor() as cursor:
                cursor.execute("DROP TABLE IF EXISTS `kvcache_auto_shards`, "
                               "`kvcache_auto_shards_dictionaries`")
