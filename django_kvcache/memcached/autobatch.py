"""Autobatching (OPTIONS ``AUTOBATCH``): the gets one event loop issues for one node in
one loop iteration go out as one multi-key ``get``.

An ``aget`` — or a node's share of an ``aget_many`` — that joins the node's :class:`Gets`
of the running loop hands its keys over and waits on a future. The first keys of an
iteration start the request's task, which runs after every coroutine that was ready in
that iteration has asked, and sends all their keys (each once) in one request, on one
pooled connection, through the node's exchange — the same connection handling, retry and
failure policy as any call. Each waiter then gets its own keys' share of the reply, or
the node's error (and applies its own IGNORE_EXCEPTIONS to it, as without batching).

Whether a get joins (``batch_for``): while the node's requests serve company enough on
average (``COMPANY`` callers or more), every get joins, the first of an iteration too, so
that the requests measure how many callers an iteration really has; below it (one
coroutine at a time, or callers spread over many nodes) a get goes straight out, as
without AUTOBATCH, unless a request is already in flight to the node — its company then
shows in the next request's figure.

The fetch runs in a task of its own, so a caller that is cancelled only drops its
future: the request, and the other callers' answers, carry on.
"""
from __future__ import annotations

import asyncio
import weakref
from typing import Any, Awaitable, Callable

from django_kvcache.memcached import ServerError, aio, wire

Found = dict[bytes, tuple[bytes, int]]
#: The callers a request serves on average (a moving average over the node's requests)
#: from which every get for the node waits for company: a request per node and loop
#: iteration instead of one per caller. Below it (one coroutine at a time, or the loop's
#: coroutines spread over many nodes), the batch's own cost — a loop iteration's wait, a
#: future per caller, a task per request — outweighs the requests it saves, and a get to
#: a node with nothing in flight goes alone. Measured (32 coroutines, 64-byte values):
#: the first get of an iteration going alone as well, as with the former threshold of 2
#: and a rule that let it, made two requests per node and iteration and grew the pools;
#: at 4 nodes the average sat on that threshold and flipped between both ways (the
#: issue's 4-node hole, docs/benchmarks.rst).
COMPANY = 1.5


class Gets:
    """One loop's pending gets for one node (touched from that loop's thread only).
    ``fetch`` sends one get request to the node and awaits what it makes of the reply."""

    def __init__(self, fetch: Callable[[wire.Op], Awaitable[Any]], node: str = "") -> None:
        self.fetch = fetch
        self.node = node
        self.waiting: list[tuple[list[bytes] | bytes, asyncio.Future]] = []
        self.loop = asyncio.get_running_loop()  # one loop's (``aio.LoopState``)
        self.fetches: set[asyncio.Task] = set()  # running: kept referenced until done
        self.flushes = 0  # requests sent, for metrics and tests
        #: Callers per request, a moving average: whether batching pays on this node
        #: (``batch_for``). It starts as if batches served one caller each: a loop's
        #: first gets go alone until a request in flight gathers company.
        self.company = 1.0

    def get(self, keys: list[bytes] | bytes) -> asyncio.Future:
        """A future of ``{key: (data, flags)}`` for the ``keys`` found; for one key given
        as bytes (a single-key get), of its ``(data, flags)`` or None (no dict made)."""
        loop = self.loop
        future = loop.create_future()
        if not self.waiting:
            # The request's task takes its first step next iteration, after every
            # coroutine ready in this one has asked: one loop iteration's wait (a
            # callback that made the task would make it two).
            task = loop.create_task(self._fetch())
            self.fetches.add(task)
            task.add_done_callback(self.fetches.discard)
        self.waiting.append((keys, future))
        return future

    async def _fetch(self) -> None:
        """The iteration's request: every waiting caller's keys, then each one's share."""
        waiting, self.waiting = self.waiting, []
        self.flushes += 1
        self.company += (len(waiting) - self.company) / 8
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
    """With AUTOBATCH, the running loop's batch of gets for ``node`` to join: when gets
    are waiting, when the node's requests lately served company enough (``COMPANY``), or
    when a request is in flight to the node. None: go alone (a lone call pays no batching
    detour)."""
    if not node.pool.settings.autobatch:
        return None
    # The node remembers the last loop's batch (``Node.loop_gets``, a weak reference: each
    # Gets holds its loop), so the loop's state is looked up only when another loop asks.
    remembered = node.loop_gets
    gets = remembered() if remembered is not None else None
    if gets is None or gets.loop is not asyncio.get_running_loop():
        gets = gets_of(node)
        node.loop_gets = weakref.ref(gets)
    if gets.waiting or gets.company >= COMPANY:
        return gets
    pool = aio.loop_state().pools.get(node)
    if pool is None or pool.size <= len(pool.idle):
        return None  # nothing going on with the node
    return gets


def gets_of(node: Any) -> Gets:
    """The running loop's batch of gets for ``node``, made on first use."""
    return _gets_in(aio.loop_state(), node)


def _gets_in(state: Any, node: Any) -> Gets:
    gets = state.gets.get(node)
    if gets is None:
        gets = state.gets[node] = Gets(node.gets_to_fetch, node.name)
    return gets
