"""zstd compression: round trips, switching compressors both ways, the two engines
(zstandard, and compression.zstd / backports.zstd where it is missing) reading each
other's frames and dictionaries, trained dictionaries (the id in each value picks its
dictionary; a missing one is a logged miss), per-thread contexts and the option checks."""
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

from django_kvcache import codec as kvcache_codec
from django_kvcache import zstd as kvcache_zstd
from django_kvcache.codec import FLAG_PICKLE, FLAG_ZLIB, Codec, CorruptValue
from django_kvcache.zstd import (
    FLAG_ZSTD,
    Dictionary,
    StandardLibrary,
    Zstandard,
    no_dictionary,
    train_dictionary,
    zstd_engine,
)
from tests.zstd_support import ENGINES, frame_dictionary_id, previous_engine

pytestmark = pytest.mark.skipif(zstd_engine() is None, reason="zstd not installed (extra 'zstd')")

ZSTD = "django_kvcache.zstd.ZstdCompressor"


@pytest.fixture(params=sorted(ENGINES))
def engine(request, monkeypatch):
    """Each engine installed here in turn, as the one every cache built in the test uses."""
    chosen = ENGINES[request.param]
    for module in (kvcache_zstd, kvcache_codec):
        monkeypatch.setattr(module, "zstd_engine", lambda: chosen)
    return chosen


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
    return frame_dictionary_id(data)


def content_id(path: str) -> int:
    return Dictionary(open(path, "rb").read()).id


def test_zstandard_is_the_engine_where_installed():
    import zstandard  # noqa: F401  (the extras install it)

    assert isinstance(zstd_engine(), Zstandard)


def test_round_trip_and_flag(engine):
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


def test_switching_compressor_keeps_old_entries_readable_both_ways(engine):
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


# --- entries of the previous engine, and the two engines reading each other -------------


@pytest.fixture
def previous():
    """The zstd module earlier releases wrote with (backports.zstd before Python 3.14)."""
    engine = previous_engine()
    if engine is None:
        pytest.skip("neither compression.zstd nor backports.zstd is installed")
    return engine.module


def test_entries_the_previous_engine_wrote_read_with_zstandard(previous, dictionaries):
    # Written exactly as the release before wrote them: one reused compressor per level
    # and dictionary, FLUSH_FRAME per value; read by today's default engine.
    assert isinstance(zstd_engine(), Zstandard)
    value = small_value()
    payload = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    old_dictionary = previous.ZstdDict(open(dictionaries[0], "rb").read())
    written = {
        "plain": previous.ZstdCompressor(3).compress(payload, previous.ZstdCompressor.FLUSH_FRAME),
        "level 19": previous.ZstdCompressor(19).compress(payload, previous.ZstdCompressor.FLUSH_FRAME),
        "one-shot": previous.compress(payload),
        "dictionary": previous.ZstdCompressor(3, zstd_dict=old_dictionary).compress(
            payload, previous.ZstdCompressor.FLUSH_FRAME),
    }
    plain = Codec.from_options({})
    trained = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries})
    for how, data in written.items():
        assert trained.decode(data, FLAG_PICKLE | FLAG_ZSTD) == value, how
        if how != "dictionary":
            assert plain.decode(data, FLAG_PICKLE | FLAG_ZSTD) == value, how
    assert dictionary_id(written["dictionary"]) == content_id(dictionaries[0])
    with pytest.raises(CorruptValue, match="dictionary"):
        plain.decode(written["dictionary"], FLAG_PICKLE | FLAG_ZSTD)


@pytest.mark.skipif(len(ENGINES) < 2, reason="needs zstandard and compression.zstd/backports.zstd")
def test_each_engine_reads_what_the_other_wrote(dictionaries):
    # A rolling deploy, or hosts with different extras: frames and dictionaries are the same.
    value = small_value()
    payload = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    dictionary = Dictionary(open(dictionaries[0], "rb").read())
    find = {dictionary.id: dictionary}.__getitem__
    for writer in ENGINES.values():
        for used in (None, dictionary):
            frame = writer.compress(payload, 3, used)
            assert dictionary_id(frame) == (used.id if used else 0)
            for reader in ENGINES.values():
                assert reader.decompress(frame, find) == payload, (writer.name, reader.name, used)


def test_damaged_frames_are_corrupt_entries_in_either_engine(engine):
    codec = Codec.from_options({"COMPRESSOR": ZSTD})
    data, flags = codec.encode(small_value())
    for damaged in (data[:-4], data + b"\0\0\0\0", b"(\xb5/\xfd" + bytes(20), b"not zstd at all"):
        with pytest.raises(CorruptValue):
            codec.decode(damaged, flags)


