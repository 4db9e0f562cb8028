"""Discrete-event simulator: a workload replayed against N simulated engine replicas, routed by
the real policy classes of `serve_app.routing.policy`.

Every number about the hardware comes from the capacity planner (`capacity`): prefill seconds
(`prefill_seconds`, chunk costs are differences of its cumulative curve, so attention at a deep
position costs what it costs there), decode step seconds and tokens per step with DSpark
speculation (`decode_step`), and KV tokens per replica (`memory_per_gpu`: free pool per GPU over
bytes per cached token, after reserving the per-request KDA states of the running slots).

Each replica has two resources, as in the Serve app: KV tokens and `max_running` state slots
(one per running request: its KDA state, one of SGLang's --max-running-requests places). The
policy is told both (`add_replica(name, kv_tokens, slots)`), so the kv_aware router holds in its
own queue what would otherwise wait in an engine's waiting queue for a slot.

Engine model (SGLang-like, one scheduler per replica): a waiting queue; admission into KV when
prompt + max_tokens fit (uncached blocks only; an LRU radix-style prefix cache of whole blocks,
unreferenced blocks evicted first); at most `max_running` requests; each iteration runs one
prefill chunk (up to `chunk_tokens`, FIFO over prefilling requests, SGLang's chunked prefill)
mixed with one decode step of every running request. A request's first token comes at the end
of its prefill; each decode step commits `acceptance_length` tokens per request.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from serve_app.routing.policy import (
    Policy,
    QueueFull,
    RequestTooLarge,
    RouteRequest,
    RouterSettings,
    make_policy,
)
from serve_app.routing.prefix_index import chain_hashes

# --- the cost model (from the capacity planner) ----------------------------------------------


@dataclass(frozen=True)
class FleetSpec:
    """Default: Kimi K3 + DSpark on 2 x 8 H200 (TP16 EP16) per replica, FP8 KV cache (a 1M-token
    BF16 MLA cache does not fit the 21 GB per GPU that the weights leave on H200; see
    `kimi-capacity explain --gpu H200 --nodes 2 --draft kimi-k3-dspark --context 1M`)."""

    model: str = "kimi-k3"
    draft: str | None = "kimi-k3-dspark"
    gpu: str = "H200"
    nodes: int = 2
    gpus_per_node: int = 8
    kv_dtype: str = "fp8"
    replicas: int = 4
    max_running: int = 16  # SGLang --max-running-requests; KDA state slots reserved for these
    chunk_tokens: int = 8192
    acceptance_length: float = 3.45
    gamma: int = 7


class CostModel:
    """Prefill/decode seconds and KV tokens for one replica of `spec`, via `capacity`."""

    def __init__(self, spec: FleetSpec) -> None:
        from capacity import (
            Layout,
            Speculation,
            Workload,
            describe_model,
            load_gpus,
            memory_per_gpu,
        )
        from capacity.formats import KvDtype

        self.spec = spec
        self.model = describe_model(spec.model)
        self.draft = describe_model(spec.draft) if spec.draft else None
        self.gpu = load_gpus()[spec.gpu.upper()]
        world = spec.nodes * spec.gpus_per_node
        self.layout = Layout(gpu=self.gpu.gpu, nodes=spec.nodes, tp=world, ep=world,
                             kv_dtype=KvDtype(spec.kv_dtype))
        self.speculation = (Speculation(gamma=spec.gamma,
                                        acceptance_length=spec.acceptance_length)
                            if self.draft else None)
        # A replica is sized for the model's own context (the descriptor's `max_context`, from
        # its config's max_position_embeddings); 1M only when the config does not say.
        context = self.model.max_context or 1_048_576
        self.context_length = context
        report = memory_per_gpu(self.model, self.layout, Workload(context_length=context),
                                self.gpu, self.draft, self.speculation)
        stage = report.worst_stage
        per_request = stage.per_request
        # Bytes that grow with context (MLA + draft KV) over the tokens that report sized them
        # for, and the per-request constant (KDA states), straight from the memory model.
        growing = per_request.get("mla_kv", 0) + per_request.get("draft_kv", 0)
        verify = (spec.gamma + 1) if self.draft else 1
        sized_tokens = math.ceil((context + verify) / 64) * 64
        self.kv_bytes_per_token = growing / sized_tokens
        fixed = sum(v for k, v in per_request.items() if k not in ("mla_kv", "draft_kv"))
        free = stage.free_for_requests - fixed * spec.max_running
        self.kv_tokens = int(free // self.kv_bytes_per_token)
        self.fixed_pass_s = self.prefill_s(1)

    @cache  # noqa: B019 - one model per run, few distinct lengths
    def prefill_s(self, tokens: int) -> float:
        from capacity.timing import prefill_seconds

        if tokens <= 0:
            return 0.0
        return prefill_seconds(self.model, self.layout, self.gpu, tokens,
                               chunk_tokens=self.spec.chunk_tokens)

    def prefill_segment_s(self, start: int, end: int) -> float:
        """Seconds to prefill positions [start, end) of one prompt: the difference of the
        cumulative curve (block-rounded for caching), so deep chunks pay their attention."""
        q = 256
        a, b = (start // q) * q, -(-end // q) * q
        return max(0.0, self.prefill_s(b) - (self.prefill_s(a) if a else 0.0))

    @cache  # noqa: B019
    def _step(self, batch: int, context_bucket: int) -> tuple[float, float]:
        from capacity.timing import decode_step

        s = decode_step(self.model, self.layout, self.gpu, batch, context_bucket, self.draft,
                        self.speculation)
        return s.step_s, s.tokens_per_step / batch

    def decode_step(self, batch: int, mean_context: float) -> tuple[float, float]:
        """(seconds, tokens committed per request) for one decode step."""
        bucket = 1 << max(10, math.ceil(math.log2(max(1.0, mean_context))))
        return self._step(batch, bucket)


# --- workload --------------------------------------------------------------------------------


@dataclass
class SimRequest:
    request_id: str
    arrival: float
    cls: str  # "short" | "long"
    prompt_tokens: int
    output_tokens: int
    doc: int = -1  # document id for long requests (shared prefix)
    doc_tokens: int = 0
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkloadSpec:
    rate: float = 1.0  # requests per second, all classes
    duration_s: float = 900.0
    long_fraction: float = 0.2  # share of requests that are questions on a long document
    questions_mean: float = 3.0  # questions per document (1 + Poisson)
    question_gap_s: float = 60.0  # mean gap between questions on one document
    doc_min_tokens: int = 32_768
    doc_max_tokens: int = 1_048_576
    short_prompt_median: int = 1200
    short_output_median: int = 200
    long_output_median: int = 300
    seed: int = 0


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def generate_workload(w: WorkloadSpec, block_size: int, max_model_len: int) -> list[SimRequest]:
    """Poisson arrivals: short chats, and long documents each asked several questions over time
    (all questions on one document share its prefix)."""
    rng = random.Random(w.seed)
    out: list[SimRequest] = []
    short_rate = w.rate * (1 - w.long_fraction)
    t = 0.0
    n = 0
    while True:
        t += rng.expovariate(short_rate) if short_rate > 0 else math.inf
        if t >= w.duration_s:
            break
        p = _lognormal(rng, w.short_prompt_median, 0.8, 64, 16_384)
        o = _lognormal(rng, w.short_output_median, 0.6, 16, 1024)
        # Short chats share a system prompt of two blocks (realistic, and what SGLang's tree
        # would pick up); the rest is unique.
        sys_blocks = chain_hashes(("system", i) for i in range(min(2, p // block_size)))
        own = chain_hashes((("chat", n, i) for i in range(p // block_size - len(sys_blocks))),
                           sys_blocks[-1] if sys_blocks else 0)
        out.append(SimRequest(f"s{n}", t, "short", p, o, blocks=sys_blocks + own))
        n += 1
    doc_rate = w.rate * w.long_fraction / w.questions_mean
    t = 0.0
    d = 0
    lo, hi = math.log(w.doc_min_tokens), math.log(w.doc_max_tokens)
    while doc_rate > 0:
        t += rng.expovariate(doc_rate)
        if t >= w.duration_s:
            break
        q_count = 1 + _poisson(rng, w.questions_mean - 1)
        out_max = _lognormal(rng, w.long_output_median, 0.5, 32, 2048)
        doc_tokens = min(int(math.exp(rng.uniform(lo, hi))), max_model_len - 512 - out_max)
        doc_tokens -= doc_tokens % block_size  # documents are whole blocks; questions are not
        doc_blocks = chain_hashes(("doc", d, i) for i in range(doc_tokens // block_size))
        at = t
        for q in range(q_count):
            qt = rng.randint(64, 400)
            o = _lognormal(rng, w.long_output_median, 0.5, 32, 2048)
            out.append(SimRequest(f"d{d}q{q}", at, "long", doc_tokens + qt, o, doc=d,
                                  doc_tokens=doc_tokens, blocks=doc_blocks))
            at += rng.expovariate(1 / w.question_gap_s)
        d += 1
    out.sort(key=lambda r: (r.arrival, r.request_id))
    return [r for r in out if r.arrival < w.duration_s]


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def load_trace(path: str | Path, block_size: int) -> list[SimRequest]:
    """JSONL, one request per line: arrival (s), prompt_tokens, output_tokens, optional cls
    ("short"/"long"), doc (shared-prefix id), doc_tokens (length of the shared prefix)."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        p, o = int(row["prompt_tokens"]), int(row["output_tokens"])
        doc = int(row.get("doc", -1))
        doc_tokens = int(row.get("doc_tokens", 0)) if doc >= 0 else 0
        blocks = chain_hashes(("doc", doc, j) for j in range(doc_tokens // block_size))
        blocks += chain_hashes((("own", i, j) for j in range((p - doc_tokens) // block_size)),
                               blocks[-1] if blocks else 0)
        out.append(SimRequest(str(row.get("id", f"t{i}")), float(row["arrival"]),
                              row.get("cls", "long" if doc >= 0 else "short"), p, o, doc,
                              doc_tokens, blocks))
    out.sort(key=lambda r: r.arrival)
    return out


# --- the engine replica ----------------------------------------------------------------------


@dataclass
class _Job:
    req: SimRequest
    routed_at: float
    admitted_at: float = -1.0
    cached: int = 0
    done_prefill: int = 0
    produced: float = 0.0
    first_token: float = -1.0
    private: int = 0


@dataclass
class Outcome:
    request_id: str
    cls: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    status: str = "pending"  # ok | rejected_429 | rejected_400 | timeout_503 | unfinished
    replica: str | None = None
    routed_at: float = -1.0
    admitted_at: float = -1.0
    first_token: float = -1.0
    finished: float = -1.0
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finished - self.first_token) / max(1, self.output_tokens - 1)


class SimReplica:
    def __init__(self, name: str, cost: CostModel, block_size: int) -> None:
        self.name = name
        self.cost = cost
        self.bs = block_size
        self.kv_total = cost.kv_tokens
        self.slots_total = cost.spec.max_running  # state slots: running requests at once
        self.max_running = 0  # peak running requests (never above slots_total)
        self.slot_waits = 0  # admission passes that left a routed request waiting for a slot
        self.cache: OrderedDict[int, int] = OrderedDict()  # block -> running holders (LRU)
        self.ref_blocks = 0
        self.private = 0
        self.waiting: deque[_Job] = deque()
        self.prefilling: deque[_Job] = deque()
        self.decoding: list[_Job] = []
        self.busy = False
        self.max_used = 0
        self.kv_time = 0.0  # integral of used tokens over time

    def used(self) -> int:
        return len(self.cache) * self.bs + self.private

    def referenced(self) -> int:
        return self.ref_blocks * self.bs + self.private

    def _try_admit(self, now: float) -> None:
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.slots_total:
            job = self.waiting[0]
            r = job.req
            blocks = r.blocks
            need_blocks = sum(1 for h in blocks if self.cache.get(h, 0) == 0)
            private = r.prompt_tokens - len(blocks) * self.bs + r.output_tokens
            if self.referenced() + need_blocks * self.bs + private > self.kv_total:
                return  # FIFO: the head waits for KV (SGLang's waiting queue)
            self.waiting.popleft()
            cached = 0
            for h in blocks:
                if h in self.cache:
                    cached += 1
                else:
                    break
            for h in blocks:
                held = self.cache.get(h)
                if held is None:
                    self.cache[h] = 1
                    self.ref_blocks += 1
                else:
                    if held == 0:
                        self.ref_blocks += 1
                    self.cache[h] = held + 1
                    self.cache.move_to_end(h)
            self.private += private
            job.private = private
            job.cached = min(cached * self.bs, r.prompt_tokens - 1)
            job.done_prefill = job.cached
            job.admitted_at = now
            # Evict unreferenced blocks, least recently used first, until the pool fits.
            if self.used() > self.kv_total:
                for h in list(self.cache):
                    if self.used() <= self.kv_total:
                        break
                    if self.cache[h] == 0:
                        del self.cache[h]
            assert self.referenced() <= self.kv_total, "KV capacity exceeded"
            self.max_used = max(self.max_used, self.referenced())
            self.prefilling.append(job)
            self.max_running = max(self.max_running, len(self.prefilling) + len(self.decoding))
        if self.waiting and len(self.prefilling) + len(self.decoding) >= self.slots_total:
            self.slot_waits += 1  # routed here, KV or not, and no slot: waits invisibly

    def _release(self, job: _Job) -> None:
        self.private -= job.private
        for h in job.req.blocks:
            held = self.cache.get(h)
            if held is not None:
                self.cache[h] = held - 1
                if held - 1 == 0:
                    self.ref_blocks -= 1

    def iterate(self, now: float) -> tuple[float, list[_Job], list[_Job]] | None:
        """Run one scheduler iteration starting at `now`: (duration, first-token jobs,
        finished jobs), or None if idle."""
        self._try_admit(now)
        if not self.prefilling and not self.decoding:
            return None
        budget = self.cost.spec.chunk_tokens
        prefill_s = 0.0
        segments = 0
        firsts: list[_Job] = []
        for job in self.prefilling:
            if budget <= 0:
                break
            take = min(budget, job.req.prompt_tokens - job.done_prefill)
            prefill_s += self.cost.prefill_segment_s(job.done_prefill, job.done_prefill + take)
            segments += 1
            job.done_prefill += take
            budget -= take
            if job.done_prefill >= job.req.prompt_tokens:
                firsts.append(job)
        # Requests batched into one pass share its weight reads and per-layer fixed cost.
        prefill_s -= max(0, segments - 1) * self.cost.fixed_pass_s
        decode_s, per_req = 0.0, 0.0
        if self.decoding:
            ctx = sum(j.req.prompt_tokens + j.produced for j in self.decoding) / len(self.decoding)
            decode_s, per_req = self.cost.decode_step(len(self.decoding), ctx)
        duration = max(prefill_s, 0.0) + decode_s
        self.kv_time += self.referenced() * duration
        finished: list[_Job] = []
        for job in self.decoding:
            job.produced += per_req
            if job.produced >= job.req.output_tokens:
                finished.append(job)
        for job in finished:
            self.decoding.remove(job)
            self._release(job)
        for job in firsts:
            self.prefilling.remove(job)
            job.produced = 1.0
            if job.produced >= job.req.output_tokens:
                finished.append(job)
                self._release(job)
            else:
                self.decoding.append(job)
        return duration, firsts, finished


# --- the event loop --------------------------------------------------------------------------


@dataclass(frozen=True)
class SLO:
    short_ttft_s: float = 2.0
    short_tpot_s: float = 0.100
    long_ttft_factor: float = 2.0  # x the prompt's isolated, uncached prefill time ...
    long_ttft_extra_s: float = 5.0  # ... + this
    long_tpot_s: float = 0.200


@dataclass
class RunResult:
    policy: str
    rate: float
    outcomes: list[Outcome]
    replicas: list[SimReplica] = field(repr=False)
    makespan: float
    duration: float
    queue_peak: int
    kv_tokens: int


def simulate(requests: Sequence[SimRequest], cost: CostModel, policy: Policy,
             drain_s: float = 3600.0) -> tuple[list[Outcome], list[SimReplica], float, int]:
    """Replay `requests` (sorted by arrival) through `policy` onto `cost.spec.replicas` replicas.
    Returns outcomes (one per request, in input order), the replicas, the makespan and the peak
    router queue length."""
    bs = policy.s.block_size
    replicas = {f"r{i}": SimReplica(f"r{i}", cost, bs) for i in range(cost.spec.replicas)}
    for name, rep in replicas.items():
        policy.add_replica(name, rep.kv_total, rep.slots_total)
    outcomes = {r.request_id: Outcome(r.request_id, r.cls, r.arrival, r.prompt_tokens,
                                      r.output_tokens) for r in requests}
    by_id = {r.request_id: r for r in requests}
    events: list[tuple[float, int, str, str]] = []
    seq = 0

    def push(t: float, kind: str, key: str) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, key))
        seq += 1

    for r in requests:
        push(r.arrival, "arrive", r.request_id)
    end = (requests[-1].arrival if requests else 0.0) + drain_s
    queue_peak = 0
    now = 0.0
    tick_pending = False

    def kick(rep: SimReplica, t: float) -> None:
        if rep.busy:
            return
        step = rep.iterate(t)
        if step is None:
            return
        rep.busy = True
        duration, firsts, finished = step
        pending_steps[rep.name] = (firsts, finished)
        push(t + duration, "step", rep.name)

    pending_steps: dict[str, tuple[list[_Job], list[_Job]]] = {}

    def route(t: float) -> None:
        nonlocal queue_peak
        for req, name in policy.dispatch(t):
            o = outcomes[req.request_id]
            o.replica, o.routed_at = name, t
            rep = replicas[name]
            sim = by_id[req.request_id]
            if sim.prompt_tokens + sim.output_tokens > rep.kv_total:
                # The engine refuses what it can never hold (baselines send it anyway).
                o.status = "rejected_400"
                policy.complete(req.request_id)
                continue
            rep.waiting.append(_Job(sim, t))
            kick(rep, t)
        queue_peak = max(queue_peak, policy.queued())

    while events:
        now, _, kind, key = heapq.heappop(events)
        if now > end:
            break
        if kind == "arrive":
            sim = by_id[key]
            try:
                policy.submit(RouteRequest(key, sim.prompt_tokens, sim.output_tokens,
                                           sim.blocks), now)
            except QueueFull:
                outcomes[key].status = "rejected_429"
                continue
            except RequestTooLarge:
                outcomes[key].status = "rejected_400"
                continue
            route(now)
        elif kind == "step":
            rep = replicas[key]
            rep.busy = False
            firsts, finished = pending_steps.pop(key)
            for job in firsts:
                o = outcomes[job.req.request_id]
                o.first_token, o.admitted_at, o.cached_tokens = now, job.admitted_at, job.cached
                policy.prefill_done(job.req.request_id)
            for job in finished:
                o = outcomes[job.req.request_id]
                o.finished, o.status = now, "ok"
                policy.complete(job.req.request_id)
            route(now)
            kick(rep, now)
        elif kind == "tick":
            tick_pending = False
            for req in policy.expire(now):
                outcomes[req.request_id].status = "timeout_503"
            route(now)
        if policy.queued() and not tick_pending:
            push(now + 1.0, "tick", "")
            tick_pending = True
    for o in outcomes.values():
        if o.status == "pending":
            o.status = "unfinished"
    return [outcomes[r.request_id] for r in requests], list(replicas.values()), now, queue_peak


# --- metrics ---------------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1)]


def meets_slo(o: Outcome, cost: CostModel, slo: SLO) -> bool:
    if o.status != "ok":
        return False
    if o.cls == "short":
        return o.ttft <= slo.short_ttft_s and o.tpot <= slo.short_tpot_s
    limit = slo.long_ttft_factor * cost.prefill_s(o.prompt_tokens) + slo.long_ttft_extra_s
    return o.ttft <= limit and o.tpot <= slo.long_tpot_s


def summarize(res: RunResult, cost: CostModel, slo: SLO) -> dict[str, Any]:
    outs = res.outcomes
    ok = [o for o in outs if o.status == "ok"]
    row: dict[str, Any] = {"policy": res.policy, "rate": res.rate, "requests": len(outs),
                           "completed": len(ok)}
    good = sum(1 for o in outs if meets_slo(o, cost, slo))
    row["goodput_rps"] = good / res.duration
    row["slo_attainment"] = good / max(1, len(outs))
    for cls in ("short", "long"):
        t = [o.ttft for o in ok if o.cls == cls]
        row[f"{cls}_ttft_p50_s"] = _pct(t, 50)
        row[f"{cls}_ttft_p99_s"] = _pct(t, 99)
        row[f"{cls}_tpot_p50_ms"] = _pct([o.tpot * 1e3 for o in ok if o.cls == cls], 50)
        row[f"{cls}_good"] = sum(1 for o in outs if o.cls == cls and meets_slo(o, cost, slo))
        row[f"{cls}_total"] = sum(1 for o in outs if o.cls == cls)
    admitted = [o for o in outs if o.admitted_at >= 0]
    prompt = sum(o.prompt_tokens for o in admitted)
    row["prefix_hit_rate"] = sum(o.cached_tokens for o in admitted) / max(1, prompt)
    row["kv_utilisation"] = sum(r.kv_time for r in res.replicas) / (
        res.kv_tokens * len(res.replicas) * max(1e-9, res.makespan))
    row["kv_peak_fraction"] = max(r.max_used for r in res.replicas) / res.kv_tokens
    waits = [o.admitted_at - o.arrival for o in admitted]
    row["queue_wait_mean_s"] = sum(waits) / max(1, len(waits))
    row["queue_wait_p99_s"] = _pct(waits, 99)
    row["router_queue_peak"] = res.queue_peak
    # Routed to a replica whose state slots were all taken (it waited there, unseen by the
    # router): the baselines do it; kv_aware, told each replica's slots, should not.
    row["engine_slot_waits"] = sum(r.slot_waits for r in res.replicas)
    for status in ("rejected_429", "rejected_400", "timeout_503", "unfinished"):
        row[status] = sum(1 for o in outs if o.status == status)
    return row


def run_policies(policies: Iterable[str], rates: Iterable[float], fleet: FleetSpec,
                 workload: WorkloadSpec, settings: RouterSettings, slo: SLO,
                 trace: list[SimRequest] | None = None, drain_s: float = 3600.0
                 ) -> tuple[list[dict[str, Any]], CostModel]:
    cost = CostModel(fleet)
    rows = []
    for rate in rates:
        w = WorkloadSpec(**{**asdict(workload), "rate": rate})
        reqs = trace if trace is not None else generate_workload(
            w, settings.block_size, max_model_len=min(cost.context_length, cost.kv_tokens))
        for name in policies:
            policy = make_policy(settings, name)
            outs, reps, makespan, peak = simulate(reqs, cost, policy, drain_s)
            res = RunResult(name, rate, outs, reps, makespan, w.duration_s, peak, cost.kv_tokens)
            rows.append(summarize(res, cost, slo))
    return rows, cost
