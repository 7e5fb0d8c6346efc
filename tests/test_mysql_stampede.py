"""MySQLCache's own herd protection (``django_kvcache.mysql.lease``) on real MariaDB: the
statements it sends, stale rows and what plain operations make of them, culling within the
stale window, leases on shards, early recomputation, and ``ttl()``.

The behaviour both backends share (32 threads → 1 computation, processes, coroutines, a
dead holder replaced) is in ``tests/test_stampede.py``.
"""
from __future__ import annotations

import asyncio
import io
import logging
import math
import os
import signal
import threading
import time
from functools import partial
from typing import Any, Iterator

import MySQLdb
import pytest
from django.conf import settings
from django.db import OperationalError, connections
from django.core.management import call_command
from django.test.utils import override_settings

from django_kvcache import stampede, steps
from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.maintenance import cull_all
from django_kvcache.mysql.keys import DIGEST_HEAD_LENGTH, DIGEST_MARKER, MAX_KEY_LENGTH
from django_kvcache.mysql.lease import LEASE_KEY_HEAD, RELEASED, MySQLLeaseStore, lease_key
from django_kvcache.stampede import recompute_early
from django_kvcache.mysql import blocking
from tests.mysql_support import (
    MYISAM_TABLE,
    in_another_thread,
    register_alias,
    sent_statements,
    unregister_alias,
)
from tests.concurrency import FORK, WORKER_TIMEOUT
from tests.servers import free_port, replica_caught_up
from tests.test_stampede import Computation, in_threads

TABLE = "kvcache_mysql_stampede"
SHARDS = list(settings.SHARD_ALIASES)
DEAD = "kvcache_stampede_dead"

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", *SHARDS])


def build(**options: Any) -> MySQLCache:
    cache = MySQLCache(TABLE, {"OPTIONS": {"CULL_PROBABILITY": 0, **options}})
    if not cache.table_exists():
        cache.create_table()
    return cache


@pytest.fixture
def cache() -> Iterator[MySQLCache]:
    cache = build(LEASE_TIMEOUT=2, STALE_TIMEOUT=30)
    cache.clear()
    yield cache
    cache.clear()


def rows(alias: str = "default") -> dict[str, tuple[bytes, int]]:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT `cache_key`, `value`, `expires` FROM `{TABLE}`")
        return {key: (bytes(value), expires) for key, value, expires in cursor.fetchall()}


def expire(cache: MySQLCache, key: str, seconds_ago: float, alias: str = "default") -> None:
    """Move an entry's expiry into the past, as if it had expired ``seconds_ago``."""
    stored = cache.make_and_validate_key(key)
    expires = time.time_ns() // 1_000_000 - int(seconds_ago * 1000)
    with connections[alias].cursor() as cursor:
        cursor.execute(f"UPDATE `{TABLE}` SET `expires` = %s WHERE `cache_key` = %s",
                       (expires, stored))


def statements(sent: list[str]) -> list[str]:
    return sent


def store_of(cache: MySQLCache, key: str = "hot", timeout: Any = 60) -> MySQLLeaseStore:
    store = cache._lease_store(key, timeout, None)
    assert isinstance(store, MySQLLeaseStore)
    return store


# --- statements ------------------------------------------------------------------------------


def test_a_waiter_reads_in_one_statement_and_a_winner_takes_the_lease_in_one(cache):
    cache.set("hot", "old", 60)
    expire(cache, "hot", 1)  # stale: inside STALE_TIMEOUT
    with sent_statements("default") as taking:
        holder = steps.run(store_of(cache).read())
    assert holder == stampede.Read(stampede.MISSING, False, True)
    sent = statements(taking)
    assert len(sent) == 2 and sent[0].startswith("SELECT") and sent[1].startswith("INSERT")

    with sent_statements("default") as waiting:
        waiter = steps.run(store_of(cache).read())
    assert waiter == stampede.Read("old", False, False)  # the stale value, at once
    assert len(statements(waiting)) == 1

    cache.set("hot", "new", 60)
    with sent_statements("default") as hit:
        assert steps.run(store_of(cache).read()) == stampede.Read("new", True, False)
    assert len(statements(hit)) == 1


