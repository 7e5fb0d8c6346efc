"""MySQLCache's REPLICAS and READ_YOUR_WRITES against a real replica that lags.

"shard2_replica" is a MariaDB server of its own that replicates shard2's server (binlog,
GTID; started by `scripts/services.py up`). These tests hold it back, with a
``MASTER_DELAY`` or with its SQL thread stopped, and show both sides of
READ_YOUR_WRITES: within the window a thread reads its own writes from the primary; after
it, its reads go to the replica and see what the replica has applied so far, which may be
older than what was written. That is the documented trade: the window covers the lag a
site expects, not every lag.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from django_kvcache.backends.mysql import MySQLCache
from tests.servers import Replica

PRIMARY, REPLICA = "shard2", "shard2_replica"
TABLE = "kvcache_replica"
#: MASTER_DELAY of the lag tests: an event is applied LAG - 1 to LAG seconds after it was
#: written (MariaDB times events in whole seconds).
LAG = 4
WINDOW = 0.5  # READ_YOUR_WRITES of these tests

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", PRIMARY, REPLICA])


def replicated(replica: Replica, **options: Any) -> MySQLCache:
    cache = MySQLCache(TABLE, {"OPTIONS": {
        "DATABASE": PRIMARY, "REPLICAS": {PRIMARY: REPLICA}, "CULL_PROBABILITY": 0, **options}})
    if not cache.table_exists():
        cache.create_table()
        replica.caught_up()  # the table reaches the replica
    return cache


@pytest.fixture
def cache(replica: Replica) -> MySQLCache:
    cache = replicated(replica, READ_YOUR_WRITES=WINDOW)
    cache.clear()
    replica.caught_up()
    yield cache
    cache.clear()


KEYS = ["page", "gone", "added", "hits"]


def test_within_the_window_own_writes_after_it_the_lagging_replica(cache, replica):
    cache.set_many({"page": "old", "gone": "old", "hits": 1})
    replica.caught_up()
    other = replicated(replica)  # other OPTIONS (the default window): it wrote nothing
    with replica.delayed(LAG):
        written = time.monotonic()
        cache.set("page", "new")
        cache.delete("gone")
        cache.set("added", 1)
        assert cache.incr("hits") == 2
        # Within the window this thread reads the primary: its own writes.
        assert cache.get("page") == "new"
        assert cache.get_many(KEYS) == {"page": "new", "added": 1, "hits": 2}
        assert not cache.has_key("gone")
        # Another thread reads the replica, which has applied none of them.
        assert other.get_many(KEYS) == {"page": "old", "gone": "old", "hits": 1}
        time.sleep(WINDOW + 0.1)
        # After the window this thread reads the replica too: the lag shows.
        after_window = cache.get_many(KEYS)
        behind = time.monotonic() - written
        assert behind < LAG - 1, f"the test stalled {behind:.1f} s: the replica may be current"
        assert after_window == {"page": "old", "gone": "old", "hits": 1}
        assert cache.get("gone") == "old"  # a deleted entry, served again
        assert replica.status()["SQL_Delay"] == LAG
    # delayed() waited until the replica caught up: now it has every write.
    assert cache.get_many(KEYS) == {"page": "new", "added": 1, "hits": 2}
    assert other.get_many(KEYS) == {"page": "new", "added": 1, "hits": 2}


def test_two_caches_of_one_table_in_one_thread_read_each_other_s_writes(cache, replica):
    # As Django's caches["default"] and a caches["v2"] of the same LOCATION in one
    # request: the window is the thread's, not the instance's.
    v2 = replicated(replica, READ_YOUR_WRITES=WINDOW)  # another instance, the same cache
    with replica.sql_thread_stopped():
        v2.set("page", "from v2", version=2)
        assert cache.get("page", version=2) == "from v2"
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(cache.get("page", version=2)))
        thread.start()
        thread.join()
        assert elsewhere == [None]  # another thread's reads: the replica, which lags


def test_an_aset_in_one_event_loop_is_read_back_in_the_next(cache, replica):
    # asyncio.run() per call, as sync code calling the async API does: each call is a
    # task of its own, whose context is a copy of this thread's.
    fresh = replicated(replica, READ_YOUR_WRITES=WINDOW * 2)  # a configuration new here
    with replica.sql_thread_stopped():
        asyncio.run(fresh.aset("page", "new"))
        assert asyncio.run(fresh.aget("page")) == "new"
        assert fresh.get("page") == "new"


def test_a_stopped_replica_serves_what_it_had_until_it_applies_again(cache, replica):
    cache.set_many({"page": "v1", "hits": 1})
    replica.caught_up()
    with replica.sql_thread_stopped():
        cache.set("page", "v2")
        assert cache.incr("hits") == 2
        assert cache.get_many(["page", "hits"]) == {"page": "v2", "hits": 2}
        time.sleep(WINDOW + 0.1)  # the window is a deadline: no race with the replica
        assert cache.get_many(["page", "hits"]) == {"page": "v1", "hits": 1}
        status = replica.status()
        assert status["Slave_SQL_Running"] == "No"
        assert status["Seconds_Behind_Master"] is None  # stopped: no estimate at all
        cache.set("page", "v3")  # a new write opens a new window
        assert cache.get("page") == "v3"
    assert cache.get_many(["page", "hits"]) == {"page": "v3", "hits": 2}


def test_the_replica_is_a_separate_server_that_replicates(replica):
    (row,) = replica.query("SELECT @@port AS port, @@server_id AS id")
    assert row["port"] == replica.port != replica.primary_port
    (primary,) = replica.query("SELECT @@server_id AS id", port=replica.primary_port)
    assert primary["id"] != row["id"]
    status = replica.status()
    assert (status["Master_Port"], status["Using_Gtid"]) == (replica.primary_port, "Slave_Pos")
