"""Each cache operation written once, run by the sync API and by the async API.

An operation is a generator (a *plan*) that yields the IO it needs — one op on one node
(``yield Call(node, op)``, or ``Get(node, key)``: one step, so the blocking path runs it
as one plain call), a :class:`Fanout` of batches on many nodes, a
``Sleep`` (shared: :mod:`django_kvcache.steps`) — and gets each result back (or its
exception thrown in). Everything else (routing, failover, IGNORE_EXCEPTIONS, counters,
clean-up of outdated copies) is plain code in the plan, so the two APIs cannot drift
apart:

    def get(self, key):  return run(self._get(key))          # blocking sockets
    async def aget(self, key):  return await arun(self._get(key))  # asyncio, no thread
"""
from __future__ import annotations

from typing import Any, Sequence

from django_kvcache.memcached import fanout
from django_kvcache.steps import Plan, Sleep, arun, run

__all__ = ["Fanout", "Plan", "Sleep", "arun", "run"]


class Fanout:
    """Every batch's request sent before any reply is read; fills result/error."""

    __slots__ = ("batches",)

    def __init__(self, batches: Sequence[fanout.Batch]) -> None:
        self.batches = batches

    def run(self) -> None:
        fanout.run(self.batches)

    def arun(self) -> Any:
        return fanout.arun(self.batches)


