"""The one failure policy of MySQLCache: how calls on shards are run, whatever drives them.

A plan (:mod:`django_kvcache.mysql.plans`) hands over :class:`Call` s — work on one shard
each — and :func:`execute` runs them all together, as a generator that runs each round
of statements through the exchange (:mod:`~django_kvcache.mysql.exchange`: checkout,
send, reply, what an error does to the connection) and yields only its waits, which the
driver it was given waits its own way: the blocking driver
(:mod:`~django_kvcache.mysql.blocking`) in the thread, on the process's connections,
the asyncio driver (:mod:`~django_kvcache.mysql.aio`) on the event loop, on the loop's.
So a single server, shards and replicas, sync or async, follow the same rules:

1. route: the shard's primary for writes, :meth:`Session.reader` for reads (with
   MAX_REPLICA_LAG, a read that claims its replica's question asks the lag first, on the
   side: :mod:`~django_kvcache.mysql.replica_lag`);
2. skip a server marked down (IGNORE_EXCEPTIONS): no connection is tried;
3. owed clean-up (:mod:`~django_kvcache.mysql.cluster`): the call's own owed keys are
   deleted first (a prefix call, which cannot list its keys, leaves the owed ones out
   of its answer instead); one bounded step of the rest is taken on the way
   (maintenance: its failure is logged, never held against the shard, never fails the
   call); a cull deletes what is owed first, within its own budget;
4. attempt, one statement per connection at a time, every shard in each round;
5. classify an error once (:mod:`~django_kvcache.mysql.errors`): send it again where
   that is harmless (as often, and after such a pause, as its class says: a round
   carries the pause, which the driver waits out); hand it to the work, which may answer
   for it (``incr``);
6. account: health, counters, missed writes, the read-your-writes window; then every
   call's answer — the error of a shard that failed raised only once every other shard
   had its turn, or, under IGNORE_EXCEPTIONS, the call's fallback.
"""
from __future__ import annotations

import enum
import logging
import time
from typing import Any, Callable, Generator, Sequence

from django.db import DatabaseError

from django_kvcache.failure_log import FailureLog
from django_kvcache.mysql import errors, exchange, layouts, replica_lag
from django_kvcache.mysql import cluster as owed
from django_kvcache.mysql.cluster import ANY_KEY, MissedWrites, Session
from django_kvcache.mysql.exchange import Driver, Failed, Wait
from django_kvcache.mysql.query import Query, redacted
from django_kvcache.mysql.server import DETECT, remember_server
from django_kvcache.mysql.shards import SHARD_KIND, Shard
from django_kvcache.mysql.sql import Statements
from django_kvcache.signals import node_up

logger = logging.getLogger("django_kvcache.backends.mysql")
#: Failures ignored under IGNORE_EXCEPTIONS: logged once per episode, then summarized.
ignored_failures = FailureLog(logger, "MySQL")
#: Maintenance that failed (owed clean-up, a cull on the write path): logged, never raised.
maintenance_failures = FailureLog(logger, "MySQL maintenance")
#: alias -> the sources (server and cache) of ``ignored_failures`` episodes about it.
_episodes: dict[str, set[str]] = {}


def _shard_answers_again(sender: Any, node: str, kind: str = "", **kwargs: Any) -> None:
    if kind == SHARD_KIND:
        for source in _episodes.pop(node, ()):
            ignored_failures.recovered(source)


node_up.connect(_shard_answers_again, dispatch_uid="django_kvcache.mysql.ignored_failures")

#: A call's ``fallback`` meaning "raise even under IGNORE_EXCEPTIONS" (incr).
RAISE: Any = object()
#: A call's ``missed`` for a write that reaches every key (clear, delete_with_prefix).
EVERYTHING: Any = object()

Work = Callable[[Statements], "Query | Generator[Query, Any, Any]"]


