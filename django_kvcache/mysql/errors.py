"""What a MySQL/MariaDB error means for the cache, decided once for every path.

Each error code belongs to one class (:data:`CLASSES`, and :data:`BY_MESSAGE` for codes
whose meaning depends on the server that sends them); everything else is a
``STATEMENT`` error (the statement itself, or the configuration, is wrong: access
denied, an unknown database, a missing table, a syntax error — raised under any
setting, never retried, never held against the server). The failure policy
(:mod:`django_kvcache.mysql.policy`) and both drivers ask :func:`classify` and nothing
else:

* ``fails_open``: the server is unreachable or overloaded, not misconfigured: under
  ``IGNORE_EXCEPTIONS`` (MySQLCache's default) the call answers as a miss or a no-op,
  logged and counted, and a write that failed so is remembered as missed;
* ``unreachable``: the server, or the path to it, failed: it also counts against the
  server's health (``FAILURE_THRESHOLD``);
* ``connection_lost``: the connection is unusable: the driver closes it, and the next
  statement starts on a fresh one;
* ``rerun``: whether the statement may run again: ``NOT_APPLIED`` errors prove the
  server did not apply it (so it may run again, whatever it does), ``LOST_REPLY``
  errors leave that open (only a statement that may run twice runs again);
  ``reruns``: how many times at most, ``backoff``: the longest pause before the first
  rerun (doubled before each next one; the pause itself is drawn at random below it, so
  writers that collided do not collide again in step).

A new retryable class is one more entry in :data:`CLASSES`; ``docs/mysql.rst`` has the
table of which errors fail open.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Callable

import django.db.utils
from django.db import DatabaseError, OperationalError, ProgrammingError


class Rerun(enum.Enum):
    NEVER = "never"
    NOT_APPLIED = "not applied: may run again"
    IF_IDEMPOTENT = "may have been applied: runs again only if running twice is harmless"


@dataclass(frozen=True)
class ErrorClass:
    name: str
    unreachable: bool
    connection_lost: bool
    rerun: Rerun
    reruns: int = 1
    backoff: float = 0.0
    fails_open: bool = True
    #: Every idle connection of the pool reaches the same server as the one that failed
    #: (a demoted primary): the driver closes them too, so that the rerun, and the calls
    #: after it, start on new connections.
    pool_stale: bool = False

    def pause(self, rerun: int) -> float:
        """Seconds to wait before rerun number ``rerun`` (1, 2, ...): at random below a
        bound that doubles from ``backoff`` up to ``MAX_PAUSE``."""
        if not self.backoff:
            return 0.0
        return random.uniform(0.0, min(self.backoff * 2 ** (rerun - 1), MAX_PAUSE))


#: The longest single pause before a rerun, in seconds.
MAX_PAUSE = 0.016


#: The client could not send the statement (2006 "server has gone away" when sending),
#: or MySQL closed an idle session before reading it (4031): never run.
NOT_SENT = ErrorClass("not sent", unreachable=True, connection_lost=True, rerun=Rerun.NOT_APPLIED)
#: The connection broke after the statement was sent: 2013 lost connection during query
#: (also a KILLed connection or a read_timeout), 2055 lost connection (extended), 1927
#: MariaDB connection killed, 1158-1161 the server's network errors on the connection.
#: The server may have run the statement.
LOST_REPLY = ErrorClass("reply lost", unreachable=True, connection_lost=True,
                        rerun=Rerun.IF_IDEMPOTENT)
#: No connection: 2002/2003 cannot connect (socket/TCP), 2005 unknown host, 1040 too many
#: connections, 1203 the user's max_user_connections, 1053 server shutdown in progress,
#: 1129 host blocked after connection errors.
NO_CONNECTION = ErrorClass("no connection", unreachable=True, connection_lost=True,
                           rerun=Rerun.NEVER)
#: The server answers but serves no statement: Galera's 1047 "WSREP has not yet prepared
#: node for application use", a node cut off from the cluster's primary component (a
#: partition, a lost quorum) or still joining. As unreachable as a stopped server, but the
#: connection is fine: it serves again once the node rejoins. (1047 from a server that
#: is not a Galera node is "unknown command": a ``STATEMENT`` error.)
NOT_SERVING = ErrorClass("node not serving", unreachable=True, connection_lost=False,
                         rerun=Rerun.NEVER)
#: The server refuses writes because it is read-only: 1290 naming ``--read-only`` or
#: ``--super-read-only`` (a primary demoted by a failover; 1290 for another option, say
#: ``--secure-file-priv``, is a ``STATEMENT`` error), MySQL's 1836 read-only mode. Not
#: applied; sent once more on a fresh connection, which reaches the new primary where a
#: proxy or a DNS name follows the failover. The pool's idle connections were opened
#: before it: closed too, else the rerun would take one of them.
READ_ONLY = ErrorClass("read-only server", unreachable=True, connection_lost=True,
                       rerun=Rerun.NOT_APPLIED, pool_stale=True)
#: 1213: InnoDB chose the statement as a deadlock's victim, or a Galera node aborted it at
#: commit because a write committed on another node conflicts with it (a certification
#: failure); 3101 (and 3100, the before_commit hook's error that reports it): MySQL Group
#: Replication rolled it back at commit for the same reason. Either way nothing was
#: applied, so it runs again; each rerun races the other nodes again, after a random
#: pause (below 1, 2, 4, 8, then 16 ms) so that writers that collided do not collide
#: again in step. Writers of one hot key on several nodes meet it
#: often and sometimes in long runs: in tests/test_galera.py's hammering tests (6 writers
#: on 4 keys over 3 nodes, 10,800 calls), 760 calls were rerun, most once or twice, the
#: longest run 18 times. 40 reruns (at most 0.6 s of pauses) before the error is raised
#: (or, under IGNORE_EXCEPTIONS, failed open).
CONFLICT = ErrorClass("conflict, not applied", unreachable=False, connection_lost=False,
                      rerun=Rerun.NOT_APPLIED, reruns=40, backoff=0.001)
#: 1205: InnoDB gave up waiting for a row lock (innodb_lock_wait_timeout, 50 s by
#: default): rolled back. Once more only: each try may wait that long again.
LOCK_WAIT = ErrorClass("lock wait timeout, not applied", unreachable=False,
                       connection_lost=False, rerun=Rerun.NOT_APPLIED)
#: The server is overloaded: a statement stopped by MariaDB's max_statement_time (1969)
#: or MySQL's max_execution_time (3024), killed (1317), out of memory or resources
#: (1037, 1038, 1041), a table or disk full (1114, 1021). Not sent again: it would meet
#: the same limit; not held against the server's health.
OVERLOADED = ErrorClass("server overloaded", unreachable=False, connection_lost=False,
                        rerun=Rerun.NEVER)
#: Anything else: the statement or the configuration is wrong. Raised under any setting.
STATEMENT = ErrorClass("statement", unreachable=False, connection_lost=False,
                       rerun=Rerun.NEVER, fails_open=False)

CLASSES: dict[int, ErrorClass] = {
    **dict.fromkeys((2006, 4031), NOT_SENT),
    **dict.fromkeys((2013, 2055, 1927, 1158, 1159, 1160, 1161), LOST_REPLY),
    **dict.fromkeys((2002, 2003, 2005, 1040, 1203, 1053, 1129), NO_CONNECTION),
    1836: READ_ONLY,
    **dict.fromkeys((1213, 3100, 3101), CONFLICT),
    1205: LOCK_WAIT,
    **dict.fromkeys((1969, 3024, 1317, 1037, 1038, 1041, 1114, 1021), OVERLOADED),
}
#: Codes that mean one thing from one kind of server and another elsewhere: the class
#: when the message says so, else ``STATEMENT``.
BY_MESSAGE: dict[int, tuple[Callable[[str], bool], ErrorClass]] = {
    1047: (lambda message: "wsrep" in message, NOT_SERVING),
    1290: (lambda message: "read-only" in message or "read_only" in message, READ_ONLY),
}

#: "Table ... doesn't exist".
NO_SUCH_TABLE = 1146


class ShardDown(OperationalError):
    """A shard marked down (``RETRY_TIMEOUT``) was not asked: no connection was tried."""


class CacheTableMissing(ProgrammingError):
    """A MySQLCache's table does not exist; the message names the command that creates it.

    The server's error (1146) is chained as ``__cause__``.
    """


class PoolExhausted(OperationalError):
    """Every connection of a pool stayed busy for POOL_TIMEOUT (the server is fine:
    nothing is held against it)."""


#: A pool's connections all busy for POOL_TIMEOUT: this process is overloaded.
POOL_BUSY = ErrorClass("pool exhausted", unreachable=False, connection_lost=False,
                       rerun=Rerun.NEVER)


def error_code(exc: BaseException) -> int | None:
    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def classify(exc: BaseException) -> ErrorClass:
    if isinstance(exc, ShardDown):
        return NO_CONNECTION
    if isinstance(exc, PoolExhausted):
        return POOL_BUSY
    code = error_code(exc)
    if code is None:
        return STATEMENT
    found = CLASSES.get(code)
    if found is not None:
        return found
    rule = BY_MESSAGE.get(code)
    if rule is not None and rule[0](str(exc).lower()):
        return rule[1]
    return STATEMENT


def is_unreachable(exc: BaseException) -> bool:
    return classify(exc).unreachable


def fails_open(exc: BaseException) -> bool:
    """Whether IGNORE_EXCEPTIONS may answer for ``exc`` (unreachable or overloaded)."""
    return isinstance(exc, DatabaseError) and classify(exc).fails_open


def is_lock_conflict(exc: BaseException) -> bool:
    return classify(exc) in (CONFLICT, LOCK_WAIT)


def may_rerun(exc: BaseException, idempotent: bool, reruns: int = 0) -> bool:
    """Whether a statement that failed with ``exc``, already sent again ``reruns`` times,
    may be sent once more (every statement of the cache runs in autocommit mode, on a
    connection of its own: no caller's transaction loses earlier work)."""
    if not isinstance(exc, DatabaseError):
        return False
    error_class = classify(exc)
    if reruns >= error_class.reruns:
        return False
    rerun = error_class.rerun
    return rerun is Rerun.NOT_APPLIED or (rerun is Rerun.IF_IDEMPOTENT and idempotent)


def translate(exc: Exception) -> Exception:
    """A DB-API error of the driver as Django's exception of the same name (what Django's
    own wrapper does), the driver's error chained as ``__cause__``."""
    if isinstance(exc, DatabaseError):  # Django's already
        return exc
    django_class = getattr(django.db.utils, type(exc).__name__, None)
    if not (isinstance(django_class, type) and issubclass(django_class, DatabaseError)):
        return exc
    translated = django_class(*exc.args)
    translated.__cause__ = exc
    return translated
