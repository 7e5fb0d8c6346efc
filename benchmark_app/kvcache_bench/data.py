"""Benchmark data, generated from a seed before anything is timed: the value mixes.

A mix says which kinds of value (see ``kvcache_bench.payloads``) make up the cached
values, in which share and in which size range. ``make_values`` turns a mix and a seed
into the same values on every run; ``describe`` says what they are, for the results.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from kvcache_bench import payloads

KB = 1024
#: Values per kind used to measure each kind's compressibility at 1 KB and 4 KB.
RATIO_SAMPLES = 24
RATIO_SIZES = (1 * KB, 4 * KB)
KIND_NAMES = {"html": "HTML", "json": "JSON", "rows": "pickled rows", "scalar": "ints/short strings",
              "bytes": "random bytes", "text": "alphanumeric strings"}


@dataclass(frozen=True)
class Share:
    """One kind of value in a mix: its share of the values and its size range in bytes."""

    kind: str  # a key of payloads.GENERATORS
    percent: int
    min_bytes: int
    max_bytes: int
    log_sizes: bool = True  # sizes log-uniform (many small, few big) rather than uniform

    def size(self, rng: random.Random) -> int:
        if not self.log_sizes:
            return rng.randint(self.min_bytes, self.max_bytes)
        return round(math.exp(rng.uniform(math.log(self.min_bytes), math.log(self.max_bytes))))

    def label(self) -> str:
        return f"{KIND_NAMES[self.kind]} {self.percent}% {size_label(self.min_bytes)}-{size_label(self.max_bytes)}"


@dataclass(frozen=True)
class Mix:
    name: str
    summary: str
    shares: tuple[Share, ...]


SCALARS = Share("scalar", 15, 1, 64, log_sizes=False)
MIXES: dict[str, Mix] = {mix.name: mix for mix in (
    Mix("realistic", "what Django sites cache: rendered fragments, API responses, query results",
        (Share("html", 30, 1 * KB, 20 * KB), Share("json", 20, 1 * KB, 8 * KB),
         Share("rows", 25, KB // 2, 5 * KB), SCALARS,
         Share("bytes", 10, KB // 2, 3 * KB, log_sizes=False))),
    Mix("small", "the realistic kinds, every value at most 3 KB",
        (Share("html", 30, 1 * KB, 3 * KB), Share("json", 20, 1 * KB, 3 * KB),
         Share("rows", 25, KB // 2, 3 * KB), SCALARS,
         Share("bytes", 10, KB // 2, 3 * KB, log_sizes=False))),
    Mix("heavy", "large realistic values (issue 10's heavier mix)",
        (Share("html", 28, 17 * KB // 2, 25 * KB // 2, log_sizes=False),
         Share("json", 26, 4 * KB, 6 * KB, log_sizes=False),
         Share("rows", 26, 5 * KB // 2, 7 * KB // 2, log_sizes=False),
         Share("bytes", 20, 1 * KB, 2 * KB, log_sizes=False))),
    Mix("random", "random bytes of 1 B to 3 KB: incompressible, the benchmark's original values",
        (Share("bytes", 100, 1, 3 * KB, log_sizes=False),)),
    Mix("strings", "alphanumeric strings of 1 KB to 3 KB: over MySQLCache's compression "
        "threshold (1000 bytes), under django-mysql's (5000), barely compressible",
        (Share("text", 100, 1 * KB, 3 * KB, log_sizes=False),)),
)}
DEFAULT_MIX = "realistic"


@dataclass(frozen=True)
class Values:
    mix: Mix
    entries: tuple[Any, ...]  # the mix's values, kinds shuffled together
    kinds: tuple[str, ...]  # the kind of each entry
    large: str  # a big rendered HTML page, for the "large" operations


def mix_named(name: str) -> Mix:
    try:
        return MIXES[name]
    except KeyError:
        raise ValueError(f"unknown value mix {name!r}; choose from {', '.join(MIXES)}") from None


def make_values(seed: int, count: int, mix_name: str, large_size: int) -> Values:
    """``count`` values of the mix: each kind's exact share, in an order drawn from the seed."""
    mix = mix_named(mix_name)
    kinds = _kinds_in_order(mix, count, random.Random(f"{seed}:order"))
    by_kind = {share.kind: share for share in mix.shares}
    rng = random.Random(seed)  # alone for the random mix: the same bytes as before mixes
    entries = []
    for kind in kinds:
        share = by_kind[kind]
        entries.append(payloads.GENERATORS[kind](rng, share.size(rng), share.max_bytes))
    large = payloads.html_fragment(random.Random(f"{seed}:large"), large_size) if large_size else ""
    return Values(mix, tuple(entries), tuple(kinds), large)


