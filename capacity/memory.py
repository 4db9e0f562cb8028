"""Memory per GPU for one layout: weights, caches per request, workspace and reserve.

Conventions (each one is what SGLang does for K3, per kimi-k3-serving.md):
- The engine's static pool is `mem_fraction` of the GPU; weights and every KV/state pool must
  fit in it. Activations, CUDA graphs and NCCL live in the rest, which must cover the workspace
  and runtime reserve estimated below.
- Attention (MLA, KDA) weights are split by attention TP and replicated across attention-DP
  ranks. Dense MLP, shared experts, latent projections, embeddings and lm_head are split over
  the whole stage. Routed experts are split by EP (and MoE TP inside an EP group).
- MLA latent KV is replicated on every attention-TP rank and split across attention-DP ranks by
  request. KDA recurrent state is split by head across attention TP; constant in context.
- The draft is colocated on the target's GPUs (last pipeline stage), split by attention TP,
  with its GQA KV split by KV head and replicated once TP exceeds the KV heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache, lru_cache
from math import ceil
from types import MappingProxyType

from capacity.config import Layout, Speculation, Workload
from capacity.errors import CapacityError
from capacity.formats import KV_DTYPE_BYTES, WeightFormat
from capacity.model import COMPONENT_SHARDING, Component, ModelDescriptor, Sharding
from capacity.tables import GIB, GpuSpec

# NVIDIA aiconfigurator's runtime overhead per GPU: about 3.5 GiB "other" + 0.34-0.39 GB NCCL
# (hardware-and-prices.md, "Memory conventions"). The upper NCCL figure is used.
RUNTIME_OTHER_BYTES = int(3.5 * GIB)
NCCL_BYTES = 390_000_000
# Activation workspace: an estimate, not a measurement. One prefill chunk (SGLang's
# chunked_prefill_size, 8192 on large GPUs) holds about 16 hidden-wide BF16 buffers per token
# live at once (residual, norms, attention in/out, MoE dispatch/combine for top-k), plus FP32
# logits for every decode row of the verify window.
ACTIVATION_HIDDEN_BUFFERS = 16
ACTIVATION_BYTES = 2
LOGIT_BYTES = 4
# FlashMLA's KV block is 64 tokens, so a request's cache is rounded up to whole pages.
KV_PAGE_TOKENS = 64
# Engines cap running requests; SGLang forces 48 with DSPARK unless set, and the logits buffer
# is sized for the cap (kimi-k3-serving.md).
DSPARK_MAX_RUNNING_REQUESTS = 48
DEFAULT_MAX_RUNNING_REQUESTS = 1024


@dataclass(frozen=True)
class StageMemory:
    """Bytes per GPU on one pipeline stage (the busiest GPU of the stage)."""

    stage: int
    first_layer: int
    last_layer: int
    weights: Mapping[str, int]
    budget: int
    per_request: Mapping[str, int]
    outside_pool: dict[str, int]
    weight_bytes: int
    request_bytes: int

    @property
    def free_for_requests(self) -> int:
        return self.budget - self.weight_bytes

    @property
    def max_requests_per_rank(self) -> int:
        free = self.budget - self.weight_bytes
        if free <= 0:
            return 0
        return free // max(1, self.request_bytes)


@dataclass(frozen=True)
class MemoryReport:
    model: str
    draft: str | None
    layout: Layout
    gpu: GpuSpec
    context_length: int
    capacity_bytes: int
    stages: tuple[StageMemory, ...]
    max_concurrent: int
    reasons: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def worst_stage(self) -> StageMemory:
        return min(self.stages, key=lambda s: (s.max_requests_per_rank, -s.weight_bytes))


@cache
def _stage_bounds(n_layers: int, stages: int) -> tuple[tuple[int, int], ...]:
    return tuple((s * n_layers // stages, (s + 1) * n_layers // stages) for s in range(stages))


@cache
def _stage_component_bytes(
    model: ModelDescriptor, fmt_key: str | None, stages: int
) -> tuple[dict[Component, int], ...]:
    """Total (unsharded) bytes per component on each pipeline stage; cached per format."""
    fmt = model.native_format if fmt_key is None else WeightFormat(fmt_key)
    out: list[dict[Component, int]] = []
    bounds = _stage_bounds(len(model.layers), stages)
    for index, (start, end) in enumerate(bounds):
        totals: dict[Component, int] = {}
        for kind in model.layers[start:end]:
            for comp, size in model.layer_component_bytes(kind, fmt).items():
                totals[comp] = totals.get(comp, 0) + size
        for comp, size in model.global_component_bytes(fmt).items():
            on_first = comp is Component.EMBEDDINGS
            if (on_first and index == 0) or (not on_first and index == stages - 1):
                totals[comp] = totals.get(comp, 0) + size
        out.append(totals)
    return tuple(out)


@cache
def _stage_attention_layers(model: ModelDescriptor, stages: int) -> tuple[tuple[int, int], ...]:
    """(MLA layers, KDA layers) on each pipeline stage."""
    out = []
    for start, end in _stage_bounds(len(model.layers), stages):
        kinds = model.layers[start:end]
        out.append((sum(1 for k in kinds if k.attention == "mla"),
                    sum(1 for k in kinds if k.attention == "kda")))
    return tuple(out)


@cache
def _stage_weights(
    model: ModelDescriptor, fmt_key: str | None, stages: int, attention_tp: int,
    expert_parallel: int, moe_tp: int,
) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Weight bytes per GPU by component on each stage; shared by every context length and
    KV dtype of a sweep."""
    stage_gpus = expert_parallel * moe_tp
    out = []
    for totals in _stage_component_bytes(model, fmt_key, stages):
        per_gpu: list[tuple[str, int]] = []
        for comp, size in totals.items():
            sharding = COMPONENT_SHARDING[comp]
            if sharding is Sharding.ATTENTION:
                share = ceil(size / attention_tp)
            elif sharding is Sharding.DENSE:
                share = ceil(size / stage_gpus)
            elif sharding is Sharding.EXPERT:
                assert model.moe is not None
                # An EP rank holds ceil(E / EP) experts: an uneven split costs the busiest rank.
                experts_here = -(-model.moe.experts // expert_parallel)
                share = ceil(size * experts_here / model.moe.experts / moe_tp)
            else:
                share = size
            per_gpu.append((comp.value, share))
        out.append(tuple(per_gpu))
    return tuple(out)


def check_layout(model: ModelDescriptor, layout: Layout) -> None:
    """Raises if the model's heads cannot be split the way the layout asks."""
    if layout.pipeline_stages > len(model.layers):
        raise CapacityError(
            f"layout.pipeline_stages ({layout.pipeline_stages}) exceeds {model.name}'s "
            f"{len(model.layers)} layers"
        )
    for label, heads in (
        ("MLA attention heads", model.mla.heads if model.mla else None),
        ("KDA heads", model.kda.heads if model.kda else None),
    ):
        if heads is not None and heads % layout.attention_tp:
            raise CapacityError(
                f"layout.attention_tp ({layout.attention_tp}) must divide {model.name}'s {heads} "
                f"{label}"
            )


def check_context(model: ModelDescriptor, context_length: int) -> None:
    if context_length <= 0:
        raise CapacityError(f"context length must be positive, got {context_length}")
    if model.max_context and context_length > model.max_context:
        raise CapacityError(
            f"context length {context_length:,} exceeds {model.name}'s maximum "
            f"{model.max_context:,} (max_position_embeddings)"
        )


@lru_cache(maxsize=64)
def _kda_state_per_layer(model: ModelDescriptor) -> int:
    # Sweeps ask for the same model's constants tens of thousands of times.
    return model.kda_state_bytes() // model.kda_layers if model.kda_layers else 0


@lru_cache(maxsize=64)
def _total_bytes(model: ModelDescriptor) -> int:
    return model.total_bytes()


def max_running_requests(draft: ModelDescriptor | None) -> int:
    return DSPARK_MAX_RUNNING_REQUESTS if draft is not None else DEFAULT_MAX_RUNNING_REQUESTS


@dataclass(frozen=True)
class _StageNeeds:
    first_layer: int
    last_layer: int
    weights: Mapping[str, int]
    per_request: Mapping[str, int]
    weight_bytes: int
    request_bytes: int


@lru_cache(maxsize=8192)
def _stage_needs(
    model: ModelDescriptor, draft: ModelDescriptor | None, verify_rows: int | None,
    fmt_key: str | None, pipeline_stages: int, attention_tp: int, expert_parallel: int,
    moe_tp: int, kv_bytes: int, context_length: int, kda_state_slots: int,
) -> tuple[_StageNeeds, ...]:
    """What each stage's GPU holds, independent of which GPU it is: a sweep asks for the same
    shape on every GPU type and memory fraction. `verify_rows` is None without speculation."""
    rows = verify_rows or 1
    cached_tokens = ceil((context_length + rows) / KV_PAGE_TOKENS) * KV_PAGE_TOKENS
    mla_per_layer_token = (
        (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * kv_bytes if model.mla else 0
    )
    kda_per_layer = _kda_state_per_layer(model)
    stage_weights = _stage_weights(
        model, fmt_key, pipeline_stages, attention_tp, expert_parallel, moe_tp
    )
    attention_layers = _stage_attention_layers(model, pipeline_stages)
    out: list[_StageNeeds] = []
    for index, (start, end) in enumerate(_stage_bounds(len(model.layers), pipeline_stages)):
        weights = dict(stage_weights[index])
        mla_here, kda_here = attention_layers[index]
        per_request = {
            "mla_kv": cached_tokens * mla_per_layer_token * mla_here,
            "kda_state": ceil(kda_per_layer * kda_here * kda_state_slots / attention_tp),
        }
        if verify_rows is not None and kda_here:
            # Hybrid linear-attention models keep one state per verified position so a
            # rejected draft can be rolled back (SGLang's intermediate SSM state cache; inferred).
            per_request["kda_verify_states"] = ceil(
                kda_per_layer * kda_here * verify_rows / attention_tp
            )
        if draft is not None and index == pipeline_stages - 1:
            weights["draft"] = ceil(_total_bytes(draft) / attention_tp)
            if draft.gqa is not None:
                per_token = (
                    len(draft.layers) * 2 * draft.gqa_kv_heads_per_rank(attention_tp)
                    * draft.gqa.head_dim * kv_bytes
                )
                per_request["draft_kv"] = cached_tokens * per_token
        out.append(_StageNeeds(
            first_layer=start, last_layer=end - 1,
            # Shared by every report of this shape: read-only.
            weights=MappingProxyType(weights), per_request=MappingProxyType(per_request),
            weight_bytes=sum(weights.values()), request_bytes=sum(per_request.values()),
        ))
    return tuple(out)


def memory_per_gpu(
    model: ModelDescriptor,
    layout: Layout,
    workload: Workload,
    gpu: GpuSpec,
    draft: ModelDescriptor | None = None,
    speculation: Speculation | None = None,
) -> MemoryReport:
    """Per-GPU memory of `layout` serving `model` (and `draft`) at the workload's context,
    with the largest number of concurrent requests that fits."""
    check_context(model, workload.context_length)
    check_layout(model, layout)
    if draft is not None and speculation is None:
        speculation = Speculation.for_draft(draft)
    kv_bytes = KV_DTYPE_BYTES[layout.kv_dtype]
    verify_rows = (speculation.gamma + 1) if speculation else 1
    capacity = gpu.memory_bytes
    budget = int(capacity * layout.mem_fraction)
    activation = (
        workload.prefill_chunk_tokens * model.hidden_size * ACTIVATION_BYTES
        * ACTIVATION_HIDDEN_BUFFERS
        + ceil(max_running_requests(draft) * verify_rows * model.vocab_size * LOGIT_BYTES
               / layout.stage_gpus)
    )
    outside = {"activation_workspace": activation, "runtime_reserve": RUNTIME_OTHER_BYTES + NCCL_BYTES}
    needs = _stage_needs(
        model, draft, verify_rows if speculation else None,
        layout.weight_format.value if layout.weight_format else None, layout.pipeline_stages,
        layout.attention_tp, layout.expert_parallel, layout.moe_tp, kv_bytes,
        workload.context_length, workload.kda_state_slots,
    )
    stages = [
        StageMemory(stage=index, first_layer=n.first_layer, last_layer=n.last_layer,
                    weights=n.weights, budget=budget, per_request=n.per_request,
                    outside_pool=outside, weight_bytes=n.weight_bytes,
                    request_bytes=n.request_bytes)
        for index, n in enumerate(needs)
    ]

    reasons: list[str] = []
    outside_need = sum(outside.values())
    outside_have = capacity - budget
    if outside_need > outside_have:
        reasons.append(
            f"mem_fraction {layout.mem_fraction} leaves {outside_have / 1e9:.1f} GB outside the "
            f"static pool on {gpu.gpu}; activations + runtime need {outside_need / 1e9:.1f} GB"
        )
    heaviest = max(stages, key=lambda s: s.weight_bytes)
    if heaviest.free_for_requests <= 0:
        reasons.append(
            f"weights need {heaviest.weight_bytes / 1e9:.1f} GB per GPU (stage "
            f"{heaviest.stage}) but the static pool is {budget / 1e9:.1f} GB "
            f"({layout.mem_fraction} x {gpu.memory_label} {gpu.gpu})"
        )
    per_rank = min(s.max_requests_per_rank for s in stages)
    if per_rank == 0 and not reasons:
        worst = min(stages, key=lambda s: s.free_for_requests - s.request_bytes)
        mla = worst.per_request.get("mla_kv", 0)
        reasons.append(
            f"one {workload.context_length:,}-token request needs {worst.request_bytes / 1e9:.1f} "
            f"GB per GPU ({mla / 1e9:.1f} GB of MLA KV per attention-TP rank); free memory "
            f"per GPU after weights is {worst.free_for_requests / 1e9:.1f} GB"
        )
    return MemoryReport(
        model=model.name,
        draft=draft.name if draft else None,
        layout=layout,
        gpu=gpu,
        context_length=workload.context_length,
        capacity_bytes=capacity,
        stages=tuple(stages),
        max_concurrent=per_rank * layout.attention_dp if not reasons else 0,
        reasons=tuple(reasons),
    )


# --- what SGLang 0.5.23's pools hold for a deployment -----------------------------------------

# SGLang's hybrid linear-attention pool (mem_cache/kv_cache_configurator.py, 0.5.23): KDA/mamba
# states live in a pool of fixed-size slots beside the MLA KV pool. Each running request takes
# MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = 3 slots, plus get_mamba_tracking_slots() = 2
# ping-pong slots with --mamba-radix-cache-strategy extra_buffer under the overlap scheduler
# (what `auto` resolves to for KimiK3ForConditionalGeneration: _MAMBA_EXTRA_BUFFER_ARCHS).
MAMBA_SLOTS_PER_RUNNING_REQUEST = 3 + 2
# Speculative verify scratch (intermediate_ssm): (running + 1) x speculative_num_draft_tokens
# states; DSPARK's draft tokens are gamma + 1 (speculative_hook: "must equal gamma + 1").
# Each pool also keeps one padding slot.


@dataclass(frozen=True)
class RunningFit:
    """One deployment as SGLang sizes its pools, on the busiest GPU of a replica: the static
    pool left after weights holds the KDA states of every running request (radix-cache slots
    and verify scratch, fixed in size) and the MLA (+ draft) KV of the requests' tokens."""

    context_length: int
    kv_dtype: str
    free_bytes: int  # static pool after weights, per GPU
    full_request_kv_bytes: int  # MLA + draft KV of one full-context request, per GPU
    state_bytes_per_request: int  # KDA states one running request holds, per GPU
    state_padding_bytes: int  # the pools' padding slots, per GPU
    max_running_requests: int  # per replica (0: not even one full-context request fits)
    full_context_requests: int  # full-context requests whose KV fits beside those states
    attention_dp: int

    @property
    def fits(self) -> bool:
        return self.full_context_requests >= 1

    @property
    def one_request_bytes(self) -> int:
        """Per GPU, what one full-context request needs: its KV and its states."""
        return self.full_request_kv_bytes + self.state_bytes_per_request + self.state_padding_bytes

    @property
    def mamba_cache_slots(self) -> int:
        """SGLang's --max-mamba-cache-size for the replica (split by attention DP there)."""
        return self.max_running_requests * MAMBA_SLOTS_PER_RUNNING_REQUEST


def running_fit(
    model: ModelDescriptor,
    layout: Layout,
    gpu: GpuSpec,
    context_length: int,
    draft: ModelDescriptor | None = None,
    speculation: Speculation | None = None,
    running_cap: int | None = None,
    running: int | None = None,
) -> RunningFit:
    """How many requests a deployment may run at once and how many of them may be at full
    context: the most running requests (up to SGLang's cap, `max_running_requests(draft)`) whose
    KDA states still leave the KV of one full-context request, and how many full-context
    requests' KV then fit. `max_running_requests` 0 means one full-context request does not fit
    even alone. With `running` given (a deployment's setting), that many run: how many of them
    may be at full context."""
    if draft is not None and speculation is None:
        speculation = Speculation.for_draft(draft)
    report = memory_per_gpu(model, layout, Workload(context_length=context_length), gpu, draft,
                            speculation)
    draft_tokens = speculation.gamma + 1 if speculation else 0
    cap = running_cap if running_cap is not None else max_running_requests(draft)
    per_rank_cap = max(1, cap // layout.attention_dp)
    ok = True
    shapes: list[tuple[StageMemory, int, int, int]] = []  # (stage, kv, state, padding)
    for stage in report.stages:
        slot = stage.per_request.get("kda_state", 0)  # one state slot (Workload default: 1)
        kv = sum(v for k, v in stage.per_request.items() if k.endswith("_kv"))
        shapes.append((stage, kv, slot * (MAMBA_SLOTS_PER_RUNNING_REQUEST + draft_tokens),
                       slot * (1 + draft_tokens)))
        # Activations and the runtime must fit outside the static pool.
        ok = ok and sum(stage.outside_pool.values()) <= report.capacity_bytes - stage.budget

    def room(stage: StageMemory, state: int, padding: int, requests: int) -> int:
        return stage.free_for_requests - padding - requests * state

    if running is not None:
        per_rank = max(1, running // layout.attention_dp)
    else:
        # The most running requests every stage holds beside one full-context request's KV.
        per_rank = per_rank_cap
        for stage, kv, state, padding in shapes:
            spare = room(stage, 0, padding, 0) - kv
            per_rank = 0 if spare < 0 else min(per_rank, spare // state if state else per_rank)
    if not ok:
        per_rank = 0

    def full_requests(shape: tuple[StageMemory, int, int, int]) -> int:
        stage, kv, state, padding = shape
        if per_rank == 0 or kv == 0:
            return 0
        return max(0, room(stage, state, padding, per_rank) // kv)

    stage, kv, state, padding = worst = min(
        shapes, key=lambda x: (full_requests(x), x[0].free_for_requests - x[1]))
    return RunningFit(
        context_length=context_length, kv_dtype=layout.kv_dtype.value,
        free_bytes=stage.free_for_requests, full_request_kv_bytes=kv,
        state_bytes_per_request=state, state_padding_bytes=padding,
        max_running_requests=per_rank * layout.attention_dp,
        full_context_requests=full_requests(worst) * layout.attention_dp,
        attention_dp=layout.attention_dp,
    )
