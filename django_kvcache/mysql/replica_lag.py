"""How far a read replica is behind its primary, asked at most every few seconds.

A replica far behind serves stale cache entries for as long as it lags. A bound on the
lag (``MAX_REPLICA_LAG``, ProxySQL's ``max_replication_lag`` idea) sends a shard's reads to
its primary while its replica is further behind; this module only knows the lag.

The lag is the server's own estimate: ``Seconds_Behind_Master`` of ``SHOW SLAVE STATUS``
(``Seconds_Behind_Source`` of ``SHOW REPLICA STATUS`` on MySQL 8.0.22 and later, where the
old statement is deprecated; 8.4 removed it). Where there is no estimate the replica counts
as infinitely behind: replication stopped or broken (the server reports NULL, or its SQL
thread is not running), a server that replicates nothing, a status that cannot be read (the
server is unreachable, or the user lacks the REPLICATION CLIENT / SLAVE MONITOR privilege;
such failures are logged, rate-limited).

One :class:`LagMonitor` per replica alias and process (:func:`monitor`), shared by every
cache and thread. Callers read its last answer (:attr:`LagMonitor.seconds`, no I/O); one
caller per interval is told to ask again (:meth:`LagMonitor.claim`), so the server is
asked at most once per interval whatever the call rate, and no caller ever waits for
another's question. The question is separate from the I/O: :meth:`~LagMonitor.ask` asks
on a Django connection (blocking); another driver can send :func:`status_statement`
itself and :meth:`~LagMonitor.record` what :func:`lag_from_status` makes of the reply.
:func:`replica_lag` does it all on the calling thread's connection.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Callable, Sequence

from django.db import Error as DatabaseError
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_kvcache.failure_log import FailureLog
from django_kvcache.mysql.server import server_info

logger = logging.getLogger(__name__)
failures = FailureLog(logger, "MySQL replica lag")

#: Infinitely behind: no estimate, or none could be had.
INFINITE = math.inf
#: Seconds between two questions to one replica.
DEFAULT_INTERVAL = 3.0


def status_statement(mariadb: bool, version: tuple[int, ...]) -> str:
    """The statement that reports replication status on this server."""
    if not mariadb and version >= (8, 0, 22):
        return "SHOW REPLICA STATUS"
    return "SHOW SLAVE STATUS"


def lag_from_status(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> float:
    """Seconds behind, from a status reply: INFINITE when the server replicates nothing,
    its SQL thread is not running, or it has no estimate (NULL)."""
    if not rows:
        return INFINITE
    status = dict(zip(columns, rows[0]))  # the default replication connection
    running = status.get("Slave_SQL_Running", status.get("Replica_SQL_Running"))
    seconds = status.get("Seconds_Behind_Master", status.get("Seconds_Behind_Source"))
    if running != "Yes" or seconds is None:
        return INFINITE
    return float(seconds)


class LagMonitor:
    """The lag of one replica alias, as last asked."""

    def __init__(
        self,
        alias: str,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.alias = alias
        self.interval = interval
        self.clock = clock
        #: The last answer; INFINITE until the first one.
        self.seconds: float = INFINITE
        self.answered_at: float | None = None
        self._claimed_at: float | None = None
        self._lock = threading.Lock()

    def claim(self) -> bool:
        """True for the one caller per ``interval`` that should ask the server now (the
        first caller ever included). A question that hangs holds nobody up: the others
        keep the last answer, and the next interval has its own asker."""
        now = self.clock()
        with self._lock:
            if self._claimed_at is not None and now - self._claimed_at < self.interval:
                return False
            self._claimed_at = now
            return True

    def record(self, seconds: float) -> None:
        """The answer to a claimed question."""
        self.seconds, self.answered_at = seconds, self.clock()
        failures.recovered(self.alias)

    def failed(self, error: BaseException) -> None:
        """A claimed question went unanswered: infinitely behind until the next answer."""
        self.seconds, self.answered_at = INFINITE, self.clock()
        failures.failed(self.alias, f"{type(error).__name__}: {error}")

    def ask(self, connection: BaseDatabaseWrapper) -> float:
        """Ask the replica behind ``connection`` (blocking) and record the answer."""
        try:
            info = server_info(connection)
            with connection.cursor() as cursor:
                cursor.execute(status_statement(info.mariadb, info.version))
                columns = [column[0] for column in cursor.description or ()]
                rows = cursor.fetchall()
        except DatabaseError as exc:
            self.failed(exc)
        else:
            self.record(lag_from_status(columns, rows))
        return self.seconds

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._claimed_at = None  # its question is not the child's


_monitors: dict[str, LagMonitor] = {}
_monitors_lock = threading.Lock()


def monitor(alias: str, interval: float = DEFAULT_INTERVAL) -> LagMonitor:
    """The process's monitor of replica ``alias`` (its interval is the first caller's)."""
    with _monitors_lock:
        lag_monitor = _monitors.get(alias)
        if lag_monitor is None:
            lag_monitor = _monitors[alias] = LagMonitor(alias, interval)
        return lag_monitor


def forget(alias: str) -> None:
    """Drop ``alias``'s monitor (its DATABASES entry changed): the next call asks anew."""
    with _monitors_lock:
        _monitors.pop(alias, None)


def replica_lag(alias: str, interval: float = DEFAULT_INTERVAL) -> float:
    """Seconds replica ``alias`` is behind its primary: the last answer, asked again on
    this thread's connection when an interval has passed since the last question."""
    lag_monitor = monitor(alias, interval)
    if lag_monitor.claim():
        return lag_monitor.ask(connections[alias])
    return lag_monitor.seconds


def _new_locks_after_fork() -> None:
    global _monitors_lock
    _monitors_lock = threading.Lock()
    for lag_monitor in list(_monitors.values()):
        lag_monitor._after_fork()


os.register_at_fork(after_in_child=_new_locks_after_fork)
