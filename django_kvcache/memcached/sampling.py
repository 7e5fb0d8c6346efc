"""Entries picked at random across the nodes, for training a compression dictionary.

Maintenance, not the request path: ``lru_crawler metadump all`` lists every key of every
node (memcached 1.4.31+).
"""
from __future__ import annotations

import random

from django_kvcache.memcached import fanout, wire
from django_kvcache.memcached.node import Node


def sample_entries(nodes: list[Node], count: int) -> list[tuple[str, bytes, int]]:
    """Up to ``count`` stored ``(key, bytes, flags)`` entries, about as many from each
    node. A node that fails raises."""
    per_node = -(-count // len(nodes))
    batches = []
    for node in nodes:
        sample = Reservoir(per_node)
        node.call(wire.key_dump(sample))
        if sample.keys:
            batches.append(fanout.get_batch(node, sample.keys))
    fanout.run(batches)
    entries: list[tuple[str, bytes, int]] = []
    for batch in batches:
        if batch.error is not None:
            raise batch.error
        entries.extend((key.decode(), data, flags) for key, (data, flags) in batch.result.items())
    random.shuffle(entries)
    return entries[:count]


class Reservoir:
    """Up to ``size`` of the keys handed to it, picked at random (a reservoir sample)."""

    def __init__(self, size: int, rng: random.Random | None = None) -> None:
        self.size = size
        self.rng = rng or random.Random()
        self.keys: list[str] = []
        self.seen = 0

    def __call__(self, key: str) -> None:
        self.seen += 1
        if len(self.keys) < self.size:
            self.keys.append(key)
        elif (slot := self.rng.randrange(self.seen)) < self.size:
            self.keys[slot] = key
