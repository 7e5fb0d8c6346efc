"""The shared settings readers: each names the setting and the value it refused."""
from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_kvcache import options


@pytest.mark.parametrize("value", [True, 0, -3, 2.0, "4", None], ids=repr)
def test_integer_takes_only_ints_of_the_minimum(value):
    with pytest.raises(ImproperlyConfigured, match=r"OPTIONS\['SIZE'\] must be an integer .*got"):
        options.integer({"SIZE": value}, "SIZE", 1)


def test_integer_default_and_minimum():
    assert options.integer({}, "SIZE", 7) == 7
    assert options.integer({"SIZE": 0}, "SIZE", 7, minimum=0) == 0


@pytest.mark.parametrize("value", [0, -1, True, "1", float("nan")], ids=repr)
def test_seconds_must_be_positive_numbers(value):
    with pytest.raises(ImproperlyConfigured, match=r"OPTIONS\['WAIT'\] must be a positive number"):
        options.seconds({"WAIT": value}, "WAIT", 1.0)


def test_seconds_none_only_where_allowed():
    assert options.seconds({"WAIT": None}, "WAIT", 1.0, allow_none=True) is None
    assert options.seconds({"WAIT": 2}, "WAIT", 1.0) == 2.0
    with pytest.raises(ImproperlyConfigured, match="positive number of seconds, got None"):
        options.seconds({"WAIT": None}, "WAIT", 1.0)


@pytest.mark.parametrize("value", [-0.1, 1.5, False, "0.5"], ids=repr)
def test_fraction_is_a_number_from_0_to_1(value):
    with pytest.raises(ImproperlyConfigured, match="from 0 to 1"):
        options.fraction({"P": value}, "P", 0.5)
    assert options.fraction({"P": 1}, "P", 0.5) == 1.0


@pytest.mark.parametrize("value", [1, 0, "yes", None], ids=repr)
def test_flag_takes_only_bools(value):
    with pytest.raises(ImproperlyConfigured, match=r"OPTIONS\['ON'\] must be True or False"):
        options.flag({"ON": value}, "ON")


def test_check_known_names_the_unknown_keys_and_the_known_ones():
    with pytest.raises(ImproperlyConfigured, match="TLS has unknown keys: cert. Known: cafile"):
        options.check_known({"cert": 1}, {"cafile"}, "TLS")
    with pytest.raises(ImproperlyConfigured, match="TLS must be a dict, got 'x'"):
        options.check_known("x", {"cafile"}, "TLS")


def test_django_integer_minimum():
    assert options.django_integer("0", "MAX_ENTRIES", minimum=0) == 0
    with pytest.raises(ImproperlyConfigured, match="MAX_ENTRIES must be .* at least 0, got -2"):
        options.django_integer(-2, "MAX_ENTRIES", minimum=0)
