"""MemcachedCache behind twemproxy (Debian's nutcracker 0.5), the proxy large sites put in
front of their memcached pool: one address for the cache, the classic protocol only — it
closes the connection on a meta command, ``flush_all``, ``stats`` or a negative exptime,
and answers ``SERVER_ERROR`` for the keys of a server it cannot reach.

Django's cache contract runs through the proxy ``services.py up`` starts (all of it but
``clear()``, which a proxy cannot forward: docs/memcached.rst, "Behind a proxy"); the
faults run on a proxy of the test's own (``tests/servers.py``'s ``Twemproxy``).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Iterator

import pytest
from django.conf import settings
from pymemcache.client.base import Client

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import NodeError, Unsupported
from django_kvcache.memcached.lease import MetaCommandsMissing
from tests.contract import CacheContract
from tests.servers import Twemproxy
from tests.test_stampede import Computation, in_threads

pytestmark = [
    pytest.mark.skipif(not settings.TWEMPROXY, reason="no twemproxy (KVCACHE_TWEMPROXY)"),
    pytest.mark.once,  # the proxy's behaviour, not Django's
]

BACKEND = "django_kvcache.backends.memcached.MemcachedCache"


def client(address: str) -> Client:
    host, port = address.rsplit(":", 1)
    return Client((host, int(port)), connect_timeout=2, timeout=2)


def empty(servers: list[str]) -> None:
    """Flush the memcached servers behind a proxy, each directly."""
    for address in servers:
        direct = client(address)
        try:
            direct.flush_all(noreply=False)
        finally:
            direct.close()


def build(location: str, **options: Any) -> MemcachedCache:
    """A cache of its own nodes' state: a RETRY_TIMEOUT a hair different per cache keeps
    what one test learned about the proxy (health, meta commands) from the next."""
    options = {"RETRY_TIMEOUT": 30 + (time.monotonic() % 1) / 1000, **options}
    return MemcachedCache(location, {"OPTIONS": options})


# --- Django's contract through the proxy -------------------------------------------------


class TestMemcachedCacheThroughTwemproxy(CacheContract):
    def backend_params(self) -> dict[str, Any]:
        return {"BACKEND": BACKEND, "LOCATION": settings.TWEMPROXY}

    def prepare(self, cache: Any) -> None:
        """The proxy forwards no ``flush_all``: the contract's own clean-ups (and its
        ``clear()`` calls) empty the servers behind it directly. What ``clear()`` itself
        does through a proxy is tested below."""

        def clear() -> None:
            empty(settings.TWEMPROXY_SERVERS)

        async def aclear() -> None:
            clear()

        cache.clear, cache.aclear = clear, aclear

    def test_clear_removes_everything(self, cache):
        pytest.skip("a proxy cannot forward flush_all: test_clear_through_a_proxy")


# --- what a proxy does not forward ----------------------------------------------------


@pytest.fixture
def proxied() -> Iterator[MemcachedCache]:
    cache = build(settings.TWEMPROXY, IGNORE_EXCEPTIONS=False, LEASE_TIMEOUT=2)
    empty(settings.TWEMPROXY_SERVERS)
    yield cache
    empty(settings.TWEMPROXY_SERVERS)


def test_no_meta_commands_is_found_once_and_never_counts_as_a_failure(proxied):
    """twemproxy closes the connection on ``mn``: the probe's answer, not the proxy's
    failure. It is asked once, remembered, and the proxy is never marked down for it."""
    node = proxied._nodes[0]
    with pytest.raises(MetaCommandsMissing):
        proxied.ttl("k")
    assert node.meta is False
    connects = node.pool.connects
    for _ in range(3):  # neither asked again nor counted
        with pytest.raises(MetaCommandsMissing):
            proxied.ttl("k")
        assert proxied.get_or_set("k", "v") == "v"
    assert node.pool.connects == connects
    metrics = proxied.metrics()[settings.TWEMPROXY]
    assert metrics["errors"] == 0 and metrics["down"] is False


@pytest.mark.parametrize("ignore_exceptions", [False, True])
def test_ttl_through_a_proxy_says_it_cannot_know(ignore_exceptions):
    cache = build(settings.TWEMPROXY, IGNORE_EXCEPTIONS=ignore_exceptions)
    cache.set("k", 1, timeout=60)
    for ttl in (cache.ttl, lambda key: asyncio.run(cache.attl(key))):
        with pytest.raises(NotImplementedError, match="cannot know"):
            ttl("k")
    assert cache.get("k") == 1


@pytest.mark.parametrize("api", ["sync", "async"])
def test_counters_through_a_proxy(proxied, api):
    """Without meta commands a decrement is memcached's own ``decr``: atomic, the entry's
    lifetime kept, and like it (and Django's PyMemcacheCache) it stops at 0. What would
    need to rewrite the counter (a negative value) raises, the counter unchanged."""

    def call(name: str, *args: Any) -> Any:
        if api == "sync":
            return getattr(proxied, name)(*args)
        return asyncio.run(getattr(proxied, f"a{name}")(*args))

    proxied.set("n", 5, timeout=60)
    assert call("decr", "n", 2) == 3
    assert call("incr", "n", -1) == 2
    assert call("incr", "n", 4) == 6
    assert call("decr", "n", 10) == 0  # stops at 0, as memcached's decr
    assert proxied.get("n") == 0
    with pytest.raises(ValueError):
        call("decr", "missing")
    proxied.set("text", "not a number")
    with pytest.raises(TypeError):
        call("decr", "text")
    proxied.set("negative", -5)
    with pytest.raises(MetaCommandsMissing, match="unchanged"):
        call("incr", "negative")
    assert proxied.get("negative") == -5
    metrics = proxied.metrics()[settings.TWEMPROXY]
    assert metrics["errors"] == 0 and metrics["down"] is False


def test_get_or_set_through_a_proxy_is_herd_proof(proxied):
    """Leases by ``add`` (the classic store), released by ``gets`` + ``cas`` with a past
    exptime (twemproxy refuses a negative one)."""
    compute = Computation()
    results = in_threads(8, lambda i: build(settings.TWEMPROXY, LEASE_TIMEOUT=2,
                                            IGNORE_EXCEPTIONS=False).get_or_set("hot", compute))
    assert compute.calls == 1 and results == ["fresh"] * 8
    proxied.delete("hot")
    started = time.monotonic()
    assert proxied.get_or_set("hot", lambda: "again") == "again"
    assert time.monotonic() - started < 1  # the lease was released, not left to expire


def test_clear_through_a_proxy_says_it_refused_and_poisons_nothing(proxied, caplog):
    proxied.set("kept", 1)
    node = proxied._nodes[0]
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        for clear in (proxied.clear, lambda: asyncio.run(proxied.aclear())):
            with pytest.raises(Unsupported, match="flush_all"):
                clear()
    assert caplog.text.count("refused flush_all") == 1  # said once
    assert node.flushes is False and not node.outdated.pending
    assert proxied.get("kept") == 1  # nothing was flushed, and later calls go on
    proxied.set("after", 2)
    assert proxied.get("after") == 2
    metrics = proxied.metrics()[settings.TWEMPROXY]
    assert metrics["errors"] == 0 and metrics["down"] is False


# --- faults on a proxy of the test's own ---------------------------------------------------


@pytest.fixture
def own_proxy() -> Iterator[Twemproxy]:
    proxy = Twemproxy()
    proxy.start()
    yield proxy
    proxy.stop()


def test_a_flush_pending_for_a_proxy_never_fails_later_calls(own_proxy):
    """A clear() while the proxy is unreachable leaves it a flush to do when it returns;
    the proxy refuses flush_all: the pending flush is given up (said once), and the next
    requests are served — not refused one after another until a restart."""
    cache = build(own_proxy.address, IGNORE_EXCEPTIONS=False, FAILURE_THRESHOLD=100)
    cache.set("k", "v")
    own_proxy.process.kill()  # the proxy alone: its servers keep their data
    own_proxy.process.wait()
    with pytest.raises(NodeError):
        cache.clear()
    assert cache._nodes[0].outdated.flush
    own_proxy.start()
    for _ in range(3):
        assert cache.get("k") == "v"
    assert not cache._nodes[0].outdated.pending


def keys_by_server(proxy: Twemproxy, keys: list[str], cache: MemcachedCache) -> dict[str, set]:
    """Which server behind the proxy holds each of ``keys`` (asked directly)."""
    held: dict[str, set] = {}
    stored = {cache.make_and_validate_key(key): key for key in keys}
    for server in proxy.servers:
        direct = client(server.address)
        try:
            held[server.address] = {stored[k] for k in direct.get_many(list(stored))}
        finally:
            direct.close()
    return held


@pytest.mark.parametrize("how", ["get", "get_many", "aget", "aget_many"])
def test_one_server_down_behind_the_proxy_costs_only_its_keys(own_proxy, how):
    """twemproxy answers SERVER_ERROR for the keys of a server it cannot reach: those
    keys fail (misses under IGNORE_EXCEPTIONS), the others are served, and the proxy —
    which answered — is not counted as failing."""
    cache = build(own_proxy.address, FAILURE_THRESHOLD=2)
    keys = [f"page:{hashlib.sha1(str(i).encode()).hexdigest()[:12]}" for i in range(30)]
    assert cache.set_many({key: key.upper() for key in keys}) == []
    held = keys_by_server(own_proxy, keys, cache)
    stopped, lost = max(held.items(), key=lambda item: len(item[1]))
    assert 0 < len(lost) < len(keys)
    next(s for s in own_proxy.servers if s.address == stopped).kill()
    for _ in range(2):  # twice: never marked down
        if how == "get":
            found = {key: value for key in keys if (value := cache.get(key)) is not None}
        elif how == "get_many":
            found = cache.get_many(keys)
        elif how == "aget":
            async def each() -> list[Any]:
                return await asyncio.gather(*(cache.aget(key) for key in keys))

            found = {key: value for key, value in zip(keys, asyncio.run(each())) if value}
        else:
            found = asyncio.run(cache.aget_many(keys))
        assert found == {key: key.upper() for key in keys if key not in lost}
    assert set(cache.set_many({key: "new" for key in keys})) == lost
    cache.set(sorted(lost)[0], "new")  # a miss under IGNORE_EXCEPTIONS, no error
    metrics = cache.metrics()[own_proxy.address]
    assert metrics["down"] is False and metrics["errors"] == 0
    assert metrics["ignored"] > 0


@pytest.mark.parametrize("api", ["sync", "async"])
def test_an_overflow_s_undo_refused_behind_a_proxy_deletes_the_counter_and_raises_overflow(api):
    """memcached 1.6.18 can refuse the ``incr`` that undoes an overflow (its
    ``safe_strtoull`` bug); directly, the undo is then made by compare-and-swap on the
    meta commands, which a proxy does not forward. The counter cannot be put back, so it
    must not stay out of range: the key is deleted as outdated, and the call raises
    ``OverflowError`` as any overflow does, without counting the proxy as failed.
    Before, the meta request reached twemproxy, which closed the connection: a node
    error, the proxy marked failed, and the counter left at 2**63 + 999."""
    from tests.memcached_fault_proxy import MemcachedFaultProxy

    host, port = settings.TWEMPROXY.rsplit(":", 1)
    fault = MemcachedFaultProxy(host, int(port))
    cache = build(fault.address, IGNORE_EXCEPTIONS=False)
    try:
        cache.set("n", 1000)
        stored = cache.make_and_validate_key("n")
        fault.refuse_next(b"incr %s %d" % (stored.encode(), 2**64 - (2**63 - 1)),
                          b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n")
        with pytest.raises(OverflowError):
            if api == "sync":
                cache.incr("n", 2**63 - 1)
            else:
                asyncio.run(cache.aincr("n", 2**63 - 1))
        assert fault.refusals == 1
        assert cache.get("n") is None  # never an out-of-range counter
        assert client(settings.TWEMPROXY).get(stored) is None
        metrics = cache.metrics()[fault.address]
        assert metrics["errors"] == 0 and metrics["down"] is False
    finally:
        cache.close()
        fault.stop()
