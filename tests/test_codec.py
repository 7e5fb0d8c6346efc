"""The shared value codec: round trips, flag layout, compression, pluggable parts."""
from __future__ import annotations

import datetime
import decimal
import pickle
import random
import zlib

import pytest
from django.core.exceptions import ImproperlyConfigured
from pymemcache import serde as pymemcache_serde

from django_kvcache.codec import (
    FLAG_INTEGER,
    FLAG_JSON,
    FLAG_PICKLE,
    FLAG_SIGNED_PICKLE,
    FLAG_TEXT,
    FLAG_ZLIB,
    INT64_MAX,
    INT64_MIN,
    Codec,
    CorruptValue,
    JSONSerializer,
    PickleSerializer,
    ZlibCompressor,
)
from django_kvcache.zstd import FLAG_ZSTD, no_dictionary, zstd_engine
from tests.models import Poll
from tests.codec_support import MAIN_ENTRIES, MAIN_TOKEN, alphanumeric
from tests.zstd_support import ZSTD_ENTRY, ZSTD_ENTRY_FLAGS, ZSTD_ENTRY_VALUE

COMPRESSIBLE = "django-kvcache " * 1000

VALUES = [
    "plain text",
    "text with 4-byte UTF-8: \U0001f600 \U00010348 and é",
    b"\x00\xffbinary\r\n",
    b"",
    "",
    0,
    1,
    -1,
    INT64_MAX,
    INT64_MIN,
    INT64_MAX + 1,
    INT64_MIN - 1,
    10**40,
    True,
    False,
    None,
    1.5,
    float("inf"),
    decimal.Decimal("3.14"),
    datetime.datetime(2026, 11, 21, 10, 15),
    {"a": [1, 2, {"b": (3, 4)}], 5: None},
    [1, "two", 3.0],
    (1, 2),
    {1, 2, 3},
    COMPRESSIBLE,
    COMPRESSIBLE.encode(),
    Poll(id=7, question="Why?", answers=3),
]


#: These tests are about zlib and the flag layout other clients share; the default
#: compressor (zstd where installed) has its own tests at the end and in test_zstd.py.
ZLIB = {"COMPRESSOR": "django_kvcache.codec.ZlibCompressor"}


@pytest.fixture
def codec() -> Codec:
    return Codec.from_options(ZLIB)


def same(a, b) -> bool:
    if isinstance(a, Poll):
        return isinstance(b, Poll) and (a.pk, a.question, a.answers) == (b.pk, b.question, b.answers)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_round_trip(codec, value):
    data, flags = codec.encode(value)
    assert isinstance(data, bytes)
    assert same(codec.decode(data, flags), value)


@pytest.mark.parametrize("value", [0, 42, -42, INT64_MAX, INT64_MIN])
def test_int64_is_decimal_text_for_server_side_incr(codec, value):
    assert codec.encode(value) == (str(value).encode(), FLAG_INTEGER)


@pytest.mark.parametrize("value", [True, False, INT64_MAX + 1, INT64_MIN - 1])
def test_bools_and_big_ints_are_pickled(codec, value):
    data, flags = codec.encode(value)
    assert flags == FLAG_PICKLE
    assert pickle.loads(data) is value or pickle.loads(data) == value


class Count(int):
    pass


def test_int_subclass_keeps_its_type(codec):
    data, flags = codec.encode(Count(3))
    assert flags == FLAG_PICKLE
    assert type(codec.decode(data, flags)) is Count


def test_compressible_payload_is_zlib_compressed(codec):
    data, flags = codec.encode(COMPRESSIBLE)
    assert flags == FLAG_PICKLE | FLAG_ZLIB
    assert len(data) < len(COMPRESSIBLE) / 10
    assert pickle.loads(zlib.decompress(data)) == COMPRESSIBLE


def test_incompressible_payload_is_kept_raw(codec):
    noise = random.Random(1).randbytes(2000)  # random bytes: zlib cannot shrink them
    data, flags = codec.encode(noise)
    assert flags == FLAG_PICKLE
    assert pickle.loads(data) == noise


def test_short_payload_is_not_compressed():
    codec = Codec.from_options({**ZLIB, "COMPRESS_MIN_LENGTH": 1000})
    value = "a" * 500
    assert codec.encode(value)[1] == FLAG_PICKLE
    assert codec.encode("a" * 2000)[1] == FLAG_PICKLE | FLAG_ZLIB


