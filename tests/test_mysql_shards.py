"""MySQLCache over several databases (OPTIONS["DATABASES"]): routing, batching per shard,
operations and commands that span every shard, resharding and read replicas.

The shards are real servers: "shard1" is the main MariaDB, "shard2" and "shard3" the two
extra ones `scripts/services.py up` starts. "shard2_replica" is the real replica of shard2's
server it starts too: these tests wait for it to catch up and show where reads are routed;
tests/test_mysql_replica.py shows what its lag does.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import ExitStack
from typing import Any, Iterator

import pytest
from django.conf import settings
from django.core.cache.backends.base import default_key_func
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import OperationalError, connections, transaction
from django.test.utils import override_settings

from django_kvcache.backends.mysql import CacheTableMissing, MySQLCache
from django_kvcache.checks import check_mysql_cache_tables
from django_kvcache.maintenance import create_tables_in, cull_all, migration_source
from django_kvcache.mysql import blocking, errors, policy, pools
from django_kvcache.mysql.query import Query, rowcount, rows
from django_kvcache.mysql.sql import FOREVER
from django_kvcache.routing import KvcacheRouter
from tests.mysql_support import BACKEND, in_another_thread, now_ms, sent_statements, wait_for
from tests.servers import replica_caught_up

SHARDS = list(settings.SHARD_ALIASES)
REPLICA = "shard2_replica"
TABLE = "kvcache_shards"

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", *SHARDS, REPLICA]),
    pytest.mark.skipif(len(SHARDS) < 3, reason="needs KVCACHE_MYSQL_SHARD_PORTS (two ports)"),
]


def sharded(*aliases: str, table: str = TABLE, **options: Any) -> MySQLCache:
    cache = MySQLCache(
        table,
        {"OPTIONS": {"DATABASES": list(aliases or SHARDS), "CULL_PROBABILITY": 0, **options}},
    )
    if not cache.table_exists():
        cache.create_table()
    return cache


def count_rows(alias: str, table: str = TABLE) -> int:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM `{table}`")
        return cursor.fetchone()[0]


def keys_on(alias: str, table: str = TABLE) -> set[str]:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT `cache_key` FROM `{table}`")
        return {key for (key,) in cursor.fetchall()}


def drop(table: str) -> None:
    for alias in SHARDS:
        with connections[alias].cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS `{table}`")


@pytest.fixture
def cache() -> Iterator[MySQLCache]:
    cache = sharded()
    cache.clear()
    yield cache
    cache.clear()


class Statements:
    """The statements the cache sends to each shard alias while the block runs."""

    def __init__(self, aliases: list[str]) -> None:
        self.stack = ExitStack()
        self.aliases = aliases
        self.sent: dict[str, list[str]] = {}

    def __enter__(self) -> "Statements":
        self.sent = {alias: self.stack.enter_context(sent_statements(alias))
                     for alias in self.aliases}
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.__exit__(*exc)

    def per_alias(self) -> dict[str, list[str]]:
        return dict(self.sent)


# --- configuration --------------------------------------------------------------------------


def test_database_and_databases_are_mutually_exclusive():
    with pytest.raises(ImproperlyConfigured, match=r"OPTIONS\['DATABASE'\] and OPTIONS\['DATABASES'\]"):
        MySQLCache(TABLE, {"OPTIONS": {"DATABASE": "shard1", "DATABASES": SHARDS}})


@pytest.mark.parametrize(
    "options, message",
    [
        ({"DATABASES": []}, r"OPTIONS\['DATABASES'\] must be a non-empty list"),
        ({"DATABASES": "shard1"}, r"OPTIONS\['DATABASES'\] must be a non-empty list"),
        ({"DATABASES": ["shard1", "nope"]}, r"each entry of OPTIONS\['DATABASES'\] must name"),
        ({"DATABASES": ["shard1", "shard1"]}, "lists an alias twice"),
        ({"DATABASES": ["shard1", "shard2"], "WEIGHTS": {"shard9": 2}}, "unknown keys: shard9"),
        ({"DATABASES": ["shard1", "shard2"], "WEIGHTS": {"shard1": 0}}, "positive number"),
        ({"DATABASE": "shard1", "WEIGHTS": {"shard1": 2}}, r"WEIGHTS'\] needs OPTIONS\['DATABASES"),
        ({"DATABASES": ["shard1"], "REPLICAS": {"shard3": REPLICA}}, "not a shard of this cache"),
        ({"DATABASES": ["shard2"], "REPLICAS": {"shard2": "nope"}}, r"REPLICAS'\]\['shard2'\]"),
        ({"REPLICAS": {"shard2": REPLICA}}, r"REPLICAS'\] needs OPTIONS\['DATABASE'\]"),
        ({"DATABASE": "shard2", "READ_YOUR_WRITES": 0}, r"OPTIONS\['READ_YOUR_WRITES'\] must be a positive number"),
        ({"DATABASE": "shard2", "IGNORE_EXCEPTIONS": 1}, r"OPTIONS\['IGNORE_EXCEPTIONS'\] must be True or False"),
        ({"DATABASE": "shard2", "RETRY_TIMEOUT": -1}, r"OPTIONS\['RETRY_TIMEOUT'\] must be a positive number"),
        ({"DATABASE": "shard2", "FAILURE_THRESHOLD": 0}, r"OPTIONS\['FAILURE_THRESHOLD'\] must be an integer"),
    ],
)
def test_bad_shard_options_name_the_option(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        MySQLCache(TABLE, {"OPTIONS": options})


# --- routing --------------------------------------------------------------------------------


def test_each_key_lives_on_the_shard_the_shared_router_picks(cache):
    cache.set_many({f"k{i}": i for i in range(300)})
    router = KvcacheRouter(SHARDS, [1.0] * len(SHARDS))
    for alias in SHARDS:
        stored = keys_on(alias)
        assert stored, alias
        assert {SHARDS[router.node_for(key)] for key in stored} == {alias}


def test_keys_spread_evenly_over_three_shards(cache):
    total = 3000
    cache.set_many({f"user:{i}:profile": i for i in range(total)})
    counts = [count_rows(alias) for alias in SHARDS]
    assert sum(counts) == total
    even = total / len(SHARDS)
    assert all(0.75 * even <= count <= 1.25 * even for count in counts), counts


def test_weights_give_a_shard_its_share():
    cache = sharded(WEIGHTS={"shard1": 2})
    cache.clear()
    cache.set_many({f"w{i}": i for i in range(2000)})
    share = count_rows("shard1") / 2000
    cache.clear()
    assert 0.4 <= share <= 0.6  # 2 of 4 weight units


def test_single_key_operations_on_every_shard(cache):
    keys = [f"op{i}" for i in range(30)]
    for i, key in enumerate(keys):
        cache.set(key, i)
    assert all(count_rows(alias) for alias in SHARDS)
    assert [cache.get(key) for key in keys] == list(range(30))
    assert all(cache.has_key(key) for key in keys)
    assert not any(cache.add(key, "other") for key in keys)
    assert [cache.incr(key, 10) for key in keys] == [i + 10 for i in range(30)]
    assert all(cache.touch(key, 60) for key in keys)
    assert all(cache.delete(key) for key in keys)
    assert not any(count_rows(alias) for alias in SHARDS)


# --- one statement per shard ---------------------------------------------------------------


def test_many_operations_send_one_statement_per_shard(cache):
    items = {f"m{i}": i for i in range(60)}
    cache.get_many(items)  # server detection happens once per alias and process
    with Statements(SHARDS) as sent:
        assert cache.set_many(items) == []
    assert {alias: [s.split()[0] for s in sql] for alias, sql in sent.per_alias().items()} == {
        alias: ["INSERT"] for alias in SHARDS
    }
    with Statements(SHARDS) as sent:
        assert cache.get_many([*items, "missing"]) == items
    assert all(len(sql) == 1 and sql[0].startswith("SELECT") for sql in sent.per_alias().values())
    with Statements(SHARDS) as sent:
        cache.delete_many(items)
    assert all(len(sql) == 1 and sql[0].startswith("DELETE") for sql in sent.per_alias().values())
    assert cache.get_many(items) == {}


def test_a_batch_on_one_shard_sends_nothing_to_the_others(cache):
    router = KvcacheRouter(SHARDS, [1.0] * len(SHARDS))
    on_shard3 = [k for k in (f"only{i}" for i in range(100)) if
                 SHARDS[router.node_for(cache.make_key(k))] == "shard3"][:5]
    with Statements(SHARDS) as sent:
        cache.set_many(dict.fromkeys(on_shard3, 1))
        cache.get_many(on_shard3)
    assert {alias: len(sql) for alias, sql in sent.per_alias().items()} == {
        "shard1": 0, "shard2": 0, "shard3": 2
    }


# --- all shards in one round trip -----------------------------------------------------------


def session_counts(aliases: list[str]) -> dict[str, Counter]:
    """The server's count of statements by kind on the cache's session of each alias
    (its one pooled connection here: one thread), as the server counts them."""
    counts = {}
    for alias in aliases:
        found = blocking.query(alias, "SHOW SESSION STATUS WHERE Variable_name IN "
                                      "('Com_select', 'Com_insert', 'Com_delete')")
        counts[alias] = Counter({name: int(value) for name, value in found})
    return counts


def test_pipelined_many_operations_send_one_statement_per_shard(cache):
    items = {f"m{i}": i for i in range(60)}
    cache.get_many(["warm-up"])
    for operation, kind in [(lambda: cache.set_many(items), "Com_insert"),
                            (lambda: cache.get_many([*items, "missing"]), "Com_select"),
                            (lambda: cache.delete_many(items), "Com_delete")]:
        before = session_counts(SHARDS)
        operation()
        after = session_counts(SHARDS)
        for alias in SHARDS:
            assert after[alias] - before[alias] == Counter({kind: 1}), (alias, kind)
    assert cache.get_many(items) == {}


def raw_connection(alias: str) -> Any:
    """A DB-API connection of its own to ``alias``'s (test) database."""
    connection = connections[alias]
    return connection.get_new_connection(connection.get_connection_params())


