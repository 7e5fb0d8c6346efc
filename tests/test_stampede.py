"""Herd protection of get_or_set (LEASE_TIMEOUT, STALE_TIMEOUT) on both backends, with real
servers, threads, processes and coroutines: one computation per missing or expired key."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_kvcache import stampede, steps
from tests.concurrency import run_processes
from tests.contract import CacheFixture
from tests.mysql_support import BACKEND as MYSQL_BACKEND, ensure_table

MEMCACHED_BACKEND = "django_kvcache.backends.memcached.MemcachedCache"
COMPUTE = 0.3  # seconds a computation takes: long enough for every caller to pile up
THREADS = 32


class Computation:
    """A default that counts its calls across threads and takes COMPUTE seconds."""

    def __init__(self, value: Any = "fresh", seconds: float = COMPUTE) -> None:
        self.value = value
        self.seconds = seconds
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> Any:
        with self.lock:
            self.calls += 1
        time.sleep(self.seconds)
        return self.value


def in_threads(count: int, work) -> list[Any]:
    """``work(index)`` in ``count`` threads released together; their results by index."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = work(index)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def while_recomputed(cache: Any, key: str, call) -> Any:
    """What ``call()`` (a get_or_set of ``key``) gives while another caller, through
    ``cache``'s lease store, holds ``key``'s lease and stores ``"recomputed"`` 0.2 s
    later: that value, unless ``call`` is answered with a stale one."""
    holder = cache._lease_store(key, 60, None)
    assert steps.run(holder.read()).won
    storing = threading.Timer(0.2, lambda: steps.run(holder.store("recomputed")))
    storing.start()
    try:
        return call()
    finally:
        storing.join()


