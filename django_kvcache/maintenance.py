"""Table creation, migrations and culling over every MySQLCache in ``CACHES``.

With ``django_kvcache`` in INSTALLED_APPS, ``prepare_migrate`` runs before migrations
run on a database (``pre_migrate``): in ``manage.py migrate`` and in every test
database the test runner builds, the tables of the caches that live there exist before
any migration or ``post_migrate`` receiver may write to them.

The management commands are thin wrappers around these functions; ``cull_all`` is also
meant to be called from a periodic task (Celery beat, RQ scheduler...)::

    from django_kvcache.maintenance import cull_all

    @app.task
    def cull_caches():
        return cull_all()

It lives above the backend (the helper package ``django_kvcache.mysql`` never imports it),
and imports the backend only through ``CACHES``: a site without a MySQLCache (without
mysqlclient, say) runs ``migrate`` without importing any of it.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from django.conf import settings
from django.core.cache import caches
from django.db import DatabaseError, connections, router

from django_kvcache.configured import is_mysql_cache, mysql_cache_aliases

if TYPE_CHECKING:  # the MySQL backend is imported only by a site that configures it
    from django_kvcache.backends.mysql import MySQLCache

logger = logging.getLogger(__name__)


class UnknownCache(LookupError):
    """An alias that is not in ``CACHES`` or is not a MySQLCache."""


def mysql_caches(aliases: Iterable[str] | None = None) -> dict[str, MySQLCache]:
    """``{alias: cache}`` for the given aliases, or for every MySQLCache in CACHES."""
    if not aliases:
        aliases = mysql_cache_aliases()
    found = {}
    for alias in aliases:
        if alias not in settings.CACHES:
            raise UnknownCache(f"No cache named {alias!r} in CACHES")
        if not is_mysql_cache(alias):
            raise UnknownCache(f"Cache {alias!r} is not a MySQLCache")
        found[alias] = caches[alias]
    return found


def create_tables(aliases: Iterable[str] | None = None, dry_run: bool = False) -> dict[str, str]:
    """Create every missing table, on every shard of each cache; returns ``{alias: SQL}``
    of what was (or would be) run, one statement per line preceded by a ``-- database``
    comment when the cache has several shards."""
    done = {}
    for alias, cache in mysql_caches(aliases).items():
        sharded = len(cache.shards) > 1
        statements = []
        for database in cache.database_aliases():
            refuse_other_layout(cache, database)  # before its side tables are made
            if cache.table_exists(database):
                continue
            statement = ";\n".join([cache.create_table_sql(database),
                                    *cache.upgrade_table_sql(database)])
            if not dry_run:
                cache.create_table(database)
            statements.append(f"-- database {database}\n{statement}" if sharded else statement)
        if statements:
            done[alias] = ";\n".join(statements)
    return done


def create_tables_in(database: str, dry_run: bool = False) -> dict[str, str]:
    """Create the missing tables of the caches that live in ``database`` and that the
    database routers let migrate there (``allow_migrate``, as Django's
    ``createcachetable`` asks for DatabaseCache); returns ``{alias: SQL}`` as
    ``create_tables``."""
    return {alias: sql for alias, (sql, _, _) in _create_missing_in(database, dry_run).items()}


def _create_missing_in(
    database: str, dry_run: bool = False
) -> dict[str, tuple[str, list[str], list[str]]]:
    """``create_tables_in``, with the names of the tables each cache lacked and what its
    table's upgrade did: ``{alias: (SQL, [table, ...], ["column key_hash", ...])}``."""
    done = {}
    for alias, cache in caches_in(database).items():
        if not router.allow_migrate_model(database, cache.cache_model_class):
            continue
        refuse_other_layout(cache, database)  # before its side tables are made
        missing = cache.missing_tables(database)
        outdated = [] if cache.table in missing else cache.outdated_table(database)
        if not missing and not outdated:
            continue
        statement = ";\n".join([cache.create_table_sql(database),
                                *cache.upgrade_table_sql(database)])
        done[alias] = (statement, missing, outdated)
        if not dry_run:
            cache.create_table(database)
            if missing:
                logger.info("Created the tables %s of cache %r in database %r",
                            table_names(missing), alias, database)
            if outdated:
                logger.info("Upgraded the table %r of cache %r in database %r: %s",
                            cache.table, alias, database, ", ".join(outdated))
    return done


