"""Reading a cache's settings: one reading of numbers (Django's) for every number option of
both backends, and errors that name the cache, the option and the nearest known key."""
from __future__ import annotations

import re
from typing import Any, Callable

import pytest
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_kvcache import options
from django_kvcache.backends.memcached import MemcachedCache
from django_kvcache.backends.mysql import MySQLCache

MYSQL = "django_kvcache.backends.mysql.MySQLCache"
MEMCACHED = "django_kvcache.backends.memcached.MemcachedCache"
NOWHERE = "127.0.0.1:1"  # building a MemcachedCache connects to nothing
ZLIB = {"COMPRESSOR": "django_kvcache.codec.ZlibCompressor"}
LEASE = {"LEASE_TIMEOUT": 5}
REPLICATED = {"DATABASE": "shard2", "REPLICAS": {"shard2": "shard2_replica"}}

# --- the readers -------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, 0, -3, 2.5, "4.5", "four", None, float("inf")], ids=repr)
def test_integer_takes_whole_numbers_of_the_minimum(value):
    with pytest.raises(ImproperlyConfigured, match=r"OPTIONS\['SIZE'\] must be an integer .*got"):
        options.integer({"SIZE": value}, "SIZE", 1)


@pytest.mark.parametrize("value, expected", [(4, 4), ("4", 4), (" 4 ", 4), (4.0, 4)], ids=repr)
def test_integer_reads_numbers_and_numeric_strings(value, expected):
    number = options.integer({"SIZE": value}, "SIZE", 7)
    assert number == expected and type(number) is int


def test_integer_default_and_minimum():
    assert options.integer({}, "SIZE", 7) == 7
    assert options.integer({"SIZE": 0}, "SIZE", 7, minimum=0) == 0


@pytest.mark.parametrize(
    "value",
    [0, -1, "0", True, "soon", float("nan"), float("inf"), "inf", "nan", [1], 1e300],
    ids=repr,
)
def test_seconds_must_be_positive_finite_numbers(value):
    with pytest.raises(ImproperlyConfigured, match=(
        r"OPTIONS\['WAIT'\] must be a positive number of seconds \(finite, at most 1_000_000_000\)"
    )):
        options.seconds({"WAIT": value}, "WAIT", 1.0)


@pytest.mark.parametrize("value, expected", [(2, 2.0), ("2", 2.0), ("0.25", 0.25), (0.5, 0.5)])
def test_seconds_reads_numbers_and_numeric_strings(value, expected):
    assert options.seconds({"WAIT": value}, "WAIT", 1.0) == expected


@pytest.mark.parametrize("value, expected", [(0, 0.0), ("0", 0.0), (1.5, 1.5), (None, None)])
def test_seconds_from_zero_where_allowed(value, expected):
    assert options.seconds(
        {"WAIT": value}, "WAIT", None, allow_none=True, allow_zero=True
    ) == expected


def test_seconds_none_only_where_allowed():
    assert options.seconds({"WAIT": None}, "WAIT", 1.0, allow_none=True) is None
    with pytest.raises(ImproperlyConfigured, match=r"\(finite, at most 1_000_000_000\), got None"):
        options.seconds({"WAIT": None}, "WAIT", 1.0)


@pytest.mark.parametrize("value", [-0.1, 1.5, False, "half", float("nan")], ids=repr)
def test_fraction_is_a_number_from_0_to_1(value):
    with pytest.raises(ImproperlyConfigured, match="from 0 to 1"):
        options.fraction({"P": value}, "P", 0.5)


def test_fraction_reads_numbers_and_numeric_strings():
    assert options.fraction({"P": 1}, "P", 0.5) == 1.0
    assert options.fraction({"P": "0.5"}, "P", 0.1) == 0.5


@pytest.mark.parametrize("value", [1, 0, "yes", None], ids=repr)
def test_flag_takes_only_bools(value):
    with pytest.raises(ImproperlyConfigured, match=r"OPTIONS\['ON'\] must be True or False"):
        options.flag({"ON": value}, "ON")


def test_check_known_names_the_unknown_keys_and_the_known_ones():
    with pytest.raises(ImproperlyConfigured, match="TLS has unknown keys: cert. Known: cafile"):
        options.check_known({"cert": 1}, {"cafile"}, "TLS")
    with pytest.raises(ImproperlyConfigured, match="TLS must be a dict, got 'x'"):
        options.check_known("x", {"cafile"}, "TLS")


