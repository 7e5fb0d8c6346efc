"""MySQLCache under hostile input and concurrency (the shared suites of issue #6)."""
from __future__ import annotations

import pytest

from tests.concurrency import ConcurrencyContract
from tests.contract import CacheFixture
from tests.hostile import HostileInputContract
from tests.mysql_support import BACKEND, ensure_table


@pytest.mark.django_db(transaction=True)
class TestMySQLCacheHardening(HostileInputContract, ConcurrencyContract, CacheFixture):
    key_rule = "warn"

    def backend_params(self):
        return {"BACKEND": BACKEND, "LOCATION": "kvcache_hardening"}

    def prepare(self, cache):
        ensure_table(cache)
