"""MySQLCache under faults, on a MariaDB of the test's own: restarts mid-run, values and
batches beyond ``max_allowed_packet``.

Extends tests/test_mysql_resilience.py (a connection KILLed on the shared server) with real
server restarts, and tests/test_mysql_operations.py (packet limits on the shared server's
16 MiB) with a 1 MiB server where splitting happens at every scale.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, Callable, Iterator

import MySQLdb
import pytest
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections, transaction

from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.mysql import blocking, errors, pools
from django_kvcache.mysql.blocking import server_info
from django_kvcache.mysql.connect import connection_params
from django_kvcache.mysql.server import PACKET_HEADROOM, forget_server
from tests.lost_reply_proxy import LostReplyProxy
from tests.mysql_support import register_alias, sent_statements, unregister_alias

pytestmark = pytest.mark.once  # servers failing, not Django's API

ALIAS = "kvcache_faults"
TABLE = "kvcache_faults"
SMALL_PACKET = 1024 * 1024


@pytest.fixture
def own_server(mariadb_server, django_db_blocker) -> Iterator[Any]:
    """The test's own MariaDB behind the alias ``ALIAS``, and database access allowed."""
    register_alias(ALIAS, mariadb_server.connection_settings())
    try:
        with django_db_blocker.unblock():
            yield mariadb_server
    finally:
        unregister_alias(ALIAS)


def make_cache(**options: Any) -> MySQLCache:
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": ALIAS, "CULL_PROBABILITY": 0, **options}})
    if not cache.table_exists():
        cache.create_table()
    return cache


