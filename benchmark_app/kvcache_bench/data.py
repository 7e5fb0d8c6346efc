"""Benchmark data, generated from a seed before anything is timed."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Values:
    small: tuple[bytes, ...]  # random bytes of random sizes: incompressible, like images or ids
    large: str  # a big, compressible text, like a rendered HTML fragment


def make_values(seed: int, count: int, min_size: int, max_size: int, large_size: int) -> Values:
    rng = random.Random(seed)
    small = tuple(rng.randbytes(rng.randint(min_size, max_size)) for _ in range(count))
    return Values(small=small, large=_html_like(rng, large_size))


def _html_like(rng: random.Random, size: int) -> str:
    words = ["cache", "django", "table", "node", "value", "<li>", "</li>", "<a href='/x'>", "</a>"]
    parts: list[str] = []
    length = 0
    while length < size:
        part = f"{rng.choice(words)} {rng.randint(0, 9999)} "
        parts.append(part)
        length += len(part)
    return "".join(parts)[:size]
