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
    """Base class of the errors the memcached backend raises; ``node`` names the server."""

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(f"memcached node {node}: {reason}")
        self.node = node
        self.reason = reason


class NodeError(MemcachedError):
    """A node did not answer: connection refused or reset, timeout, garbled reply."""


class NodeDown(NodeError):
    """The node failed too often and is skipped until its retry time has passed."""


class NodeBusy(NodeError):
    """The node is being repaired (writes cut short settled, outdated copies deleted) by
    another caller, and this call cannot wait for it: the repair is a coroutine of this
    very thread (a sync call made on the event loop's thread), or it did not end within
    IO_TIMEOUT. Not the node's failure: it is not counted."""


class PoolExhausted(MemcachedError):
    """Every pooled connection of a node stayed busy for POOL_TIMEOUT seconds."""


class Refused(MemcachedError):
    """The server refused one request (``SERVER_ERROR``/``CLIENT_ERROR``: too large, out
    of memory, not a number); the node and the connection are fine."""

    def __init__(self, node: str, reason: str, client_error: bool = False) -> None:
        super().__init__(node, reason)
        self.client_error = client_error


class ValueTooLarge(MemcachedError):
    """The server refused to store a value (over its item size even after compression).

    No call raises it any more: a refused value is logged and fails no page (docs,
    "Values a backend refuses"). Kept so that code catching it still imports."""
