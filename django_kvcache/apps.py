from django.apps import AppConfig


class KVCacheConfig(AppConfig):
    """Add ``"django_kvcache"`` to INSTALLED_APPS for the management commands and checks."""

    name = "django_kvcache"
    verbose_name = "django-kvcache"

    def ready(self) -> None:
        from django_kvcache import checks  # noqa: F401  (registers the system checks)