def waiting(alias: str, statement_start: str) -> int:
    """Statements starting with ``statement_start`` that the server is running for
    other sessions (here: waiting for a table lock)."""
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                       "WHERE INFO LIKE %s AND ID <> CONNECTION_ID()", (statement_start + "%",))
        return cursor.fetchone()[0]


@pytest.mark.parametrize("operation, statement_start", [
    ("get_many", "SELECT `cache_key`"),
    ("set_many", f"INSERT INTO `{TABLE}`"),
    ("delete_many", f"DELETE FROM `{TABLE}` WHERE `cache_key` IN"),
])
def test_every_shard_has_its_statement_before_any_reply_is_read(cache, operation, statement_start):
    """Each shard's table is locked by another session, so no statement can answer: a
    backend that waits for a reply before sending the next statement leaves two shards
    without theirs. The servers' process lists show all three at once."""
    items = {f"lock{i}": i for i in range(30)}
    cache.set_many(items)
    calls = {"get_many": lambda c: c.get_many(items), "set_many": lambda c: c.set_many(items),
             "delete_many": lambda c: c.delete_many(items)}
    lockers = {alias: raw_connection(alias) for alias in SHARDS}
    outcome: list[Any] = []

    def call() -> None:
        try:  # on this thread's connections, not connected yet
            # CULL_PROBABILITY 0: a cull would go first and wait on the lock itself
            thread_cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASES": SHARDS, "CULL_PROBABILITY": 0}})
            outcome.append(calls[operation](thread_cache))
        except Exception as exc:  # reported by the assertion below
            outcome.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=call)
    try:
        for locker in lockers.values():
            locker.query(f"LOCK TABLES `{TABLE}` WRITE".encode())
        thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
            waiting(alias, statement_start) for alias in SHARDS
        ):
            time.sleep(0.02)
        sent = {alias: waiting(alias, statement_start) for alias in SHARDS}
    finally:
        for locker in lockers.values():
            locker.query(b"UNLOCK TABLES")
            locker.close()
        thread.join(30)
    assert sent == dict.fromkeys(SHARDS, 1)
    assert outcome == [{"get_many": items, "set_many": [], "delete_many": None}[operation]]