class StampedeContract(CacheFixture):
    lease = {"LEASE_TIMEOUT": 2}

    def guarded(self, **options: Any):
        return self.build(OPTIONS={**self.backend_params().get("OPTIONS", {}), **options})

    @pytest.fixture
    def cache(self):
        cache = self.guarded(**self.lease)
        cache.clear()
        yield cache
        cache.clear()

    def test_threads_on_a_missing_key_compute_once(self, cache):
        compute = Computation()
        results = in_threads(THREADS, lambda i: self.guarded(**self.lease).get_or_set("hot", compute))
        assert compute.calls == 1
        assert results == ["fresh"] * THREADS
        assert cache.get("hot") == "fresh"

    def test_with_a_stale_value_the_others_answer_at_once(self, cache):
        options = {**self.lease, "STALE_TIMEOUT": 30}
        first = self.guarded(**options)
        assert first.get_or_set("hot", "old", timeout=1) == "old"
        time.sleep(2.3)  # expired (1 to 2 s: whole seconds): only the stale copy is left
        compute = Computation("new")

        def call(index: int) -> tuple[Any, float]:
            own = self.guarded(**options)
            started = time.monotonic()
            return own.get_or_set("hot", compute, timeout=60), time.monotonic() - started

        results = in_threads(THREADS, call)
        assert compute.calls == 1
        values = [value for value, _ in results]
        assert values.count("new") == 1 and values.count("old") == THREADS - 1
        waited = sorted(seconds for value, seconds in results if value == "old")
        assert waited[len(waited) // 2] < 0.05  # median: answered at once, not after COMPUTE
        assert first.get("hot") == "new"

    def test_a_stale_value_is_never_served_past_stale_timeout(self, cache):
        options = {**self.lease, "STALE_TIMEOUT": 1}
        guarded = self.guarded(**options)
        guarded.get_or_set("hot", "old", timeout=1)
        time.sleep(3.3)  # past expiry + STALE_TIMEOUT (whole seconds, one more on memcached)
        holder = guarded._lease_store("hot", 60, None)  # the backend's own store
        assert steps.run(holder.read()).won  # someone else recomputes...
        started = time.monotonic()
        waiter = self.guarded(**{**options, "LEASE_TIMEOUT": 1})
        assert waiter.get_or_set("hot", "new") == "new"  # ...but nothing stale is left
        assert time.monotonic() - started >= 0.9  # it waited for the lease, then took over

    def test_a_lease_holder_that_died_is_replaced_by_one_winner(self, cache):
        options = {"LEASE_TIMEOUT": 1}
        crashed = self.guarded(**options)
        holder = crashed._lease_store("hot", 60, None)
        assert steps.run(holder.read()).won
        compute = Computation(seconds=0.1)
        started = time.monotonic()
        results = in_threads(16, lambda i: self.guarded(**options).get_or_set("hot", compute))
        assert compute.calls == 1
        assert results == ["fresh"] * 16
        assert time.monotonic() - started >= 0.9  # nobody computed while the lease lived

    def test_a_failed_computation_releases_the_lease(self, cache):
        def fail():
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            cache.get_or_set("hot", fail)
        started = time.monotonic()
        assert cache.get_or_set("hot", "value") == "value"
        assert time.monotonic() - started < 0.5  # no wait for the dead lease

    def test_processes_and_threads_compute_once(self, cache):
        params = self.backend_params()
        options = {**params.get("OPTIONS", {}), **self.lease}

        def work(index: int) -> int:
            compute = Computation()
            in_threads(8, lambda i: self.build(OPTIONS=options).get_or_set("hot", compute))
            return compute.calls

        assert sum(run_processes(4, work)) == 1
        assert cache.get("hot") == "fresh"

    def test_coroutines_on_aget_or_set_compute_once(self, cache):
        calls = []

        async def compute():
            calls.append(1)
            await asyncio.sleep(COMPUTE)
            return "fresh"

        async def herd():
            return await asyncio.gather(*(cache.aget_or_set("hot", compute) for _ in range(64)))

        assert asyncio.run(herd()) == ["fresh"] * 64
        assert len(calls) == 1

    def test_coroutines_on_an_expired_key_compute_once_and_get_the_stale_value(self, cache):
        options = {**self.lease, "STALE_TIMEOUT": 30}
        guarded = self.guarded(**options)
        guarded.get_or_set("hot", "old", timeout=1)
        time.sleep(2.3)  # expired (memcached counts whole seconds): only the stale copy
        calls = []

        async def compute():
            calls.append(1)
            await asyncio.sleep(COMPUTE)
            return "new"

        async def herd():
            return await asyncio.gather(*(guarded.aget_or_set("hot", compute, timeout=60)
                                          for _ in range(64)))

        values = asyncio.run(herd())
        assert len(calls) == 1
        assert values.count("new") == 1 and values.count("old") == 63
        assert guarded.get("hot") == "new"

    @pytest.mark.parametrize("deletion", ["delete", "adelete", "delete_many", "adelete_many",
                                          "set 0", "aset 0", "set_many 0", "aset_many 0"])
    @pytest.mark.parametrize("api", ["sync", "async"])
    def test_a_deleted_entry_is_never_served_stale(self, cache, deletion, api):
        """After ``delete`` (or ``delete_many``, their async twins, or a ``set`` with a
        timeout of 0, which caches nothing) get_or_set's stale copy of the entry is gone
        too: a caller that finds the lease held waits for the holder's new value instead
        of getting the one the user deleted."""
        options = {**self.lease, "STALE_TIMEOUT": 30}
        guarded = self.guarded(**options)
        assert guarded.get_or_set("hot", "deleted", timeout=60) == "deleted"
        assert guarded.get_or_set("other", "kept", timeout=60) == "kept"
        if deletion == "delete":
            assert guarded.delete("hot") is True
        elif deletion == "adelete":
            assert asyncio.run(guarded.adelete("hot")) is True
        elif deletion == "delete_many":
            guarded.delete_many(["hot", "absent"])
        elif deletion == "adelete_many":
            asyncio.run(guarded.adelete_many(["hot", "absent"]))
        elif deletion == "set 0":
            guarded.set("hot", "not cached", 0)
        elif deletion == "aset 0":
            asyncio.run(guarded.aset("hot", "not cached", 0))
        elif deletion == "set_many 0":
            assert guarded.set_many({"hot": "not cached", "absent": "no"}, 0) == []
        else:
            assert asyncio.run(guarded.aset_many({"hot": "not cached"}, 0)) == []
        assert guarded.get("hot") is None
        assert guarded.get("other") == "kept"  # only the keys named
        waiter = self.guarded(**options)

        def ask() -> Any:
            if api == "sync":
                return waiter.get_or_set("hot", "not computed here", timeout=60)
            return asyncio.run(waiter.aget_or_set("hot", "not computed here", timeout=60))

        # Someone recomputes the deleted entry while the waiter asks for it.
        assert while_recomputed(guarded, "hot", ask) == "recomputed"

    def test_aget_or_set_awaits_an_async_default_with_or_without_protection(self, cache):
        async def compute():
            return "awaited"

        plain = self.build()
        assert asyncio.run(plain.aget_or_set("plain", compute)) == "awaited"
        assert asyncio.run(cache.aget_or_set("guarded", compute)) == "awaited"
        assert plain.get("plain") == cache.get("guarded") == "awaited"

    def test_early_recompute_longer_than_the_timeout_still_caches(self, cache):
        """EARLY_RECOMPUTE 30 with entries stored for 5 s (the docs' option, a shorter
        timeout): the early window is bounded by the entry's own lifetime, so the entry
        is served as it is, not recomputed on every call."""
        early = self.guarded(**self.lease, EARLY_RECOMPUTE=30)
        compute = Computation(seconds=0)
        for _ in range(20):
            assert early.get_or_set("short", compute, timeout=5) == "fresh"
        assert compute.calls == 1

    def test_without_lease_timeout_get_or_set_is_django_s(self):
        plain = self.build()
        assert plain.stampede is None
        plain.clear()
        assert plain.get_or_set("key", lambda: "value") == "value"
        assert plain.get("key") == "value"

    @pytest.mark.parametrize(
        "options, message",
        [
            ({"STALE_TIMEOUT": 5}, "STALE_TIMEOUT.*needs.*LEASE_TIMEOUT"),
            ({"LEASE_TIMEOUT": 0}, "LEASE_TIMEOUT"),
            ({"LEASE_TIMEOUT": 1, "STALE_TIMEOUT": "five"}, "STALE_TIMEOUT"),
            ({"EARLY_RECOMPUTE": 5}, "EARLY_RECOMPUTE.*needs.*LEASE_TIMEOUT"),
            ({"LEASE_TIMEOUT": 1, "EARLY_RECOMPUTE": -1}, "EARLY_RECOMPUTE"),
        ],
    )
    def test_bad_options_name_the_option(self, options, message):
        with pytest.raises(ImproperlyConfigured, match=message):
            self.guarded(**options)


@pytest.mark.django_db(transaction=True)
class TestMySQLCacheStampede(StampedeContract):
    def backend_params(self):
        return {"BACKEND": MYSQL_BACKEND, "LOCATION": "kvcache_stampede",
                "OPTIONS": {"CULL_PROBABILITY": 0}}

    def prepare(self, cache):
        ensure_table(cache)


class TestMemcachedCacheStampede(StampedeContract):
    @pytest.fixture(autouse=True)
    def _nodes(self, private_memcached_nodes):
        self.locations = private_memcached_nodes

    def backend_params(self):
        return {"BACKEND": MEMCACHED_BACKEND, "LOCATION": self.locations}


# --- the plan alone: every decision, with a scripted store ---------------------------------


def drive(policy, reads, default="computed"):
    """Run the plan against scripted reads; returns the value and the steps taken."""
    steps, reads = [], list(reads)

    class Scripted:  # asks for no cache calls: each method returns at once

        def read(self):
            steps.append("read")
            return reads.pop(0)
            yield

        def store(self, value):
            steps.append(("store", value))
            return
            yield

        def release(self):
            steps.append("release")
            return
            yield

    return stampede.run(policy, Scripted(), default), steps


POLICY = stampede.Policy(lease_timeout=1, stale_timeout=None)
MISSING = stampede.MISSING


def test_plan_fresh_value_is_returned_as_is():
    assert drive(POLICY, [stampede.Read("v", True, False)]) == ("v", ["read"])


def test_plan_winner_computes_and_stores():
    value, steps = drive(POLICY, [stampede.Read(MISSING, False, True)])
    assert (value, steps) == ("computed", ["read", ("store", "computed")])


def test_plan_stale_value_is_returned_to_a_loser():
    assert drive(POLICY, [stampede.Read("old", False, False)]) == ("old", ["read"])


def test_plan_loser_without_stale_waits_then_reads_again():
    value, steps = drive(POLICY, [stampede.Read(MISSING, False, False),
                                  stampede.Read("v", True, False)])
    assert (value, steps) == ("v", ["read", "read"])
