"""No log line, exception or metric carries a cached value or key material.

Django's cache session backend creates sessions with ``add()``: a value is session data.
A secret is planted in the values (and an encryption key in ENCRYPTION_KEYS) and every
failure path a value can take is walked — a lost reply (failed open, raised, retried), a
reply that never comes (a hung server), a server refusing the statement, a corrupt
counter whose text the server quotes — with every log record (every logger, DEBUG up),
every exception (its chain and traceback) and ``metrics()`` searched for it, as text and
as the hex the statements carry.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import traceback
from typing import Any, Callable, Iterator

import pytest
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections

from django_kvcache.backends.mysql import MySQLCache
from django_kvcache.codec import FLAG_INTEGER
from tests.lost_reply_proxy import LostReplyProxy
from tests.mysql_support import (  # noqa: F401  (fixtures)
    TABLE,
    insert_row,
    make_cache,
    mysql_tables,
    register_alias,
    registered_alias,
    unregister_alias,
)
from tests.test_mysql_fail_open import failing_inserts

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "PLANTED-SECRET-7f3a9c"  # short: stored as it is (below COMPRESS_MIN_LENGTH)
VALUE = {"session": SECRET}
ENCRYPTION_KEY = "planted-encryption-key-0b8e4d1c"
PROXIED = "kvcache_secrets_proxied"
HUNG = "kvcache_secrets_hung"

#: The forms a secret takes in a statement or a reply: text, and hex either case.
FORMS = [form for text in (SECRET, ENCRYPTION_KEY)
         for form in (text, text.encode().hex(), text.encode().hex().upper())]


def leaks(text: str) -> list[str]:
    return [form for form in FORMS if form in text]


def exception_text(exc: BaseException) -> str:
    """Everything an exception shows: its chain, each one's args, and the traceback."""
    parts = ["".join(traceback.format_exception(type(exc), exc, exc.__traceback__))]
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts += [str(current), repr(current), repr(current.args)]
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


class Watch:
    """What the test saw: log records of every logger, exceptions, metrics."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog
        self.exceptions: list[BaseException] = []
        self.outcomes: list[str] = []

    def call(self, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except Exception as exc:  # noqa: BLE001  (what it carries is the subject)
            self.exceptions.append(exc)
            return exc

    def check(self, *caches: MySQLCache) -> None:
        found = []
        for record in self.caplog.records:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += exception_text(record.exc_info[1])
            found += [(f"log {record.name}", form, text[:200]) for form in leaks(text)]
        for exc in self.exceptions:
            text = exception_text(exc)
            found += [(f"exception {type(exc).__name__}", form, text[:200]) for form in leaks(text)]
        for cache in caches:
            text = json.dumps(cache.metrics(), default=str)
            found += [("metrics", form, text[:200]) for form in leaks(text)]
        assert not found, found


@pytest.fixture
def watch(caplog) -> Iterator[Watch]:
    with caplog.at_level(logging.DEBUG):
        yield Watch(caplog)


@pytest.fixture
def proxy(mysql_tables, django_db_blocker) -> Iterator[LostReplyProxy]:
    lost = LostReplyProxy(settings.MYSQL["HOST"], int(settings.MYSQL["PORT"]))
    entry = {**connections[DEFAULT_DB_ALIAS].settings_dict, "HOST": "127.0.0.1",
             "PORT": str(lost.port), "TEST": {}}
    register_alias(PROXIED, entry)
    try:
        with django_db_blocker.unblock():
            yield lost
    finally:
        unregister_alias(PROXIED)
        lost.stop()


def proxied(**options: Any) -> MySQLCache:
    cache = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": PROXIED, "CULL_PROBABILITY": 0,
                                           **options}})
    cache.delete_many(["sess", "sess2", "sess3"])
    return cache


ENCRYPTED = {"ENCRYPTION_KEYS": [ENCRYPTION_KEY]}


@pytest.mark.parametrize("options", [{}, ENCRYPTED], ids=["plain", "encrypted"])
def test_a_lost_reply_never_logs_or_raises_the_value(proxy, watch, options):
    failing_open, raising = proxied(**options), proxied(IGNORE_EXCEPTIONS=False, **options)
    for cache in (failing_open, raising):
        for key, write in [
            ("sess", lambda c: c.add("sess", VALUE)),  # Django's session backend
            ("sess2", lambda c: c.set("sess2", VALUE)),  # retried once: lost again below
            ("sess3", lambda c: c.set_many({"sess3": VALUE})),
        ]:
            proxy.drop_reply_to(f":1:{key}".encode())
            watch.call(lambda: write(cache))
        proxy.drop_reply_to(b":1:sess")
        watch.call(lambda: cache.get_or_set("sess", VALUE))
    assert proxy.replies_lost >= 6
    watch.check(failing_open, raising)


@pytest.mark.parametrize("options", [{}, ENCRYPTED], ids=["plain", "encrypted"])
def test_a_refused_statement_never_logs_or_raises_the_value(mysql_tables, watch, options):
    with failing_inserts(1205, "Lock wait timeout exceeded; try restarting transaction") as table:
        for cache in (make_cache(table, OPTIONS=options),
                      make_cache(table, OPTIONS={"IGNORE_EXCEPTIONS": False, **options})):
            watch.call(lambda: cache.add("sess", VALUE))
            watch.call(lambda: cache.set_many({"sess": VALUE, "other": VALUE}))
            watch.check(cache)


def test_a_corrupt_counter_s_text_is_never_logged_or_raised(mysql_tables, watch):
    """An integer-flagged row whose bytes are not a number: the server's error for the
    increment quotes them ("Truncated incorrect INTEGER value: '…'")."""
    cache = make_cache()
    insert_row(cache.make_key("counter"), SECRET.encode(), FLAG_INTEGER, 2**62)
    for cache in (cache, make_cache(OPTIONS={"IGNORE_EXCEPTIONS": False})):
        watch.call(lambda: cache.incr("counter"))
    watch.check(cache)
    cache.delete("counter")


@pytest.fixture
def hung_server(mariadb_server, django_db_blocker) -> Iterator[Any]:
    entry = mariadb_server.connection_settings()
    entry["OPTIONS"] = {**entry["OPTIONS"], "connect_timeout": 1, "read_timeout": 1,
                        "write_timeout": 1}
    with registered_alias(HUNG, entry, django_db_blocker):
        yield mariadb_server
    os.kill(mariadb_server.process.pid, signal.SIGCONT)


@pytest.mark.once  # a server of its own, stopped
def test_a_reply_that_never_comes_never_logs_or_raises_the_value(hung_server, watch):
    failing_open = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": HUNG, "CULL_PROBABILITY": 0}})
    failing_open.create_table()
    raising = MySQLCache(TABLE, {"OPTIONS": {"DATABASE": HUNG, "CULL_PROBABILITY": 0,
                                             "IGNORE_EXCEPTIONS": False}})
    failing_open.get("warm-up")  # a pooled connection, which the statement finds
    os.kill(hung_server.process.pid, signal.SIGSTOP)
    try:
        watch.call(lambda: raising.add("sess", VALUE))
        watch.call(lambda: failing_open.add("sess", VALUE))
    finally:
        os.kill(hung_server.process.pid, signal.SIGCONT)
    watch.check(failing_open, raising)
