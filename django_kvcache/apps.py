from django.apps import AppConfig
from django.db.models.signals import pre_migrate


class KVCacheConfig(AppConfig):
    """``"django_kvcache"`` in INSTALLED_APPS: the management commands, the system checks,
    and the MySQLCache tables created before migrations run on their database — in
    ``manage.py migrate`` and in the test databases of ``manage.py test``."""

    name = "django_kvcache"
    verbose_name = "django-kvcache"

    def ready(self) -> None:
        from django_kvcache import checks  # noqa: F401  (registers the system checks)
        from django_kvcache.maintenance import prepare_migrate

        pre_migrate.connect(
            prepare_migrate, sender=self, dispatch_uid="django_kvcache.prepare_migrate"
        )