def test_compression_level_is_used():
    fast = Codec.from_options({**ZLIB, "COMPRESS_LEVEL": 1}).encode(COMPRESSIBLE + str(list(range(3000))))
    best = Codec.from_options({**ZLIB, "COMPRESS_LEVEL": 9}).encode(COMPRESSIBLE + str(list(range(3000))))
    assert len(best[0]) < len(fast[0])


def test_compression_off_still_reads_compressed_entries(codec):
    data, flags = codec.encode(COMPRESSIBLE)
    plain = Codec.from_options({"COMPRESSOR": None})
    assert plain.encode(COMPRESSIBLE)[1] == FLAG_PICKLE
    assert plain.decode(data, flags) == COMPRESSIBLE


# --- compatibility with pymemcache's serde (the flag layout pylibmc and python-memcached share)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_pymemcache_reads_our_values(codec, value):
    data, flags = codec.encode(value)
    compressed = pymemcache_serde.CompressedSerde(min_compress_len=10**9)  # read-side only
    assert same(compressed.deserialize(b"key", data, flags), value)
    if not flags & FLAG_ZLIB:
        assert same(pymemcache_serde.python_memcache_deserializer(b"key", data, flags), value)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_we_read_pymemcache_values(codec, value):
    for serde in (pymemcache_serde.pickle_serde, pymemcache_serde.CompressedSerde()):
        data, flags = serde.serialize(b"key", value)
        if isinstance(data, str):  # pymemcache encodes int text on the way to the wire
            data = data.encode()
        assert same(codec.decode(data, flags), value)


# --- serializers


def test_json_serializer_round_trip_and_flag():
    codec = Codec.from_options({"SERIALIZER": "django_kvcache.codec.JSONSerializer"})
    value = {"name": "é\U0001f600", "items": [1, 2.5, None, True]}
    data, flags = codec.encode(value)
    assert flags == FLAG_JSON
    assert codec.decode(data, flags) == value
    assert codec.encode(12) == (b"12", FLAG_INTEGER)


def test_json_codec_refuses_pickle_entries():
    """An entry pickled by someone else is never unpickled by a JSON-configured cache."""
    pickled = Codec.from_options(ZLIB).encode({"x": 1})
    codec = Codec.from_options({"SERIALIZER": "django_kvcache.codec.JSONSerializer"})
    with pytest.raises(CorruptValue):
        codec.decode(*pickled)


def test_json_serializer_rejects_unserializable_values():
    codec = Codec(JSONSerializer())
    with pytest.raises(TypeError):
        codec.encode(object())


def test_custom_serializer_by_dotted_path():
    codec = Codec.from_options({"SERIALIZER": "tests.test_codec.ReversedSerializer"})
    data, flags = codec.encode("abc")
    assert (data, flags) == (b"cba", ReversedSerializer.flag)
    assert codec.decode(data, flags) == "abc"


class ReversedSerializer:
    flag = 1 << 12

    def __init__(self, options):
        pass

    def dumps(self, value):
        return value.encode()[::-1]

    def loads(self, data):
        return data[::-1].decode()


# --- corrupt entries


@pytest.mark.parametrize(
    "data, flags",
    [
        (b"not a pickle", FLAG_PICKLE),
        (b"not zlib", FLAG_PICKLE | FLAG_ZLIB),
        (b"12a", FLAG_INTEGER),
        (b"x", 1 << 13),
        (zlib.compress(b"not a pickle"), FLAG_PICKLE | FLAG_ZLIB),
    ],
)
def test_corrupt_entries_raise_corrupt_value(codec, data, flags):
    with pytest.raises(CorruptValue):
        codec.decode(data, flags)


# --- configuration errors name the option


@pytest.mark.parametrize(
    "options, option",
    [
        ({"SERIALIZER": "no.such.Serializer"}, "SERIALIZER"),
        ({"SERIALIZER": 3}, "SERIALIZER"),
        ({"SERIALIZER": None}, "SERIALIZER"),  # COMPRESSOR None is "off"; this has no off
        ({"COMPRESSOR": "django_kvcache.codec.Nope"}, "COMPRESSOR"),
        ({**ZLIB, "COMPRESS_LEVEL": 10}, "COMPRESS_LEVEL"),
        ({"COMPRESS_LEVEL": "1"}, "COMPRESS_LEVEL"),
        ({"COMPRESS_MIN_LENGTH": -1}, "COMPRESS_MIN_LENGTH"),
        ({"COMPRESS_MIN_LENGTH": 1.5}, "COMPRESS_MIN_LENGTH"),
    ],
)
def test_bad_options_raise_improperly_configured(options, option):
    with pytest.raises(ImproperlyConfigured, match=option):
        Codec.from_options(options)


