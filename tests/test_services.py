"""The servers the suite runs against are real, reachable and the ones the env names."""
from __future__ import annotations

import hashlib
import socket

import MySQLdb
import pytest
from django.conf import settings
from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheError



def memcached_client(address: str) -> Client:
    host, port = address.rsplit(":", 1)
    return Client((host, int(port)), connect_timeout=2, timeout=2)


def test_mariadb_is_a_real_server():
    conn = MySQLdb.connect(
        host=settings.MYSQL["HOST"],
        port=int(settings.MYSQL["PORT"]),
        user=settings.MYSQL["USER"],
        passwd=settings.MYSQL["PASSWORD"],
    )
    try:
        cursor = conn.cursor()
        cursor.execute("SELECT VERSION(), @@port")
        version, port = cursor.fetchone()
    finally:
        conn.close()
    assert "MariaDB" in version or version[0].isdigit()
    assert port == int(settings.MYSQL["PORT"])


@pytest.mark.parametrize("address", settings.MEMCACHED_NODES)
def test_each_memcached_node_answers(address):
    client = memcached_client(address)
    try:
        client.set(b"kvcache-probe", b"here")
        assert client.get(b"kvcache-probe") == b"here"
        assert client.stats("settings")[b"tcpport"] == int(address.rsplit(":", 1)[1])
    finally:
        client.close()


def test_shared_nodes_are_distinct_processes():
    pids = set()
    for address in settings.MEMCACHED_NODES:
        client = memcached_client(address)
        pids.add(client.stats()[b"pid"])
        client.close()
    assert len(pids) == len(settings.MEMCACHED_NODES) >= 2


@pytest.mark.skipif(not settings.TWEMPROXY, reason="no twemproxy (KVCACHE_TWEMPROXY empty)")
def test_twemproxy_spreads_keys_over_its_own_servers():
    """The proxy answers, speaks the classic protocol only, and places keys on the servers
    the environment names (none of which is a shared node)."""
    assert not set(settings.TWEMPROXY_SERVERS) & set(settings.MEMCACHED_NODES)
    proxy = memcached_client(settings.TWEMPROXY)
    # Keys unalike from their first byte: twemproxy's FNV-1a hash puts keys that differ in
    # their last characters only next to one another on its ring (30 numbered keys all
    # landed on one server when its servers listened on ports 31301-31303).
    keys = [b"kvcache-proxy-probe-" + hashlib.sha256(b"%d" % i).hexdigest().encode()
            for i in range(100)]
    try:
        proxy.set_many({key: b"here" for key in keys})
        assert proxy.get_many(keys) == {key: b"here" for key in keys}
    finally:
        proxy.close()
    holding = 0
    for address in settings.TWEMPROXY_SERVERS:
        server = memcached_client(address)
        holding += bool(server.get_many(keys))
        server.delete_many(keys)
        server.close()
    assert holding >= 2
    with socket.create_connection(settings.TWEMPROXY.rsplit(":", 1), timeout=2) as sock:
        sock.sendall(b"mn\r\n")  # a meta command: twemproxy closes the connection
        assert sock.recv(64) == b""


@pytest.mark.skipif(not settings.REDIS, reason="no Redis (KVCACHE_REDIS empty)")
def test_the_benchmarks_redis_is_ours_and_keeps_nothing_on_disk():
    """The Redis services.py starts for the benchmark's RedisCache peer: on the port the
    environment names (never the system's 6379), with no snapshot and no append-only file."""
    redis = pytest.importorskip("redis")
    host, port = settings.REDIS.rsplit(":", 1)
    assert int(port) != 6379
    client = redis.Redis(host=host, port=int(port), socket_timeout=2)
    try:
        assert client.ping()
        assert client.config_get("port") == {"port": port}
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
    finally:
        client.close()


def test_extra_node_can_be_killed_and_restarted(memcached_node_factory):
    node = memcached_node_factory()
    client = memcached_client(node.address)
    client.set(b"k", b"v")
    assert client.get(b"k") == b"v"
    node.kill()
    with pytest.raises((MemcacheError, OSError, socket.timeout)):
        client.get(b"k")
    node.start()
    client.close()
    client = memcached_client(node.address)
    assert client.get(b"k") is None  # a restarted memcached is empty
    client.set(b"k", b"again")
    assert client.get(b"k") == b"again"
    client.close()



def test_own_mariadb_keeps_data_across_restart(mariadb_server):
    def connect():
        params = mariadb_server.connection_settings()
        return MySQLdb.connect(host=params["HOST"], port=int(params["PORT"]),
                               user=params["USER"], passwd="", db=params["NAME"])

    conn = connect()
    cursor = conn.cursor()
    cursor.execute("CREATE TABLE t (id INT PRIMARY KEY)")
    cursor.execute("INSERT INTO t VALUES (1)")
    conn.commit()
    mariadb_server.restart()
    with pytest.raises(MySQLdb.OperationalError):
        cursor.execute("SELECT id FROM t")  # the old connection died with the server
    conn = connect()
    cursor = conn.cursor()
    cursor.execute("SELECT id FROM t")
    assert cursor.fetchall() == ((1,),)
    conn.close()


# --- a run that was meant to test a server group fails when the group is not there ----------


def test_missing_servers_names_each_group_that_does_not_answer(monkeypatch):
    from tests.servers import free_port, missing_servers

    assert missing_servers(["mysql", "memcached"]) == []
    monkeypatch.setattr(settings, "MEMCACHED_NODES", [f"127.0.0.1:{free_port()}"])
    monkeypatch.setattr(settings, "GALERA_NODES", [])
    problems = missing_servers(["memcached", "galera", "nonsense"])
    assert problems == [
        f"memcached: {settings.MEMCACHED_NODES[0]}",
        "galera: not configured (see scripts/services.py)",
        "nonsense: no such server group",
    ]


def test_a_required_group_that_is_not_up_stops_the_run_instead_of_skipping(tmp_path):
    """What ``make test-galera`` relies on: without a cluster the galera tests would all
    be skipped and the run would pass."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "KVCACHE_REQUIRE_SERVERS": "galera", "KVCACHE_GALERA": ""}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "galera",
         "tests/test_galera.py"],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 3, result.stdout[-2000:]
    assert "servers that were meant to run are not there: galera: not configured" in (
        result.stdout + result.stderr)
