"""One memcached server as the backend sees it: address, pool, health and counters.

Every exchange with the server — a single-key call or a node's share of a fan-out —
holds its connection through a :class:`Lease`, the one place that decides what becomes
of it: checked in after a success, kept open as a late write after a write timed out,
discarded after anything else (including ``KeyboardInterrupt``). The node's counters
(``ops``, ``hits``, ``bytes_sent``…) are bumped here and in ``fanout``, never above.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheUnexpectedCloseError, MemcacheUnknownError

from django_kvcache.memcached import NodeDown, NodeError
from django_kvcache.memcached import protocol
from django_kvcache.health import NodeHealth
from django_kvcache.memcached.pool import NodePool
from django_kvcache.memcached.protocol import ProtocolError, ReplyReader, WriteTimeout, connected
from django_kvcache.memcached.routing import NodeAddress
from django_kvcache.memcached.stale import LateWrites, OutdatedCopies

#: Errors that mean the node (or the path to it) failed, not the request.
NODE_FAILURES = (OSError, MemcacheUnexpectedCloseError, MemcacheUnknownError, ProtocolError)
#: Errors a pooled connection shows when the server restarted since its last use.
STALE_CONNECTION = (ConnectionError, MemcacheUnexpectedCloseError)

COUNTERS = (
    "ops", "hits", "misses", "errors", "timeouts", "ignored",
    "bytes_sent", "bytes_received", "bytes_saved",
)


class Node:
    """Counters are plain ints: cheap, and exact enough under the GIL for monitoring."""

    def __init__(self, address: NodeAddress, pool: NodePool, health: NodeHealth) -> None:
        self.name = address.name
        self.pool = pool
        self.health = health
        self.outdated = OutdatedCopies()
        self.late = LateWrites()
        self.ops = self.hits = self.misses = self.errors = self.timeouts = self.ignored = 0
        self.bytes_sent = self.bytes_received = self.bytes_saved = 0

    def __repr__(self) -> str:
        return f"<memcached node {self.name}>"

    def call(
        self, command: Callable[..., Any], *args: Any, retry: bool = True,
        sent: int = 0, saved: int = 0,
    ) -> Any:
        """``command(client, *args)`` on a pooled connection, counted as one operation.

        A connection that broke while it sat in the pool (server restarted) is replaced
        and the command retried once, unless ``retry`` is off (``incr``/``decr``).
        ``sent`` and ``saved`` are credited to ``bytes_sent``/``bytes_saved`` on success.
        """
        self.ops += 1
        while True:
            with Lease(self, self.pool.checkout()) as lease:
                try:
                    self.ready(lease.client)
                    result = command(lease.client, *args)
                except NODE_FAILURES as exc:
                    error = lease.fail(exc, retry)
                    if error is not None:
                        raise error from exc
                    retry = False
                    continue
            self.bytes_sent += sent
            self.bytes_saved += saved
            return result

    def get(self, key: str) -> tuple[bytes, int] | None:
        """``get`` of one key: ``(data, flags)`` or None, counted as a hit or a miss."""
        found = self.call(protocol.get_one, key)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
            self.bytes_received += len(found[0])
        return found

    # --- before the node serves again ---------------------------------------------------

    def ready(self, client: Client) -> None:
        """Settle late writes and delete outdated copies first, if any (two bool reads)."""
        if self.late.pending or self.outdated.pending:
            self.repair(client)

    def repair(self, client: Client) -> None:
        """Let every write that may still land land, then clean up (on ``client``).

        One thread at a time: another must not clean up while writes that this one took
        to settle can still land after its clean-up.
        """
        with self.late.repairing:
            self.settle()
            if self.outdated.pending:
                self.clean(client)

    def settle(self) -> None:
        """Finish every timed-out write: its unsent rest and a fence, then the fence's
        reply. A timeout means the node still does not serve: the request fails and the
        clean-up waits. A closed or reset connection can apply nothing more: settled."""
        late = self.late.take()
        try:
            while late:
                sock, unsent = late[-1]
                try:
                    protocol.send_write(sock, unsent + protocol.FENCE)
                    late[-1] = (sock, b"")  # all sent: a retry only reads
                    protocol.read_to_fence(sock)
                except WriteTimeout as exc:  # not the caller's write: a plain timeout
                    late[-1] = (sock, exc.unsent)
                    raise TimeoutError("a late write is still not settled") from exc
                except protocol.TIMEOUTS:
                    raise
                except NODE_FAILURES:
                    pass
                late.pop()
                sock.close()
        finally:
            if late:
                self.late.put_back(late)

    def clean(self, client: Client) -> None:
        """Delete this node's outdated copies (see ``stale``) before it serves again."""
        keys, flush = self.outdated.take()
        try:
            request, replies = OutdatedCopies.request(keys, flush)
            sock = connected(client)
            protocol.send_write(sock, request)
            reader = ReplyReader(sock)
            protocol.read_write_replies(reader, lambda _: protocol.read_lines(reader, replies))
        except BaseException:
            self.outdated.put_back(keys, flush)
            raise

    # --- failures and observability ----------------------------------------------------

    def skipped(self) -> NodeDown:
        """The error of a request not sent because the node is marked down (counted)."""
        self.errors += 1
        retry_in = max(0.0, self.health.down_until - time.monotonic())
        return NodeDown(
            self.name,
            f"marked down after {self.health.failures} consecutive failures; "
            f"next try in {retry_in:.1f} s (RETRY_TIMEOUT)",
        )

    def failure(self, exc: BaseException) -> NodeError:
        """Count a failed exchange and tell the health record; the error to raise."""
        self.errors += 1
        if isinstance(exc, protocol.TIMEOUTS):  # Python's or the kernel's
            self.timeouts += 1
            reason = f"timed out ({type(exc).__name__}: {exc})"
        else:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.health.failed(reason)
        return NodeError(self.name, reason)

    def metrics(self) -> dict[str, Any]:
        counters = {name: getattr(self, name) for name in COUNTERS}
        pool = self.pool
        counters.update(
            pool_size=pool.size,
            pool_idle=len(pool.idle),
            pool_waits=pool.waits,
            pool_connects=pool.connects,
            down=self.health.down,
            consecutive_failures=self.health.failures,
            outdated_keys=len(self.outdated.keys),
            flush_pending=self.outdated.flush,
            late_writes=len(self.late.connections),
        )
        return counters