def test_default_serializer_is_pickle(codec):
    assert isinstance(codec.serializer, PickleSerializer)


# --- signed pickle


SIGNED = "django_kvcache.codec.SignedPickleSerializer"


def test_signed_pickle_round_trip_and_flag():
    codec = Codec.from_options({"SERIALIZER": SIGNED, "SIGNING_KEY": "k1"})
    for value in [{"a": 1}, COMPRESSIBLE, Poll(id=1, question="q", answers=0)]:
        data, flags = codec.encode(value)
        assert flags & ~(FLAG_ZLIB | FLAG_ZSTD) == FLAG_SIGNED_PICKLE
        assert same(codec.decode(data, flags), value)


def test_signed_pickle_rejects_unsigned_and_tampered_entries():
    codec = Codec.from_options({"SERIALIZER": SIGNED, "SIGNING_KEY": "k1", "COMPRESSOR": None})
    unsigned = Codec.from_options(ZLIB).encode({"x": 1})
    with pytest.raises(CorruptValue):
        codec.decode(*unsigned)
    data, flags = codec.encode({"x": 1})
    tampered = data[:-2] + bytes([data[-2] ^ 1]) + data[-1:]
    with pytest.raises(CorruptValue, match="bad signature"):
        codec.decode(tampered, flags)
    forged = data[:32] + pickle.dumps({"x": 2})
    with pytest.raises(CorruptValue, match="bad signature"):
        codec.decode(forged, flags)
    with pytest.raises(CorruptValue):
        codec.decode(b"short", flags)


def test_signed_pickle_needs_the_same_key():
    writer = Codec.from_options({"SERIALIZER": SIGNED, "SIGNING_KEY": "k1"})
    reader = Codec.from_options({"SERIALIZER": SIGNED, "SIGNING_KEY": "k2"})
    with pytest.raises(CorruptValue):
        reader.decode(*writer.encode("secret"))


def test_signed_pickle_uses_secret_key_and_accepts_fallbacks(settings):
    settings.SECRET_KEY = "old"
    written = Codec.from_options({"SERIALIZER": SIGNED}).encode("value")
    settings.SECRET_KEY = "new"
    settings.SECRET_KEY_FALLBACKS = ["old"]
    rotated = Codec.from_options({"SERIALIZER": SIGNED})
    assert rotated.decode(*written) == "value"
    settings.SECRET_KEY_FALLBACKS = []
    with pytest.raises(CorruptValue):
        Codec.from_options({"SERIALIZER": SIGNED}).decode(*written)


def test_signed_pickle_without_a_key_is_misconfigured():
    with pytest.raises(ImproperlyConfigured, match="SIGNING_KEY"):
        Codec.from_options({"SERIALIZER": SIGNED, "SIGNING_KEY": ""})


def test_other_clients_never_unpickle_signed_entries():
    data, flags = Codec.from_options({"SERIALIZER": SIGNED, "SIGNING_KEY": "k"}).encode([1])
    assert not flags & FLAG_PICKLE


# --- the compressibility pre-check


class CountingCompressor:
    """zlib, counting how often compression is attempted."""

    flag = FLAG_ZLIB
    calls = 0

    def __init__(self, options):
        pass

    def compress(self, data):
        CountingCompressor.calls += 1
        return zlib.compress(data, 1)

    def decompress(self, data):
        return zlib.decompress(data)


@pytest.mark.parametrize("size", [400, 1000, 3000, 100_000])
def test_random_bytes_are_not_sent_to_the_compressor(size):
    codec = Codec.from_options({"COMPRESSOR": "tests.test_codec.CountingCompressor"})
    CountingCompressor.calls = 0
    value = random.Random(size).randbytes(size)
    data, flags = codec.encode(value)
    assert CountingCompressor.calls == 0
    assert flags == FLAG_PICKLE
    assert codec.decode(data, flags) == value


