"""OPTIONS["ENCRYPTION_KEYS"]: AES-256-GCM entries on both backends, both APIs.

The codec's layout and key handling first (no server); then, on real MariaDB tables and
memcached nodes: every value kind round trips (compressed, with a dictionary too), what a
raw ``SELECT`` or a raw ``mg`` shows holds no plaintext, an entry altered or moved (to
another key, cache, table or backend) is a logged miss that is never unpickled — shown
with a pickle that runs code when it is — keys rotate without a flush, counters stay
plain, and the other features keep working.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import random
import re
import socket
import sys
from contextlib import ExitStack
from typing import Any, Iterator

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_kvcache import encryption, stampede, steps
from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.checks import check_encryption_keys, check_shared_encryption
from django_kvcache.codec import FLAG_INTEGER, FLAG_PICKLE, Codec, CorruptValue
from django_kvcache.encryption import FLAG_ENCRYPTED, OVERHEAD, key_id_of, key_id_text
from django_kvcache.memcached import wire
from django_kvcache.zstd import FLAG_ZSTD, dictionary_id, train_dictionary, zstd_engine
from tests.contract import AsyncAPI, api  # noqa: F401  (fixture)
from tests.mysql_support import BACKEND, drop_table, make_cache, sql
from tests.servers import memcached_node
from tests.test_zstd import api_response
from tests.zstd_support import frame_dictionary_id

KEY1 = "the first key of the encryption tests, 7f3a9c2e5b8d"
KEY2 = "the second key of the encryption tests: q9w8e7r6t5"
RAW_KEY = bytes(range(100, 132))  # 32 bytes, used as they are
MARKER = "PLAINTEXT-MARKER-4f1d"
TABLE_A, TABLE_B = "kvcache_encrypted_a", "kvcache_encrypted_b"
LOGGER = "django_kvcache.base"
MEMCACHED = "django_kvcache.backends.memcached.MemcachedCache"

# Committed rows: the async API reads on connections of its own.
pytestmark = pytest.mark.django_db(transaction=True)


def key_id(key: str | bytes) -> int:
    return encryption._cipher(key)[0]


# --- a pickle that runs code when it is unpickled -----------------------------------------

RAN: list[str] = []


def ran(what: str) -> str:
    RAN.append(what)
    return what


class Exploit:
    """Unpickling it calls ``ran``: what an attacker's pickle would do with ``os.system``."""

    def __reduce__(self) -> Any:
        return (ran, ("unpickled",))


@pytest.fixture(autouse=True)
def nothing_ran() -> Iterator[None]:
    RAN.clear()
    yield
    RAN.clear()


def encrypting(*keys: Any, scope: str = "test", **options: Any) -> Codec:
    return Codec.from_options({"ENCRYPTION_KEYS": list(keys), **options},
                              encryption_scope=scope)


# --- the codec ------------------------------------------------------------------------------

VALUES = [
    "é", b"\x00\xff", 1.5, None, True, 2**70, [1, (2, 3)], {"a": {"b": [MARKER]}},
    "html " * 500, random.Random(3).randbytes(5000),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_an_entry_is_its_payload_sealed_28_bytes_larger(value):
    codec = encrypting(KEY1)
    payload, payload_flags, _ = codec.payload(value)
    data, flags = codec.encode(value, ":1:k")
    assert flags == payload_flags | FLAG_ENCRYPTED | key_id(KEY1) << 16
    assert key_id_of(flags) == key_id(KEY1)
    assert len(data) == len(payload) + OVERHEAD
    assert payload not in data
    got = codec.decode(data, flags, ":1:k")
    assert got == value and type(got) is type(value)


def test_compression_comes_before_encryption():
    codec = encrypting(KEY1)
    value = "compressible " * 2000
    data, flags = codec.encode(value, "k")
    payload, payload_flags = codec.opened(data, flags, "k")
    assert payload_flags & codec.compressor.flag  # the payload is the compressed form
    assert len(data) == len(payload) + OVERHEAD < len(pickle.dumps(value)) / 10


@pytest.mark.parametrize("value", [0, 42, -(2**63), 2**63 - 1])
def test_integers_stay_plain_decimal_text_for_incr(value):
    codec = encrypting(KEY1)
    assert codec.encode(value, "k") == (b"%d" % value, FLAG_INTEGER)
    assert codec.decode(b"%d" % value, FLAG_INTEGER, "k") == value


def test_every_value_gets_a_fresh_nonce():
    codec = encrypting(KEY1)
    sealed = {codec.encode("same", "k")[0] for _ in range(100)}
    assert len({data[:12] for data in sealed}) == 100


def test_a_text_key_is_derived_with_hkdf_never_used_raw():
    data, flags = encrypting(KEY1, scope="s").encode("value", "k")
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"django-kvcache",
                   info=b"django-kvcache ENCRYPTION_KEYS AES-256-GCM v1").derive(KEY1.encode())
    associated = encrypting(KEY1, scope="s").encryption.associated_data(flags, "k")
    payload = AESGCM(derived).decrypt(data[:12], data[12:], associated)
    assert pickle.loads(payload) == "value"
    with pytest.raises(Exception):
        AESGCM(KEY1.encode()[:32]).decrypt(data[:12], data[12:], associated)


