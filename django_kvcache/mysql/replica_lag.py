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
caller per interval (:data:`DEFAULT_INTERVAL`) is told to ask again
(:meth:`LagMonitor.claim`), so the server is asked at most once per interval whatever the
call rate, and no caller ever waits for another's question. This module does no I/O: the
failure policy (:mod:`django_kvcache.mysql.policy`) sends :func:`question` on the replica
alias ahead of the claiming read, through whichever driver runs it (blocking or asyncio),
and hands the answer to :meth:`~LagMonitor.record` or the error to
:meth:`~LagMonitor.failed`.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Sequence

from django_kvcache import forks
from django_kvcache.failure_log import FailureLog
from django_kvcache.forks import Registry
from django_kvcache.mysql.query import ROWS, Query, Reply
from django_kvcache.mysql.server import known_server

logger = logging.getLogger(__name__)
failures = FailureLog(logger, "MySQL replica lag")

#: Infinitely behind: no estimate, or none could be had.
INFINITE = math.inf
#: Seconds between two questions to one replica: the interval of a monitor made without
#: one (read when it is made; tests shorten it).
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


def question(alias: str) -> Query:
    """The status statement for replica ``alias``, once its server is known (the policy
    detects it first); the answer is the seconds behind, as :func:`lag_from_status`."""
    info = known_server(alias)
    assert info is not None, "the policy detects a server before its first statement"
    return Query(status_statement(info.mariadb, info.version), (), _lag_of_reply, named=True)


def _lag_of_reply(reply: Reply) -> float:
    rows = reply[ROWS] or ()  # named: each row a dict of column -> value
    columns = list(rows[0]) if rows else []
    return lag_from_status(columns, [tuple(row.values()) for row in rows])


class LagMonitor:
    """The lag of one replica alias, as last asked."""

    def __init__(
        self,
        alias: str,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.alias = alias
        self.interval = DEFAULT_INTERVAL if interval is None else interval
        self.clock = clock
        #: The last answer; INFINITE until the first one.
        self.seconds: float = INFINITE
        self.answered_at: float | None = None
        self._claimed_at: float | None = None
        self._lock = threading.Lock()
        forks.register(self)

    def claim(self) -> bool:
        """True for the one caller per ``interval`` that should ask the server now (the
        first caller ever included). A question that hangs holds nobody up: the others
        keep the last answer, and the next interval has its own asker."""
        now = self.clock()
        claimed_at = self._claimed_at
        if claimed_at is not None and now - claimed_at < self.interval:
            return False  # the usual answer, on every read: no lock
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

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._claimed_at = None  # its question is not the child's


_monitors: Registry[str, LagMonitor] = Registry()


def monitor(alias: str, interval: float | None = None) -> LagMonitor:
    """The process's monitor of replica ``alias`` (its interval is the first caller's,
    else :data:`DEFAULT_INTERVAL`). Called on every routed read: no lock once it exists."""
    return _monitors.get(alias, lambda: LagMonitor(alias, interval))


def forget(alias: str) -> None:
    """Drop ``alias``'s monitor (its DATABASES entry changed): the next call asks anew."""
    _monitors.pop(alias)
