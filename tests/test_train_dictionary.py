"""manage.py kvcache_train_dictionary on a real MySQLCache and a real memcached node:
samples live entries, writes a dictionary that makes the cache's own values smaller, and
refuses what it cannot use."""
from __future__ import annotations

import io
import random
import re

import pytest
from django.core.cache import caches
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_kvcache.codec import FLAG_INTEGER, Codec
from django_kvcache.zstd import Dictionary, zstd_engine
from django_kvcache.backends.mysql import MySQLCache
from tests.mysql_support import BACKEND, drop_table, ensure_table, sql
from tests.zstd_support import frame_dictionary_id
from tests.test_zstd import ZSTD, api_response

pytestmark = [
    pytest.mark.skipif(zstd_engine() is None, reason="zstd not installed (extra 'zstd')"),
    pytest.mark.django_db(transaction=True),
]
TABLE = "kvcache_train_test"
MEMCACHED = "django_kvcache.backends.memcached.MemcachedCache"
MYSQL_CACHE = {"BACKEND": BACKEND, "LOCATION": TABLE, "OPTIONS": {"CULL_PROBABILITY": 0}}
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}


ENCRYPTED = {"ENCRYPTION_KEYS": ["the key of the sampled cache, 0123456789abcdef"]}


@pytest.fixture(params=["mysql", "memcached", "mysql encrypted", "memcached encrypted"])
def sampled(request, memcached_node_factory):
    """The "sampled" cache: a MySQLCache table, or a memcached node of the test's own;
    with ENCRYPTION_KEYS, whose entries are sampled through its keys."""
    backend = request.param.partition(" ")[0]
    if backend == "memcached":
        node = memcached_node_factory()
        CACHES["sampled"] = {"BACKEND": MEMCACHED, "LOCATION": [node.address]}
    else:
        CACHES["sampled"] = MYSQL_CACHE
    if request.param.endswith("encrypted"):
        options = CACHES["sampled"].get("OPTIONS", {})
        CACHES["sampled"] = {**CACHES["sampled"], "OPTIONS": {**options, **ENCRYPTED}}
    with override_settings(CACHES=CACHES):
        cache = caches["sampled"]
        if backend == "mysql":
            ensure_table(cache)
        yield cache
        if backend == "mysql":
            drop_table(TABLE)


def fill(cache, count, seed=1):
    rng = random.Random(seed)
    cache.set_many({f"api:{n}": [api_response(rng) for _ in range(3)] for n in range(count)})
    cache.set_many({f"counter:{n}": n for n in range(20)})  # integers are no samples


def train(tmp_path, *args, **options):
    out, err = io.StringIO(), io.StringIO()
    call_command("kvcache_train_dictionary", *args, stdout=out, stderr=err, **options)
    return out.getvalue(), err.getvalue()


def test_a_dictionary_from_live_entries_shrinks_the_cache_s_values(sampled, tmp_path):
    fill(sampled, 300)
    path = tmp_path / "site.zstd"
    out, _ = train(tmp_path, "sampled", output=path, samples=1000, size=4096)
    assert "trained on 240 entries" in out
    assert "On 60 other entries" in out and "zstd-3 + dictionary" in out
    dictionary = Dictionary(path.read_bytes())
    assert f"zstd dictionary {dictionary.id}" in out

    value = [api_response(random.Random(7)) for _ in range(3)]
    without = Codec.from_options({"COMPRESSOR": ZSTD}).encode(value)[0]
    with_dictionary = Codec.from_options({"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": str(path)})
    assert len(with_dictionary.encode(value)[0]) < 0.7 * len(without)


def test_entries_compressed_with_an_unknown_dictionary_are_skipped_and_counted(sampled, tmp_path):
    fill(sampled, 100)
    first = tmp_path / "first.zstd"
    train(tmp_path, "sampled", output=first, samples=100, size=2048)
    options = {
        **CACHES["sampled"].get("OPTIONS", {}),
        "COMPRESSOR": ZSTD,
        "COMPRESS_DICTIONARY": str(first),
        "COMPRESS_MIN_LENGTH": 400,  # MySQLCache's default leaves these values raw
    }
    with override_settings(CACHES={**CACHES, "writer": {**CACHES["sampled"], "OPTIONS": options}}):
        rng = random.Random(3)
        caches["writer"].set("written-with-first", [api_response(rng) for _ in range(3)])
    _, err = train(tmp_path, "sampled", output=tmp_path / "second.zstd", samples=200)
    assert "Skipped 1 entries cache 'sampled' cannot decompress" in err


def test_silent_at_verbosity_0(sampled, tmp_path):
    fill(sampled, 50)
    assert train(tmp_path, "sampled", output=tmp_path / "d", samples=50, verbosity=0)[0] == ""


@pytest.mark.parametrize(
    "alias, message",
    [("nowhere", "No cache named 'nowhere'"), ("default", "not a django-kvcache cache")],
)
def test_caches_it_cannot_sample_are_refused(sampled, tmp_path, alias, message):
    with pytest.raises(CommandError, match=message):
        train(tmp_path, alias, output=tmp_path / "d")


