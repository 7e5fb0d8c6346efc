"""TLS: a memcached started with ``-Z`` and a throwaway self-signed certificate."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time

import pytest

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import NodeError
from tests.servers import free_port, services
from tests.test_faults_memcached import stop_process

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A throwaway self-signed certificate for 127.0.0.1: ``(cert file, key file)``."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


def start_tls_memcached(cert: str, key: str) -> tuple[subprocess.Popen, str]:
    """A TLS-only memcached (skips the test if this memcached build has no TLS)."""
    port = free_port()
    argv = services.memcached_argv(port) + [
        "-Z", "-o", f"ssl_chain_cert={cert},ssl_key={key}",
    ]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while True:
        if process.poll() is not None:
            pytest.skip(f"memcached without TLS support: {process.stderr.read()[:200]!r}")
        try:
            probe = ssl.create_default_context(cafile=cert)
            with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
                with probe.wrap_socket(raw, server_hostname="127.0.0.1"):
                    break
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.05)
    return process, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tls_node(certificate):
    """``(address, CA file)`` of a TLS-only memcached, if this memcached build has TLS."""
    process, address = start_tls_memcached(*certificate)
    yield address, certificate[0]
    process.kill()
    process.wait()


def test_tls_round_trip_with_a_ca_file(tls_node):
    address, ca_file = tls_node
    cache = MemcachedCache([address], {"OPTIONS": {"TLS": {"cafile": ca_file}}})
    cache.set("key", "over TLS")
    assert cache.get("key") == "over TLS"
    data = {f"k{i}": "x" * i * 100 for i in range(30)}
    assert cache.set_many(data) == []
    assert cache.get_many(data) == data
    cache.delete_many(data)
    assert cache.get_many(data) == {}
    assert cache.add("counter", 1) is True
    assert cache.incr("counter") == 2
    big = "compressible " * 200_000
    cache.set("big", big)
    assert cache.get("big") == big


def test_tls_with_an_ssl_context(tls_node):
    address, ca_file = tls_node
    context = ssl.create_default_context(cafile=ca_file)
    cache = MemcachedCache([address], {"OPTIONS": {"TLS": context}})
    cache.set("context", 1)
    assert cache.get("context") == 1


def test_untrusted_certificate_fails_as_a_node_error(tls_node):
    address, _ = tls_node
    cache = MemcachedCache([address], {"OPTIONS": {"TLS": {}, "FAILURE_THRESHOLD": 50,
                                                "IGNORE_EXCEPTIONS": False}})
    with pytest.raises(NodeError, match="CERTIFICATE_VERIFY_FAILED"):
        cache.get("key")


def test_tls_on_the_async_path(tls_node):
    address, ca_file = tls_node
    cache = MemcachedCache([address], {"OPTIONS": {"TLS": {"cafile": ca_file}}})
    data = {f"a{i}": "y" * i * 100 for i in range(30)}
    big = os.urandom(300_000)  # more than one TLS record and one read

    async def scenario() -> None:
        await cache.aset("key", "over TLS, async")
        assert await cache.aget("key") == "over TLS, async"
        assert await cache.aset_many(data) == []
        assert await cache.aget_many(data) == data
        await cache.aset("big", big)
        assert await cache.aget("big") == big

    asyncio.run(scenario())
    assert cache.get("key") == "over TLS, async"  # and the blocking path reads it


def test_untrusted_certificate_fails_as_a_node_error_async(tls_node):
    address, _ = tls_node
    cache = MemcachedCache([address], {"OPTIONS": {"TLS": {}, "FAILURE_THRESHOLD": 50,
                                                "IGNORE_EXCEPTIONS": False}})
    with pytest.raises(NodeError, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(cache.aget("key"))


def test_a_tls_late_write_is_settled_without_blocking_the_event_loop(certificate):
    """A write that timed out on a blocking TLS connection is settled before the node
    serves again — also by a coroutine. That settling waits on the event loop (the
    socket non-blocking), never in a blocking call that stalls every other coroutine."""
    process, address = start_tls_memcached(*certificate)
    try:
        cache = MemcachedCache([address], {"OPTIONS": {
            "TLS": {"cafile": certificate[0]}, "IO_TIMEOUT": 0.5, "FAILURE_THRESHOLD": 100,
            "IGNORE_EXCEPTIONS": False}})
        cache.set("key", "before")
        stop_process(process.pid)  # stopped before the write, not some time after
        try:
            with pytest.raises(NodeError, match="did not answer within IO_TIMEOUT"):
                cache.set("key", "late")  # kept as a late write, to settle
            assert cache._nodes[0].unsettled.pending

            async def settle_while_ticking() -> float:
                loop = asyncio.get_running_loop()
                gaps: list[float] = []

                async def tick() -> None:
                    last = loop.time()
                    while True:
                        await asyncio.sleep(0.01)
                        gaps.append(loop.time() - last)
                        last = loop.time()

                ticker = asyncio.ensure_future(tick())
                await asyncio.sleep(0.05)
                with pytest.raises(NodeError, match="did not answer within IO_TIMEOUT"):
                    await cache.aget("key")  # the node still sleeps: settling times out
                await asyncio.sleep(0.05)  # the ticker notes the last gap
                ticker.cancel()
                return max(gaps)

            assert asyncio.run(settle_while_ticking()) < 0.25
        finally:
            os.kill(process.pid, signal.SIGCONT)
        assert asyncio.run(cache.aget("key")) is None  # settled, then cleaned up
        assert not cache._nodes[0].unsettled.pending
    finally:
        process.kill()
        process.wait()
