"""Multi-key operations on many nodes: every request is sent before any reply is read.

``run`` does it on blocking sockets, ``arun`` on the running event loop's connections;
both share the batches and what a failure does to them.

Each node gets one pipelined request (``get k1 k2 …``, or a run of ``set``/``delete``
commands) on a pooled connection. Only when all of them are on the wire do we read the
replies, so the nodes work in parallel and a call costs one round trip per node, all
at the same time, whatever the number of keys.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from django_kvcache.memcached import MemcachedError, aio, wire
from django_kvcache.memcached.node import NODE_FAILURES, Lease, Node


@dataclass
class Batch:
    """One node's share of a multi-key call: ``op`` on one of its connections.

    ``on_result`` bumps the node's counters once the reply is in (sync and async path).
    """

    node: Node
    keys: list[str]
    op: wire.Op
    on_result: Callable[[Any], None] | None = None
    gets: list[bytes] | None = None  # a get's keys: AUTOBATCH may merge it with others
    result: Any = None
    error: MemcachedError | None = None
    _lease: Lease | None = field(default=None, repr=False)
    _reply: Any = field(default=None, repr=False)

    def sending(self) -> bytes:
        """The request, with a fresh parser for its reply (an attempt starts here)."""
        self._reply = self.op.make_reply()
        self.node.bytes_sent += len(self.op.request)
        return self.op.request

    def received(self) -> None:
        """The reply parsed: the result, and the node's counters."""
        self.result = self.op.result(self._reply)
        self._reply = None
        if self.on_result is not None:
            self.on_result(self.result)


def count_ops(batches: Sequence[Batch]) -> None:
    for batch in batches:
        batch.node.ops += len(batch.keys)  # once per call, whatever is retried


def run(batches: Sequence[Batch]) -> None:
    """Send every batch's request, then read every reply; fills ``result``/``error``.

    A thread never waits for one node's connection while holding another's (two threads
    could each hold what the other waits for): batches whose pool is busy go in a later
    round, and a round where every pool is busy waits for a single pool only.
    """
    count_ops(batches)
    _run(batches, retry=True)


def _run(batches: Sequence[Batch], retry: bool) -> None:
    pending = list(batches)
    stale: list[Batch] = []
    try:
        while pending:
            claimed = [batch for batch in pending if _claim(batch, wait=False)]
            if not claimed and _claim(pending[0], wait=True):
                claimed = [pending[0]]
            pending = [b for b in pending if b._lease is None and b.error is None]
            stale += _exchange(claimed, retry)
    except BaseException as exc:
        # Interrupted (even by KeyboardInterrupt): no connection stays checked out.
        for batch in batches:
            lease, batch._lease = batch._lease, None
            if lease is not None:
                lease.drop(exc)
        raise
    if stale:
        _run(stale, retry=False)


def _claim(batch: Batch, wait: bool) -> bool:
    pool = batch.node.pool
    try:
        client = pool.checkout() if wait else pool.try_checkout()
    except MemcachedError as exc:
        batch.error = exc
        return False
    if client is None:
        return False
    batch._lease = Lease(batch.node, client)
    return True


def _exchange(batches: list[Batch], retry: bool) -> list[Batch]:
    """Send every request, then read every reply; the batches worth a retry."""
    stale: list[Batch] = []
    sent = [batch for batch in batches if _step(batch, _send, retry, stale)]
    for batch in sent:
        if _step(batch, _receive, retry, stale):
            lease, batch._lease = batch._lease, None
            assert lease is not None
            lease.release()
    return stale


def _step(
    batch: Batch, step: Callable[[Batch, Any], None], retry: bool, stale: list[Batch]
) -> bool:
    """One half of a batch's exchange; on a node failure its lease ends here."""
    lease = batch._lease
    assert lease is not None and lease.client is not None
    try:
        step(batch, lease.client)
        return True
    except NODE_FAILURES as exc:
        batch._lease = None
        failed(batch, lease, exc, retry, stale)
        return False


def failed(batch: Batch, lease: Lease, exc: BaseException, retry: bool, stale: list[Batch]) -> None:
    """A node failure in a batch's exchange: the lease ends, and the batch is either due
    for one retry on a new connection (``stale``) or fails with the node's error."""
    error = lease.fail(exc, retry)
    if error is None:
        stale.append(batch)
    else:
        batch.error = error


def _send(batch: Batch, client: Any) -> None:
    batch.node.ready(client)
    client.send(batch.sending(), batch.op.writes)


def _receive(batch: Batch, client: Any) -> None:
    before = client.received
    try:
        client.read(batch._reply, batch.op.writes)
    finally:
        batch.node.bytes_received += client.received - before
    batch.received()


# --- the same on an event loop ------------------------------------------------------


