"""The forked children of tests (``tests.concurrency``, ``os.fork()``) never end a database
session of their parent, whichever of its threads holds it.

Django's connections are per thread. A child has only the thread that forked; the other
threads' connections (asgiref's executor thread runs the async ORM on one of its own) are
garbage there, and the child's garbage collector, whenever it runs, deallocates them:
mysqlclient then closes each, sending ``COM_QUIT`` on the socket the child shares with
its parent, whose session the server ends. ``gc.collect()`` here stands for a collection a
child runs sooner or later, by allocating.
"""
from __future__ import annotations

import asyncio
import gc
import os

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from tests.concurrency import run_processes

pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork"),
              pytest.mark.django_db(transaction=True)]


def session() -> int:
    """The server's id of this thread's Django session (``default``)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT CONNECTION_ID()")
        return cursor.fetchone()[0]


def executor_session() -> int:
    """The session of asgiref's executor thread, where the async ORM runs."""
    return asyncio.run(sync_to_async(session)())


def collect(index: int) -> int:
    gc.collect()
    return index


def test_a_child_leaves_the_session_of_the_async_orm_s_thread():
    before = executor_session()
    assert run_processes(4, collect) == [0, 1, 2, 3]
    assert executor_session() == before  # (a session the children ended: OperationalError)


def test_a_child_of_os_fork_leaves_the_sessions_of_every_thread():
    before = (session(), executor_session())
    pid = os.fork()
    if pid == 0:  # never return into pytest
        try:
            gc.collect()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (session(), executor_session()) == before
