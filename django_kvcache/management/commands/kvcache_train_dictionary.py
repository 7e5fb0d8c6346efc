"""``manage.py kvcache_train_dictionary ALIAS (--output FILE | --install)``: a zstd
dictionary from live entries.

Samples the cache's live entries, trains a dictionary on four fifths of them and measures
it on the fifth it has not seen, then writes it to FILE, or with ``--install`` (MySQLCache)
stores it on every shard, in the table a cache with ``"COMPRESS_DICTIONARY": "auto"``
reads its dictionaries from. A file is used with ``"COMPRESS_DICTIONARY": [FILE, <older
dictionaries>...]`` (docs/codec.rst).
"""
from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_kvcache.codec import FLAG_INTEGER, FLAG_LONG
from django_kvcache.configured import is_mysql_cache
from django_kvcache.management.commands._errors import failing
from django_kvcache.zstd import (
    DEFAULT_DICTIONARY_SIZE,
    DEFAULT_LEVEL,
    Dictionary,
    Engine,
    ZstdCompressor,
    require_zstd,
    train_dictionary,
)

#: Entries under this size are what dictionaries help; larger ones compress well alone.
MAX_SAMPLE_BYTES = 64 * 1024
#: The COMPRESS_MIN_LENGTH values the report weighs, and the share of the dictionary's
#: gain (every entry compressed) a threshold must take to be enough.
THRESHOLDS = (64, 128, 256, 400, 512, 1000, 2000, 4000, 8000)
TAKEN = 0.9


