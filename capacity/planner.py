"""Enumerate layouts, keep the ones that fit, price and rank them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date
from functools import cache, cached_property

from capacity.calibration import k3_anchor_gpus
from capacity.config import Images, Layout, Speculation, Workload
from capacity.errors import CapacityError
from capacity.formats import KvDtype, WeightFormat
from capacity.levers import dcp_sizes
from capacity.memory import (
    DEFAULT_KDA_ROLLBACK,
    DEFAULT_REPLAY_RING_LEN,
    MemoryReport,
    check_context,
    check_kda_rollback,
    hicache_host,
    hicache_ratio,
    mamba_slots_per_request,
    max_running_requests,
    memory_per_gpu,
)
from capacity.model import ModelDescriptor
from capacity.sglang_k3_paths import (
    NotServable,
    held_formats,
    k3_paths_for,
    runnable_path,
)
from capacity.sglang_recipe import pipeline_problem
from capacity.tables import (
    GpuSpec,
    PriceRow,
    SglangK3Path,
    cheapest_prices,
    gpu_spec,
)
from capacity.targets import LatencyTargets
from capacity.timing import (
    DEFAULT_CONSTANTS,
    DecodeRate,
    TimeConstants,
    decode_rate,
    prefill_seconds,
    vision_seconds,
)
from capacity.vision import prompt_tokens

DEFAULT_MAX_NODES = 8


@dataclass(frozen=True)
class PlanRow:
    layout: Layout
    memory: MemoryReport
    replicas: int
    concurrency_per_replica: int
    per_user_tokens_s: float
    total_tokens_s: float
    price: PriceRow | None
    _prefill: Callable[[], float] = field(repr=False, compare=False)
    vision_ms_per_image: float | None = None  # None: the plan's requests carry no images
    targets: LatencyTargets | None = None  # the plan's; None: none asked
    host_sessions: int = 0  # full-context sessions the HiCache host tier parks per replica
    # What SGLang 0.5.23 runs K3 with on this GPU (capacity/data/sglang_k3_paths.csv); None
    # for models the table does not cover.
    sglang_path: SglangK3Path | None = None

    @property
    def meets_targets(self) -> bool:
        """One full-context prompt's TTFT and the running requests' decode rate meet the
        plan's targets (always, without targets)."""
        return self.targets is None or self.targets.met(self.prefill_s, self.per_user_tokens_s)

    def missed(self) -> str:
        """Which target the row misses, in words ('' when it meets them)."""
        t = self.targets
        if t is None:
            return ""
        out = []
        if t.ttft_s is not None and self.prefill_s > t.ttft_s:
            out.append(f"TTFT {self.prefill_s:.0f} s > {t.ttft_s:g}")
        if t.min_user_tokens_s is not None and self.per_user_tokens_s < t.min_user_tokens_s:
            out.append(f"{self.per_user_tokens_s:.0f} tok/s < {t.min_user_tokens_s:g}")
        return "; ".join(out)

    @cached_property
    def prefill_s(self) -> float:
        """Seconds to prefill one full-context prompt alone (time to first token, no queue;
        its images through the vision tower first); computed on demand because a sweep ranks thousands of rows it never prints."""
        return self._prefill()

    @property
    def gpus(self) -> int:
        return self.replicas * self.layout.total_gpus

    @property
    def nodes(self) -> int:
        return self.replicas * self.layout.nodes

    @property
    def usd_per_hour(self) -> float | None:
        return self.gpus * self.price.usd_per_gpu_hour if self.price else None

    @property
    def usd_per_million_tokens(self) -> float | None:
        if self.usd_per_hour is None or self.total_tokens_s <= 0:
            return None
        return self.usd_per_hour / (self.total_tokens_s * 3600) * 1e6

    def as_dict(self, today: date | None = None) -> dict[str, object]:
        stage = self.memory.worst_stage
        layout = self.layout
        return {
            "gpu": layout.gpu,
            "layout": layout.label(),
            "weights": (layout.weight_format.value if layout.weight_format else "native"),
            "kv_dtype": layout.kv_dtype.value,
            "replicas": self.replicas,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "tp": layout.tp,
            "attention_dp": layout.attention_dp,
            "ep": layout.ep,
            "pp": layout.pp,
            "dcp": layout.dcp,
            "mamba_radix_cache_strategy": layout.mamba_strategy,
            "hicache_ratio": layout.hicache_ratio,
            "host_sessions": self.host_sessions,
            "levers": layout.levers_label(),
            "meets_targets": self.meets_targets,
            "missed": self.missed(),
            "weights_gb_per_gpu": round(stage.weight_bytes / 1e9, 2),
            "free_gb_per_gpu": round(stage.free_for_requests / 1e9, 2),
            "request_gb_per_gpu": round(stage.request_bytes / 1e9, 3),
            "max_concurrent_per_replica": self.memory.max_concurrent,
            "concurrency_per_replica": self.concurrency_per_replica,
            "tokens_s_per_user": round(self.per_user_tokens_s, 2),
            "tokens_s_total": round(self.total_tokens_s, 1),
            "prefill_s": round(self.prefill_s, 2),
            **({} if self.vision_ms_per_image is None else {
                "vision_ms_per_image": round(self.vision_ms_per_image, 2),
                "vision_weights_gb_per_gpu": round(
                    (stage.weights["vision_tower"] + stage.weights["mm_projector"]) / 1e9, 3),
                "vision_activation_gb_per_gpu": round(
                    stage.outside_pool["vision_activation"] / 1e9, 3),
            }),
            "usd_per_hour": None if self.usd_per_hour is None else round(self.usd_per_hour, 2),
            "usd_per_million_tokens": (
                None if self.usd_per_million_tokens is None
                else round(self.usd_per_million_tokens, 3)
            ),
            "sglang_path": self.sglang_path.label if self.sglang_path else None,
            "sglang_path_source": self.sglang_path.decided_by if self.sglang_path else None,
            # Whether a published K3 measurement on this GPU type anchors the time model; rows
            # without one are roofline extrapolations.
            "k3_anchor": layout.gpu.upper() in k3_anchor_gpus(),
            "provider": self.price.provider if self.price else None,
            "price_date": self.price.date_read if self.price else None,
            "price_age_days": self.price.age_days(today) if self.price else None,
            "price_source": self.price.source if self.price else None,
        }


