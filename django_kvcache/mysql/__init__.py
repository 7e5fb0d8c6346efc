"""Helpers of the MySQL/MariaDB backend (:mod:`django_kvcache.backends.mysql`).

``sql`` builds the statement text per table and server flavour, ``keys`` maps cache keys
to the stored key column, ``server`` detects the server once per alias and retries after a
dropped connection what may safely run twice, ``culling`` keeps the table under
``MAX_ENTRIES``. None of them imports the backend; what works over every cache in
``CACHES`` (table creation, ``cull_all``) is in :mod:`django_kvcache.maintenance`.
"""