@pytest.mark.parametrize(
    "value",
    [
        "<li class='item'>entry</li>" * 20,
        [{"id": i, "name": f"user {i}", "active": True} for i in range(30)],
        '{"results": [' + ",".join(f'{{"id": {i}, "score": {i * 7 % 100}}}' for i in range(40)) + "]}",
    ],
    ids=["html", "records", "json-text"],
)
def test_typical_payloads_are_still_compressed(value):
    data, flags = Codec.from_options(ZLIB).encode(value)
    assert flags == FLAG_PICKLE | FLAG_ZLIB
    assert len(data) < len(pickle.dumps(value, pickle.HIGHEST_PROTOCOL))


class UnscreenedCompressor(CountingCompressor):
    """A compressor that declares it fails fast on random bytes: no sample check first."""

    screens_random = False


def test_compressor_that_does_not_screen_gets_random_bytes_and_they_stay_raw():
    codec = Codec.from_options({"COMPRESSOR": "tests.test_codec.UnscreenedCompressor"})
    CountingCompressor.calls = 0
    value = random.Random(7).randbytes(3000)
    data, flags = codec.encode(value)
    assert CountingCompressor.calls == 1  # tried, because the compressor asked not to be screened
    assert flags == FLAG_PICKLE  # zlib output was larger, so the raw pickle is kept
    assert codec.decode(data, flags) == value


def test_a_backend_default_compressor_applies_only_when_the_option_is_absent():
    default = "tests.test_codec.CountingCompressor"
    assert isinstance(Codec.from_options({}, default_compressor=default).compressor, CountingCompressor)
    assert Codec.from_options({"COMPRESSOR": None}, default_compressor=default).compressor is None
    chosen = Codec.from_options({"COMPRESSOR": "django_kvcache.codec.ZlibCompressor"},
                                default_compressor=default)
    assert type(chosen.compressor).__name__ == "ZlibCompressor"


# --- the default compressor: zstd where installed, zlib where not --------------------------


def test_the_default_compressor_is_zstd_where_it_is_installed():
    if zstd_engine() is None:
        pytest.skip("zstd not installed (a backend extra brings it)")
    data, flags = Codec.from_options({}).encode(COMPRESSIBLE)
    assert flags == FLAG_PICKLE | FLAG_ZSTD
    assert pickle.loads(zstd_engine().decompress(data, no_dictionary)) == COMPRESSIBLE


def test_without_zstd_the_default_is_zlib_and_a_warning_says_so_once(without_zstd, caplog):
    with caplog.at_level("WARNING", logger="django_kvcache.codec"):
        Codec.from_options(ZLIB)  # zlib chosen on purpose: nothing to say
        Codec.from_options({"COMPRESSOR": None})
        assert not caplog.records
        codecs = [Codec.from_options({}) for _ in range(3)]
    data, flags = codecs[0].encode(COMPRESSIBLE)
    assert flags == FLAG_PICKLE | FLAG_ZLIB
    assert pickle.loads(zlib.decompress(data)) == COMPRESSIBLE
    warnings = [r.getMessage() for r in caplog.records if r.name == "django_kvcache.codec"]
    assert len(warnings) == 1 and "zstd" in warnings[0] and "ZlibCompressor" in warnings[0]
    # The package itself, installable from a checkout too, beside the extras that bring it.
    assert "pip install zstandard" in warnings[0] and "django-kvcache[zstd]" in warnings[0]


def test_the_zstd_entry_below_is_a_real_one():
    if zstd_engine() is None:
        pytest.skip("zstd not installed (a backend extra brings it)")
    assert Codec.from_options(ZLIB).decode(ZSTD_ENTRY, ZSTD_ENTRY_FLAGS) == ZSTD_ENTRY_VALUE


def test_without_zstd_a_zstd_level_is_clamped_into_zlibs_range(without_zstd):
    # COMPRESS_LEVEL without COMPRESSOR is a zstd level; a host without zstd must still start.
    for zstd_level, zlib_level in [(-5, 1), (0, 1), (1, 1), (6, 6), (12, 9), (22, 9)]:
        compressor = Codec.from_options({"COMPRESS_LEVEL": zstd_level}).compressor
        assert isinstance(compressor, ZlibCompressor) and compressor.level == zlib_level
    with pytest.raises(ImproperlyConfigured, match="COMPRESS_LEVEL"):
        Codec.from_options({**ZLIB, "COMPRESS_LEVEL": 12})  # zlib named: its own range
    for wrong in ("fast", 23, -(1 << 17) - 1):  # not a level of zstd either
        with pytest.raises(ImproperlyConfigured, match="COMPRESS_LEVEL"):
            Codec.from_options({"COMPRESS_LEVEL": wrong})


