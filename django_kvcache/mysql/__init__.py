"""Helpers of the MySQL/MariaDB backend (:mod:`django_kvcache.backends.mysql`).

* ``plans``: each operation written once — which statements go to which shard, and what
  their replies make; ``sql`` builds the statement text per table and server flavour,
  ``keys`` maps cache keys to the stored key column, ``culling`` keeps the table under
  ``MAX_ENTRIES``, ``lease`` is ``get_or_set``'s herd protection;
* ``policy``: the one failure policy that runs a plan's calls on shards, as rounds of
  statements (no I/O of its own); ``errors`` classifies an error once for every path;
* ``blocking`` and ``aio``: the two drivers that move those statements — on the
  process's pooled connections, or the event loop's; ``connect`` opens both kinds, the
  cache's own, from an alias's DATABASES entry (never Django's connection);
* ``shards`` reads the shards and replicas from OPTIONS (and decides which alias serves a
  read), ``cluster`` keeps what is shared per configuration (health, counters, missed
  writes and their bounded clean-up), ``server`` what is known per server and connection;
* beside the operations: ``tables`` (the DDL, which tables exist, what to say of a
  missing one or another library's: ``layouts``), ``locks``, ``rotation`` (re-encryption
  with the newest key), ``dictionaries`` (``COMPRESS_DICTIONARY: "auto"``) and
  ``metrics`` (the counters ``cache.metrics()`` reports).

None of them imports the backend; what works over every cache in ``CACHES`` (table
creation, ``cull_all``) is in :mod:`django_kvcache.maintenance`.
"""

from django_kvcache.dependencies import require

# Every module here serves MySQLCache, which needs mysqlclient: whichever is imported
# first tells a process without it which extra to install.
require("MySQLdb", "MySQLCache", extra="mysql")
