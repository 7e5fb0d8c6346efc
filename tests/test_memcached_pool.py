"""Connections: process-wide pools shared by backend instances, kept across requests,
closed by disconnect_all, reset in a forked child, bounded by MAX_POOL_SIZE; socket
options; unix sockets; many threads sharing one backend."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import subprocess
import threading
import time

import pytest
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import request_finished
from django.test import override_settings
from pymemcache.client.base import Client

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import PoolExhausted
from tests.servers import services

BACKEND = "django_kvcache.backends.memcached.MemcachedCache"


def server_stats(node) -> dict[bytes, int]:
    client = Client(("127.0.0.1", node.port))
    try:
        return client.stats()
    finally:
        client.close()


def connections_opened(node) -> int:
    """Connections the server accepted so far, not counting this call's own."""
    return server_stats(node)[b"total_connections"] - 1


def opened_since(node, before: int) -> int:
    return connections_opened(node) - before - 1  # minus the connection that took `before`


def test_instances_with_the_same_settings_share_pools(memcached_node_factory):
    address = memcached_node_factory().address
    first, second = MemcachedCache([address], {}), MemcachedCache(address, {"KEY_PREFIX": "x"})
    assert first._nodes[0].pool is second._nodes[0].pool
    assert first._nodes[0].health is second._nodes[0].health
    other = MemcachedCache([address], {"OPTIONS": {"IO_TIMEOUT": 2.5}})
    assert other._nodes[0].pool is not first._nodes[0].pool


def test_connections_survive_requests(memcached_node_factory):
    node = memcached_node_factory()
    before = connections_opened(node)
    with override_settings(CACHES={"mc": {"BACKEND": BACKEND, "LOCATION": node.address}}):
        for i in range(20):
            caches["mc"].set("key", i)
            assert caches["mc"].get("key") == i
            request_finished.send(sender=None)  # Django closes every cache here
    assert opened_since(node, before) == 1


def test_django_pymemcachecache_reconnects_every_request(memcached_node_factory):
    # The control for the test above: the counting sees a reconnecting backend.
    node = memcached_node_factory()
    before = connections_opened(node)
    backend = "django.core.cache.backends.memcached.PyMemcacheCache"
    with override_settings(CACHES={"mc": {"BACKEND": backend, "LOCATION": node.address}}):
        for i in range(5):
            caches["mc"].set("key", i)
            request_finished.send(sender=None)
    assert opened_since(node, before) == 5


def test_disconnect_all_really_closes(memcached_node_factory):
    node = memcached_node_factory()
    cache = MemcachedCache([node.address], {})
    cache.set("key", 1)
    connected_before = server_stats(node)[b"curr_connections"]
    cache.disconnect_all()
    deadline = time.monotonic() + 5
    while server_stats(node)[b"curr_connections"] >= connected_before:
        assert time.monotonic() < deadline, "the server still sees our connection"
        time.sleep(0.02)
    assert cache._nodes[0].pool.size == 0
    assert cache.get("key") == 1  # and the cache reconnects on demand


def io_timeout(sock: socket.socket) -> float | None:
    """The socket's IO timeout, whether Python or the kernel enforces it."""
    if sock.gettimeout() is not None:
        return sock.gettimeout()
    seconds, micros = struct.unpack("ll", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.calcsize("ll")))
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.calcsize("ll")) == (
        struct.pack("ll", seconds, micros))
    return (seconds + micros / 1e6) or None


def test_sockets_have_nodelay_and_timeouts(memcached_node_factory):
    address = memcached_node_factory().address
    cases = [({}, 1.0), ({"IO_TIMEOUT": 0.25}, 0.25), ({"IO_TIMEOUT": None}, None)]
    for options, expected in cases:
        cache = MemcachedCache([address], {"OPTIONS": options})
        pool = cache._nodes[0].pool
        client = pool.checkout()
        try:
            sock = client.connect()
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            # the kernel keeps its timeouts in clock ticks: 0.25 s may read back as 0.252
            if expected is None:
                assert io_timeout(sock) is None
            else:
                assert io_timeout(sock) == pytest.approx(expected, abs=0.01)
            assert client.settings.connect_timeout == options.get("CONNECT_TIMEOUT", 1.0)
        finally:
            pool.checkin(client)


def test_pool_size_bound_and_waiting(memcached_node_factory):
    address = memcached_node_factory().address
    cache = MemcachedCache([address], {"OPTIONS": {
        "MAX_POOL_SIZE": 1, "POOL_TIMEOUT": 0.2, "IGNORE_EXCEPTIONS": False}})
    pool = cache._nodes[0].pool
    held = pool.checkout()
    with pytest.raises(PoolExhausted, match="MAX_POOL_SIZE"):
        cache.get("key")
    assert pool.waits == 1

    results = []
    waiter = threading.Thread(target=lambda: results.append(cache.get("key", "miss")))
    waiter.start()
    time.sleep(0.05)
    pool.checkin(held)  # hands the connection to the waiting thread
    waiter.join()
    assert results == ["miss"]
    assert pool.size == 1


