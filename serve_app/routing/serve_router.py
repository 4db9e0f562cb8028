"""The target deployments' Serve request router: it sends a request where the admission stage
(serve_app.routing.admission, in the caller's dispatcher) chose, which the request itself
carries (`GenerateRequest.replica`). It keeps no state of its own:
Serve cloudpickles this module by value into each handle's process, so nothing here could be
shared with the ingress anyway.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serve_app.protocol.generation import GenerateRequest


def _chosen(pending: PendingRequest | None) -> str | None:
    """The replica a `generate` call's request carries (None: any, and for other calls)."""
    if pending is not None and pending.args and isinstance(pending.args[0], GenerateRequest):
        return pending.args[0].replica
    return None


class ChosenReplicaRouter(RequestRouter):
    """Requests with a chosen replica go to it; calls without one (health, stats) go to any."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        chosen = _chosen(pending_request)
        if chosen is None:
            return [candidate_replicas]
        match = [r for r in candidate_replicas if r.replica_id.unique_id == chosen]
        if match:
            return [match]
        if any(rid.unique_id == chosen for rid in self.curr_replicas):
            # Still running but not a candidate this round: an empty rank makes Serve back off
            # and ask again.
            return [[]]
        # It has left since the stage chose it (the stage releases it at its next sync): any
        # replica can serve the request rather than failing it.
        return [candidate_replicas]