@pytest.mark.parametrize("idempotent", [True, False])
def test_a_lost_reply_is_sent_again_only_for_an_idempotent_statement(cache, idempotent):
    """The policy's rerun rule, per statement of a pipelined round: shard2's INSERT waits
    for a table lock when its connection is killed (the reply is lost). An idempotent
    statement runs again on a fresh connection; one that must not run twice reports the
    error. shard1's reply is read either way, and every connection works afterwards."""
    cache.get_many([f"warm-up{i}" for i in range(30)])  # every server detected
    locker = raw_connection("shard2")
    locker.query(f"LOCK TABLES `{TABLE}` WRITE".encode())
    session: list[int] = []
    outcome: list[Any] = []
    shard1, shard2 = cache.shards[0], cache.shards[1]
    insert = f"INSERT INTO `{TABLE}` VALUES (%s, %s, 0, %s)"
    calls = [
        policy.Call(shard1, policy.Access.WRITE, lambda sql: Query("SELECT %s", [7], rows)),
        policy.Call(shard2, policy.Access.WRITE, lambda sql: Query(
            insert, ["lost-reply", b"v", FOREVER], rowcount, idempotent=idempotent)),
    ]

    def call() -> None:
        pool = pools.process_pool("shard2")
        raw = pool.checkout()  # the connection the call takes next (the last one in)
        session.append(raw.thread_id())
        pool.checkin(raw)
        try:
            outcome.append(blocking.execute(cache.session, calls))
        except OperationalError as exc:
            outcome.append(exc)
        for alias in ("shard1", "shard2"):
            outcome.append(blocking.query(alias, "SELECT 1")[0])

    thread = threading.Thread(target=call)
    thread.start()
    try:
        assert wait_for(lambda: waiting("shard2", f"INSERT INTO `{TABLE}`"))
        with connections["shard2"].cursor() as cursor:
            cursor.execute("KILL CONNECTION %s", (session[0],))
    finally:
        locker.query(b"UNLOCK TABLES")
        locker.close()
        thread.join(30)
    answers, *usable = outcome
    assert usable == [(1,), (1,)]
    if idempotent:
        assert answers == [((7,),), 1]
        assert "lost-reply" in keys_on("shard2")
    else:
        assert isinstance(answers, OperationalError)
        assert errors.classify(answers) is errors.LOST_REPLY
        assert "lost-reply" not in keys_on("shard2")


