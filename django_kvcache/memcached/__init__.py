"""Building blocks of :class:`django_kvcache.backends.memcached.MemcachedCache`.

``wire`` is the protocol, sans IO: request encoders and incremental reply parsers.
``exchange`` is every request's life, sans IO too: one state machine that decides what
is sent, which deadline applies and what a reply, an error, a timeout or a cancellation
does to the connection and the node — for both drivers, which only move bytes:
``connection`` on blocking sockets (``pool`` keeps them), ``aio`` on asyncio connections
(one pool per event loop; ``autobatch`` merges one loop's gets). ``routing`` parses
LOCATION and places keys on nodes (with the shared :mod:`django_kvcache.routing`), the
shared :mod:`django_kvcache.health` tracks which nodes answer, ``stale`` what a node
missed or may still apply late, ``node`` is one server's state and counters, ``fanout``
builds the per-node batches of multi-key calls, ``cluster`` reads OPTIONS and places
keys (with the failure policy), ``plans`` writes each cache operation once for both the
sync and the async API, and ``lease`` is ``get_or_set``'s herd protection on the meta
commands.
"""
from __future__ import annotations


class MemcachedError(Exception):
    """Base class of the errors the memcached backend raises; ``node`` names the server,
    and once the backend has it in hand (:meth:`of_cache`), ``cache`` the cache.
    ``problem``: what went wrong in a word or two, for an operator's table
    (``kvcache_stats``): "refused", "timeout", "no answer"..."""

    problem = "error"

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(f"memcached node {node}: {reason}")
        self.node = node
        self.reason = reason
        self.cache: str | None = None

    def of_cache(self, cache: str) -> MemcachedError:
        """This error, its message naming the cache too (``memcached node h:p of
        CACHES['default']: ...``): nodes are shared by the caches of one process, and
        only the backend knows which cache the failed call was for."""
        if self.cache is None:
            self.cache = cache
            self.args = (f"memcached node {self.node} of {cache}: {self.reason}",)
        return self


class NodeError(MemcachedError):
    """A node did not answer: connection refused or reset, timeout, garbled reply
    (``problem`` says which: "refused", "timeout" or "failed")."""

    problem = "failed"


class NodeDown(NodeError):
    """The node failed too often and is skipped until its retry time has passed."""

    problem = "marked down"


class NodeBusy(NodeError):
    """The node is being repaired (writes cut short settled, outdated copies deleted) by
    another caller, and this call cannot wait for it: the repair is a coroutine of this
    very thread (a sync call made on the event loop's thread), or it did not end within
    IO_TIMEOUT. Not the node's failure: it is not counted."""


class ServerError(NodeError):
    """The server answered ``SERVER_ERROR`` for this request — a proxy does, for a key
    whose server it cannot reach (twemproxy: ``SERVER_ERROR Connection refused``): the
    request failed, but the node and the connection are fine, and it is not counted
    against the node's health."""


class Unsupported(MemcachedError, NotImplementedError):
    """The server, or a proxy in front of it, does not support a command the call needs:
    memcached before 1.6.6 has no meta commands; twemproxy forwards neither them nor
    ``flush_all``, ``stats`` or ``lru_crawler`` (it closes the connection on one). Raised
    whatever IGNORE_EXCEPTIONS says: it is no failure, and retrying cannot help."""

    problem = "unsupported"


class PoolExhausted(MemcachedError):
    """Every pooled connection of a node stayed busy for POOL_TIMEOUT seconds."""


class Refused(MemcachedError):
    """The server refused one request (``CLIENT_ERROR``: not a number, a bad command line;
    ``SERVER_ERROR`` for the value it carried: too large, out of memory); the node and
    the connection are fine."""

    def __init__(self, node: str, reason: str, client_error: bool = False) -> None:
        super().__init__(node, reason)
        self.client_error = client_error


class ValueTooLarge(MemcachedError):
    """The server refused to store a value (over its item size even after compression).

    No call raises it any more: a refused value is logged and fails no page (docs,
    "Values a backend refuses"). Kept so that code catching it still imports."""