def test_a_key_given_as_32_bytes_is_the_aes_key():
    data, flags = encrypting(RAW_KEY, scope="s").encode("value", "k")
    associated = encrypting(RAW_KEY, scope="s").encryption.associated_data(flags, "k")
    assert pickle.loads(AESGCM(RAW_KEY).decrypt(data[:12], data[12:], associated)) == "value"


@pytest.mark.parametrize("change", ["ciphertext", "nonce", "tag", "flags", "key", "scope",
                                    "truncated"])
def test_an_altered_or_moved_entry_fails_authentication_and_is_never_unpickled(change):
    codec = encrypting(KEY1, scope="mysql table a")
    data, flags = codec.encode(Exploit(), ":1:k")
    assert codec.decode(data, flags, ":1:k") == "unpickled" and RAN == ["unpickled"]
    RAN.clear()
    key, reader = ":1:k", codec
    if change in ("ciphertext", "nonce", "tag"):
        at = {"nonce": 3, "ciphertext": 20, "tag": len(data) - 2}[change]
        data = data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]
    elif change == "flags":
        flags ^= FLAG_PICKLE  # claims another serializer
    elif change == "key":
        key = ":1:other"
    elif change == "scope":
        reader = encrypting(KEY1, scope="mysql table b")
    else:
        data = data[:8]
    with pytest.raises(CorruptValue) as raised:
        reader.decode(data, flags, key)
    assert raised.value.reason in (
        f"not authentic, key id {key_id_text(key_id(KEY1))}",
        "not encrypted",  # the flags edit that removes the encryption bit
    )
    assert RAN == []


def test_an_unencrypted_entry_is_refused_unread_by_an_encrypting_cache():
    planted = pickle.dumps(Exploit())
    assert Codec.from_options({}).decode(planted, FLAG_PICKLE) == "unpickled"  # it runs code
    RAN.clear()
    with pytest.raises(CorruptValue) as raised:
        encrypting(KEY1).decode(planted, FLAG_PICKLE, "k")
    assert raised.value.reason == "not encrypted" and RAN == []


def test_a_cache_without_keys_reads_an_encrypted_entry_as_corrupt_naming_its_key_id():
    data, flags = encrypting(KEY1).encode("secret", "k")
    with pytest.raises(CorruptValue) as raised:
        Codec.from_options({}).decode(data, flags, "k")
    assert raised.value.reason == "encrypted"
    assert f"(key id {key_id_text(key_id(KEY1))})" in str(raised.value)


def test_keys_rotate_the_first_encrypts_every_one_decrypts():
    old = encrypting(KEY1)
    data, flags = old.encode("written with key 1", "k")
    both = encrypting(KEY2, KEY1)
    assert both.decode(data, flags, "k") == "written with key 1"
    assert key_id_of(both.encode("new", "k")[1]) == key_id(KEY2)
    resealed = both.encryption.resealed(data, flags, "k")
    assert key_id_of(resealed[1]) == key_id(KEY2)
    assert encrypting(KEY2).decode(*resealed, "k") == "written with key 1"
    assert both.encryption.resealed(*resealed, "k") is None  # already with the first key
    with pytest.raises(CorruptValue) as raised:
        encrypting(KEY2).decode(data, flags, "k")
    assert raised.value.reason == "unknown key id"
    assert f"key id {key_id_text(key_id(KEY1))}, which is not in" in str(raised.value)


@pytest.mark.parametrize("keys, message", [
    (KEY1, "must be a list of keys"),
    ([], "is empty: give at least one key, or None"),
    ([KEY1, ""], r"\[1\] is an empty string"),
    ([b"short bytes"], r"\[0\] is 11 bytes: a key given as bytes must be exactly 32"),
    ([42], r"\[0\] must be a str or 32 bytes, got a int"),
    ([KEY1, KEY2, KEY1], r"\[2\] has the key id of .*\[0\]"),
])
def test_a_bad_key_list_is_improperly_configured_never_repeating_a_key(keys, message):
    with pytest.raises(ImproperlyConfigured, match=message) as raised:
        Codec.from_options({"ENCRYPTION_KEYS": keys})
    assert "ENCRYPTION_KEYS" in str(raised.value)
    assert KEY1 not in str(raised.value) and "short bytes" not in str(raised.value)


def test_none_turns_encryption_off():
    assert Codec.from_options({"ENCRYPTION_KEYS": None}).encryption is None