class Access(enum.Enum):
    READ = "the reader: a replica, or the primary within read-your-writes"
    WRITE = "the primary, opening the read-your-writes window"
    PRIMARY_READ = "the primary, without counting as a write (leases)"
    MAINTENANCE = "the primary; failures never count against the shard's health"


class Call:
    """Work on one shard: ``work(statements)`` gives a :class:`Query`, or a generator of
    them that gets each one's answer back (and may catch its error).

    ``fallback``: the answer when IGNORE_EXCEPTIONS hides an unreachable or overloaded
    server (``RAISE``: none). ``missed``: the keys whose older copy a failed write leaves on the
    shard (or ``EVERYTHING``). ``keys``: the stored keys it reads or writes, deleted
    first where a missed write still owes them (``ANY_KEY``: everything owed first).
    ``quiet``: maintenance on the side: a failure is logged and answered with
    ``fallback``. ``owed_budget``: for maintenance over every key (a cull), the owed
    clean-up statements it runs first at most (``None``: all of them).
    """

    __slots__ = ("shard", "access", "work", "fallback", "missed", "keys", "quiet", "owed_budget")

    def __init__(
        self,
        shard: Shard,
        access: Access,
        work: Work,
        fallback: Any = RAISE,
        missed: Any = None,
        keys: Any = (),
        quiet: bool = False,
        owed_budget: int | None = None,
    ) -> None:
        self.shard, self.access, self.work = shard, access, work
        self.fallback, self.missed, self.keys, self.quiet = fallback, missed, keys, quiet
        self.owed_budget = owed_budget


def execute(session: Session, calls: Sequence[Call], io: Driver) -> Generator[Wait, Any, list[Any]]:
    """Run ``calls`` together, on ``io``'s connections; returns their answers in order, or
    raises the first error that no fallback answers once every call is done."""
    settings = session.cluster.connections
    if len(calls) == 1:  # the usual call: one run, one statement per round
        run = Run(session, calls[0])
        runs = [run]
    else:
        runs = [Run(session, call) for call in calls]
    try:
        if len(runs) == 1:
            if run.begin():
                while run.pending is not None:
                    pause = run.take_pause()
                    if pause and (waiting := io.sleep(pause)) is not None:
                        yield waiting  # a rerun's back-off, on the loop
                    run.advance((yield from exchange.one(*run.pending, settings, io)))
            return settle(session, runs)
        active = [run for run in runs if run.begin()]
        while active:
            busy: set[str] = set()
            items: list[tuple[str, Query]] = []
            sending: list[Run] = []
            pause = 0.0
            for run in active:  # never two statements in flight on one connection
                alias, query = run.pending  # type: ignore[misc]
                if alias not in busy:
                    busy.add(alias)
                    items.append((alias, query))
                    sending.append(run)
                    pause = max(pause, run.take_pause())
            if pause and (waiting := io.sleep(pause)) is not None:
                yield waiting
            replies = yield from exchange.perform(items, settings, io)
            for run, reply in zip(sending, replies):
                run.advance(reply)
            active = [run for run in active if run.pending is not None]
        return settle(session, runs)
    finally:
        for run in runs:
            run.end()