def test_a_hit_through_get_or_set_is_one_statement(cache):
    cache.set("hot", "value", 60)
    with sent_statements("default") as captured:
        assert cache.get_or_set("hot", Computation()) == "value"
    assert len(statements(captured)) == 1


def test_the_winner_stores_then_releases_its_own_lease(cache):
    store = store_of(cache)
    assert steps.run(store.read()).won
    with sent_statements("default") as captured:
        steps.run(store.store("value"))
    sent = statements(captured)
    assert len(sent) == 2 and sent[1].startswith("UPDATE")
    value, _ = rows()[store.lease_key]
    assert value == RELEASED + store.token  # released: the next caller may take it at once
    assert cache.get("hot") == "value"


# --- stale rows and plain operations ---------------------------------------------------------


def test_an_expired_row_in_the_stale_window_is_a_miss_for_plain_operations(cache):
    cache.set("hot", 5, 60)
    expire(cache, "hot", 1)
    assert cache.make_and_validate_key("hot") in rows()  # kept for get_or_set...
    assert cache.get("hot") is None  # ...but every plain read misses it
    assert cache.has_key("hot") is False
    assert cache.get_many(["hot"]) == {}
    assert cache.keys_with_prefix("") == []
    assert cache.ttl("hot") == 0
    assert cache.touch("hot") is False
    with pytest.raises(ValueError):
        cache.incr("hot")
    assert cache.add("hot", "added") is True  # add() takes the expired row over
    assert cache.get("hot") == "added"


def test_a_plain_set_entry_has_a_stale_value_too(cache):
    cache.set("hot", "old", 60)  # not written by get_or_set: the row itself is the stale copy
    expire(cache, "hot", 1)
    holder = store_of(cache)
    assert steps.run(holder.read()).won
    assert cache.get_or_set("hot", Computation("new")) == "old"


def test_a_stale_value_is_never_served_past_stale_timeout():
    cache = build(LEASE_TIMEOUT=2, STALE_TIMEOUT=1)
    cache.clear()
    cache.set("hot", "old", 60)
    expire(cache, "hot", 0.5)
    assert steps.run(store_of(cache).read()).won
    assert steps.run(store_of(cache).read()).value == "old"  # 0.5 s into the window
    expire(cache, "hot", 1.01)
    assert steps.run(store_of(cache).read()) == stampede.Read(stampede.MISSING, False, False)


def test_without_stale_timeout_an_expired_value_is_never_served():
    cache = build(LEASE_TIMEOUT=2)
    cache.clear()
    cache.set("hot", "old", 60)
    expire(cache, "hot", 0.001)
    assert steps.run(store_of(cache).read()).won
    assert steps.run(store_of(cache).read()) == stampede.Read(stampede.MISSING, False, False)