def _kinds_in_order(mix: Mix, count: int, rng: random.Random) -> list[str]:
    """Each kind ``percent`` of ``count`` times (largest remainders get the rounding), shuffled."""
    exact = [share.percent * count / 100 for share in mix.shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)
    for index in by_remainder[:count - sum(counts)]:
        counts[index] += 1
    kinds = [share.kind for share, n in zip(mix.shares, counts) for _ in range(n)]
    if len(mix.shares) > 1:
        rng.shuffle(kinds)
    return kinds


FILLER_SIZES = (50, 200)
FILLER_LABEL = f"values: random filler of {FILLER_SIZES[0]}-{FILLER_SIZES[1]} B, whatever the mix"
FIXED_VALUE = b"v" * 200  # what every write of the concurrency scenario stores
FIXED_LABEL = f"values: {len(FIXED_VALUE)} fixed bytes, whatever the mix"


def filler(seed: int, count: int) -> tuple[bytes, ...]:
    """Small random values for the scenarios that measure something else than the values
    (``rows``: the table's size, ``nodes``: the node count)."""
    rng = random.Random(seed)
    return tuple(rng.randbytes(rng.randint(*FILLER_SIZES)) for _ in range(count))


def describe(values: Values, seed: int) -> dict[str, Any]:
    """What the values are: the mix as defined, and as generated (sizes, zlib-6 ratios)."""
    kinds = []
    for share in values.mix.shares:
        chosen = [v for v, kind in zip(values.entries, values.kinds) if kind == share.kind]
        kinds.append({
            "kind": share.kind, "percent": share.percent, "min_bytes": share.min_bytes,
            "max_bytes": share.max_bytes, "sizes": "log-uniform" if share.log_sizes else "uniform",
            "count": len(chosen), "mean_bytes": _mean_size(chosen),
            "zlib6_ratio": payloads.compression_ratio(chosen) if chosen else None,
        })
    return {
        "name": values.mix.name,
        "summary": values.mix.summary,
        "label": label(values.mix, _mean_size(values.entries)),
        "count": len(values.entries),
        "mean_bytes": _mean_size(values.entries),
        "zlib6_ratio": payloads.compression_ratio(values.entries),
        "kinds": kinds,
        "large": {"kind": "html", "bytes": len(values.large),
                  "zlib6_ratio": payloads.compression_ratio([values.large]) if values.large else None},
        "zlib6_ratio_at": reference_ratios(seed),
    }


def reference_ratios(seed: int) -> dict[str, dict[str, float]]:
    """Each compressible kind's zlib-6 ratio at 1 KB and 4 KB, to compare with real data."""
    ratios: dict[str, dict[str, float]] = {}
    for kind in ("html", "json", "rows"):
        rng = random.Random(f"{seed}:ratio:{kind}")
        generate = payloads.GENERATORS[kind]
        ratios[kind] = {
            size_label(size): payloads.compression_ratio(
                [generate(rng, size, size * 5 // 4) for _ in range(RATIO_SAMPLES)])
            for size in RATIO_SIZES
        }
    return ratios


def label(mix: Mix, mean_bytes: float) -> str:
    """One line for table headings and plot titles."""
    return f"values: {mix.name} ({', '.join(s.label() for s in mix.shares)}; mean {size_label(mean_bytes)})"


def _mean_size(values: Any) -> float:
    values = list(values)
    return round(sum(payloads.payload_size(v) for v in values) / len(values), 1) if values else 0.0


def size_label(size: float) -> str:
    if size < KB:
        return f"{size:.0f} B"
    return f"{size / KB:.1f}".removesuffix(".0") + " KB"
