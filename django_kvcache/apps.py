from django.apps import AppConfig


class KVCacheConfig(AppConfig):
    """Add ``"django_kvcache"`` to INSTALLED_APPS for the management commands and checks."""

    name = "django_kvcache"
    verbose_name = "django-kvcache"
