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

from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.codec import FLAG_INTEGER, FLAG_LONG
from django_kvcache.management.commands._errors import failing
from django_kvcache.mysql.dictionaries import table_dictionaries
from django_kvcache.zstd import (
    DEFAULT_DICTIONARY_SIZE,
    DEFAULT_LEVEL,
    Dictionary,
    Engine,
    require_zstd,
    train_dictionary,
)

#: Entries under this size are what dictionaries help; larger ones compress well alone.
MAX_SAMPLE_BYTES = 64 * 1024


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
        if install and not isinstance(cache, MySQLCache):
            raise CommandError(
                f"--install keeps the dictionary in a MySQLCache's database; cache {alias!r} "
                "takes dictionary files: use --output and OPTIONS['COMPRESS_DICTIONARY']"
            )
        if samples < 10 or size < 256:
            raise CommandError("--samples must be at least 10 and --size at least 256")
        engine = require_zstd("Training a dictionary")  # without zstd: one line (failing)
        payloads = self.payloads(cache, cache.sample_entries(samples))
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
            self.stdout.write(self.report(engine, alias, " and ".join(where), dictionary,
                                          training, held_out))

    def install(self, cache: Any, alias: str, dictionary: bytes) -> None:
        try:
            table_dictionaries(cache.table, cache.options).install(dictionary)
        except (DatabaseError, ValueError) as exc:  # a shard down, an id taken, no table
            raise CommandError(f"Installing the dictionary in cache {alias!r} failed: {exc}") from exc
        if cache.options.get("COMPRESS_DICTIONARY") != "auto":
            self.stderr.write(
                f"Cache {alias!r} does not read it: set its OPTIONS['COMPRESS_DICTIONARY'] to "
                "'auto' to compress with the dictionaries in its table."
            )

    def payloads(self, cache: Any, entries: list[tuple[str, bytes, int]]) -> list[bytes]:
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
            self.stderr.write(f"Skipped {unreadable} entries this cache cannot decompress.")
        return payloads

    @staticmethod
    def report(engine: Engine, alias: str, where: str, dictionary: bytes, training: list[bytes],
               held_out: list[bytes]) -> str:
        """The dictionary's effect on entries it was not trained on."""
        trained = Dictionary(dictionary)
        raw = sum(map(len, held_out))
        sizes = {}
        for name, compress in (
            ("zlib-1", lambda data: zlib.compress(data, 1)),
            (f"zstd-{DEFAULT_LEVEL}", lambda data: engine.compress(data, DEFAULT_LEVEL, None)),
            (f"zstd-{DEFAULT_LEVEL} + dictionary",
             lambda data: engine.compress(data, DEFAULT_LEVEL, trained)),
        ):
            start = time.perf_counter()
            sizes[name] = (sum(len(compress(d)) for d in held_out), time.perf_counter() - start)
        lines = [
            f"{alias}: wrote {where} (zstd dictionary {trained.id}, {len(dictionary)} "
            f"bytes) trained on {len(training)} entries.",
            f"On {len(held_out)} other entries ({raw} bytes serialized):",
        ]
        for name, (total, seconds) in sizes.items():
            lines.append(
                f"  {name:20} {raw / total:5.2f}x smaller, "
                f"{seconds / len(held_out) * 1e6:6.1f} us per entry"
            )
        return "\n".join(lines) + "\n"