def test_a_frame_without_its_content_size_reads_back_and_truncated_is_corrupt():
    # Streaming writers leave the size out of the header; zstandard then reads the frame
    # as a stream and must still notice a frame cut short.
    zstandard = pytest.importorskip("zstandard")
    value = small_value()
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(
        pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
    assert zstandard.get_frame_parameters(frame).content_size == zstandard.CONTENTSIZE_UNKNOWN
    codec = Codec.from_options({})
    assert codec.decode(frame, FLAG_PICKLE | FLAG_ZSTD) == value
    for damaged in (frame[:-3], frame + b"tail"):
        with pytest.raises(CorruptValue, match="truncated or followed"):
            codec.decode(damaged, FLAG_PICKLE | FLAG_ZSTD)


# --- dictionaries --------------------------------------------------------------------------


def test_a_dictionary_shrinks_small_values_and_its_id_is_in_every_value(engine, dictionaries):
    plain = Codec.from_options({"COMPRESSOR": ZSTD})
    trained = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[0]})
    value = small_value()
    plain_data, _ = plain.encode(value)
    data, flags = trained.encode(value)
    assert len(data) < 0.8 * len(plain_data)  # 94 vs 261 bytes when written
    assert dictionary_id(data) == content_id(dictionaries[0])
    assert trained.decode(data, flags) == value


def test_old_dictionaries_listed_after_the_new_one_still_read(engine, dictionaries):
    old = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": [dictionaries[0]]})
    new = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[::-1]})
    value = small_value()
    old_data, flags = old.encode(value)
    new_data, _ = new.encode(value)
    assert dictionary_id(new_data) != dictionary_id(old_data)
    assert new.decode(old_data, flags) == value
    assert new.decode(new_data, flags) == value


def test_a_value_whose_dictionary_is_not_listed_is_corrupt_not_wrong(engine, dictionaries):
    writer = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[0]})
    data, flags = writer.encode(small_value())
    for reader in (
        Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[1]}),
        Codec.from_options({"COMPRESSOR": ZSTD}),
        Codec.from_options({}),
    ):
        with pytest.raises(CorruptValue, match="dictionary"):
            reader.decode(data, flags)


# --- contexts reused per thread ------------------------------------------------------------


@pytest.fixture
def contexts_built(monkeypatch):
    """The thread of each zstd compression and decompression context built while the test
    runs, by kind, in the default engine.

    The C types cannot be subclassed, so stand-ins build the real ones and count."""
    built: dict[str, list[int]] = {"compressors": [], "decompressors": []}
    module = zstd_engine().module
    names = {"compressors": "ZstdCompressor", "decompressors": "ZstdDecompressor"}
    if isinstance(zstd_engine(), StandardLibrary):
        names.pop("decompressors")  # it has no reusable one: a context per value

    for kind, name in names.items():
        real = getattr(module, name)

        def counting(*args, real=real, kind=kind, **kwargs):
            built[kind].append(threading.get_ident())
            return real(*args, **kwargs)

        stand_in = type(name, (), {"__new__": lambda cls, *a, c=counting, **k: c(*a, **k)})
        if hasattr(real, "FLUSH_FRAME"):
            stand_in.FLUSH_FRAME = real.FLUSH_FRAME
        monkeypatch.setattr(module, name, stand_in)
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


def test_each_thread_builds_one_compressor_and_one_decompressor(contexts_built):
    # Django builds a cache instance per thread and per async context (each ASGI
    # request): none of them may pay for a new context, on either side.
    values = [small_value(seed) for seed in range(4)]

    def work():
        for _ in range(3):  # a new cache instance each time, as each request gets
            codec = Codec.from_options({"COMPRESSOR": ZSTD})
            for value in values * 20:
                data, flags = codec.encode(value)
                assert flags & FLAG_ZSTD and codec.decode(data, flags) == value

    for _ in range(4):
        in_new_thread(work)
    # One per thread: not one per cache instance (12) nor per value (960).
    assert len(contexts_built["compressors"]) == 4
    if isinstance(zstd_engine(), Zstandard):
        assert len(contexts_built["decompressors"]) == 4


