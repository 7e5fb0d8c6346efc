"""Reading a cache's settings: the checks both backends share, in one place.

Every reader raises ``ImproperlyConfigured`` naming the setting and the value it got, so a
typo fails at start-up instead of behaving oddly later. ``bool`` is never taken for a
number (``True`` is an ``int`` to Python, but ``"MAX_POOL_SIZE": True`` is a mistake).
"""
from __future__ import annotations

from typing import Any, Collection, Mapping

from django.core.exceptions import ImproperlyConfigured


def is_number(value: Any) -> bool:
    """An ``int`` or ``float``, but not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_known(mapping: Any, known: Collection[str], what: str) -> Mapping[str, Any]:
    """``mapping`` itself, after checking it is a dict whose keys are all in ``known``."""
    if not isinstance(mapping, Mapping):
        raise ImproperlyConfigured(f"{what} must be a dict, got {mapping!r}")
    unknown = sorted(set(mapping) - set(known), key=str)
    if unknown:
        raise ImproperlyConfigured(
            f"{what} has unknown keys: {', '.join(map(str, unknown))}. "
            f"Known: {', '.join(sorted(known))}"
        )
    return mapping


def django_integer(value: Any, name: str, minimum: int | None = None) -> int:
    """A setting Django itself reads with ``int(value)``: TIMEOUT, MAX_ENTRIES, CULL_FREQUENCY.

    Numbers and numeric strings (``"60"``) are taken as Django takes them (floats are
    truncated); where Django silently falls back to its default for anything else, this
    raises, so a typo is not a cache that quietly behaves otherwise.
    """
    if is_number(value) or isinstance(value, str):
        try:
            number = int(value)
        except (ValueError, OverflowError):  # "1.5", "ten", float("inf"), float("nan")
            pass
        else:
            if minimum is None or number >= minimum:
                return number
    wanted = "an integer or a numeric string"
    if minimum is not None:
        wanted = f"{wanted} of at least {minimum}"
    raise ImproperlyConfigured(f"{name} must be {wanted}, got {value!r}")


def timeout_setting(value: Any, name: str = "TIMEOUT") -> int | None:
    """The cache's default TIMEOUT: ``None`` (forever) or what Django's ``int()`` makes of it."""
    return None if value is None else django_integer(value, name)


def integer(options: Mapping[str, Any], name: str, default: int, minimum: int = 1) -> int:
    """``OPTIONS[name]``: an ``int`` of at least ``minimum``."""
    value = options.get(name, default)
    if type(value) is not int or value < minimum:
        raise ImproperlyConfigured(
            f"OPTIONS[{name!r}] must be an integer of at least {minimum}, got {value!r}"
        )
    return value


def seconds(
    options: Mapping[str, Any], name: str, default: float | None, allow_none: bool = False
) -> float | None:
    """``OPTIONS[name]``: a positive number of seconds (or ``None`` where that means "no limit")."""
    value = options.get(name, default)
    if value is None and allow_none:
        return None
    if not is_number(value) or not value > 0:
        raise ImproperlyConfigured(
            f"OPTIONS[{name!r}] must be a positive number of seconds"
            f"{' or None' if allow_none else ''}, got {value!r}"
        )
    return float(value)


def fraction(options: Mapping[str, Any], name: str, default: float) -> float:
    """``OPTIONS[name]``: a number from 0 to 1."""
    value = options.get(name, default)
    if not is_number(value) or not 0 <= value <= 1:
        raise ImproperlyConfigured(f"OPTIONS[{name!r}] must be a number from 0 to 1, got {value!r}")
    return float(value)


def flag(options: Mapping[str, Any], name: str, default: bool = False) -> bool:
    """``OPTIONS[name]``: ``True`` or ``False``."""
    value = options.get(name, default)
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"OPTIONS[{name!r}] must be True or False, got {value!r}")
    return value
