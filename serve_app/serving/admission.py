"""The admission stage of the router (no Ray imports): the ingress waits here for a replica,
and the target deployment's `KVAwareRequestRouter` (serve_app.serving.router) feeds it replica
capacities and routing-hook events.

It lives in its own module on purpose: Serve cloudpickles a custom RequestRouter's module BY
VALUE into each handle's process, so a registry defined next to the router class would be a
private copy there; this module is imported normally, so the ingress and the router share one
stage per process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any

from serve_app.observability.metrics import app_metrics
from serve_app.routing.policy import Policy, QueueTimeout, RouteRequest, RouterSettings, make_policy
from serve_app.routing.prefix_index import block_hashes

logger = logging.getLogger("serve_app.router")

_STAGES: dict[str, AdmissionStage] = {}
_STAGES_LOCK = threading.Lock()


def stage_for(key: str, settings: RouterSettings) -> AdmissionStage:
    """The process's stage for one target deployment (the ingress and the handle's router are
    in the same process and must share it)."""
    with _STAGES_LOCK:
        if key not in _STAGES:
            _STAGES[key] = AdmissionStage(settings)
        return _STAGES[key]


class AdmissionStage:
    """Thread-safe wrapper of a `Policy`: Serve may run the handle's router on its own loop."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.policy: Policy = make_policy(settings)
        # Reentrant: a request's lease may be released from a finalizer that runs while this
        # thread already holds the lock.
        self._lock = threading.RLock()
        self._waiters: dict[str, asyncio.Future[str]] = {}
        self.decisions: deque[tuple[str, str]] = deque(maxlen=1000)  # (request id, replica)
        self.capacity: dict[str, int] = {}

    @property
    def ready(self) -> bool:
        return bool(self.capacity)

    # --- replicas (from the RequestRouter) ------------------------------------------------------

    def set_replica(self, replica: str, kv_tokens_total: int) -> None:
        with self._lock:
            self.capacity[replica] = kv_tokens_total
            self.policy.add_replica(replica, kv_tokens_total)
            self._pump()

    def remove_replicas(self, keep: set[str]) -> None:
        with self._lock:
            for replica in [r for r in self.capacity if r not in keep]:
                del self.capacity[replica]
                lost = self.policy.remove_replica(replica)
                logger.warning("replica %s left; %d in-flight requests released", replica,
                               len(lost))
            self._pump()

    # --- requests (from the ingress) ------------------------------------------------------------

    async def admit(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                    client: str = "") -> str:
        """The replica for this request, once one can hold it. Raises RequestTooLarge (400),
        QueueFull / ClientLimit (429) or QueueTimeout (503). From the moment this returns, the
        caller owns the reservation and must `release` it exactly once, on every path."""
        blocks = block_hashes(prompt_ids, self.settings.block_size)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        with self._lock:
            self.policy.submit(RouteRequest(request_id, len(prompt_ids), max_tokens, blocks,
                                            client), time.monotonic())
            self._waiters[request_id] = fut
            self._pump()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.settings.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            with self._lock:
                self._waiters.pop(request_id, None)
                if not self.policy.cancel(request_id):
                    # Assigned in the meantime: give the tokens back, nothing was sent.
                    self.policy.complete(request_id)
                    self._pump()
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(time.monotonic() - started) from None
            raise

    def assigned(self, request_id: str) -> str | None:
        with self._lock:
            return self.policy.replica_of(request_id)

    def prefill_done(self, request_id: str) -> None:
        with self._lock:
            self.policy.prefill_done(request_id)
            self._pump()

    def release(self, request_id: str) -> None:
        """Idempotent: the request's lease calls it once, a replica's removal may have freed
        it already."""
        with self._lock:
            self.policy.complete(request_id)
            self._pump()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            p = self.policy
            return {
                "policy": p.name,
                "queued": p.queued(),
                "replicas": {r: {"kv_tokens_total": self.capacity.get(r, 0),
                                 "kv_tokens_committed": p.ledger.committed(r)
                                 if r in p.ledger.replicas() else 0,
                                 "in_flight": p.load[r].in_flight,
                                 "pending_prefill_tokens": p.load[r].pending_prefill,
                                 "long_prefills": p.load[r].long_prefills}
                             for r in p.replicas()},
                "clients": len(p.clients),
                "recent": [{"id": rid, "replica": rep} for rid, rep in self.decisions],
            }

    def _pump(self) -> None:
        # Called with the lock held.
        for req in self.policy.expire(time.monotonic()):
            fut = self._waiters.pop(req.request_id, None)
            if fut is not None and not fut.done():
                waited = time.monotonic() - req.arrival
                fut.get_loop().call_soon_threadsafe(_set_exception, fut, QueueTimeout(waited))
        dispatched = self.policy.dispatch(time.monotonic())
        metrics = app_metrics() if dispatched else None
        for req, replica in dispatched:
            self.decisions.append((req.request_id, replica))
            if metrics is not None:  # one decision per dispatched request, by the policy's reason
                metrics.router_decisions.inc(tags={"reason": req.reason or self.policy.name})
            fut = self._waiters.pop(req.request_id, None)
            if fut is None:
                self.policy.complete(req.request_id)  # its caller is gone
                continue
            fut.get_loop().call_soon_threadsafe(_set_result, fut, replica)


def _set_result(fut: asyncio.Future[str], value: str) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[str], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
