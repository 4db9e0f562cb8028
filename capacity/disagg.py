"""Aggregated and prefill/decode-disaggregated fleets side by side, at a TTFT and ITL target.

A request is `input_tokens` of prompt and `output_tokens` of answer. The time model is the
planner's own (timing.py: `prefill_seconds`, `decode_rate`); what this module adds is how the
two layouts spend it, as NVIDIA's aiconfigurator compares them:

- **Aggregated** (one layout does both, chunked prefill): in a closed loop of c running
  requests, each request's prompt is prefilled once per `output_tokens` decoded (as
  `timing.serving_throughput`), and every prefill stalls the decodes. A user's mean inter-token
  gap (ITL) is therefore (decode time + prefill time) / output_tokens. Its time to first token
  (TTFT) is the prompt's prefill alone plus one decode step per prefill chunk (each chunk
  shares a step with the c decodes). The largest c whose ITL meets the target is taken.
- **Disaggregated**: prefill replicas prefill b prompts at a time (the largest b whose
  prefill meets the TTFT target) and hand each request over (the MLA latents of its prompt,
  its KDA state, the draft's context rows: `handoff_bytes`) over the GPUs' scale-out network;
  decode replicas run the largest concurrency whose ITL (one decode step per accepted token)
  meets the target. TTFT = prefill + transfer. The fleet is the integer mix of prefill and
  decode replicas (up to `MAX_REPLICAS` of either) that serves the most requests per GPU.

Queueing is not modelled (TTFT at the rates shown, not under a burst), and the transfer uses
one GPU's NIC per request (every attention-TP rank moves its copy of the latent in parallel
over its own NIC). Costs are per million output tokens, priced like `plan`'s rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from capacity.config import Layout, Speculation, Workload
from capacity.errors import CapacityError
from capacity.formats import KvDtype, WeightFormat
from capacity.memory import (
    DEFAULT_KDA_ROLLBACK,
    MAMBA_SLOTS_PER_RUNNING_REQUEST,
    check_context,
    max_running_requests,
    memory_per_gpu,
    running_fit,
)
from capacity.model import ModelDescriptor
from capacity.planner import DEFAULT_MAX_NODES, _candidate_layouts
from capacity.sglang_k3_paths import NotServable, held_formats, runnable_path
from capacity.sglang_recipe import pipeline_problem
from capacity.tables import GpuSpec, PriceRow, cheapest_prices, gpu_spec
from capacity.timing import DEFAULT_CONSTANTS, TimeConstants, decode_rate, prefill_seconds

MAX_REPLICAS = 64  # of either kind in one disaggregated fleet
# A fleet this much less efficient per GPU than the best mix is still taken if it is smaller
# (integer replica counts: the best ratio may need a huge fleet for a percent).
MIX_SLACK = 0.05
PREFILL_BATCHES = (1, 2, 4, 8, 16, 32, 64)
CHUNK_TOKENS = 8192  # SGLang's chunked_prefill_size in the emitted deployments


@dataclass(frozen=True)
class Targets:
    input_tokens: int
    output_tokens: int
    ttft_s: float | None = None  # None: no bound
    itl_s: float | None = None


@dataclass(frozen=True)
class ModeRow:
    mode: Literal["agg", "disagg"]
    prefill: Layout  # agg: the one layout
    decode: Layout
    prefill_replicas: int  # agg: 0 (the decode replicas prefill too)
    decode_replicas: int
    prefill_batch: int  # prompts prefilled together (agg: 1, chunked into the decodes)
    decode_concurrency: int  # running requests per decode (agg: per) replica
    ttft_s: float
    itl_s: float  # mean gap between a user's tokens
    requests_s: float  # the fleet's
    handoff_bytes: int  # per request (agg: 0)
    transfer_s: float
    price: PriceRow | None
    output_tokens: int  # per request

    @property
    def gpus(self) -> int:
        return (self.prefill_replicas * self.prefill.total_gpus
                + self.decode_replicas * self.decode.total_gpus)

    @property
    def output_tokens_s(self) -> float:
        return self.requests_s * self.output_tokens

    @property
    def usd_per_hour(self) -> float | None:
        return self.gpus * self.price.usd_per_gpu_hour if self.price else None

    @property
    def usd_per_million_tokens(self) -> float | None:
        if self.usd_per_hour is None or self.output_tokens_s <= 0:
            return None
        return self.usd_per_hour / (self.output_tokens_s * 3600) * 1e6

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode, "gpu": self.decode.gpu,
            "prefill": self.prefill.label() if self.mode == "disagg" else None,
            "decode": self.decode.label(),
            "prefill_replicas": self.prefill_replicas, "decode_replicas": self.decode_replicas,
            "prefill_batch": self.prefill_batch, "decode_concurrency": self.decode_concurrency,
            "gpus": self.gpus, "ttft_s": round(self.ttft_s, 3), "itl_ms": round(1e3 * self.itl_s, 2),
            "requests_s": round(self.requests_s, 4),
            "output_tokens_s": round(self.output_tokens_s, 1),
            "handoff_gb": round(self.handoff_bytes / 1e9, 3), "transfer_s": round(self.transfer_s, 3),
            "usd_per_hour": None if self.usd_per_hour is None else round(self.usd_per_hour, 2),
            "usd_per_million_tokens": (None if self.usd_per_million_tokens is None
                                       else round(self.usd_per_million_tokens, 3)),
            "provider": self.price.provider if self.price else None,
        }


def handoff_bytes(model: ModelDescriptor, draft: ModelDescriptor | None, prompt_tokens: int,
                  kv_dtype: KvDtype) -> int:
    """What a hand-over moves for one request: the MLA latents of its prompt (all MLA
    layers), its KDA state (every KDA layer's conv window and recurrent state, SGLang's
    dtypes) and the draft's context rows (every GQA layer's K and V)."""
    per_token = model.kv_bytes_per_token(kv_dtype)
    if draft is not None:
        per_token += draft.gqa_kv_bytes_per_token(kv_dtype)
    return prompt_tokens * per_token + (model.kda_state_bytes() if model.kda else 0)


def _largest(cap: int, ok: Callable[[int], bool]) -> int | None:
    """The largest c in [1, cap] with ok(c), ok being monotone (true, then false)."""
    if cap < 1 or not ok(1):
        return None
    low, high = 1, cap
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True)
class _Side:
    layout: Layout
    batch: int  # prefill: prompts together; decode: running requests
    seconds: float  # prefill: of one batch (aggregated: the TTFT); decode: the ITL
    requests_s: float  # one replica's
    itl_s: float = 0.0  # aggregated: the ITL


@dataclass(frozen=True)
class _Layout:
    """One layout's aggregated row and its two disaggregated sides."""

    model: ModelDescriptor
    draft: ModelDescriptor | None
    speculation: Speculation | None
    constants: TimeConstants
    kda_rollback: str
    spec: GpuSpec
    layout: Layout
    targets: Targets
    running_cap: int

    @cached_property
    def full_context_fit(self) -> int:
        """`fit` at a whole request's context (prompt + answer): what the aggregated layout,
        the decode side and the prefill side's start-up check each ask."""
        return self.fit(self.targets.input_tokens + self.targets.output_tokens)

    def fit(self, context: int) -> int:
        """Requests the layout holds at `context` tokens each (0: not one, or not with the
        running requests' KDA states that `emit` sizes beside it: running_fit)."""
        if not running_fit(self.model, self.layout, self.spec, context, self.draft,
                           self.speculation, kda_rollback=self.kda_rollback).fits:
            return 0
        workload = Workload(context_length=context, kda_state_slots=MAMBA_SLOTS_PER_RUNNING_REQUEST)
        report = memory_per_gpu(self.model, self.layout, workload, self.spec, self.draft,
                                self.speculation, self.kda_rollback)
        return min(report.max_concurrent, self.running_cap) if report.fits else 0

    def step(self, running: int) -> tuple[float, float]:
        """(seconds, tokens) of one decode step at `running` requests, at the context a step
        sees on average (the prompt and half the answer)."""
        t = self.targets
        step = decode_rate(self.model, self.layout, self.spec, running,
                           t.input_tokens + t.output_tokens // 2, self.draft, self.speculation,
                           self.constants).step
        return step.step_s, step.tokens_per_step

    def prefill_s(self, prompts: int) -> float:
        return prefill_seconds(self.model, self.layout, self.spec, self.targets.input_tokens,
                               prompts, self.constants)

    def aggregated(self, ttft_max: float, itl_max: float) -> _Side | None:
        """The closed loop of c requests whose prefills stall the decodes: the largest c whose
        mean gap meets `itl_max`."""
        osl = self.targets.output_tokens

        def cycle(c: int) -> float:  # one generation of c requests: decodes + their prefills
            step_s, per_step = self.step(c)
            return osl / (per_step / c) * step_s + self.prefill_s(c)

        c = _largest(self.full_context_fit,
                     lambda c: cycle(c) / osl <= itl_max)
        if c is None:
            return None
        chunks = math.ceil(self.targets.input_tokens / CHUNK_TOKENS)
        ttft = self.prefill_s(1) + chunks * self.step(c)[0]
        if ttft > ttft_max:
            return None
        return _Side(self.layout, c, ttft, c / cycle(c), itl_s=cycle(c) / osl)

    def decode_side(self, itl_max: float) -> _Side | None:
        """Decoding only: the largest concurrency whose gap between tokens meets `itl_max`."""
        def itl(c: int) -> float:
            step_s, per_step = self.step(c)
            return step_s * c / per_step

        c = _largest(self.full_context_fit,
                     lambda c: itl(c) <= itl_max)
        if c is None:
            return None
        return _Side(self.layout, c, itl(c), c / itl(c) / self.targets.output_tokens)

    def prefill_side(self, ttft_max: float) -> _Side | None:
        """Prefilling only: the largest batch of prompts whose prefill meets `ttft_max` (the
        transfer is added by the caller). A prefill server holds prompts only, but it runs at
        the deployment's context length, and the app's start-up checks (as `emit`) want one
        request of it to fit: a layout is offered only where it does."""
        if not self.full_context_fit:
            return None
        room = self.fit(self.targets.input_tokens)
        for b in reversed([b for b in PREFILL_BATCHES if b <= room]):
            seconds = self.prefill_s(b)
            if seconds <= ttft_max:
                return _Side(self.layout, b, seconds, b / seconds)
        return None


