"""MemcachedCache under faults: a node killed under multi-threaded load, a node that stops
answering or never completes a connection, and which stale values each FAILOVER policy can
serve afterwards.

Extends tests/test_memcached_failures.py (single-threaded kills, the health state machine,
a silent node on ``get``) with load, every operation and the stale-value scenarios.
"""
from __future__ import annotations

import os
import random
import selectors
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest

from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.memcached import MemcachedError, NodeDown, NodeError
from tests.contract import api  # noqa: F401  (fixture)

pytestmark = pytest.mark.once  # servers failing, not Django's API

RETRY = 0.3  # RETRY_TIMEOUT: how long a failed node is left alone
IO_TIMEOUT = 0.3
MARGIN = 1.0  # seconds on top of the timeouts a call may wait: a bound, not a speed test
THREADS = 6
KEYS_PER_NODE = 40


def build(locations: list[str], **options: Any) -> MemcachedCache:
    # Node health is process-wide per (node, FAILURE_THRESHOLD, RETRY_TIMEOUT): a retry time
    # a hair different per cache keeps a reused port from inheriting an earlier test's state.
    options = {
        "RETRY_TIMEOUT": RETRY + random.random() / 1000,
        "FAILURE_THRESHOLD": 2,
        "IO_TIMEOUT": IO_TIMEOUT,
        "CONNECT_TIMEOUT": IO_TIMEOUT,
        "IGNORE_EXCEPTIONS": False,  # strict unless a test says otherwise
        **options,
    }
    return MemcachedCache(locations, {"OPTIONS": options, "TIMEOUT": None})


def keys_by_node(cache: MemcachedCache, per_node: int, prefix: str = "k") -> dict[str, list[str]]:
    """``per_node`` caller keys for each node name, chosen by the cache's own routing."""
    found: dict[str, list[str]] = {node.name: [] for node in cache.cluster.nodes}
    index = 0
    while any(len(keys) < per_node for keys in found.values()):
        key = f"{prefix}-{index}"
        name = cache.cluster.nodes[cache.cluster.router.node_for(cache.make_key(key))].name
        if len(found[name]) < per_node:
            found[name].append(key)
        index += 1
    return found


def value_of(key: str) -> str:
    """Every write of a key stores the same value, so any read is that value or a miss."""
    return f"value of {key}"


# --- a multi-threaded load that records every call ----------------------------------------------


@dataclass
class Call:
    started: float
    ended: float
    keys: tuple[str, ...]
    error: BaseException | None = None
    missed: tuple[str, ...] = ()  # keys a read did not find, or a set_many reported failed
    hit: tuple[str, ...] = ()
    wrong: list[Any] = field(default_factory=list)  # values that are not value_of(key)


class Load:
    """``THREADS`` threads doing get/set/get_many/set_many on random keys until stopped."""

    def __init__(self, cache: MemcachedCache, keys: list[str]) -> None:
        self.cache = cache
        self.keys = keys
        self.calls: list[Call] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.work, args=(n,)) for n in range(THREADS)]

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in self.threads)

    def work(self, seed: int) -> None:
        rng = random.Random(seed)
        operations = [(self.get, 1), (self.set, 1), (self.get_many, 8), (self.set_many, 8)]
        while not self.stopping.is_set():
            operation, count = rng.choice(operations)
            call = Call(time.monotonic(), 0.0, tuple(rng.sample(self.keys, count)))
            try:
                operation(call)
            except Exception as exc:  # recorded; the test decides whether it was allowed
                call.error = exc
            call.ended = time.monotonic()
            self.calls.append(call)  # list.append is atomic under the GIL

    def get(self, call: Call) -> None:
        (key,) = call.keys
        value = self.cache.get(key)
        self.check(call, {} if value is None else {key: value})

    def set(self, call: Call) -> None:
        (key,) = call.keys
        self.cache.set(key, value_of(key))

    def get_many(self, call: Call) -> None:
        self.check(call, self.cache.get_many(call.keys))

    def set_many(self, call: Call) -> None:
        call.missed = tuple(self.cache.set_many({key: value_of(key) for key in call.keys}))

    @staticmethod
    def check(call: Call, found: dict[str, Any]) -> None:
        call.hit = tuple(found)
        call.missed = tuple(key for key in call.keys if key not in found)
        call.wrong = [(key, value) for key, value in found.items() if value != value_of(key)]

    def wait_for(self, condition: Callable[[Call], bool], timeout: float) -> bool:
        """Let the load run until a call satisfies ``condition`` (checked from now on)."""
        start = len(self.calls)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(condition(call) for call in self.calls[start:]):
                return True
            time.sleep(0.02)
        return False


