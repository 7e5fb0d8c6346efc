"""django-kvcache: Django cache backends for MySQL/MariaDB and multi-node memcached."""

__version__ = "0.1.0"