async def arun(batches: Sequence[Batch]) -> None:
    """``run`` on the event loop: every node's request written, then every reply read —
    all nodes at once (their replies arrive meanwhile, parsed as they come). A stale
    pooled connection is retried once on a new one, as on the blocking path.

    As there, a call never waits for one node's connection while holding another's:
    batches whose pool is busy go in a later round, and a round where every pool is busy
    waits for a single pool only.
    """
    count_ops(batches)
    direct: list[Batch] = []
    batched: list[Batch] = []
    waits: list[asyncio.Future] = []
    for batch in batches:
        joined = aio.batch_for(batch.node) if batch.gets is not None else None
        if joined is None:
            direct.append(batch)
        else:
            batched.append(batch)
            waits.append(joined.get(batch.gets))  # type: ignore[arg-type]
    try:
        stale = await _arounds(direct, retry=True)
        if stale:
            await _arounds(stale, retry=False)
    except BaseException:  # cancelled (or worse) first: drop the shares that joined too
        for wait in waits:
            wait.cancel()
        raise
    if batched:
        await _batched(batched, waits)


async def _batched(batches: list[Batch], waits: list[asyncio.Future]) -> None:
    """The results of the batches that went out with other gets (``autobatch``)."""
    try:
        for batch, wait in zip(batches, waits):
            try:
                batch.result = await wait
            except MemcachedError as exc:
                batch.error = exc
                continue
            batch.node.bytes_received += sum(len(data) for data, _ in batch.result.values())
            if batch.on_result is not None:
                batch.on_result(batch.result)
    except BaseException:  # cancelled: drop our other shares too (nobody would read them)
        for wait in waits:
            wait.cancel()
        raise


async def _arounds(batches: Sequence[Batch], retry: bool) -> list[Batch]:
    pools = {batch.node: aio.pool_of(batch.node) for batch in batches}
    pending = list(batches)
    stale: list[Batch] = []
    while pending:
        claimed = []
        for batch in pending:
            connection = pools[batch.node].try_checkout()
            if connection is not None:
                claimed.append((batch, Lease(batch.node, connection, pools[batch.node])))
        if not claimed:
            first = pending[0]
            try:
                connection = await pools[first.node].checkout()
            except MemcachedError as exc:
                first.error = exc
            else:
                claimed.append((first, Lease(first.node, connection, pools[first.node])))
        done = {id(batch) for batch, _ in claimed}
        pending = [b for b in pending if id(b) not in done and b.error is None]
        stale += await _aexchange(claimed, retry)
    return stale


async def _aexchange(claimed: list[tuple[Batch, Lease]], retry: bool) -> list[Batch]:
    """Send every request, then read every reply; the batches worth a retry."""
    stale: list[Batch] = []
    try:
        sent = [
            (batch, lease) for batch, lease in claimed
            if await _astep(batch, lease, _asend(batch, lease), retry, stale)
        ]
        since = asyncio.get_running_loop().time()  # every request is out: one shared wait
        for batch, lease in sent:
            if await _astep(batch, lease, _areceive(batch, lease, since), retry, stale):
                lease.release()
    except BaseException as exc:  # cancelled or interrupted: no connection stays out
        for _, lease in claimed:
            if lease.client is not None:
                lease.drop(exc)
        raise
    return stale


async def _astep(batch: Batch, lease: Lease, step: Any, retry: bool, stale: list[Batch]) -> bool:
    """One half of a batch's exchange; on a node failure its lease ends here."""
    try:
        await step
        return True
    except NODE_FAILURES as exc:
        failed(batch, lease, exc, retry, stale)
        return False


async def _asend(batch: Batch, lease: Lease) -> None:
    node = batch.node
    if node.late.pending or node.outdated.pending:
        await node.arepair(lease.client)
    await lease.client.send(batch.sending(), batch.op.writes)


async def _areceive(batch: Batch, lease: Lease, since: float) -> None:
    connection = lease.client
    before = connection.received
    try:
        await connection.read(batch._reply, batch.op.writes, since)
    finally:
        batch.node.bytes_received += connection.received - before
    batch.received()


# --- the batches ----------------------------------------------------------------------


def get_batch(node: Node, keys: list[str]) -> Batch:
    """``result``: ``{key bytes: (data, flags)}`` for the keys found."""

    def count(found: dict) -> None:
        node.hits += len(found)
        node.misses += len(keys) - len(found)

    encoded = [key.encode() for key in keys]
    return Batch(node, keys, wire.get_many(encoded), count, gets=encoded)


def set_batch(
    node: Node, keys: list[str], encoded: list[tuple[bytes, int]], expire: int, saved: int
) -> Batch:
    """``result``: one reply line per key (``STORED`` or the server's error). ``saved``:
    the bytes compression saved, credited to the node once it answered."""
    items = [(key.encode(), data, flags) for key, (data, flags) in zip(keys, encoded)]

    def count(lines: list) -> None:
        node.bytes_saved += saved

    return Batch(node, keys, wire.store_many(items, expire), count)


def delete_batch(node: Node, keys: list[str]) -> Batch:
    """``result``: one reply line per key (``DELETED`` or ``NOT_FOUND``)."""
    return Batch(node, keys, wire.delete_many(key.encode() for key in keys))


def flush_batch(node: Node) -> Batch:
    return Batch(node, [], wire.flush_all())