def test_stale_values_answer_the_others_within_a_few_ms(cache):
    cache.set("hot", "old", 60)
    expire(cache, "hot", 1)
    compute = Computation("new")

    def call(index: int) -> tuple[Any, float]:
        own = build(LEASE_TIMEOUT=2, STALE_TIMEOUT=30)
        own.get("warm-up")  # connected before the clock starts
        started = time.monotonic()
        return own.get_or_set("hot", compute, timeout=60), time.monotonic() - started

    results = in_threads(32, call)
    assert compute.calls == 1
    stale = sorted(seconds for value, seconds in results if value == "old")
    assert len(stale) == 31
    # The median waiter answered in milliseconds (2 cores, 32 threads), not after COMPUTE.
    assert stale[len(stale) // 2] < 0.03
    assert stale[-1] < compute.seconds


def test_delete_of_an_expired_entry_drops_its_stale_value(cache):
    cache.set("hot", "old", 60)
    expire(cache, "hot", 1)
    with sent_statements("default") as captured:
        assert cache.delete("hot") is False  # there was no live entry
    assert len(statements(captured)) == 2  # the live delete, then the stale row's
    assert steps.run(store_of(cache).read()).value is stampede.MISSING
    assert cache.make_and_validate_key("hot") not in rows()
    cache.set("live", 1, 60)
    with sent_statements("default") as captured:
        assert cache.delete("live") is True
    assert len(statements(captured)) == 1
    plain = build()  # without STALE_TIMEOUT: one statement, as before
    with sent_statements("default") as captured:
        assert plain.delete("missing") is False
    assert len(statements(captured)) == 1


def test_a_delete_through_set_with_timeout_zero_drops_the_stale_value(cache):
    cache.set("hot", "old", 60)
    expire(cache, "hot", 1)
    cache.set("hot", "ignored", 0)  # deletes the row, live or not
    assert steps.run(store_of(cache).read()).value is stampede.MISSING


def test_a_corrupt_stale_row_is_a_logged_miss(cache, caplog):
    cache.set("hot", "old", 60)
    stored = cache.make_and_validate_key("hot")
    with connections["default"].cursor() as cursor:
        cursor.execute(f"UPDATE `{TABLE}` SET `flags` = 99 WHERE `cache_key` = %s", (stored,))
    expire(cache, "hot", 1)
    with caplog.at_level(logging.WARNING):
        assert cache.get_or_set("hot", "fresh") == "fresh"
    assert any("corrupt" in r.getMessage() for r in caplog.records)


# --- leases ----------------------------------------------------------------------------------


def test_lease_keys_are_no_caller_s_and_invisible_to_prefix_operations(cache):
    key = lease_key(cache.make_and_validate_key("hot"))
    assert len(key) == MAX_KEY_LENGTH and key.startswith(LEASE_KEY_HEAD)
    assert key[DIGEST_HEAD_LENGTH : DIGEST_HEAD_LENGTH + len(DIGEST_MARKER)] != DIGEST_MARKER
    assert lease_key(cache.make_and_validate_key("hot", version=2)) != key
    assert steps.run(store_of(cache).read()).won
    assert key in rows()
    assert cache.keys_with_prefix("") == [] and cache.get_with_prefix("") == {}
    no_prefix = MySQLCache(TABLE, {"KEY_PREFIX": "", "OPTIONS": {"CULL_PROBABILITY": 0}})
    assert no_prefix.keys_with_prefix("") == []


def test_a_hung_holder_is_replaced_by_one_winner_and_cannot_release_its_lease():
    cache = build(LEASE_TIMEOUT=1)
    cache.clear()
    hung = store_of(cache)
    assert steps.run(hung.read()).won
    compute = Computation(seconds=0.1)
    started = time.monotonic()
    results = in_threads(16, lambda i: build(LEASE_TIMEOUT=1).get_or_set("hot", compute, 60))
    assert compute.calls == 1 and results == ["fresh"] * 16
    assert time.monotonic() - started >= 0.9  # nobody computed while the hung lease lived

    # A second hung holder's late release leaves the current holder's lease alone.
    cache.delete("hot")
    with connections["default"].cursor() as cursor:  # the last lease lapses
        cursor.execute(f"UPDATE `{TABLE}` SET `expires` = 0 WHERE `cache_key` = %s",
                       (hung.lease_key,))
    current = store_of(cache)
    assert steps.run(current.read()).won
    steps.run(hung.store("late"))  # its value is written (as a plain set would)...
    assert rows()[hung.lease_key][0] == current.token  # ...but the lease stays taken
    steps.run(hung.release())
    assert rows()[hung.lease_key][0] == current.token


def test_a_lease_holder_killed_mid_compute_is_replaced_by_exactly_one_winner():
    """A real process takes the lease through get_or_set and is SIGKILLed while computing:
    nobody computes while its lease lives, then exactly one caller does."""
    cache = build(LEASE_TIMEOUT=1)
    cache.clear()
    computing = FORK.Event()

    def doomed() -> None:
        def compute() -> str:
            computing.set()
            time.sleep(60)
            return "never"

        build(LEASE_TIMEOUT=1).get_or_set("hot", compute, 60)

    process = FORK.Process(target=doomed)
    connections.close_all()  # the child inherits no socket of ours to tear down when killed
    process.start()
    try:
        assert computing.wait(WORKER_TIMEOUT)
        killed_at = time.monotonic()
        os.kill(process.pid, signal.SIGKILL)
        process.join(WORKER_TIMEOUT)
    finally:
        if process.is_alive():
            process.kill()
    compute = Computation(seconds=0.1)
    results = in_threads(16, lambda i: build(LEASE_TIMEOUT=1).get_or_set("hot", compute, 60))
    assert compute.calls == 1 and results == ["fresh"] * 16
    assert time.monotonic() - killed_at >= 0.8  # the dead holder's lease was waited out
    assert cache.get("hot") == "fresh"


def test_a_lease_read_free_but_taken_and_released_since_is_not_won(cache):
    late = store_of(cache)
    seen = late._call(False, late._select, None).run()  # its read only
    other = store_of(cache)
    assert steps.run(other.read()).won
    steps.run(other.store("value"))
    lease_row = [row for row in seen[1] if row[0] == late.lease_key]
    assert lease_row == []  # it read the lease free (no row)...
    # ...and the take that follows that read finds a released row, not a missing one.
    assert late._call(True, partial(late._take, None), True).run() is False


def test_of_two_callers_that_read_the_same_released_lease_only_the_first_takes_it(cache):
    """The compare-and-set is on the lease row's value (a token, or a released marker with
    one), not on its expiry, which a take and a release in the same millisecond share."""
    previous = store_of(cache)
    assert steps.run(previous.read()).won
    steps.run(previous.store("value"))
    cache.delete("hot")  # the entry goes, the released lease row stays
    first, second = store_of(cache), store_of(cache)
    seen = {}
    for store in (first, second):
        _, found = store._call(False, store._select, None).run()
        (seen[store],) = [bytes(value) for key, value, _, _ in found if key == store.lease_key]
    assert seen[first] == seen[second] == RELEASED + previous.token
    assert first._call(True, partial(first._take, seen[first]), True).run() is True
    assert second._call(True, partial(second._take, seen[second]), True).run() is False
    assert rows()[first.lease_key][0] == first.token


def test_the_lease_row_lives_on_the_entry_s_shard():
    if len(SHARDS) < 3:
        pytest.skip("needs KVCACHE_MYSQL_SHARD_PORTS")
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASES": SHARDS, "CULL_PROBABILITY": 0,
                                           "LEASE_TIMEOUT": 2, "STALE_TIMEOUT": 30}})
    if not cache.table_exists():
        cache.create_table()
    cache.clear()
    try:
        for index in range(12):
            key = f"hot{index}"
            store = store_of(cache, key)
            assert steps.run(store.read()).won
            owner = cache._shard_for(store.entry_key).alias
            steps.run(store.store(index))
            assert store.lease_key in rows(owner)
            assert store.entry_key in rows(owner)
        assert {cache._shard_for(cache.make_key(f"hot{i}")).alias for i in range(12)} == set(SHARDS)
    finally:
        cache.clear()
        for alias in SHARDS:  # clear() keeps lease rows outside KEY_PREFIX: none is set here
            assert rows(alias) == {}


