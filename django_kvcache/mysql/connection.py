"""One connection of the cache's own: the one class both drivers send statements on.

A :class:`Connection` is a mysqlclient connection (``MySQLdb.connections.Connection``,
so tools may take a cursor of it), opened by :mod:`~django_kvcache.mysql.connect` from an
alias's DATABASES entry. What it does is the same whichever driver holds it: it sends a
statement (:meth:`~Connection.send`, mysqlclient's ``send_query``), reads the reply
(:meth:`~Connection.read`) and says whether the server hung up while it sat idle
(:meth:`~Connection.hung_up`). How to wait for the reply is the driver's: the blocking
one polls the socket (``poll``), the asyncio one has the loop watch it (``watch``). Which connection to take, when to give up on a reply and
what an error does to the connection are the exchange's
(:mod:`~django_kvcache.mysql.exchange`).

A forked child must never close a connection it inherited: closing sends ``COM_QUIT`` on
the socket it shares with its parent, which ends the parent's session. So every open
connection is held by :data:`opened` until the cache closes it (never by the garbage
collector), and in a forked child the inherited ones keep nothing of their parent's
socket: their descriptors are pointed at ``/dev/null`` (:meth:`Opened.after_fork`). The
child may exit however it likes — ``os._exit()``, or ``sys.exit()`` as gunicorn's,
uWSGI's and Celery's workers do, when the interpreter deallocates every object and
mysqlclient closes what it still holds — its ``COM_QUIT`` goes nowhere.
"""
from __future__ import annotations

import select
from typing import Any, Callable

import MySQLdb
import MySQLdb.connections

from django_kvcache import forks
from django_kvcache.mysql.query import Query, Reply
from django_kvcache.mysql.server import statement_bytes


class Connection(MySQLdb.connections.Connection):
    """A mysqlclient connection of the cache's own (see the module). Held open by
    :data:`opened` until :meth:`close`, which never raises (it may be closed already, or
    its server gone), so a pool can always let it go.

    Set when it opens: ``alias`` (its DATABASES alias), ``io_timeout`` (seconds a reply
    may take, ``None``: no limit), ``poll`` (a poll of its socket, in milliseconds);
    ``watch``: the asyncio driver's watch of its socket (None on the blocking driver).
    """

    alias: str
    io_timeout: float | None
    poll: Callable[[float], list[Any]]
    watch: Any = None

    def send(self, query: Query) -> None:
        """Send ``query`` (its reply is read by :meth:`read`, once it is here)."""
        self.send_query(statement_bytes(self, query.sql, query.params))

    def read(self, named: bool = False) -> Reply:
        """The reply of the statement sent: its rows (``named``: as dicts), or its counts.
        A reply read only in part (an error, an interruption) loses the connection:
        :class:`Unreadable`."""
        self.read_query_result()  # an error reply carries no result: nothing left unread
        try:
            result = self.store_result()
            if result is None:
                return (None, self.affected_rows(), self.insert_id(), self.info())
            return (result.fetch_row(0, int(named)), self.affected_rows(), self.insert_id(), None)
        except Exception as exc:  # (an interruption goes on: the exchange closes it)
            raise Unreadable(exc) from exc

    def hung_up(self) -> bool:
        """Whether the server has closed this idle connection (``wait_timeout``, a
        restart, ``KILL``): it sends nothing between statements unless it ends the
        session (a closed socket, or an error packet such as MySQL's 4031), so something
        to read now means it did. Seen by the loop (``watch``) or by a zero-timeout poll."""
        watch = self.watch
        return (watch is not None and watch.hung_up) or bool(self.poll(0))

    def close(self) -> None:
        opened.forget(self)
        watch = self.watch
        if watch is not None:
            self.watch = None
            watch.close()
        try:
            super().close()
        except Exception:  # already closed, or the server is gone: nothing to keep
            pass


class Unreadable(Exception):
    """A reply could not be read to its end: the connection cannot be used again."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def poller(fd: int) -> Callable[[float], list[Any]]:
    """A poll of one descriptor for input, made once (a poll object registered once:
    making one per check costs three times as much); its argument is milliseconds. A
    closed descriptor reports POLLNVAL: something to read, which the read then fails."""
    if not hasattr(select, "poll"):  # select() refuses descriptors above FD_SETSIZE (1024)
        return lambda ms: select.select([fd], [], [], None if ms < 0 else ms / 1000)[0]
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return poll.poll


class Opened:
    """Every connection this process opened and has not closed, with its alias.

    Held here, a connection is closed only by its :meth:`Connection.close`, never by the
    garbage collector. In a forked child the inherited ones are kept too, their sockets
    replaced by ``/dev/null`` (see the module)."""

    def __init__(self) -> None:
        self.open: dict[Any, str] = {}
        self.inherited: list[dict[Any, str]] = []
        forks.register(self)

    def track(self, raw: Any, alias: str) -> None:
        self.open[raw] = alias

    def forget(self, raw: Any) -> None:
        self.open.pop(raw, None)

    def after_fork(self) -> None:
        """In a forked child: the parent's connections are kept, never used, and their
        descriptors now name ``/dev/null``, so that whatever closes them — this process
        closing a connection, or mysqlclient at interpreter exit — writes its
        ``COM_QUIT`` there, not on the socket the child shares with its parent."""
        inherited, self.open = self.open, {}
        self.inherited.append(inherited)
        forks.disown(inherited)


opened = Opened()


def alias_of(raw: Any) -> str | None:
    """The alias a connection of this process was opened for (None: not one of ours)."""
    return opened.open.get(raw)
