"""The usual calls: one request on its node's exchange, without a plan.

``get``, ``aget``, ``aset``, ``aadd``, ``adelete`` and ``atouch`` of one key are, most
of the time, one request to one node: REPLICAS 1, the node up, a connection free, the
node owing no settle of a write cut short and no clean-up of the copies it missed, no
stale copies of get_or_set's to clear. Then the request is sent and its reply awaited as
one coroutine on the node's exchange (``exchange.sent_alone``; a get joins the node's
pending gets, ``exchange.joined_get``, or goes alone when they have no company), or for
``get`` sent and read on a blocking connection of the node's pool
(``exchange.done_alone``): no plan, no driver, no step in between. They are
``MemcachedCache``'s own methods (:class:`UsualCalls` is a base class of it), so that
not even a call of the cache's is in between.

Nothing is decided here. Which node, and whether the call is the usual one, is the
replica policy's (``Replicas.write_alone``, ``Replicas.joined_read``,
``Replicas.read_alone``: None when it is not); what is sent is the cache's
(``_store_request``…); what the reply, an error, IO_TIMEOUT or a cancellation does to
the connection and the node is the exchange's, the same functions its plans use; a
failed write's missed-write mark is the policy's (``OneReplica.write_missed``,
``Replicas.add_failed``, as in its plans), IGNORE_EXCEPTIONS the cache's
(``_failed``). Everything unusual — no connection free, a node to settle or clean up, a
stale pooled connection's second try, a refused value's
clean-up, REPLICAS > 1 — goes through the cache's plan, run by ``steps.run`` or ``steps.arun``.
"""
from __future__ import annotations

from typing import Any, Protocol

from django.core.cache.backends.base import DEFAULT_TIMEOUT

from django_kvcache.memcached import MemcachedError, wire
from django_kvcache.memcached.exchange import (
    ASYNCIO,
    BLOCKING,
    Transport,
    done_alone,
    sent_alone,
)
from django_kvcache.steps import Plan, arun, run


class UsualHost(Protocol):
    """What the usual calls need of their cache (``MemcachedCache``): its keys, its
    requests and its plans, each the one the cache's own methods use."""

    replicas: Any  # memcached.replicas.Replicas
    _stale_copies: bool

    def make_and_validate_key(self, key: Any, version: int | None = None) -> str: ...

    def expire_time(self, timeout: Any) -> int: ...

    def _failed(self, error: MemcachedError, fallback: Any = None) -> Any: ...

    def _found(self, found: tuple[bytes, int] | None, default: Any, stored_key: str) -> Any: ...

    def _read(self, stored_key: str, default: Any, io: Transport) -> Plan: ...

    def _set(self, key: Any, value: Any, timeout: Any, version: int | None,
             io: Transport) -> Plan: ...

    def _store_request(self, name: bytes, stored_key: str, value: Any,
                       expire: int) -> tuple[wire.Op, bytes, int]: ...

    def _stored(self, stored_key: str, key: Any, op: wire.Op, data: bytes, saved: int,
                io: Transport) -> Plan: ...

    def _set_failed(self, error: MemcachedError, stored_key: str, key: Any,
                    io: Transport) -> Plan: ...

    def _add(self, key: Any, value: Any, timeout: Any, version: int | None,
             io: Transport) -> Plan: ...

    def _delete(self, key: Any, version: int | None, io: Transport) -> Plan: ...

    def _touch_op(self, stored_key: str, timeout: Any) -> wire.Op: ...

    def _changed(self, stored_key: str, op: wire.Op, io: Transport) -> Plan: ...


