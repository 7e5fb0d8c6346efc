"""``manage.py kvcache_createtable [--dry-run] [alias ...]``: create missing cache tables."""
from __future__ import annotations

from typing import Any

from django_kvcache.management.commands._errors import failing
from django_kvcache.management.commands._mysql import MySQLCacheCommand
from django_kvcache.maintenance import create_tables


class Command(MySQLCacheCommand):
    help = "Create the tables of MySQLCache caches that do not exist yet."
    nothing = "no table to create"

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "--dry-run", action="store_true", help="Print the SQL instead of running it."
        )

    def handle(
        self, *args: Any, aliases: list[str], dry_run: bool, verbosity: int, **options: Any
    ) -> None:
        for alias, cache in self.selected_caches(aliases, verbosity).items():
            with failing(alias, cache):
                # Every table there, one outdated: MAX_SIZE's columns and index are added.
                upgrades = not any(cache.missing_tables(database)
                                   for database in cache.database_aliases())
                created = create_tables([alias], dry_run=dry_run)
            if dry_run and alias in created:  # the SQL asked for: printed at any verbosity
                self.stdout.write(f"-- {alias}\n{created[alias]};")
            elif verbosity >= 1:
                done = "table exists"
                if alias in created:
                    done = "upgraded table" if upgrades else "created table"
                self.stdout.write(f"{alias}: {done}")