def test_without_zstd_a_zstd_entry_is_a_miss_that_says_why(without_zstd):
    with pytest.raises(CorruptValue, match="zstd, which is not installed.*pip install zstandard"):
        Codec.from_options(ZLIB).decode(ZSTD_ENTRY, ZSTD_ENTRY_FLAGS)


def test_without_zstd_a_dictionary_option_says_zstd_is_missing(without_zstd):
    for options in ({"COMPRESS_DICTIONARY": "/some/path"},
                    {**ZLIB, "COMPRESS_DICTIONARY": "/some/path"}):
        with pytest.raises(ImproperlyConfigured, match="COMPRESS_DICTIONARY.*needs zstd.*pip install zstandard"):
            Codec.from_options(options)


def test_without_zstd_the_check_names_each_cache_left_to_the_default(without_zstd, settings):
    from django.core.cache import caches

    from django_kvcache.checks import check_default_compressor

    settings.CACHES = {
        "defaulted": {"BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
                      "LOCATION": "127.0.0.1:1"},
        "chosen": {"BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
                   "LOCATION": "127.0.0.1:1", "OPTIONS": ZLIB},
        "django": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    }
    try:
        messages = check_default_compressor()
        assert [m.id for m in messages] == ["kvcache.W002"]
        assert "'defaulted'" in messages[0].msg and "pip install zstandard" in messages[0].hint
    finally:
        for alias in settings.CACHES:
            caches[alias].close()


def test_the_check_is_silent_where_zstd_is_installed(settings):
    if zstd_engine() is None:
        pytest.skip("zstd not installed (a backend extra brings it)")
    from django.core.cache import caches

    from django_kvcache.checks import check_default_compressor

    # A kvcache alias left to the default compressor: the one the check would name.
    settings.CACHES = {
        "defaulted": {"BACKEND": "django_kvcache.backends.memcached.MemcachedCache",
                      "LOCATION": "127.0.0.1:1"},
    }
    try:
        assert check_default_compressor() == []
    finally:
        caches["defaulted"].close()


# --- values compression does not pay for are stored as they are --------------------------


class CountingZlib(CountingCompressor):
    """zlib, counting compressions and decompressions (nothing screened)."""

    screens_random = False
    decompressions = 0

    def decompress(self, data):
        CountingZlib.decompressions += 1
        return zlib.decompress(data)


#: MySQLCache's threshold: tokens save less.
QUARTER = {"COMPRESS_MIN_SAVING": 0.25}


@pytest.fixture
def counting() -> Codec:
    CountingCompressor.calls = CountingZlib.decompressions = 0
    return Codec.from_options({"COMPRESSOR": "tests.test_codec.CountingZlib", **QUARTER})


def test_a_value_compression_does_not_shrink_enough_is_stored_as_it_is(counting):
    value = alphanumeric(2000)
    payload = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    saving = 1 - len(zlib.compress(payload, 1)) / len(payload)
    assert 0.1 < saving < counting.min_saving == 0.25  # smaller, not smaller enough
    assert counting.encode(value) == (payload, FLAG_PICKLE)  # no compression flag
    # The rule, not the compressor, decided: with any saving kept it is compressed.
    keep_any = Codec.from_options({"COMPRESSOR": "tests.test_codec.CountingZlib",
                                   "COMPRESS_MIN_SAVING": 0.1})
    assert keep_any.encode(value)[1] == FLAG_PICKLE | FLAG_ZLIB


def test_a_value_that_saves_the_threshold_is_compressed(counting):
    value = "<li class='item'>entry</li>" * 100
    data, flags = counting.encode(value)
    assert flags == FLAG_PICKLE | FLAG_ZLIB
    assert len(data) < 0.25 * len(pickle.dumps(value))


def test_reads_skip_the_decompressor_for_values_stored_as_they_are(counting):
    plain = counting.encode(alphanumeric(2000))
    compressed = counting.encode(COMPRESSIBLE)
    assert counting.decode(*plain) == alphanumeric(2000)
    assert CountingZlib.decompressions == 0
    assert counting.decode(*compressed) == COMPRESSIBLE
    assert CountingZlib.decompressions == 1