# --- culling ---------------------------------------------------------------------------------


def test_culling_keeps_stale_rows_for_stale_timeout_and_deletes_them_after():
    cache = build(LEASE_TIMEOUT=2, STALE_TIMEOUT=60)
    cache.clear()
    for key in ("recent", "old", "live"):
        cache.set(key, key, 600)
    expire(cache, "recent", 30)  # in the stale window
    expire(cache, "old", 61)  # past it
    assert cache.cull() == 1
    kept = {cache.make_and_validate_key(k) for k in ("recent", "live")}
    assert set(rows()) == kept

    plain = build()  # the same table, without STALE_TIMEOUT: expired means deletable
    assert plain.cull() == 1
    assert set(rows()) == {cache.make_and_validate_key("live")}


def test_kvcache_cull_and_cull_all_keep_stale_rows_too():
    options = {"CULL_PROBABILITY": 0, "LEASE_TIMEOUT": 2, "STALE_TIMEOUT": 60}
    entry = {"BACKEND": "django_kvcache.backends.mysql.MySQLCache", "LOCATION": TABLE,
             "OPTIONS": options}
    cache = build(**options)
    cache.clear()
    for key in ("recent", "old", "older"):
        cache.set(key, 1, 600)
    expire(cache, "recent", 30)
    expire(cache, "old", 61)
    expire(cache, "older", 62)
    with override_settings(CACHES={**settings.CACHES, "stale": entry}):
        assert cull_all(["stale"]) == {"stale": 2}  # "old" and "older"
        expire(cache, "recent", 61)
        out = io.StringIO()
        call_command("kvcache_cull", "stale", stdout=out)
        assert "stale: 1 rows deleted" in out.getvalue()  # "recent", out of the window now
    assert rows() == {}