@pytest.fixture
def three_nodes(memcached_node_factory):
    return [memcached_node_factory() for _ in range(3)]


def outage_under_load(nodes, cache: MemcachedCache):
    """Kill node 0 while the load runs, restart it, run until its keys are hit again.

    Returns the load, the victim's keys, when the kill had completed, when the restart
    began and whether a victim key was hit after the restart.
    """
    placed = keys_by_node(cache, KEYS_PER_NODE)
    victim = nodes[0]
    victim_keys = set(placed[victim.address])
    everything = [key for keys in placed.values() for key in keys]
    cache.set_many({key: value_of(key) for key in everything})
    with Load(cache, everything) as load:
        time.sleep(0.3)
        victim.kill()
        killed = time.monotonic()
        time.sleep(RETRY * 3)  # several failed probes while the load goes on
        restarting = time.monotonic()
        victim.start()
        back = load.wait_for(
            lambda call: call.started > restarting and call.error is None
            and bool(victim_keys & set(call.hit)),
            timeout=RETRY + 5,
        )
    return load, victim_keys, killed, restarting, back


def test_killed_node_with_ignore_exceptions_only_its_keys_miss(three_nodes):
    cache = build([node.address for node in three_nodes], IGNORE_EXCEPTIONS=True)
    load, victim_keys, killed, restarting, back = outage_under_load(three_nodes, cache)

    assert [call.error for call in load.calls if call.error] == []
    assert [call.wrong for call in load.calls if call.wrong] == []
    missed = {key for call in load.calls for key in call.missed}
    assert missed <= victim_keys  # the other nodes' keys never missed
    during = [c for c in load.calls if c.started > killed and c.ended < restarting]
    assert any(victim_keys & set(c.missed) for c in during)  # the outage really happened
    assert back, "the restarted node was not used again under load"
    assert not cache.cluster.by_name[three_nodes[0].address].health.down


def test_killed_node_without_ignore_exceptions_every_failed_call_raises(three_nodes):
    cache = build([node.address for node in three_nodes])
    victim = three_nodes[0].address
    load, victim_keys, killed, restarting, back = outage_under_load(three_nodes, cache)

    assert [call.wrong for call in load.calls if call.wrong] == []
    for call in load.calls:
        touches_victim = bool(victim_keys & set(call.keys))
        if call.error is not None:
            assert touches_victim, call  # only calls with a key of the dead node fail
            assert isinstance(call.error, MemcachedError) and call.error.node == victim
        else:
            assert not call.missed or touches_victim, call
    during = [c for c in load.calls if c.started > killed and c.ended < restarting]
    with_victim_key = [c for c in during if victim_keys & set(c.keys)]
    raised = [c for c in during if c.error is not None]
    assert with_victim_key  # the load reached the dead node while it was dead
    assert len(raised) == len(with_victim_key)  # never a silent miss instead of an error
    assert any(isinstance(c.error, NodeDown) for c in raised)  # the circuit opened
    assert back, "the restarted node was not used again under load"


# --- stale values after an outage --------------------------------------------------------------


@pytest.mark.parametrize("ignore_exceptions", [False, True])
def test_no_failover_restarted_node_never_serves_a_value_from_before(
    three_nodes, ignore_exceptions
):
    cache = build([node.address for node in three_nodes], IGNORE_EXCEPTIONS=ignore_exceptions)
    home = three_nodes[0]
    key = keys_by_node(cache, 1)[home.address][0]
    cache.set(key, "v1")
    home.kill()
    for _ in range(3):  # before and after the circuit opens
        try:
            cache.set(key, "v2")
        except NodeError:
            assert not ignore_exceptions
    home.start()
    time.sleep(RETRY + 0.1)
    assert cache.get(key, "miss") in ("miss", "v2")  # never v1


def pause(node) -> None:
    """SIGSTOP: the node keeps its data and its port but answers nobody (a partition)."""
    stop_process(node.process.pid)


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid``, returning once it is stopped: the signal is delivered
    asynchronously, and a process still running may answer one more request."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while process_state(pid) != "T":
        assert time.monotonic() < deadline, "memcached did not stop"
        time.sleep(0.01)


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def resume(node) -> None:
    os.kill(node.process.pid, signal.SIGCONT)


def fail_twice(operation: Callable[[], Any]) -> None:
    """Run ``operation`` until the node is marked down (FAILURE_THRESHOLD is 2)."""
    for _ in range(2):
        with pytest.raises(NodeError):
            operation()


