"""Django's cache contract on MySQLCache, against the real MariaDB test database."""
from __future__ import annotations

import pytest
from django.conf import settings

from tests.contract import CacheContract
from tests.mysql_support import BACKEND, ensure_table


@pytest.mark.django_db(transaction=True)
class TestMySQLCacheMeetsTheContract(CacheContract):
    clock_resolution = 0.001  # expires in milliseconds

    def backend_params(self):
        return {"BACKEND": BACKEND, "LOCATION": "kvcache_contract"}

    def prepare(self, cache):
        ensure_table(cache)


@pytest.mark.once  # a variant: the Django API is checked in every environment by the base class
class TestMyISAMTableMeetsTheContract(TestMySQLCacheMeetsTheContract):
    def backend_params(self):
        return {**super().backend_params(), "LOCATION": "kvcache_contract_myisam",
                "OPTIONS": {"ENGINE": "MyISAM"}}


SHARDS = list(settings.SHARD_ALIASES)
REPLICA = "shard2_replica"


@pytest.mark.once  # a variant: the Django API is checked in every environment by the base class
@pytest.mark.skipif(len(SHARDS) < 3, reason="needs KVCACHE_MYSQL_SHARD_PORTS (two ports)")
@pytest.mark.django_db(transaction=True, databases=["default", *SHARDS, REPLICA])
class TestShardedMySQLCacheMeetsTheContract(CacheContract):
    """Three shards on three servers, one of them read through a replica alias: the
    contract on both APIs (the async one on the event loop's own connections)."""

    clock_resolution = 0.001  # expires in milliseconds

    def backend_params(self):
        return {"BACKEND": BACKEND, "LOCATION": "kvcache_contract_shards",
                "OPTIONS": {"DATABASES": SHARDS, "REPLICAS": {"shard2": REPLICA}}}

    def prepare(self, cache):
        ensure_table(cache)


@pytest.mark.once  # a variant: the Django API is checked in every environment by the base class
@pytest.mark.skipif(len(SHARDS) < 3, reason="needs KVCACHE_MYSQL_SHARD_PORTS (two ports)")
@pytest.mark.django_db(transaction=True, databases=["default", *SHARDS, REPLICA])
class TestReplicatedMySQLCacheMeetsTheContract(CacheContract):
    """One shard, its reads from a replica alias (read-your-writes in between)."""

    clock_resolution = 0.001  # expires in milliseconds

    def backend_params(self):
        return {"BACKEND": BACKEND, "LOCATION": "kvcache_contract_replica",
                "OPTIONS": {"DATABASE": "shard2", "REPLICAS": {"shard2": REPLICA}}}

    def prepare(self, cache):
        ensure_table(cache)


@pytest.mark.once  # a variant: the Django API is checked in every environment by the base class
class TestEncryptedMySQLCacheMeetsTheContract(TestMySQLCacheMeetsTheContract):
    """ENCRYPTION_KEYS: every value AES-GCM encrypted, integers plain (tests/test_encryption)."""

    def backend_params(self):
        return {**super().backend_params(), "LOCATION": "kvcache_contract_encrypted",
                "OPTIONS": {"ENCRYPTION_KEYS": ["the contract's encryption key, 0123456789"]}}
