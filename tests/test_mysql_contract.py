"""Django's cache contract on MySQLCache, against the real MariaDB test database."""
from __future__ import annotations

import pytest

from tests.contract import CacheContract
from tests.mysql_support import BACKEND, ensure_table


@pytest.mark.django_db(transaction=True)
class TestMySQLCacheMeetsTheContract(CacheContract):
    def backend_params(self):
        return {"BACKEND": BACKEND, "LOCATION": "kvcache_contract"}

    def prepare(self, cache):
        ensure_table(cache)


class TestMyISAMTableMeetsTheContract(TestMySQLCacheMeetsTheContract):
    def backend_params(self):
        return {**super().backend_params(), "LOCATION": "kvcache_contract_myisam",
                "OPTIONS": {"ENGINE": "MyISAM"}}
