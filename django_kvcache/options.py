"""Reading a cache's settings: the checks both backends share, in one place.

Every reader raises ``ImproperlyConfigured`` whose message starts with the setting it is
about (``OPTIONS['IO_TIMEOUT'] must be ...``, ``TIMEOUT must be ...``), so a typo fails at
start-up instead of behaving oddly later; the backend puts the cache's name in front
(``CACHES['mc']['OPTIONS']['IO_TIMEOUT'] must be ...``, :func:`name_the_cache`).

Numbers are read one way, Django's: where Django reads ``TIMEOUT``, ``MAX_ENTRIES`` and
``CULL_FREQUENCY`` with ``int(value)``, every number option takes a number or a numeric
string (``"60"``, ``"0.5"`` for seconds). ``bool`` is never taken for a number (``True``
is an ``int`` to Python, but ``"MAX_POOL_SIZE": True`` is a mistake), nor are infinity
and NaN: an infinite STALE_TIMEOUT or LEASE_TIMEOUT cannot be turned into the
milliseconds and expiry times the servers are sent.
"""
from __future__ import annotations

import difflib
import math
import re
from typing import Any, Collection, Mapping

from django.core.exceptions import ImproperlyConfigured

#: OPTIONS that hold a whole number. Django's own two truncate a float, as Django does.
WHOLE_NUMBER_OPTIONS = frozenset(
    {"MAX_ENTRIES", "CULL_FREQUENCY", "COMPRESS_MIN_LENGTH", "COMPRESS_LEVEL",
     "FAILURE_THRESHOLD", "MAX_POOL_SIZE", "REPLICAS"}
)
DJANGO_INTEGER_OPTIONS = frozenset({"MAX_ENTRIES", "CULL_FREQUENCY"})
#: OPTIONS that hold seconds, or another real number (CULL_PROBABILITY, COMPRESS_MIN_SAVING).
REAL_NUMBER_OPTIONS = frozenset(
    {"LEASE_TIMEOUT", "STALE_TIMEOUT", "EARLY_RECOMPUTE", "RETRY_TIMEOUT",
     "READ_YOUR_WRITES", "MAX_REPLICA_LAG", "CONNECT_TIMEOUT", "IO_TIMEOUT", "POOL_TIMEOUT",
     "CULL_PROBABILITY", "COMPRESS_MIN_SAVING"}
)
#: The most seconds any option takes (about 31 years): beyond it a value is a mistake, and
#: one far beyond it (1e300) overflows the expiry times the servers are sent.
MAX_SECONDS = 10**9
#: OPTIONS that map names to real numbers.
NUMBER_MAP_OPTIONS = frozenset({"WEIGHTS"})


class NotANumber(ValueError):
    """A value no number option accepts; the readers turn it into ImproperlyConfigured."""


