"""The package's one fork hook, and its process-wide registries.

A prefork server (gunicorn, uWSGI, Celery) forks a process that already has threads,
pools and sockets. The child gets a copy of every object but only the thread that
forked: a lock another thread held at that moment is never released, a worker thread is
gone, and a socket is still the parent's (both processes would read its replies). So
each object holding such state says what a child must do in ``after_fork()`` and is
registered here (:func:`register`, weakly: registering keeps nothing alive), and the one
hook calls them all in the child.

:class:`Registry` is the process-wide table both backends keep their shared objects in
(node health, clusters, pools, monitors): made on first use, read without a lock once
made, its lock renewed in a forked child.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable, Generic, Hashable, Iterable, Protocol, TypeVar


class ForkAware(Protocol):
    def after_fork(self) -> None:
        """Run in a forked child: renew locks, forget the parent's sockets and threads."""


A = TypeVar("A", bound=ForkAware)
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_aware: weakref.WeakSet[ForkAware] = weakref.WeakSet()
logger = logging.getLogger(__name__)


def register(aware: A) -> A:
    """Have ``aware.after_fork()`` called in every child this process forks."""
    _aware.add(aware)
    return aware


class Registry(Generic[K, V]):
    """A process-wide table of shared objects, each made by the first caller that needs it."""

    def __init__(self) -> None:
        self.items: dict[K, V] = {}
        self.lock = threading.Lock()
        register(self)

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The object for ``key``; made (once, under the lock) if there is none yet."""
        try:
            return self.items[key]
        except KeyError:
            with self.lock:
                found = self.items.get(key)
                if found is None:
                    found = self.items[key] = make()
                return found

    def pop(self, key: K) -> None:
        with self.lock:
            self.items.pop(key, None)

    def values(self) -> list[V]:
        return list(self.items.values())

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork


def disown(sockets: Iterable[Any]) -> None:
    """In a forked child: point each inherited socket's descriptor (its ``fileno()``) at
    ``/dev/null``, so that whatever closes it here (a driver's goodbye, such as MySQL's
    ``COM_QUIT``, at close or when the garbage collector frees it) says nothing on the
    connection the parent still uses. One closed already is left as it is."""
    sockets = list(sockets)
    if not sockets:
        return
    nowhere = os.open(os.devnull, os.O_RDWR)
    try:
        for each in sockets:
            try:
                os.dup2(nowhere, each.fileno(), inheritable=False)
            except Exception:  # noqa: BLE001  (closed already: nothing of the parent's)
                continue
    finally:
        os.close(nowhere)


def _after_fork_in_child() -> None:
    for aware in list(_aware):
        try:
            aware.after_fork()
        except Exception:  # the others must still renew theirs
            logger.exception("Renewing %r in a forked child failed", aware)


os.register_at_fork(after_in_child=_after_fork_in_child)
