"""The contract suite run against Django's own LocMemCache.

Django's reference backend must pass every contract test; this keeps the suite honest
(a test that encodes a wrong expectation fails here, not just on our backends).
"""
from tests.contract import CacheContract


class TestLocMemCacheMeetsTheContract(CacheContract):
    def backend_params(self):
        return {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "contract"}
