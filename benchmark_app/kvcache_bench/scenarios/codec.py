"""``codec``: what compression costs and saves on the mix's values, without any server.

For each setting (compressor, level, COMPRESS_MIN_LENGTH) the mix's values go through
our codec: the CPU time per value to encode and to decode (best of several passes, in
this process), and the bytes stored as a share of the serialized payload. The first row
is django-mysql's policy done the same way (pickle, zlib level 6 from 5000 bytes) and
the second no compression at all, so each setting's price reads against both.
The last rows use a zstd dictionary trained on 2000 other values of the same mix (another
seed), as ``kvcache_train_dictionary`` trains one on a site's live entries. This is the
measurement behind the defaults (docs/codec.rst, "Choosing compression").
"""
from __future__ import annotations

import pickle
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

from django_kvcache.codec import Codec
from django_kvcache.zstd import train_dictionary, zstd_module
from kvcache_bench.caches import PEERS
from kvcache_bench.context import Context
from kvcache_bench.data import make_values

PASSES = 5
#: Values of the mix (another seed) a dictionary is trained on.
DICTIONARY_SAMPLES = 2000
#: Where the compact MySQL variant starts compressing (docs/codec.rst, "Choosing compression").
COMPACT_MYSQL_MIN_LENGTH = 1000
ZSTD = "django_kvcache.zstd.ZstdCompressor"
ZLIB = "django_kvcache.codec.ZlibCompressor"
#: (label, OPTIONS) of each setting measured; zstd ones only where zstd is installed.
#: Each names its compressor: the default one depends on what is installed.
SETTINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("none", {"COMPRESSOR": None}),
    *((f"zlib-1 from {n}", {"COMPRESSOR": ZLIB, "COMPRESS_MIN_LENGTH": n})
      for n in (400, 1000, 2000, 4000, 8000)),
    ("zlib-6 from 400", {"COMPRESSOR": ZLIB, "COMPRESS_LEVEL": 6, "COMPRESS_MIN_LENGTH": 400}),
    *((f"zstd-{level} from {n}", {"COMPRESSOR": ZSTD, "COMPRESS_LEVEL": level,
                                  "COMPRESS_MIN_LENGTH": n})
      for level in (1, 3) for n in (400, 2000, 4000)),
)


def run(context: Context) -> dict[str, Any]:
    values = context.values.entries
    payload = sum(len(_serialized(value)) for value in values)
    settings = [(label, options) for label, options in SETTINGS
                if zstd_module() is not None or options.get("COMPRESSOR") != ZSTD]
    with tempfile.TemporaryDirectory() as folder:
        if zstd_module() is not None:
            settings.extend(
                (f"zstd-3 + dictionary from {n}", {
                    "COMPRESSOR": ZSTD, "COMPRESS_MIN_LENGTH": n,
                    "COMPRESS_DICTIONARY": trained_dictionary(context, folder)})
                for n in sorted({400, COMPACT_MYSQL_MIN_LENGTH}))
        return _run_settings(context, values, payload, settings)


def trained_dictionary(context: Context, folder: str) -> str:
    """The path of a 16 KB dictionary trained on DICTIONARY_SAMPLES values of the same mix
    drawn with another seed (``--seed`` + 1), never the values then measured, as
    ``kvcache_train_dictionary`` trains one on a site's live entries."""
    p = context.parameters
    samples = make_values(p.seed + 1, DICTIONARY_SAMPLES, p.values, 0).entries
    path = Path(folder) / f"{p.values}-{p.seed + 1}.zstd"
    if not path.exists():
        path.write_bytes(train_dictionary(
            [_serialized(value) for value in samples if type(value) is not int]))
    return str(path)


#: How the compact variants' setting reads in the results.
COMPACT_SETTING = "zstd-3 + dictionary from {min_length}"