def test_hits_and_misses_on_every_shard_with_awkward_keys_and_values(cache):
    awkward = ["it's", 'say"hi"', "back\\slash", "percent%s%%%d", "été😀", "semi;colon--"]
    items = {f"{text}-{i}": bytes(range(256)) + text.encode() + bytes([i]) for i, text in
             enumerate(awkward * 6)}
    items.update({f"n{i}": i for i in range(20)})
    stored = dict(list(items.items())[::2])  # every other key is a miss
    assert cache.set_many(stored) == []
    router = KvcacheRouter(SHARDS, [1.0] * len(SHARDS))
    shard_of = {key: SHARDS[router.node_for(cache.make_key(key))] for key in items}
    for alias in SHARDS:  # hits and misses on every shard
        assert {key in stored for key in items if shard_of[key] == alias} == {True, False}
    assert cache.get_many(items) == stored
    cache.delete_many(list(stored)[:10])
    assert cache.get_many(items) == dict(list(stored.items())[10:])


def test_debug_logging_and_execute_wrappers_see_no_cache_statement(cache, settings):
    """The shards are asked on the cache's own connections, pipelined, whatever Django
    watches: its query log and execute wrappers see none of them."""
    items = {f"d{i}": i for i in range(30)}
    cache.set_many(items)
    settings.DEBUG = True
    for alias in SHARDS:
        connections[alias].ensure_connection()
        reset_queries_of(alias)
    before = session_counts(SHARDS)
    assert cache.get_many(items) == items
    after = session_counts(SHARDS)
    assert all(not connections[alias].queries for alias in SHARDS)
    assert all(after[alias] - before[alias] == Counter({"Com_select": 1}) for alias in SHARDS)
    settings.DEBUG = False
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql.split()[0])
        return execute(sql, params, many, context)

    with ExitStack() as stack:
        for alias in SHARDS:
            stack.enter_context(connections[alias].execute_wrapper(wrapper))
        cache.delete_many(items)
    assert seen == []
    assert cache.get_many(items) == {}


