"""Every statement MySQLCache sends, checked with the server's own plan (issue 41 §2).

Each operation runs on a table larger than the full cull's batch, and every statement is
checked just before it is sent, on the table as it then is: explained (``EXPLAIN``:
which index) and run under MariaDB's ``ANALYZE`` in a transaction rolled back
(``r_rows``: the rows it really read). It must use the primary key or the expiry index
(MAX_SIZE's estimate: its sample index, a range of SAMPLE_ROWS + 1 entries) and read no
more rows than it names keys, or its ``LIMIT`` (plus ``OFFSET``: the limit check and the
eviction's bound read up to MAX_ENTRIES index entries, by design; docs/mysql.rst,
"Culling"). An INSERT reads only the row its key names (a duplicate-key lookup EXPLAIN
does not show): its plan must read nothing. The culls delete a few percent of the table,
as on a large cache: a DELETE of a large part of a table in one statement may be planned
as a scan of the whole table (MariaDB's choice, and cheaper there), as may a batch of
10,000 on a table not much larger than that, or whose expiry index holds many entries
InnoDB has not purged yet (its estimates count them).
"""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
from django.db import connections, transaction

from django_kvcache.mysql import budget, connection, culling
from tests.mysql_support import drop_table, make_cache, sql

TABLE = "kvcache_explain"
#: Three full cull batches: on a table not much larger than its LIMIT, MariaDB may
#: prefer scanning (and sorting) the whole small table to a range of the expiry index.
ROWS = 3 * culling.FULL_CULL_BATCH_SIZE
KEYS = {"PRIMARY", "kvcache_expires", budget.SAMPLE_INDEX}

pytestmark = pytest.mark.django_db(transaction=True)


def drop() -> None:
    for table in (TABLE, TABLE + "_locks"):
        drop_table(table)


