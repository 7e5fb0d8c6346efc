"""What the kvcache MySQL commands share: the cache aliases argument."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from django_kvcache.maintenance import UnknownCache, mysql_caches

if TYPE_CHECKING:  # imported through CACHES, by a site that has a MySQLCache
    from django_kvcache.backends.mysql import MySQLCache


class MySQLCacheCommand(BaseCommand):
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "aliases", nargs="*", metavar="alias",
            help="Cache aliases (default: every MySQLCache in CACHES).",
        )

    def selected_caches(self, aliases: list[str]) -> dict[str, MySQLCache]:
        """``{alias: cache}``; an unknown alias, or a cache that cannot be built, stops
        the command with one line."""
        try:
            return mysql_caches(aliases)
        except (UnknownCache, ImproperlyConfigured) as exc:  # the latter names its cache
            raise CommandError(str(exc)) from exc
