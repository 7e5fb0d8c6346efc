"""Django's ``migrate``, whose system checks know the cache tables it is about to create.

``migrate`` runs the checks before anything else, and django_kvcache's ``pre_migrate``
receiver creates the missing MySQLCache tables of the database right after: without this
override, kvcache.W001 would tell the user to run ``migrate`` (or ``kvcache_createtable``)
in the very run that creates them. With ``--plan`` or ``--check`` nothing is created, and
the warning stays. Apps in INSTALLED_APPS override Django's own commands of the same name.
"""
from __future__ import annotations

from typing import Any

from django.core.management.commands import migrate
from django.db import DEFAULT_DB_ALIAS

from django_kvcache.checks import migrating


class Command(migrate.Command):
    def execute(self, *args: Any, **options: Any) -> Any:
        creates = not (options.get("plan") or options.get("check_unapplied"))
        database = options.get("database") or DEFAULT_DB_ALIAS
        with migrating([database] if creates else []):
            return super().execute(*args, **options)
