"""Routing: the published "kvcache" vectors, minimal disruption, weights, LOCATION parsing
and pymemcache-compatible placement (checked against pymemcache and Django's backend)."""
from __future__ import annotations

import uuid
from collections import Counter

import pytest
from django.conf import settings
from django.core.cache.backends.memcached import PyMemcacheCache
from django.core.exceptions import ImproperlyConfigured
from hypothesis import given, settings as hypothesis_settings, strategies as st
from pymemcache.client.murmur3 import murmur3_32
from pymemcache.client.rendezvous import RendezvousHash

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached.routing import PymemcacheRouter, make_router, parse_location
from django_kvcache.routing import KvcacheRouter, parse_weights

NAMES = ["cache-a:11211", "cache-b:11211", "cache-c:11211"]
NODES = parse_location(NAMES)

# The table published in docs/memcached.rst: key, the three scores, the winner, and the
# winner once cache-c has weight 3.
VECTORS = [
    ("", (3356201479, 220467543, 3797126410), "cache-c:11211", "cache-c:11211"),
    ("kvcache", (648929608, 3989040235, 1971563766), "cache-b:11211", "cache-b:11211"),
    (":1:user:42", (1794008562, 2387661845, 3700576864), "cache-c:11211", "cache-c:11211"),
    ("prefix:2:é", (3004180682, 202583663, 2762008511), "cache-a:11211", "cache-c:11211"),
    (":1:b", (798257132, 3124207782, 2737592360), "cache-b:11211", "cache-c:11211"),
    (":1:d", (2373862593, 1813345879, 1286392508), "cache-a:11211", "cache-c:11211"),
]
NODE_SEEDS = {"cache-a:11211": 482419806, "cache-b:11211": 2157730250, "cache-c:11211": 2263983989}


def keys(count: int) -> list[str]:
    return [f":1:key-{i}" for i in range(count)]


def owners(router, keys):
    return {key: router.names[router.winner(key)] for key in keys}


@pytest.mark.parametrize("key, scores, winner, weighted_winner", VECTORS)
def test_published_vectors(key, scores, winner, weighted_winner):
    router = KvcacheRouter(NAMES, [1.0, 1.0, 1.0])
    assert tuple(router.scores(key)) == scores
    assert router.names[router.node_for(key)] == winner
    weighted = KvcacheRouter(NAMES, [1.0, 1.0, 3.0])
    assert weighted.names[weighted.winner(key)] == weighted_winner


def test_node_seeds_are_murmur3_of_the_name():
    router = KvcacheRouter(NAMES, [1.0, 1.0, 1.0])
    assert dict(zip(NAMES, router.seeds)) == NODE_SEEDS


@pytest.mark.parametrize("key", [v[0] for v in VECTORS if v[0].isascii()])
def test_vectors_match_an_independent_murmur3(key):
    # pymemcache's pure-Python murmur3 is a second implementation (for ASCII text).
    router = KvcacheRouter(NAMES, [1.0, 1.0, 1.0])
    expected = [murmur3_32(key, murmur3_32(name, 0)) for name in NAMES]
    assert router.scores(key) == expected


def test_ranking_starts_with_the_winner_and_lists_every_node():
    router = KvcacheRouter(NAMES, [1.0, 1.0, 1.0])
    for key in keys(200):
        ranking = router.ranking(key)
        assert sorted(ranking) == [0, 1, 2]
        assert ranking[0] == router.winner(key)


def test_removing_a_node_moves_only_its_keys():
    names = [f"10.0.0.{i}:11211" for i in range(1, 9)]
    before = owners(KvcacheRouter(names, [1.0] * 8), keys(5000))
    removed = names[3]
    after = owners(KvcacheRouter(names[:3] + names[4:], [1.0] * 7), keys(5000))
    moved = {key for key in before if before[key] != after[key]}
    assert moved == {key for key, owner in before.items() if owner == removed}


def test_adding_a_node_moves_about_one_share_of_keys():
    names = [f"10.0.0.{i}:11211" for i in range(1, 8)]
    before = owners(KvcacheRouter(names, [1.0] * 7), keys(8000))
    grown = names + ["10.0.0.8:11211"]
    after = owners(KvcacheRouter(grown, [1.0] * 8), keys(8000))
    moved = [key for key in before if before[key] != after[key]]
    assert all(after[key] == "10.0.0.8:11211" for key in moved)  # only onto the new node
    assert 0.8 / 8 < len(moved) / 8000 < 1.2 / 8


def test_weights_shift_the_share_of_keys():
    names = ["a:1", "b:1", "c:1"]
    router = KvcacheRouter(names, [1.0, 1.0, 2.0])
    share = Counter(owners(router, keys(9000)).values())
    assert 0.45 < share["c:1"] / 9000 < 0.55  # 2 / (1 + 1 + 2)
    assert 0.2 < share["a:1"] / 9000 < 0.3


