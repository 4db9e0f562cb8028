"""The router's lifecycle in the ingress process (no Ray imports): reserve, dispatch, release.

- **reserve**: `admit` submits a request to the policy and waits (bounded queue, queue timeout)
  until the policy assigns it a replica; the replica's ledger is committed at that moment, so a
  burst can never overcommit a replica. Refusals raise (RequestTooLarge 400, QueueFull /
  ClientLimit 429, QueueTimeout 503).
- **dispatch**: the caller writes the returned replica id into the request
  (`GenerateRequest.replica`); the target deployment's `ChosenReplicaRouter`
  (serve_app.routing.serve_router) sends it there. The choice travels with the request, so the
  Serve router keeps no state and nothing is shared through a process-global.
- **release**: the caller's lease calls `release` exactly once on every path (completion,
  error, cancellation at any await).

Which replicas exist, how many KV tokens and how many state slots (running requests) each
holds, the stage asks for itself (`ask_replicas`: the ingress supplies only the transport, a
coroutine that sends the stage's request to every target replica through Serve's broadcast
and returns their answers, each its engine's `capacity()` and the prefix-cache events since
the stage's cursor); the stage asks every `refresh_s` while it is in use (every
`refresh_waiting_s` while a request waits), and a replica that has left releases its
requests' reservations at the next sync.

Several ingress replicas (docs/router.md): this stage's ledger is a hint. The target replica
reserves each request again on its own authoritative ledger (serve_app.routing.reservation)
and refuses what does not fit; `requeue` takes such a refused request back to the front of
the queue, with the replica's numbers from the refusal. Each report's `ledger` (the replica's
committed KV tokens and reserved slots, per caller) becomes the other ingresses' load in this
stage's ledger (`CapacityLedger.set_external`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from serve_app.observability.metrics import app_metrics
from serve_app.routing.policy import Policy, QueueTimeout, RouteRequest, RouterSettings, make_policy
from serve_app.routing.prefix_index import block_hashes
from serve_app.routing.reservation import Reservation

logger = logging.getLogger("serve_app.router")

# Replica id -> its engine's capacity() report (kv_tokens_total, state_slots_total, the
# engine's own used counts ...; a bare int is kv_tokens_total alone, slots unbounded), and
# whether every replica answered (only a complete answer may remove a replica: one that failed
# to answer once may still be serving).
ReplicaReport = int | Mapping[str, Any]
ReplicaList = tuple[dict[str, ReplicaReport], bool]
# The transport: {replica: next prefix event wanted} -> every replica's answer, a report with
# its "replica" id, or the exception it failed with.
AskReplicas = Callable[[dict[str, int]], Awaitable[list[Any]]]


def _resources(report: ReplicaReport) -> tuple[int, int | None]:
    """(kv_tokens_total, state_slots_total) of one replica's report. No `state_slots_total`
    (an older engine, or a bare token count) is None: unbounded, as before slots existed."""
    if isinstance(report, Mapping):
        slots = report.get("state_slots_total")
        return int(report["kv_tokens_total"]), None if slots is None else int(slots)
    return int(report), None


class AdmissionStage:
    """A `Policy` driven from the ingress's event loop, every change to it under one lock."""

    def __init__(self, settings: RouterSettings,
                 ask_replicas: AskReplicas,
                 refresh_s: float = 1.0, me: str = "", refresh_waiting_s: float = 0.2) -> None:
        self.settings = settings
        self.policy: Policy = make_policy(settings)
        self._ask_replicas = ask_replicas
        self.refresh_s = refresh_s
        # While a request waits, the replicas are asked this often: another ingress's request
        # that ends frees room this stage learns of only from a report.
        self.refresh_waiting_s = refresh_waiting_s
        self.me = me  # this ingress's caller name in the replicas' ledger reports
        self._seq: dict[str, int] = {}  # newest ledger report seen per replica
        # Per replica, the next prefix-cache event to read (its engine's events, which the
        # prefix index follows: serve_app/engines/reference/prefix_cache.py).
        self.prefix_seq: dict[str, int] = {}
        self.refusals = 0
        self.moves = 0  # requests handed back by leaving replicas, moved to another
        self._wake: asyncio.Event | None = None
        self._lock = threading.RLock()
        self._waiters: dict[str, asyncio.Future[str]] = {}
        self.decisions: deque[tuple[str, str]] = deque(maxlen=1000)  # (request id, replica)
        self.capacity: dict[str, tuple[int, int | None]] = {}  # (KV tokens, state slots)
        self.reported: dict[str, dict[str, Any]] = {}  # each replica's last capacity() report
        self._synced = asyncio.Event()
        self._refresher: asyncio.Task[None] | None = None

    # --- replicas --------------------------------------------------------------------------

    def sync(self, replicas: dict[str, ReplicaReport], complete: bool = True) -> None:
        """Make the policy's replicas these (id -> capacity report, or a bare kv_tokens_total).
        Replicas missing from a complete list have left: their in-flight reservations are
        released."""
        with self._lock:
            for replica, report in replicas.items():
                resources = _resources(report)
                self.reported[replica] = dict(report) if isinstance(report, Mapping) else {}
                if self.capacity.get(replica) != resources:
                    self.capacity[replica] = resources
                    self.policy.add_replica(replica, *resources)
                if isinstance(report, Mapping) and report.get("node"):
                    self.policy.nodes[replica] = str(report["node"])
                if isinstance(report, Mapping) and isinstance(report.get("ledger"), Mapping):
                    self._apply_ledger(replica, report["ledger"])
                if isinstance(report, Mapping) and isinstance(report.get("prefix"), Mapping):
                    self._follow_prefix(replica, report["prefix"])
            if complete:
                for replica in [r for r in self.capacity if r not in replicas]:
                    del self.capacity[replica]
                    self.reported.pop(replica, None)
                    lost = self.policy.remove_replica(replica)
                    logger.warning("replica %s left; %d in-flight requests released", replica,
                                   len(lost))
            self._pump()
            self._export()

    def _apply_ledger(self, replica: str, ledger: Mapping[str, Any]) -> None:
        """The replica's authoritative numbers -> the other callers' load in this stage's
        ledger. Its report counts this ingress's requests too (`callers[me]`): subtracting
        the smaller of that and this stage's own count leaves the others' load, plus this
        ingress's requests that the replica still holds though they ended here (an abort on
        its way), but not those on their way to it (already counted here). A report older
        than one already applied (by its `seq`) is ignored. Called with the lock held."""
        seq = int(ledger.get("seq", 0))
        if seq < self._seq.get(replica, -1) or replica not in self.policy.ledger.replicas():
            return
        self._seq[replica] = seq
        mine = ledger.get("callers", {}).get(self.me, {})
        local = self.policy.ledger
        kv = int(ledger.get("kv_tokens_committed", 0)) - min(
            local.committed(replica), int(mine.get("kv_tokens_committed", 0)))
        slots = int(ledger.get("state_slots_reserved", 0)) - min(
            local.slots_reserved(replica), int(mine.get("state_slots_reserved", 0)))
        local.set_external(replica, kv, slots)

    def _follow_prefix(self, replica: str, prefix: Mapping[str, Any]) -> None:
        """What the replica's engine cached and evicted since the last report -> the prefix
        index (which guesses at dispatch, so that a second question arriving during the first
        one's prefill finds the document, and is corrected here by what the engine really
        holds). Called with the lock held."""
        self.policy.index.follow(replica, prefix.get("events", []), prefix.get("held"))
        self.prefix_seq[replica] = int(prefix.get("next", 0))

    def _export(self) -> None:
        """The router's view per replica as gauges (its reservations; the engines export
        their own totals and running counts). Called with the lock held, once per sync."""
        metrics = app_metrics()
        if metrics is None:
            return
        ledger = self.policy.ledger
        try:
            for replica in ledger.replicas():
                t = {"replica": replica}
                metrics.router_state_slots_reserved.set(ledger.slots_reserved(replica), tags=t)
                metrics.router_kv_tokens_committed.set(ledger.committed(replica), tags=t)
        except Exception:  # a metrics failure must not stop the replica sync (routing)
            logger.exception("router gauges not exported")

    async def _list_replicas(self) -> ReplicaList:
        answers = await self._ask_replicas(dict(self.prefix_seq))
        replicas = {a["replica"]: a for a in answers if isinstance(a, Mapping)}
        return replicas, len(replicas) == len(answers)

    async def _refresh(self) -> None:
        try:
            replicas, complete = await self._list_replicas()
        except Exception as exc:  # no replica reachable right now: keep what we know
            logger.info("replica list not available: %s", type(exc).__name__)
        else:
            self.sync(replicas, complete)
        self._synced.set()

    async def _refresh_forever(self) -> None:
        while True:
            await self._refresh()
            wake = self._wake_event()
            wake.clear()
            period = self.refresh_waiting_s if self.policy.queued() else self.refresh_s
            with contextlib.suppress(TimeoutError):
                # A request that starts waiting cuts an idle period short.
                await asyncio.wait_for(wake.wait(), period)

    def _wake_event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    async def _started(self) -> None:
        """Start syncing on the first request (the stage is built before Serve runs the
        ingress's loop), and wait for the first answer so that it is routed at once."""
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        if not self._synced.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._synced.wait(), self.settings.queue_timeout_s)

    # --- requests --------------------------------------------------------------------------

    async def admit(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                    client: str = "", near: str | None = None) -> str:
        """The replica for this request, once one can hold it. Raises RequestTooLarge (400),
        QueueFull / ClientLimit (429) or QueueTimeout (503). From the moment this returns, the
        caller owns the reservation and must `release` it exactly once, on every path.
        `near`: the node of the replica that takes the request over (a disaggregated
        request's decode replica), which the policy prices replicas elsewhere against."""
        started = time.monotonic()
        await self._started()
        req = self._route_request(request_id, prompt_ids, max_tokens, client, near)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        with self._lock:
            self.policy.submit(req, started)
            self._waiters[request_id] = fut
            self._pump()
        return await self._wait(request_id, fut, started)

    def _route_request(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       client: str, near: str | None) -> RouteRequest:
        """The request as the policy sees it: the one place `admit` and `move` make it, so a
        moved request is charged as it was admitted."""
        return RouteRequest(request_id, len(prompt_ids), max_tokens,
                            block_hashes(prompt_ids, self.settings.block_size), client,
                            near=near)

    def node_of(self, replica: str) -> str | None:
        """The node `replica` reported (None before it has)."""
        with self._lock:
            return self.policy.nodes.get(replica)

    def reservation(self, request_id: str) -> Reservation | None:
        """What the request reserves on its replica (carried by the generate call), as this
        stage computed it: the replica's own ledger charges the same."""
        with self._lock:
            req = self.policy._requests.get(request_id)
            if req is None:
                return None
            blocks = req.blocks if self.settings.share_prefix else ()
            return Reservation(req.prompt_tokens, req.max_tokens, blocks)

    async def requeue(self, request_id: str, replica: str, info: Mapping[str, Any]) -> str:
        """The replica refused the request (ReplicaFull: its authoritative ledger is full,
        other ingresses took the room). Correct this stage's view of it from the refusal's
        numbers, put the request back at the front of its queue (its arrival and its client's
        count unchanged) and wait for a replica again, like `admit`."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        with self._lock:
            self.refusals += 1
            req = self.policy._requests.get(request_id)
            if replica in self.policy.ledger.replicas():
                self._apply_refusal(request_id, replica, info)
            if req is None or not self.policy.requeue(request_id):
                raise QueueTimeout(0.0)  # it has left the router meanwhile (replica gone)
            self._waiters[request_id] = fut
            self._pump()
            started = req.arrival
        return await self._wait(request_id, fut, started)

    async def move(self, request_id: str, leaving: str | None, prompt_ids: list[int],
                   max_tokens: int, client: str = "", near: str | None = None) -> str:
        """The request's replica is leaving (scaled down, restarted) and has handed the
        request back: that replica takes nothing more from this stage (its capacity reads 0
        until a sync forgets it), the request's reservation there is released, and it waits
        at the front of its queue for another replica, like `requeue`. A request this stage
        forgot meanwhile (a sync saw its replica gone) enters again at the front, with the
        same facts as at `admit`."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        with self._lock:
            self.moves += 1
            if leaving is not None:
                self._leaving(leaving)
            if not self.policy.requeue(request_id):
                self.policy.resubmit(self._route_request(request_id, prompt_ids, max_tokens,
                                                         client, near), now)
            self._waiters[request_id] = fut
            self._pump()
        return await self._wait(request_id, fut, now)

    def _leaving(self, replica: str) -> None:
        """Nothing more goes to `replica` (it answers `Moved`, or reports no capacity, until
        a sync forgets it). Called with the lock held."""
        if replica in self.capacity and self.capacity[replica] != (0, 0):
            self.capacity[replica] = (0, 0)
            self.policy.add_replica(replica, 0, 0)

    def _apply_refusal(self, request_id: str, replica: str, info: Mapping[str, Any]) -> None:
        # The refused request is still committed here; the refusal's numbers do not count it.
        local = self.policy.ledger
        local.release(request_id)
        self._apply_ledger(replica, info)

    async def _wait(self, request_id: str, fut: asyncio.Future[str], started: float) -> str:
        if not fut.done():
            self._wake_event().set()
        try:
            left = self.settings.queue_timeout_s - (time.monotonic() - started)
            return await asyncio.wait_for(asyncio.shield(fut), max(left, 0.0))
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

    def queue_report(self) -> dict[str, Any]:
        """This stage's queue for the replicas' autoscaling reports (`routing_info`): its
        caller name, the requests waiting, their KV tokens and the oldest wait."""
        with self._lock:
            queued, tokens, wait = self.policy.queue_demand(time.monotonic())
        return {"caller": self.me, "queued": queued, "queued_tokens": tokens,
                "oldest_wait_s": wait}

    async def view(self) -> dict[str, Any]:
        """The snapshot once the replicas have answered at least once (right after start-up
        there is nothing to show yet, which is not the truth about the replicas)."""
        await self._started()
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            p = self.policy
            return {
                "policy": p.name,
                "ingress": self.me,
                "queued": p.queued(),
                "refusals": self.refusals,
                "moves": self.moves,
                "replicas": {r: self._replica_state(r) for r in p.replicas()},
                "clients": len(p.clients),
                "recent": [{"id": rid, "replica": rep} for rid, rep in self.decisions],
            }

    def _replica_state(self, replica: str) -> dict[str, Any]:
        """One replica in /v1/router: both resources as this router reserved them (committed
        KV tokens; reserved state slots, one per in-flight request) beside its totals, and the
        engine's own used counts from its last report (None until it reports them)."""
        p = self.policy
        kv_total, slots_total = self.capacity.get(replica, (0, None))
        known = replica in p.ledger.replicas()
        reported = self.reported.get(replica, {})
        load = p.load[replica]
        ext_kv, ext_slots = p.ledger.external(replica) if known else (0, 0)
        ledger = reported.get("ledger") or {}
        return {"node": p.nodes.get(replica),
                "kv_tokens_total": kv_total,
                "kv_tokens_committed": p.ledger.committed(replica) if known else 0,
                "kv_tokens_used": reported.get("kv_tokens_used"),
                "state_slots_total": slots_total,  # None: unbounded (no bound reported)
                "state_slots_reserved": p.ledger.slots_reserved(replica) if known else 0,
                "state_slots_used": reported.get("state_slots_used"),
                # The other ingresses' load on it (this router's hint, from its reports), and
                # the replica's own authoritative totals from its last report.
                "kv_tokens_others": ext_kv,
                "state_slots_others": ext_slots,
                "replica_kv_tokens_committed": ledger.get("kv_tokens_committed"),
                "replica_state_slots_reserved": ledger.get("state_slots_reserved"),
                "in_flight": load.in_flight,
                "pending_prefill_tokens": load.pending_prefill,
                "long_prefills": load.long_prefills}

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