@pytest.mark.parametrize(
    "typed, nearest",
    [("max_entries", "MAX_ENTRIES"), ("MAX_ENTRY", "MAX_ENTRIES"), ("io_timeout", "IO_TIMEOUT"),
     ("LEASE_TIMOUT", "LEASE_TIMEOUT"), ("SPEED", None)],
)
def test_check_known_suggests_the_nearest_known_key(typed, nearest):
    known = {"MAX_ENTRIES", "IO_TIMEOUT", "LEASE_TIMEOUT", "STALE_TIMEOUT"}
    with pytest.raises(ImproperlyConfigured) as raised:
        options.check_known({typed: 1}, known, "OPTIONS")
    if nearest:
        assert f"unknown keys: {typed} (did you mean {nearest}?)." in str(raised.value)
    else:
        assert f"unknown keys: {typed}. Known:" in str(raised.value)


def test_django_integer_minimum():
    assert options.django_integer("0", "MAX_ENTRIES", minimum=0) == 0
    assert options.django_integer(2.7, "MAX_ENTRIES", minimum=0) == 2  # int(), as Django
    with pytest.raises(ImproperlyConfigured, match="MAX_ENTRIES must be .* at least 0, got -2"):
        options.django_integer(-2, "MAX_ENTRIES", minimum=0)


# --- one reading for every number option of both backends ----------------------------------


def mysql(settings: dict[str, Any]) -> MySQLCache:
    return MySQLCache("kvcache_options", {"OPTIONS": settings})


def memcached(settings: dict[str, Any]) -> MemcachedCache:
    return MemcachedCache(NOWHERE, {"OPTIONS": settings})


Reader = Callable[[Any], Any]
#: (option, its text, the number it means, options it needs, how the backend holds it)
SHARED_NUMBERS: list[tuple[str, str, float, dict[str, Any], Reader]] = [
    ("COMPRESS_MIN_LENGTH", "500", 500, {}, lambda c: c.codec.compress_min_length),
    ("COMPRESS_MIN_SAVING", "0.3", 0.3, {}, lambda c: c.codec.min_saving),
    ("COMPRESS_LEVEL", "5", 5, ZLIB, lambda c: c.codec.compressor.level),
    ("LEASE_TIMEOUT", "10", 10.0, {}, lambda c: c.stampede.lease_timeout),
    ("STALE_TIMEOUT", "30", 30.0, LEASE, lambda c: c.stampede.stale_timeout),
    ("EARLY_RECOMPUTE", "2.5", 2.5, LEASE, lambda c: c.stampede.early_recompute),
]
MYSQL_NUMBERS = [
    *SHARED_NUMBERS,
    ("MAX_ENTRIES", "100", 100, {}, lambda c: c._max_entries),
    ("CULL_FREQUENCY", "4", 4, {}, lambda c: c._cull_frequency),
    ("FAILURE_THRESHOLD", "3", 3, {}, lambda c: c.cluster.failure_threshold),
    ("RETRY_TIMEOUT", "0.5", 0.5, {}, lambda c: c.cluster.retry_timeout),
    ("READ_YOUR_WRITES", "2", 2.0, {}, lambda c: c.cluster.read_your_writes),
    ("MAX_REPLICA_LAG", "2.5", 2.5, REPLICATED, lambda c: c.cluster.max_replica_lag),
    ("MAX_POOL_SIZE", "8", 8, {}, lambda c: c.cluster.max_pool_size),
    ("POOL_TIMEOUT", "3", 3.0, {}, lambda c: c.cluster.pool_timeout),
    ("CONNECT_TIMEOUT", "2", 2.0, {}, lambda c: c.cluster.connections.connect_timeout),
    ("IO_TIMEOUT", "1.5", 1.5, {}, lambda c: c.cluster.connections.io_timeout),
    ("CULL_PROBABILITY", "0.25", 0.25, {}, lambda c: c.cull_probability),
]
#: Memcached's connection options shape the process-wide cluster: a cache whose option
#: is read the same way shares the very same cluster (and its pools) with the number's.
def cluster(cache: MemcachedCache) -> Any:
    return cache.cluster


MEMCACHED_NUMBERS = [
    *SHARED_NUMBERS,
    *(
        (name, text, number, {}, cluster)
        for name, text, number in [
            ("CONNECT_TIMEOUT", "2", 2.0), ("IO_TIMEOUT", "1.5", 1.5),
            ("MAX_POOL_SIZE", "8", 8), ("POOL_TIMEOUT", "3", 3.0),
            ("FAILURE_THRESHOLD", "4", 4), ("RETRY_TIMEOUT", "7", 7.0),
        ]
    ),
    ("WEIGHTS", {NOWHERE: "2"}, {NOWHERE: 2.0}, {}, cluster),
]