def test_without_cryptography_keys_are_improperly_configured(monkeypatch):
    for name in [name for name in sys.modules if name.partition(".")[0] == "cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)  # what an import finds: nothing
    encryption._cipher.cache_clear()
    try:
        with pytest.raises(ImproperlyConfigured, match=r"pip install 'django-kvcache\[encrypt\]'"):
            MemcachedCache("127.0.0.1:1", {"OPTIONS": {"ENCRYPTION_KEYS": [KEY1]}})
    finally:
        encryption._cipher.cache_clear()


def test_an_encrypting_codec_needs_the_stored_key():
    with pytest.raises(TypeError, match="pass the stored key"):
        encrypting(KEY1).encode("value")


# --- both backends on real servers ----------------------------------------------------------


@pytest.fixture(scope="module")
def memcached_locations() -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield [stack.enter_context(memcached_node()).address for _ in range(2)]


class MySQLSide:
    """MySQLCache tables, and what anyone with database access sees of them."""

    name = "mysql"

    def __init__(self) -> None:
        self.built: list[MySQLCache] = []

    def build(self, keys: list[Any] | None = (KEY1,), table: str = TABLE_A,
              **params: Any) -> MySQLCache:
        options = {**params.pop("OPTIONS", {})}
        if keys is not None:
            options["ENCRYPTION_KEYS"] = list(keys)
        cache = make_cache(table, OPTIONS=options, **params)
        self.built.append(cache)
        return cache

    def raw(self, cache: MySQLCache, stored: str) -> tuple[bytes, int]:
        (value, flags), = sql(f"SELECT `value`, `flags` FROM `{cache.table}` "
                              "WHERE `cache_key` = %s", [stored])
        return bytes(value), flags

    def write_raw(self, cache: MySQLCache, stored: str, data: bytes, flags: int) -> None:
        sql(f"REPLACE INTO `{cache.table}` VALUES (%s, %s, %s, %s)",
            [stored, data, flags, 2**63 - 1])

    def everything(self, cache: MySQLCache, stored_keys: list[str]) -> bytes:
        """The cache's rows, as a raw SELECT returns them."""
        found = sql(f"SELECT * FROM `{cache.table}` WHERE `cache_key` IN "
                    f"({', '.join(['%s'] * len(stored_keys))})", stored_keys)
        assert len(found) == len(stored_keys)
        return b"".join(b"%s %s %d\n" % (key.encode(), bytes(value), flags)
                        for key, value, flags, _ in found)

    def clean(self) -> None:
        for cache in self.built:
            cache.clear()


class MemcachedSide:
    """memcached nodes of the module's own, and what anyone who reaches them sees."""

    name = "memcached"

    def __init__(self, locations: list[str]) -> None:
        self.locations = locations
        self.built: list[MemcachedCache] = []

    def build(self, keys: list[Any] | None = (KEY1,), **params: Any) -> MemcachedCache:
        options = {"IGNORE_EXCEPTIONS": False, **params.pop("OPTIONS", {})}
        if keys is not None:
            options["ENCRYPTION_KEYS"] = list(keys)
        params.pop("table", None)
        cache = MemcachedCache(self.locations, {**params, "OPTIONS": options})
        self.built.append(cache)
        return cache

    def raw(self, cache: MemcachedCache, stored: str) -> tuple[bytes, int]:
        return cache._node(stored).call(wire.get_one(stored.encode()))

    def write_raw(self, cache: MemcachedCache, stored: str, data: bytes, flags: int) -> None:
        cache._node(stored).call(wire.store(b"set", stored.encode(), data, flags, 0))

    def everything(self, cache: MemcachedCache, stored_keys: list[str]) -> bytes:
        """What a raw ``mg <key> v f k`` on each key's node answers."""
        replies = []
        for stored in stored_keys:
            host, port = cache._node(stored).pool.address.server
            with socket.create_connection((host, port), timeout=5) as conn:
                conn.sendall(b"mg %s v f k\r\nmn\r\n" % stored.encode())
                reply = b""
                while not reply.endswith(b"MN\r\n"):
                    reply += conn.recv(1 << 20)
            assert reply.startswith(b"VA "), reply[:80]
            replies.append(reply)
        return b"".join(replies)

    def clean(self) -> None:
        if self.built:
            self.built[0].clear()


@pytest.fixture(params=["mysql", "memcached"])
def side(request) -> Iterator[Any]:
    if request.param == "mysql":
        chosen: Any = MySQLSide()
    else:
        chosen = MemcachedSide(request.getfixturevalue("memcached_locations"))
    yield chosen
    chosen.clean()


@pytest.fixture(scope="module", autouse=True)
def tables(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    yield
    with django_db_blocker.unblock():
        for table in (TABLE_A, TABLE_B):
            drop_table(table)


def warnings_naming(caplog: Any, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and text in r.getMessage()]


class Row:
    """A model-like value: pickled, compressible when there are many."""

    def __init__(self, n: int) -> None:
        self.id, self.name, self.email = n, f"user {n}", f"user{n}@example.com"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Row) and vars(self) == vars(other)


ROUND_TRIP = {
    "text": "é" * 10,
    "bytes": b"\x00\xff" * 10,
    "float": 2.5,
    "none": None,
    "bool": False,
    "big_int": 2**70,
    "nested": {"a": [1, (2, 3)], "b": {4}},
    "rows_compressed": [Row(n) for n in range(200)],
    "html_compressed": "<div class='item'>entry</div>\n" * 500,
    "random_bytes": random.Random(5).randbytes(3000),
    "int": 7,
}


def test_every_value_kind_round_trips(side, api):
    cache = api(side.build())
    cache.set("single", ROUND_TRIP["html_compressed"])
    assert cache.set_many(ROUND_TRIP) == []
    assert cache.get_many(list(ROUND_TRIP)) == ROUND_TRIP
    for name, value in ROUND_TRIP.items():
        assert cache.get(name) == value
    assert cache.add("added", ROUND_TRIP["nested"]) is True
    assert cache.get_or_set("made", lambda: ROUND_TRIP["rows_compressed"]) == \
        ROUND_TRIP["rows_compressed"]
    assert cache.get("added") == ROUND_TRIP["nested"]
    assert cache.get("made") == ROUND_TRIP["rows_compressed"]
    assert cache.incr_version("single") == 2
    assert cache.get("single", version=2) == ROUND_TRIP["html_compressed"]
    raw = side.raw(cache.cache if isinstance(cache, AsyncAPI) else cache,
                   cache.make_and_validate_key("html_compressed"))
    assert raw[1] & FLAG_ENCRYPTED


@pytest.mark.skipif(zstd_engine() is None, reason="zstd not installed (extra 'zstd')")
def test_the_dictionary_path_compresses_the_plaintext(side, api, tmp_path):
    rng = random.Random(11)
    samples = [pickle.dumps(api_response(rng)) for _ in range(400)]
    path = tmp_path / "dictionary"
    path.write_bytes(train_dictionary(samples, 8192))
    cache = side.build(OPTIONS={"COMPRESS_DICTIONARY": [str(path)], "COMPRESS_MIN_LENGTH": 0})
    value = api_response(random.Random(99))
    api(cache).set("response", value)
    stored = cache.make_and_validate_key("response")
    data, flags = side.raw(cache, stored)
    assert flags & FLAG_ENCRYPTED and flags & FLAG_ZSTD
    payload, payload_flags = cache.codec.opened(data, flags, stored)
    assert frame_dictionary_id(payload) == dictionary_id(path.read_bytes())
    assert len(data) == len(payload) + OVERHEAD
    assert api(cache).get("response") == value


def test_the_stored_bytes_hold_no_plaintext(side):
    values = {"short": MARKER, "pickled": {"k": [MARKER] * 3},
              "compressible": f"{MARKER} " + "filler text " * 200}
    plain, sealed = side.build(keys=None, KEY_PREFIX="plain"), side.build()
    for cache in (plain, sealed):
        cache.set_many(values)
        cache.set("one", MARKER)
    seen = {cache: side.everything(cache, [cache.make_and_validate_key(k) for k in
                                           [*values, "one"]]) for cache in (plain, sealed)}
    assert MARKER.encode() in seen[plain]  # the check can fail: unencrypted, it is there
    assert MARKER.encode() not in seen[sealed]
    assert sealed.get("short") == MARKER


def move(side, source_cache, source_key, target_cache, target_key, target_side=None) -> None:
    """Copy an entry's stored bytes and flags, as someone with write access could."""
    data, flags = side.raw(source_cache, source_cache.make_and_validate_key(source_key))
    (target_side or side).write_raw(
        target_cache, target_cache.make_and_validate_key(target_key), data, flags)


def test_an_altered_or_moved_entry_is_a_miss_logged_once_and_never_unpickled(side, api, caplog):
    cache = side.build()
    other_cache = side.build(KEY_PREFIX="other")  # same keys, same table or nodes
    caller = api(cache)
    caller.set("exploit", Exploit())
    assert cache.get("exploit") == "unpickled" and RAN == ["unpickled"]  # it runs code
    RAN.clear()
    stored = cache.make_and_validate_key("exploit")
    data, flags = side.raw(cache, stored)

    flipped = cache.make_and_validate_key("flipped")
    side.write_raw(cache, flipped, data[:20] + bytes([data[20] ^ 0x40]) + data[21:], flags)
    move(side, cache, "exploit", cache, "moved")
    move(side, cache, "exploit", other_cache, "exploit")
    side.write_raw(cache, cache.make_and_validate_key("edited_flags"), data, flags ^ 0x100)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            assert caller.get("flipped", "default") == "default"
            assert caller.get("moved") is None
            assert caller.get_many(["flipped", "moved", "edited_flags"]) == {}
            assert api(other_cache).get("exploit") is None
            assert api(other_cache).get_many(["exploit"]) == {}
    assert RAN == []
    lines = warnings_naming(caplog, f"key id {key_id_text(key_id(KEY1))}")
    assert len(lines) == 1, lines  # rate-limited: one line for the episode
    assert "failed authentication" in lines[0]
    assert KEY1 not in caplog.text
    assert caller.get("exploit") == "unpickled"  # the original still reads


def test_an_entry_moved_between_tables_or_backends_does_not_decrypt(
        memcached_locations, caplog):
    mysql, memcached = MySQLSide(), MemcachedSide(memcached_locations)
    in_a, in_b = mysql.build(table=TABLE_A), mysql.build(table=TABLE_B)
    on_nodes = memcached.build()
    try:
        in_a.set("k", Exploit())
        move(mysql, in_a, "k", in_b, "k")
        move(mysql, in_a, "k", on_nodes, "k", memcached)
        move(mysql, in_a, "k", in_a, "k2")
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert in_b.get("k") is None and in_b.get_many(["k"]) == {}
            assert on_nodes.get("k") is None
        assert RAN == []
        assert len(warnings_naming(caplog, "failed authentication")) == 2  # one per backend
    finally:
        mysql.clean()
        memcached.clean()


def test_an_unencrypted_entry_planted_in_an_encrypting_cache_is_never_unpickled(side, api, caplog):
    cache = side.build()
    stored = cache.make_and_validate_key("planted")
    side.write_raw(cache, stored, pickle.dumps(Exploit()), FLAG_PICKLE)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert api(cache).get("planted") is None
        assert api(cache).get_many(["planted"]) == {}
    assert RAN == []
    assert len(warnings_naming(caplog, "stored unencrypted")) == 1
    side.write_raw(cache, stored, b"41", FLAG_INTEGER)  # integers are read: plain by design
    assert api(cache).incr("planted") == 42


def test_keys_rotate_without_a_flush(side, api, caplog):
    first = side.build(keys=[KEY1])
    first.set_many({f"k{n}": f"value {n}" for n in range(10)})
    rotated = api(side.build(keys=[KEY2, KEY1]))
    assert rotated.get_many([f"k{n}" for n in range(10)]) == {
        f"k{n}": f"value {n}" for n in range(10)}
    rotated.set("new", "written with key 2")
    stored = rotated.make_and_validate_key("new")
    assert key_id_of(side.raw(first, stored)[1]) == key_id(KEY2)

    only_new = api(side.build(keys=[KEY2]))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert only_new.get_many([f"k{n}" for n in range(10)]) == {}
        assert only_new.get("k1") is None
    assert only_new.get("new") == "written with key 2"
    lines = warnings_naming(caplog, f"key id {key_id_text(key_id(KEY1))}")
    assert len(lines) == 1 and "not in ENCRYPTION_KEYS" in lines[0], lines


def test_counters_stay_plain_and_count_on_the_server(side, api):
    cache = api(side.build())
    cache.set("hits", 10)
    assert cache.incr("hits", 5) == 15
    assert cache.decr("hits", 20) == -5
    assert cache.get("hits") == -5
    plain = cache.cache if isinstance(cache, AsyncAPI) else cache
    assert side.raw(plain, plain.make_and_validate_key("hits")) == (b"-5", FLAG_INTEGER)
    cache.set("name", "not a number")
    with pytest.raises(TypeError):
        cache.incr("name")


# memcached's incr reads any value that starts like a number (spaces, a sign, digits, then
# a space, a newline or a NUL) as that number; an encrypted value starts with its nonce.
@pytest.mark.parametrize("nonce_start", [b"7\n", b" 42 ", b"-0\0", b"+5\r"],
                         ids=["digit", "space", "minus", "plus"])
def test_incr_of_an_encrypted_text_raises_whatever_its_random_nonce(side, monkeypatch, nonce_start):
    cache = side.build()
    random_bytes = os.urandom
    unlucky = [nonce_start.ljust(encryption.NONCE_BYTES, b"\xff")]

    def urandom(size: int) -> bytes:  # the first nonce drawn is the unlucky one
        return unlucky.pop() if unlucky and size == encryption.NONCE_BYTES else random_bytes(size)

    with monkeypatch.context() as patched:
        patched.setattr(os, "urandom", urandom)
        cache.set("name", "not a number")
    with pytest.raises(TypeError):
        cache.incr("name")
    assert cache.get("name") == "not a number"


def test_ttl_and_herd_protection_work_on_encrypted_entries(side, api):
    cache = side.build(OPTIONS={"LEASE_TIMEOUT": 2, "STALE_TIMEOUT": 30})
    caller = api(cache)
    assert caller.get_or_set("k", "computed", timeout=60) == "computed"
    assert 55 <= cache.ttl("k") <= 60
    assert caller.get_or_set("k", "again", timeout=60) == "computed"


def test_a_stale_copy_on_memcached_is_encrypted_and_bound_to_its_own_key(memcached_locations):
    memcached = MemcachedSide(memcached_locations)
    cache = memcached.build(OPTIONS={"LEASE_TIMEOUT": 2, "STALE_TIMEOUT": 30})
    try:
        cache.get_or_set("k", "old", timeout=60)
        store = cache._lease_store("k", 60, None)
        node = cache._node(cache.make_and_validate_key("k"))  # the copy lives beside it
        data, flags = node.call(wire.get_one(store.stale_key))
        assert flags & FLAG_ENCRYPTED
        assert cache.codec.decode(data, flags, store.stale_item) == "old"
        with pytest.raises(CorruptValue):
            cache.codec.decode(data, flags, cache.make_and_validate_key("k"))
        node.call(wire.delete(cache.make_and_validate_key("k").encode()))  # as if expired
        holder = cache._lease_store("k", 60, None)
        assert steps.run(holder.read()).won
        assert steps.run(cache._lease_store("k", 60, None).read()) == \
            stampede.Read("old", False, False)  # the stale copy, decrypted
        steps.run(holder.release())
    finally:
        memcached.clean()


def test_prefix_helpers_and_culling_work_on_encrypted_rows(api):
    mysql = MySQLSide()
    cache = mysql.build(OPTIONS={"MAX_ENTRIES": 5, "CULL_FREQUENCY": 5})
    caller = api(cache)
    try:
        caller.set_many({f"user:{n}": {"n": n, "name": MARKER} for n in range(8)})
        assert cache.keys_with_prefix("user:") == [f"user:{n}" for n in range(8)]
        assert cache.get_with_prefix("user:") == {
            f"user:{n}": {"n": n, "name": MARKER} for n in range(8)}
        assert cache.cull() == 4  # down to MAX_ENTRIES - MAX_ENTRIES // CULL_FREQUENCY
        assert len(cache.get_with_prefix("user:")) == 4
        assert cache.delete_with_prefix("user:") == 4
    finally:
        mysql.clean()


def test_incr_of_a_pickled_big_int_under_a_version_says_so(caplog):
    """The row is read back to say why incr refused it: with ENCRYPTION_KEYS it opens only
    under the key it was stored with, the versioned one."""
    mysql = MySQLSide()
    cache = mysql.build()
    try:
        cache.set("big", 2**70, version=2)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            with pytest.raises(TypeError, match="beyond the signed 64-bit range"):
                cache.incr("big", version=2)
        assert warnings_naming(caplog, "") == []
    finally:
        mysql.clean()


# --- kvcache_rotate_key ----------------------------------------------------------------------


def key_ids_in(cache: MySQLCache) -> dict[str, int]:
    """Each row's key id, by stored key (0 for an unencrypted row)."""
    return {key: key_id_of(flags) if flags & FLAG_ENCRYPTED else 0
            for key, flags in sql(f"SELECT `cache_key`, `flags` FROM `{cache.table}`")}


@pytest.fixture
def rotation() -> Iterator[tuple[MySQLSide, MySQLCache, MySQLCache]]:
    """25 entries of the "site" cache written with key 1, a counter, and a neighbour in the
    same table (KEY_PREFIX "other", key 1 only) whose rows the rotation must not touch."""
    mysql = MySQLSide()
    old = mysql.build(keys=[KEY1], KEY_PREFIX="site")
    old.set_many({f"k{n:02}": f"value {n}" for n in range(25)}, timeout=600)
    old.set("counter", 7)
    neighbour = mysql.build(keys=[KEY1], KEY_PREFIX="other")
    neighbour.set_many({f"k{n}": n * 1.5 for n in range(5)})
    rotating = mysql.build(keys=[KEY2, KEY1], KEY_PREFIX="site")
    yield mysql, rotating, neighbour
    mysql.clean()


def test_rotation_reencrypts_this_cache_s_entries_in_bounded_batches(rotation):
    mysql, rotating, neighbour = rotation
    rotating.set("new", "written with key 2")
    ttl_before = rotating.ttl("k03")
    done = rotating.rotate_encryption_key(batch_rows=4)
    assert (done.resealed, done.current, done.unreadable) == (25, 1, 0)
    assert done.examined == 27 and done.batches == 7 and done.resume_after is None
    ids = key_ids_in(rotating)
    assert {ids[f"site:1:k{n:02}"] for n in range(25)} == {key_id(KEY2)}
    assert ids["site:1:counter"] == 0  # plain, untouched
    assert {ids[f"other:1:k{n}"] for n in range(5)} == {key_id(KEY1)}  # not this cache's
    only_new = mysql.build(keys=[KEY2], KEY_PREFIX="site")
    assert only_new.get_many([f"k{n:02}" for n in range(25)]) == {
        f"k{n:02}": f"value {n}" for n in range(25)}
    assert ttl_before - 1 < only_new.ttl("k03") <= ttl_before  # the expiry is kept
    assert neighbour.get_many([f"k{n}" for n in range(5)]) == {f"k{n}": n * 1.5 for n in range(5)}
    again = rotating.rotate_encryption_key(batch_rows=4)
    assert (again.resealed, again.current) == (0, 26)  # nothing left: only read


def test_rotation_stopped_after_some_batches_resumes_where_it_stopped(rotation):
    mysql, rotating, _ = rotation
    first = rotating.rotate_encryption_key(batch_rows=5, max_batches=2)
    # In key order: site:1:counter, then k00 to k08 (ten rows, nine entries to rotate).
    assert (first.resealed, first.batches) == (9, 2)
    assert first.resume_after == "site:1:k08"
    ids = key_ids_in(rotating)
    assert [ids[f"site:1:k{n:02}"] == key_id(KEY2) for n in range(25)] == [True] * 9 + [False] * 16
    rest = rotating.rotate_encryption_key(batch_rows=5, after=first.resume_after)
    assert (rest.resealed, rest.current, rest.resume_after) == (16, 0, None)
    assert {key_ids_in(rotating)[f"site:1:k{n:02}"] for n in range(25)} == {key_id(KEY2)}


def test_a_row_written_while_its_batch_is_reencrypted_keeps_the_new_value(rotation):
    mysql, rotating, _ = rotation
    plan = rotating._rotate(100, None, "")
    scans = next(plan).run()
    rotating.set("k05", "written meanwhile")  # after the scan, before the write
    rotating.delete("k06")
    writes = plan.send(scans)
    with pytest.raises(StopIteration) as finished:
        plan.send(writes.run())
    assert finished.value.value.resealed == 23
    assert rotating.get("k05") == "written meanwhile" and rotating.get("k06") is None
    assert mysql.build(keys=[KEY2], KEY_PREFIX="site").get("k07") == "value 7"


def test_rows_no_key_opens_are_counted_left_alone_and_logged_once(rotation, caplog):
    mysql, rotating, _ = rotation
    lost = mysql.build(keys=["a key nobody configures any more, abcdefghij"], KEY_PREFIX="site")
    lost.set_many({"lost1": 1.5, "lost2": 2.5})
    stored = rotating.make_and_validate_key("k00")
    data, flags = mysql.raw(rotating, stored)
    mysql.write_raw(rotating, stored, data[:-1] + bytes([data[-1] ^ 1]), flags)  # altered
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        done = rotating.rotate_encryption_key()
    assert (done.resealed, done.unreadable) == (24, 3)
    assert mysql.raw(rotating, stored)[1] == flags  # left as it was
    lost_id = key_id_text(key_id_of(mysql.raw(lost, lost.make_and_validate_key("lost1"))[1]))
    assert len(warnings_naming(caplog, f"key id {lost_id}, which is not in")) == 1
    assert len(warnings_naming(caplog, "failed authentication")) == 1
    assert "not re-encrypted" in caplog.text and KEY1 not in caplog.text


def rotate_command(*args: str) -> str:
    out = io.StringIO()
    call_command("kvcache_rotate_key", *args, stdout=out)
    return out.getvalue()


def test_the_command_reencrypts_reports_and_says_where_to_continue(rotation):
    mysql, rotating, _ = rotation
    caches = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
              "site": {"BACKEND": BACKEND, "LOCATION": TABLE_A,
                       "OPTIONS": {"ENCRYPTION_KEYS": [KEY2, KEY1]}, "KEY_PREFIX": "site"}}
    new_id = key_id_text(key_id(KEY2))
    with override_settings(CACHES=caches):
        out = rotate_command("site", "--batch-size", "5", "--max-batches", "1")
        assert out == (
            f"site: 4 entries re-encrypted with key id {new_id}, 0 had it already, 5 rows "
            "examined in 1 batches.\nsite: stopped after 1 batches; continue with "
            "--after 'site:1:k03'\n")
        out = rotate_command("site", "--after", "site:1:k03")
        assert out.startswith(f"site: 21 entries re-encrypted with key id {new_id}, 0 had it")
        assert "site: done. Once every process" in out
        assert rotate_command("site", "--verbosity", "0") == ""
    assert {key_ids_in(rotating)[f"site:1:k{n:02}"] for n in range(25)} == {key_id(KEY2)}


