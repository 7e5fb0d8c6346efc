"""MemcachedCache under hostile input and concurrency (the shared suites of issue #6)."""
from __future__ import annotations

import pytest

from tests.concurrency import ConcurrencyContract
from tests.contract import CacheFixture
from tests.hostile import HostileInputContract

BACKEND = "django_kvcache.backends.memcached.MemcachedCache"


class TestMemcachedCacheHardening(HostileInputContract, ConcurrencyContract, CacheFixture):
    key_rule = "raise"

    @pytest.fixture(autouse=True)
    def _nodes(self, private_memcached_nodes):
        self.locations = private_memcached_nodes

    def backend_params(self):
        return {"BACKEND": BACKEND, "LOCATION": self.locations}
