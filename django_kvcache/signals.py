"""Signals of django-kvcache.

``node_down`` is sent with ``node`` (its name: a memcached LOCATION entry), ``kind``
(``"memcached node"``) and ``reason`` when a node is taken out after consecutive
failures; ``node_up`` with ``node`` and ``kind`` when a probe finds it answering again.
The sender is :class:`django_kvcache.health.NodeHealth`. A receiver that raises is
logged, never raised into the request that noticed the change.
"""
from django.dispatch import Signal

node_down = Signal()
node_up = Signal()
