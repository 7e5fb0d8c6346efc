"""``manage.py kvcache_migration [alias ...] > app/migrations/0002_cache_tables.py``."""
from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from django_kvcache.management.commands._errors import failing
from django_kvcache.management.commands._mysql import MySQLCacheCommand, no_mysql_cache
from django_kvcache.maintenance import migration_source


class Command(MySQLCacheCommand):
    help = (
        "Print a migration module that creates the MySQLCache tables (one RunSQL with "
        "its reverse per table). Save it into one of your apps' migrations."
    )

    def handle(self, *args: Any, aliases: list[str], **options: Any) -> None:
        selected = self.selected_caches(aliases, verbosity=0)
        if not selected:  # an empty migration saved in an app would only mislead: exit 1
            raise CommandError(no_mysql_cache("no migration to write"))
        for alias, cache in selected.items():  # the SQL depends on the server: ask each
            with failing(alias, cache):
                cache.create_table_sql()
        self.stdout.write(migration_source(list(selected)), ending="")
