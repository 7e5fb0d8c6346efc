from __future__ import annotations

from typing import Callable, Iterator

import pytest

from tests.servers import MariaDBServer, MemcachedNode


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