class Task:
    """One piece of a run on one alias: the call's work, or owed clean-up or the
    replica-lag question before it. ``failed``: a question on the side, whose error goes
    to it (never held against the alias, never failing the call)."""

    __slots__ = ("alias", "work", "quiet", "done", "failed")

    def __init__(
        self,
        alias: str,
        work: Work,
        quiet: bool = False,
        done: Callable[[Any], None] | None = None,
        failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.alias, self.work, self.quiet, self.done = alias, work, quiet, done
        self.failed = failed


class Run:
    """One call on its way through :func:`execute`."""

    __slots__ = (
        "session", "call", "alias", "tasks", "task", "steps", "pending", "reruns", "pause",
        "result", "error", "failed_on", "skipped", "writes", "cleaning",
    )

    def __init__(self, session: Session, call: Call) -> None:
        self.session, self.call = session, call
        self.tasks: list[Task] = []
        self.task: Task | None = None
        self.steps: Any = None  # the running task's generator, if it is one
        self.pending: tuple[str, Query] | None = None
        self.reruns = 0  # times the pending statement was sent again
        self.pause = 0.0  # seconds to wait before sending it again
        self.result: Any = None
        self.error: BaseException | None = None
        self.failed_on = ""
        self.skipped = False
        self.writes = call.access is Access.WRITE
        self.cleaning: MissedWrites | None = None  # the record whose cleaning lock we hold

    # --- start ---------------------------------------------------------------------------

    def begin(self) -> bool:
        """Route, skip or plan the tasks; True when there is a statement to send."""
        call, session = self.call, self.session
        cluster = session.cluster
        shard = call.shard
        if call.access is Access.READ:
            alias = session.reader(shard)
        else:
            alias = shard.primary()
        self.alias = alias
        if cluster.ignore_exceptions:
            health = cluster.health(alias)
            if health.down_until and not health.may_try():
                self.skipped = True
                return False
        if call.access is Access.READ:
            lag_monitor = cluster.lag_monitor(shard)
            if lag_monitor is not None and lag_monitor.claim():
                # Once per interval per replica (not per call), on the replica whichever
                # alias this read uses; the answer routes the reads that follow.
                replica = lag_monitor.alias
                self.tasks.append(Task(
                    replica, lambda sql: replica_lag.question(replica),
                    quiet=True, done=lag_monitor.record, failed=lag_monitor.failed,
                ))
        if not call.quiet:
            record = cluster.missed(shard)
            if record.pending:
                self._owed_tasks(record, shard.primary())
        self.tasks.append(Task(alias, call.work, call.quiet))
        if self.writes:
            session.wrote(shard)  # before: a lost reply may still have applied
        return self._next_task()

    def _owed_tasks(self, record: MissedWrites, primary: str) -> None:
        scope = self.session.cluster.scope
        self.writes = True
        if self.call.keys is ANY_KEY and self.call.access is Access.MAINTENANCE:
            # cull(): what is owed first, within the cull's own budget of statements.
            budget = self.call.owed_budget
            named = self.session.cluster.describe(primary)
            self.tasks.append(Task(primary,
                                   lambda sql: owed.steps(record, scope, sql, named, budget)))
            return
        if time.monotonic() >= record.resume_at and record.cleaning.acquire(blocking=False):
            # (another call's step is never waited for; a failed one pauses the steps)
            self.cleaning = record
            budget = owed.OWED_BATCHES_PER_CALL
            named = self.session.cluster.describe(primary)
            self.tasks.append(Task(
                primary, lambda sql: owed.steps(record, scope, sql, named, budget),
                quiet=True, done=self._release_cleaning,
            ))
        if self.call.keys is ANY_KEY:
            # A prefix call cannot list its keys: the ones still owed are left out of its
            # answer (plans.with_prefix), never deleted all first here.
            return
        keys = record.owed(self.call.keys)
        if keys:
            generation = record.generation
            self.tasks.append(Task(primary, lambda sql: owed.delete_owed(sql, keys),
                                   done=lambda _: record.settled(keys, generation)))

    def _release_cleaning(self, _: Any = None) -> None:
        if self.cleaning is not None:
            self.cleaning.cleaning.release()
            self.cleaning = None

    def _next_task(self) -> bool:
        """Start the next task (its server detected first if need be); False when none."""
        while self.tasks:
            task = self.task = self.tasks.pop(0)
            sql = self.session.cluster.statements(task.alias)
            if sql is None:
                self._send(task.alias, DETECT)
                return True
            if self._start(task, sql):
                return True
        self.pending = None
        return False

    def _start(self, task: Task, sql: Statements) -> bool:
        try:
            work = task.work(sql)
        except BaseException as exc:
            return self._fail(exc)
        if isinstance(work, Query):
            self.steps = None
            self._send(task.alias, work)
            return True
        self.steps = work
        return self._step(lambda: next(work))

    def _send(self, alias: str, query: Query) -> None:
        self.pending = (alias, query)
        self.reruns = 0

    def take_pause(self) -> float:
        """The pause owed before the pending statement goes out (once)."""
        pause, self.pause = self.pause, 0.0
        return pause

    # --- each reply ------------------------------------------------------------------------

    def advance(self, reply: Any) -> None:
        alias, query = self.pending  # type: ignore[misc]
        task = self.task
        assert task is not None
        if isinstance(reply, Failed):
            error = reply.error
            kind = errors.classify(error)
            if not task.quiet and errors.may_rerun(error, query.idempotent, self.reruns):
                # The same statement again (on a fresh connection if the old one is lost).
                self.reruns += 1
                self.pause = kind.pause(self.reruns)
                self.session.cluster.stats(alias).reruns += 1
                return
            if kind is errors.LOST_REPLY and not query.idempotent and not task.quiet:
                # The caller's outcome is unknown: say why it was not sent again. (A
                # statement that may run twice was, once; maintenance and questions on
                # the side have rate-limited logs of their own.) The statement's text
                # without its values: a value may be session data.
                logger.warning("Not retried after error %s on %s (the server may have run "
                               "it): %s", errors.error_code(error),
                               self.session.cluster.describe(alias), redacted(query.sql))
            self.failed_on = alias
            if task.quiet:
                self._maintenance_failed(alias, error)
            elif self.steps is not None and not task.quiet:
                steps = self.steps
                self._step(lambda: steps.throw(error))  # the work may answer for it
            else:
                self._fail(error)
            return
        if query is DETECT:
            remember_server(alias, reply[0][0])
            self._start(task, self.session.cluster.statements(alias))  # type: ignore[arg-type]
            return
        try:
            answer = query.read(reply)
        except BaseException as exc:
            self._fail(exc)
            return
        if self.steps is None:
            self._finish_task(answer)
            return
        steps = self.steps
        self._step(lambda: steps.send(answer))

    def _step(self, resume: Callable[[], Query]) -> bool:
        """Resume the task's generator: its next statement, or the task is done."""
        try:
            query = resume()
        except StopIteration as done:
            self._finish_task(done.value)
            return self.pending is not None
        except BaseException as exc:
            return self._fail(exc)
        self._send(self.task.alias, query)  # type: ignore[union-attr]
        return True

    def _finish_task(self, answer: Any) -> None:
        task = self.task
        assert task is not None
        if task.done is not None:
            task.done(answer)
        if not self.tasks:
            self.result = answer
        self.steps = None
        self._next_task()

    def _maintenance_failed(self, alias: str, error: BaseException) -> None:
        """Maintenance failed (owed clean-up, a write-path cull): logged; the call goes on
        (a quiet call answers with its fallback). The shard's health is not touched."""
        task = self.task
        if task is not None and task.failed is not None:
            self._aside_failed(task, error)
            return
        if self.steps is not None:
            self.steps.close()
            self.steps = None
        if task is not None and task.done is self._release_cleaning and self.cleaning:
            # Owed clean-up that fails (a lock, a slow DELETE) pauses for RETRY_TIMEOUT:
            # the calls in between do not each wait for it again.
            self.cleaning.resume_at = time.monotonic() + self.session.cluster.retry_timeout
            self._release_cleaning()
        what = "Cull" if self.call.quiet else "Owed clean-up"
        why = "a lock conflict" if errors.is_lock_conflict(error) else "an error"
        maintenance_failures.failed(
            self.session.cluster.describe(alias, kind=False),
            f"{what} of {self.session.cluster.table} skipped after {why}: "
            f"{type(error).__name__}: {error}",
        )
        if not self.tasks:
            self.result = self.call.fallback
        self._next_task()

    def _aside_failed(self, task: Task, error: BaseException) -> bool:
        """A question on the side went unanswered (or its server
        not even detected): its own handler logs it; the call goes on."""
        if self.steps is not None:
            self.steps.close()
            self.steps = None
        task.failed(error)  # type: ignore[misc]
        self.failed_on = ""  # not the call's alias: its own failure names its own
        return self._next_task()

    def _fail(self, error: BaseException) -> bool:
        task = self.task
        if task is not None and task.failed is not None and isinstance(error, Exception):
            return self._aside_failed(task, error)
        self.error = error
        if not self.failed_on:
            self.failed_on = self.pending[0] if self.pending else self.alias
        if self.steps is not None:
            self.steps.close()
            self.steps = None
        self.tasks.clear()
        self.pending = None
        return False

    def end(self) -> None:
        """Whatever happened (also when the driver was interrupted): let go of the
        cleaning lock, and stamp the end of a write."""
        self._release_cleaning()
        if self.steps is not None:
            self.steps.close()
            self.steps = None
        if self.writes and not self.skipped:
            self.session.wrote(self.call.shard)


def settle(session: Session, runs: list[Run]) -> list[Any]:
    """Each run's answer, its shard's health and counters accounted; raises the first
    error no fallback answers."""
    cluster = session.cluster
    answers: list[Any] = []
    raised: BaseException | None = None
    for run in runs:
        call = run.call
        try:
            if run.skipped:
                answers.append(_skipped(session, run))
            elif run.error is None:
                if cluster.ignore_exceptions:
                    cluster.health(run.alias).succeeded()
                answers.append(run.result)
            else:
                answers.append(_failed(session, run))
        except BaseException as exc:
            raised = raised or exc
            answers.append(call.fallback)
    if raised is not None:
        raise raised
    return answers


def _skipped(session: Session, run: Run) -> Any:
    cluster, call, alias = session.cluster, run.call, run.alias
    if call.quiet:
        return call.fallback
    stats = cluster.stats(alias)
    stats.skipped += 1
    _missed(session, call)
    health = cluster.health(alias)
    retry_in = max(0.0, health.down_until - time.monotonic())
    down = errors.ShardDown(
        f"{cluster.describe(alias)} is marked down after {health.failures} consecutive "
        f"failures; next try in {retry_in:.1f} s (RETRY_TIMEOUT)"
    )
    return _ignored(session, alias, stats, down, call.fallback)


def _failed(session: Session, run: Run) -> Any:
    cluster, call = session.cluster, run.call
    error = run.error
    alias = run.failed_on or run.alias
    assert error is not None
    if isinstance(error, DatabaseError) and errors.error_code(error) == errors.NO_SUCH_TABLE:
        missing = errors.CacheTableMissing(session.describe_missing_table(alias))
        missing.__cause__ = error
        raise missing
    if isinstance(error, DatabaseError) and errors.error_code(error) == layouts.UNKNOWN_COLUMN:
        raise layouts.OtherLayout(alias, call.shard) from error  # described by plans.On
    if not errors.fails_open(error):  # the statement or the configuration is wrong
        raise error
    stats = cluster.stats(alias)
    stats.errors += 1
    _missed(session, call)  # a write that failed leaves the older copy
    if not cluster.ignore_exceptions:
        raise error
    if call.access is not Access.MAINTENANCE and errors.is_unreachable(error):
        cluster.health(alias).failed(f"{type(error).__name__}: {error}")
    return _ignored(session, alias, stats, error, call.fallback)


def _missed(session: Session, call: Call) -> None:
    missed = call.missed
    if missed is EVERYTHING:
        session.cluster.missed(call.shard).add_everything()
    elif missed:
        session.cluster.missed(call.shard).add(missed)


def _ignored(session: Session, alias: str, stats: Any, error: BaseException,
             fallback: Any) -> Any:
    if fallback is RAISE:
        raise error
    stats.ignored += 1
    # Logged once per episode and then summarized: a down server fails every call.
    source = session.cluster.describe(alias, kind=False)
    _episodes.setdefault(alias, set()).add(source)
    ignored_failures.failed(source, f"{type(error).__name__}: {error}")
    return fallback