@pytest.mark.parametrize("alias, message", [
    ("plain", "plain: the cache has no OPTIONS['ENCRYPTION_KEYS']: nothing to re-encrypt"),
    ("nodes", "'nodes' is not a MySQLCache"),
    ("missing", "No cache named 'missing'"),
])
def test_the_command_refuses_what_it_cannot_rotate(alias, message, memcached_locations):
    caches = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
              "plain": {"BACKEND": BACKEND, "LOCATION": TABLE_A},
              "nodes": {"BACKEND": MEMCACHED,
                        "LOCATION": memcached_locations,
                        "OPTIONS": {"ENCRYPTION_KEYS": [KEY1]}}}
    with override_settings(CACHES=caches):
        with pytest.raises(CommandError, match=re.escape(message)):
            rotate_command(alias)


SHARDS = list(settings.SHARD_ALIASES)


@pytest.mark.skipif(len(SHARDS) < 3, reason="needs KVCACHE_MYSQL_SHARD_PORTS (two ports)")
@pytest.mark.django_db(transaction=True, databases=["default", *SHARDS])
def test_rotation_covers_every_shard():
    mysql = MySQLSide()
    old = mysql.build(keys=[KEY1], table="kvcache_encrypted_shards", OPTIONS={"DATABASES": SHARDS})
    try:
        old.set_many({f"k{n}": n * 0.5 for n in range(60)})
        rotating = mysql.build(keys=[KEY2, KEY1], table="kvcache_encrypted_shards",
                               OPTIONS={"DATABASES": SHARDS})
        first = rotating.rotate_encryption_key(batch_rows=7, max_batches=2)
        assert first.resume_after is not None and 0 < first.resealed <= 42
        rest = rotating.rotate_encryption_key(batch_rows=7, after=first.resume_after)
        assert first.resealed + rest.resealed == 60  # each shard resumed at the lowest cursor
        reader = mysql.build(keys=[KEY2], table="kvcache_encrypted_shards",
                             OPTIONS={"DATABASES": SHARDS})
        assert reader.get_many([f"k{n}" for n in range(60)]) == {f"k{n}": n * 0.5 for n in range(60)}
        assert all(len(sql("SELECT 1 FROM `kvcache_encrypted_shards`", alias=alias)) > 5
                   for alias in SHARDS)
    finally:
        mysql.clean()
        for alias in SHARDS:
            drop_table("kvcache_encrypted_shards", alias)


