"""Routing decisions: this project's KV-aware long-context router and the baselines it is
measured against. Pure Python, no Ray: the Serve admission stage and the simulator call the same
methods with the same clock discipline (`now` is passed in).

Life of a request: `submit` (400 if larger than every replica, 429 if the queue is full) ->
`dispatch` (returns the (request, replica) pairs that may go now; the ledger is committed here)
-> `prefill_done` (first token: the replica's prefill slot frees) -> `complete` (tokens and
the request's state slot released). `requeue`: the chosen replica refused it (its own
authoritative ledger was full, several ingresses): back to the front of its queue. `expire` drops requests that waited longer than the queue timeout (503).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from serve_app.routing.ledger import CapacityLedger
from serve_app.routing.prefix_index import PrefixIndex
from serve_app.routing.settings import RouterSettings


class RouterError(Exception):
    status = 500


class RequestTooLarge(RouterError, ValueError):
    status = 400

    def __init__(self, request_tokens: int, largest_capacity: int) -> None:
        self.request_tokens = request_tokens
        self.largest_capacity = largest_capacity
        super().__init__(
            f"the request needs {request_tokens} KV tokens (prompt + max_tokens) but the largest "
            f"replica holds {largest_capacity} KV tokens")


class QueueFull(RouterError):
    status = 429

    def __init__(self, queue_size: int, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(f"the router queue is full ({queue_size} requests waiting); retry in "
                         f"{retry_after_s:.0f} s")


class ClientLimit(QueueFull):
    """One client has too many requests queued + in flight (429)."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        RouterError.__init__(self, f"this client already has {limit} requests queued or in "
                             f"flight (the per-client limit); retry in {retry_after_s:.0f} s")


class QueueTimeout(RouterError):
    status = 503

    def __init__(self, waited_s: float) -> None:
        self.waited_s = waited_s
        super().__init__(f"no replica had KV capacity and a free state slot for this request "
                         f"within {waited_s:.1f} s "
                         "(router queue timeout); the service is overloaded")


@dataclass
class RouteRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    blocks: tuple[int, ...] = ()
    client: str = ""
    arrival: float = 0.0
    # Disaggregated: the node of the replica that takes the request after this one (its decode
    # replica), whose hand-over costs `handoff_cost` per prompt token from any other node.
    near: str | None = None
    is_long: bool = False
    # Set by dispatch: prompt tokens the chosen replica is expected to prefill (uncached part)
    # and whether that counts as a long prefill on it.
    prefill_tokens: int = 0
    long_prefill: bool = False
    # Set by dispatch: why that replica (the `reason` label of the router_decisions metric):
    # kv_aware's "affinity" (longest cached prefix), "least_work" or "batched" (followed a long
    # prefill of the same document); a baseline's own name.
    reason: str = ""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass
class _Client:
    requests: int = 0  # queued + in flight
    in_flight: int = 0
    committed: int = 0  # prompt + max_tokens of its in-flight requests


@dataclass
class _Load:
    in_flight: int = 0
    pending_prefill: int = 0  # uncached prompt tokens routed here whose first token is not out
    long_prefills: int = 0
    routed: dict[str, RouteRequest] = field(default_factory=dict)


