"""The benchmark's clean-up after a Ctrl-C: the statement it cut off left this thread's
connection out of sync, and every table dropped through that connection stayed (the
interrupted run of tests/test_benchmark_site.py met it when the signal landed inside a
DatabaseCache statement; here the connection is put in that state on purpose)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from django.db import connections

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmark_app"))

from kvcache_bench import run, storage  # noqa: E402
from kvcache_bench.caches import DJANGO_DB, KV_MYSQL, CacheSpec  # noqa: E402
from kvcache_bench.context import Context, Parameters  # noqa: E402


def tables() -> set[str]:
    with connections["default"].cursor() as cursor:
        cursor.execute("SHOW TABLES LIKE 'kvbench_cleanup_%'")
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.django_db(transaction=True)
def test_a_connection_cut_off_mid_statement_does_not_keep_the_tables():
    specs = [
        CacheSpec("db", "DatabaseCache", "db", DJANGO_DB, "kvbench_cleanup_db", "p1",
                  database="default"),
        CacheSpec("auto", "MySQLCache, auto", "kv-mysql", KV_MYSQL, "kvbench_cleanup_auto",
                  "p2", options={"COMPRESS_DICTIONARY": "auto"}, database="default"),
    ]
    context = Context("cleanup", Parameters(), [], None, [])
    for spec in specs:
        context.caches.append(spec)
        storage.create_storage(spec, context.cache(spec))
    assert tables() == {"kvbench_cleanup_db", "kvbench_cleanup_auto",
                        "kvbench_cleanup_auto_locks", "kvbench_cleanup_auto_dictionaries"}
    # What Ctrl-C left there: the signal raised KeyboardInterrupt as MySQLdb's query()
    # returned, before the cursor stored its result: the next statement on that
    # connection fails with "Commands out of sync" (2014).
    connections["default"].connection.query(b"SELECT COUNT(*) FROM kvbench_cleanup_db")
    run._clean_up(context)
    assert tables() == set(), context.notes