def is_number(value: Any) -> bool:
    """An ``int`` or ``float``, but not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_number(value: Any, whole: bool, truncate: bool = False) -> int | float:
    """``value`` read as Django reads a number setting: a number, or a string ``int()``
    (``whole``) or ``float()`` parses. A whole number's float must have no fraction
    unless ``truncate`` (Django's own options: ``int(1.5)`` is 1).

    Raises ``NotANumber`` for anything else, ``bool``, infinity and NaN included.
    """
    if isinstance(value, str):
        try:
            value = int(value) if whole else float(value)
        except ValueError:
            raise NotANumber(value) from None
    if not is_number(value) or not math.isfinite(value):
        raise NotANumber(value)
    if not whole:
        return float(value)
    if isinstance(value, float) and not (truncate or value.is_integer()):
        raise NotANumber(value)
    return int(value)


def read_number_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` with every number option read as a number, so that every
    reader (the backends', the codec's, the routers') sees ``60``, never ``"60"``.

    Values that are not numbers are left as they are: the option's own reader refuses
    them with the rule it applies (a range, ``None`` allowed or not).
    """
    read = dict(options)
    for name, value in options.items():
        if value is None or isinstance(value, bool) or type(value) is int:
            continue  # nothing to read (None, a bool: left to the reader to refuse)
        try:
            if name in WHOLE_NUMBER_OPTIONS:
                read[name] = read_number(value, True, name in DJANGO_INTEGER_OPTIONS)
            elif name in REAL_NUMBER_OPTIONS:
                read[name] = read_number(value, False)
            elif name in NUMBER_MAP_OPTIONS and isinstance(value, Mapping):
                read[name] = {key: _read_or_keep(v, name, key) for key, v in value.items()}
        except NotANumber:
            pass
    return read


def _read_or_keep(value: Any, name: str, key: Any) -> Any:
    """A number of a map option: read, refused when infinite or NaN, else left to its reader."""
    try:
        return read_number(value, False)
    except NotANumber:
        if is_number(value):
            raise ImproperlyConfigured(
                f"OPTIONS[{name!r}][{key!r}] must be a finite number, got {value!r}"
            ) from None
        return value


def nearest(name: Any, known: Collection[str]) -> str | None:
    """The known name closest to ``name`` (``max_entries`` -> ``MAX_ENTRIES``), if any."""
    text = str(name)
    if text.upper() in known:
        return text.upper()
    found = difflib.get_close_matches(text.upper(), sorted(known), n=1, cutoff=0.75)
    return found[0] if found else None


#: Stands for the cache in a message (``CACHES['x']``), filled in when the cache is named.
THIS_CACHE = "{this cache}"
#: The settings of a CACHES entry that are not OPTIONS, and what a user who puts one in
#: OPTIONS is told (a backend adds to TIMEOUT's).
TOP_LEVEL = f"it belongs at the top level of {THIS_CACHE}, beside BACKEND, not in OPTIONS"
TOP_LEVEL_HINTS = {
    name: TOP_LEVEL for name in ("TIMEOUT", "KEY_PREFIX", "VERSION", "KEY_FUNCTION", "LOCATION",
                                 "BACKEND")
}


def hint_for(name: Any, hints: Mapping[str, str]) -> str | None:
    """What ``hints`` say of an unknown key: under its exact name, else in lower case
    (``TIMEOUT`` is Django's setting, ``timeout`` pymemcache's)."""
    if not isinstance(name, str):
        return None
    return hints.get(name) or hints.get(name.lower())


def check_known(
    mapping: Any, known: Collection[str], what: str, hints: Mapping[str, str] | None = None
) -> Mapping[str, Any]:
    """``mapping`` itself, after checking it is a dict whose keys are all in ``known``;
    each unknown key comes with what ``hints`` say of it (a name carried over from another
    client, and its equivalent here), else with the nearest known one."""
    if not isinstance(mapping, Mapping):
        raise ImproperlyConfigured(f"{what} must be a dict, got {mapping!r}")
    unknown = sorted(set(mapping) - set(known), key=str)
    if unknown:
        described = []
        for name in unknown:
            hint = hint_for(name, hints or {})
            suggestion = nearest(name, known)
            if hint:
                described.append(f"{name} ({hint})")
            elif suggestion:
                described.append(f"{name} (did you mean {suggestion}?)")
            else:
                described.append(str(name))
        raise ImproperlyConfigured(
            f"{what} has unknown keys: {', '.join(described)}. "
            f"Known: {', '.join(sorted(known))}"
        )
    return mapping


def django_integer(value: Any, name: str, minimum: int | None = None) -> int:
    """A setting Django itself reads with ``int(value)``: TIMEOUT, MAX_ENTRIES, CULL_FREQUENCY.

    Numbers and numeric strings (``"60"``) are taken as Django takes them (floats are
    truncated); where Django silently falls back to its default for anything else, this
    raises, so a typo is not a cache that quietly behaves otherwise.
    """
    try:
        number = int(read_number(value, whole=True, truncate=True))
    except NotANumber:  # "1.5", "ten", float("inf"), float("nan")
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
    """``OPTIONS[name]``: a whole number (or its string) of at least ``minimum``."""
    value = options.get(name, default)
    try:
        number = int(read_number(value, whole=True))
    except NotANumber:
        number = None
    if number is None or number < minimum:
        raise ImproperlyConfigured(
            f"OPTIONS[{name!r}] must be an integer of at least {minimum}, got {value!r}"
        )
    return number


def seconds(
    options: Mapping[str, Any],
    name: str,
    default: float | None,
    allow_none: bool = False,
    allow_zero: bool = False,
) -> float | None:
    """``OPTIONS[name]``: a positive number of seconds up to MAX_SECONDS (or its string),
    ``0`` too with ``allow_zero``, or ``None`` where that means "no limit" (``allow_none``)."""
    value = options.get(name, default)
    if value is None and allow_none:
        return None
    try:
        number = float(read_number(value, whole=False))
    except NotANumber:
        number = None
    if number is None or not (number >= 0 if allow_zero else number > 0) or number > MAX_SECONDS:
        wanted = "a number of seconds from 0" if allow_zero else "a positive number of seconds"
        raise ImproperlyConfigured(
            f"OPTIONS[{name!r}] must be {wanted} (finite, at most {MAX_SECONDS:_})"
            f"{' or None' if allow_none else ''}, got {value!r}"
        )
    return number


def fraction(options: Mapping[str, Any], name: str, default: float) -> float:
    """``OPTIONS[name]``: a number from 0 to 1 (or its string)."""
    value = options.get(name, default)
    try:
        number = float(read_number(value, whole=False))
    except NotANumber:
        number = None
    if number is None or not 0 <= number <= 1:
        raise ImproperlyConfigured(f"OPTIONS[{name!r}] must be a number from 0 to 1, got {value!r}")
    return number


def flag(options: Mapping[str, Any], name: str, default: bool = False) -> bool:
    """``OPTIONS[name]``: ``True`` or ``False``."""
    value = options.get(name, default)
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"OPTIONS[{name!r}] must be True or False, got {value!r}")
    return value


#: The settings a message may start with; the cache's name goes in front of them.
SETTING_AT_START = re.compile(r"(OPTIONS|TIMEOUT|LOCATION|KEY_PREFIX|VERSION|KEY_FUNCTION)\b")
ONE_CACHE = re.compile(r"CACHES\[[^]]*\]")


def name_the_cache(message: str, cache: str) -> str:
    """``message`` about a setting of ``cache`` (``CACHES['mc']``, or a description of
    a cache built outside CACHES), naming it: ``OPTIONS['X'] must be ...`` becomes
    ``CACHES['mc']['OPTIONS']['X'] must be ...``; any other message is prefixed."""
    message = message.replace(THIS_CACHE, cache if ONE_CACHE.fullmatch(cache) else "its settings")
    match = SETTING_AT_START.match(message)
    if match and ONE_CACHE.fullmatch(cache):
        return f"{cache}[{match.group(1)!r}]{message[match.end():]}"
    return f"{cache}: {message}"