def compare(
    model: ModelDescriptor,
    gpus: dict[str, GpuSpec],
    prices: Iterable[PriceRow],
    targets: Targets,
    draft: ModelDescriptor | None = None,
    *,
    allowed_gpus: Sequence[str] | None = None,
    weight_formats: Sequence[WeightFormat | None] = (None,),
    kv_dtypes: Sequence[KvDtype] = (KvDtype.BF16,),
    max_nodes: int = DEFAULT_MAX_NODES,
    speculation: Speculation | None = None,
    constants: TimeConstants = DEFAULT_CONSTANTS,
    kda_rollback: str = DEFAULT_KDA_ROLLBACK,
) -> list[ModeRow]:
    """Every GPU type's best aggregated fleet per layout and its best disaggregated fleet per
    (prefill, decode) pair that meet the targets, cheapest per million output tokens first
    (unpriced rows last, by requests per GPU). Only what SGLang 0.5.23 runs is priced, as
    `plan` does (capacity/sglang_k3_paths.py): GPUs without a K3 path are left out, and the
    native checkpoint is sized as BF16 where SGLang upcasts its experts."""
    isl, osl = targets.input_tokens, targets.output_tokens
    if isl <= 0 or osl <= 0:
        raise CapacityError(f"input and output tokens must be positive, got {isl} and {osl}")
    for name, value in (("TTFT", targets.ttft_s), ("ITL", targets.itl_s)):
        if value is not None and not value > 0:
            raise CapacityError(f"the {name} target must be positive, got {value}")
    check_context(model, isl + osl)
    if draft is not None and speculation is None:
        speculation = Speculation.for_draft(draft)
    ttft_max = targets.ttft_s if targets.ttft_s is not None else math.inf
    itl_max = targets.itl_s if targets.itl_s is not None else math.inf
    best_price = cheapest_prices(prices)
    running_cap = max_running_requests(draft)
    rows: list[ModeRow] = []
    for spec in (gpu_spec(gpus, n) for n in (allowed_gpus or list(gpus))):
        price = best_price.get(spec.gpu.upper())
        prefills: list[_Side] = []
        decodes: list[_Side] = []
        # Decode context parallel layouts too (capacity/levers.py); the radix-cache strategy
        # stays extra_buffer: SGLang refuses extra_buffer_lazy under PD disaggregation
        # (arg_groups/mamba_hook.py:123-128), and the aggregated rows are sized alike.
        try:
            path = runnable_path(model, spec.gpu)
        except NotServable:
            continue  # SGLang 0.5.23 cannot run K3 here (capacity/sglang_k3_paths.py)
        # Priced as SGLang holds the weights (BF16 experts where it upcasts the MXFP4 ones).
        formats = held_formats(model, weight_formats, path)
        for layout in _candidate_layouts(model, spec, max_nodes, formats,
                                         tuple(kv_dtypes), None, True):
            one = _Layout(model, draft, speculation, constants, kda_rollback, spec, layout,
                          targets, running_cap)
            # DSpark: pipeline stages only where SGLang allows them, on a PD prefill server.
            pp_ok = pipeline_problem(layout.pp, draft is not None) is None
            agg = one.aggregated(ttft_max, itl_max) if pp_ok else None
            if agg is not None:
                rows.append(ModeRow("agg", layout, layout, 0, 1, 1, agg.batch, agg.seconds,
                                    agg.itl_s, agg.requests_s, 0, 0.0, price, osl))
            decode = one.decode_side(itl_max) if pp_ok else None
            if decode is not None:
                decodes.append(decode)
            # A prefill server gains nothing from DCP (SGLang warns it only adds communication:
            # arg_groups/pd_disaggregation_hook.py:57-62): prefill sides run dcp 1.
            prefill = one.prefill_side(ttft_max) if layout.dcp == 1 else None
            if prefill is not None:
                prefills.append(prefill)
        moved = {kv: handoff_bytes(model, draft, isl, kv) for kv in kv_dtypes}
        nic = spec.scale_out_gbps * 1e9 / 8
        for p in prefills:
            transfer = moved[p.layout.kv_dtype] / nic
            if p.seconds + transfer > ttft_max:
                continue
            for d in decodes:
                if d.layout.kv_dtype != p.layout.kv_dtype:
                    continue  # the latents move as they are stored
                if d.layout.weight_format != p.layout.weight_format:
                    continue  # one checkpoint: the decode side continues the prefill's model
                if p.layout.dcp not in (1, d.layout.dcp):
                    # SGLang runs DCP on a PD prefill server only with the decode side's DCP
                    # layout (arg_groups/pd_disaggregation_hook.py:57-62).
                    continue
                mix = _mix(p, d)
                if mix is None:
                    continue
                n_p, n_d, served = mix
                rows.append(ModeRow("disagg", p.layout, d.layout, n_p, n_d, p.batch, d.batch,
                                    p.seconds + transfer, d.seconds, served,
                                    moved[p.layout.kv_dtype], transfer, price, osl))

    def rank(row: ModeRow) -> tuple[float, float]:
        cost = row.usd_per_million_tokens
        return (math.inf if cost is None else cost, -row.requests_s / row.gpus)

    rows.sort(key=rank)
    return rows


def _mix(p: _Side, d: _Side) -> tuple[int, int, float] | None:
    """The smallest fleet of prefill and decode replicas (at most MAX_REPLICAS each) within
    MIX_SLACK of the best requests per GPU any mix reaches (a fleet's rate is its slower
    side's); None when one side would need more than MAX_REPLICAS per replica of the other."""
    mixes = []
    for n_d in range(1, MAX_REPLICAS + 1):
        for n_p in {math.ceil(n_d * d.requests_s / p.requests_s),
                    math.floor(n_d * d.requests_s / p.requests_s)}:
            if 1 <= n_p <= MAX_REPLICAS:
                served = min(n_p * p.requests_s, n_d * d.requests_s)
                gpus = n_p * p.layout.total_gpus + n_d * d.layout.total_gpus
                mixes.append((served / gpus, gpus, n_p, n_d, served))
    if not mixes:
        return None
    best = max(m[0] for m in mixes)
    _, _, n_p, n_d, served = min((m for m in mixes if m[0] >= (1 - MIX_SLACK) * best),
                                 key=lambda m: m[1])
    return n_p, n_d, served