def test_inside_transactions_on_every_shard_the_cache_commits_on_its_own(cache):
    items = {f"t{i}": i for i in range(30)}
    with pytest.raises(RuntimeError), ExitStack() as stack:
        for alias in SHARDS:
            stack.enter_context(transaction.atomic(using=alias))
        assert cache.set_many(items) == []
        assert cache.get_many(items) == items
        cache.delete_many(list(items)[:10])
        raise RuntimeError("the view failed")
    assert cache.get_many(items) == dict(list(items.items())[10:])


def reset_queries_of(alias: str) -> None:
    connections[alias].queries_log.clear()


@pytest.mark.parametrize("ignore", [False, True])
def test_a_statement_error_on_one_shard_leaves_the_others_usable(ignore):
    """shard3 lacks the table: the call raises after reading every shard's reply (in both
    policies: a missing table is no unreachable server), and every connection still
    works afterwards."""
    table = "kvcache_shards_partial"
    drop(table)
    cache = sharded(table=table, IGNORE_EXCEPTIONS=ignore)
    with connections["shard3"].cursor() as cursor:
        cursor.execute(f"DROP TABLE `{table}`")
    items = {f"e{i}": i for i in range(30)}
    try:
        for call in (lambda: cache.get_many(items), lambda: cache.set_many(items),
                     lambda: cache.delete_many(items)):
            with pytest.raises(CacheTableMissing, match="shard3"):
                call()
            for alias in SHARDS:  # an unread reply would make this "commands out of sync"
                with connections[alias].cursor() as cursor:
                    cursor.execute("SELECT 1")
                    assert cursor.fetchone() == (1,)
        on_others = sharded("shard1", "shard2", table=table)
        assert on_others.set_many({"x": 1}) == [] and on_others.get_many(["x"]) == {"x": 1}
    finally:
        drop(table)


# --- operations over every shard ------------------------------------------------------------


def test_prefix_operations_and_clear_span_every_shard(cache):
    cache.set_many({f"page:{i:03d}": i for i in range(90)})
    cache.set("other", 1)
    keys = cache.keys_with_prefix("page:")
    assert keys == [f"page:{i:03d}" for i in range(90)]  # one key order across shards
    assert list(cache.get_with_prefix("page:")) == keys
    assert cache.delete_with_prefix("page:") == 90
    assert cache.keys_with_prefix("page:") == []
    assert cache.get("other") == 1
    cache.set_many({f"again{i}": i for i in range(30)})
    cache.clear()
    assert [count_rows(alias) for alias in SHARDS] == [0, 0, 0]


def test_clear_with_a_key_prefix_spares_other_caches_on_every_shard(cache):
    prefixed = MySQLCache(TABLE, {"KEY_PREFIX": "app", "OPTIONS": {"DATABASES": SHARDS}})
    cache.set_many({f"plain{i}": i for i in range(30)})
    prefixed.set_many({f"p{i}": i for i in range(30)})
    prefixed.clear()
    assert prefixed.get_many([f"p{i}" for i in range(30)]) == {}
    assert len(cache.get_many([f"plain{i}" for i in range(30)])) == 30


