"""The nodes of one configuration, where keys go, and what a failed write leaves to do.

:func:`cluster_for` reads the connection and failure OPTIONS and returns the process-wide
:class:`Cluster` for them: every backend instance built with the same settings (Django
builds one per thread and per async context) shares its nodes, pools, health records
and counters.

The placement policy lives here too: a key goes to its node, or — with FAILOVER — to
the next node of its ranking that may be tried; a write that failed or was skipped
marks the key outdated on the nodes that may still hold an older copy.

With ``REPLICAS`` N > 1 a key lives on its first N nodes in rendezvous order (its
*replicas*, :meth:`Cluster.replica_set`): writes are placed on every replica that may be
tried (:meth:`Cluster.place_everywhere`), and each replica that is skipped or fails
has the key marked outdated there, so that it deletes the key before it serves again.
"""
from __future__ import annotations

import itertools
import ssl
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Mapping, NamedTuple

from django.core.exceptions import ImproperlyConfigured

from django_kvcache.forks import Registry
from django_kvcache.health import health_for
from django_kvcache.memcached import MemcachedError, NodeDown
from django_kvcache.memcached.node import Node
from django_kvcache.memcached.pool import ConnectionSettings, pool_for
from django_kvcache.memcached.routing import NodeAddress, check_scheme, make_router
from django_kvcache.options import check_known, flag, integer, seconds
from django_kvcache.routing import ROUTE_MEMO_SIZE, Router, parse_weights

if TYPE_CHECKING:
    from django_kvcache.memcached.exchange import Batch


#: AUTOBATCH's default, chosen by measurement (docs/async.rst, Autobatching).
AUTOBATCH_DEFAULT = True



class Usable(dict):
    """Whether each node may be asked in one call: ``may_try`` is asked once per node
    and call (it makes a caller the probe of a node whose retry time is up)."""

    def __missing__(self, node: Node) -> bool:
        may = self[node] = not node.health.down_until or node.health.may_try()
        return may

class Placement(NamedTuple):
    groups: dict[Node, list[str]]
    stranded: list[str]  # keys whose node is down (and no failover node is up)
    errors: list[MemcachedError]


