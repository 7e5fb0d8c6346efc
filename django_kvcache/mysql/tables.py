"""A MySQLCache's tables: their DDL, which of them exist, and what to say when one is
missing or is another library's.

Beside the cache table (LOCATION) live its lock table (``<LOCATION>_locks``,
:mod:`~django_kvcache.mysql.locks`) and, with ``COMPRESS_DICTIONARY: "auto"``, its
dictionary table (:mod:`~django_kvcache.mysql.dictionaries`): created together, dropped
together, reported together. With ``MAX_SIZE``, the cache table has two generated
columns and an index its estimate reads (:mod:`~django_kvcache.mysql.budget`): a table
made without them (before ``MAX_SIZE`` was set, or by the release that kept the total
with triggers in ``<LOCATION>_size``) is outdated, and ``kvcache_createtable`` or
``migrate`` upgrades it (adds them, drops the old triggers and size table); until then
the system check reports it (``kvcache.W004``). The DDL and the checks run outside any
request path, on the blocking driver (:func:`~django_kvcache.mysql.blocking.query`). The
messages read no database: a call that meets a table of another layout reads its columns
on its own driver first (:meth:`django_kvcache.mysql.plans.On.run`), and hands them
over.
"""
from __future__ import annotations

from typing import Any, Mapping

from django.apps import apps as django_apps
from django.conf import settings
from django.db import DatabaseError, ProgrammingError

from django_kvcache.configured import mysql_cache_aliases
from django_kvcache.mysql import blocking, budget, dictionaries, layouts
from django_kvcache.mysql.connect import DDL_SETTINGS
from django_kvcache.mysql.errors import CacheTableMissing
from django_kvcache.mysql.shards import shard_aliases
from django_kvcache.mysql.sql import (
    check_engine,
    create_lock_table_sql,
    create_table_sql,
    drop_lock_table_sql,
    drop_table_sql,
    lock_table,
    quote_name,
)

#: Between the statements of a cache's DDL (the table, its lock table, its dictionaries').
STATEMENT_SEPARATOR = ";\n"

#: What another process's upgrade of the same table answers to ours (``migrate`` on two
#: hosts at a deploy): 1060 duplicate column, 1061 duplicate key name. The statement's
#: work is done: the upgrade goes on with the next.
DONE_ALREADY = (1060, 1061)


def upgrade_step(database: str, statement: str) -> None:
    """One statement of an upgrade, taken as done when another process did it first."""
    try:
        blocking.query(database, statement, settings=DDL_SETTINGS)
    except DatabaseError as exc:
        if not (exc.args and exc.args[0] in DONE_ALREADY):
            raise