class Policy(ABC):
    """Shared bookkeeping; subclasses decide `dispatch`."""

    name = "base"
    admission = False  # True: holds requests until a replica can take them (this router)

    def __init__(self, settings: RouterSettings) -> None:
        self.s = settings
        self.ledger = CapacityLedger(settings.block_size, settings.share_prefix)
        self.index = PrefixIndex(settings.index_max_entries)
        self.load: dict[str, _Load] = {}
        self.nodes: dict[str, str] = {}  # replica -> its node, where the replicas report it
        self.queue: deque[RouteRequest] = deque()
        self._where: dict[str, str] = {}
        self._requests: dict[str, RouteRequest] = {}  # queued or in flight, by id
        self._dispatched: set[str] = set()
        self.clients: dict[str, _Client] = {}
        self.rng = random.Random(settings.seed)

    # --- replicas -------------------------------------------------------------------------------

    def add_replica(self, replica: str, kv_tokens_total: int,
                    state_slots_total: int | None = None) -> None:
        """A replica and its two resources: KV tokens and state slots (one per running
        request; None = the replica reports no bound, unbounded)."""
        self.ledger.set_capacity(replica, kv_tokens_total, state_slots_total)
        self.index.set_replica_limit(replica, kv_tokens_total // self.s.block_size)
        self.load.setdefault(replica, _Load())

    def remove_replica(self, replica: str) -> list[str]:
        """Forget a replica (it died or was scaled down); returns the ids routed to it."""
        self.ledger.remove_replica(replica)
        self.index.remove_replica(replica)
        self.nodes.pop(replica, None)
        gone = list(self.load.pop(replica, _Load()).routed)
        for rid in gone:
            self._where.pop(rid, None)
            self._forget(rid)
        return gone

    def replicas(self) -> list[str]:
        return list(self.load)

    # --- requests -------------------------------------------------------------------------------

    def submit(self, req: RouteRequest, now: float) -> None:
        if self.admission:
            # 400 only for what can never fit: KV larger than the largest replica. A full set
            # of state slots is temporary (every request gives its slot back), so it queues.
            largest = self.ledger.max_capacity()
            if self.load and req.total_tokens > largest:
                raise RequestTooLarge(req.total_tokens, largest)
            if self.queued() >= self.s.queue_size:
                raise QueueFull(self.s.queue_size, self.s.retry_after_s)
        if req.client and self.clients.get(req.client, _Client()).requests >= \
                self.s.client_max_requests:
            raise ClientLimit(self.s.client_max_requests, self.s.retry_after_s)
        self._register(req, now)
        self._enqueue(req)

    def _register(self, req: RouteRequest, now: float) -> None:
        """The request is the router's from `now`: its class, its client's count."""
        req.arrival = now
        req.is_long = req.prompt_tokens >= self.s.long_threshold
        if req.client:
            self.clients.setdefault(req.client, _Client()).requests += 1
        self._requests[req.request_id] = req

    def _forget(self, request_id: str) -> None:
        """The request left the router (completed, cancelled, expired or its replica went):
        its client's counters drop, once."""
        req = self._requests.pop(request_id, None)
        if req is None or not req.client:
            return
        client = self.clients[req.client]
        client.requests -= 1
        if request_id in self._dispatched:
            self._dispatched.discard(request_id)
            client.in_flight -= 1
            client.committed -= req.total_tokens
        if client.requests <= 0:
            del self.clients[req.client]

    def client_may_dispatch(self, req: RouteRequest) -> bool:
        """A client holds at most client_max_kv_share of the fleet's KV tokens; one with
        nothing in flight is always served (a single request larger than the share must not
        wait forever)."""
        if not req.client or self.s.client_max_kv_share >= 1.0:
            return True
        client = self.clients.get(req.client)
        if client is None or client.in_flight == 0:
            return True
        fleet = sum(self.ledger.capacity(r) for r in self.ledger.replicas())
        return client.committed + req.total_tokens <= self.s.client_max_kv_share * fleet

    def _enqueue(self, req: RouteRequest) -> None:
        self.queue.append(req)

    def queued(self) -> int:
        return len(self.queue)

    def queue_demand(self, now: float) -> tuple[int, int, float]:
        """What waits: (requests, their KV tokens (prompt + max_tokens), the oldest wait in
        seconds): the demand the autoscaling policy adds to what the replicas hold."""
        waiting = [r for q in self._queues() for r in q]
        if not waiting:
            return 0, 0, 0.0
        return (len(waiting), sum(r.total_tokens for r in waiting),
                max(0.0, now - min(r.arrival for r in waiting)))

    @abstractmethod
    def dispatch(self, now: float) -> list[tuple[RouteRequest, str]]: ...

    def expire(self, now: float) -> list[RouteRequest]:
        return []

    def cancel(self, request_id: str) -> bool:
        """Drop a still-queued request (client went away); False if it was not queued."""
        for q in self._queues():
            for req in q:
                if req.request_id == request_id:
                    q.remove(req)
                    self._forget(request_id)
                    return True
        return False

    def _queues(self) -> list[deque[RouteRequest]]:
        return [self.queue]

    def _route(self, req: RouteRequest, replica: str, matched_blocks: int = 0,
               reason: str | None = None) -> None:
        """Book a routing decision: ledger, load counters, prefix index."""
        req.reason = reason or self.name
        cached = min(matched_blocks * self.s.block_size, req.prompt_tokens)
        req.prefill_tokens = req.prompt_tokens - cached
        if replica in self.ledger.replicas() and self.admission:
            self.ledger.commit(req.request_id, replica, req.prompt_tokens, req.max_tokens,
                               req.blocks)
        load = self.load[replica]
        load.in_flight += 1
        load.pending_prefill += req.prefill_tokens
        if req.long_prefill:
            load.long_prefills += 1
        load.routed[req.request_id] = req
        self._where[req.request_id] = replica
        client = self.clients.get(req.client) if req.client else None
        if client is not None and req.request_id not in self._dispatched:
            self._dispatched.add(req.request_id)
            client.in_flight += 1
            client.committed += req.total_tokens
        # Index at routing time, not at completion: a second question on the same document that
        # arrives during the first one's minutes-long prefill must find it.
        self.index.insert(req.blocks, replica)

    def prefill_done(self, request_id: str) -> None:
        replica = self._where.get(request_id)
        if replica is None:
            return
        req = self.load[replica].routed.get(request_id)
        if req is None or req.prefill_tokens < 0:
            return
        load = self.load[replica]
        load.pending_prefill -= req.prefill_tokens
        if req.long_prefill:
            load.long_prefills -= 1
        req.prefill_tokens = -1  # done (marker: do not subtract twice)

    def requeue(self, request_id: str) -> bool:
        """A dispatched request its replica refused (its authoritative ledger was full: another
        ingress took the room): undo the routing decision (ledger, load, the client's in-flight
        counters) and put the request back at the *front* of its queue, keeping its arrival
        (queue timeout, aging) and its place in its client's count (not a new request). False
        if it was not dispatched (already completed or cancelled)."""
        replica = self._where.pop(request_id, None)
        req = self._requests.get(request_id)
        if replica is None or req is None:
            return False
        load = self.load.get(replica)
        if load is not None and load.routed.pop(request_id, None) is not None:
            load.in_flight -= 1
            if req.prefill_tokens > 0:
                load.pending_prefill -= req.prefill_tokens
            if req.long_prefill and req.prefill_tokens >= 0:
                load.long_prefills -= 1
        self.ledger.release(request_id)
        client = self.clients.get(req.client) if req.client else None
        if client is not None and request_id in self._dispatched:
            client.in_flight -= 1
            client.committed -= req.total_tokens
        self._dispatched.discard(request_id)
        req.prefill_tokens, req.long_prefill, req.reason = 0, False, ""
        self._enqueue_front(req)
        return True

    def _enqueue_front(self, req: RouteRequest) -> None:
        self.queue.appendleft(req)

    def resubmit(self, req: RouteRequest, now: float) -> None:
        """A request the router forgot with its replica (`remove_replica`) that is not lost:
        the leaving replica handed it back (a scale-down moves its running requests). It
        enters again at the front of its queue, past the queue and client limits: it is not
        a new request."""
        self._register(req, now)
        self._enqueue_front(req)

    def complete(self, request_id: str) -> None:
        """Idempotent: the routing hook and error paths may both call it."""
        self.prefill_done(request_id)
        self.ledger.release(request_id)
        self._forget(request_id)
        replica = self._where.pop(request_id, None)
        if replica is None or replica not in self.load:
            return
        load = self.load[replica]
        if load.routed.pop(request_id, None) is not None:
            load.in_flight -= 1


# --- baselines: dispatch everything at once, the engine's own queue holds what does not fit ----


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, settings: RouterSettings) -> None:
        super().__init__(settings)
        self._next = 0

    def dispatch(self, now: float) -> list[tuple[RouteRequest, str]]:
        out = []
        replicas = self.replicas()
        while self.queue and replicas:
            req = self.queue.popleft()
            r = replicas[self._next % len(replicas)]
            self._next += 1
            self._route(req, r)
            out.append((req, r))
        return out