class UsualCalls:
    """``MemcachedCache``'s usual calls — Django's ``get``, ``aget``, ``aset``, ``aadd``,
    ``adelete`` and ``atouch`` — as a base class of it (module docstring). Each falls
    back to the cache's plan where the call is not the usual one. What it needs of the
    cache: :class:`UsualHost`."""

    def get(self: UsualHost, key: Any, default: Any = None, version: int | None = None) -> Any:
        stored_key = self.make_and_validate_key(key, version=version)
        batch = self.replicas.read_alone(stored_key)
        if batch is None:
            return run(self._read(stored_key, default, BLOCKING))
        try:
            found = done_alone(batch)
        except MemcachedError as exc:
            return self._failed(exc, default)
        return self._found(found, default, stored_key)

    async def aget(self: UsualHost, key: Any, default: Any = None,
                   version: int | None = None) -> Any:
        stored_key = self.make_and_validate_key(key, version=version)
        joined = self.replicas.joined_read(stored_key)
        if joined is None:
            return await arun(self._read(stored_key, default, ASYNCIO))
        # The usual case on a busy loop: the get joins its node's pending gets; what
        # comes back is treated as _read does.
        try:
            found = await joined
        except MemcachedError as exc:
            return self._failed(exc, default)
        return self._found(found, default, stored_key)

    async def aset(self: UsualHost, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT,
                   version: int | None = None) -> None:
        if self._stale_copies:  # stale copies of get_or_set's go with the entry
            return await arun(self._set(key, value, timeout, version, ASYNCIO))
        stored_key, op, data, saved, batch = _storing(self, b"set", key, value, timeout,
                                                      version)
        if batch is None:
            return await arun(self._stored(stored_key, key, op, data, saved, ASYNCIO))
        try:
            await sent_alone(batch)
        except MemcachedError as exc:  # (a refused value's clean-up: a request more)
            self.replicas.write_missed(stored_key, exc)
            await arun(self._set_failed(exc, stored_key, key, ASYNCIO))
        return None

    async def aadd(self: UsualHost, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT,
                   version: int | None = None) -> bool:
        if self._stale_copies:
            return await arun(self._add(key, value, timeout, version, ASYNCIO))
        stored_key, op, data, saved, batch = _storing(self, b"add", key, value, timeout,
                                                      version)
        if batch is None:
            return await arun(self.replicas.add_request(stored_key, key, op, data, saved,
                                                        version, ASYNCIO))
        try:
            # One replica (the only policy that answers write_alone): its reply decides.
            return bool(await sent_alone(batch))
        except MemcachedError as exc:
            self.replicas.add_failed(stored_key, key, exc, [])  # no other replica decides
            return False

    async def adelete(self: UsualHost, key: Any, version: int | None = None) -> bool:
        if self._stale_copies:
            return await arun(self._delete(key, version, ASYNCIO))
        stored_key = self.make_and_validate_key(key, version=version)
        return await _changed_alone(self, stored_key, wire.delete(stored_key.encode()))

    async def atouch(self: UsualHost, key: Any, timeout: Any = DEFAULT_TIMEOUT,
                     version: int | None = None) -> bool:
        stored_key = self.make_and_validate_key(key, version=version)
        return await _changed_alone(self, stored_key, self._touch_op(stored_key, timeout))


def _storing(cache: UsualHost, name: bytes, key: Any, value: Any, timeout: Any,
             version: int | None) -> tuple[str, wire.Op, bytes, int, Any]:
    """A ``set`` or an ``add`` (``name``): its stored key, its request (the cache's
    ``_store_request``) and a batch of ``Replicas.write_alone`` for it, or None."""
    stored_key = cache.make_and_validate_key(key, version=version)
    op, data, saved = cache._store_request(name, stored_key, value, cache.expire_time(timeout))
    batch = cache.replicas.write_alone(stored_key, op, len(stored_key) + len(data), saved)
    return stored_key, op, data, saved, batch


async def _changed_alone(cache: UsualHost, stored_key: str, op: wire.Op) -> bool:
    """A ``touch`` or a ``delete`` (the cache's ``_changed``): whether it found the key."""
    batch = cache.replicas.write_alone(stored_key, op)
    if batch is None:
        return await arun(cache._changed(stored_key, op, ASYNCIO))
    try:
        return bool(await sent_alone(batch))  # the plan's any() of the one reply
    except MemcachedError as exc:
        cache.replicas.write_missed(stored_key, exc)
        return cache._failed(exc, False)