class Lease:
    """One connection checked out of a node's pool, until it is checked in or dropped.

    As a context manager: on leaving without an exception the connection is checked in
    (and the node counts as answering), with one it is dropped — unless ``fail`` or
    ``release`` already ended the lease.
    """

    __slots__ = ("node", "client", "reused")

    def __init__(self, node: Node, client: Client) -> None:
        self.node = node
        self.client: Client | None = client
        self.reused = client.sock is not None  # a pooled connection that may have gone stale

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self.client is not None:
            if exc is None:
                self.release()
            else:
                self.drop(exc)

    def release(self) -> None:
        """The exchange succeeded: back to the pool."""
        client, self.client = self.client, None
        assert client is not None
        self.node.pool.checkin(client)
        if self.node.health.failures:
            self.node.health.succeeded()

    def drop(self, exc: BaseException) -> None:
        """The exchange failed: keep a timed-out write's socket to settle, close the rest."""
        client, self.client = self.client, None
        assert client is not None
        pool = self.node.pool
        if isinstance(exc, WriteTimeout):
            self.node.late.add(exc.sock, exc.unsent)
            pool.free_slot()  # the client object is dropped; its socket lives on in ``late``
        else:
            pool.discard(client)

    def fail(self, exc: BaseException, retry: bool) -> NodeError | None:
        """Drop the connection after a node failure; the error to report, or None when
        it was a pooled connection gone stale and one retry on a new one is due."""
        self.drop(exc)
        if retry and self.reused and isinstance(exc, STALE_CONNECTION):
            self.node.pool.close_idle()  # its neighbours in the pool are just as stale
            return None
        return self.node.failure(exc)