def test_too_few_entries_is_a_clear_error(sampled, tmp_path):
    fill(sampled, 5)
    with pytest.raises(CommandError, match="gave 5 usable entries; at least 10"):
        train(tmp_path, "sampled", output=tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_sample_entries_picks_distinct_live_entries_at_random(sampled):
    fill(sampled, 100)
    values = sampled.get_many([f"api:{n}" for n in range(100)]).values()
    payloads = {sampled.codec.payload(value)[0] for value in values}
    first, second = sampled.sample_entries(30), sampled.sample_entries(30)
    assert len(first) == len(second) == 30
    assert all(flags != FLAG_INTEGER or data.isdigit() for _, data, flags in first)
    opened = [sampled.codec.opened(data, flags, key)[0] for key, data, flags in first]
    api_entries = [payload for payload in opened if payload in payloads]
    assert len(set(api_entries)) == len(api_entries) > 10  # no entry twice
    assert first != second  # a random pick, not the first 30 in storage order


def test_without_zstd_it_says_which_package_to_install(sampled, tmp_path, without_zstd):
    fill(sampled, 20)
    with pytest.raises(CommandError, match=r"needs zstd: install the zstandard package \(pip install zstandard"):
        train(tmp_path, "sampled", output=tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_it_needs_somewhere_to_put_the_dictionary(sampled, tmp_path):
    fill(sampled, 20)
    with pytest.raises(CommandError, match="--output FILE, --install, or both"):
        train(tmp_path, "sampled")


def test_install_stores_it_in_the_caches_table_for_auto(sampled, tmp_path):
    fill(sampled, 100)
    if not isinstance(sampled, MySQLCache):
        with pytest.raises(CommandError, match="--install keeps the dictionary in a MySQLCache"):
            train(tmp_path, "sampled", install=True)
        return
    out, err = train(tmp_path, "sampled", install=True, output=tmp_path / "copy.zstd",
                     samples=100, size=2048)
    dictionary = Dictionary((tmp_path / "copy.zstd").read_bytes())
    assert f"wrote {tmp_path / 'copy.zstd'} and the table of cache 'sampled' " \
           f"(zstd dictionary {dictionary.id}" in out
    assert "set its OPTIONS['COMPRESS_DICTIONARY'] to 'auto'" in err  # this one does not read it
    (found_id, content), = sql(f"SELECT `dictionary_id`, `content` FROM `{TABLE}_dictionaries`")
    encrypted = "ENCRYPTION_KEYS" in CACHES["sampled"]["OPTIONS"]
    assert found_id == dictionary.id
    assert (bytes(content) != dictionary.content) is encrypted  # sealed with the cache's keys
    auto = {**CACHES["sampled"], "OPTIONS": {**CACHES["sampled"]["OPTIONS"],
                                             "COMPRESS_DICTIONARY": "auto",
                                             "COMPRESS_MIN_LENGTH": 400}}
    with override_settings(CACHES={**CACHES, "auto": auto}):
        caches["auto"].set("new", [api_response(random.Random(5)) for _ in range(3)])
        data, flags = [row[1:] for row in sql(
            f"SELECT `cache_key`, `value`, `flags` FROM `{TABLE}` WHERE `cache_key` = ':1:new'")][0]
        payload, _ = caches["auto"].codec.opened(bytes(data), flags, ":1:new")
        assert frame_dictionary_id(payload) == dictionary.id
        # Trained again on entries now compressed with it: sampling reads them through the
        # table (none skipped), and the new dictionary is installed beside the first.
        caches["auto"].set_many({f"api:{n}": value for n, value in enumerate(
            [[api_response(random.Random(n)) for _ in range(3)] for n in range(100)])})
        _, err = train(tmp_path, "auto", install=True, samples=150, size=2048)
        assert "Skipped" not in err
        assert len(sql(f"SELECT 1 FROM `{TABLE}_dictionaries`")) == 2
    sql(f"DROP TABLE `{TABLE}_dictionaries`")


def test_the_report_measures_the_gain_at_the_cache_s_own_threshold(sampled, tmp_path):
    """The values here (about 700 bytes) are under MySQLCache's COMPRESS_MIN_LENGTH (1000)
    and over MemcachedCache's (400): the dictionary's gain is one the MySQL cache does not
    take until its threshold comes down, and the report says so and by how much."""
    fill(sampled, 300)
    out, _ = train(tmp_path, "sampled", output=tmp_path / "d", samples=1000, size=4096)
    assert re.search(r"On 60 other entries \([\d,]+ bytes serialized, \d+ bytes on average\):",
                     out), out
    assert "  every entry compressed:\n" in out
    threshold = sampled.codec.compress_min_length
    if isinstance(sampled, MySQLCache):
        assert f"  as this cache compresses (from COMPRESS_MIN_LENGTH {threshold} bytes: 0% " \
            "of these entries):\n" in out, out
        assert re.search(r"    zstd-3 \+ dictionary +1\.00x smaller\n", out), out
        suggested = re.search(
            rf"The dictionary's gain is on entries under {threshold} bytes, which this cache "
            r"stores as they are: COMPRESS_MIN_LENGTH (\d+) would compress (\d+)% of these "
            r"entries, (\d+\.\d\d)x smaller with the dictionary \((\d+)% of its gain\)\.", out)
        assert suggested, out
        assert int(suggested[1]) < 600 and int(suggested[2]) >= 90 and int(suggested[4]) >= 90
        assert float(suggested[3]) > 2
    else:
        assert f"  as this cache compresses (from COMPRESS_MIN_LENGTH {threshold} bytes: 100% " \
            "of these entries):\n" in out, out
        assert re.search(rf"This cache's COMPRESS_MIN_LENGTH of {threshold} bytes takes "
                         r"100% of the dictionary's gain\.", out), out
