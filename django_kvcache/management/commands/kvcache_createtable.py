"""``manage.py kvcache_createtable [--dry-run] [alias ...]``: create missing cache tables."""
from __future__ import annotations

from typing import Any

from django_kvcache.management.commands._mysql import MySQLCacheCommand
from django_kvcache.mysql.maintenance import create_tables


class Command(MySQLCacheCommand):
    help = "Create the tables of MySQLCache caches that do not exist yet."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "--dry-run", action="store_true", help="Print the SQL instead of running it."
        )

    def handle(self, *args: Any, aliases: list[str], dry_run: bool, **options: Any) -> None:
        aliases = list(self.selected_caches(aliases))
        created = create_tables(aliases, dry_run=dry_run) if aliases else {}
        for alias in aliases:
            if alias not in created:
                self.stdout.write(f"{alias}: table exists")
            elif dry_run:
                self.stdout.write(f"-- {alias}\n{created[alias]};")
            else:
                self.stdout.write(f"{alias}: created table")