class PowerOfTwoPolicy(Policy):
    """Ray Serve's default: two random replicas, the one with fewer ongoing requests."""

    name = "power_of_two"

    def dispatch(self, now: float) -> list[tuple[RouteRequest, str]]:
        out = []
        replicas = self.replicas()
        while self.queue and replicas:
            req = self.queue.popleft()
            pair = self.rng.sample(replicas, min(2, len(replicas)))
            r = min(pair, key=lambda x: self.load[x].in_flight)
            self._route(req, r)
            out.append((req, r))
        return out


class CacheAwarePolicy(Policy):
    """SGLang router's cache_aware policy (sgl-router), on token blocks instead of characters:
    if loads (running requests) are imbalanced (max - min > 32 and max > 1.0001 x min) -> the
    least loaded; else if the best prefix match covers > 50% of the prompt -> that replica; else
    the replica with the smallest tree (most cache room)."""

    name = "cache_aware"

    def dispatch(self, now: float) -> list[tuple[RouteRequest, str]]:
        out = []
        replicas = self.replicas()
        while self.queue and replicas:
            req = self.queue.popleft()
            loads = {r: self.load[r].in_flight for r in replicas}
            hi, lo = max(loads.values()), min(loads.values())
            matches = self.index.match(req.blocks)
            matched = 0
            if (hi - lo > self.s.sglang_balance_abs_threshold
                    and hi > self.s.sglang_balance_rel_threshold * lo):
                r = min(replicas, key=lambda x: loads[x])
                matched = matches.get(r, 0)
            else:
                best = max(replicas, key=lambda x: matches.get(x, 0))
                ratio = matches.get(best, 0) * self.s.block_size / max(1, req.prompt_tokens)
                if ratio > self.s.sglang_cache_threshold:
                    r, matched = best, matches[best]
                else:
                    r = min(replicas, key=lambda x: self.index.size(x))
                    matched = matches.get(r, 0)
            self._route(req, r, matched)
            out.append((req, r))
        return out


