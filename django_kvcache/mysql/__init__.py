"""Helpers of the MySQL/MariaDB backend (:mod:`django_kvcache.backends.mysql`).

``sql`` builds the statement text per table and server flavour, ``keys`` maps cache keys
to the stored key column, ``server`` detects the server once per alias and retries on a
dropped connection, ``culling`` keeps the table under ``MAX_ENTRIES``.
"""
