"""TLS: a memcached started with ``-Z`` and a throwaway self-signed certificate."""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import time

import pytest

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import NodeError
from tests.servers import free_port, services

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory):
    """``(address, CA file)`` of a TLS-only memcached, if this memcached build has TLS."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    port = free_port()
    argv = services.memcached_argv(port) + [
        "-Z", "-o", f"ssl_chain_cert={cert},ssl_key={key}",
    ]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        if process.poll() is not None:
            pytest.skip(f"memcached without TLS support: {process.stderr.read()[:200]!r}")
        try:
            probe = ssl.create_default_context(cafile=str(cert))
            with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
                with probe.wrap_socket(raw, server_hostname="127.0.0.1"):
                    break
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.05)
    yield address, str(cert)
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
    cache = MemcachedCache([address], {"OPTIONS": {"TLS": {}, "FAILURE_THRESHOLD": 50}})
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
    cache = MemcachedCache([address], {"OPTIONS": {"TLS": {}, "FAILURE_THRESHOLD": 50}})
    with pytest.raises(NodeError, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(cache.aget("key"))
