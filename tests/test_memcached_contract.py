"""Django's cache contract on MemcachedCache, spread over three nodes of its own.

The contract's fixture flushes the cache around every test; dedicated memcached
processes keep that away from the shared nodes other test modules use.
"""
from __future__ import annotations

from contextlib import ExitStack

import pytest

from tests.contract import CacheContract, CacheFixture
from tests.servers import memcached_node

BACKEND = "django_kvcache.backends.memcached.MemcachedCache"


@pytest.fixture(scope="module")
def contract_nodes():
    with ExitStack() as stack:
        yield [stack.enter_context(memcached_node()).address for _ in range(3)]


class TestMemcachedCacheMeetsTheContract(CacheContract):
    @pytest.fixture(autouse=True)
    def _nodes(self, contract_nodes):
        self.locations = contract_nodes

    def backend_params(self):
        return {"BACKEND": BACKEND, "LOCATION": self.locations}


@pytest.mark.once  # a variant: the Django API is checked in every environment by the base class
class TestPymemcachePlacementMeetsTheContract(TestMemcachedCacheMeetsTheContract):
    def backend_params(self):
        return {**super().backend_params(), "OPTIONS": {"HASHING": "pymemcache"}}


@pytest.mark.once  # a variant: the Django API is checked in every environment by the base class
class TestUnbatchedMemcachedCacheMeetsTheContract(TestMemcachedCacheMeetsTheContract):
    """AUTOBATCH off (it is on by default): every async get is a request of its own."""

    def backend_params(self):
        return {**super().backend_params(), "OPTIONS": {"AUTOBATCH": False}}


@pytest.mark.once  # a variant: the Django API is checked in every environment by the base class
class TestEncryptedMemcachedCacheMeetsTheContract(TestMemcachedCacheMeetsTheContract):
    """ENCRYPTION_KEYS: every value AES-GCM encrypted, integers plain (tests/test_encryption)."""

    def backend_params(self):
        return {**super().backend_params(),
                "OPTIONS": {"ENCRYPTION_KEYS": ["the contract's encryption key, 0123456789"]}}


@pytest.mark.once  # a variant: the Django API is checked in every environment by the base class
class TestReplicatedMemcachedCacheMeetsTheContract(TestMemcachedCacheMeetsTheContract):
    """REPLICAS 2: every key on two of the three nodes, reads spread over both."""

    def backend_params(self):
        return {**super().backend_params(), "OPTIONS": {"REPLICAS": 2}}


@pytest.mark.once
class TestThreeReplicasMeetTheContract(TestMemcachedCacheMeetsTheContract):
    """REPLICAS 3: every key on every node."""

    def backend_params(self):
        return {**super().backend_params(), "OPTIONS": {"REPLICAS": 3}}


@pytest.mark.once
class TestReplicatedHerdProofMemcachedCacheMeetsTheContract(TestMemcachedCacheMeetsTheContract):
    """REPLICAS 2 with get_or_set's leases and stale copies on the meta commands."""

    def backend_params(self):
        return {**super().backend_params(),
                "OPTIONS": {"REPLICAS": 2, "LEASE_TIMEOUT": 5, "STALE_TIMEOUT": 30}}


@pytest.mark.once
class TestReplicatedClassicProtocolMeetsTheContract(TestMemcachedCacheMeetsTheContract):
    """REPLICAS 2 on the classic protocol only (as on memcached before 1.6.6): the nodes
    are taken for servers without meta commands, so leases are add-based, and ``add``,
    counters and stale copies take their classic paths."""

    @pytest.fixture(autouse=True)
    def _classic(self, _nodes):
        nodes = CacheFixture.build(self).cluster.nodes  # the cache itself, not its async view
        for node in nodes:
            node.meta = False
        yield
        for node in nodes:
            node.meta = None

    def backend_params(self):
        return {**super().backend_params(),
                "OPTIONS": {"REPLICAS": 2, "LEASE_TIMEOUT": 5, "STALE_TIMEOUT": 30}}
