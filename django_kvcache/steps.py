"""The two drivers of a plan: blocking (``run``) and asyncio (``arun``).

A plan is a generator that yields steps — objects with ``run()`` (blocking) and
``arun()`` (an awaitable) — and gets each step's result sent back, or its exception
thrown in. Written once, a plan runs the same on sockets and on an event loop: the
memcached operations (``memcached.plans``, ``Node.repair_plan``) and the stampede policy
(``stampede.plan``) are plans.
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


class Invoke:
    """``method(*args)`` of an object that has it in both forms: a blocking connection or
    pool returns the result, an asyncio one an awaitable (``exchange``, ``checkout``)."""

    __slots__ = ("method", "args")

    def __init__(self, method: Any, *args: Any) -> None:
        self.method, self.args = method, args

    def run(self) -> Any:
        return self.method(*self.args)

    arun = run


class Sleep:
    """A pause: blocking, or on the event loop."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self) -> None:
        time.sleep(self.seconds)

    def arun(self) -> Any:
        return asyncio.sleep(self.seconds)