def test_cull_culls_every_shard(cache):
    past = now_ms() - 1000
    for alias in SHARDS:
        with connections[alias].cursor() as cursor:
            cursor.execute(f"INSERT INTO `{TABLE}` VALUES (%s, 'x', 0, %s)", (f"old-{alias}", past))
    assert cache.cull() == 3
    assert [count_rows(alias) for alias in SHARDS] == [0, 0, 0]


def test_sample_entries_draws_from_every_shard(cache):
    cache.set_many({f"s{i}": f"value {i}" for i in range(60)})
    sample = cache.sample_entries(30)
    assert len(sample) == 30
    assert all(isinstance(data, bytes) for _, data, _ in sample)
    assert {key for key, _, _ in sample} <= {cache.make_key(f"s{i}") for i in range(60)}


# --- resharding -----------------------------------------------------------------------------


def test_removing_a_shard_moves_only_its_keys(cache):
    items = {f"r{i}": i for i in range(900)}
    cache.set_many(items)
    on_removed = {key for key in items if cache.make_key(key) in keys_on("shard2")}
    smaller = sharded("shard1", "shard3")
    kept = smaller.get_many(items)
    others = set(items) - on_removed
    assert len(others) >= 0.6 * len(items)  # the check below covers most keys
    assert set(kept) == others  # every key of the remaining shards is still found
    assert smaller.get_many(on_removed) == {}


def test_adding_a_shard_moves_about_its_share(cache):
    two = sharded("shard1", "shard2")
    two.clear()
    items = {f"a{i}": i for i in range(900)}
    two.set_many(items)
    found = cache.get_many(items)  # three shards: keys that stay where they were
    assert 0.5 * len(items) <= len(found) <= 0.8 * len(items)  # about 2/3 stay


# --- commands and checks --------------------------------------------------------------------


SHARDED_CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "sharded": {
        "BACKEND": BACKEND,
        "LOCATION": "kvcache_sharded_cmd",
        "OPTIONS": {"DATABASES": SHARDS, "REPLICAS": {"shard2": REPLICA}},
    },
}


@pytest.fixture
def sharded_settings() -> Iterator[MySQLCache]:
    drop("kvcache_sharded_cmd")
    with override_settings(CACHES=SHARDED_CACHES):
        from django.core.cache import caches

        yield caches["sharded"]
    drop("kvcache_sharded_cmd")


def call(name: str, *args: str) -> str:
    from io import StringIO

    out = StringIO()
    call_command(name, *args, stdout=out)
    return out.getvalue()


def test_createtable_and_checks_cover_every_shard(sharded_settings):
    warnings = check_mysql_cache_tables(databases=["default"])
    assert sorted(w.msg.rsplit(" ", 1)[1] for w in warnings) == [f"'{a}'." for a in SHARDS]
    assert all(w.id == "kvcache.W001" for w in warnings)
    dry = call("kvcache_createtable", "--dry-run")
    assert [f"-- database {alias}" in dry for alias in SHARDS] == [True] * 3
    assert not any(sharded_settings.table_exists(alias) for alias in SHARDS)
    assert call("kvcache_createtable") == "sharded: created table\n"
    assert all(sharded_settings.table_exists(alias) for alias in SHARDS)
    assert check_mysql_cache_tables(databases=["default"]) == []
    assert call("kvcache_createtable") == "sharded: table exists\n"


def test_cull_command_covers_every_shard(sharded_settings):
    sharded_settings.create_table()
    past = now_ms() - 1000
    for alias in SHARDS:
        with connections[alias].cursor() as cursor:
            cursor.execute(f"INSERT INTO `kvcache_sharded_cmd` VALUES ('old', 'x', 0, {past})")
    assert call("kvcache_cull") == "sharded: 3 rows deleted\n"
    assert cull_all() == {"sharded": 0}


def test_createcachetable_hook_creates_the_table_in_each_shard_database(sharded_settings):
    for alias in SHARDS:
        assert "kvcache_sharded_cmd" in create_tables_in(alias)["sharded"]
        assert sharded_settings.table_exists(alias)
    assert create_tables_in(REPLICA) == {}  # replicas get the table by replication