def test_the_default_keeps_a_tenth_and_a_quarter_stores_tokens_as_they_are():
    if zstd_engine() is None:
        pytest.skip("zstd not installed (a backend extra brings it)")
    default, quarter = Codec.from_options({}), Codec.from_options(QUARTER)
    assert default.min_saving == 0.1
    noise = random.Random(2).randbytes(2000)
    for codec in (default, quarter):
        assert codec.encode(noise) == (pickle.dumps(noise, pickle.HIGHEST_PROTOCOL), FLAG_PICKLE)
        assert codec.encode(COMPRESSIBLE)[1] == FLAG_PICKLE | FLAG_ZSTD
    assert default.encode(alphanumeric(2000))[1] == FLAG_PICKLE | FLAG_ZSTD  # 22 % off
    assert quarter.encode(alphanumeric(2000))[1] == FLAG_PICKLE


def test_a_kind_that_does_not_pay_is_tried_once_in_sample_every(counting):
    from django_kvcache.savings import SAMPLE_EVERY

    tokens = [alphanumeric(2000, seed) for seed in range(1 + 3 * SAMPLE_EVERY)]
    for token in tokens:
        assert counting.encode(token)[1] == FLAG_PICKLE
    assert CountingCompressor.calls == 1 + 3  # the first value, then one in SAMPLE_EVERY
    # Another kind (another type, or another size class) is tried on its own.
    counting.encode([alphanumeric(2000)])
    counting.encode(alphanumeric(5000))
    assert CountingCompressor.calls == 4 + 2


def test_a_kind_whose_values_start_to_compress_is_compressed_again(counting):
    from django_kvcache.savings import SAMPLE_EVERY

    for seed in range(2 * SAMPLE_EVERY):
        counting.encode(alphanumeric(2000, seed))
    html = ["<li class='item'>entry %d</li>" % i * 60 for i in range(4 * SAMPLE_EVERY)]
    flags = [counting.encode(value)[1] for value in html]
    assert all(len(pickle.dumps(value)) < 4096 for value in html)  # the tokens' size class
    first = flags.index(FLAG_PICKLE | FLAG_ZLIB)
    assert first < 2 * SAMPLE_EVERY  # within two samples
    assert set(flags[first + SAMPLE_EVERY:]) == {FLAG_PICKLE | FLAG_ZLIB}  # then every one


def test_what_is_learnt_is_shared_by_the_caches_of_one_setting_only():
    first, second = Codec.from_options(ZLIB), Codec.from_options(ZLIB)
    assert first.savings is second.savings  # Django builds an instance per thread and request
    assert Codec.from_options({**ZLIB, "COMPRESS_LEVEL": 6}).savings is not first.savings
    assert Codec.from_options({**ZLIB, **QUARTER}).savings is not first.savings
    assert Codec.from_options({"COMPRESSOR": None}).savings is not first.savings




@pytest.mark.parametrize("data, flags", MAIN_ENTRIES, ids=["zstd", "zlib"])
def test_entries_mains_code_compressed_read_back(data, flags):
    if flags & FLAG_ZSTD and zstd_engine() is None:
        pytest.skip("zstd not installed (a backend extra brings it)")
    for options in ({}, ZLIB, {"COMPRESSOR": None}, QUARTER, {**ZLIB, **QUARTER}):
        codec = Codec.from_options(options)
        assert codec.decode(data, flags) == MAIN_TOKEN
    for options in ({"COMPRESSOR": None}, QUARTER, {**ZLIB, **QUARTER}):
        assert Codec.from_options(options).encode(MAIN_TOKEN) == (
            pickle.dumps(MAIN_TOKEN, pickle.HIGHEST_PROTOCOL), FLAG_PICKLE)


@pytest.mark.parametrize("data, flags", [
    (b"SECRET-4242", FLAG_INTEGER),  # int() quotes what it cannot read
    (b"\xffSECRET-4242", FLAG_TEXT),  # a UnicodeDecodeError carries the whole object
    (b"SECRET-4242", FLAG_PICKLE),
], ids=["integer", "text", "pickle"])
def test_a_corrupt_entry_s_error_carries_none_of_its_bytes(codec, data, flags):
    # The error is logged as the entry's miss: it names the damage, never the value.
    with pytest.raises(CorruptValue) as raised:
        codec.decode(data, flags)
    error = raised.value
    seen = [str(error), repr(error), str(error.__cause__), str(error.__context__),
            repr(error.__context__)]
    assert not any("SECRET" in text for text in seen), seen
    assert error.reason  # the decoder's error class still says what kind of damage
