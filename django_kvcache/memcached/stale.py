"""Keys whose copy on a node may be older than the last write to them.

A write that fails, times out or is skipped because the node is down leaves the node's
previous value in place. Once the node answers again — it may only have been
unreachable, not restarted — that value would be served as if current. So every such
key is remembered for its node and deleted there before the node serves anything else
(past ``LIMIT`` keys the whole node is flushed instead).

This covers the writes this process dropped; another process that dropped writes does
the same when it next uses the node.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Iterable

#: Remembered keys per node before we give up listing them and flush the node instead.
LIMIT = 10_000


class OutdatedCopies:
    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.flush = False
        self.pending = False  # read without the lock on every request: keep it a plain bool
        self.lock = threading.Lock()
        _all.add(self)

    def add(self, keys: Iterable[str]) -> None:
        with self.lock:
            if not self.flush:
                self.keys.update(keys)
                if len(self.keys) > LIMIT:
                    self.keys, self.flush = set(), True
            self.pending = True

    def add_everything(self) -> None:
        """The node missed a flush: everything on it is outdated."""
        with self.lock:
            self.keys, self.flush, self.pending = set(), True, True

    def take(self) -> tuple[set[str], bool]:
        """Everything to clean up, now owned by the caller (``put_back`` if that fails)."""
        with self.lock:
            keys, flush = self.keys, self.flush
            self.keys, self.flush, self.pending = set(), False, False
        return keys, flush

    def put_back(self, keys: set[str], flush: bool) -> None:
        with self.lock:
            self.flush = self.flush or flush
            if not self.flush:
                self.keys |= keys
            self.pending = True

    @staticmethod
    def request(keys: set[str], flush: bool) -> tuple[bytes, int]:
        """The pipelined commands that clean up, and how many reply lines they get."""
        if flush:
            return b"flush_all\r\n", 1
        return b"".join(b"delete %b\r\n" % key.encode() for key in keys), len(keys)


_all: weakref.WeakSet[OutdatedCopies] = weakref.WeakSet()


def _new_locks_after_fork() -> None:
    for copies in list(_all):
        copies.lock = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_after_fork)
