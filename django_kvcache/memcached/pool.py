"""Process-wide connection pools, one per node and connection settings.

Django builds one cache backend per thread and per async context and calls ``close()``
at the end of every request, so pools live here, outside the backend instances: every
instance with the same settings shares them and connections survive the request.

A pool is a LIFO list of :class:`~connection.Connection` objects (each owns one socket). Taking
and returning a connection is a plain ``list.pop``/``list.append`` (atomic under the
GIL); the lock is only taken when the pool is empty or someone waits. A forked child
forgets every connection inherited from its parent (they share the parent's sockets).

No waiter is ever stranded next to an idle connection: ``checkin`` appends to ``idle``
*then* looks at the queue, a waiter joins the queue *then* looks at ``idle`` (under the
lock), so at least one of the two sees the other and hands the connection over.
"""
from __future__ import annotations

import threading
from collections import deque

from django_kvcache import forks
from django_kvcache.forks import Registry

from django_kvcache.memcached import PoolExhausted
from django_kvcache.memcached.connection import Connection, ConnectionSettings
from django_kvcache.memcached.routing import NodeAddress

__all__ = ["ConnectionSettings", "NodePool", "pool_for"]


class _Waiter:
    """A thread queued for a connection; ``lock`` is released when one is handed over."""

    __slots__ = ("client", "lock")

    def __init__(self) -> None:
        self.client: Connection | None = None  # None with the lock released: open a new one
        self.lock = threading.Lock()
        self.lock.acquire()


class NodePool:
    """Connections to one node. ``size`` counts open connections, idle or in use.

    Waiting threads queue in arrival order and each gets a connection handed over
    directly, so a burst of newcomers cannot starve a thread that is already waiting.
    """

    def __init__(self, address: NodeAddress, settings: ConnectionSettings) -> None:
        self.address = address
        self.settings = settings
        self.after_fork()
        forks.register(self)

    def after_fork(self) -> None:
        """Start empty without closing anything (after fork the sockets are the parent's)."""
        self.idle: list[Connection] = []
        self.queue: deque[_Waiter] = deque()
        self.size = 0
        self.waits = 0
        self.connects = 0
        self.lock = threading.Lock()

    def checkout(self) -> Connection:
        if not self.queue:
            client = self._pop_idle()
            if client is not None:
                return client
        return self._checkout_slow()

    def try_checkout(self) -> Connection | None:
        """A connection if one is free or may be opened now; None instead of waiting."""
        if not self.queue:
            client = self._pop_idle()
            if client is not None:
                return client
        with self.lock:
            if not self.queue:
                client = self._pop_idle()
                if client is not None:
                    return client
            if self.size < self.settings.max_size:
                self.size += 1
                return self._new_client()
        return None

    def checkin(self, client: Connection) -> None:
        self.idle.append(client)
        if self.queue:  # read after the append: see the module docstring
            with self.lock:
                self._hand_over_idle()

    def discard(self, client: Connection) -> None:
        """Close a connection that failed; a waiting thread may open one in its place."""
        client.close()
        self.free_slot()

    def free_slot(self) -> None:
        """Stop counting a connection that left the pool (closed, or kept by its node)."""
        with self.lock:
            if self.queue:
                self.queue.popleft().lock.release()  # hands over the slot, not a client
            else:
                self.size -= 1

    def close_idle(self) -> None:
        """Close every idle connection (the ones in use close when they come back).

        ``idle`` is emptied in place, never replaced: a checkin that read the list before
        would otherwise add to a list nobody looks at. Each freed slot goes to a waiting
        thread first, as ``free_slot`` does, so no waiter is stranded by the closing.
        """
        closed = []
        with self.lock:
            while (client := self._pop_idle()) is not None:
                closed.append(client)
                if self.queue:
                    self.queue.popleft().lock.release()  # hands over the slot
                else:
                    self.size -= 1
        for client in closed:
            client.close()

    def _pop_idle(self) -> Connection | None:
        try:
            return self.idle.pop()
        except IndexError:  # another thread took the last one since we looked
            return None

    def _hand_over_idle(self) -> None:
        """Give idle connections to waiters, first come first served (lock held)."""
        while self.queue:
            client = self._pop_idle()
            if client is None:
                return
            waiter = self.queue.popleft()
            waiter.client = client
            waiter.lock.release()

    def _checkout_slow(self) -> Connection:
        settings = self.settings
        with self.lock:
            if not self.queue:
                client = self._pop_idle()
                if client is not None:
                    return client
            if self.size < settings.max_size:
                self.size += 1
                return self._new_client()
            waiter = _Waiter()
            self.queue.append(waiter)
            self.waits += 1
            # Look again after queueing: a checkin that read the queue before our append
            # has put its connection in ``idle`` by now (see the module docstring).
            self._hand_over_idle()
        if not waiter.lock.acquire(timeout=settings.pool_timeout):
            with self.lock:
                if waiter in self.queue:
                    self.queue.remove(waiter)
                    raise PoolExhausted(
                        self.address.name,
                        f"all {settings.max_size} connections busy for "
                        f"{settings.pool_timeout} s (MAX_POOL_SIZE, POOL_TIMEOUT)",
                    )
            # handed over just as we gave up: take it
        return waiter.client if waiter.client is not None else self._new_client()

    def _new_client(self) -> Connection:
        self.connects += 1
        return Connection(self.address, self.settings)


_registry: Registry[tuple[str, ConnectionSettings], NodePool] = Registry()


def pool_for(address: NodeAddress, settings: ConnectionSettings) -> NodePool:
    """The process-wide pool for this node and these settings."""
    return _registry.get((address.name, settings), lambda: NodePool(address, settings))