class Cluster:
    """The nodes and router of one configuration, shared process-wide."""

    def __init__(self, nodes: list[Node], router: Router, replicas: int = 1) -> None:
        self.nodes = nodes
        self.router = router
        self.replicas = replicas
        self.by_name = {node.name: node for node in nodes}
        self._node_for_key = router.node_for
        self._replica_memo: dict[str, list[Node]] = {}
        #: Which replica a read starts with: the next turn per call, so that a hot key's
        #: reads divide over its replicas (itertools.count is atomic under the GIL).
        self.turns = itertools.count()

    # --- replicas (REPLICAS > 1) --------------------------------------------------------

    def replica_set(self, key: str) -> list[Node]:
        """The key's replicas: its first REPLICAS nodes in rendezvous order, best first."""
        memo = self._replica_memo
        try:
            return memo[key]
        except KeyError:
            pass
        if len(memo) >= ROUTE_MEMO_SIZE:
            memo.clear()  # as the router's memo: routing is deterministic
        nodes = self.nodes
        replicas = memo[key] = [nodes[i] for i in self.router.ranking(key)[: self.replicas]]
        return replicas

    def beyond_replicas(self, key: str) -> Node | None:
        """FAILOVER with every replica down: the next node of the key's ranking that may
        be tried, or None."""
        for index in self.router.ranking(key)[self.replicas:]:
            node = self.nodes[index]
            if node.health.may_try():
                return node
        return None

    def primary(self, key: str, failover: bool, failed: Collection[Node] = ()) -> Node:
        """The replica that decides what must have one answer (``add``'s winner, the
        counter's value returned, get_or_set's lease): the first replica in rendezvous
        order that is up — the same for every process that sees the same nodes up,
        whatever each remembers of restarts — else the first that may be probed now; with
        FAILOVER and every replica down, the next node. Replicas that ``failed`` earlier
        in the same call are passed over (one failure does not yet make a node down).
        Raises ``NodeDown`` when none may be tried."""
        everyone = self.replica_set(key)
        replicas = [node for node in everyone if node not in failed]
        for node in replicas:
            if not node.health.down_until:
                return node
        for node in replicas:
            if node.health.may_try():  # this caller probes it
                return node
        if failover:
            node = self.beyond_replicas(key)
            if node is not None:
                return node
        raise everyone[0].skipped()

    def place_everywhere(
        self, keys: Iterable[str], failover: bool,
        side: Callable[[str], tuple[str, ...]] | None = None,
    ) -> Placement:
        """A write's placement with replicas: each key on every replica that may be tried
        now. A replica that may not has the key (and its ``side`` keys: stale copies
        riding with it) marked outdated at once. Keys no replica can take go, with
        FAILOVER, to the next node of their ranking; else they are ``stranded``, with an
        error per node. ``may_try`` is asked once per node and call (it makes a caller
        the probe of a node whose retry time is up)."""
        placement = Placement({}, [], [])
        groups = placement.groups
        usable = Usable()
        reported: set[Node] = set()
        for key in keys:
            reached = False
            for node in self.replica_set(key):
                if usable[node]:
                    groups.setdefault(node, []).append(key)
                    reached = True
                else:
                    node.outdated.add((key, *side(key)) if side else (key,))
            if reached:
                continue
            extra = self.beyond_replicas(key) if failover else None
            if extra is not None:
                groups.setdefault(extra, []).append(key)
                continue
            placement.stranded.append(key)
            first = self.replica_set(key)[0]
            if first not in reported:
                reported.add(first)
                placement.errors.append(first.skipped())
        return placement

    def home(self, key: str) -> Node:
        """The node the key belongs to, up or down."""
        return self.nodes[self._node_for_key(key)]

    def node(self, key: str, failover: bool) -> Node:
        """The node to ask now; ``NodeDown`` when it is down and no failover node is up."""
        node = self.nodes[self._node_for_key(key)]
        if node.health.down_until and not node.health.may_try():
            return self._failover_node(key, node, failover)
        return node

    def _failover_node(self, key: str, down: Node, failover: bool) -> Node:
        if failover:
            for index in self.router.ranking(key)[1:]:
                node = self.nodes[index]
                if node.health.may_try():
                    return node
        raise down.skipped()

    def place(self, keys: Iterable[str], failover: bool) -> Placement:
        """Keys by the node that serves them now; keys no node can take, with the errors."""
        placement = Placement({}, [], [])
        groups = placement.groups
        for index, node_keys in self.router.group(keys).items():
            node = self.nodes[index]
            if not node.health.down_until or node.health.may_try():
                groups.setdefault(node, []).extend(node_keys)
                continue
            reported = False
            for key in node_keys:
                try:
                    groups.setdefault(self._failover_node(key, node, failover), []).append(key)
                except NodeDown as exc:  # counted per key, reported once per node
                    placement.stranded.append(key)
                    if not reported:
                        placement.errors.append(exc)
                        reported = True
        return placement

    def missed_write(self, key: str, error: MemcachedError) -> None:
        """A write that failed or was skipped leaves the old value on the key's node (and
        on the node that failed): delete it there before that node serves again."""
        home = self.home(key)
        home.outdated.add((key,))
        failed = self.by_name.get(error.node)
        if failed is not None and failed is not home:
            failed.outdated.add((key,))

    def missed_batch_writes(
        self, placement: Placement, batches: list[Batch], riders: Mapping[str, str] | None = None
    ) -> None:
        """``missed_write`` for the keys of a multi-key write that were skipped or whose
        batch failed (its side keys too). ``riders``: side keys stored on their entry's
        node rather than on their own (a side key: its entry's key), whose home is their
        entry's."""
        if self.replicas > 1:
            # Skipped replicas were marked when placed (place_everywhere); a failed
            # batch leaves only its own node behind: the other replicas got the write.
            for batch in batches:
                if batch.error is not None:
                    batch.node.outdated.add([*batch.keys, *batch.side_keys])
            return
        home = self.home if not riders else (lambda key: self.home(riders.get(key, key)))
        for key in placement.stranded:
            home(key).outdated.add((key,))
        for batch in batches:
            if batch.error is None:
                continue
            keys = [*batch.keys, *batch.side_keys]
            batch.node.outdated.add(keys)
            for key in keys:
                if home(key) is not batch.node:  # a failover batch
                    home(key).outdated.add((key,))