# --- system checks ------------------------------------------------------------------------


def checked(caches: dict[str, Any]) -> list[Any]:
    with override_settings(CACHES={
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}, **caches
    }):
        return check_encryption_keys() + check_shared_encryption()


def test_a_weak_key_is_an_error_that_never_repeats_it(memcached_locations):
    weak = ["short key", "a" * 40, b"\0" * 32]
    messages = checked({"mc": {"BACKEND": MEMCACHED, "LOCATION": memcached_locations,
                               "OPTIONS": {"ENCRYPTION_KEYS": [KEY1, *weak]}}})
    assert [(m.id, m.msg.partition(" too")[0]) for m in messages] == [
        ("kvcache.E011", "CACHES['mc']['OPTIONS']['ENCRYPTION_KEYS'][1] is 9 characters long, "
                         "fewer than 32:"),
        ("kvcache.E011", "CACHES['mc']['OPTIONS']['ENCRYPTION_KEYS'][2] uses only 1 distinct "
                         "characters:"),
        ("kvcache.E011", "CACHES['mc']['OPTIONS']['ENCRYPTION_KEYS'][3] uses only 1 distinct "
                         "byte values: not random bytes:"),
    ]
    assert not any("short key" in m.msg or "a" * 40 in m.msg for m in messages)
    assert "secrets.token_urlsafe(32)" in messages[0].hint


