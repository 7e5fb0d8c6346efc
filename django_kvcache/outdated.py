"""Keys whose copy on a node may be older than the last write to them.

A node is what a backend spreads keys over and may lose: a memcached server, a MySQL
shard. A write that fails, or is skipped because the node is marked down, leaves the
node's previous value in place; once the node answers again that value would be served
as if current. So the backend remembers each such key for its node and deletes it there
before the node serves anything else; past ``LIMIT`` keys the record gives up listing
them and asks for the whole node to be flushed instead (memory stays bounded).

The record is process-local: it covers the writes this process dropped, not another
process's. How to delete or flush is the backend's business.
"""
from __future__ import annotations

import threading
from typing import Iterable

from django_kvcache import forks

#: Remembered keys per node before we give up listing them and flush the node instead.
LIMIT = 10_000


class OutdatedCopies:
    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.flush = False
        self.pending = False  # read without the lock on every request: keep it a plain bool
        self.lock = threading.Lock()
        forks.register(self)

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
        """Everything to clean up, now owned by the caller (``put_back`` if that fails,
        ``done`` once it succeeded). ``pending`` stays set meanwhile, so other threads
        wait for the clean-up instead of reading what it is about to delete."""
        with self.lock:
            keys, flush = self.keys, self.flush
            self.keys, self.flush = set(), False
        return keys, flush

    def done(self) -> None:
        """The clean-up landed: nothing pending unless more was added meanwhile."""
        with self.lock:
            self.pending = bool(self.keys) or self.flush

    def put_back(self, keys: set[str], flush: bool) -> None:
        with self.lock:
            self.flush = self.flush or flush
            if not self.flush:
                self.keys |= keys
            self.pending = True

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork
