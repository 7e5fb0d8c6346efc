"""What the kvcache MySQL commands share: the cache aliases argument, and what they say
on a site without a MySQLCache."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from django_kvcache.configured import MYSQL_BACKEND_MODULE
from django_kvcache.maintenance import UnknownCache, mysql_caches

if TYPE_CHECKING:  # imported through CACHES, by a site that has a MySQLCache
    from django_kvcache.backends.mysql import MySQLCache


def no_mysql_cache(nothing: str) -> str:
    """The line a MySQL command prints when CACHES has no MySQLCache: what it looked for
    and that there is ``nothing`` to do."""
    aliases = ", ".join(repr(alias) for alias in settings.CACHES) or "none"
    return (f"no MySQLCache in CACHES (no BACKEND of {aliases} is "
            f"{MYSQL_BACKEND_MODULE}.MySQLCache or a subclass): {nothing}.")


class MySQLCacheCommand(BaseCommand):
    requires_system_checks: list[str] = []
    #: What there is not to do without a MySQLCache ("nothing to cull").
    nothing = "nothing to do"

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "aliases", nargs="*", metavar="alias",
            help="Cache aliases (default: every MySQLCache in CACHES).",
        )

    def selected_caches(self, aliases: list[str], verbosity: int = 1) -> dict[str, MySQLCache]:
        """``{alias: cache}``; an unknown alias, or a cache that cannot be built, stops
        the command with one line. Without aliases on a site without a MySQLCache, the
        command says so (at verbosity 1 and up) and does nothing: a site on memcached
        has no table, which is no failure (exit status 0, and a cron line with ``-v 0``
        stays silent)."""
        try:
            selected = mysql_caches(aliases)
        except (UnknownCache, ImproperlyConfigured) as exc:  # the latter names its cache
            raise CommandError(str(exc)) from exc
        if not selected and verbosity >= 1:
            self.stdout.write(no_mysql_cache(self.nothing))
        return selected
