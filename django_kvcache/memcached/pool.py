"""Process-wide connection pools, one per node and connection settings.

Django builds one cache backend per thread and per async context and calls ``close()``
at the end of every request, so pools live here, outside the backend instances: every
instance with the same settings shares them and connections survive the request. A
pool is the package's :class:`~django_kvcache.pool.BlockingPool` of
:class:`~connection.Connection` objects (each owns one socket, opened by its first
exchange); a forked child forgets every connection inherited from its parent.
"""
from __future__ import annotations

from django_kvcache.forks import Registry
from django_kvcache.memcached import PoolExhausted
from django_kvcache.memcached.connection import Connection, ConnectionSettings
from django_kvcache.memcached.routing import NodeAddress
from django_kvcache.pool import BlockingPool

__all__ = ["ConnectionSettings", "NodePool", "pool_for"]


class NodePool(BlockingPool[Connection]):
    """Connections to one node, shared by the process's threads."""

    def __init__(self, address: NodeAddress, settings: ConnectionSettings) -> None:
        super().__init__(settings.max_size, settings.pool_timeout)
        self.address = address
        self.settings = settings

    def open(self) -> Connection:
        return Connection(self.address, self.settings)

    def exhausted(self) -> PoolExhausted:
        return exhausted(self.address, self.settings)


def exhausted(address: NodeAddress, settings: ConnectionSettings) -> PoolExhausted:
    """What a wait for one of a node's connections raises when its time is up."""
    return PoolExhausted(
        address.name,
        f"all {settings.max_size} connections busy for {settings.pool_timeout} s "
        "(MAX_POOL_SIZE, POOL_TIMEOUT)",
    )


_registry: Registry[tuple[str, ConnectionSettings], NodePool] = Registry()


def pool_for(address: NodeAddress, settings: ConnectionSettings) -> NodePool:
    """The process-wide pool for this node and these settings."""
    return _registry.get((address.name, settings), lambda: NodePool(address, settings))
