"""Django's ``createcachetable``, which also creates the MySQLCache tables of its database.

Django's test runner runs ``createcachetable --database <alias>`` for every test database
it creates, so ``manage.py test`` gets these tables as it gets ``DatabaseCache``'s (the
``pre_migrate`` receiver of django_kvcache made them already, before the migrations).
Apps in INSTALLED_APPS override Django's own commands of the same name.
"""
from __future__ import annotations

from typing import Any

from django.core.management.commands import createcachetable
from django.db import router

from django_kvcache.management.commands._errors import failing
from django_kvcache.maintenance import caches_in, create_tables_in


class Command(createcachetable.Command):
    help = (
        "Creates the tables of Django's database cache and of django-kvcache's MySQLCache "
        "in the given database."
    )

    def handle(self, *tablenames: str, **options: Any) -> None:
        super().handle(*tablenames, **options)
        if tablenames:  # Django's legacy form names DatabaseCache tables only
            return
        database, dry_run, verbosity = options["database"], options["dry_run"], options["verbosity"]
        with failing(f"database {database!r}"):
            created = create_tables_in(database, dry_run=dry_run)
        for alias, cache in caches_in(database).items():  # in Django's words and verbosity
            if not router.allow_migrate_model(database, cache.cache_model_class):
                continue  # not this database's, as Django skips a DatabaseCache table
            if alias not in created:
                if verbosity >= 2:
                    self.stdout.write(f"Cache table '{cache.table}' already exists.")
            elif dry_run:
                self.stdout.write(f"{created[alias]};")
            elif verbosity >= 2:
                self.stdout.write(f"Cache table '{cache.table}' created.")