@dataclass(frozen=True)
class PlanResult:
    model: str
    draft: str | None
    context_length: int  # per request, image tokens included
    rows: tuple[PlanRow, ...]
    evaluated: int
    rejected: dict[str, str]  # GPU -> why its best attempt failed
    images: Images = field(default_factory=Images)
    text_tokens: int | None = None  # the context without image tokens (None: no images)
    targets: LatencyTargets | None = None

    def meeting(self) -> list[PlanRow]:
        """Rows that meet the targets, cheapest first."""
        return [r for r in self.rows if r.meets_targets]

    def missing(self) -> list[PlanRow]:
        """Rows that miss a target, cheapest first (shown apart, not dropped)."""
        return [r for r in self.rows if not r.meets_targets]

    def top(self, n: int, per_gpu: int | None = None,
            rows: Sequence[PlanRow] | None = None) -> list[PlanRow]:
        pool = list(self.rows if rows is None else rows)
        if per_gpu is None:
            return pool[:n]
        seen: dict[str, int] = {}
        picked: list[PlanRow] = []
        for row in pool:
            if seen.get(row.layout.gpu, 0) < per_gpu:
                seen[row.layout.gpu] = seen.get(row.layout.gpu, 0) + 1
                picked.append(row)
        return picked[:n]

    def pareto(self) -> list[PlanRow]:
        """Priced rows no other row beats on both cost per hour and total throughput."""
        priced = sorted(
            (r for r in self.rows if r.usd_per_hour is not None),
            key=lambda r: (r.usd_per_hour, -r.total_tokens_s),
        )
        frontier: list[PlanRow] = []
        best_tps = -1.0
        for row in priced:
            if row.total_tokens_s > best_tps:
                frontier.append(row)
                best_tps = row.total_tokens_s
        return frontier

    def latency_front(self) -> set[int]:
        """Indexes (into `rows`) of the cost/latency Pareto front: priced rows that no other
        row beats on $ per million tokens, TTFT and tokens/s per user at once (at least as
        good on all three, better on one)."""
        priced = sorted(
            (i for i, r in enumerate(self.rows) if r.usd_per_million_tokens is not None),
            key=lambda i: (self.rows[i].usd_per_million_tokens, self.rows[i].prefill_s,
                           -self.rows[i].per_user_tokens_s),
        )
        front: list[tuple[float, float, float, int]] = []
        for i in priced:
            r = self.rows[i]
            point = (r.usd_per_million_tokens or 0.0, r.prefill_s, -r.per_user_tokens_s)
            # Sorted by cost: only an earlier (no dearer) row can dominate this one.
            if not any(all(f <= p for f, p in zip(other[:3], point, strict=True))
                       and other[:3] != point for other in front):
                front.append((*point, i))
        return {entry[3] for entry in front}


