"""Multi-key operations on many nodes: every request is sent before any reply is read.

Each node gets one pipelined request (``get k1 k2 …``, or a run of ``set``/``delete``
commands) on a pooled connection. Only when all of them are on the wire do we read the
replies, so the nodes work in parallel and a call costs one round trip per node, all
at the same time, whatever the number of keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pymemcache.client.base import Client

from django_kvcache.memcached import MemcachedError
from django_kvcache.memcached import protocol
from django_kvcache.memcached.node import NODE_FAILURES, STALE_CONNECTION, Node
from django_kvcache.memcached.protocol import ReplyReader, connected


@dataclass
class Batch:
    """One node's share of a multi-key call."""

    node: Node
    keys: list[str]
    request: bytes
    read: Callable[[ReplyReader], Any]
    result: Any = None
    error: MemcachedError | None = None
    _client: Client | None = field(default=None, repr=False)
    _reused: bool = field(default=False, repr=False)


def run(batches: Sequence[Batch], retry: bool = True) -> None:
    """Send every batch's request, then read every reply; fills ``result``/``error``.

    A thread never waits for one node's connection while holding another's (two threads
    could each hold what the other waits for): batches whose pool is busy go in a later
    round, and a round where every pool is busy waits for a single pool only.
    """
    pending = list(batches)
    while pending:
        claimed = [batch for batch in pending if _claim(batch, wait=False)]
        if not claimed:
            claimed = [pending[0]] if _claim(pending[0], wait=True) else []
        pending = [b for b in pending if b._client is None and b.error is None]
        _exchange(claimed, retry)


def _claim(batch: Batch, wait: bool) -> bool:
    pool = batch.node.pool
    try:
        client = pool.checkout() if wait else pool.try_checkout()
    except MemcachedError as exc:
        batch.error = exc
        return False
    if client is None:
        return False
    batch._client, batch._reused = client, client.sock is not None
    return True


def _exchange(batches: list[Batch], retry: bool) -> None:
    sent: list[Batch] = []
    stale: list[Batch] = []
    for batch in batches:
        if _send(batch, retry):
            sent.append(batch)
        elif batch.error is None:
            stale.append(batch)
    try:
        for batch in sent:
            if not _receive(batch, retry) and batch.error is None:
                stale.append(batch)
    finally:
        for batch in sent:  # interrupted: replies left unread make a connection useless
            if batch._client is not None:
                batch.node.pool.discard(batch._client)
                batch._client = None
    if stale:
        run(stale, retry=False)


def _send(batch: Batch, retry: bool) -> bool:
    """Send one request. False with no error: a stale pooled connection, worth a retry."""
    node, client = batch.node, batch._client
    assert client is not None
    node.ops += len(batch.keys)
    try:
        if node.outdated.pending:
            node.clean(client)
        connected(client).sendall(batch.request)
    except NODE_FAILURES as exc:
        return _drop_connection(batch, client, exc, retry)
    node.bytes_sent += len(batch.request)
    return True


def _drop_connection(batch: Batch, client: Any, exc: BaseException, retry: bool) -> bool:
    """Discard the connection that failed; the node's failure counts unless a retry is due."""
    batch._client = None
    batch.node.pool.discard(client)
    if not _stale(batch, exc, retry):
        batch.error = batch.node.failure(exc)
    return False


def _receive(batch: Batch, retry: bool) -> bool:
    """Read one reply. False with no error: a stale pooled connection, worth a retry."""
    node, client = batch.node, batch._client
    assert client is not None
    reader = ReplyReader(client.sock)  # type: ignore[arg-type]
    try:
        batch.result = batch.read(reader)
    except NODE_FAILURES as exc:
        return _drop_connection(batch, client, exc, retry)
    finally:
        node.bytes_received += reader.received
    batch._client = None
    node.pool.checkin(client)
    if node.health.failures:
        node.health.succeeded()
    return True


def _stale(batch: Batch, exc: BaseException, retry: bool) -> bool:
    """Whether ``exc`` is a pooled connection that went stale (server restarted)."""
    if retry and batch._reused and isinstance(exc, STALE_CONNECTION):
        batch.node.pool.close_idle()  # its neighbours in the pool are just as stale
        return True
    return False


# --- the batches ----------------------------------------------------------------------


def get_batch(node: Node, keys: list[str]) -> Batch:
    """``result``: ``{key bytes: (data, flags)}`` for the keys found."""
    ends = protocol.get_lines(len(keys))
    return Batch(
        node,
        keys,
        protocol.get_request([key.encode() for key in keys]),
        lambda reader: protocol.read_values(reader, ends),
    )


def set_batch(node: Node, keys: list[str], encoded: list[tuple[bytes, int]], expire: int) -> Batch:
    """``result``: one reply line per key (``STORED`` or the server's error)."""
    command = protocol.store_command
    request = b"".join(
        command(b"set", key.encode(), data, flags, expire)
        for key, (data, flags) in zip(keys, encoded)
    )
    count = len(keys)
    return Batch(node, keys, request, lambda reader: protocol.read_lines(reader, count))


def delete_batch(node: Node, keys: list[str]) -> Batch:
    """``result``: one reply line per key (``DELETED`` or ``NOT_FOUND``)."""
    request = b"".join(b"delete %b\r\n" % key.encode() for key in keys)
    count = len(keys)
    return Batch(node, keys, request, lambda reader: protocol.read_lines(reader, count))


def flush_batch(node: Node) -> Batch:
    return Batch(node, [], b"flush_all\r\n", lambda reader: protocol.read_lines(reader, 1))
