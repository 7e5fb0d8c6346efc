"""Multi-key operations on many nodes: a batch per node, every request sent before any
reply is read.

Each node gets one pipelined request (``get k1 k2 …``, or a run of ``set``/``delete``
commands) on a pooled connection; only when all of them are on the wire are the replies
read, so the nodes work in parallel and a call costs one round trip per node, all at the
same time, whatever the number of keys. The exchange (``exchange``) does it for both
drivers: :func:`run` on blocking sockets, :func:`arun` on the running loop, where a
node's share of a get may also join the gets other coroutines are sending it
(``autobatch``).
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from django_kvcache import steps
from django_kvcache.memcached import MemcachedError, autobatch, wire
from django_kvcache.memcached.exchange import ASYNCIO, BLOCKING, Batch, exchange

__all__ = ["Batch", "arun", "delete_batch", "flush_batch", "get_batch", "run", "set_batch"]


def run(batches: Sequence[Batch]) -> None:
    """Every batch on blocking sockets; fills ``result``/``error``."""
    steps.run(exchange(batches, BLOCKING))


async def arun(batches: Sequence[Batch]) -> None:
    """``run`` on the event loop. With AUTOBATCH, a get batch for a node this loop is
    already busy with joins that node's pending gets instead of a request of its own."""
    direct: list[Batch] = []
    joined: list[tuple[Batch, asyncio.Future]] = []
    for batch in batches:
        gets = autobatch.batch_for(batch.node) if batch.gets is not None else None
        if gets is None:
            direct.append(batch)
        else:
            batch.node.ops += batch.ops
            joined.append((batch, gets.get(batch.gets)))
    try:
        await steps.arun(exchange(direct, ASYNCIO))
        for batch, share in joined:
            try:
                batch.result = await share
            except MemcachedError as exc:
                batch.error = exc
                continue
            batch.node.bytes_received += sum(len(data) for data, _ in batch.result.values())
            if batch.on_result is not None:
                batch.on_result(batch.result)
    except BaseException:  # cancelled: drop our other shares too (nobody would read them)
        for _, share in joined:
            share.cancel()
        raise


# --- the batches ----------------------------------------------------------------------


def get_batch(node: Any, keys: list[str]) -> Batch:
    """``result``: ``{key bytes: (data, flags)}`` for the keys found."""

    def count(found: dict) -> None:
        node.hits += len(found)
        node.misses += len(keys) - len(found)

    encoded = [key.encode() for key in keys]
    op = wire.get_many(encoded)
    return Batch(node, op, keys, ops=len(keys), sent=len(op.request), count_received=True,
                 on_result=count, gets=encoded)


def set_batch(
    node: Any, keys: list[str], encoded: list[tuple[bytes, int]], expire: int, saved: int
) -> Batch:
    """``result``: one reply line per key (``STORED`` or the server's refusal). ``saved``:
    the bytes compression saved, credited to the node once it answered."""
    items = [(key.encode(), data, flags) for key, (data, flags) in zip(keys, encoded)]
    op = wire.store_many(items, expire)
    return Batch(node, op, keys, ops=len(keys), sent=len(op.request), saved=saved,
                 count_received=True)


def delete_batch(node: Any, keys: list[str]) -> Batch:
    """``result``: one reply line per key (``DELETED`` or ``NOT_FOUND``)."""
    op = wire.delete_many(key.encode() for key in keys)
    return Batch(node, op, keys, ops=len(keys), sent=len(op.request), count_received=True)


def flush_batch(node: Any) -> Batch:
    op = wire.flush_all()
    return Batch(node, op, ops=0, sent=len(op.request), count_received=True)
