"""The one connection pool (django_kvcache.pool) both backends use, on real servers: no
slot is lost whatever ends a wait, and a loop closed without shutting down does not
keep its connections (or itself) alive."""
from __future__ import annotations

import asyncio
import gc
import linecache
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import pytest

import django_kvcache.pool

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import PoolExhausted
from django_kvcache.memcached import aio as memcached_aio
from django_kvcache.memcached.pool import ConnectionSettings, NodePool
from django_kvcache.memcached.routing import parse_location
from django_kvcache.mysql import pools
from tests.servers import connections_held
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


def test_the_connection_count_sees_this_process_s_sockets_only_and_at_once(
        memcached_node_factory):
    """The count the tests below compare: another process's connection (as the fixture's
    start-up probe is, to memcached, until a worker thread reads its close) is not in it,
    and a socket this process closes leaves it at once. memcached's `curr_connections`
    counted both: a baseline taken while the probe was still counted failed `1 == 2`."""
    node = memcached_node_factory()
    other = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys; host, port = sys.argv[1].rsplit(':', 1); "
        "s = socket.create_connection((host, int(port))); print('ok', flush=True); "
        "sys.stdin.read()"), node.address], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert other.stdout.readline() == b"ok\n"
        baseline = connections_held(node.address)
        own = socket.create_connection(("127.0.0.1", node.port))
        assert connections_held(node.address) == baseline + 1
        own.close()
        other.stdin.close()
        other.wait(timeout=10)
        assert connections_held(node.address) == baseline
    finally:
        other.kill()
        other.wait()


def test_loops_closed_without_shutting_down_leave_no_connection_open(memcached_node_factory):
    """Hand-made loops closed with ``loop.close()`` alone (no shutdown_asyncgens): their
    pools were kept, with the loops, for the life of the process (one socket each)."""
    node = memcached_node_factory()
    cache = MemcachedCache([node.address], {"OPTIONS": {"IGNORE_EXCEPTIONS": False}})
    baseline = connections_held(node.address)
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
    while connections_held(node.address) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert connections_held(node.address) == baseline
    assert not [ref for ref in loops if ref() is not None]  # the loops were collected
    # A loop that shuts down properly closes its pools at once, as before.
    asyncio.run(cache.aget("key-0"))
    assert connections_held(node.address) == baseline


def test_a_new_loop_closes_what_closed_loops_left(memcached_node_factory):
    """Without anyone reading the metrics, the next loop to use the cache closes what
    the closed ones left: a process making loop after loop keeps at most one's sockets."""
    node = memcached_node_factory()
    cache = MemcachedCache([node.address], {})
    baseline = connections_held(node.address)
    for index in range(10):
        loop = asyncio.new_event_loop()
        loop.run_until_complete(cache.aset("key", index))
        loop.close()
    gc.collect()
    time.sleep(0.1)
    assert connections_held(node.address) <= baseline + 1


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
            for pool in pools._loops.get().values():
                opened.extend(pool.idle)

        loop.run_until_complete(use())
        loop.close()
        loops.append(weakref.ref(loop))
        del loop, use
    assert opened and opened[-1].open
    assert pools._loops.every() == []  # the closed loops' pools: closed and forgotten
    assert not [raw for raw in opened if raw.open]
    gc.collect()
    assert not [ref for ref in loops if ref() is not None]


# --- found by review: every point of a wait, a reset peer, a fork inside a loop ----------