def test_cache_instances_share_their_dictionary_and_its_contexts(dictionaries, contexts_built):
    # Nor may a cache instance read the dictionary file again.
    options = {"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": dictionaries[0]}
    value = small_value()

    def work():
        first, second = Codec.from_options(options), Codec.from_options(options)
        dictionary = first.compressor.dictionaries.for_writing()
        assert dictionary is second.compressor.dictionaries.for_writing()
        written = [first.encode(value)[0], second.encode(value)[0], first.encode(value)[0]]
        assert len(contexts_built["compressors"]) == 1
        assert {dictionary_id(data) for data in written} == {dictionary.id}
        # The process prepares a dictionary for reading once, with a decompressor of its
        # own, at its first read by any test: done here so only the contexts are counted.
        zstd_engine().prepared(dictionary, "decompress")
        prepared = len(contexts_built.get("decompressors", []))
        assert all(second.decode(data, FLAG_PICKLE | FLAG_ZSTD) == value for data in written)
        if isinstance(zstd_engine(), Zstandard):  # the dictionary's, shared
            assert len(contexts_built["decompressors"]) == prepared + 1
        plain = Codec.from_options({"COMPRESSOR": ZSTD})
        assert dictionary_id(plain.encode(value)[0]) == 0
        assert len(contexts_built["compressors"]) == 2  # another setting, another compressor

    in_new_thread(work)


def test_a_thread_keeps_a_bounded_number_of_contexts(contexts_built):
    engine = zstd_engine()
    limit = kvcache_zstd.MAX_THREAD_CONTEXTS

    def work():
        for level in range(1, 2 * limit + 1):
            engine.compress(b"x" * 100, level, None)
        assert len(engine.contexts.compressors) <= limit
        before = len(contexts_built["compressors"])
        engine.compress(b"x" * 100, 2 * limit, None)
        assert len(contexts_built["compressors"]) == before  # the last one is still kept

    in_new_thread(work)
    assert len(contexts_built["compressors"]) == 2 * limit


def test_a_rewritten_dictionary_file_is_read_again(tmp_path, dictionaries):
    path = tmp_path / "current.zstd"
    path.write_bytes(open(dictionaries[0], "rb").read())
    before = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})
    path.write_bytes(open(dictionaries[1], "rb").read())
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    after = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})
    assert before.compressor.dictionaries.for_writing().id == content_id(dictionaries[0])
    assert after.compressor.dictionaries.for_writing().id == content_id(dictionaries[1])


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
    assert before.compressor.dictionaries.for_writing().id == content_id(dictionaries[0])
    assert after.compressor.dictionaries.for_writing().id == content_id(dictionaries[1])


# --- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"COMPRESSOR": ZSTD, "COMPRESS_LEVEL": 99}, "COMPRESS_LEVEL"),
        ({"COMPRESSOR": ZSTD, "COMPRESS_LEVEL": "3"}, "COMPRESS_LEVEL"),
        ({"COMPRESSOR": "django_kvcache.codec.ZlibCompressor", "COMPRESS_DICTIONARY": "/some/path"},
         "COMPRESS_DICTIONARY.*ZstdCompressor"),
        ({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": "/no/such/file"}, "/no/such/file"),
        ({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": 5}, "COMPRESS_DICTIONARY"),
        ({"COMPRESS_DICTIONARY": "auto"}, "'auto' keeps dictionaries in a MySQLCache"),
    ],
)
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        Codec.from_options(options)


def test_levels_are_zstds_whatever_the_engine(engine):
    for level in (-(1 << 17), -5, 0, 22):
        assert Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_LEVEL": level}).compressor.level == level
    for wrong in (23, -(1 << 17) - 1, True):
        with pytest.raises(ImproperlyConfigured, match="from -131072 to 22"):
            Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_LEVEL": wrong})


@pytest.mark.parametrize("content", [zlib.compress(b"x" * 100), b"raw dictionary content" * 20])
def test_a_file_that_is_not_a_dictionary_is_refused(engine, tmp_path, content):
    # Raw content has no id: its frames would say "no dictionary" and read back wrong.
    path = tmp_path / "not-a-dictionary"
    path.write_bytes(content)
    with pytest.raises(ImproperlyConfigured, match="cannot load"):
        Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})


def test_a_damaged_dictionary_is_refused(engine, tmp_path, dictionaries):
    content = bytearray(open(dictionaries[0], "rb").read())
    content[8:40] = bytes(32)  # the header's id stays, its entropy tables are broken
    path = tmp_path / "damaged.zstd"
    path.write_bytes(content)
    with pytest.raises(ImproperlyConfigured, match="cannot load"):
        Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})


def test_training_needs_samples():
    with pytest.raises(ValueError, match="at least 10"):
        train_dictionary([b"a", b"b"])


def test_the_engines_train_dictionaries_each_other_uses(engine):
    rng = random.Random(5)
    samples = [pickle.dumps([api_response(rng) for _ in range(3)]) for _ in range(300)]
    dictionary = Dictionary(train_dictionary(samples, 4096))
    for other in ENGINES.values():
        frame = other.compress(samples[0], 3, dictionary)
        assert engine.decompress(frame, {dictionary.id: dictionary}.__getitem__) == samples[0]


def test_no_dictionary_says_which_id_it_lacks():
    with pytest.raises(kvcache_zstd.MissingDictionary, match="dictionary 1234"):
        no_dictionary(1234)


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
