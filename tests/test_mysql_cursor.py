"""How MySQLCache sends a statement: on the DB-API cursor of the open connection while
nobody watches statements and no transaction is open, through Django's cursor otherwise
(so DEBUG, assertNumQueries and execute_wrapper() still see every statement)."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
from django.db import ProgrammingError, connections, transaction
from django.test.utils import CaptureQueriesContext

from django_kvcache.backends.mysql import CacheTableMissing, MySQLCache
from tests.mysql_support import cache, mysql_tables  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)

@pytest.fixture
def django_cursors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the cursors Django's connection creates (every statement through
    ``connection.cursor()`` asks for one)."""
    connection = connections["default"]
    created = [0]
    create_cursor = connection.create_cursor

    def counting(*args: Any, **kwargs: Any) -> Any:
        created[0] += 1
        return create_cursor(*args, **kwargs)

    monkeypatch.setattr(connection, "create_cursor", counting)
    yield created


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
