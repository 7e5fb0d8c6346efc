"""The Django project that runs ``kvcache_benchmark``."""