def _powers_of_two_dividing(n: int) -> list[int]:
    out = []
    d = 1
    while d <= n:
        if n % d == 0:
            out.append(d)
        d *= 2
    return out


def candidate_layouts(
    model: ModelDescriptor,
    gpu: GpuSpec,
    max_nodes: int = DEFAULT_MAX_NODES,
    weight_formats: Sequence[WeightFormat | None] = (None,),
    kv_dtypes: Sequence[KvDtype] = (KvDtype.BF16,),
    mem_fraction: float | None = None,
    with_dcp: bool = False,
    mamba_strategy: str = "extra_buffer",
) -> list[Layout]:
    """Layouts SGLang can run: EP over the whole stage, attention DP in powers of two, pipeline
    stages either 1 or one per node; attention TP must divide the attention heads. With
    `with_dcp`, each also with decode context parallelism (capacity.levers.dcp_sizes) where
    the GPU runs K3's DCP kernel; `mamba_strategy` is SGLang's radix-cache strategy."""
    return list(_candidate_layouts(model, gpu, max_nodes, tuple(weight_formats),
                                   tuple(kv_dtypes), mem_fraction, with_dcp, mamba_strategy))


@cache
def _candidate_layouts(
    model: ModelDescriptor,
    gpu: GpuSpec,
    max_nodes: int,
    weight_formats: tuple[WeightFormat | None, ...],
    kv_dtypes: tuple[KvDtype, ...],
    mem_fraction: float | None,
    with_dcp: bool = False,
    mamba_strategy: str = "extra_buffer",
) -> tuple[Layout, ...]:
    heads = [h for h in (model.mla.heads if model.mla else None,
                         model.kda.heads if model.kda else None) if h]
    layouts: list[Layout] = []
    extra: dict[str, object] = {"mem_fraction": mem_fraction} if mem_fraction is not None else {}
    if mamba_strategy != "extra_buffer":
        extra["mamba_strategy"] = mamba_strategy
    for nodes in range(1, max_nodes + 1):
        world = nodes * gpu.gpus_per_node
        for stages in sorted({1, nodes}):
            stage_gpus = world // stages
            for dp in _powers_of_two_dividing(stage_gpus):
                tp = stage_gpus // dp
                if any(h % tp for h in heads):
                    continue
                for dcp in [1, *(dcp_sizes(gpu, tp) if with_dcp else [])]:
                    for fmt in weight_formats:
                        for kv in kv_dtypes:
                            layouts.append(Layout(
                                gpu=gpu.gpu, nodes=nodes, tp=stage_gpus, attention_dp=dp,
                                ep=stage_gpus, pp=stages, weight_format=fmt, kv_dtype=kv,
                                dcp=dcp, **extra,  # type: ignore[arg-type]
                            ))
    return tuple(layouts)


def _choose_concurrency(
    rate_at: Callable[[int], DecodeRate], cap: int, min_user_tokens_s: float | None
) -> int | None:
    """The largest concurrency up to `cap` whose per-user rate meets the floor."""
    if min_user_tokens_s is None:
        return cap
    if rate_at(1).per_user_tokens_s < min_user_tokens_s:
        return None
    low, high = 1, cap
    while low < high:
        mid = (low + high + 1) // 2
        if rate_at(mid).per_user_tokens_s >= min_user_tokens_s:
            low = mid
        else:
            high = mid - 1
    return low


