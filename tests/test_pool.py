"""The one connection pool (django_kvcache.pool) both backends use, on real servers: no
slot is lost whatever ends a wait, and a loop closed without shutting down does not
keep its connections (or itself) alive."""
from __future__ import annotations

import asyncio
import gc
import signal
import socket
import threading
import time
import weakref

import pytest

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import PoolExhausted
from django_kvcache.memcached.pool import ConnectionSettings, NodePool
from django_kvcache.memcached.routing import parse_location
from django_kvcache.mysql import aio
from tests.mysql_support import make_cache, mysql_tables  # noqa: F401  (a fixture)


class Interrupted(Exception):
    """What the test's signal handler raises in the waiting thread."""


def raise_interrupted(signum, frame):
    raise Interrupted


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_a_wait_a_signal_handler_interrupts_gives_its_slot_back(memcached_node_factory):
    """A thread waiting for a connection is interrupted by an exception its signal
    handler raises: the connection checked in later must still reach the next caller,
    not a waiter that no longer exists (every later call raised PoolExhausted)."""
    address = parse_location(memcached_node_factory().address)[0]
    pool = NodePool(address, ConnectionSettings(max_size=1, pool_timeout=2.0))
    held = pool.checkout()
    previous = signal.signal(signal.SIGALRM, raise_interrupted)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            pool.checkout()  # waits: the only connection is held
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pool.checkin(held)
    started = time.monotonic()
    again = pool.checkout()
    assert again is held and time.monotonic() - started < 0.5
    pool.checkin(again)
    assert pool.size == 1 and pool.idle == [held] and not pool.line


def test_a_waiter_times_out_with_pool_exhausted_and_loses_nothing(memcached_node_factory):
    address = parse_location(memcached_node_factory().address)[0]
    pool = NodePool(address, ConnectionSettings(max_size=1, pool_timeout=0.2))
    held = pool.checkout()
    with pytest.raises(PoolExhausted, match="MAX_POOL_SIZE"):
        pool.checkout()
    assert pool.waits == 1 and 0.15 < pool.wait_time < 2
    pool.checkin(held)
    assert pool.checkout() is held and pool.reuses == 1 and pool.connects == 1


def test_threads_share_a_small_pool_without_losing_a_slot(memcached_node_factory):
    address = parse_location(memcached_node_factory().address)[0]
    pool = NodePool(address, ConnectionSettings(max_size=2, pool_timeout=5.0))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                connection = pool.checkout()
                pool.checkin(connection)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert pool.size == len(pool.idle) <= 2 and not pool.line


def server_connections(address: str) -> int:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"stats\r\n")
        data = b""
        while not data.endswith(b"END\r\n"):
            data += sock.recv(65536)
    for line in data.decode().splitlines():
        if line.startswith("STAT curr_connections "):
            return int(line.split()[2])
    raise AssertionError("no curr_connections")


def test_loops_closed_without_shutting_down_leave_no_connection_open(memcached_node_factory):
    """Hand-made loops closed with ``loop.close()`` alone (no shutdown_asyncgens): their
    pools were kept, with the loops, for the life of the process (one socket each)."""
    node = memcached_node_factory()
    cache = MemcachedCache([node.address], {"OPTIONS": {"IGNORE_EXCEPTIONS": False}})
    baseline = server_connections(node.address)
    loops: list[weakref.ref] = []
    for index in range(12):
        loop = asyncio.new_event_loop()
        loop.run_until_complete(cache.aset(f"key-{index}", index))
        assert loop.run_until_complete(cache.aget(f"key-{index}")) == index
        loop.close()
        loops.append(weakref.ref(loop))
        del loop
    cache.metrics()  # lists every loop's pools: the closed ones are closed and forgotten
    gc.collect()
    deadline = time.monotonic() + 5
    while server_connections(node.address) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_connections(node.address) == baseline
    assert not [ref for ref in loops if ref() is not None]  # the loops were collected
    # A loop that shuts down properly closes its pools at once, as before.
    asyncio.run(cache.aget("key-0"))
    assert server_connections(node.address) == baseline


def test_a_new_loop_closes_what_closed_loops_left(memcached_node_factory):
    """Without anyone reading the metrics, the next loop to use the cache closes what
    the closed ones left: a process making loop after loop keeps at most one's sockets."""
    node = memcached_node_factory()
    cache = MemcachedCache([node.address], {})
    baseline = server_connections(node.address)
    for index in range(10):
        loop = asyncio.new_event_loop()
        loop.run_until_complete(cache.aset("key", index))
        loop.close()
    gc.collect()
    time.sleep(0.1)
    assert server_connections(node.address) <= baseline + 1


@pytest.mark.django_db(transaction=True)
def test_mysql_loops_closed_without_shutting_down_close_their_connections(mysql_tables):
    cache = make_cache()
    opened: list = []
    loops: list[weakref.ref] = []
    for index in range(5):
        loop = asyncio.new_event_loop()

        async def use(index: int = index) -> None:
            await cache.aset(f"key-{index}", index)
            assert await cache.aget(f"key-{index}") == index
            for pool in aio._pools.get().values():
                opened.extend(connection.raw for connection in pool.idle)

        loop.run_until_complete(use())
        loop.close()
        loops.append(weakref.ref(loop))
        del loop, use
    assert opened and opened[-1].open
    assert aio._pools.every() == []  # the closed loops' pools: closed and forgotten
    assert not [raw for raw in opened if raw.open]
    gc.collect()
    assert not [ref for ref in loops if ref() is not None]