def test_a_write_path_cull_keeps_stale_rows_too():
    cache = build(LEASE_TIMEOUT=2, STALE_TIMEOUT=60, CULL_PROBABILITY=1)
    cache.clear()
    cache.set("recent", 1, 600)
    cache.set("old", 1, 600)
    expire(cache, "recent", 30)
    expire(cache, "old", 61)
    cache.set("trigger", 1, 600)  # culls first
    assert set(rows()) == {cache.make_and_validate_key(k) for k in ("recent", "trigger")}


def test_released_lease_rows_are_culled_once_expired(cache):
    store = store_of(cache)
    assert steps.run(store.read()).won
    steps.run(store.store("v"))
    with connections["default"].cursor() as cursor:
        cursor.execute(f"UPDATE `{TABLE}` SET `expires` = %s WHERE `cache_key` = %s",
                       (time.time_ns() // 1_000_000 - 31_000, store.lease_key))
    cache.cull()
    assert store.lease_key not in rows()


# --- early recomputation ---------------------------------------------------------------------


def test_the_early_rule_rises_to_certainty_at_expiry():
    window = 3.0
    assert not recompute_early(3.0, window, 0.0)  # before the window: never
    assert not recompute_early(0.5, None, 0.0)  # no window: never
    assert recompute_early(2.999, window, 0.04)  # just inside: ~5 %
    assert not recompute_early(2.999, window, 0.06)
    assert recompute_early(1.0, window, math.exp(-1) - 0.01)
    assert not recompute_early(1.0, window, math.exp(-1) + 0.01)
    assert recompute_early(0.0, window, 0.999)  # at expiry: always


def test_the_early_window_is_bounded_by_the_entry_s_lifetime():
    policy = stampede.Policy(lease_timeout=2, stale_timeout=None, early_recompute=30)
    assert policy.early_window(300) == 30
    assert policy.early_window(60) == 15  # a quarter of the lifetime
    assert policy.early_window(5) == 1.25
    assert policy.early_window(None) is None  # never expires: nothing to renew early
    assert stampede.Policy(2, None).early_window(60) is None


def test_an_early_winner_recomputes_while_the_others_get_the_fresh_value():
    cache = build(LEASE_TIMEOUT=2, EARLY_RECOMPUTE=5)
    cache.clear()
    cache.set("hot", "current", 3)  # inside the last 5 seconds
    early = MySQLLeaseStore(cache, cache.stampede, "hot", 60, None, draw=lambda: 0.0)
    assert steps.run(early.read()) == stampede.Read("current", True, True)
    other = MySQLLeaseStore(cache, cache.stampede, "hot", 60, None, draw=lambda: 0.0)
    assert steps.run(other.read()) == stampede.Read("current", True, False)  # lease held
    steps.run(early.store("next"))
    assert 55 < cache.ttl("hot") <= 60
    later = MySQLLeaseStore(cache, cache.stampede, "hot", 60, None, draw=lambda: 0.0)
    assert steps.run(later.read()) == stampede.Read("next", True, False)  # out of the window


def test_an_entry_younger_than_its_window_is_not_recomputed_even_on_the_eagerest_draw():
    """EARLY_RECOMPUTE longer than the entry's timeout: the window is bounded by the
    entry's lifetime, so a fresh 5 s entry is served, whatever the draw."""
    cache = build(LEASE_TIMEOUT=2, EARLY_RECOMPUTE=30)
    cache.clear()
    cache.set("short", "current", 5)
    eager = MySQLLeaseStore(cache, cache.stampede, "short", 5, None, draw=lambda: 0.0)
    assert steps.run(eager.read()) == stampede.Read("current", True, False)
    expire(cache, "short", -0.5)  # half a second left: inside a quarter of its lifetime
    eager = MySQLLeaseStore(cache, cache.stampede, "short", 5, None, draw=lambda: 0.0)
    assert steps.run(eager.read()) == stampede.Read("current", True, True)


def test_a_hot_key_under_steady_load_never_misses_at_expiry():
    """Without STALE_TIMEOUT a miss would make every caller wait for the computation; with
    EARLY_RECOMPUTE one caller refreshes the entry before it expires, so none ever does."""
    timeout, early, compute_seconds, duration = 1.5, 1.0, 0.2, 5.0
    options = {"LEASE_TIMEOUT": 2, "EARLY_RECOMPUTE": early}
    build(**options).clear()
    build(**options).set("hot", "first", timeout)
    compute = Computation("again", seconds=compute_seconds)
    waits: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration

    def load(index: int) -> int:
        own = build(**options)
        calls = 0
        while time.monotonic() < deadline:
            before = compute.calls
            started = time.monotonic()
            assert own.get_or_set("hot", compute, timeout) in ("first", "again")
            took = time.monotonic() - started
            if compute.calls == before:  # not this caller's own computation
                with lock:
                    waits.append(took)
            calls += 1
            time.sleep(0.01)
        return calls

    calls = sum(in_threads(8, load))
    assert calls > 200
    # Refreshed every ~0.5-1.5 s over 5 s: a few computations, never one per caller.
    assert 2 <= compute.calls <= math.ceil(duration / (timeout - early)) + 1
    slow = [took for took in waits if took >= compute_seconds * 0.75]
    assert len(slow) <= 2, sorted(waits)[-5:]  # no herd waited on a missing entry


# --- ttl -------------------------------------------------------------------------------------


def test_ttl(cache):
    assert cache.ttl("missing") == 0
    cache.set("forever", 1, None)
    assert cache.ttl("forever") is None
    cache.set("ten", 1, 10)
    assert isinstance(cache.ttl("ten"), float) and 9 < cache.ttl("ten") <= 10
    cache.set("huge", 1, 10**17)  # beyond what BIGINT ms hold: stored as "never expires"
    assert cache.ttl("huge") is None
    cache.set("versioned", 1, 10, version=2)
    assert cache.ttl("versioned") == 0 and 9 < cache.ttl("versioned", version=2) <= 10
    long_key = "k" * 300  # stored in digest form
    cache.set(long_key, 1, 10)
    assert 9 < cache.ttl(long_key) <= 10
    cache.set("short", 1, 0.2)
    time.sleep(0.3)
    assert cache.ttl("short") == 0  # expired (and in the stale window: still 0)
    assert asyncio.run(cache.attl("forever")) is None


def test_ttl_on_every_shard():
    if len(SHARDS) < 3:
        pytest.skip("needs KVCACHE_MYSQL_SHARD_PORTS")
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASES": SHARDS, "CULL_PROBABILITY": 0}})
    if not cache.table_exists():
        cache.create_table()
    cache.clear()
    keys = [f"k{i}" for i in range(12)]
    cache.set_many({key: 1 for key in keys}, 30)
    assert {cache._shard_for(cache.make_key(k)).alias for k in keys} == set(SHARDS)
    assert all(29 < cache.ttl(key) <= 30 for key in keys)
    cache.clear()


@pytest.fixture
def dead_shard(django_db_blocker) -> Iterator[str]:
    entry = {**settings.DATABASES["shard1"], "PORT": str(free_port()),
             "OPTIONS": {"charset": "utf8mb4", "connect_timeout": 2}}
    entry.pop("TEST", None)
    register_alias(DEAD, entry)
    try:
        with django_db_blocker.unblock():
            yield DEAD
    finally:
        unregister_alias(DEAD)


def on_dead_shard(cache: MySQLCache) -> str:
    return next(f"k{i}" for i in range(100)
                if cache._shard_for(cache.make_key(f"k{i}")).alias == DEAD)


def test_ttl_and_get_or_set_on_an_unreachable_shard_under_ignore_exceptions(dead_shard, caplog):
    cache = MySQLCache(TABLE, {"OPTIONS": {
        "DATABASES": ["default", DEAD], "IGNORE_EXCEPTIONS": True, "CULL_PROBABILITY": 0,
        "LEASE_TIMEOUT": 5, "RETRY_TIMEOUT": 60,
    }})
    key = on_dead_shard(cache)
    with caplog.at_level(logging.WARNING):
        assert cache.ttl(key) == 0
        started = time.monotonic()
        assert cache.get_or_set(key, "computed") == "computed"  # no wait for a lease
        assert time.monotonic() - started < 2
    assert any(DEAD in r.getMessage() for r in caplog.records)

    raising = MySQLCache(TABLE, {"OPTIONS": {"DATABASES": ["default", DEAD],
                                             "CULL_PROBABILITY": 0, "IGNORE_EXCEPTIONS": False}})
    with pytest.raises(OperationalError):
        raising.ttl(key)


def test_a_released_lease_is_free_again_as_soon_as_the_entry_expires():
    """The released lease row outlives a short entry (LEASE_TIMEOUT > timeout): the first
    caller after expiry takes it over from its state as read, without waiting for it."""
    cache = build(LEASE_TIMEOUT=10, STALE_TIMEOUT=30)
    cache.clear()
    assert cache.get_or_set("hot", "first", timeout=0.3) == "first"
    time.sleep(0.4)
    compute = Computation("second", seconds=0)
    started = time.monotonic()
    assert cache.get_or_set("hot", compute, timeout=60) == "second"
    assert compute.calls == 1 and time.monotonic() - started < 1


def test_threads_on_a_missing_key_compute_once_on_a_myisam_table():
    cache = MySQLCache(MYISAM_TABLE, {"OPTIONS": {"ENGINE": "MyISAM", "CULL_PROBABILITY": 0,
                                                  "LEASE_TIMEOUT": 2}})
    if not cache.table_exists():
        cache.create_table()
    cache.clear()
    try:
        compute = Computation()
        results = in_threads(32, lambda i: MySQLCache(MYISAM_TABLE, {"OPTIONS": {
            "CULL_PROBABILITY": 0, "LEASE_TIMEOUT": 2}}).get_or_set("hot", compute))
        assert compute.calls == 1 and results == ["fresh"] * 32
    finally:
        cache.clear()


@pytest.mark.django_db(transaction=True, databases=["default", *SHARDS, "shard2_replica"])
def test_lease_reads_go_to_the_primary_and_do_not_count_as_writes():
    if len(SHARDS) < 3:
        pytest.skip("needs KVCACHE_MYSQL_SHARD_PORTS")
    options = {"DATABASES": ["shard2"], "REPLICAS": {"shard2": "shard2_replica"},
               "CULL_PROBABILITY": 0, "LEASE_TIMEOUT": 2}
    writer = MySQLCache(TABLE, {"OPTIONS": options})
    if not writer.table_exists():
        writer.create_table()
    in_another_thread(lambda: writer.set("hot", "value", 60))  # no window opened here
    replica_caught_up()  # the table and the row, on the real replica
    cache = MySQLCache(TABLE, {"OPTIONS": options})  # this thread has written nothing
    cache.get("warm-up")  # the replica's server detection, out of the way
    with sent_statements("shard2") as primary, \
            sent_statements("shard2_replica") as replica:
        assert cache.get_or_set("hot", Computation()) == "value"
        assert cache.get("hot") == "value"
    assert [q.split()[0] for q in statements(primary)] == ["SELECT"]  # the lease read
    assert [q.split()[0] for q in statements(replica)] == ["SELECT"]  # get: still the replica
    writer.clear()


# --- found by review -------------------------------------------------------------------


def test_delete_with_prefix_also_drops_stale_rows(cache):
    cache.set("page:1", "old", 60)
    cache.set("page:2", "live", 60)
    expire(cache, "page:1", 1)
    assert cache.delete_with_prefix("page:") == 1  # the live entries deleted
    assert not rows()  # the stale row is gone too: a deleted entry is never served stale
    assert cache.get_or_set("page:1", lambda: "new", 60) == "new"


def test_inside_a_caller_s_transaction_get_or_set_takes_its_lease(cache):
    """The lease row is written on the cache's own connection, committed at once: other
    callers see it (and wait for LEASE_TIMEOUT at most), whatever transaction the caller
    is in, so get_or_set is herd-proof there too."""
    from django.db import transaction

    with transaction.atomic():
        assert cache._lease_store("x", 60, None) is not None
        assert cache.get_or_set("x", lambda: "value", 60) == "value"
        assert any(key.startswith(LEASE_KEY_HEAD) for key in rows())  # released, committed


def test_the_lease_is_taken_under_simultaneous_assignment(cache):
    """MariaDB's SIMULTANEOUS_ASSIGNMENT makes an UPDATE's assignments read the old row:
    the take must not depend on reading the value it just assigned."""
    # On the cache's pooled connection (the one its next call takes: the last one in).
    blocking.query("default", "SET SESSION sql_mode = CONCAT(@@sql_mode, ',SIMULTANEOUS_ASSIGNMENT')")
    try:
        first = store_of(cache, "k")
        assert steps.run(first.read()).won  # an insert
        steps.run(first.store("v"))  # released
        expire(cache, "k", 1)
        second = store_of(cache, "k")
        assert steps.run(second.read()).won  # a take-over of the released row
        assert rows()[second.lease_key][0] == second.token
        assert not steps.run(store_of(cache, "k").read()).won  # held: nobody else wins
    finally:
        blocking.query("default",
                       "SET SESSION sql_mode = REPLACE(@@sql_mode, 'SIMULTANEOUS_ASSIGNMENT', '')")


def test_aget_or_set_called_inside_a_transaction_takes_its_lease_outside_it(cache):
    """Suspicion confirmed: the async API decided on the lease from the event loop
    thread's connection while its statements ran, through a thread hop, inside the
    caller's transaction: the lease row stayed uncommitted, invisible to every other
    caller. Async code never runs inside a user's atomic(): the lease is seen by all."""
    from asgiref.sync import async_to_sync
    from django.db import transaction

    entry = connections["default"].settings_dict
    observer = MySQLdb.connect(host=entry["HOST"], port=int(entry["PORT"]), user=entry["USER"],
                               password=entry["PASSWORD"], database=entry["NAME"])
    seen: list[int] = []

    def compute() -> str:
        observer.query(f"SELECT COUNT(*) FROM `{TABLE}` WHERE `cache_key` LIKE "
                       f"'{LEASE_KEY_HEAD}%'".encode())
        seen.append(observer.store_result().fetch_row()[0][0])
        return "value"

    try:
        with transaction.atomic():
            assert async_to_sync(cache.aget_or_set)("x", compute, 60) == "value"
    finally:
        observer.close()
    assert seen == [1]  # another session sees the lease while the value is computed
    assert cache.get("x") == "value"
