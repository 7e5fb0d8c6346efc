"""zstd compression: round trips, switching compressors both ways, trained dictionaries
(the id in each value picks its dictionary; a missing one is a logged miss), per-thread
compressors and the option checks."""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import threading
import zlib

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_kvcache.codec import FLAG_PICKLE, FLAG_ZLIB, Codec, CorruptValue
from django_kvcache.zstd import FLAG_ZSTD, thread_compressor, train_dictionary, zstd_module

zstd = zstd_module()
pytestmark = pytest.mark.skipif(zstd is None, reason="zstd not installed (extra 'zstd')")

ZSTD = "django_kvcache.zstd.ZstdCompressor"


def api_response(rng: random.Random) -> str:
    """A small JSON API body: the kind of value a trained dictionary helps most."""
    return json.dumps(
        {
            "id": rng.randint(1, 10**6),
            "status": rng.choice(["active", "pending", "closed"]),
            "owner": {"username": f"user{rng.randint(1, 5000)}", "is_staff": rng.random() < 0.1},
            "tags": rng.sample(["news", "sport", "tech", "arts", "travel", "food"], 3),
            "created": f"2026-{rng.randint(1, 12):02}-{rng.randint(1, 28):02}T10:00:00Z",
            "score": round(rng.random() * 100, 2),
        }
    )


@pytest.fixture(scope="module")
def dictionaries(tmp_path_factory):
    """Two dictionaries trained on different samples of the same kind of value."""
    folder = tmp_path_factory.mktemp("dictionaries")
    paths = []
    for seed in (1, 2):
        rng = random.Random(seed)
        samples = [pickle.dumps([api_response(rng) for _ in range(3)]) for _ in range(400)]
        path = folder / f"dictionary-{seed}.zstd"
        path.write_bytes(train_dictionary(samples, 8 * 1024))
        paths.append(str(path))
    return paths


def small_value(seed: int = 99) -> list[str]:
    rng = random.Random(seed)
    return [api_response(rng) for _ in range(3)]


def dictionary_id(data: bytes) -> int:
    return zstd.get_frame_info(data).dictionary_id


def test_round_trip_and_flag():
    codec = Codec.from_options({"COMPRESSOR": ZSTD})
    value = small_value()
    data, flags = codec.encode(value)
    assert flags == FLAG_PICKLE | FLAG_ZSTD
    assert len(data) < len(pickle.dumps(value))
    assert codec.decode(data, flags) == value


def test_random_bytes_are_tried_without_the_sample_check_and_kept_raw(monkeypatch):
    calls = []
    monkeypatch.setattr("django_kvcache.codec.looks_compressible", calls.append)
    codec = Codec.from_options({"COMPRESSOR": ZSTD})
    value = random.Random(3).randbytes(1500)
    data, flags = codec.encode(value)
    assert calls == []  # zstd fails fast on random bytes: no screening
    assert flags == FLAG_PICKLE  # not smaller, so stored as the plain pickle
    assert codec.decode(data, flags) == value


def test_switching_compressor_keeps_old_entries_readable_both_ways():
    zlib_codec = Codec.from_options({"COMPRESSOR": "django_kvcache.codec.ZlibCompressor"})
    zstd_codec = Codec.from_options({"COMPRESSOR": ZSTD})
    value = small_value()
    zlib_data, zlib_flags = zlib_codec.encode(value)
    zstd_data, zstd_flags = zstd_codec.encode(value)
    assert zlib_flags == FLAG_PICKLE | FLAG_ZLIB
    assert zstd_codec.decode(zlib_data, zlib_flags) == value
    assert zlib_codec.decode(zstd_data, zstd_flags) == value
    assert Codec.from_options({"COMPRESSOR": None}).decode(zstd_data, zstd_flags) == value


def test_two_compression_bits_at_once_are_a_corrupt_entry():
    data, flags = Codec.from_options({"COMPRESSOR": ZSTD}).encode(small_value())
    with pytest.raises(CorruptValue):
        Codec.from_options({}).decode(data, flags | FLAG_ZLIB)


def test_a_dictionary_shrinks_small_values_and_its_id_is_in_every_value(dictionaries):
    plain = Codec.from_options({"COMPRESSOR": ZSTD})
    trained = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[0]})
    value = small_value()
    plain_data, _ = plain.encode(value)
    data, flags = trained.encode(value)
    assert len(data) < 0.8 * len(plain_data)  # 94 vs 261 bytes when written
    assert dictionary_id(data) == zstd.ZstdDict(open(dictionaries[0], "rb").read()).dict_id
    assert trained.decode(data, flags) == value


def test_old_dictionaries_listed_after_the_new_one_still_read(dictionaries):
    old = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": [dictionaries[0]]})
    new = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[::-1]})
    value = small_value()
    old_data, flags = old.encode(value)
    new_data, _ = new.encode(value)
    assert dictionary_id(new_data) != dictionary_id(old_data)
    assert new.decode(old_data, flags) == value
    assert new.decode(new_data, flags) == value


def test_a_value_whose_dictionary_is_not_listed_is_corrupt_not_wrong(dictionaries):
    writer = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[0]})
    data, flags = writer.encode(small_value())
    for reader in (
        Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[1]}),
        Codec.from_options({"COMPRESSOR": ZSTD}),
        Codec.from_options({}),
    ):
        with pytest.raises(CorruptValue, match="dictionary"):
            reader.decode(data, flags)


