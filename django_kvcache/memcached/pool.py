"""Process-wide connection pools, one per node and connection settings.

Django builds one cache backend per thread and per async context and calls ``close()``
at the end of every request, so pools live here, outside the backend instances: every
instance with the same settings shares them and connections survive the request.

A pool is a LIFO list of pymemcache ``Client`` objects (each owns one socket). Taking
and returning a connection is a plain ``list.pop``/``list.append`` (atomic under the
GIL); the lock is only taken when the pool is empty or someone waits. A forked child
forgets every connection inherited from its parent (they share the parent's sockets).
"""
from __future__ import annotations

import os
import ssl
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from pymemcache.client.base import Client

from django_kvcache.memcached import PoolExhausted
from django_kvcache.memcached.routing import NodeAddress


@dataclass(frozen=True)
class ConnectionSettings:
    connect_timeout: float | None = 1.0
    io_timeout: float | None = 1.0
    max_size: int = 64
    pool_timeout: float = 1.0
    tls: ssl.SSLContext | None = None  # hashed by identity, like the setting object itself


class RawSerde:
    """pymemcache serde that leaves encoding to our codec.

    ``set`` receives an already encoded ``(bytes, flags)`` pair; ``get`` hands back the
    stored ``(bytes, flags)``, so a corrupt entry never breaks the connection's reply.
    """

    def serialize(self, key: Any, value: tuple[bytes, int]) -> tuple[bytes, int]:
        return value

    def deserialize(self, key: Any, data: bytes, flags: int) -> tuple[bytes, int]:
        return data, flags


RAW_SERDE = RawSerde()


class NodePool:
    """Connections to one node. ``size`` counts open connections, idle or in use."""

    def __init__(self, address: NodeAddress, settings: ConnectionSettings) -> None:
        self.address = address
        self.settings = settings
        self.forget()
        _all_pools.add(self)

    def forget(self) -> None:
        """Start empty without closing anything (after fork the sockets are the parent's)."""
        self.idle: list[Client] = []
        self.size = 0
        self.waits = 0
        self.connects = 0
        self.waiting = 0
        self.condition = threading.Condition(threading.Lock())

    def checkout(self) -> Client:
        try:
            return self.idle.pop()
        except IndexError:
            return self._checkout_slow()

    def checkin(self, client: Client) -> None:
        self.idle.append(client)
        if self.waiting:
            with self.condition:
                self.condition.notify()

    def discard(self, client: Client) -> None:
        """Close a connection that failed; the pool may open a new one in its place."""
        client.close()
        with self.condition:
            self.size -= 1
            self.condition.notify()

    def close_idle(self) -> None:
        """Close every idle connection (the ones in use close when they come back)."""
        with self.condition:
            idle, self.idle = self.idle, []
            self.size -= len(idle)
        for client in idle:
            client.close()

    def _checkout_slow(self) -> Client:
        settings = self.settings
        deadline = None
        with self.condition:
            while True:
                if self.idle:
                    return self.idle.pop()
                if self.size < settings.max_size:
                    self.size += 1
                    break
                if deadline is None:
                    self.waits += 1
                    deadline = time.monotonic() + settings.pool_timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PoolExhausted(
                        self.address.name,
                        f"all {settings.max_size} connections busy for "
                        f"{settings.pool_timeout} s (MAX_POOL_SIZE, POOL_TIMEOUT)",
                    )
                self.waiting += 1
                try:
                    self.condition.wait(remaining)
                finally:
                    self.waiting -= 1
        self.connects += 1
        return Client(
            self.address.server,
            serde=RAW_SERDE,
            connect_timeout=settings.connect_timeout,
            timeout=settings.io_timeout,
            no_delay=True,
            allow_unicode_keys=True,
            default_noreply=False,
            encoding="utf-8",
            tls_context=settings.tls,
        )


_all_pools: weakref.WeakSet[NodePool] = weakref.WeakSet()
_registry: dict[tuple[str, ConnectionSettings], NodePool] = {}
_registry_lock = threading.Lock()


def pool_for(address: NodeAddress, settings: ConnectionSettings) -> NodePool:
    """The process-wide pool for this node and these settings."""
    key = (address.name, settings)
    try:
        return _registry[key]
    except KeyError:
        with _registry_lock:
            return _registry.setdefault(key, NodePool(address, settings))


def _forget_all_after_fork() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    for pool in list(_all_pools):
        pool.forget()


os.register_at_fork(after_in_child=_forget_all_after_fork)
