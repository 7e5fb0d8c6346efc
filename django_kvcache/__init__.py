"""django-kvcache: Django cache backends for MySQL/MariaDB and multi-node memcached."""

__version__ = "1.0.0"