def test_caches_sharing_a_table_or_nodes_are_warned_when_their_keys_disagree(memcached_locations):
    encrypted = {"ENCRYPTION_KEYS": [KEY1]}
    mysql = {"BACKEND": BACKEND, "LOCATION": TABLE_A}
    nodes = {"BACKEND": MEMCACHED, "LOCATION": memcached_locations}
    assert checked({"a": {**mysql, "OPTIONS": encrypted},
                    "b": {**mysql, "KEY_PREFIX": "b", "OPTIONS": encrypted},
                    "c": {**mysql, "LOCATION": "kvcache_elsewhere"},  # another table
                    "d": {**nodes, "OPTIONS": encrypted},
                    "e": {**nodes, "KEY_PREFIX": "e", "OPTIONS": {"ENCRYPTION_KEYS": [KEY2]}},
                    "f": {**mysql, "LOCATION": TABLE_B, "OPTIONS": {"ENCRYPTION_KEYS": [KEY2]},
                          "KEY_PREFIX": "f"}}) == [
        ]  # the same keys, or none anywhere near, or other prefixes with their own keys
    messages = checked({"a": {**mysql, "OPTIONS": encrypted},
                        "plain": {**mysql, "KEY_PREFIX": "plain"},
                        "d": {**nodes, "OPTIONS": {"ENCRYPTION_KEYS": [KEY2, KEY1]}},
                        "e": {**nodes, "OPTIONS": encrypted}})
    assert [m.id for m in messages] == ["kvcache.W011", "kvcache.W011"]
    assert messages[0].msg == (
        f"CACHES['a'] and CACHES['plain'] keep their entries in the same place (table "
        f"'{TABLE_A}' in database 'default'), but only one of them has ENCRYPTION_KEYS: "
        "CACHES['plain'] stores its entries unencrypted where the other's are encrypted, "
        "readable by anyone who can read the other's ciphertext, and each reads the "
        "other's entries as misses.")
    assert messages[1].msg.startswith("CACHES['d'] and CACHES['e'] keep their entries in the "
                                      "same place (memcached node ")
    assert messages[1].msg.endswith(
        f"but CACHES['d'] encrypts with key id {key_id_text(key_id(KEY2))}, which is not "
        "among CACHES['e']'s ENCRYPTION_KEYS: what one writes, the other reads as a miss.")


