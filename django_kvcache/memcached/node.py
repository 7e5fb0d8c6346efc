"""One memcached server as the backend sees it: address, pool, health and counters."""
from __future__ import annotations

import socket
from typing import Any, Callable

from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheUnexpectedCloseError, MemcacheUnknownError

from django_kvcache.memcached import NodeError
from django_kvcache.memcached.health import NodeHealth
from django_kvcache.memcached.pool import NodePool
from django_kvcache.memcached.protocol import ProtocolError, ReplyReader, connected, read_lines
from django_kvcache.memcached.routing import NodeAddress
from django_kvcache.memcached.stale import OutdatedCopies

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
        self.address = address
        self.pool = pool
        self.health = health
        self.outdated = OutdatedCopies()
        self.ops = self.hits = self.misses = self.errors = self.timeouts = self.ignored = 0
        self.bytes_sent = self.bytes_received = self.bytes_saved = 0

    def __repr__(self) -> str:
        return f"<memcached node {self.name}>"

    def call(self, command: Callable[..., Any], *args: Any, retry: bool = True) -> Any:
        """``command(client, *args)`` on a pooled connection.

        A connection that broke while it sat in the pool (server restarted) is replaced
        and the command retried once, unless ``retry`` is off (``incr``/``decr``).
        """
        self.ops += 1
        pool = self.pool
        client = pool.checkout()
        reused = client.sock is not None
        try:
            if self.outdated.pending:
                self.clean(client)
            result = command(client, *args)
        except NODE_FAILURES as exc:
            pool.discard(client)
            if retry and reused and isinstance(exc, STALE_CONNECTION):
                pool.close_idle()  # its neighbours in the pool are just as stale
                return self.call(command, *args, retry=False)
            raise self.failure(exc) from exc
        except Exception:
            # A refused command (value too large, not a number...): the reply may be half
            # read, so start the next user on a fresh socket (pymemcache reconnects lazily).
            client.close()
            pool.checkin(client)
            raise
        except BaseException:
            pool.discard(client)  # interrupted mid-reply: the stream is unusable
            raise
        pool.checkin(client)
        if self.health.failures:
            self.health.succeeded()
        return result

    def clean(self, client: Client) -> None:
        """Delete this node's outdated copies (see ``stale``) before it serves again."""
        keys, flush = self.outdated.take()
        try:
            request, replies = OutdatedCopies.request(keys, flush)
            connected(client).sendall(request)
            read_lines(ReplyReader(client.sock), replies)  # type: ignore[arg-type]
        except BaseException:
            self.outdated.put_back(keys, flush)
            raise

    def failure(self, exc: BaseException) -> NodeError:
        """Count a failed exchange and tell the health record; the error to raise."""
        self.errors += 1
        if isinstance(exc, (socket.timeout, BlockingIOError)):  # Python's or the kernel's
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
        )
        return counters