def readings(build: Callable[[dict[str, Any]], Any], name: str, text: Any, number: Any,
             needs: dict[str, Any], reader: Reader) -> tuple[Any, Any]:
    as_text, as_number = build({**needs, name: text}), build({**needs, name: number})
    return reader(as_text), reader(as_number)


@pytest.mark.parametrize("name, text, number, needs, reader", MYSQL_NUMBERS,
                         ids=[row[0] for row in MYSQL_NUMBERS])
def test_every_mysql_number_option_reads_a_numeric_string_as_its_number(
    name, text, number, needs, reader
):
    from_text, from_number = readings(mysql, name, text, number, needs, reader)
    assert from_text == from_number == number
    assert type(from_text) is type(from_number)


@pytest.mark.parametrize("name, text, number, needs, reader", MEMCACHED_NUMBERS,
                         ids=[row[0] for row in MEMCACHED_NUMBERS])
def test_every_memcached_number_option_reads_a_numeric_string_as_its_number(
    name, text, number, needs, reader
):
    from_text, from_number = readings(memcached, name, text, number, needs, reader)
    if reader is cluster:
        assert from_text is from_number and from_text is not cluster(memcached({}))
        assert memcached({**needs, name: text}).options[name] == number
    else:
        assert from_text == from_number == number
        assert type(from_text) is type(from_number)


NUMBER_OPTIONS = sorted({row[0] for row in MYSQL_NUMBERS + MEMCACHED_NUMBERS} - {"WEIGHTS"})


@pytest.mark.parametrize("name", NUMBER_OPTIONS)
@pytest.mark.parametrize("junk", [float("inf"), float("nan"), "inf", True, "soon"], ids=repr)
def test_every_number_option_refuses_infinity_nan_bools_and_words_naming_cache_and_option(
    name, junk
):
    backend = MYSQL if name in {row[0] for row in MYSQL_NUMBERS} else MEMCACHED
    location = "kvcache_options" if backend == MYSQL else NOWHERE
    needs = LEASE if name in ("STALE_TIMEOUT", "EARLY_RECOMPUTE") else {}
    configured = {"BACKEND": backend, "LOCATION": location, "OPTIONS": {**needs, name: junk}}
    if name == "COMPRESS_LEVEL":
        configured["OPTIONS"].update(ZLIB)
    with override_settings(CACHES={"mc": configured}):
        with pytest.raises(ImproperlyConfigured) as raised:
            caches["mc"]
    assert str(raised.value).startswith(f"CACHES['mc']['OPTIONS'][{name!r}] must be"), raised.value
    assert repr(junk) in str(raised.value)


@pytest.mark.parametrize("backend, location", [(MYSQL, "kvcache_options"), (MEMCACHED, NOWHERE)])
@pytest.mark.parametrize("share", [-0.1, 1, 1.5, "half", None, [0.2]], ids=repr)
def test_compress_min_saving_is_a_share_below_one_naming_the_cache(backend, location, share):
    configured = {"BACKEND": backend, "LOCATION": location,
                  "OPTIONS": {"COMPRESS_MIN_SAVING": share}}
    with override_settings(CACHES={"mc": configured}):
        with pytest.raises(ImproperlyConfigured) as raised:
            caches["mc"]
    assert str(raised.value) == (
        "CACHES['mc']['OPTIONS']['COMPRESS_MIN_SAVING'] must be a number from 0 (keep any "
        "saving) to below 1 (the share of a value's bytes compression must take off), got "
        f"{share!r}"
    )


def test_compress_min_saving_from_zero_keeps_any_saving():
    assert memcached({"COMPRESS_MIN_SAVING": 0}).codec.min_saving == 0
    assert mysql({"COMPRESS_MIN_SAVING": "0"}).codec.min_saving == 0


# --- issue 21, defect 5: seconds that cannot become milliseconds --------------------------