# The check command asks every database alias's server (Django 6.1's model checks): see
# the check_order fixture.
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_without_cryptography_the_check_command_says_what_to_install(monkeypatch, check_order,
                                                                     memcached_locations):
    for name in [name for name in sys.modules if name.partition(".")[0] == "cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)
    encryption._cipher.cache_clear()
    caches = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
              "secret": {"BACKEND": MEMCACHED, "LOCATION": memcached_locations,
                         "OPTIONS": {"ENCRYPTION_KEYS": [KEY1]}}}
    try:
        with override_settings(CACHES=caches):
            with pytest.raises(ImproperlyConfigured) as raised:
                call_command("check")
    finally:
        encryption._cipher.cache_clear()
    assert str(raised.value) == (
        "CACHES['secret']['OPTIONS']['ENCRYPTION_KEYS'] needs cryptography: install the "
        "cryptography package (pip install 'django-kvcache[encrypt]')")


def test_entries_naming_many_unknown_key_ids_do_not_flood_the_log(side, caplog):
    """Someone with write access can put any key id in the flags: one line, whatever ids."""
    cache = side.build()
    data, flags = cache.codec.encode("value", cache.make_and_validate_key("k0"))
    for n in range(30):
        forged = (flags & ~encryption.KEY_ID_MASK) | (n + 1) << encryption.KEY_ID_SHIFT
        side.write_raw(cache, cache.make_and_validate_key(f"k{n}"), data, forged)
    keyless = side.build(keys=None)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cache.get_many([f"k{n}" for n in range(30)]) == {}
        assert keyless.get_many([f"k{n}" for n in range(30)]) == {}
    lines = warnings_naming(caplog, "")
    assert len(lines) == 2, lines  # one for each cache's kind of failure
    assert re.search(r"key id 00[01][0-9a-f], which is not in ENCRYPTION_KEYS", lines[0])
    assert re.search(r"encrypted \(key id 00[01][0-9a-f]\), and this cache has no", lines[1])
