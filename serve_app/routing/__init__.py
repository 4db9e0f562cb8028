"""The long-context router, one package (docs/router.md).

Pure Python, no Ray: `settings` (RouterSettings: the router's
fields, which the app's config tree uses as `router:`), `ledger` (KV tokens committed per
replica), `prefix_index` (hash-chain block index -> replicas, memory-bounded LRU), `policy`
(admission, affinity, long/short classes, aging, and the baseline policies), `admission` (the
lifecycle the ingress drives: reserve, dispatch, release). Ray: `serve_router` (the target
deployment's RequestRouter, which sends a request to the replica it carries). The simulator
(bench/router_simulator.py) drives the same policy classes.
"""

from serve_app.routing.ledger import CapacityLedger
from serve_app.routing.policy import (
    POLICIES,
    KVRouterPolicy,
    Policy,
    QueueFull,
    QueueTimeout,
    RequestTooLarge,
    RouteRequest,
    RouterSettings,
    make_policy,
)
from serve_app.routing.prefix_index import PrefixIndex, block_hashes, chain_hashes

__all__ = [
    "POLICIES",
    "CapacityLedger",
    "KVRouterPolicy",
    "Policy",
    "PrefixIndex",
    "QueueFull",
    "QueueTimeout",
    "RequestTooLarge",
    "RouteRequest",
    "RouterSettings",
    "block_hashes",
    "chain_hashes",
    "make_policy",
]