@pytest.mark.parametrize("backend, location", [(MYSQL, "kvcache_options"), (MEMCACHED, NOWHERE)])
@pytest.mark.parametrize(
    "settings, name",
    [({"LEASE_TIMEOUT": float("inf")}, "LEASE_TIMEOUT"),
     ({"LEASE_TIMEOUT": 5, "STALE_TIMEOUT": float("inf")}, "STALE_TIMEOUT"),
     ({"LEASE_TIMEOUT": 5, "EARLY_RECOMPUTE": float("inf")}, "EARLY_RECOMPUTE"),
     ({"LEASE_TIMEOUT": 5, "STALE_TIMEOUT": float("nan")}, "STALE_TIMEOUT")],
    ids=["lease-inf", "stale-inf", "early-inf", "stale-nan"],
)
def test_infinite_lease_and_stale_timeouts_are_refused_naming_the_cache(
    backend, location, settings, name
):
    """STALE_TIMEOUT=inf made every MySQL write-path cull raise OverflowError, and
    LEASE_TIMEOUT=inf every get_or_set: now the cache does not start."""
    with override_settings(CACHES={"guarded": {"BACKEND": backend, "LOCATION": location,
                                               "OPTIONS": settings}}):
        with pytest.raises(ImproperlyConfigured, match=(
            rf"^CACHES\['guarded'\]\['OPTIONS'\]\['{name}'\] must be a positive number of "
            r"seconds \(finite, at most 1_000_000_000\)"
        )):
            caches["guarded"]


# --- issue 22: MAX_REPLICA_LAG ------------------------------------------------------------


@pytest.mark.parametrize("bound, expected", [(None, None), (0, 0.0), ("0", 0.0), ("30", 30.0)])
def test_max_replica_lag_is_seconds_from_zero_off_by_default(bound, expected):
    settings = {**REPLICATED, **({} if bound is None else {"MAX_REPLICA_LAG": bound})}
    assert mysql(settings).cluster.max_replica_lag == expected


@pytest.mark.parametrize("bound", [-1, -0.5, float("inf"), True, "soon", [3], 1e10], ids=repr)
def test_max_replica_lag_refuses_what_is_not_seconds_naming_the_cache(bound):
    configured = {"BACKEND": MYSQL, "LOCATION": "kvcache_options",
                  "OPTIONS": {**REPLICATED, "MAX_REPLICA_LAG": bound}}
    with override_settings(CACHES={"mc": configured}):
        with pytest.raises(ImproperlyConfigured) as raised:
            caches["mc"]
    assert str(raised.value) == (
        "CACHES['mc']['OPTIONS']['MAX_REPLICA_LAG'] must be a number of seconds from 0 "
        f"(finite, at most 1_000_000_000) or None, got {bound!r}"
    )


def test_max_replica_lag_needs_replicas():
    configured = {"BACKEND": MYSQL, "LOCATION": "kvcache_options",
                  "OPTIONS": {"DATABASE": "shard2", "MAX_REPLICA_LAG": 5}}
    with override_settings(CACHES={"mc": configured}):
        with pytest.raises(ImproperlyConfigured, match=(
            r"^CACHES\['mc'\]\['OPTIONS'\]\['MAX_REPLICA_LAG'\] needs OPTIONS\['REPLICAS'\]"
        )):
            caches["mc"]


# --- errors name the cache ----------------------------------------------------------------


@pytest.mark.parametrize("backend, location", [(MYSQL, "kvcache_options"), (MEMCACHED, NOWHERE)])
def test_an_unknown_key_names_the_cache_and_the_nearest_known_key(backend, location):
    configured = {"BACKEND": backend, "LOCATION": location, "OPTIONS": {"compressr": None}}
    with override_settings(CACHES={"mc": configured}):
        with pytest.raises(ImproperlyConfigured) as raised:
            caches["mc"]
    assert str(raised.value).startswith(
        "CACHES['mc']['OPTIONS'] has unknown keys: compressr (did you mean COMPRESSOR?). "
        "Known: "
    ), raised.value


def known_and_suggested(backend: str, location: Any, typed: str) -> tuple[list[str], str | None]:
    """The "Known:" list of an unknown key's message, and what it suggests for ``typed``."""
    message = configured_error(backend, location, {typed: 1})
    known = message.rsplit("Known: ", 1)[1].split(", ")
    suggested = re.search(r"did you mean (\w+)\?", message)
    return known, suggested and suggested[1]


