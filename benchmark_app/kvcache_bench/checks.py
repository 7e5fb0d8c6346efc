"""Is a benchmarked call's result the right one? Shared by every scenario."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from django.core.cache.backends.base import BaseCache

ABSENT: Any = object()  # "this key must not be in the cache afterwards"


@dataclass(frozen=True)
class Call:
    argument: Any
    expected: Any  # the result the call must return; an exception class for an error


def matches(result: Any, expected: Any) -> bool:
    """Exactly the expected result: same type, so ``1`` is not ``True`` and ``b"x"`` not ``"x"``."""
    if isinstance(expected, type) and issubclass(expected, BaseException):
        return isinstance(result, expected)
    if expected is None or isinstance(expected, bool):
        return result is expected
    return type(result) is type(expected) and result == expected


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def mismatches(results: Sequence[Any], calls: Sequence[Call], known: tuple[Any, str] | None = None) -> list[str]:
    """One line per wrong result; ``known`` is an accepted alternative result and its reason."""
    return [
        f"call {index} returned {_short(result)}, expected {_short(call.expected)}"
        for index, (result, call) in enumerate(zip(results, calls))
        if not matches(result, call.expected) and not (known and matches(result, known[0]))
    ]


def deviations(results: Sequence[Any], calls: Sequence[Call], known: tuple[Any, str] | None) -> int:
    """How many results were the known deviation instead of the right result."""
    if known is None:
        return 0
    return sum(not matches(result, call.expected) and matches(result, known[0])
               for result, call in zip(results, calls))


def stored_mismatches(cache: BaseCache, stored: dict[str, Any]) -> list[str]:
    """What the cache holds after the calls, compared with what it must hold."""
    found = cache.get_many(list(stored)) if stored else {}
    problems = []
    for key, expected in stored.items():
        if expected is ABSENT and key in found:
            problems.append(f"{key} still holds {_short(found[key])} after the calls")
        elif expected is not ABSENT and found.get(key, ABSENT) != expected:
            problems.append(f"{key} holds {_short(found.get(key, 'nothing'))} afterwards, "
                            f"expected {_short(expected)}")
    return problems