def test_an_exception_at_any_line_of_a_wait_loses_nothing(memcached_node_factory):
    """An exception a signal handler raises (Celery's soft time limit) lands between two
    lines anywhere in a waiting checkout — before it joined the line, while it waits, or
    once it was served and before its caller took the connection: no slot and no
    connection may be lost (one point after another, each in a new pool)."""
    address = parse_location(memcached_node_factory().address)[0]
    pool_file = django_kvcache.pool.__file__
    point = 0
    while True:
        point += 1
        pool = NodePool(address, ConnectionSettings(max_size=1, pool_timeout=2.0))
        held = pool.checkout()
        returner = threading.Timer(0.05, pool.checkin, (held,))
        events = 0
        where: list[tuple[str, int]] = []

        def taken(frame) -> bool:
            while frame is not None and frame.f_code.co_name != "checkout":
                frame = frame.f_back
            waiter = frame.f_locals.get("waiter") if frame is not None else None
            return waiter is not None and waiter.taken

        def trace(frame, event, arg):
            nonlocal events
            if frame.f_code.co_filename != pool_file:
                return None
            # Not at a ``with`` line: leaving the block, Python reports it before calling
            # __exit__, and an exception there leaks the lock whatever the code does
            # (CPython's own limit, bpo-29988).
            # Nor inside an except block: an exception a trace function raises there stays
            # the thread's handled exception after the block (CPython 3.11 to 3.13), the
            # __context__ of every later error and re-raised by asgiref in its thread.
            if event == "line" and sys.exc_info()[1] is None and not linecache.getline(
                    pool_file, frame.f_lineno).lstrip().startswith("with "):
                if not taken(frame):  # taken: the caller's from now on
                    events += 1
                    if events == point:
                        sys.settrace(None)
                        where.append((frame.f_code.co_name, frame.f_lineno))
                        raise Interrupted
            return trace

        returner.start()
        sys.settrace(trace)
        try:
            got = pool.checkout()
        except Interrupted:
            got = None
        finally:
            sys.settrace(None)
            returner.join()
        if got is not None:
            pool.checkin(got)
        assert pool.size == 1 and pool.idle == [held] and not pool.line, where
        assert pool.checkout() is held
        if events < point:  # the checkout ran to the end: every point was tried
            break
    assert point > 10
    assert sys.exc_info()[1] is None  # the thread handles no exception after the test


def test_a_checkout_from_an_empty_pool_raises_nothing_inside(memcached_node_factory):
    """Opening a connection is the usual path of an empty pool: nothing is raised and
    caught on it (an exception caught there cost time, and was the ``__context__`` of
    unrelated errors in tracebacks)."""
    address = parse_location(memcached_node_factory().address)[0]
    pool = NodePool(address, ConnectionSettings(max_size=2, pool_timeout=2.0))
    pool_file = django_kvcache.pool.__file__
    raised: list[tuple[str, type]] = []

    def trace(frame, event, arg):
        if frame.f_code.co_filename != pool_file:
            return None
        if event == "exception":
            raised.append((frame.f_code.co_name, arg[0]))
        return trace

    sys.settrace(trace)
    try:
        first = pool.checkout()
        second = pool.checkout()
    finally:
        sys.settrace(None)
    pool.checkin(first)
    pool.checkin(second)
    assert raised == []
    assert pool.size == 2


class ResettingProxy:
    """Forwards to a memcached; ``reset()`` resets every client connection (a fault)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.clients: list[socket.socket] = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.clients.append(client)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self.pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            sock.close()

    def reset(self) -> None:
        for client in self.clients:
            if client.fileno() == -1:  # its client closed it already
                continue
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.shutdown(socket.SHUT_RDWR)  # the pipes close both ends: the RST goes out

    def close(self) -> None:
        self.listener.close()


def test_a_reset_connection_of_a_closed_loop_does_not_fail_the_next_loop(memcached_node_factory):
    proxy = ResettingProxy(memcached_node_factory().address)
    try:
        cache = MemcachedCache([proxy.address], {"OPTIONS": {"IGNORE_EXCEPTIONS": False}})
        for index in range(2):
            loop = asyncio.new_event_loop()
            loop.run_until_complete(cache.aset(f"k{index}", index))
            loop.close()
        proxy.reset()  # the idle connections of both closed loops are reset by the peer
        time.sleep(0.1)
        assert asyncio.run(cache.aget("k1")) == 1  # closing the closed loops' raised ENOTCONN
        assert memcached_aio._loops.every() == []  # both closed loops' states were closed, not one
    finally:
        proxy.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_inside_a_loop_leaves_its_parent_s_connections_alone(
        memcached_node_factory):
    """The child goes back to the loop it was forked in, which shuts down: it must not
    close the parent's asyncio connections (it unregistered the parent's socket from the
    epoll instance both share, and the parent's next call timed out)."""
    node = memcached_node_factory()
    cache = MemcachedCache([node.address], {"OPTIONS": {"IGNORE_EXCEPTIONS": False,
                                                       "IO_TIMEOUT": 1.0}})
    parent = os.getpid()
    outcome: list[Any] = []

    async def main() -> None:
        await cache.aset("k", "v")
        pid = os.fork()
        if pid == 0:
            return  # the child: its asyncio.run shuts this loop down
        os.waitpid(pid, 0)
        started = time.monotonic()
        outcome.append(await cache.aget("k"))
        outcome.append(time.monotonic() - started)

    try:
        asyncio.run(main())
    finally:
        if os.getpid() != parent:
            os._exit(0)
    assert outcome[0] == "v" and outcome[1] < 0.5
