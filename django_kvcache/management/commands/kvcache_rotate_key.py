"""``manage.py kvcache_rotate_key ALIAS``: re-encrypt a MySQLCache's entries with the
newest of its ENCRYPTION_KEYS, so that the older keys can be dropped without losing them.

Bounded batches in key order on every shard; a row written meanwhile is left alone (it
has the newest key already). Interrupted or stopped by ``--max-batches``, it prints the
key to continue after (``--after``); run again from the start, it only reads what is
done already (docs/operations.rst, "Rotating an encryption key").
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.management.base import CommandError, CommandParser

from django_kvcache.encryption import key_id_text
from django_kvcache.management.commands._errors import failing
from django_kvcache.management.commands._mysql import MySQLCacheCommand

if TYPE_CHECKING:  # imported once the alias is known to be a MySQLCache: a site without
    from django_kvcache.mysql.rotation import Rotation  # the mysql extra lists the command


class Command(MySQLCacheCommand):
    help = (
        "Re-encrypt the entries of a MySQLCache with the first of its "
        "OPTIONS['ENCRYPTION_KEYS'], in bounded batches; resumable."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("alias", help="the MySQLCache alias in CACHES")
        parser.add_argument(
            "--batch-size", type=int, default=None,
            help="rows each batch examines per shard (default: the backend's, 1000)",
        )
        parser.add_argument(
            "--max-batches", type=int, default=None,
            help="stop after this many batches and print where to continue",
        )
        parser.add_argument(
            "--after", default="",
            help="start after this stored key (what a stopped run printed)",
        )

    def handle(self, *args: Any, alias: str, batch_size: int | None, max_batches: int | None,
               after: str, verbosity: int, **options: Any) -> None:
        if (batch_size is not None and batch_size < 1) or (
                max_batches is not None and max_batches < 1):
            raise CommandError("--batch-size and --max-batches must be at least 1")
        cache = self.selected_caches([alias])[alias]
        if batch_size is None:
            from django_kvcache.mysql.rotation import ROTATION_BATCH_ROWS

            batch_size = ROTATION_BATCH_ROWS
        encryption = cache.codec.encryption
        if encryption is None:
            raise CommandError(
                f"{alias}: the cache has no OPTIONS['ENCRYPTION_KEYS']: nothing to re-encrypt"
            )
        with failing(alias, cache):
            done = cache.rotate_encryption_key(batch_size, max_batches, after)
        if verbosity >= 1:
            self.stdout.write(self.report(alias, done, encryption.key_ids))

    @staticmethod
    def report(alias: str, done: Rotation, key_ids: list[int]) -> str:
        lines = [
            f"{alias}: {done.resealed} entries re-encrypted with key id "
            f"{key_id_text(done.key_id)}, {done.current} had it already, {done.examined} "
            f"rows examined in {done.batches} batches."
        ]
        if done.unreadable:
            lines.append(
                f"{alias}: {done.unreadable} entries are encrypted with no key of "
                f"ENCRYPTION_KEYS (key ids {', '.join(map(key_id_text, key_ids))}) or were "
                "altered: left as they are, read as misses until they expire."
            )
        if done.resume_after is None:
            if len(key_ids) > 1:
                lines.append(
                    f"{alias}: done. Once every process runs with the new key first, the "
                    "older keys can be removed from ENCRYPTION_KEYS."
                )
            else:
                lines.append(f"{alias}: done.")
        else:
            lines.append(
                f"{alias}: stopped after {done.batches} batches; continue with "
                f"--after {done.resume_after!r}"
            )
        return "\n".join(lines) + "\n"
