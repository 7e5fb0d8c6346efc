"""The two drivers of a plan: blocking (``run``) and asyncio (``arun``).

A plan is a generator that yields steps and gets each step's result sent back, or its
exception thrown in. A step (:class:`Step`) is one thing to do, in two forms under one
meaning: ``run()`` does it and blocks the thread until it is done; ``arun()`` returns an
awaitable that does it on the running event loop. The blocking driver calls ``run``, the
asyncio driver awaits ``arun``, so a plan written once runs the same on sockets and on an
event loop: the memcached operations (``backends.memcached``) and their exchanges
(``memcached.exchange``), the stampede policy (``stampede.plan``) and the MySQL plans are
plans.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Generator, Protocol, TypeVar

T = TypeVar("T", covariant=True)


class Step(Protocol[T]):
    """One thing a plan asks its driver to do."""

    def run(self) -> T:
        """Do it, blocking this thread until it is done (the blocking driver)."""

    def arun(self) -> Awaitable[T]:
        """An awaitable that does it on the running event loop (the asyncio driver)."""


#: A plan: yields steps, is sent their results; its return value is the plan's.
Plan = Generator["Step[Any]", Any, Any]


def run(plan: Plan) -> Any:
    """Run ``plan`` on blocking sockets in this thread."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as done:
            return done.value
        value = error = None
        try:
            value = step.run()
        except BaseException as exc:  # the plan decides (a KeyboardInterrupt goes through)
            error = exc


async def arun(plan: Plan) -> Any:
    """Run ``plan`` on the running event loop: no thread, no executor."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as done:
            return done.value
        value = error = None
        try:
            value = await step.arun()
        except BaseException as exc:
            error = exc


class Sleep:
    """A pause: blocking, or on the event loop."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self) -> None:
        time.sleep(self.seconds)

    def arun(self) -> Awaitable[None]:
        return asyncio.sleep(self.seconds)