def table_names(tables: list[str]) -> str:
    """``'a'``, ``'a' and 'b'``, ``'a', 'b' and 'c'``."""
    quoted = [repr(table) for table in tables]
    return " and ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)


def refuse_other_layout(cache: MySQLCache, database: str) -> None:
    """An existing table of another layout (django-mysql's, DatabaseCache's...) is no
    table of the cache's: ``CacheTableLayout``, saying whose it looks like and the fix."""
    from django_kvcache.mysql.layouts import CacheTableLayout

    problem = cache.table_layout_problem(database)
    if problem is not None:
        raise CacheTableLayout(" ".join(problem))


def caches_in(database: str) -> dict[str, MySQLCache]:
    """The MySQLCaches whose table lives in ``database``.

    Django's test runner calls ``migrate`` and ``createcachetable --database <alias>``
    for each test database it creates, and not for a ``TEST["MIRROR"]`` alias, which at
    that moment still points at the real database. So a cache whose alias is
    ``database``, mirrors it in tests, or is another connection to the same database
    (same HOST, PORT and NAME), counts as living there.
    """
    if connections[database].vendor != "mysql":
        return {}
    return {
        alias: cache
        for alias, cache in mysql_caches().items()
        if any(lives_in(own, database) for own in cache.database_aliases())
    }


def lives_in(alias: str, database: str) -> bool:
    """Whether the alias ``alias`` reaches the database of the alias ``database``."""
    if alias == database or mirrored(alias) == database:
        return True
    own, other = connections[alias].settings_dict, connections[database].settings_dict
    return all(own.get(name) == other.get(name) for name in ("HOST", "PORT", "NAME"))


def mirrored(alias: str) -> str | None:
    """The alias that ``alias`` is a ``TEST["MIRROR"]`` of, if any."""
    return (connections[alias].settings_dict.get("TEST") or {}).get("MIRROR")


def follow_test_mirror(database: str) -> None:
    """Point the caches' mirror aliases of ``database`` at its test database now, when
    the test runner is building it, instead of after every test database is built.

    Until then a cache on a mirror alias (``"cache"``, ``TEST: {"MIRROR": "default"}``)
    still reaches the real database: a ``post_migrate`` receiver that writes to it while
    the test database is migrated (django-cachalot does) would write to, or miss the
    table of, the real database. The test database is known by its name: its TEST NAME,
    or ``test_`` and the mirror's (unchanged) NAME, which a real ``migrate`` never sees.
    """
    primary = connections[database].settings_dict
    for cache in caches_in(database).values():
        for alias in cache.database_aliases():
            if alias == database or mirrored(alias) != database:
                continue
            from django_kvcache.mysql.connect import is_test_database_of  # (MySQLCache only)

            mirror = connections[alias]
            if is_test_database_of(primary, mirror.settings_dict):
                mirror.close()  # an open connection would stay on the real database
                mirror.creation.set_as_test_mirror(primary)
                follow_mirror(alias, primary)


def follow_mirror(alias: str, settings: dict[str, Any]) -> None:
    """The cache's own connections to ``alias`` reach the database of ``settings`` from
    now on, in every thread (idle ones to the real database are closed)."""
    from django_kvcache.mysql import blocking, connect  # (a site with MySQLCache only)

    connect.remember_mirror(alias, settings)
    blocking.retire_pools([alias])


def prepare_migrate(
    sender: Any, using: str, verbosity: int = 1, stdout: Any = None, **kwargs: Any
) -> None:
    """``pre_migrate``: create the missing tables of the caches that live in ``using``
    before any migration runs there (and, while the test runner builds a test database,
    point their mirror aliases at it first)."""
    follow_test_mirror(using)
    created = _create_missing_in(using)
    if verbosity >= 1 and stdout is not None:
        for alias, (_, tables, outdated) in created.items():
            if tables:
                noun = "tables" if len(tables) > 1 else "table"
                stdout.write(f"  Created the {noun} {table_names(tables)} of cache {alias!r}.\n")
            if outdated:
                stdout.write(f"  Upgraded the table of cache {alias!r} for MAX_SIZE: "
                             f"{', '.join(outdated)}.\n")


