"""Long-context routing policy: pure, backend-agnostic Python (no Ray imports).

`settings` (RouterSettings: the router's fields, which the app's config tree uses as `router:`),
`ledger` (KV tokens committed per replica), `prefix_index` (hash-chain block index -> replicas,
memory-bounded LRU), `policy` (admission, affinity, long/short classes, aging, and the baseline
policies). The Serve integration (`serve_app.serving.router`) and the simulator
(`serve_app.routing.simulator`) drive the same classes.
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
