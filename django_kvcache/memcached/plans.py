"""Each cache operation written once, run by the sync API and by the async API.

An operation is a generator (a *plan*) that yields the IO it needs and gets each result
back (or its exception thrown in). The API method that runs it picks the driver and
tells the plan its transport: ``get`` runs ``self._get(..., BLOCKING)`` with ``run`` on
blocking sockets, ``aget`` runs ``self._get(..., ASYNCIO)`` with ``arun`` on the event
loop. The plan hands the transport to the node's exchange (``yield from
node.exchange(op, io)``), which runs inside the plan's own driver; a :class:`Fanout` of
batches on many nodes and a ``Sleep`` (:mod:`django_kvcache.steps`) are steps. Everything
else (routing, failover, IGNORE_EXCEPTIONS, counters, clean-up of outdated copies) is
plain code in the plan, so the two APIs cannot drift apart:

    def get(self, key):  return run(self._get(key, BLOCKING))            # blocking sockets
    async def aget(self, key):  return await arun(self._get(key, ASYNCIO))  # asyncio, no thread
"""
from __future__ import annotations

from typing import Any, Sequence

from django_kvcache.memcached import fanout
from django_kvcache.memcached.exchange import ASYNCIO, BLOCKING, Transport
from django_kvcache.steps import Plan, Sleep, arun, run

__all__ = ["ASYNCIO", "BLOCKING", "Fanout", "Plan", "Sleep", "Transport", "arun", "run"]


class Fanout:
    """Every batch's request sent before any reply is read; fills result/error."""

    __slots__ = ("batches",)

    def __init__(self, batches: Sequence[fanout.Batch]) -> None:
        self.batches = batches

    def run(self) -> None:
        fanout.run(self.batches)

    def arun(self) -> Any:
        return fanout.arun(self.batches)