def cull_all(aliases: Iterable[str] | None = None) -> dict[str, int]:
    """Cull every MySQLCache (or the given ones); returns ``{alias: rows deleted}``.

    A cache whose cull fails (a shard down, whatever IGNORE_EXCEPTIONS says) is logged and
    the others are culled all the same; then its error is raised (a cron job fails
    loudly).
    """
    culled: dict[str, int] = {}
    failure: DatabaseError | None = None
    for alias, cache in mysql_caches(aliases).items():
        try:
            culled[alias] = cache.cull(fail_open=False)
        except DatabaseError as exc:
            logger.error("Cull of cache %r failed: %s: %s", alias, type(exc).__name__, exc)
            failure = failure or exc
    if failure is not None:
        raise failure
    return culled


MIGRATION_TEMPLATE = '''"""Cache tables of django-kvcache's MySQLCache ({aliases}).{databases}

Each table's collation is binary and NO PAD ("a" and "a " are two keys); MariaDB and
MySQL 8 name it differently, so it is the one of the server the migration runs on.
"""
from django.db import migrations

COLLATION = "{placeholder}"
COLLATIONS = {{"mariadb": "{mariadb}", "mysql": "{mysql}"}}
CREATE = [
{creates}]
DROP = [
{drops}]


def create_tables(apps, schema_editor):
    flavour = "mariadb" if schema_editor.connection.mysql_is_mariadb else "mysql"
    for statement in CREATE:
        schema_editor.execute(statement.replace(COLLATION, COLLATIONS[flavour]), None)


def drop_tables(apps, schema_editor):
    for statement in DROP:
        schema_editor.execute(statement, None)


class Migration(migrations.Migration):
    dependencies = []

    operations = [migrations.RunPython(create_tables, drop_tables)]
'''

#: Where the migration puts the collation of the server it runs on.
COLLATION_PLACEHOLDER = "{kvcache-collation}"


def python_literal(sql: str) -> str:
    """``sql`` as a readable triple-quoted literal when that is safe, else its repr."""
    if '"""' in sql or "\\" in sql or sql.endswith('"'):
        return repr(sql)
    indented = sql.replace("\n", "\n" + " " * 12)
    return f'"""\n{" " * 12}{indented}\n{" " * 12}"""'


def migration_source(aliases: Iterable[str] | None = None) -> str:
    """A migration module creating each cache's table (dropping it when reversed), with
    the collation of the server it is applied to."""
    from django_kvcache.mysql.sql import MARIADB_COLLATION, MYSQL_COLLATION

    selected = mysql_caches(aliases)
    tables: dict[str, MySQLCache] = {}
    for cache in selected.values():  # two aliases may share one table
        tables.setdefault(cache.table, cache)
    creates = "".join(
        f"    {python_literal(cache.create_table_sql(collation=COLLATION_PLACEHOLDER))},\n"
        for cache in tables.values()
    )
    drops = "".join(f"    {cache.drop_table_sql()!r},\n" for cache in tables.values())
    return MIGRATION_TEMPLATE.format(
        aliases=", ".join(selected), databases=databases_note(selected), creates=creates,
        drops=drops, placeholder=COLLATION_PLACEHOLDER, mariadb=MARIADB_COLLATION,
        mysql=MYSQL_COLLATION,
    )


def databases_note(selected: dict[str, MySQLCache]) -> str:
    """Where to apply the migration, when some cache lives on more than one database."""
    databases = sorted({alias for cache in selected.values() for alias in cache.database_aliases()})
    if not any(len(cache.shards) > 1 for cache in selected.values()):
        return ""
    commands = "".join(f"\n    manage.py migrate --database {alias}" for alias in databases)
    return f"\n\nApply it on every shard:\n{commands}\n"
