"""The two drivers of a plan: blocking (``run``) and asyncio (``arun``).

A plan is a generator that yields steps and gets each step's result sent back, or its
exception thrown in. A step is an object with ``run()`` (blocking) and ``arun()`` (an
awaitable), or a *call*: a tuple ``(function, arguments)`` of a function that has both
forms under one name — a blocking connection's ``send`` returns, an asyncio one's
returns an awaitable — which the blocking driver makes and the asyncio driver awaits.
Written once, a plan runs the same on sockets and on an event loop: the memcached
operations (``memcached.plans``) and their exchanges (``memcached.exchange``) and the
stampede policy (``stampede.plan``) are plans.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Generator

Plan = Generator[Any, Any, Any]


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
            value = step[0](*step[1]) if type(step) is tuple else step.run()
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
            value = await (step[0](*step[1]) if type(step) is tuple else step.arun())
        except BaseException as exc:
            error = exc


class Sleep:
    """A pause: blocking, or on the event loop."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self) -> None:
        time.sleep(self.seconds)

    def arun(self) -> Any:
        return asyncio.sleep(self.seconds)
