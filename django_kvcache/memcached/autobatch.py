"""Autobatching (OPTIONS ``AUTOBATCH``): the gets one event loop issues for one node in
one loop iteration go out as one multi-key ``get``.

An ``aget`` — or a node's share of an ``aget_many`` — that finds the loop already busy
with that node (gets waiting, or a connection in use: ``aio.batch_for``) hands its keys
to the node's :class:`Gets` of the running loop and waits on a future; a lone call goes
straight out, as without AUTOBATCH. The first keys of an iteration schedule one flush (``loop.call_soon``): it runs after every coroutine that
was ready in that iteration has asked, and sends all their keys (each once) in one
request, on one pooled connection, through the node's exchange — the same connection
handling, retry and failure policy as any call. Each waiter then gets its own keys'
share of the reply, or the node's error (and applies its own IGNORE_EXCEPTIONS to it, as
without batching).

The fetch runs in a task of its own, so a caller that is cancelled only drops its
future: the request, and the other callers' answers, carry on.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from django_kvcache.memcached import ServerError, aio, wire

Found = dict[bytes, tuple[bytes, int]]
#: The callers a request must serve on average for a get to wait for company while a
#: connection is free: below it (the loop's coroutines spread over many nodes, a request
#: or two each per iteration), the batch's own cost — a future per caller, a task per
#: request — outweighs the requests it saves, and a get with a free connection goes alone.
COMPANY = 2


class Gets:
    """One loop's pending gets for one node (touched from that loop's thread only).
    ``fetch`` sends one get request to the node and awaits what it makes of the reply."""

    def __init__(self, fetch: Callable[[wire.Op], Awaitable[Any]], node: str = "") -> None:
        self.fetch = fetch
        self.node = node
        self.waiting: list[tuple[list[bytes] | bytes, asyncio.Future]] = []
        self.fetches: set[asyncio.Task] = set()  # running: kept referenced until done
        self.flushes = 0  # requests sent, for metrics and tests
        #: Callers per request, a moving average: whether batching pays on this node
        #: (``batch_for``). It starts as if it did.
        self.company = float(COMPANY)

    def get(self, keys: list[bytes] | bytes) -> asyncio.Future:
        """A future of ``{key: (data, flags)}`` for the ``keys`` found; for one key given
        as bytes (a single-key get), of its ``(data, flags)`` or None (no dict made)."""
        future = asyncio.get_running_loop().create_future()
        if not self.waiting:
            future.get_loop().call_soon(self._flush)
        self.waiting.append((keys, future))
        return future

    def _flush(self) -> None:
        waiting, self.waiting = self.waiting, []
        self.flushes += 1
        self.company += (len(waiting) - self.company) / 8
        task = asyncio.get_running_loop().create_task(self._fetch(waiting))
        self.fetches.add(task)
        task.add_done_callback(self.fetches.discard)

    async def _fetch(self, waiting: list[tuple[list[bytes] | bytes, asyncio.Future]]) -> None:
        asked_keys: dict[bytes, None] = {}  # each key once, in the order asked
        for asked, _ in waiting:
            if type(asked) is bytes:
                asked_keys[asked] = None
            else:
                asked_keys.update(dict.fromkeys(asked))
        keys = list(asked_keys)
        op = wire.get_one(keys[0]) if len(keys) == 1 else wire.get_many(keys)
        failed: set[bytes] = set()
        try:
            try:
                reply = await self.fetch(op)
            except ServerError:
                if len(keys) == 1:
                    raise
                # A proxy answers SERVER_ERROR for a whole get when one of its servers is
                # down: the keys are asked one by one, and only those callers fail.
                reply, not_served = await self.fetch(wire.get_each(keys))
                failed.update(not_served)
                error = ServerError(self.node, "SERVER_ERROR for this key (a proxy's server "
                                    "down?)")
        except BaseException as exc:  # the node's error (or a cancelled loop): theirs too
            for _, future in waiting:
                if future.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        found: Found = reply if len(keys) > 1 else ({keys[0]: reply} if reply else {})
        for asked, future in waiting:
            if future.done():  # a cancelled caller's share is dropped
                continue
            if type(asked) is bytes:
                if asked in failed:
                    future.set_exception(error)
                else:
                    future.set_result(found.get(asked))
            elif failed.intersection(asked):
                future.set_exception(error)
            else:
                future.set_result({key: found[key] for key in asked if key in found})


def batch_for(node: Any) -> Gets | None:
    """With AUTOBATCH, the running loop's batch of gets for ``node`` to join — when this
    loop already has gets waiting, or a connection busy on the node and either none free
    or the node's requests have lately served company enough (``COMPANY``), so there is
    company to share a request with. None: go alone (a lone call pays no batching
    detour). The loop's state is looked up once."""
    if not node.pool.settings.autobatch:
        return None
    state = aio.loop_state()
    gets = _gets_in(state, node)
    if gets.waiting:
        return gets
    pool = state.pools.get(node)
    if pool is None or pool.size <= len(pool.idle):
        return None  # nothing going on with the node
    if pool.idle and gets.company < COMPANY:
        return None  # a free connection, and batches here have served one caller or so
    return gets


def gets_of(node: Any) -> Gets:
    """The running loop's batch of gets for ``node``, made on first use."""
    return _gets_in(aio.loop_state(), node)


def _gets_in(state: Any, node: Any) -> Gets:
    gets = state.gets.get(node)
    if gets is None:
        gets = state.gets[node] = Gets(node.gets_to_fetch, node.name)
    return gets