def test_failover_serves_stale_values_after_the_home_node_returns(three_nodes):
    """The documented price of FAILOVER=True (docs/memcached.rst, "Stale reads")."""
    cache = build([node.address for node in three_nodes], FAILOVER=True)
    home = three_nodes[0]
    key = keys_by_node(cache, 1)[home.address][0]
    cache.set(key, "v1")

    pause(home)  # unreachable, but keeps v1
    try:
        fail_twice(lambda: cache.get(key))
        cache.set(key, "v2")  # written on the fallback node
        assert cache.get(key) == "v2"
    finally:
        resume(home)
    time.sleep(RETRY + 0.1)
    assert cache.get(key) == "v1"  # stale: the home node's old value is back

    cache.delete(key)  # reaches the home node only
    pause(home)
    try:
        fail_twice(lambda: cache.get(key))
        assert cache.get(key) == "v2"  # the fallback's copy survives and is served again
    finally:
        resume(home)


def test_no_failover_the_same_outages_serve_nothing_stale(three_nodes):
    """The sequence above without failover: nothing is copied to another node, and what the
    home node missed is deleted there before it serves again."""
    cache = build([node.address for node in three_nodes], IGNORE_EXCEPTIONS=True)
    home = three_nodes[0]
    key = keys_by_node(cache, 1)[home.address][0]
    cache.set(key, "v1")

    pause(home)
    try:
        for _ in range(2):
            assert cache.get(key) is None  # timeouts, ignored; then the node is down
        cache.set(key, "v2")  # dropped: nothing is written elsewhere
        assert cache.get(key) is None
    finally:
        resume(home)
    time.sleep(RETRY + 0.1)
    assert cache.get(key) is None  # not v1: the missed write cleaned it up

    pause(home)
    try:
        for _ in range(3):
            assert cache.get(key) is None  # no copy anywhere to be served
    finally:
        resume(home)


def test_no_failover_paused_node_does_not_serve_a_value_older_than_the_last_write(three_nodes):
    """A partition, not a crash: the node keeps v1, and a timed-out write (v2, v3) may even
    be applied when it resumes; the writes it missed are deleted before it serves again."""
    cache = build([node.address for node in three_nodes], IGNORE_EXCEPTIONS=True)
    home = three_nodes[0]
    key = keys_by_node(cache, 1)[home.address][0]
    cache.set(key, "v1")
    pause(home)
    try:
        for version in ("v2", "v3", "v4"):  # timeouts, then dropped while the circuit is open
            cache.set(key, version)
    finally:
        resume(home)
    time.sleep(RETRY + 0.1)
    assert cache.get(key, "miss") in ("miss", "v4")


# --- a node that accepts connections and never answers ----------------------------------------