_clusters: Registry[tuple, Cluster] = Registry()


def connection_settings(options: Mapping[str, Any]) -> ConnectionSettings:
    return ConnectionSettings(
        connect_timeout=seconds(options, "CONNECT_TIMEOUT", 1.0, allow_none=True),
        io_timeout=seconds(options, "IO_TIMEOUT", 1.0, allow_none=True),
        max_size=integer(options, "MAX_POOL_SIZE", 64),
        pool_timeout=seconds(options, "POOL_TIMEOUT", 1.0),
        tls=tls_context(options.get("TLS")),
        autobatch=flag(options, "AUTOBATCH", AUTOBATCH_DEFAULT),
    )


def cluster_for(addresses: list[NodeAddress], options: Mapping[str, Any]) -> Cluster:
    """The process-wide cluster for these nodes and OPTIONS (checked here)."""
    settings = connection_settings(options)
    threshold = integer(options, "FAILURE_THRESHOLD", 2)
    retry_timeout = seconds(options, "RETRY_TIMEOUT", 10.0)
    scheme = check_scheme(options.get("HASHING", "kvcache"))
    weights = parse_weights(options.get("WEIGHTS"), [address.name for address in addresses])
    replicas = integer(options, "REPLICAS", 1)
    if replicas > len(addresses):
        raise ImproperlyConfigured(
            f"OPTIONS['REPLICAS'] must be at most the number of servers in LOCATION "
            f"({len(addresses)}), got {options['REPLICAS']!r}"
        )
    identity = (
        tuple(a.name for a in addresses), scheme, tuple(weights), settings,
        threshold, retry_timeout, replicas,
    )

    def make() -> Cluster:
        nodes = [
            Node(a, pool_for(a, settings), health_for(a.name, threshold, retry_timeout))
            for a in addresses
        ]
        return Cluster(nodes, make_router(scheme, addresses, weights), replicas)

    return _clusters.get(identity, make)


def tls_context(value: Any) -> ssl.SSLContext | None:
    """OPTIONS['TLS']: an ``ssl.SSLContext``, or a dict of ``ssl.create_default_context``
    arguments (``cafile``, ``capath``, ``cadata``) plus ``certfile``/``keyfile``.

    One context per distinct dict, so instances built from the same settings share pools
    (and Django's per-request instances do not load certificates every time).
    """
    if value is None or isinstance(value, ssl.SSLContext):
        return value
    known = {"cafile", "capath", "cadata", "certfile", "keyfile"}
    check_known(value, known, "OPTIONS['TLS'] (an ssl.SSLContext or a dict)")
    key = tuple(sorted((k, str(v)) for k, v in value.items()))
    if key not in _contexts:
        try:
            context = ssl.create_default_context(
                cafile=value.get("cafile"), capath=value.get("capath"), cadata=value.get("cadata")
            )
            if value.get("certfile"):
                context.load_cert_chain(value["certfile"], value.get("keyfile"))
        except (OSError, ssl.SSLError) as exc:
            raise ImproperlyConfigured(f"OPTIONS['TLS']: {exc}") from exc
        _contexts.setdefault(key, context)
    return _contexts[key]


_contexts: dict[tuple, ssl.SSLContext] = {}