def test_pool_exhaustion_with_ignore_exceptions(memcached_node_factory):
    address = memcached_node_factory().address
    cache = MemcachedCache([address], {"OPTIONS": {
        "MAX_POOL_SIZE": 1, "POOL_TIMEOUT": 0.05, "IGNORE_EXCEPTIONS": True}})
    pool = cache._nodes[0].pool
    held = pool.checkout()
    try:
        assert cache.get("key", "default") == "default"
        assert cache.add("key", 1) is False
        assert cache.get_many(["a", "b"]) == {}
    finally:
        pool.checkin(held)
    assert cache.metrics()[address]["ignored"] == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_fresh_connections(memcached_node_factory):
    node = memcached_node_factory()
    cache = MemcachedCache([node.address], {})
    cache.set("key", "parent")
    pool = cache._nodes[0].pool
    inherited = list(pool.idle)
    assert inherited
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        status = 1
        try:
            fresh = pool.size == 0 and not pool.idle
            cache.set("key", "child")
            ok = cache.get("key") == "child" and all(c not in pool.idle for c in inherited)
            status = 0 if fresh and ok else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool.idle == inherited  # the parent's pool is untouched
    assert cache.get("key") == "child"


def test_thread_hammer_every_value_belongs_to_its_key(memcached_node_factory):
    addresses = [memcached_node_factory().address for _ in range(3)]
    cache = MemcachedCache(addresses, {"OPTIONS": {"MAX_POOL_SIZE": 4}})
    errors: list[str] = []

    def work(worker: int) -> None:
        rng = random.Random(worker)
        for round_ in range(150):
            keys = [f"key-{rng.randrange(60)}" for _ in range(5)]
            try:
                choice = rng.random()
                if choice < 0.3:
                    cache.set(keys[0], (keys[0], worker, "x" * rng.randrange(2000)))
                elif choice < 0.5:
                    cache.set_many({key: (key, worker, round_) for key in keys})
                elif choice < 0.8:
                    for key, value in cache.get_many(keys).items():
                        if value[0] != key:
                            errors.append(f"{key} read {value[0]}")
                else:
                    value = cache.get(keys[0])
                    if value is not None and value[0] != keys[0]:
                        errors.append(f"{keys[0]} read {value[0]}")
            except Exception as exc:  # any error fails the test below
                errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    metrics = cache.metrics()
    assert all(m["pool_size"] <= 4 for m in metrics.values())
    assert sum(m["hits"] for m in metrics.values()) > 0


@pytest.fixture
def unix_node(tmp_path):
    path = str(tmp_path / "memcached.sock")
    argv = services.memcached_argv(0)
    argv = [arg for arg in argv if arg not in ("-l", services.HOST, "-p", "0")] + ["-s", path]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        assert time.monotonic() < deadline and process.poll() is None, "memcached did not start"
        time.sleep(0.02)
    yield path
    process.kill()
    process.wait()


def test_unix_socket_node(unix_node, memcached_node_factory):
    tcp = memcached_node_factory().address
    cache = MemcachedCache(f"unix:{unix_node};{tcp}", {})
    data = {f"key-{i}": i for i in range(40)}
    assert cache.set_many(data) == []
    assert cache.get_many(data) == data
    assert cache.get("key-1") == 1
    assert all(m["hits"] for m in cache.metrics().values())  # both nodes served keys


def test_unix_socket_node_async(unix_node, memcached_node_factory):
    tcp = memcached_node_factory().address
    cache = MemcachedCache(f"unix:{unix_node};{tcp}", {})
    data = {f"akey-{i}": i for i in range(40)}

    async def scenario() -> None:
        assert await cache.aset_many(data) == []
        assert await cache.aget_many(data) == data
        assert await cache.aget("akey-1") == 1

    asyncio.run(scenario())
    assert all(m["hits"] for m in cache.metrics().values())  # both nodes served keys


@pytest.mark.parametrize(
    "options, name",
    [
        ({"CONNECT_TIMEOUT": 0}, "CONNECT_TIMEOUT"),
        ({"IO_TIMEOUT": "soon"}, "IO_TIMEOUT"),
        ({"MAX_POOL_SIZE": 0}, "MAX_POOL_SIZE"),
        ({"POOL_TIMEOUT": None}, "POOL_TIMEOUT"),
        ({"RETRY_TIMEOUT": -1}, "RETRY_TIMEOUT"),
        ({"FAILURE_THRESHOLD": 1.5}, "FAILURE_THRESHOLD"),
        ({"FAILOVER": "yes"}, "FAILOVER"),
        ({"IGNORE_EXCEPTIONS": 1}, "IGNORE_EXCEPTIONS"),
        ({"HASHING": "ketama"}, "HASHING"),
        ({"HASHING": ["kvcache"]}, "HASHING"),
        ({"TLS": "on"}, "TLS"),
        ({"TLS": {"verify": False}}, "TLS"),
        ({"TLS": {"cafile": "/nonexistent/ca.pem"}}, "TLS"),
        ({"WEIGHTS": {"127.0.0.1:1": "x"}}, "WEIGHTS"),
        ({"TIMEOUT_IO": 1}, "TIMEOUT_IO"),
    ],
)
def test_bad_options_name_the_option(options, name):
    with pytest.raises(ImproperlyConfigured, match=name):
        MemcachedCache(["127.0.0.1:1"], {"OPTIONS": options})


def test_tls_option_takes_a_context_or_a_dict():
    import ssl

    context = ssl.create_default_context()
    cache = MemcachedCache(["127.0.0.1:1"], {"OPTIONS": {"TLS": context}})
    assert cache._nodes[0].pool.settings.tls is context
    from_dict = MemcachedCache(["127.0.0.1:1"], {"OPTIONS": {"TLS": {}}})
    again = MemcachedCache(["127.0.0.1:1"], {"OPTIONS": {"TLS": {}}})
    assert isinstance(from_dict._nodes[0].pool.settings.tls, ssl.SSLContext)
    assert from_dict._nodes[0].pool is again._nodes[0].pool
