"""Multi-key operations on many nodes: every request is sent before any reply is read.

Each node gets one pipelined request (``get k1 k2 …``, or a run of ``set``/``delete``
commands) on a pooled connection. Only when all of them are on the wire do we read the
replies, so the nodes work in parallel and a call costs one round trip per node, all
at the same time, whatever the number of keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from django_kvcache.memcached import MemcachedError
from django_kvcache.memcached import protocol
from django_kvcache.memcached.node import NODE_FAILURES, Lease, Node
from django_kvcache.memcached.protocol import ReplyReader, connected


@dataclass
class Batch:
    """One node's share of a multi-key call."""

    node: Node
    keys: list[str]
    request: bytes
    read: Callable[[ReplyReader], Any]
    writes: bool  # a timed-out write may still land: its connection is settled, not closed
    result: Any = None
    error: MemcachedError | None = None
    _lease: Lease | None = field(default=None, repr=False)


def run(batches: Sequence[Batch]) -> None:
    """Send every batch's request, then read every reply; fills ``result``/``error``.

    A thread never waits for one node's connection while holding another's (two threads
    could each hold what the other waits for): batches whose pool is busy go in a later
    round, and a round where every pool is busy waits for a single pool only.
    """
    for batch in batches:
        batch.node.ops += len(batch.keys)  # once per call, whatever is retried
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
        error = lease.fail(exc, retry)
        if error is None:
            stale.append(batch)
        else:
            batch.error = error
        return False


def _send(batch: Batch, client: Any) -> None:
    node = batch.node
    node.ready(client)
    sock = connected(client)
    if batch.writes:
        protocol.send_write(sock, batch.request)
    else:
        sock.sendall(batch.request)
    node.bytes_sent += len(batch.request)


def _receive(batch: Batch, client: Any) -> None:
    reader = ReplyReader(client.sock)
    try:
        if batch.writes:
            batch.result = protocol.read_write_replies(reader, batch.read)
        else:
            batch.result = batch.read(reader)
    finally:
        batch.node.bytes_received += reader.received


# --- the batches ----------------------------------------------------------------------


def get_batch(node: Node, keys: list[str]) -> Batch:
    """``result``: ``{key bytes: (data, flags)}`` for the keys found."""
    ends = protocol.get_lines(len(keys))

    def read(reader: ReplyReader) -> dict[bytes, tuple[bytes, int]]:
        found = protocol.read_values(reader, ends)
        node.hits += len(found)
        node.misses += len(keys) - len(found)
        return found

    return Batch(node, keys, protocol.get_request([key.encode() for key in keys]), read, False)


def set_batch(
    node: Node, keys: list[str], encoded: list[tuple[bytes, int]], expire: int, saved: int
) -> Batch:
    """``result``: one reply line per key (``STORED`` or the server's error). ``saved``:
    the bytes compression saved, credited to the node once it answered."""
    command = protocol.store_command
    request = b"".join(
        command(b"set", key.encode(), data, flags, expire)
        for key, (data, flags) in zip(keys, encoded)
    )

    def read(reader: ReplyReader) -> list[bytes]:
        lines = protocol.read_lines(reader, len(keys))
        node.bytes_saved += saved
        return lines

    return Batch(node, keys, request, read, True)


def delete_batch(node: Node, keys: list[str]) -> Batch:
    """``result``: one reply line per key (``DELETED`` or ``NOT_FOUND``)."""
    request = b"".join(b"delete %b\r\n" % key.encode() for key in keys)
    return Batch(node, keys, request, _status_lines(len(keys)), True)


def flush_batch(node: Node) -> Batch:
    return Batch(node, [], b"flush_all\r\n", _status_lines(1), True)


def _status_lines(count: int) -> Callable[[ReplyReader], list[bytes]]:
    return lambda reader: protocol.read_lines(reader, count)