# --- this router ---------------------------------------------------------------------------------


class KVRouterPolicy(Policy):
    """Capacity admission + token-based prefix affinity + long/short classes with aging.

    - Admission: a request goes only to a replica whose ledger can hold prompt + max_tokens
      (prefix blocks shared with in-flight requests counted once) and has a free state slot
      (one per running request); otherwise it waits here.
    - Classes: prompts >= long_threshold are "long". Shorts go first (they are cheap and their
      TTFT SLO is tight) unless the oldest long request has waited aging_s, in which case it goes
      first and, if no replica can hold it yet, one replica is reserved for it (shorts stop going
      there) so a 1M-token request is not starved by a trickle of chats.
    - Long prefills: a replica runs at most max_long_prefills_per_replica at once, and at most
      long_prefill_replica_fraction of the replicas run one at all, so short requests always
      have replicas whose prefill queue is not minutes deep. A long request whose prefix is
      already cached (a follow-up question) is not a long prefill and skips that limit.
    - Batching: when a long prefill is dispatched, queued long requests sharing its prefix go to
      the same replica with it (the engine prefills the prefix once; the ledger charges it once).
    - Affinity (SGLang's shape, in tokens of prefill work): if the candidates' pending prefill
      differs by more than balance_abs_tokens and balance_rel x, pick the least work
      (pending + uncached); else the longest cached prefix if it covers >= cache_threshold of the
      prompt; else the least work.
    - Disaggregated pairs: the ingress places a request on a decode replica first (the
      resource it holds for the whole answer; a request no decode replica can take is not
      prefilled), then on a prefill replica with `near` = that decode replica's node; a
      prefill replica elsewhere adds the hand-over's transfer (`handoff_cost` per prompt
      token) to its work. Affinity is left as it is: it only wins where at least
      cache_threshold of the prompt is cached, which saves far more prefill than the transfer
      costs.
    """

    name = "kv_aware"
    admission = True

    def __init__(self, settings: RouterSettings) -> None:
        super().__init__(settings)
        self.long_queue: deque[RouteRequest] = deque()
        self.reserved: str | None = None
        self.reserved_for: str | None = None

    def _enqueue(self, req: RouteRequest) -> None:
        (self.long_queue if req.is_long else self.queue).append(req)

    def _enqueue_front(self, req: RouteRequest) -> None:
        (self.long_queue if req.is_long else self.queue).appendleft(req)

    def queued(self) -> int:
        return len(self.queue) + len(self.long_queue)

    def _queues(self) -> list[deque[RouteRequest]]:
        return [self.queue, self.long_queue]

    def expire(self, now: float) -> list[RouteRequest]:
        gone = []
        for q in self._queues():
            while q and now - q[0].arrival > self.s.queue_timeout_s:
                gone.append(q.popleft())
                self._forget(gone[-1].request_id)
            # FIFO per class: only the heads can be the oldest, but aging reorders nothing inside
            # a class, so scanning beyond the head is not needed.
        if self.reserved_for and all(r.request_id != self.reserved_for for r in self.long_queue):
            self.reserved = self.reserved_for = None
        return gone

    def remove_replica(self, replica: str) -> list[str]:
        if self.reserved == replica:
            self.reserved = self.reserved_for = None
        return super().remove_replica(replica)

    # --- placement ------------------------------------------------------------------------------

    def _long_prefill_allowed(self, replica: str) -> bool:
        load = self.load[replica]
        if load.long_prefills >= self.s.max_long_prefills_per_replica:
            return False
        if load.long_prefills > 0:
            return True
        busy = sum(1 for x in self.load.values() if x.long_prefills > 0)
        limit = max(1, int(self.s.long_prefill_replica_fraction * len(self.load)))
        return busy < limit

    def _place(self, req: RouteRequest, exclude: str | None) -> tuple[str, int, str] | None:
        """(replica, matched blocks, reason) for `req`, or None if no replica can take it now."""
        matches = self.index.match(req.blocks)
        bs = self.s.block_size
        cands: list[str] = []
        uncached: dict[str, int] = {}
        long_on: dict[str, bool] = {}
        for r in self.load:
            # Both resources or nothing: KV room without a free state slot would only move the
            # wait into the engine, where this router can neither see nor order it.
            if r == exclude or not self.ledger.fits(r, req.prompt_tokens, req.max_tokens,
                                                    req.blocks):
                continue
            u = req.prompt_tokens - min(matches.get(r, 0) * bs, req.prompt_tokens)
            is_long_prefill = req.is_long and u >= self.s.long_threshold
            if is_long_prefill and not self._long_prefill_allowed(r):
                continue
            cands.append(r)
            uncached[r] = u
            long_on[r] = is_long_prefill
        if not cands:
            return None

        def work(r: str) -> tuple[float, int]:
            return (self.load[r].pending_prefill + uncached[r] + self._handoff_cost(req, r),
                    self.ledger.committed(r) + self.ledger.external(r)[0])

        pending = [self.load[r].pending_prefill for r in cands]
        hi, lo = max(pending), min(pending)
        imbalanced = hi - lo > self.s.balance_abs_tokens and hi > self.s.balance_rel * lo
        best = max(cands, key=lambda r: (matches.get(r, 0), -self.load[r].pending_prefill))
        ratio = matches.get(best, 0) * bs / max(1, req.prompt_tokens)
        if not imbalanced and ratio >= self.s.cache_threshold:
            choice, reason = best, "affinity"
        else:
            choice, reason = min(cands, key=work), "least_work"
        req.long_prefill = long_on[choice]
        return choice, matches.get(choice, 0), reason

    def _handoff_cost(self, req: RouteRequest, replica: str) -> float:
        """What handing `req` over from `replica` to its decode replica's node costs, in
        prompt tokens of prefill work: nothing on the same node (the object store there), or
        for a replica whose node is unknown (no cost can be told apart)."""
        node = self.nodes.get(replica)
        if req.near is None or node is None or node == req.near:
            return 0.0
        return self.s.handoff_cost * req.prompt_tokens

    def _shares_prefix(self, a: RouteRequest, b: RouteRequest) -> bool:
        if not a.blocks or not b.blocks:
            return False
        n = 0
        for x, y in zip(a.blocks, b.blocks, strict=False):
            if x != y:
                break
            n += 1
        return n * self.s.block_size >= self.s.cache_threshold * b.prompt_tokens

    def _dispatch_one(self, req: RouteRequest, replica: str, matched: int, reason: str,
                      out: list[tuple[RouteRequest, str]]) -> None:
        self._route(req, replica, matched, reason)
        out.append((req, replica))
        if not req.long_prefill:
            return
        # Batch: queued long requests on the same document follow it to the same replica; the
        # engine serves them from the prefix this prefill is writing.
        for other in list(self.long_queue):
            # `fits` checks the slot too: a batch never takes more slots than the replica has.
            if (self._shares_prefix(req, other) and self.client_may_dispatch(other)
                    and self.ledger.fits(replica, other.prompt_tokens, other.max_tokens,
                                         other.blocks)):
                self.long_queue.remove(other)
                other.long_prefill = False
                m = self.index.match(other.blocks).get(replica, 0)
                self._route(other, replica, m, "batched")
                out.append((other, replica))

    def dispatch(self, now: float) -> list[tuple[RouteRequest, str]]:
        out: list[tuple[RouteRequest, str]] = []
        if not self.load:
            return out
        if self.reserved_for and all(r.request_id != self.reserved_for for r in self.long_queue):
            self.reserved = self.reserved_for = None
        # Aged long head: it goes before any short, onto a reserved replica if need be.
        if (self.long_queue and now - self.long_queue[0].arrival >= self.s.aging_s
                and self.client_may_dispatch(self.long_queue[0])):
            head = self.long_queue[0]
            placed = self._place(head, None)
            if placed is not None:
                self.long_queue.popleft()
                if self.reserved_for == head.request_id:
                    self.reserved = self.reserved_for = None
                self._dispatch_one(head, *placed, out)
            elif self.reserved_for != head.request_id:
                # Drain the replica that can hold it soonest: the most capacity minus commitment
                # that is not pinned by a long prefill.
                self.reserved_for = head.request_id
                self.reserved = max(self.load, key=lambda r: (
                    self.ledger.capacity(r) >= head.total_tokens, self.ledger.free(r)))
        # Shorts, FIFO: stop at the first that fits nowhere (all later ones would queue anyway,
        # and letting smaller ones pass would starve the larger). A request held back by its
        # own client's share is skipped, not waited on: it waits for its client's requests,
        # and other clients must not wait behind it.
        held: list[RouteRequest] = []
        while self.queue:
            head = self.queue[0]
            if not self.client_may_dispatch(head):
                held.append(self.queue.popleft())
                continue
            placed = self._place(head, self.reserved)
            if placed is None:
                break
            self._dispatch_one(self.queue.popleft(), *placed, out)
        self.queue.extendleft(reversed(held))
        # Longs, FIFO with bounded look-ahead: a follow-up question on a cached document (no long
        # prefill) may pass a new document that waits for a prefill slot, but never onto the
        # replica reserved for the aged head.
        for req in list(self.long_queue)[:64]:
            # A batch above may have taken it: placing it again would re-flag a request that
            # is already routed.
            if req not in self.long_queue or not self.client_may_dispatch(req):
                continue
            exclude = None if req.request_id == self.reserved_for else self.reserved
            placed = self._place(req, exclude)
            if placed is None:
                continue
            self.long_queue.remove(req)
            if self.reserved_for == req.request_id:
                self.reserved = self.reserved_for = None
            self._dispatch_one(req, *placed, out)
        return out


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (RoundRobinPolicy, PowerOfTwoPolicy, CacheAwarePolicy, KVRouterPolicy)
}


def make_policy(settings: RouterSettings, name: str | None = None) -> Policy:
    key = name or settings.policy
    if key not in POLICIES:  # ray_default: Serve's own routing, no policy of this package
        raise ValueError(f"router.policy={key!r}; allowed: {', '.join(POLICIES)}")
    return POLICIES[key](settings)
