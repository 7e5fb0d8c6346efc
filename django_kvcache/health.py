"""Process-wide node health: which nodes answer, shared by every thread and backend.

A node is anything a backend spreads its keys over and may lose: a memcached server, a
MySQL shard. ``kind`` names it in the log ("memcached node", "MySQL shard").

After ``threshold`` consecutive connection or timeout errors a node is *down* for
``retry_timeout`` seconds and nobody talks to it. When that time is up, the first
caller re-arms the timer and becomes the single probe: its own request decides
whether the node is up again (``node_up``) or down for another period.
"""
from __future__ import annotations

import logging
import threading
import time

from django.dispatch import Signal

from django_kvcache import forks
from django_kvcache.forks import Registry
from django_kvcache.signals import node_down, node_up

logger = logging.getLogger(__name__)


class NodeHealth:
    def __init__(
        self, name: str, threshold: int, retry_timeout: float, kind: str = "memcached node"
    ) -> None:
        self.name = name
        self.kind = kind
        self.threshold = threshold
        self.retry_timeout = retry_timeout
        self.failures = 0  # consecutive
        self.down_until = 0.0  # monotonic time; 0 while the node is up
        self.lock = threading.Lock()
        forks.register(self)

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork

    @property
    def down(self) -> bool:
        return self.down_until != 0.0

    def may_try(self) -> bool:
        """Whether a request may go to the node now. Cheap while the node is up."""
        if not self.down_until:
            return True
        now = time.monotonic()
        if now < self.down_until:
            return False
        with self.lock:
            if now < self.down_until:
                return False
            self.down_until = now + self.retry_timeout  # everyone else waits for our probe
            return True

    def succeeded(self) -> None:
        if not self.failures and not self.down_until:
            return
        with self.lock:
            was_down = self.down_until != 0.0
            self.failures = 0
            self.down_until = 0.0
        if was_down:
            logger.warning("%s %s is back up", self.kind, self.name)
            _notify("node_up", node_up, node=self.name, kind=self.kind)

    def failed(self, reason: str) -> None:
        with self.lock:
            self.failures += 1
            if self.down_until:  # the probe failed: down for another period
                self.down_until = time.monotonic() + self.retry_timeout
                return
            if self.failures < self.threshold:
                return
            self.down_until = time.monotonic() + self.retry_timeout
        logger.error(
            "%s %s is down after %d consecutive failures (%s); retrying in %s s",
            self.kind, self.name, self.failures, reason, self.retry_timeout,
        )
        _notify("node_down", node_down, node=self.name, reason=reason, kind=self.kind)


def _notify(name: str, signal: Signal, **arguments: str) -> None:
    """Send ``signal`` to every receiver; one that raises is logged, never raised: the
    request that noticed the change must not fail because of a listener."""
    for receiver, response in signal.send_robust(sender=NodeHealth, **arguments):
        if isinstance(response, Exception):
            logger.error(
                "%s receiver %r raised %s: %s", name, receiver,
                type(response).__name__, response, exc_info=response,
            )


_registry: Registry[tuple[str, str, int, float], NodeHealth] = Registry()


def health_for(
    name: str, threshold: int, retry_timeout: float, kind: str = "memcached node"
) -> NodeHealth:
    """The process-wide health record of a node (per kind and failure policy)."""
    return _registry.get(
        (kind, name, threshold, retry_timeout),
        lambda: NodeHealth(name, threshold, retry_timeout, kind),
    )