def compact_variants(context: Context, folder: str) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Our recommended setting where bytes matter more than CPU, per cache family, as
    ``(cache name, setting, OPTIONS)``: zstd level 3 with a dictionary trained on the mix
    (``trained_dictionary``), from 400 bytes on memcached and from
    COMPACT_MYSQL_MIN_LENGTH on MySQL. Empty when zstd is not installed."""
    if zstd_module() is None:
        return {}
    options = {"COMPRESSOR": ZSTD, "COMPRESS_DICTIONARY": trained_dictionary(context, folder)}
    return {
        family: (f"{name} zstd+dict", COMPACT_SETTING.format(min_length=min_length),
                 {**options, "COMPRESS_MIN_LENGTH": min_length})
        for family, name, min_length in (("kv-memcached", "kv-memcached", 400),
                                         ("kv-mysql", "kv-mysql-innodb", COMPACT_MYSQL_MIN_LENGTH))
    }


def variant_peer_ratios(results: list[dict[str, Any]], metric: str, subject: str) -> None:
    """``peer``/``vs_peer`` of each variant entry (one with ``variant_of``): its metric over
    the peer of the cache it is a variant of, as ``add_peer_ratios`` does for that cache."""
    by_subject = {entry[subject]: entry[metric] for entry in results}
    for entry in results:
        peer = PEERS.get(entry.get("variant_of") or "")
        if peer and by_subject.get(peer):
            entry["peer"], entry["vs_peer"] = peer, round(entry[metric] / by_subject[peer], 3)


def _run_settings(context: Context, values: Sequence[Any], payload: int,
                  settings: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    results = [_measure("django-mysql policy", values, payload, *_django_mysql_policy())]
    with context.progress("codec", len(settings)) as bar:
        for label, options in settings:
            codec = Codec.from_options(options)
            results.append(_measure(label, values, payload, codec.encode,
                                    lambda encoded, codec=codec: codec.decode(*encoded)))
            results[-1]["compressor"] = type(codec.compressor).__name__ if codec.compressor else None
            bar.update()
    return {"values": len(values), "payload_bytes": payload, "passes": PASSES,
            "results": results}


def _measure(label: str, values: Sequence[Any], payload: int,
             encode: Callable[[Any], tuple[bytes, int]],
             decode: Callable[[tuple[bytes, int]], Any]) -> dict[str, Any]:
    encoded = [encode(value) for value in values]
    stored = sum(len(data) for data, _ in encoded)
    return {"setting": label,
            "encode_us": round(_best_per_item(encode, values), 2),
            "decode_us": round(_best_per_item(decode, encoded), 2),
            "stored_bytes": stored,
            "vs_payload": round(stored / payload, 3)}


def _best_per_item(call: Callable[[Any], Any], items: Sequence[Any]) -> float:
    """CPU µs per item, the best of PASSES passes (the least disturbed by other work)."""
    best = float("inf")
    for _ in range(PASSES):
        started = time.process_time_ns()
        for item in items:
            call(item)
        best = min(best, (time.process_time_ns() - started) / len(items) / 1000)
    return best


def _serialized(value: Any) -> bytes:
    return b"%d" % value if type(value) is int else pickle.dumps(value, pickle.HIGHEST_PROTOCOL)


def _django_mysql_policy() -> tuple[Callable[[Any], tuple[bytes, int]],
                                    Callable[[tuple[bytes, int]], Any]]:
    """django-mysql's MySQLCache encoding: ints as text, pickle, zlib-6 from 5000 bytes."""

    def encode(value: Any) -> tuple[bytes, int]:
        if type(value) is int:
            return b"%d" % value, 0
        data = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
        return (zlib.compress(data, 6), 2) if len(data) >= 5000 else (data, 1)

    def decode(encoded: tuple[bytes, int]) -> Any:
        data, kind = encoded
        if kind == 0:
            return int(data)
        return pickle.loads(zlib.decompress(data) if kind == 2 else data)

    return encode, decode
