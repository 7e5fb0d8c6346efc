"""How MySQLCache sends a statement: on the backend's own cursor of the open connection
while nobody watches statements and no transaction is open, through Django's
``connection.cursor()`` otherwise (so DEBUG, assertNumQueries and execute_wrapper() still
see every statement, and Django's async and health checks still apply)."""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterator

import pytest
from django.core.exceptions import SynchronousOnlyOperation
from django.db import ProgrammingError, connections, transaction
from django.test.utils import CaptureQueriesContext

from django_kvcache.backends.mysql import CacheTableMissing, MySQLCache
from django_kvcache.codec import INT64_MAX
from tests.mysql_support import cache, mysql_tables  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)

@pytest.fixture
def django_cursors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the statements sent through Django's ``connection.cursor()``."""
    connection = connections["default"]
    calls = [0]
    cursor = connection.cursor

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return cursor(*args, **kwargs)

    monkeypatch.setattr(connection, "cursor", counting)
    yield calls


def operations(cache: Any) -> list[Callable[[], Any]]:
    return [lambda: cache.set("k", "v"), lambda: cache.get("k"), lambda: cache.add("a", 1),
            lambda: cache.incr("a"), lambda: cache.touch("k"), lambda: cache.delete("k"),
            lambda: cache.has_key("k")]


def test_an_unobserved_statement_outside_a_transaction_skips_django_s_cursor(cache, django_cursors):
    cache.get("warm-up")  # connected
    before = django_cursors[0]
    for operation in operations(cache):
        operation()
    assert django_cursors[0] == before
    assert cache.get("a") == 2  # and the statements did their work


def test_execute_wrapper_sees_every_statement(cache):
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql.split()[0])
        return execute(sql, params, many, context)

    cache.get("warm-up")
    with connections["default"].execute_wrapper(wrapper):
        for operation in operations(cache):
            operation()
    assert len(seen) == len(operations(cache))
    assert cache.get("a") == 2


def test_captured_queries_list_every_statement(cache):
    cache.get("warm-up")
    with CaptureQueriesContext(connections["default"]) as captured:
        for operation in operations(cache):
            operation()
    assert len(captured) == len(operations(cache))


def test_inside_a_transaction_statements_go_through_django_s_cursor(cache, django_cursors):
    cache.get("warm-up")
    before = django_cursors[0]
    with transaction.atomic():
        cache.set("k", "v")
        assert cache.get("k") == "v"
    assert django_cursors[0] == before + 2


def test_errors_on_the_direct_path_are_django_s(django_cursors):
    """MySQLdb's errors come out as Django's, as through Django's cursor: here a missing
    table's ProgrammingError, which the backend turns into CacheTableMissing."""
    cache = MySQLCache("kvcache_no_such_table", {"OPTIONS": {"CULL_PROBABILITY": 0}})
    connections["default"].ensure_connection()
    before = django_cursors[0]
    with pytest.raises(CacheTableMissing) as raised:
        cache.get("k")
    assert isinstance(raised.value.__cause__, ProgrammingError)
    assert django_cursors[0] == before


def test_a_sync_call_inside_an_event_loop_is_refused_as_django_refuses_it(cache, monkeypatch):
    """Also on a connection that is open (the loop's own, opened while Django was told
    to allow it): the direct path must not skip Django's check."""

    async def call() -> None:
        monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        cache.get("warm-up")  # connects
        assert connections["default"].connection is not None
        monkeypatch.delenv("DJANGO_ALLOW_ASYNC_UNSAFE")
        try:
            with pytest.raises(SynchronousOnlyOperation):
                cache.get("k")
        finally:
            monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
            connections["default"].close()

    asyncio.run(call())


def test_a_due_health_check_runs_before_the_statement(cache):
    connection = connections["default"]
    cache.get("warm-up")
    connection.health_check_enabled, connection.health_check_done = True, False
    try:
        cache.get("k")
        assert connection.health_check_done
    finally:
        connection.health_check_enabled = False


def test_an_incr_overflow_outside_a_transaction_changes_nothing(cache):
    """Error 1690 on the direct path, as on Django's cursor."""
    cache.set("n", INT64_MAX)
    with pytest.raises(OverflowError):
        cache.incr("n")
    assert cache.get("n") == INT64_MAX
