from __future__ import annotations

import os
import sys
from typing import Callable, Iterator

import pytest

from tests.concurrency import keep_forked_children_off_django_sockets
from tests.servers import (
    MariaDBServer,
    MemcachedNode,
    Replica,
    configured_replica,
    missing_servers,
)


def pytest_configure(config: pytest.Config) -> None:
    # Before any test opens a database connection: each is watched from its opening.
    keep_forked_children_off_django_sockets()


def pytest_sessionstart(session: pytest.Session) -> None:
    """The server groups named by KVCACHE_REQUIRE_SERVERS (``make test`` names the ones it
    started) must answer: a test whose servers are not there would skip, and a run that
    was meant to test them would pass having tested nothing."""
    required = [g for g in os.environ.get("KVCACHE_REQUIRE_SERVERS", "").split(",") if g]
    problems = missing_servers(required)
    if problems:
        pytest.exit("servers that were meant to run are not there: " + "; ".join(problems),
                    returncode=3)


@pytest.fixture(autouse=True)
def no_exception_left_handled() -> Iterator[None]:
    """A test leaves its thread handling no exception. CPython (3.11 to 3.13) leaves one
    handled for good when a trace function raises inside an except block: every later
    test then has it as the ``__context__`` of its errors, and asgiref re-raises it in
    its sync thread on every ``sync_to_async`` (it failed an unrelated test in CI)."""
    before = sys.exc_info()[1]
    yield
    after = sys.exc_info()[1]
    if before is None and after is not None:
        pytest.fail(f"the test left its thread handling {after!r}", pytrace=False)


@pytest.fixture(autouse=True)
def new_corrupt_entry_episode() -> None:
    """Each test's first corrupt entry is logged: an episode left by an earlier test
    would otherwise summarize it a minute later."""
    from django_kvcache.base import unreadable_entries

    unreadable_entries.episodes.clear()


@pytest.fixture(autouse=True)
def nothing_learnt_about_compression() -> None:
    """Each test's codecs start without a record of what compression saved: a kind of
    value an earlier test found incompressible would otherwise not be tried here."""
    from django_kvcache.savings import shared_savings

    shared_savings.cache_clear()


@pytest.fixture(autouse=True)
def new_mysql_failure_episodes() -> None:
    """Each test's first MySQL failure of a kind is logged (the logs are rate-limited:
    an earlier test's episode would only count it)."""
    # Only where the MySQL backend is in use: the extra-memcached environment has none.
    backend, policy = (sys.modules.get(f"django_kvcache.{name}")
                       for name in ("backends.mysql", "mysql.policy"))
    logs = ([backend.oversized] if backend else []) + (
        [policy.ignored_failures, policy.maintenance_failures] if policy else [])
    for failure_log in logs:
        failure_log.episodes.clear()


@pytest.fixture(autouse=True)
def no_read_your_writes_window_yet() -> None:
    """Each test's thread starts without a READ_YOUR_WRITES window: the window is the
    thread's (as in a long-lived worker thread), and an earlier test's write through a
    cache of the same configuration would send this test's first reads to the primary."""
    cluster = sys.modules.get("django_kvcache.mysql.cluster")
    for each in cluster._clusters.values() if cluster else []:
        each.written_here().clear()


@pytest.fixture
def without_zstd(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What a process without any zstd engine (zstandard, or before Python 3.14
    backports.zstd) sees: the imports fail.
    Caches built after it have no zstd; the py311-nozstd tox env runs the same tests
    where it is really missing."""
    from django_kvcache.codec import _warn_zlib_fallback

    for module in ("codec", "checks", "zstd"):
        monkeypatch.setattr(f"django_kvcache.{module}.zstd_engine", lambda: None)
    _warn_zlib_fallback.cache_clear()
    yield
    _warn_zlib_fallback.cache_clear()


@pytest.fixture(params=["models first", "caches first"])
def check_order(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test of the ``check`` command with Django's model checks before its cache
    checks, then after them. Django runs the system checks in the order of a set of
    functions, which changes from process to process; from Django 6.1 the model checks
    ask every database alias's server its version (earlier versions ask none), so a test
    allowed fewer databases passed or failed by the process it ran in."""
    from django.core.checks.registry import registry

    registered = registry.get_checks
    models_first = request.param == "models first"

    def get_checks(include_deployment_checks: bool = False) -> list:
        checks = registered(include_deployment_checks)
        return sorted(checks, key=lambda check: ("models" in check.tags) != models_first)

    monkeypatch.setattr(registry, "get_checks", get_checks)
    return request.param


@pytest.fixture
def memcached_node_factory() -> Iterator[Callable[[], MemcachedNode]]:
    """Start extra memcached processes for a test; every one is killed afterwards."""
    nodes: list[MemcachedNode] = []

    def start() -> MemcachedNode:
        node = MemcachedNode()
        nodes.append(node)
        node.start()
        return node

    yield start
    for node in nodes:
        node.kill()


@pytest.fixture
def mariadb_server() -> Iterator[MariaDBServer]:
    """A MariaDB of the test's own, which it may stop and restart; removed afterwards."""
    server = MariaDBServer()
    server.start()
    yield server
    server.remove()


@pytest.fixture(scope="module")
def private_memcached_nodes() -> Iterator[list[str]]:
    """Three memcached processes for one test module, so its flushes stay its own."""
    nodes = [MemcachedNode() for _ in range(3)]
    try:
        for node in nodes:
            node.start()
        yield [node.address for node in nodes]
    finally:
        for node in nodes:
            node.kill()


@pytest.fixture(scope="session")
def replica() -> Replica:
    """shard2's real replica, replicating and caught up; the test is skipped where the
    settings have none (KVCACHE_MYSQL_REPLICA_PORT empty: a mirror stands in)."""
    replica = configured_replica()
    if replica is None:
        pytest.skip("no real replica: KVCACHE_MYSQL_REPLICA_PORT is empty")
    status = replica.status()
    assert (status["Slave_IO_Running"], status["Slave_SQL_Running"]) == ("Yes", "Yes"), (
        f"the replica on port {replica.port} does not replicate: {status['Last_Error']}; "
        "`scripts/services.py up` rebuilds it"
    )
    replica.caught_up()
    return replica