def test_migration_says_to_apply_it_on_every_shard(sharded_settings):
    source = migration_source()
    for alias in SHARDS:
        assert f"manage.py migrate --database {alias}" in source
    namespace: dict = {}
    exec(compile(source, "0002_cache_tables.py", "exec"), namespace)
    assert len(namespace["Migration"].operations) == 1


def test_checks_find_a_shard_that_is_not_mysql(sharded_settings):
    from django_kvcache.checks import check_mysql_caches

    assert check_mysql_caches() == []
    connections.settings["sqlite_shard"] = connections.configure_settings(
        {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    )["default"]
    try:
        caches_setting = {
            **SHARDED_CACHES,
            "sharded": {**SHARDED_CACHES["sharded"],
                        "OPTIONS": {"DATABASES": ["shard1", "sqlite_shard"]}},
        }
        with override_settings(CACHES=caches_setting):
            (error,) = check_mysql_caches()
        assert error.id == "kvcache.E001" and "'sqlite_shard'" in error.msg
    finally:
        del connections.settings["sqlite_shard"]


# --- replicas and read-your-writes ----------------------------------------------------------


def replicated(**options: Any) -> MySQLCache:
    cache = sharded("shard2", REPLICAS={"shard2": REPLICA}, **options)
    replica_caught_up()  # the table, on the real replica
    return cache


def test_reads_go_to_the_replica_until_this_thread_writes():
    writer = replicated()
    in_another_thread(lambda: (writer.clear(), writer.set("seed", 1)))  # no window here
    reader = replicated()  # this thread has written nothing; waits for "seed"
    reader.get("warm-up"), writer.get("warm-up")
    with Statements(["shard2", REPLICA]) as sent:
        assert reader.get("seed") == 1
        assert reader.get_many(["seed"]) == {"seed": 1}
        assert reader.has_key("seed")
        writer.set("fresh", 2)
        assert writer.get("fresh") == 2  # read-your-writes: from the primary
        assert writer.get_many(["fresh", "seed"]) == {"fresh": 2, "seed": 1}
    statements = {alias: [s.split()[0] for s in sql] for alias, sql in sent.per_alias().items()}
    assert statements == {REPLICA: ["SELECT"] * 3, "shard2": ["INSERT", "SELECT", "SELECT"]}
    writer.clear()


def test_read_your_writes_ends_after_its_window():
    cache = replicated(READ_YOUR_WRITES=0.2)
    cache.get("warm-up")  # the replica's first connection asks its server's version first
    cache.set("key", 1)
    time.sleep(0.3)  # past the window: nothing races, the window is a monotonic deadline
    replica_caught_up()
    with Statements(["shard2", REPLICA]) as sent:
        assert cache.get("key") == 1
    assert [len(sql) for sql in sent.per_alias().values()] == [0, 1]
    cache.clear()


def test_read_your_writes_is_per_thread():
    cache = replicated()
    cache.clear()
    seen: dict[str, str] = {}

    def other_thread() -> None:
        other = replicated()
        other.get("warm-up")
        with Statements(["shard2", REPLICA]) as sent:
            other.get("key")
        seen.update({alias: str(len(sql)) for alias, sql in sent.per_alias().items()})
        connections.close_all()

    cache.set("key", 1)
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(30)
    assert seen == {"shard2": "0", REPLICA: "1"}
    cache.clear()


def test_writes_and_prefix_deletes_always_go_to_the_primary():
    cache = replicated()
    cache.get("warm-up")
    with Statements(["shard2", REPLICA]) as sent:
        cache.set_many({"p1": 1, "p2": 2})
        cache.delete_with_prefix("p")
        cache.clear()
    assert len(sent.per_alias()[REPLICA]) == 0
    assert Counter(s.split()[0] for s in sent.per_alias()["shard2"]) == {"INSERT": 1, "DELETE": 2}


def test_metrics_list_every_shard_and_replica(cache):
    metrics = replicated().metrics()
    assert set(metrics["shards"]) == {"shard2"} and set(metrics["replicas"]) == {REPLICA}
    assert "replicas" not in cache.metrics()  # no REPLICAS: none
    assert set(cache.metrics()["shards"]) == set(SHARDS)
    shard1 = cache.metrics()["shards"]["shard1"]
    pools = {name: shard1.pop(name) for name in list(shard1) if name.startswith("pool_")}
    assert shard1 == {
        "errors": 0, "ignored": 0, "skipped": 0, "reruns": 0, "down": False, "consecutive_failures": 0,
        "outdated_keys": 0, "flush_pending": False,
    }
    assert set(pools) == {"pool_size", "pool_idle", "pool_waiters", "pool_waits",
                          "pool_wait_seconds", "pool_connects", "pool_reuses", "pool_reconnects"}
    assert "outdated_keys" not in metrics["replicas"][REPLICA]  # a primary's record


def test_default_key_function_is_what_routing_hashes(cache):
    # Routing hashes the stored key (prefix and version included), so two caches with
    # different KEY_PREFIX spread the same caller key independently.
    assert cache.key_func is default_key_func
    cache.set("k", 1)
    (alias,) = [alias for alias in SHARDS if ":1:k" in keys_on(alias)]
    assert SHARDS[KvcacheRouter(SHARDS, [1.0] * 3).node_for(":1:k")] == alias


def test_the_shards_are_three_separate_servers():
    ports = set()
    for alias in SHARDS:
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT @@port")
            ports.add(cursor.fetchone()[0])
    assert len(ports) == 3  # scripts/services.py up started the two extra ones


def test_read_your_writes_counts_from_the_end_of_the_write():
    """Defect 3: a write slower than the window (here a row lock held 1.5 s, the window
    1 s) must still send the next read to the primary, not the replica."""
    cache = replicated(READ_YOUR_WRITES=1)
    cache.clear()
    cache.set("slow", "old")
    time.sleep(1.1)  # the window of that write is over
    assert cache.get("slow") == "old"  # from the replica (detected here, once)
    locker = raw_connection("shard2")
    locker.query(b"BEGIN")
    locker.query(f"SELECT * FROM `{TABLE}` WHERE `cache_key` = ':1:slow' FOR UPDATE".encode())
    locker.store_result()
    release = threading.Timer(1.5, lambda: (locker.query(b"COMMIT"), locker.close()))
    release.start()
    try:
        cache.set("slow", "new")  # waits for the lock
    finally:
        release.join()
    with Statements(["shard2", REPLICA]) as sent:
        assert cache.get("slow") == "new"
    assert [len(sql) for sql in sent.per_alias().values()] == [1, 0]  # the primary
    cache.clear()


def test_one_replica_alias_for_two_shards_gets_one_statement_at_a_time():
    """Suspicion: a replica alias shared by two shards (or a replica that is another
    shard's primary) must never get two statements in flight on one connection
    (libmysqlclient answers 2014 "Commands out of sync"; MariaDB Connector/C happens to
    queue them). Each of its statements is sent once the previous reply is read."""
    writer = sharded("shard2", "shard3")
    writer.clear()
    items = {f"r{i}": i for i in range(30)}
    writer.set_many(items)
    reader = sharded("shard2", "shard3", REPLICAS={"shard2": "shard3", "shard3": "shard3"})
    reader.get("warm-up")
    from django_kvcache.mysql import exchange

    seen: list[list[str]] = []
    original = exchange.perform

    def recording(items_: Any, *args: Any) -> Any:
        seen.append([alias for alias, _ in items_])
        return original(items_, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exchange, "perform", recording)
        found = reader.get_many(items)
    on_shard3 = {k: v for k, v in items.items() if reader._shard_for(reader.make_key(k)).alias == "shard3"}
    assert found == on_shard3  # shard2's keys were asked of shard3, which lacks them
    assert seen and all(len(aliases) == len(set(aliases)) for aliases in seen)
    writer.clear()
