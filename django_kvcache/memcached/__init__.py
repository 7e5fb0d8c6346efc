"""Building blocks of :class:`django_kvcache.backends.memcached.MemcachedCache`.

``routing`` parses LOCATION and places keys on nodes (with the shared
:mod:`django_kvcache.routing`), ``pool`` keeps connections, the shared
:mod:`django_kvcache.health` tracks which nodes answer, ``stale`` what a node missed or may still apply late, ``node`` ties them
together per server (and owns every connection's lifecycle), ``protocol`` speaks the
text protocol for the writes and batch paths and ``fanout`` runs batches on every node
at once.
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


class PoolExhausted(MemcachedError):
    """Every pooled connection of a node stayed busy for POOL_TIMEOUT seconds."""


class ValueTooLarge(MemcachedError):
    """The server refused to store a value (over its item size even after compression)."""
