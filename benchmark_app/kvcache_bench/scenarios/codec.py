"""``codec``: what compression costs and saves on the mix's values, without any server.

For each setting (compressor, level, COMPRESS_MIN_LENGTH, zstd engine) ``codec_values``
values of the mix (1500; 300 with ``--quick``) go through our codec: the CPU time per value to encode and to decode (process
time, best of several passes, in this process: what other load on the machine moves
least), and the bytes stored as a share of the serialized payload. The first row is
django-mysql's policy done the same way (pickle, zlib level 6 from 5000 bytes) and the
second no compression at all, so each setting's price reads against both.

The zstd rows at thresholds from 400 to 4000 bytes are the curve the backends' defaults
are chosen from (bytes against read CPU per threshold, docs/codec.rst); rows marked
``compression.zstd`` use the fallback engine (the standard library's or backports.zstd)
where it is installed. The last rows use a zstd dictionary trained on DICTIONARY_SAMPLES
other values of the mix (another seed), as ``kvcache_train_dictionary`` trains one on a
site's live entries.

Each backend's defaults are marked, and its dictionary threshold measured, only when a
cache of that backend is measured in the run: the backend is imported then, so a site
with one backend's extra never imports the other's.
"""
from __future__ import annotations

import pickle
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

from django.core.management import call_command
from django.test import override_settings
from django.utils.module_loading import import_string

from django_kvcache.codec import DEFAULT_COMPRESS_MIN_SAVING, Codec
from django_kvcache.zstd import (
    DEFAULT_LEVEL,
    StandardLibrary,
    standard_library_engine,
    train_dictionary,
    zstd_engine,
)
from kvcache_bench.caches import PEERS, CacheSpec
from kvcache_bench.context import Context
from kvcache_bench.data import make_values

PASSES = 5
#: Values of the mix (another seed) a dictionary is trained on.
DICTIONARY_SAMPLES = 2000
ZSTD = "django_kvcache.zstd.ZstdCompressor"
ZLIB = "django_kvcache.codec.ZlibCompressor"
#: Thresholds of the zstd curve.
CURVE = (400, 700, 1000, 1500, 2000, 3000, 4000)
#: (label, OPTIONS) of each setting measured; zstd ones only where zstd is installed.
#: Each names its compressor: the default one depends on what is installed.
SETTINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("none", {"COMPRESSOR": None}),
    *((f"zlib-1 from {n}", {"COMPRESSOR": ZLIB, "COMPRESS_MIN_LENGTH": n})
      for n in (400, 1000, 4000)),
    ("zlib-6 from 400", {"COMPRESSOR": ZLIB, "COMPRESS_LEVEL": 6, "COMPRESS_MIN_LENGTH": 400}),
    *((f"zstd-{DEFAULT_LEVEL} from {n}", {"COMPRESSOR": ZSTD, "COMPRESS_MIN_LENGTH": n})
      for n in CURVE),
    # MySQLCache's defaults (the report says which row is a backend's default, from the
    # backends measured): it keeps what saves a quarter, the curve what saves a tenth.
    (f"zstd-{DEFAULT_LEVEL} from 1000 saving 25%",
     {"COMPRESSOR": ZSTD, "COMPRESS_MIN_LENGTH": 1000, "COMPRESS_MIN_SAVING": 0.25}),
    *((f"zstd-{level} from 1000", {"COMPRESSOR": ZSTD, "COMPRESS_LEVEL": level,
                                   "COMPRESS_MIN_LENGTH": 1000})
      for level in (1, 6)),
)
#: Thresholds measured again with the fallback engine, where it is installed.
FALLBACK_CURVE = (400, 1000, 4000)
FALLBACK = "compression.zstd"


#: The kvcache backend of each cache family, by the name the results give it.
BACKENDS = {"MySQL": ("kv-mysql", "django_kvcache.backends.mysql.MySQLCache"),
            "memcached": ("kv-memcached", "django_kvcache.backends.memcached.MemcachedCache")}


def measured_backends(context: Context) -> dict[str, type]:
    """``{"MySQL": MySQLCache, ...}``: the kvcache backends a cache of the run is of."""
    families = {spec.family for spec in context.caches}
    return {name: import_string(path) for name, (family, path) in BACKENDS.items()
            if any(measured.startswith(family) for measured in families)}


def run(context: Context) -> dict[str, Any]:
    p = context.parameters
    backends = measured_backends(context)
    values = make_values(p.seed, p.codec_values, p.values, 0).entries
    payload = sum(len(_serialized(value)) for value in values)
    engine = zstd_engine()
    thresholds = dict.fromkeys([400, *(backend.default_compress_min_length
                                       for backend in backends.values())])
    settings = [(label, options, None) for label, options in SETTINGS
                if engine is not None or options.get("COMPRESSOR") != ZSTD]
    fallback = standard_library_engine()
    if fallback is not None and fallback is not engine:
        settings += [(f"zstd-{DEFAULT_LEVEL} from {n} ({FALLBACK})",
                      {"COMPRESSOR": ZSTD, "COMPRESS_MIN_LENGTH": n}, fallback)
                     for n in FALLBACK_CURVE]
    with tempfile.TemporaryDirectory() as folder:
        if engine is not None:
            settings += [(f"zstd-{DEFAULT_LEVEL} + dictionary from {n}", {
                "COMPRESSOR": ZSTD, "COMPRESS_MIN_LENGTH": n,
                "COMPRESS_DICTIONARY": trained_dictionary(context, folder)}, None)
                for n in thresholds]
        return _run_settings(context, values, payload, settings, backends)


