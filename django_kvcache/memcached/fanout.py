"""The batches of multi-key operations: one per node, every request sent before any
reply is read.

Each node gets one pipelined request (``get k1 k2 …``, or a run of ``set``/``delete``
commands) on a pooled connection; only when all of them are on the wire are the replies
read, so the nodes work in parallel and a call costs one round trip per node, all at the
same time, whatever the number of keys. The exchange does that, for both drivers
(``yield from exchange.fan_out(batches, io)``); where the event loop is already busy
with a node, its share of a get may also join the gets other coroutines are sending it
(``autobatch``).
"""
from __future__ import annotations

from typing import Any

from django_kvcache.memcached import wire
from django_kvcache.memcached.exchange import Batch

__all__ = ["Batch", "delete_batch", "flush_batch", "get_batch", "store_batch"]


# --- the batches ----------------------------------------------------------------------


def get_batch(node: Any, keys: list[str]) -> Batch:
    """``result``: ``{key bytes: (data, flags)}`` for the keys found."""

    def count(found: dict) -> None:
        node.hits += len(found)
        node.misses += len(keys) - len(found)

    encoded = [key.encode() for key in keys]
    batch = _many(node, keys, wire.get_many(encoded))
    batch.on_result = count
    batch.gets = encoded
    return batch


def get_each_batch(node: Any, keys: list[str]) -> Batch:
    """The keys of a multi-key get that the node could not serve whole (a proxy answers
    ``SERVER_ERROR`` for all of it when one of its servers is down), a ``get`` per key in
    one request. ``result``: ``({key bytes: (data, flags)}, [key bytes not served])``.
    Counted with the get it retries: no operation of its own."""

    def count(result: tuple[dict, list]) -> None:
        found, failed = result
        node.hits += len(found)
        node.misses += len(keys) - len(found) - len(failed)

    batch = _many(node, keys, wire.get_each([key.encode() for key in keys]))
    batch.ops = 0
    batch.on_result = count
    return batch


def store_batch(
    node: Any, name: bytes, keys: list[str], encoded: list[tuple[bytes, int]], expire: int,
    saved: int, deletes: list[str] | None = None,
) -> Batch:
    """``set`` (``add``) of ``keys``' encoded values, then ``delete`` of ``deletes`` (side
    keys: stale copies) in the same request. ``result``: one reply line per command, the
    stores' first (``STORED``, ``NOT_STORED`` or the server's refusal). ``saved``: the
    bytes compression saved, credited to the node once it answered."""
    items = [(key.encode(), data, flags) for key, (data, flags) in zip(keys, encoded)]
    side = deletes or []
    batch = _many(node, keys, wire.store_many(items, expire, name,
                                              [key.encode() for key in side]))
    batch.saved = saved
    batch.side_keys = side
    return batch


def delete_batch(node: Any, keys: list[str], side: list[str] | None = None) -> Batch:
    """``delete`` of ``keys``, then of ``side`` (side keys: stale copies, not counted as
    operations). ``result``: one reply line per key (``DELETED`` or ``NOT_FOUND``)."""
    batch = _many(node, keys, wire.delete_many(key.encode() for key in [*keys, *(side or ())]))
    batch.side_keys = side or []
    return batch


def flush_batch(node: Any) -> Batch:
    return _many(node, [], wire.flush_all())


def _many(node: Any, keys: list[str], op: wire.Op) -> Batch:
    """A node's share of a multi-key call: counted as an operation per key, credited
    with the whole request and reply."""
    batch = Batch(node, op, len(op.request))
    batch.keys = keys
    batch.ops = len(keys)
    batch.count_received = True
    return batch