class CacheTables:
    """The tables of one MySQLCache configuration (LOCATION, ENGINE, COMPRESS_DICTIONARY,
    and where they live: DATABASE or DATABASES), the same on each of its databases."""

    def __init__(self, table: str, options: Mapping[str, Any], backend_name: str) -> None:
        self.table = table
        self.lock_table = lock_table(table)
        self.engine = check_engine(options.get("ENGINE", "InnoDB"))
        self.dictionaries = dictionaries.uses_stored_dictionaries(options)
        shard_aliases(options)  # a DATABASE or DATABASES that is not one raises, named
        self.placement = placement({"OPTIONS": options})
        self.budget = budget.max_size(dict(options)) is not None
        self.backend_name = backend_name

    def names(self) -> list[str]:
        """The table, its lock table, and with ``COMPRESS_DICTIONARY: "auto"`` its
        dictionary table."""
        names = [self.table, self.lock_table]
        if self.dictionaries:
            names.append(dictionaries.dictionary_table(self.table))
        return names

    # --- DDL -------------------------------------------------------------------------------

    def create_sql(self, database: str, collation: str | None = None) -> str:
        """The DDL for ``database``'s server (``collation``: another name of its binary NO
        PAD collation, or a placeholder for a migration)."""
        mariadb = blocking.server_info(database).mariadb
        statements = [
            create_table_sql(self.table, quote_name, mariadb, self.engine, collation,
                             sampled=self.budget),
            create_lock_table_sql(self.table, quote_name, mariadb, collation),
        ]
        if self.dictionaries:
            statements.append(dictionaries.create_table_sql(self.table, quote_name))
        return STATEMENT_SEPARATOR.join(statements)

    def upgrade_sql(self, database: str) -> list[str]:
        """What brings the existing table in ``database`` up to date (:meth:`outdated`):
        with MAX_SIZE, its estimate's columns and index added, the old size table and
        its triggers dropped; [] when there is nothing to do."""
        lacks = self.outdated(database)
        if not lacks:
            return []
        mariadb = blocking.server_info(database).mariadb
        return budget.upgrade_sql(self.table, quote_name, mariadb, self.engine, lacks)

    def outdated(self, database: str) -> list[str]:
        """What the existing table in ``database`` lacks, or keeps that is no longer used
        ("column key_hash", "trigger <LOCATION>_size_ins", ...); [] when up to date or
        missing. Only MAX_SIZE has such parts."""
        return budget.outdated(database, self.table) if self.budget else []

    def drop_sql(self) -> str:
        statements = [drop_table_sql(self.table, quote_name),
                      drop_lock_table_sql(self.table, quote_name)]
        if self.budget:  # the earlier release's totals, if the table never was upgraded
            statements.append(drop_table_sql(budget.size_table(self.table), quote_name))
        if self.dictionaries:
            statements.append(dictionaries.drop_table_sql(self.table, quote_name))
        return STATEMENT_SEPARATOR.join(statements)

    def create(self, databases: list[str]) -> str:
        """Create the tables where they are missing and upgrade an outdated one, in each
        of ``databases``; the DDL it ran (the last database's)."""
        statement = ""
        for database in databases:
            created = self.create_sql(database)
            for part in created.split(STATEMENT_SEPARATOR):
                blocking.query(database, part, settings=DDL_SETTINGS)
            # Asked once the table exists: a table just made again after a drop still
            # has the earlier release's size table beside it, to drop.
            upgrade = self.upgrade_sql(database)
            for part in upgrade:
                upgrade_step(database, part)
            statement = STATEMENT_SEPARATOR.join([created, *upgrade])
        budget.forget_layouts()  # this process's budget checks read the new layout
        return statement

    def missing(self, database: str) -> list[str]:
        """Which of :meth:`names` ``database`` lacks."""
        present = {row[0] for row in blocking.query(database, "SHOW TABLES")}
        return [name for name in self.names() if name not in present]

    def layout_problem(self, database: str) -> tuple[str, str] | None:
        """What is wrong with the layout of the table in ``database`` (another library's
        table under this name, say) and the fix, or ``None``: it is ours, or missing."""
        columns = table_columns(database, self.table)
        return self._layout_problem(database, columns) if columns else None

    # --- what to say (no database is read) ----------------------------------------------

    def layout_message(self, database: str, columns: list[str] | None,
                       error: BaseException) -> str:
        """After a statement's ``error`` (1054) in ``database``, where the table has
        ``columns`` (``None``: they could not be read)."""
        return " ".join(self._layout_problem(database, columns, error) or (str(error),))

    def missing_message(self, database: str, table: str | None = None) -> str:
        """The table (or ``table``, one of :meth:`names`) does not exist in ``database``."""
        aliases = self.configured_aliases()
        owner = self._owner(aliases)
        if not aliases:  # built outside CACHES
            fix = "Create it with cache.create_table()."
        elif not django_apps.is_installed("django_kvcache"):  # no commands, no pre_migrate
            fix = ("Add 'django_kvcache' to INSTALLED_APPS: then 'manage.py migrate' creates "
                   "it, and so does the test runner in test databases.")
        else:
            fix = (f"Create it with 'manage.py kvcache_createtable {' '.join(aliases)}' (or "
                   "'manage.py migrate', which creates it first).")
        return (f"The table {table or self.table!r} of {owner} does not exist in database "
                f"{database!r}. {fix}")

    def lock_table_missing(self, database: str, columns: list[str] | None) -> ProgrammingError:
        """The error for a lock table missing in ``database``, where the cache table has
        ``columns``. Beside a table of another layout (which ``kvcache_createtable``
        refuses to make a lock table for), that table is the problem: the error every
        other call of the cache gives."""
        problem = self._layout_problem(database, columns) if columns else None
        if problem is not None:
            return layouts.CacheTableLayout(" ".join(problem))
        return CacheTableMissing(self.missing_message(database, self.lock_table))

    def configured_aliases(self) -> list[str]:
        """The CACHES aliases configured with this table and these databases."""
        return [
            alias
            for alias in mysql_cache_aliases()
            if settings.CACHES[alias].get("LOCATION") == self.table
            and placement(settings.CACHES[alias]) == self.placement
        ]

    def _layout_problem(
        self, database: str, columns: list[str] | None, error: BaseException | None = None
    ) -> tuple[str, str] | None:
        aliases = self.configured_aliases()
        return layouts.describe(self.table, self._owner(aliases), database, columns,
                                " ".join(aliases) or "<alias>", error)

    def _owner(self, aliases: list[str]) -> str:
        if not aliases:
            return f"a {self.backend_name}"
        return "cache " + ", ".join(repr(alias) for alias in aliases)


def table_columns(database: str, table: str) -> list[str]:
    """``table``'s columns in ``database``, in order ([] if there is no such table)."""
    return [row[0] for row in blocking.query(database, layouts.COLUMNS_QUERY, [table])]


def placement(cache_settings: Mapping[str, Any]) -> tuple[Any, Any]:
    """The DATABASE and DATABASES of a CACHES entry: where its tables live."""
    options = cache_settings.get("OPTIONS") or {}
    databases = options.get("DATABASES")
    return options.get("DATABASE"), None if databases is None else tuple(databases)