class SilentServer:
    """Accepts connections and reads whatever is sent, never writing a byte back."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.listener.setblocking(False)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.received = 0
        self.connections = 0
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stopping.is_set():
            for ready, _ in self.selector.select(timeout=0.05):
                sock = ready.fileobj
                if sock is self.listener:
                    client, _ = self.listener.accept()
                    self.connections += 1
                    self.selector.register(client, selectors.EVENT_READ)
                    continue
                data = sock.recv(65536)  # type: ignore[union-attr]
                self.received += len(data)
                if not data:
                    self.selector.unregister(sock)
                    sock.close()  # type: ignore[union-attr]

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def silent_cache(
    server: SilentServer, live: str, **options: Any
) -> tuple[MemcachedCache, str, str]:
    """A cache on a live node and the silent one; a key on each (silent first)."""
    cache = build([live, server.address], **options)
    placed = keys_by_node(cache, 1, prefix="silent")
    return cache, placed[server.address][0], placed[live][0]


OPERATIONS: dict[str, Callable[[MemcachedCache, str, str], Any]] = {
    "get": lambda c, k, other: c.get(k),
    "set": lambda c, k, other: c.set(k, "x" * 100_000),  # more than a socket buffer's worth
    "add": lambda c, k, other: c.add(k, 1),
    "touch": lambda c, k, other: c.touch(k),
    "delete": lambda c, k, other: c.delete(k),
    "has_key": lambda c, k, other: c.has_key(k),
    "incr": lambda c, k, other: c.incr(k),
    "get_many": lambda c, k, other: c.get_many([k, other]),
    "set_many": lambda c, k, other: c.set_many({k: 1, other: 2}),
    "delete_many": lambda c, k, other: c.delete_many([k, other]),
    "get_or_set": lambda c, k, other: c.get_or_set(k, 1),
}


@pytest.mark.parametrize("ignore_exceptions", [False, True])
def test_every_operation_on_a_silent_node_is_bounded_by_the_io_timeout(
    silent_server, memcached_node_factory, ignore_exceptions, api
):
    live = memcached_node_factory().address
    # A threshold no test reaches: every call really waits for the silent node.
    cache, key, other = silent_cache(
        silent_server, live, FAILURE_THRESHOLD=1000, IGNORE_EXCEPTIONS=ignore_exceptions
    )
    metrics = cache.cluster.by_name[silent_server.address]
    cache = api(cache)
    for name, operation in OPERATIONS.items():
        timeouts_before = metrics.timeouts
        started = time.monotonic()
        try:
            operation(cache, key, other)
        except NodeError as exc:
            assert not ignore_exceptions, name
            assert "did not answer within IO_TIMEOUT (" in str(exc), (name, exc)
        except ValueError:  # incr's answer for a key it cannot find (fail-open)
            assert ignore_exceptions and name == "incr", name
        else:
            assert ignore_exceptions, f"{name} on a silent node did not raise"
        elapsed = time.monotonic() - started
        # Django's get_or_set is get, add, get: three waits when failures are ignored.
        waits = 3 if name == "get_or_set" and ignore_exceptions else 1
        assert metrics.timeouts - timeouts_before == waits, name  # one wait per request
        assert elapsed < waits * IO_TIMEOUT + MARGIN, (name, elapsed)
    assert silent_server.received > 0  # the requests really reached the silent node


def test_threads_on_a_silent_node_open_its_circuit_and_then_fail_fast(
    silent_server, memcached_node_factory
):
    live = memcached_node_factory().address
    # No probe during the test: every timeout counted happened before the circuit opened.
    cache, key, other = silent_cache(silent_server, live, RETRY_TIMEOUT=60)
    errors: list[BaseException] = []
    durations: list[float] = []

    def hammer() -> None:
        for _ in range(5):
            started = time.monotonic()
            try:
                cache.get_many([key, other])
            except NodeError as exc:
                errors.append(exc)
            durations.append(time.monotonic() - started)

    threads = [threading.Thread(target=hammer) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(errors) == THREADS * 5  # every call raised, none silently missed
    assert max(durations) < IO_TIMEOUT + MARGIN  # nobody waited longer than one timeout
    timeouts = cache.metrics()[silent_server.address]["timeouts"]
    # A thread's second call may start before any thread's timeout has been counted; once a
    # thread has timed out twice the node has failed FAILURE_THRESHOLD times and is down.
    assert 2 <= timeouts <= 2 * THREADS
    assert sum(isinstance(exc, NodeDown) for exc in errors) >= THREADS * 5 - timeouts

    # Open circuit: nothing is sent to the silent node, the call costs no timeout.
    received = silent_server.received
    started = time.monotonic()
    with pytest.raises(NodeDown):
        cache.get(key)
    assert time.monotonic() - started < IO_TIMEOUT
    assert silent_server.received == received
    assert cache.get(other) is None  # the live node still serves its keys


@pytest.fixture
def unreachable_node() -> Iterator[str]:
    """A port whose handshakes never complete: a listener that accepts nobody, with its
    (one place) backlog already taken, like a host whose packets are dropped."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    address = listener.getsockname()
    filler = socket.create_connection(address)
    yield f"{address[0]}:{address[1]}"
    filler.close()
    listener.close()


def test_a_node_that_never_completes_a_connection_is_bounded_by_the_connect_timeout(
    unreachable_node, memcached_node_factory
):
    live = memcached_node_factory().address
    cache = build([live, unreachable_node], RETRY_TIMEOUT=60)
    key = keys_by_node(cache, 1, prefix="unreachable")[unreachable_node][0]
    for name in ("get", "set", "get_many"):
        started = time.monotonic()
        with pytest.raises(NodeError) as raised:
            OPERATIONS[name](cache, key, key)
        assert time.monotonic() - started < IO_TIMEOUT + MARGIN, name  # CONNECT_TIMEOUT
        if name != "get_many":  # the first two calls wait; they reach FAILURE_THRESHOLD
            assert "no connection within CONNECT_TIMEOUT (" in str(raised.value), (name, raised.value)
    assert isinstance(raised.value, NodeDown)  # the third finds the circuit open
    assert cache.metrics()[unreachable_node]["timeouts"] == 2
