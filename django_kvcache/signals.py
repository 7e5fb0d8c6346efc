"""Signals of django-kvcache.

``node_down`` is sent with ``node`` (the LOCATION name) and ``reason`` when a memcached
node is taken out after consecutive failures; ``node_up`` with ``node`` when a probe
finds it answering again. The sender is
:class:`django_kvcache.memcached.health.NodeHealth`.
"""
from django.dispatch import Signal

node_down = Signal()
node_up = Signal()
