"""``manage.py kvcache_cull [alias ...]``: cull MySQLCache tables, e.g. from cron."""
from __future__ import annotations

from typing import Any

from django_kvcache.management.commands._errors import failing
from django_kvcache.management.commands._mysql import MySQLCacheCommand


class Command(MySQLCacheCommand):
    help = (
        "Delete expired entries of MySQLCache caches and evict down to MAX_ENTRIES; "
        "prints the rows deleted per cache (nothing with -v 0, for cron)."
    )
    nothing = "nothing to cull"

    def handle(self, *args: Any, aliases: list[str], verbosity: int, **options: Any) -> None:
        for alias, cache in self.selected_caches(aliases, verbosity).items():
            with failing(alias, cache):
                deleted = cache.cull(fail_open=False)  # a cron job fails loudly
            if verbosity >= 1:
                self.stdout.write(f"{alias}: {deleted} rows deleted")