class Command(BaseCommand):
    help = "Train a zstd compression dictionary on a sample of a cache's live entries."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("alias", help="the cache alias in CACHES to sample")
        parser.add_argument("--output", "-o", type=Path, help="dictionary file to write")
        parser.add_argument(
            "--install", action="store_true",
            help="store it in the cache's database, on every shard (MySQLCache; used by "
            "caches with COMPRESS_DICTIONARY 'auto')",
        )
        parser.add_argument("--samples", type=int, default=5000, help="entries to sample")
        parser.add_argument(
            "--size", type=int, default=DEFAULT_DICTIONARY_SIZE, help="dictionary size in bytes"
        )

    def execute(self, *args: Any, **options: Any) -> Any:
        """Failures (no zstd, a node or database down, an unwritable file) as one line."""
        with failing(options.get("alias", "?")):
            return super().execute(*args, **options)

    def handle(self, *args: Any, alias: str, output: Path | None, install: bool, samples: int,
               size: int, verbosity: int, **options: Any) -> None:
        if alias not in settings.CACHES:
            raise CommandError(f"No cache named {alias!r} in CACHES")
        cache = caches[alias]
        if not hasattr(cache, "sample_entries"):
            raise CommandError(f"Cache {alias!r} is not a django-kvcache cache")
        if output is None and not install:
            raise CommandError("Say where the dictionary goes: --output FILE, --install, or both")
        if install and not is_mysql_cache(alias):
            raise CommandError(
                f"--install keeps the dictionary in a MySQLCache's database; cache {alias!r} "
                "takes dictionary files: use --output and OPTIONS['COMPRESS_DICTIONARY']"
            )
        if samples < 10 or size < 256:
            raise CommandError("--samples must be at least 10 and --size at least 256")
        engine = require_zstd("Training a dictionary")  # without zstd: one line (failing)
        payloads = self.payloads(cache, cache.sample_entries(samples), alias)
        if len(payloads) < 10:
            raise CommandError(
                f"Cache {alias!r} gave {len(payloads)} usable entries; at least 10 are needed"
            )
        held_out = payloads[::5]
        training = [payload for index, payload in enumerate(payloads) if index % 5]
        try:
            dictionary = train_dictionary(training, size)
        except ValueError as exc:  # too few or too uniform samples for zstd's trainer
            raise CommandError(f"Training failed: {exc}") from exc
        if output is not None:
            output.write_bytes(dictionary)
        if install:
            self.install(cache, alias, dictionary)
        if verbosity:
            where = [str(output)] if output is not None else []
            if install:
                where.append(f"the table of cache {alias!r}")
            compressor = cache.codec.compressor
            level = getattr(compressor, "level", DEFAULT_LEVEL) if isinstance(
                compressor, ZstdCompressor) else DEFAULT_LEVEL
            self.stdout.write(self.report(engine, alias, " and ".join(where), dictionary,
                                          training, held_out, cache.codec.compress_min_length,
                                          level, cache.codec.min_saving))

    def install(self, cache: Any, alias: str, dictionary: bytes) -> None:
        from django_kvcache.mysql.dictionaries import table_dictionaries  # a MySQLCache's

        try:
            table_dictionaries(cache.table, cache.options).install(dictionary)
        except (DatabaseError, ValueError) as exc:  # a shard down, an id taken, no table
            raise CommandError(f"Installing the dictionary in cache {alias!r} failed: {exc}") from exc
        if cache.options.get("COMPRESS_DICTIONARY") != "auto":
            self.stderr.write(
                f"Cache {alias!r} does not read it: set its OPTIONS['COMPRESS_DICTIONARY'] to "
                "'auto' to compress with the dictionaries in its table."
            )

    def payloads(self, cache: Any, entries: list[tuple[str, bytes, int]],
                 alias: str = "") -> list[bytes]:
        """Serialized values as compressors see them (decrypted, with ENCRYPTION_KEYS);
        integers and unreadable entries dropped."""
        payloads = []
        unreadable = 0
        for key, data, flags in entries:
            if flags in (FLAG_INTEGER, FLAG_LONG):
                continue
            try:
                payload, _ = cache.codec.decompressed(*cache.codec.opened(data, flags, key))
            except Exception:  # corrupt, another cache's (or key's), or compressed with a
                # dictionary not configured here
                unreadable += 1
                continue
            if 0 < len(payload) <= MAX_SAMPLE_BYTES:
                payloads.append(bytes(payload))
        if unreadable:
            self.stderr.write(f"Skipped {unreadable} entries cache {alias!r} cannot decompress.")
        return payloads

    @staticmethod
    def report(engine: Engine, alias: str, where: str, dictionary: bytes, training: list[bytes],
               held_out: list[bytes], threshold: int, level: int = DEFAULT_LEVEL,
               min_saving: float = 0.0) -> str:
        """The dictionary's effect on entries it was not trained on: with every entry
        compressed, then as the cache compresses them (from its COMPRESS_MIN_LENGTH,
        ``threshold``, keeping a compressed form that saves ``min_saving``, its
        COMPRESS_MIN_SAVING), and, when that threshold leaves most of the gain untaken,
        the highest one that would take it."""
        trained = Dictionary(dictionary)
        raw = sum(map(len, held_out))
        zstd, with_dictionary = f"zstd-{level}", f"zstd-{level} + dictionary"
        compressors = {
            "zlib-1": lambda data: zlib.compress(data, 1),
            zstd: lambda data: engine.compress(data, level, None),
            with_dictionary: lambda data: engine.compress(data, level, trained),
        }
        lines = [
            f"{alias}: wrote {where} (zstd dictionary {trained.id}, {len(dictionary)} "
            f"bytes) trained on {len(training)} entries.",
            f"On {len(held_out)} other entries ({raw:,} bytes serialized, "
            f"{raw // len(held_out)} bytes on average):",
            "  every entry compressed:",
        ]
        sizes: dict[str, list[int]] = {}
        for name, compress in compressors.items():
            start = time.perf_counter()
            sizes[name] = [min(len(compress(data)), len(data)) for data in held_out]
            per_entry = (time.perf_counter() - start) / len(held_out) * 1e6
            lines.append(f"    {name:20} {raw / sum(sizes[name]):5.2f}x smaller, "
                         f"{per_entry:6.1f} us per entry")

        def stored(name: str, minimum: int) -> int:
            """Bytes stored with ``name`` compressing the entries from ``minimum`` bytes."""
            return sum(size if len(data) >= minimum and len(data) - size >= min_saving * len(data)
                       else len(data) for data, size in zip(held_out, sizes[name]))

        def share(minimum: int) -> int:
            return round(100 * sum(len(data) >= minimum for data in held_out) / len(held_out))

        lines.append(f"  as this cache compresses (from COMPRESS_MIN_LENGTH {threshold} bytes: "
                     f"{share(threshold)}% of these entries):")
        for name in (zstd, with_dictionary):
            lines.append(f"    {name:20} {raw / stored(name, threshold):5.2f}x smaller")
        gain = raw - stored(with_dictionary, 0)  # the most the dictionary can save
        if gain <= 0:
            lines.append("The dictionary does not make these entries smaller.")
            return "\n".join(lines) + "\n"
        taken = (raw - stored(with_dictionary, threshold)) / gain
        if taken >= TAKEN:
            lines.append(f"This cache's COMPRESS_MIN_LENGTH of {threshold} bytes takes "
                         f"{taken:.0%} of the dictionary's gain.")
            return "\n".join(lines) + "\n"
        better = max(minimum for minimum in [0, *THRESHOLDS]
                     if raw - stored(with_dictionary, minimum) >= TAKEN * gain)
        lines.append(
            f"The dictionary's gain is on entries under {threshold} bytes, which this cache "
            f"stores as they are: COMPRESS_MIN_LENGTH {better} would compress {share(better)}% "
            f"of these entries, {raw / stored(with_dictionary, better):.2f}x smaller with the "
            f"dictionary ({(raw - stored(with_dictionary, better)) / gain:.0%} of its gain)."
        )
        return "\n".join(lines) + "\n"