def _default_of(options: dict[str, Any], engine: StandardLibrary | None,
                backends: dict[str, type]) -> str | None:
    """Which of ``backends``' defaults the setting is, if any ("MySQL", "memcached")."""
    if (engine is not None or options.get("COMPRESSOR") != ZSTD or "COMPRESS_LEVEL" in options
            or "COMPRESS_DICTIONARY" in options):
        return None
    defaults = [name for name, backend in backends.items()
                if backend.default_compress_min_length == options["COMPRESS_MIN_LENGTH"]
                and backend.default_compress_min_saving == options.get(
                    "COMPRESS_MIN_SAVING", DEFAULT_COMPRESS_MIN_SAVING)]
    return " and ".join(defaults) or None


def trained_dictionary(context: Context, folder: str) -> str:
    """The path of a dictionary of the default size (64 KB) trained on DICTIONARY_SAMPLES values of the mix
    drawn with another seed (``--seed`` + 1), never the values then measured, as
    ``kvcache_train_dictionary`` trains one on a site's live entries."""
    p = context.parameters
    samples = make_values(p.seed + 1, DICTIONARY_SAMPLES, p.values, 0).entries
    path = Path(folder) / f"{p.values}-{p.seed + 1}.zstd"
    if not path.exists():
        path.write_bytes(train_dictionary(
            [_serialized(value) for value in samples if type(value) is not int]))
    return str(path)


#: How the compact variants' settings read in the results.
COMPACT_MEMCACHED_SETTING = f"zstd-{DEFAULT_LEVEL} + dictionary file from {{min_length}}"
AUTO_SETTING = "defaults + COMPRESS_DICTIONARY 'auto' (kvcache_train_dictionary --install)"


def compact_variants(context: Context, folder: str) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Our recommended setting where bytes matter more than CPU, per cache family, as
    ``(cache name, setting, OPTIONS)``: on memcached, zstd with a dictionary file trained
    on the mix (``trained_dictionary``) from 400 bytes; on MySQL, the defaults with
    ``COMPRESS_DICTIONARY: "auto"``, whose dictionary ``install_dictionary`` trains on
    entries of the table and installs, as a site does. Empty when zstd is not installed."""
    if zstd_engine() is None:
        return {}
    return {
        "kv-memcached": ("kv-memcached zstd+dict", COMPACT_MEMCACHED_SETTING.format(min_length=400),
                         {"COMPRESSOR": ZSTD, "COMPRESS_MIN_LENGTH": 400,
                          "COMPRESS_DICTIONARY": trained_dictionary(context, folder)}),
        "kv-mysql": ("kv-mysql-innodb auto", AUTO_SETTING, {"COMPRESS_DICTIONARY": "auto"}),
    }


def install_dictionary(context: Context, spec: CacheSpec) -> None:
    """For a cache with ``COMPRESS_DICTIONARY: "auto"``: write DICTIONARY_SAMPLES values of
    the mix drawn with another seed (never the entries then measured) into its table and
    run ``manage.py kvcache_train_dictionary ALIAS --install`` on them: what a site does
    on its live entries. The caller empties the table."""
    p = context.parameters
    samples = make_values(p.seed + 1, DICTIONARY_SAMPLES, p.values, 0).entries
    cache = spec.build()
    alias = "kvcache_bench_auto"
    settings = {alias: {"BACKEND": spec.backend, "LOCATION": spec.location,
                        "KEY_PREFIX": spec.key_prefix, "OPTIONS": dict(spec.options)}}
    try:
        cache.set_many({f"train.{index}": value for index, value in enumerate(samples)})
        with override_settings(CACHES=settings):
            call_command("kvcache_train_dictionary", alias, "--install",
                         "--samples", str(DICTIONARY_SAMPLES), verbosity=0)
    finally:
        cache.close()


def variant_peer_ratios(results: list[dict[str, Any]], metric: str, subject: str) -> None:
    """``peer``/``vs_peer`` of each variant entry (one with ``variant_of``): its metric over
    the peer of the cache it is a variant of, as ``add_peer_ratios`` does for that cache."""
    by_subject = {entry[subject]: entry[metric] for entry in results}
    for entry in results:
        peer = PEERS.get(entry.get("variant_of") or "")
        if peer and by_subject.get(peer):
            entry["peer"], entry["vs_peer"] = peer, round(entry[metric] / by_subject[peer], 3)


def _run_settings(context: Context, values: Sequence[Any], payload: int,
                  settings: list[tuple[str, dict[str, Any], StandardLibrary | None]],
                  backends: dict[str, type]) -> dict[str, Any]:
    results = [_measure("django-mysql policy", values, payload, *_django_mysql_policy())]
    with context.progress("codec", len(settings)) as bar:
        for label, options, engine in settings:
            codec = Codec.from_options(options)
            if engine is not None:  # the same settings through the fallback engine
                codec.compressor.engine = engine
            results.append(_measure(label, values, payload, codec.encode,
                                    lambda encoded, codec=codec: codec.decode(*encoded)))
            results[-1]["compressor"] = type(codec.compressor).__name__ if codec.compressor else None
            results[-1]["engine"] = getattr(getattr(codec.compressor, "engine", None), "name", None)
            results[-1]["default_of"] = _default_of(options, engine, backends)
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
