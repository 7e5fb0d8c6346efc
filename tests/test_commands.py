"""What the kvcache management commands do when they fail: one line naming the cache alias
and the fix, a non-zero exit (``CommandError``), the traceback only with ``--traceback``."""
from __future__ import annotations

import socket
from io import StringIO
from typing import Iterator

import pytest
from django.core.cache import caches
from django.core.management import CommandError, ManagementUtility, call_command
from django.db import OperationalError
from django.test import override_settings

from tests.mysql_support import BACKEND, drop_table
from tests.test_mysql_test_databases import add_alias, remove_alias

LOCMEM = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def unreachable_database(django_db_blocker) -> Iterator[str]:
    """A DATABASES alias whose server is not running, and a MySQLCache "down" on it."""
    entry = {"ENGINE": "django.db.backends.mysql", "NAME": "kvcache", "HOST": "127.0.0.1",
             "PORT": str(closed_port()), "USER": "kvcache", "PASSWORD": ""}
    add_alias("unreachable", entry)
    cache = {"BACKEND": BACKEND, "LOCATION": "kvcache_cmd_down",
             "OPTIONS": {"DATABASE": "unreachable"}}
    try:
        with django_db_blocker.unblock(), override_settings(CACHES={"default": LOCMEM,
                                                                    "down": cache}):
            yield "unreachable"
    finally:
        remove_alias("unreachable")


def failure(*argv: str) -> CommandError:
    with pytest.raises(CommandError) as raised:
        call_command(*argv, stdout=StringIO(), stderr=StringIO())
    assert "\n" not in str(raised.value)  # one line
    return raised.value


@pytest.mark.parametrize("command", ["kvcache_createtable", "kvcache_cull", "kvcache_migration"])
def test_a_database_that_cannot_be_reached_is_one_line_naming_the_alias(
    unreachable_database, command
):
    error = failure(command, "down")
    assert str(error).startswith("down: cannot use its database (OperationalError 200")
    assert str(error).endswith(
        "Check that the server is running and DATABASES['unreachable'] (HOST, PORT, NAME, "
        "USER, PASSWORD)."
    )
    assert isinstance(error.__cause__, OperationalError)  # for --traceback


@pytest.mark.django_db(transaction=True)
def test_cull_of_a_missing_table_is_one_line_with_the_command_that_creates_it():
    drop_table("kvcache_cmd_lost")
    with override_settings(CACHES={"default": LOCMEM,
                                   "lost": {"BACKEND": BACKEND, "LOCATION": "kvcache_cmd_lost"}}):
        error = failure("kvcache_cull", "lost")
    assert str(error) == (
        "lost: The table 'kvcache_cmd_lost' of cache 'lost' does not exist in database "
        "'default'. Create it with 'manage.py kvcache_createtable lost' (or 'manage.py "
        "migrate', which creates it first)."
    )


@pytest.mark.django_db(transaction=True)
def test_train_dictionary_without_zstd_is_one_line_naming_the_alias(without_zstd, tmp_path):
    table = "kvcache_cmd_train"
    configured = {"BACKEND": BACKEND, "LOCATION": table,
                  "OPTIONS": {"COMPRESSOR": "django_kvcache.codec.ZlibCompressor"}}
    with override_settings(CACHES={"default": LOCMEM, "sampled": configured}):
        cache = caches["sampled"]
        cache.create_table()
        try:
            cache.set_many({f"page:{n}": f"<p>page {n}</p>" * 20 for n in range(30)})
            error = failure("kvcache_train_dictionary", "sampled", "--output",
                            str(tmp_path / "d"))
        finally:
            drop_table(table)
    assert str(error).startswith("sampled: ") and "zstd" in str(error)
    assert not (tmp_path / "d").exists()


def test_a_cache_that_cannot_be_built_is_one_line_naming_it():
    broken = {"BACKEND": BACKEND, "LOCATION": "t", "OPTIONS": {"max_entries": 5}}
    with override_settings(CACHES={"default": LOCMEM, "broken": broken}):
        error = failure("kvcache_cull", "broken")
    assert str(error).startswith("CACHES['broken']['OPTIONS'] has unknown keys: max_entries "
                                 "(did you mean MAX_ENTRIES?)")


def test_on_the_command_line_a_failure_is_one_line_and_exit_status_1(
    unreachable_database, capsys
):
    with pytest.raises(SystemExit) as exited:
        ManagementUtility(["manage.py", "kvcache_cull", "down"]).execute()
    assert exited.value.code == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("CommandError: down: cannot use its database")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_with_traceback_the_error_is_raised_with_its_cause(unreachable_database):
    with pytest.raises(CommandError) as raised:
        ManagementUtility(["manage.py", "kvcache_cull", "down", "--traceback"]).execute()
    assert isinstance(raised.value.__cause__, OperationalError)