def plan(
    model: ModelDescriptor,
    gpus: dict[str, GpuSpec],
    prices: Iterable[PriceRow],
    context_length: int,
    draft: ModelDescriptor | None = None,
    *,
    allowed_gpus: Sequence[str] | None = None,
    concurrency: int | None = None,
    target_tokens_s: float | None = None,
    min_user_tokens_s: float | None = None,
    weight_formats: Sequence[WeightFormat | None] = (None,),
    kv_dtypes: Sequence[KvDtype] = (KvDtype.BF16,),
    max_nodes: int = DEFAULT_MAX_NODES,
    mem_fraction: float | None = None,
    speculation: Speculation | None = None,
    constants: TimeConstants = DEFAULT_CONSTANTS,
    require_price: bool = False,
    kda_rollback: str = DEFAULT_KDA_ROLLBACK,
    ring_len: int = DEFAULT_REPLAY_RING_LEN,
    images: Images | None = None,
    targets: LatencyTargets | None = None,
    levers: bool = False,
    k3_paths: dict[str, SglangK3Path] | None = None,
) -> PlanResult:
    """Ranked feasible fleets (cheapest per million output tokens first). `kda_rollback` is how
    the speculative verify rolls the KDA state back (memory.kda_rollback_costs); the time model
    does not depend on it. `context_length` is each request's text; its `images` add their
    tokens to the prompt (KV, KDA and prefill like any prompt token) and the tower's time to
    its TTFT.

    `targets`: latency targets (capacity.targets); rows that miss them stay in `rows`, marked
    (`PlanRow.meets_targets`), and each row runs the most requests that still meet the
    per-user rate (all it holds when none does). `min_user_tokens_s` is the older hard floor:
    rows below it are dropped. `levers`: SGLang 0.5.23's K3 levers in the search (capacity/
    levers.py): decode context parallel layouts, extra_buffer_lazy state slots, and the
    HiCache host tier where the node's host RAM is known.

    For K3's MXFP4 checkpoint only what SGLang 0.5.23 can run is priced
    (`k3_paths`, default capacity/data/sglang_k3_paths.csv): a GPU without a path is rejected
    as not servable, and one that runs the experts dequantized to BF16 is priced with BF16
    experts in place of `native`."""
    images = images or Images()
    text_tokens = context_length
    context_length = prompt_tokens(model, text_tokens, images)
    check_context(model, context_length, f"{text_tokens:,} text tokens + {images.label} images"
                  if images.per_request else None)
    if concurrency is not None and concurrency <= 0:
        raise CapacityError(f"concurrency must be positive, got {concurrency}")
    if target_tokens_s is not None and target_tokens_s <= 0:
        raise CapacityError(f"target tokens/s must be positive, got {target_tokens_s}")
    if max_nodes <= 0:
        raise CapacityError(f"max nodes must be positive, got {max_nodes}")
    if draft is not None and speculation is None:
        speculation = Speculation.for_draft(draft)
    check_kda_rollback(kda_rollback, speculation.gamma + 1 if speculation else 0, ring_len)
    names = allowed_gpus or [g.gpu for g in gpus.values()]
    specs = [gpu_spec(gpus, n) for n in names]
    best_price = cheapest_prices(prices)
    # Each request holds SGLang's KDA state slots (radix cache + extra_buffer ping-pong) beside
    # its verify scratch, as the emitted deployments size them (memory.running_fit).
    strategy = "extra_buffer_lazy" if levers else "extra_buffer"
    workload = Workload(context_length=context_length, images=images,
                        kda_state_slots=mamba_slots_per_request(strategy))
    soft_floor = targets.min_user_tokens_s if targets is not None else None
    running_cap = max_running_requests(draft)

    rows: list[PlanRow] = []
    rejected: dict[str, tuple[int, str]] = {}
    evaluated = 0
    paths = k3_paths_for(model, k3_paths)
    for spec in specs:
        price = best_price.get(spec.gpu.upper())
        if require_price and price is None:
            rejected[spec.gpu] = (10**18, "no price in the price table")
            continue
        try:
            path = runnable_path(model, spec.gpu, paths)
        except NotServable as refused:
            rejected[spec.gpu] = (10**18 + 1, refused.reason)
            continue
        # Where the checkpoint's MXFP4 experts are upcast at load, price what is in HBM.
        formats = held_formats(model, weight_formats, path)
        for layout in _candidate_layouts(model, spec, max_nodes, formats,
                                         tuple(kv_dtypes), mem_fraction, levers, strategy):
            evaluated += 1
            refused = pipeline_problem(layout.pp, draft is not None)
            if refused is not None:
                # The reason shown only if no layout of this GPU gets as far as its memory
                # (`rejected` keeps the reason with the most free memory).
                if spec.gpu not in rejected:
                    rejected[spec.gpu] = (-(10**18), f"{refused} (best try: {layout.label()})")
                continue
            report = memory_per_gpu(model, layout, workload, spec, draft, speculation,
                                    kda_rollback, ring_len)
            if not report.fits:
                free = report.worst_stage.free_for_requests
                if spec.gpu not in rejected or free > rejected[spec.gpu][0]:
                    rejected[spec.gpu] = (free, f"{report.reasons[0]} (best try: {layout.label()})")
                continue
            cap = min(report.max_concurrent, running_cap)
            host_sessions = 0
            if levers:
                # HiCache: a host pool of ratio x the device pools (the static pool after the
                # weights), sized as SGLang auto-sizes it; it parks whole sessions (MLA KV + a
                # KDA state) between an agent's turns.
                device_pool = report.worst_stage.free_for_requests
                ratio = hicache_ratio(spec, layout.gpus_per_node, device_pool)
                if ratio > 0:
                    layout = layout.model_copy(update={"hicache_ratio": ratio})
                    tier = hicache_host(layout, spec, device_pool)
                    stage = report.worst_stage
                    session = (stage.per_request.get("mla_kv", 0)
                               + stage.per_request.get("kda_state", 0)
                               // max(1, workload.kda_state_slots))
                    if tier is not None and session:
                        host_sessions = (tier.host_bytes_per_rank // session
                                         * layout.attention_dp)

            def rate_at(c: int, layout: Layout = layout, spec: GpuSpec = spec) -> DecodeRate:
                return decode_rate(model, layout, spec, c, context_length, draft, speculation,
                                   constants)

            per_replica = _choose_concurrency(rate_at, cap, min_user_tokens_s)
            if per_replica is not None and min_user_tokens_s is None and soft_floor is not None:
                # The most requests that still meet the target's rate; all it holds when not
                # even one does (the row then shows among those that miss the targets).
                per_replica = _choose_concurrency(rate_at, cap, soft_floor) or cap
            if per_replica is None:
                rejected.setdefault(
                    spec.gpu,
                    (-1, f"one request decodes below {min_user_tokens_s} tokens/s on "
                         f"{layout.label()}"),
                )
                continue
            replicas = 1
            if concurrency is not None:
                replicas = math.ceil(concurrency / per_replica)
                per_replica = math.ceil(concurrency / replicas)
            rate = rate_at(per_replica)
            if target_tokens_s is not None and concurrency is None:
                replicas = max(1, math.ceil(target_tokens_s / rate.total_tokens_s))
            rows.append(PlanRow(
                layout=layout,
                memory=report,
                replicas=replicas,
                concurrency_per_replica=per_replica,
                per_user_tokens_s=rate.per_user_tokens_s,
                total_tokens_s=rate.total_tokens_s * replicas,
                price=price,
                _prefill=lambda layout=layout, spec=spec: prefill_seconds(
                    model, layout, spec, context_length, 1, constants
                ) + vision_seconds(model, layout, spec, images, constants).request_s,
                vision_ms_per_image=(
                    vision_seconds(model, layout, spec, images, constants).per_image_s * 1e3
                    if images.per_request else None),
                targets=targets,
                host_sessions=host_sessions,
                sglang_path=path,
            ))
    for row in rows:
        rejected.pop(row.layout.gpu, None)

    def rank(row: PlanRow) -> tuple[float, float]:
        cost = row.usd_per_million_tokens
        return (math.inf if cost is None else cost, -row.total_tokens_s)

    rows.sort(key=rank)
    return PlanResult(
        model=model.name,
        draft=draft.name if draft else None,
        context_length=context_length,
        rows=tuple(rows),
        evaluated=evaluated,
        rejected={gpu: why for gpu, (_, why) in rejected.items()},
        images=images,
        text_tokens=text_tokens if images.per_request else None,
        targets=targets,
    )


def explain_infeasible(result: PlanResult, max_nodes: int) -> str:
    what = result.model + (f" + {result.draft}" if result.draft else "")
    reasons = "; ".join(f"{gpu}: {why}" for gpu, why in sorted(result.rejected.items()))
    return (
        f"no layout of up to {max_nodes} nodes serves {what} at {result.context_length:,} "
        f"tokens: {reasons}"
    )
