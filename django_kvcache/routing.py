"""Rendezvous (highest random weight) hashing: which of a fixed list of nodes owns a key.

One implementation for every kvcache backend that spreads keys (memcached nodes, MySQL
shards). Scores use MurmurHash3 x86_32 (mmh3, in C):
``score(node, key) = murmur3_32(utf8(key), seed=murmur3_32(utf8(node name), 0))``.
The highest score wins; equal scores go to the node whose name is greater as UTF-8
bytes. With weights, ``score = -weight / ln((hash + 0.5) / 2**32)``, which orders nodes
exactly like the plain hash when every weight is equal.

Removing a node moves only that node's keys; adding one of N+1 moves about 1/(N+1).

mmh3 is imported when a router is built: a cache on one server never needs it. The
backends require it first (:func:`django_kvcache.dependencies.require`), so that a
process without it is told which extra brings it.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from django.core.exceptions import ImproperlyConfigured

from django_kvcache.options import check_known, is_number

#: Routing answers are remembered for this many keys, then forgotten all at once.
ROUTE_MEMO_SIZE = 65536


def parse_weights(weights: Any, names: Sequence[str], what: str = "server names of LOCATION") -> list[float]:
    """OPTIONS['WEIGHTS'] (node name -> positive number) as one weight per node."""
    if weights is None:
        return [1.0] * len(names)
    check_known(weights, set(names), f"OPTIONS['WEIGHTS'] ({what})")
    for name, weight in weights.items():
        if not is_number(weight) or not weight > 0:
            raise ImproperlyConfigured(
                f"OPTIONS['WEIGHTS'][{name!r}] must be a positive number, got {weight!r}"
            )
    return [float(weights.get(name, 1.0)) for name in names]


class Router:
    """Rendezvous hashing over a fixed list of nodes; answers are node indexes."""

    def __init__(self, names: Sequence[str], weights: Sequence[float]) -> None:
        self.names = list(names)
        self.weights = list(weights)
        self.weighted = len(set(self.weights)) > 1
        self.single = len(self.names) == 1
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
    """Our scheme (see the module docstring): ``HASHING="kvcache"`` for memcached."""

    def __init__(self, names: Sequence[str], weights: Sequence[float]) -> None:
        import mmh3

        super().__init__(names, weights)
        self.murmur3 = mmh3.hash
        self.seeds = [mmh3.hash(name.encode(), 0, False) for name in self.names]
        self.name_bytes = [name.encode() for name in self.names]

    def scores(self, key: str) -> list[float]:
        data, murmur3 = key.encode(), self.murmur3
        hashes = [murmur3(data, seed, False) for seed in self.seeds]
        if not self.weighted:
            return hashes
        return [
            -weight / math.log((hashed + 0.5) / 2**32)
            for hashed, weight in zip(hashes, self.weights)
        ]

    def _tie_breaker(self, index: int) -> bytes:
        return self.name_bytes[index]
