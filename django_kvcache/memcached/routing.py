"""Where memcached keys live: LOCATION parsing and the two hashing schemes.

``"kvcache"`` (default) is the rendezvous hashing of :mod:`django_kvcache.routing`.

``"pymemcache"`` is what pymemcache's ``HashClient`` (Django's ``PyMemcacheCache``) does:
``murmur3_32("<host:port>-<key>", seed 0)``, highest wins, where pymemcache's
pure-Python murmur3 reads one character's low byte per character. We feed mmh3 the same
bytes, so both clients put every key on the same node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from django.core.exceptions import ImproperlyConfigured

from django_kvcache.dependencies import require
from django_kvcache.routing import KvcacheRouter, Router

mmh3 = require("mmh3", "MemcachedCache", extra="memcached")

DEFAULT_PORT = 11211
SCHEMES = ("kvcache", "pymemcache")

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+)(?::(?P<port>\d{1,5}))?$")


@dataclass(frozen=True)
class NodeAddress:
    """One memcached server as named in LOCATION."""

    name: str  # canonical: "host:port" or "unix:/path"
    host: str | None = None
    port: int | None = None
    path: str | None = None

    @property
    def server(self) -> tuple[str, int] | str:
        """The server spec pymemcache's ``Client`` takes."""
        if self.path is not None:
            return self.path
        return (self.host.strip("[]"), self.port)  # type: ignore[union-attr]

    @property
    def pymemcache_name(self) -> str:
        """The node name pymemcache's HashClient hashes (``"host:port"`` or the path)."""
        if self.path is not None:
            return self.path
        return f"{self.host.strip('[]')}:{self.port}"  # type: ignore[union-attr]


def parse_location(location: Any) -> list[NodeAddress]:
    """LOCATION as a list, or a ``,``/``;``-separated string, of ``host:port`` or
    ``unix:/path`` entries."""
    if isinstance(location, str):
        entries = [entry.strip() for entry in re.split("[;,]", location)]
    elif isinstance(location, (list, tuple)):
        entries = list(location)
    else:
        raise ImproperlyConfigured(
            f"memcached LOCATION must be a list or a string of servers, got {location!r}"
        )
    nodes = [_parse_entry(entry) for entry in entries if entry != ""]
    if not nodes:
        raise ImproperlyConfigured("memcached LOCATION names no server")
    names = [node.name for node in nodes]
    if len(set(names)) != len(names):
        raise ImproperlyConfigured(f"memcached LOCATION lists a server twice: {names}")
    return nodes


def _parse_entry(entry: Any) -> NodeAddress:
    if not isinstance(entry, str):
        raise ImproperlyConfigured(f"memcached LOCATION entry must be a string, got {entry!r}")
    if entry.startswith("unix:"):
        path = entry[5:]
        if not path.startswith("/"):
            raise ImproperlyConfigured(
                f"memcached LOCATION entry {entry!r}: a unix socket needs an absolute path"
            )
        return NodeAddress(name=entry, path=path)
    match = _HOST_PORT.match(entry)
    port = int(match["port"]) if match and match["port"] else DEFAULT_PORT
    if not match or not 0 < port < 65536:
        raise ImproperlyConfigured(
            f"memcached LOCATION entry {entry!r} is not 'host:port' or 'unix:/path'"
        )
    return NodeAddress(name=f"{match['host']}:{port}", host=match["host"], port=port)


class PymemcacheRouter(Router):
    """The ``"pymemcache"`` scheme: the placement of pymemcache's ``HashClient``."""

    def __init__(self, nodes: Sequence[NodeAddress], weights: Sequence[float]) -> None:
        super().__init__([node.name for node in nodes], weights)
        if self.weighted:
            raise ImproperlyConfigured(
                "OPTIONS['WEIGHTS'] cannot be used with HASHING='pymemcache': "
                "pymemcache's HashClient has no weights"
            )
        self.hashed_names = [node.pymemcache_name for node in nodes]
        self.prefixes = [low_bytes(f"{name}-") for name in self.hashed_names]

    def scores(self, key: str) -> list[int]:
        data = key.encode() if key.isascii() else low_bytes(key)
        return [mmh3.hash(prefix + data, 0, False) for prefix in self.prefixes]

    def _tie_breaker(self, index: int) -> str:
        return self.hashed_names[index]  # pymemcache keeps max(str(node), str(winner))


def low_bytes(text: str) -> bytes:
    """The low byte of every character: what pymemcache's murmur3 hashes."""
    if text.isascii():
        return text.encode()
    return text.encode("utf-32-le")[::4]


def check_scheme(scheme: Any) -> str:
    if scheme not in SCHEMES:
        raise ImproperlyConfigured(
            f"OPTIONS['HASHING'] must be one of {', '.join(map(repr, SCHEMES))}, got {scheme!r}"
        )
    return scheme


def make_router(
    scheme: Any, nodes: Sequence[NodeAddress], weights: Sequence[float]
) -> Router:
    if check_scheme(scheme) == "kvcache":
        return KvcacheRouter([node.name for node in nodes], weights)
    return PymemcacheRouter(nodes, weights)