@pytest.mark.parametrize("backend, location", [(MYSQL, "kvcache_options"), (MEMCACHED, NOWHERE)])
def test_a_backend_never_offers_an_option_it_refuses(backend, location):
    """Each option of the "Known:" list, given to the backend, is taken (MemcachedCache
    listed MAX_ENTRIES and CULL_FREQUENCY, and suggested them for a typo, then refused
    them: memcached has no entry count); a typo of a refused option suggests nothing."""
    known, _ = known_and_suggested(backend, location, "NOPE")
    refused = []
    for name in known:
        configured = {"BACKEND": backend, "LOCATION": location, "OPTIONS": {name: 1}}
        with override_settings(CACHES={"x": configured}):
            try:
                caches["x"]
            except ImproperlyConfigured as exc:  # a value this test made up: fine
                if "does not apply" in str(exc):
                    refused.append(name)
    assert refused == []
    for typed in ("MAX_ENTRIE", "CULL_FREQUENCI", "MAX_ENTRIES_"):
        _, suggested = known_and_suggested(backend, location, typed)
        assert suggested is None or suggested in known


def test_memcached_tells_a_refused_option_in_lower_case_why():
    message = configured_error(MEMCACHED, NOWHERE, {"max_entries": 10})
    assert message.startswith(
        "CACHES['x']['OPTIONS'] has unknown keys: max_entries (MAX_ENTRIES does not apply to "
        "MemcachedCache: memcached evicts the least recently used items when its memory "
        "(memcached -m) is full, so there is no entry count to keep). Known: "), message
    assert "MAX_ENTRIES" not in message.split("Known: ")[1]


def test_a_message_about_another_setting_names_the_cache_in_front():
    configured = {"BACKEND": MEMCACHED, "LOCATION": [NOWHERE, NOWHERE]}
    with override_settings(CACHES={"mc": configured}):
        with pytest.raises(ImproperlyConfigured, match=r"^CACHES\['mc'\]: memcached LOCATION"):
            caches["mc"]
    with override_settings(CACHES={"db": {"BACKEND": MYSQL, "LOCATION": "a`b"}}):
        with pytest.raises(ImproperlyConfigured, match=r"^CACHES\['db'\]: MySQLCache LOCATION"):
            caches["db"]


def test_the_timeout_setting_is_named_with_its_cache():
    configured = {"BACKEND": MEMCACHED, "LOCATION": NOWHERE, "TIMEOUT": "soon"}
    with override_settings(CACHES={"mc": configured}):
        with pytest.raises(ImproperlyConfigured, match=r"^CACHES\['mc'\]\['TIMEOUT'\] must be"):
            caches["mc"]


def test_two_equal_entries_are_both_named():
    configured = {"BACKEND": MEMCACHED, "LOCATION": NOWHERE, "OPTIONS": {"IO_TIMEOUT": 0}}
    with override_settings(CACHES={"a": configured, "b": dict(configured)}):
        with pytest.raises(ImproperlyConfigured, match=r"^CACHES\['a'\] or CACHES\['b'\]: OPTIONS"):
            caches["b"]


@pytest.mark.parametrize("build, described", [
    (lambda: MySQLCache("kvcache_x", {"OPTIONS": {"max_entries": 1}}),
     "a MySQLCache with LOCATION 'kvcache_x' built outside CACHES: OPTIONS has unknown keys: "
     "max_entries (did you mean MAX_ENTRIES?)"),
    (lambda: MemcachedCache(NOWHERE, {"OPTIONS": {"IO_TIMEOUT": "soon"}}),
     "a MemcachedCache with LOCATION '127.0.0.1:1' built outside CACHES: "
     "OPTIONS['IO_TIMEOUT'] must be a positive number of seconds (finite, at most "
     "1_000_000_000)"),
])
def test_a_cache_built_outside_caches_is_described(build, described):
    with override_settings(CACHES={"default": {"BACKEND": MYSQL, "LOCATION": "other"}}):
        with pytest.raises(ImproperlyConfigured) as raised:
            build()
    assert str(raised.value).startswith(described), raised.value


# --- settings carried over from Django, pymemcache, django-redis and django-mysql -----------


def configured_error(backend: str, location: str, options: dict[str, Any]) -> str:
    configured = {"BACKEND": backend, "LOCATION": location, "OPTIONS": options}
    with override_settings(CACHES={"x": configured}):
        with pytest.raises(ImproperlyConfigured) as raised:
            caches["x"]
    return str(raised.value)


@pytest.mark.parametrize("backend, location", [(MYSQL, "kvcache_options"), (MEMCACHED, NOWHERE)])
@pytest.mark.parametrize("name", ["TIMEOUT", "KEY_PREFIX", "VERSION", "KEY_FUNCTION"])
def test_a_top_level_setting_in_options_says_where_it_belongs(backend, location, name):
    message = configured_error(backend, location, {name: 60})
    assert message.startswith(
        f"CACHES['x']['OPTIONS'] has unknown keys: {name} (it belongs at the top level of "
        "CACHES['x'], beside BACKEND, not in OPTIONS"
    ), message
    assert "did you mean" not in message


