"""Where keys live: LOCATION parsing and rendezvous (highest random weight) hashing.

Two schemes, both rendezvous hashing with MurmurHash3 x86_32 (mmh3, in C):

``"kvcache"`` (default)
    ``score(node, key) = murmur3_32(utf8(key), seed=murmur3_32(utf8(node.name), 0))``.
    The highest score wins; equal scores go to the node whose name is greater as UTF-8
    bytes. With weights, ``score = -weight / ln((hash + 0.5) / 2**32)``, which orders
    nodes exactly like the plain hash when every weight is equal.

``"pymemcache"``
    What pymemcache's ``HashClient`` (Django's ``PyMemcacheCache``) does:
    ``murmur3_32("<host:port>-<key>", seed 0)`` where pymemcache's pure-Python murmur3
    reads one character's low byte per character. We feed mmh3 the same bytes.

Removing a node moves only that node's keys; adding one of N+1 moves about 1/(N+1).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import mmh3
from django.core.exceptions import ImproperlyConfigured

from django_kvcache.options import check_known, is_number

DEFAULT_PORT = 11211
SCHEMES = ("kvcache", "pymemcache")
#: Routing answers are remembered for this many keys, then forgotten all at once.
ROUTE_MEMO_SIZE = 65536

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


def parse_weights(weights: Any, nodes: Sequence[NodeAddress]) -> list[float]:
    """OPTIONS['WEIGHTS'] (node name -> positive number) as one weight per node."""
    if weights is None:
        return [1.0] * len(nodes)
    names = {node.name for node in nodes}
    check_known(weights, names, "OPTIONS['WEIGHTS'] (server names of LOCATION)")
    for name, weight in weights.items():
        if not is_number(weight) or not weight > 0:
            raise ImproperlyConfigured(
                f"OPTIONS['WEIGHTS'][{name!r}] must be a positive number, got {weight!r}"
            )
    return [float(weights.get(node.name, 1.0)) for node in nodes]


class Router:
    """Rendezvous hashing over a fixed list of nodes; answers are node indexes."""

    def __init__(self, nodes: Sequence[NodeAddress], weights: Sequence[float]) -> None:
        self.names = [node.name for node in nodes]
        self.weights = list(weights)
        self.weighted = len(set(self.weights)) > 1
        self.single = len(nodes) == 1
        self._memo: dict[str, int] = {}

    def node_for(self, key: str) -> int:
        """The index of the node that owns ``key``."""
        if self.single:
            return 0
        memo = self._memo
        try:
            return memo[key]
        except KeyError:
            pass
        if len(memo) >= ROUTE_MEMO_SIZE:
            memo.clear()  # a crude bound: cheaper than an LRU, and routing is deterministic
        index = memo[key] = self.winner(key)
        return index

    def group(self, keys: Iterable[str]) -> dict[int, list[str]]:
        """Keys grouped by the index of their node."""
        if self.single:
            return {0: list(keys)}
        groups: dict[int, list[str]] = {}
        remembered = self._memo.get
        for key in keys:
            index = remembered(key)
            if index is None:
                index = self.node_for(key)
            try:
                groups[index].append(key)
            except KeyError:
                groups[index] = [key]
        return groups

    def winner(self, key: str) -> int:
        scores = self.scores(key)
        best = max(scores)
        if scores.count(best) == 1:
            return scores.index(best)
        return self.ranking(key)[0]  # a tie: let the tie-breaker decide

    def ranking(self, key: str) -> list[int]:
        """Every node index, best first: the failover order for ``key``."""
        scores = self.scores(key)
        return sorted(
            range(len(scores)), key=lambda i: (scores[i], self._tie_breaker(i)), reverse=True
        )

    def scores(self, key: str) -> list[float]:
        raise NotImplementedError

    def _tie_breaker(self, index: int) -> Any:
        raise NotImplementedError


class KvcacheRouter(Router):
    """The ``"kvcache"`` scheme (see the module docstring and docs/memcached.rst)."""

    def __init__(self, nodes: Sequence[NodeAddress], weights: Sequence[float]) -> None:
        super().__init__(nodes, weights)
        self.seeds = [mmh3.hash(name.encode(), 0, False) for name in self.names]
        self.name_bytes = [name.encode() for name in self.names]

    def scores(self, key: str) -> list[float]:
        data = key.encode()
        hashes = [mmh3.hash(data, seed, False) for seed in self.seeds]
        if not self.weighted:
            return hashes
        return [
            -weight / math.log((hashed + 0.5) / 2**32)
            for hashed, weight in zip(hashes, self.weights)
        ]

    def _tie_breaker(self, index: int) -> bytes:
        return self.name_bytes[index]


class PymemcacheRouter(Router):
    """The ``"pymemcache"`` scheme: the placement of pymemcache's ``HashClient``."""

    def __init__(self, nodes: Sequence[NodeAddress], weights: Sequence[float]) -> None:
        super().__init__(nodes, weights)
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
        return KvcacheRouter(nodes, weights)
    return PymemcacheRouter(nodes, weights)