@pytest.fixture
def compressors_built(monkeypatch):
    """The thread of each zstd compressor built while the test runs.

    The C type cannot be subclassed, so a stand-in class builds the real ones and counts."""
    built: list[int] = []
    real = zstd.ZstdCompressor

    class CountingCompressor:
        FLUSH_FRAME = real.FLUSH_FRAME

        def __new__(cls, *args, **kwargs):
            built.append(threading.get_ident())
            return real(*args, **kwargs)

    monkeypatch.setattr(zstd, "ZstdCompressor", CountingCompressor)
    return built


def in_new_thread(work) -> None:
    errors: list[BaseException] = []

    def run():
        try:
            work()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and not errors, errors


def test_each_thread_builds_one_compressor_for_all_its_writes(compressors_built):
    # Django builds a cache instance per thread and per async context (each ASGI
    # request): none of them may pay for a new compressor.
    values = [small_value(seed) for seed in range(4)]

    def work():
        for _ in range(3):  # a new cache instance each time, as each request gets
            codec = Codec.from_options({"COMPRESSOR": ZSTD})
            for value in values * 20:
                data, flags = codec.encode(value)
                assert flags & FLAG_ZSTD and codec.decode(data, flags) == value

    for _ in range(4):
        in_new_thread(work)
    # One per thread: not one per cache instance (12) nor per write (960).
    assert len(compressors_built) == 4


def test_cache_instances_share_their_dictionary_and_its_compressor(dictionaries, compressors_built):
    # Nor may a cache instance read the dictionary file again.
    options = {"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[0]}
    value = small_value()

    def work():
        first, second = Codec.from_options(options), Codec.from_options(options)
        assert first.compressor.dictionary is second.compressor.dictionary
        written = [first.encode(value)[0], second.encode(value)[0], first.encode(value)[0]]
        assert len(compressors_built) == 1
        assert {dictionary_id(data) for data in written} == {first.compressor.dictionary.dict_id}
        plain = Codec.from_options({"COMPRESSOR": ZSTD})
        assert dictionary_id(plain.encode(value)[0]) == 0
        assert len(compressors_built) == 2  # another setting, another compressor

    in_new_thread(work)


def test_a_thread_keeps_a_bounded_number_of_compressors(compressors_built):
    from django_kvcache import zstd as kvcache_zstd

    def work():
        for level in range(1, 2 * kvcache_zstd.MAX_THREAD_COMPRESSORS + 1):
            thread_compressor(zstd, level, None)
        assert len(kvcache_zstd._compressors.by_setting) <= kvcache_zstd.MAX_THREAD_COMPRESSORS
        assert thread_compressor(zstd, 1, None) is thread_compressor(zstd, 1, None)

    in_new_thread(work)
    assert len(compressors_built) == 2 * kvcache_zstd.MAX_THREAD_COMPRESSORS + 1


def test_a_rewritten_dictionary_file_is_read_again(tmp_path, dictionaries):
    path = tmp_path / "current.zstd"
    path.write_bytes(open(dictionaries[0], "rb").read())
    before = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})
    path.write_bytes(open(dictionaries[1], "rb").read())
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    after = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})
    assert list(before.compressor.dictionaries) != list(after.compressor.dictionaries)


def test_a_dictionary_file_replaced_with_the_same_mtime_is_read_again(tmp_path, dictionaries):
    # A deploy that copies files with their times kept (rsync -t, cp -p) must not keep
    # writing with the old dictionary.
    path = tmp_path / "current.zstd"
    path.write_bytes(open(dictionaries[0], "rb").read())
    before = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})
    mtime_ns = path.stat().st_mtime_ns
    replacement = tmp_path / "next.zstd"
    replacement.write_bytes(open(dictionaries[1], "rb").read())
    os.utime(replacement, ns=(mtime_ns, mtime_ns))
    os.replace(replacement, path)
    assert path.stat().st_mtime_ns == mtime_ns
    after = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})
    assert list(before.compressor.dictionaries) != list(after.compressor.dictionaries)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"COMPRESSOR": ZSTD, "COMPRESS_LEVEL": 99}, "COMPRESS_LEVEL"),
        ({"COMPRESSOR": ZSTD, "COMPRESS_LEVEL": "3"}, "COMPRESS_LEVEL"),
        ({"COMPRESSOR": "django_kvcache.codec.ZlibCompressor", "COMPRESS_DICTIONARY": "/some/path"},
         "COMPRESS_DICTIONARY.*ZstdCompressor"),
        ({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": "/no/such/file"}, "/no/such/file"),
        ({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": 5}, "COMPRESS_DICTIONARY"),
    ],
)
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        Codec.from_options(options)


def test_a_file_that_is_not_a_dictionary_is_refused(tmp_path):
    path = tmp_path / "not-a-dictionary"
    path.write_bytes(zlib.compress(b"x" * 100))
    with pytest.raises(ImproperlyConfigured, match="cannot load"):
        Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})


def test_training_needs_samples():
    with pytest.raises(ValueError, match="at least 10"):
        train_dictionary([b"a", b"b"])


@pytest.mark.django_db(transaction=True)
def test_missing_dictionary_is_a_logged_miss_on_a_real_cache(dictionaries, caplog):
    from tests.mysql_support import drop_table, make_cache

    options = {"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[0], "COMPRESS_MIN_LENGTH": 400}
    writer = make_cache("kvcache_zstd_test", OPTIONS=options)
    try:
        writer.set("key", small_value())
        reader = make_cache(
            "kvcache_zstd_test", OPTIONS={**options, "COMPRESS_DICTIONARY": dictionaries[1]}
        )
        with caplog.at_level(logging.WARNING):
            assert reader.get("key", "default") == "default"
        assert "dictionary" in caplog.text
        assert writer.get("key") == small_value()
    finally:
        drop_table("kvcache_zstd_test")