def test_route_memo_gives_the_same_answers_as_hashing():
    router = KvcacheRouter(NAMES, [1.0, 1.0, 1.0])
    first = [router.node_for(key) for key in keys(300)]
    assert [router.node_for(key) for key in keys(300)] == first
    assert first == [router.winner(key) for key in keys(300)]
    assert router.group(keys(300)) == {
        index: [key for key, owner in zip(keys(300), first) if owner == index]
        for index in set(first)
    }


# --- pymemcache placement -----------------------------------------------------------------


@hypothesis_settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=60))
def test_pymemcache_scheme_matches_rendezvous_hash(key):
    names = ["127.0.0.1:21211", "127.0.0.1:21212", "10.1.2.3:11211", "/run/mc.sock"]
    nodes = parse_location(names[:3] + ["unix:/run/mc.sock"])
    theirs = RendezvousHash(nodes=list(names))
    router = PymemcacheRouter(nodes, [1.0] * 4)
    assert router.hashed_names[router.winner(key)] == theirs.get_node(key)


def test_pymemcache_tie_goes_to_the_greater_name():
    router = PymemcacheRouter(parse_location(["b:1", "a:1"]), [1.0, 1.0])
    router.scores = lambda key: [7, 7]  # force a tie
    assert router.names[router.winner("x")] == "b:1"
    assert router.ranking("x") == [0, 1]


def test_pymemcache_scheme_rejects_weights():
    with pytest.raises(ImproperlyConfigured, match="WEIGHTS"):
        make_router("pymemcache", NODES, [1.0, 2.0, 1.0])


def test_switching_from_pymemcachecache_finds_every_key():
    """Django's PyMemcacheCache writes; ours, with HASHING='pymemcache', reads the same."""
    prefix = f"switch-{uuid.uuid4().hex[:8]}"
    params = {"KEY_PREFIX": prefix, "TIMEOUT": 60}
    django_cache = PyMemcacheCache(settings.MEMCACHED_NODES, params)
    ours = MemcachedCache(
        settings.MEMCACHED_NODES, {**params, "OPTIONS": {"HASHING": "pymemcache"}}
    )
    values = {f"key-{i}": value for i, value in enumerate(
        ["text", "ünïcode ✓", b"bytes", 42, -7, 3.5, {"a": [1, 2]}, None, True] * 12
    )}
    values["clé-ünïcode-😀"] = "non-ASCII key"
    try:
        django_cache.set_many(values)
        assert ours.get_many(values) == values
        for key, value in values.items():
            assert ours.get(key) == value
        # and back: what we write (uncompressed) Django's backend reads, on the same node
        ours.set_many({key: ("ours", key) for key in values})
        assert django_cache.get_many(values) == {key: ("ours", key) for key in values}
        django_cache.set("counter", 42)
        assert ours.incr("counter") == 43 and django_cache.get("counter") == 43
    finally:
        django_cache.delete_many([*values, "counter"])
        django_cache.close()


def test_default_scheme_places_keys_differently_from_pymemcache():
    # The two schemes are distinct: a sanity check that HASHING really switches.
    kv = KvcacheRouter(NAMES, [1.0] * 3)
    pm = PymemcacheRouter(NODES, [1.0] * 3)
    assert [kv.winner(k) for k in keys(100)] != [pm.winner(k) for k in keys(100)]


# --- LOCATION -----------------------------------------------------------------------------


def test_location_forms():
    assert [n.name for n in parse_location("a:1;b:2, c:3")] == ["a:1", "b:2", "c:3"]
    assert [n.name for n in parse_location(["a", "[::1]:11212"])] == ["a:11211", "[::1]:11212"]
    unix = parse_location("unix:/tmp/memcached.sock")[0]
    assert (unix.name, unix.server, unix.pymemcache_name) == (
        "unix:/tmp/memcached.sock", "/tmp/memcached.sock", "/tmp/memcached.sock"
    )
    assert parse_location(["[::1]:11212"])[0].server == ("::1", 11212)


@pytest.mark.parametrize(
    "location",
    ["", [], "a:1,a:1", "host:notaport", "host:70000", "unix:relative", "a b:1", 42, [("a", 1)]],
)
def test_bad_location_is_improperly_configured(location):
    with pytest.raises(ImproperlyConfigured, match="LOCATION"):
        MemcachedCache(location, {})


def test_weights_must_name_location_entries_and_be_positive():
    with pytest.raises(ImproperlyConfigured, match="WEIGHTS"):
        parse_weights({"elsewhere:1": 2}, NAMES)
    with pytest.raises(ImproperlyConfigured, match="WEIGHTS"):
        parse_weights({"cache-a:11211": 0}, NAMES)
    with pytest.raises(ImproperlyConfigured, match="WEIGHTS"):
        parse_weights([2, 1, 1], NAMES)
    assert parse_weights({"cache-b:11211": 2}, NAMES) == [1.0, 2.0, 1.0]
