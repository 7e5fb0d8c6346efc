"""``manage.py kvcache_migration [alias ...] > app/migrations/0002_cache_tables.py``."""
from __future__ import annotations

from typing import Any

from django_kvcache.management.commands._mysql import MySQLCacheCommand
from django_kvcache.maintenance import migration_source


class Command(MySQLCacheCommand):
    help = (
        "Print a migration module that creates the MySQLCache tables (one RunSQL with "
        "its reverse per table). Save it into one of your apps' migrations."
    )

    def handle(self, *args: Any, aliases: list[str], **options: Any) -> None:
        self.stdout.write(migration_source(list(self.selected_caches(aliases))), ending="")