def statements(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    """What ``run`` returned, and the statements it sent."""
    return statements_on(ALIAS, run)


def statements_on(alias: str, run: Callable[[], Any]) -> tuple[Any, list[str]]:
    with sent_statements(alias) as sent:
        result = run()
    return result, sent


def pool() -> pools.ProcessPool:
    return pools.process_pool(ALIAS)


#: The server's counters of the statements the cache sends.
COMMANDS = ("Com_select", "Com_insert", "Com_update", "Com_delete")


def run_on_server(run: Callable[[], Any]) -> tuple[Any, int]:
    """What ``run`` returned, and how many statements the server ran meanwhile (its own
    counters, read on a connection of the test's own)."""
    server = MySQLdb.connect(**connection_params(ALIAS).kwargs)
    try:
        before = command_count(server)
        result = run()
        return result, command_count(server) - before
    finally:
        server.close()


def command_count(server: Any) -> int:
    names = ", ".join(f"'{name}'" for name in COMMANDS)
    server.query(f"SHOW GLOBAL STATUS WHERE Variable_name IN ({names})".encode())
    return sum(int(value) for _, value in server.store_result().fetch_row(0))


# --- restarts ------------------------------------------------------------------------------------

BEFORE = {"key": "value", "n": 1}
#: name: (operation, its result after a restart, what the cache holds afterwards)
OPERATIONS: dict[str, tuple[Callable[[MySQLCache], Any], Any, dict[str, Any]]] = {
    "get": (lambda c: c.get("key"), "value", BEFORE),
    "set": (lambda c: c.set("new", 1), None, {**BEFORE, "new": 1}),
    "add": (lambda c: c.add("new", 1), True, {**BEFORE, "new": 1}),
    "incr": (lambda c: c.incr("n", 5), 6, {**BEFORE, "n": 6}),
    "touch": (lambda c: c.touch("key", 60), True, BEFORE),
    "has_key": (lambda c: c.has_key("key"), True, BEFORE),
    "get_many": (lambda c: c.get_many(["key", "n", "new"]), BEFORE, BEFORE),
    "set_many": (lambda c: c.set_many({"new": 1}), [], {**BEFORE, "new": 1}),
    "delete": (lambda c: c.delete("key"), True, {"n": 1}),
    "delete_many": (lambda c: c.delete_many(["key", "n"]), None, {}),
}


@pytest.mark.parametrize("name", OPERATIONS)
def test_first_operation_after_a_server_restart_succeeds_and_runs_once(own_server, name):
    """The restart closed every pooled connection: the pool notices before sending (a
    zero-timeout poll of the socket), so the call is lost on none and runs once, as the
    server counts it."""
    cache = make_cache(IGNORE_EXCEPTIONS=False)
    cache.set_many(BEFORE)
    own_server.restart()  # the connection the cache used is gone
    operation, expected, after = OPERATIONS[name]
    reconnects = pool().reconnects
    (result, sent), ran = run_on_server(lambda: statements(lambda: operation(cache)))
    assert result == expected
    assert len(sent) == 1 and ran == 1
    assert pool().reconnects == reconnects + 1
    assert cache.get_many(["key", "n", "new"]) == after  # committed data survived


@pytest.mark.parametrize("name", ["get", "set", "add", "incr", "delete"])
def test_an_idle_connection_past_wait_timeout_costs_no_call_and_runs_nothing_twice(
    own_server, name
):
    """The server closes a connection idle for wait_timeout (2 s here): the next call
    finds out before sending, opens another, and runs once, as the server counts it."""
    with MySQLdb.connect(**connection_params(ALIAS).kwargs) as admin:
        admin.query(b"SET GLOBAL wait_timeout = 2")  # sessions opened from now on
    blocking.close_pools([ALIAS])
    cache = make_cache(IGNORE_EXCEPTIONS=False)
    cache.set_many(BEFORE)
    idle = list(pool().idle)
    time.sleep(3)  # the server closes the idle connection
    operation, expected, after = OPERATIONS[name]
    (result, sent), ran = run_on_server(lambda: statements(lambda: operation(cache)))
    assert result == expected
    assert len(sent) == 1 and ran == 1
    assert not set(pool().idle) & set(idle)  # a new connection served it
    assert cache.get_many(["key", "n", "new"]) == after


def test_restart_in_the_middle_of_a_running_load(own_server):
    """A thread keeps working while the server restarts: only calls made while it is down
    fail (without IGNORE_EXCEPTIONS), each with a connection error; every call once it is
    back succeeds."""
    cache = make_cache(IGNORE_EXCEPTIONS=False)
    calls: list[tuple[float, float, BaseException | None]] = []
    stopping = threading.Event()

    def work() -> None:
        round_ = 0
        while not stopping.is_set():
            round_ += 1
            started, error = time.monotonic(), None
            try:
                cache.set(f"k{round_ % 50}", round_)
                assert cache.get(f"k{round_ % 50}") == round_
            except Exception as exc:  # recorded; checked below
                error = exc
            calls.append((started, time.monotonic(), error))

    worker = threading.Thread(target=work)
    worker.start()
    time.sleep(0.3)
    restarting = time.monotonic()
    own_server.restart()
    back = time.monotonic()
    time.sleep(0.5)
    stopping.set()
    worker.join(timeout=30)
    assert not worker.is_alive()

    assert any(started < restarting for started, _, _ in calls)
    after = [error for started, _, error in calls if started > back]
    assert after and all(error is None for error in after)
    for started, ended, error in calls:
        if error is not None:  # a failed call overlapped the restart
            assert ended > restarting and started < back
            assert isinstance(error, OperationalError), error
            assert errors.is_unreachable(error), error  # can't connect


def test_a_restart_inside_a_caller_s_transaction_costs_the_cache_nothing(own_server):
    """The caller's atomic() is not the cache's: after a restart the cache's next call
    goes out on a fresh connection, and what it wrote before is committed."""
    cache = make_cache()
    cache.set("key", "value")
    with pytest.raises(RuntimeError):
        with transaction.atomic(using=DEFAULT_DB_ALIAS):
            cache.set("inside", 1)
            own_server.restart()
            assert cache.get("key") == "value"
            raise RuntimeError("the view failed")
    assert cache.get("inside") == 1


# --- max_allowed_packet ------------------------------------------------------------------------


def lower_max_allowed_packet(size: int) -> None:
    """Lower the server's limit; the cache's connections opened from now on get it."""
    blocking.query(ALIAS, "SET GLOBAL max_allowed_packet = %s", (size,))
    blocking.close_pools([ALIAS])


@pytest.fixture
def small_packet(own_server) -> int:
    """A server whose max_allowed_packet is 1 MiB, before the cache first uses it."""
    lower_max_allowed_packet(SMALL_PACKET)
    forget_server(ALIAS)
    return SMALL_PACKET


def random_bytes(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)  # incompressible: the codec cannot shrink it


def test_a_value_over_max_allowed_packet_is_refused_clearly_and_the_connection_stays_usable(
    small_packet, caplog
):
    cache = make_cache()
    assert server_info(ALIAS).max_allowed_packet == small_packet
    near_limit = random_bytes(small_packet * 3 // 4)  # over the size that is never checked
    cache.set("near", near_limit)
    assert cache.get("near") == near_limit
    cache.set("big", "old")
    connects = pool().connects

    too_big = random_bytes(small_packet * 2)
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        cache.set("big", too_big)
        assert cache.add("other", too_big) is False
        assert cache.set_many({"small": 1, "huge": too_big}) == ["huge"]
    refusals = [r.getMessage() for r in caplog.records if "max_allowed_packet" in r.getMessage()]
    assert len(refusals) == 1 and "'big'" in refusals[0]  # one line per episode (issue 24)
    assert f"the limit of {small_packet - PACKET_HEADROOM} bytes" in refusals[0]

    assert pool().connects == connects  # never dropped by the server
    assert cache.get_many(["big", "other", "small", "huge", "near"]) == {
        "small": 1,
        "near": near_limit,
    }  # the older value of "big" does not outlive the refused write


def test_set_many_bigger_than_one_packet_is_split_and_fully_stored(small_packet):
    cache = make_cache()
    data: dict[str, Any] = {f"key-{i}": random_bytes(1024, seed=i) for i in range(3000)}
    data.update({f"large-{i}": random_bytes(small_packet // 2, seed=-i) for i in range(3)})
    failed, sent = statements(lambda: cache.set_many(data))
    assert failed == []
    inserts = [s for s in sent if s.startswith("INSERT")]
    assert len(inserts) >= 2  # about 3.5 MiB of rows: several statements

    found, sent = statements(lambda: cache.get_many(data))
    assert found == data  # every key readable, every value intact
    assert len(sent) >= 2  # 3003 keys of up to 2 KiB escaped: the SELECT is split too
    cache.delete_many(data)
    assert cache.get_many(data) == {}


def test_a_server_that_lowered_max_allowed_packet_refuses_clearly_after_a_reconnect(
    own_server, caplog
):
    """A session keeps the limit it started with: after the server lowers it (and the
    connection is renewed) an oversized value is refused naming the limit, the older value
    goes, and the connection is never dropped."""
    cache = make_cache()
    cache.set_many({"small": 1, "big": "old"})  # the server detected with its 16 MiB
    lower_max_allowed_packet(SMALL_PACKET)
    cache.get("small")  # a new session, with the new limit
    connects = pool().connects
    with caplog.at_level(logging.WARNING, logger="django_kvcache"):
        cache.set("big", random_bytes(SMALL_PACKET * 2))
    assert "max_allowed_packet" in caplog.text
    assert pool().connects == connects
    assert cache.get_many(["small", "big"]) == {"small": 1}


# --- hostile table names ------------------------------------------------------------------------
# (The security bullet: keys are parameters, proven by tests/hostile.py; table names
# are quoted identifiers, proven here, % included. A backtick is refused:
# tests/test_mysql_operations.py.)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "table",
    [
        "t'; DROP TABLE canary; --",
        't"; DROP TABLE canary; --',
        "t\\",
        "t?x",
        "t.x",
        "t /* x */",
        "é ü",
        "t%s",
        "t%_x",
        "t%%",
    ],
)
def test_hostile_table_names_are_quoted_identifiers(table):
    connection = connections[DEFAULT_DB_ALIAS]
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE canary (a INT)")
    cache = MySQLCache(table, {"OPTIONS": {"CULL_PROBABILITY": 1, "MAX_ENTRIES": 100}})
    cache.create_table()
    try:
        cache.set_many({"a": 1, "b'`\\%": 2})
        cache.set("c", 3)
        assert cache.add("d", 4) is True
        assert cache.incr("c") == 4
        assert cache.touch("a", 60) is True
        assert cache.get_many(["a", "b'`\\%", "c", "d"]) == {"a": 1, "b'`\\%": 2, "c": 4, "d": 4}
        assert cache.keys_with_prefix("b") == ["b'`\\%"]
        assert cache.delete("d") is True
        cache.delete_many(["a"])
        assert cache.cull() == 0
        cache.clear()
        assert cache.get("c") is None
        assert table in connection.introspection.table_names()
    finally:
        with connection.cursor() as cursor:
            try:
                cursor.execute(cache.drop_table_sql())
            finally:
                cursor.execute("DROP TABLE canary")  # fails if anything had dropped it


# --- a reply lost after the server ran the statement ---------------------------------------------

PROXIED = "kvcache_lost_reply"


@pytest.fixture
def lost_reply_proxy(django_db_setup, django_db_blocker) -> Iterator[LostReplyProxy]:
    """The shared server's test database behind a proxy that can lose one reply."""
    proxy = LostReplyProxy(settings.MYSQL["HOST"], int(settings.MYSQL["PORT"]))
    entry = {
        **connections[DEFAULT_DB_ALIAS].settings_dict,
        "HOST": "127.0.0.1",
        "PORT": str(proxy.port),
        "TEST": {},
    }
    register_alias(PROXIED, entry)
    try:
        with django_db_blocker.unblock():
            yield proxy
            MySQLCache(TABLE, {"OPTIONS": {"DATABASE": PROXIED}}).clear()
    finally:
        unregister_alias(PROXIED)
        proxy.stop()


def proxied_cache() -> MySQLCache:
    """Errors raised (not failed open): the outcome of each call is the subject."""
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": PROXIED, "CULL_PROBABILITY": 0,
                                           "IGNORE_EXCEPTIONS": False}})
    if not cache.table_exists():
        cache.create_table()
    cache.clear()
    return cache


def test_an_incr_whose_reply_is_lost_is_not_applied_twice(lost_reply_proxy, caplog):
    cache = proxied_cache()
    cache.set("lost-reply-counter", 10)
    lost_reply_proxy.drop_reply_to(b"lost-reply-counter")
    with pytest.raises(OperationalError) as raised, caplog.at_level(logging.WARNING):
        cache.incr("lost-reply-counter")
    assert lost_reply_proxy.replies_lost == 1
    assert raised.value.args[0] == 2013  # the caller learns that the outcome is unknown
    assert "Not retried after error 2013" in caplog.text
    assert cache.get("lost-reply-counter") == 11  # applied once, by the server
    assert cache.incr("lost-reply-counter") == 12  # the next call reconnects


def test_an_add_whose_reply_is_lost_never_reports_its_own_insert_as_not_added(
    lost_reply_proxy,
):
    cache = proxied_cache()
    cache.get("warm-up")
    lost_reply_proxy.drop_reply_to(b"lost-reply-added")
    try:
        added = cache.add("lost-reply-added", "mine")
    except OperationalError as exc:
        added = exc.args[0]
    assert lost_reply_proxy.replies_lost == 1
    assert added == 2013  # never False: the row the server inserted is this call's own
    assert cache.get("lost-reply-added") == "mine"


@pytest.mark.parametrize(
    "operation, expected, after",
    [
        (lambda c: c.set("lost-reply-key", 2), None, 2),
        (lambda c: c.set_many({"lost-reply-key": 2}), [], 2),
        (lambda c: c.get("lost-reply-key"), 1, 1),
        (lambda c: c.touch("lost-reply-key", 60), True, 1),
        (lambda c: c.delete_many(["lost-reply-key"]), None, None),
    ],
)
def test_idempotent_statements_whose_reply_is_lost_are_retried(
    lost_reply_proxy, operation, expected, after
):
    cache = proxied_cache()
    cache.set("lost-reply-key", 1)
    lost_reply_proxy.drop_reply_to(b"lost-reply-key")
    result, sent = statements_on(PROXIED, lambda: operation(cache))
    assert lost_reply_proxy.replies_lost == 1
    assert result == expected
    assert len(sent) == 2  # the one whose reply was lost, and the retry
    assert cache.get("lost-reply-key") == after


@pytest.mark.parametrize(
    "operation",
    [
        lambda c: c.delete("lost-reply-deleted"),
        lambda c: c.touch("lost-reply-deleted", 0),
        lambda c: c.delete_with_prefix("lost-reply-del"),
    ],
    ids=["delete", "touch-0", "delete_with_prefix"],
)
def test_a_delete_whose_reply_is_lost_never_reports_its_own_delete_as_nothing(
    lost_reply_proxy, operation
):
    cache = proxied_cache()
    cache.set("lost-reply-deleted", 1)
    lost_reply_proxy.drop_reply_to(b"lost-reply-del")
    try:
        answer = operation(cache)
    except OperationalError as exc:
        answer = exc.args[0]
    assert lost_reply_proxy.replies_lost == 1
    assert answer == 2013  # never False or 0: the row the server deleted was this call's
    assert cache.get("lost-reply-deleted") is None