def test_timeout_in_options_names_the_socket_timeouts_too():
    memcached = configured_error(MEMCACHED, NOWHERE, {"TIMEOUT": 60})
    assert "TIMEOUT (it belongs at the top level of CACHES['x'], beside BACKEND, not in " \
        "OPTIONS: the entries' default expiry in seconds; the socket timeouts are " \
        "CONNECT_TIMEOUT and IO_TIMEOUT)" in memcached
    mysql = configured_error(MYSQL, "kvcache_options", {"TIMEOUT": 60})
    assert "the entries' default expiry in seconds; the connections' timeouts are " \
        "CONNECT_TIMEOUT and IO_TIMEOUT)" in mysql


@pytest.mark.parametrize("name, said", [
    ("ignore_exc", "ignore_exc (pymemcache's name: here IGNORE_EXCEPTIONS, True by default)"),
    ("no_delay", "no_delay (pymemcache's option: TCP_NODELAY is always on here)"),
    ("connect_timeout", "connect_timeout (pymemcache's name: here CONNECT_TIMEOUT, in seconds)"),
    ("timeout", "timeout (pymemcache's socket timeout: here IO_TIMEOUT, in seconds; the "
                "entries' default expiry is TIMEOUT, at the top level of CACHES['x'])"),
    ("dead_timeout", "dead_timeout (pymemcache's name: here RETRY_TIMEOUT, the seconds a "
                     "node that failed is skipped)"),
    ("use_pooling", "use_pooling (pymemcache's option: connections are always pooled here, "
                    "see MAX_POOL_SIZE and POOL_TIMEOUT)"),
    ("serde", "serde (pymemcache's option: here SERIALIZER)"),
    ("SOCKET_TIMEOUT", "SOCKET_TIMEOUT (django-redis's name: here IO_TIMEOUT)"),
])
def test_memcached_names_the_equivalent_of_a_carried_over_option(name, said):
    message = configured_error(MEMCACHED, NOWHERE, {name: 1})
    assert f"has unknown keys: {said}. Known: " in message, message


@pytest.mark.parametrize("name, said", [
    ("ignore_exc", "ignore_exc (pymemcache's name: here IGNORE_EXCEPTIONS)"),
    ("connect_timeout", "connect_timeout (here CONNECT_TIMEOUT, in seconds; connect_timeout "
                        "belongs in the OPTIONS of a DATABASES entry)"),
    ("read_timeout", "read_timeout (here IO_TIMEOUT, in seconds; read_timeout belongs in the "
                     "OPTIONS of a DATABASES entry)"),
    ("SOCKET_TIMEOUT", "SOCKET_TIMEOUT (django-redis's name: here IO_TIMEOUT)"),
    ("REVERSE_KEY_FUNCTION", "REVERSE_KEY_FUNCTION (django-mysql's option: not needed here, "
                             "the prefix operations read keys made by the default "
                             "KEY_FUNCTION)"),
])
def test_mysql_names_the_equivalent_of_a_carried_over_option(name, said):
    message = configured_error(MYSQL, "kvcache_options", {name: 1})
    assert f"has unknown keys: {said}. Known: " in message, message


@pytest.mark.parametrize("name", ["MAX_ENTRIES", "CULL_FREQUENCY"])
def test_an_option_memcached_has_no_use_for_says_why(name):
    message = configured_error(MEMCACHED, NOWHERE, {name: 100})
    assert message == (
        f"CACHES['x']['OPTIONS'][{name!r}] does not apply to MemcachedCache: memcached evicts "
        "the least recently used items when its memory (memcached -m) is full, so there is "
        "no entry count to keep. Remove it."
    )


def test_a_bool_is_refused_after_a_cache_with_the_equal_number_was_built():
    # True == 1 and hash(True) == hash(1): a process-wide cluster built for POOL_TIMEOUT 1
    # must not be handed to a cache that says POOL_TIMEOUT True, which is refused.
    valid = {"BACKEND": MYSQL, "LOCATION": "kvcache_options", "OPTIONS": {"POOL_TIMEOUT": 1}}
    with override_settings(CACHES={"mc": valid}):
        caches["mc"]
    refused = {**valid, "OPTIONS": {"POOL_TIMEOUT": True}}
    with override_settings(CACHES={"mc": refused}):
        with pytest.raises(ImproperlyConfigured, match="POOL_TIMEOUT"):
            caches["mc"]
