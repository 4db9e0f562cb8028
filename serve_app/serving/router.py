"""The router in the Serve app: an admission stage in the ingress + a Ray Serve RequestRouter on
the target deployment, sharing one policy object per ingress process (docs/router.md).

- `AdmissionStage.admit` (ingress, per request): 400 / 429 now, or waits in the bounded queue
  until the policy assigns a replica (503 after the queue timeout). The ledger is committed at
  that moment, so a burst can never overcommit a replica.
- `KVAwareRequestRouter` (the handle's router, same process): `update_replicas` fetches each new
  replica's KV capacity from its engine (`TargetReplica.record_routing_stats` ->
  `engine.capacity()`) and forgets gone ones; `choose_replicas` sends a request to the replica
  the policy chose. Calls without an assignment (stats, capacity, health probes) go to any
  replica. Releasing a request's tokens is the ingress's job (its lease, on every path:
  completion, error, cancellation), not a routing hook's: a request cancelled before it was
  routed never reaches the hooks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serve_app.engines.types import GenerateRequest
from serve_app.routing.policy import RouterSettings
from serve_app.serving import admission

logger = logging.getLogger("serve_app.router")

def _request_id(pending: PendingRequest | None) -> str | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first.request_id if isinstance(first, GenerateRequest) else None


class KVAwareRequestRouter(RequestRouter):
    """Configured on the target deployment with request_router_kwargs
    {"key": deployment name, "settings": RouterSettings fields}."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.stage = admission.stage_for(kwargs["key"], RouterSettings(**kwargs["settings"]))
        self._fetching: set[str] = set()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id.unique_id for r in replicas}
        self.stage.remove_replicas(ids)
        for r in replicas:
            rid = r.replica_id.unique_id
            if rid not in self.stage.capacity and rid not in self._fetching:
                self._fetching.add(rid)
                self._event_loop.call_soon_threadsafe(
                    lambda r=r: self._event_loop.create_task(self._fetch_capacity(r)))

    async def _fetch_capacity(self, replica: RunningReplica) -> None:
        rid = replica.replica_id.unique_id
        try:
            for attempt in range(60):
                stats = replica.routing_stats or {}
                if "kv_tokens_total" not in stats:
                    try:
                        # The replica actor's own method: it calls TargetReplica's
                        # record_routing_stats, i.e. engine.capacity(), now rather than at the
                        # controller's next 10 s poll.
                        stats = await replica._actor_handle.record_routing_stats.remote()
                    except Exception as exc:  # starting up or gone: retry, then give up
                        logger.info("capacity of %s not available yet: %r", rid, exc)
                        await asyncio.sleep(min(2.0, 0.1 * (attempt + 1)))
                        continue
                if "kv_tokens_total" in stats:
                    if rid in {r.unique_id for r in self.curr_replicas}:
                        self.stage.set_replica(rid, int(stats["kv_tokens_total"]))
                    return
                await asyncio.sleep(0.5)
        finally:
            self._fetching.discard(rid)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        rid = _request_id(pending_request)
        target = self.stage.assigned(rid) if rid else None
        if target is None:
            return [candidate_replicas]
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        # The chosen replica may be momentarily missing from the candidates (being replaced);
        # an empty rank makes Serve back off and ask again.
        return [chosen]