@pytest.fixture(scope="module")
def filled(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    with django_db_blocker.unblock():
        if not connections["default"].mysql_is_mariadb:
            pytest.skip("ANALYZE FORMAT=JSON is MariaDB's (MySQL has EXPLAIN ANALYZE)")
        drop()
        fill(make_cache(TABLE, OPTIONS={"MAX_SIZE": 10**9}))
        sql(f"ANALYZE TABLE `{TABLE}`")
        yield
        drop()


def fill(cache: Any) -> None:
    for start in range(0, ROWS, 2000):
        cache.set_many({f"k{i}": os.urandom(100) for i in range(start, start + 2000)})


def analyzed(statement: str) -> dict[str, Any]:
    """MariaDB's ANALYZE of ``statement``, rolled back: its plan with ``r_rows``."""
    with transaction.atomic():
        with connections["default"].cursor() as cursor:
            cursor.execute("ANALYZE FORMAT=JSON " + statement.replace("%", "%%"))
            document = json.loads(cursor.fetchone()[0])
        transaction.set_rollback(True)
    return document


def tables_of(plan: Any) -> Iterator[dict[str, Any]]:
    """Every table access in a JSON plan."""
    if isinstance(plan, dict):
        if "table_name" in plan:
            yield plan
        for value in plan.values():
            yield from tables_of(value)
    elif isinstance(plan, list):
        for value in plan:
            yield from tables_of(value)


LIMIT = re.compile(r"LIMIT (\d+)(?: OFFSET (\d+))?")


def allowed_rows(statement: str) -> int:
    """The most rows ``statement`` may read (per table): its keys, else its LIMIT
    (+ OFFSET)."""
    keys = statement.count("':1:")
    limit = LIMIT.search(statement)
    if limit is None:
        assert keys, f"neither keys nor a LIMIT bound {statement[:200]}"
        return keys
    return int(limit.group(1)) + int(limit.group(2) or 0)


def check(statement: str) -> None:
    if statement == budget.LAYOUT_QUERY % tuple(f"'{name}'" for name in (
            TABLE, TABLE, budget.size_table(TABLE))):
        return  # the dictionary's, once a minute per process: no table of the cache's
    with connections["default"].cursor() as cursor:  # Django's: not the cache's own
        cursor.execute("EXPLAIN " + statement.replace("%", "%%"))
        explained = cursor.fetchall()
    if statement.startswith("INSERT"):
        assert [(row[4], row[5], row[8]) for row in explained] == [(None, None, None)], (
            statement[:200], [row[2:] for row in explained])
        return
    for row in explained:  # (a derived table holds what an indexed read picked; no table:
        # the server answered from a primary-key lookup, "Impossible WHERE ... const")
        assert row[5] in KEYS or (row[2] or "<derived").startswith("<derived"), (
            statement[:200], explained)
    most = allowed_rows(statement)
    for table in tables_of(analyzed(statement)):
        derived = (table.get("table_name") or "").startswith("<derived")
        assert derived or table.get("key") in KEYS, (statement[:200], table)
        assert (table.get("r_rows") or 0) <= most, (statement[:200], table.get("r_rows"), most)


@contextmanager
def checked_as_sent() -> Iterator[list[str]]:
    """Each statement the cache sends checked just before it runs, on the table as it
    then is; the statements, and the first failure raised when the block ends (inside
    the driver it would be the call's failure)."""
    sent: list[str] = []
    failures: list[BaseException] = []
    before = connection.statement_bytes

    def checking(raw: Any, statement: str, params: Any) -> bytes:
        sent_bytes = before(raw, statement, params)
        text = sent_bytes.decode(raw.encoding, "replace")
        sent.append(text)
        try:
            check(text)
        except BaseException as failure:  # noqa: B036  (handed to the test below)
            failures.append(failure)
        return sent_bytes

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(connection, "statement_bytes", checking)
        yield sent
    if failures:
        raise failures[0]


def operations(cache: Any) -> dict[str, Callable[[], Any]]:
    return {
        "get": lambda: cache.get("k1"),
        "get_many": lambda: cache.get_many([f"k{i}" for i in range(20)]),
        "has_key": lambda: cache.has_key("k2"),
        "ttl": lambda: cache.ttl("k3"),
        "set": lambda: cache.set("k4", os.urandom(3000)),
        "set_many": lambda: cache.set_many({f"m{i}": i for i in range(20)}),
        "add": lambda: cache.add("k5", 1),
        "incr": lambda: cache.incr("n", 5),
        "touch": lambda: cache.touch("k6", 600),
        "delete": lambda: cache.delete("k7"),
        "delete_many": lambda: cache.delete_many([f"k{i}" for i in range(100, 120)]),
    }


@pytest.mark.parametrize("name", list(operations(None)))
def test_every_operation_reads_by_key(filled, name):
    cache = make_cache(TABLE, OPTIONS={"MAX_SIZE": 10**9})
    cache.set("n", 1)
    with checked_as_sent() as sent:
        operations(cache)[name]()
    assert sent


@pytest.mark.parametrize("options", [
    {"MAX_ENTRIES": ROWS - 200, "CULL_FREQUENCY": 100},
    {"MAX_SIZE": 0.98, "MAX_ENTRIES": 10 * ROWS},  # (Django's default MAX_ENTRIES is 300)
    {"MAX_ENTRIES": ROWS - 200, "CULL_FREQUENCY": 100, "MAX_SIZE": 0.98,
     "STALE_TIMEOUT": 30, "LEASE_TIMEOUT": 10},
], ids=["max_entries", "max_size", "both"])
def test_the_cull_and_the_budget_walk_the_expiry_index(filled, options):
    """A cull of a few percent of the table (MAX_SIZE: a fraction of what it holds): as
    one of a large cache on the write path or from cron."""
    # A table of its own, filled by inserts: rewriting every row would leave 30,000
    # delete-marked entries in the expiry index until InnoDB purges them, which the
    # optimizer's estimates count.
    drop()
    fill(make_cache(TABLE, OPTIONS={"MAX_SIZE": 10**9}))
    sql(f"ANALYZE TABLE `{TABLE}`")
    if "MAX_SIZE" in options:
        options = {**options, "MAX_SIZE": int(options["MAX_SIZE"] * int(sql(
            f"SELECT SUM(LENGTH(`cache_key`) + LENGTH(`value`)) FROM `{TABLE}`")[0][0]))}
    cache = make_cache(TABLE, OPTIONS=options)
    sql(f"UPDATE `{TABLE}` SET `expires` = 1 WHERE `cache_key` LIKE ':1:k1__'")  # 100 rows
    with checked_as_sent() as sent:
        assert cache.cull() > 100
    assert "ORDER BY `expires`" in " ".join(sent)
    if "MAX_SIZE" in options:  # the estimate read a range of its index (ROWS > its sample)
        assert any(f"FORCE INDEX (`{budget.SAMPLE_INDEX}`)" in text for text in sent)


def test_evicting_within_the_first_expiry_reads_no_range_of_keys(filled):
    """The entries to evict (most of the earliest expiry) have the keys that sort last: a
    range of the primary key up to the last of them is nearly the whole table."""
    drop()
    cache = make_cache(TABLE, OPTIONS={"MAX_ENTRIES": 19_500, "CULL_FREQUENCY": 40})
    for group in range(20):
        cache.set_many({f"k{19 - group:02}-{i:05}": os.urandom(50) for i in range(1000)},
                       timeout=600 + group)
    sql(f"ANALYZE TABLE `{TABLE}`")
    with checked_as_sent() as sent:
        assert cache.cull() == 20_000 - (19_500 - 487)
    assert sent
    assert not cache.get_many([f"k19-{i:05}" for i in range(987)])
    assert len(cache.get_many([f"k19-{i:05}" for i in range(987, 1000)])) == 13
