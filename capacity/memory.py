"""Memory per GPU for one layout: weights, caches per request, workspace and reserve.

Conventions (each one is what SGLang 0.5.23 does for K3):
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
from capacity.model import (
    COMPONENT_SHARDING,
    CONV_STATE_BYTES,
    KDA_STATE_BYTES,
    Component,
    ModelDescriptor,
    Sharding,
)
from capacity.sglang_k3_paths import held_layout
from capacity.tables import GIB, GpuSpec
from capacity.vision import activation_peak

# NVIDIA aiconfigurator's runtime overhead per GPU: about 3.5 GiB "other" + 0.34-0.39 GB NCCL.
# The upper NCCL figure is used.
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
# is sized for the cap (sglang/srt/arg_groups/speculative_hook.py).
DSPARK_MAX_RUNNING_REQUESTS = 48
DEFAULT_MAX_RUNNING_REQUESTS = 1024
# How a speculative verify rolls the KDA state back (see kda_rollback_costs): SGLang's default
# per-position scratch, or ReplaySSM's ring (--enable-linear-replayssm-spec).
KDA_ROLLBACKS = ("scratch", "replay")
DEFAULT_KDA_ROLLBACK = "scratch"
# --linear-replayssm-cache-len's default (arg_groups/fields/exec_.py:582-585).
DEFAULT_REPLAY_RING_LEN = 16
FP32_BYTES = 4


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
    expert_parallel: int, moe_tp: int, redundant_experts: int = 0,
) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Weight bytes per GPU by component on each stage; shared by every context length and
    KV dtype of a sweep. `redundant_experts` R (EPLB, SGLang's --ep-num-redundant-experts):
    E + R physical experts split evenly over the EP ranks, (E + R) / EP each
    (eplb/expert_location.py:235-257 asserts the split is even), every copy a full expert."""
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
                # An EP rank holds ceil((E + R) / EP) experts: an uneven split costs the
                # busiest rank.
                experts_here = -(-(model.moe.experts + redundant_experts) // expert_parallel)
                share = ceil(size * experts_here / model.moe.experts / moe_tp)
            else:
                share = size
            per_gpu.append((comp.value, share))
        out.append(tuple(per_gpu))
    return tuple(out)


def check_layout(model: ModelDescriptor, layout: Layout) -> None:
    """Raises if the model's heads cannot be split the way the layout asks."""
    if layout.pp > len(model.layers):
        raise CapacityError(
            f"layout.pp ({layout.pp}) exceeds {model.name}'s "
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


def check_context(model: ModelDescriptor, context_length: int, parts: str | None = None
                  ) -> None:
    """`parts` says what the context is made of, when it is more than one number."""
    if context_length <= 0:
        raise CapacityError(f"context length must be positive, got {context_length}")
    if model.max_context and context_length > model.max_context:
        made_of = f" ({parts})" if parts else ""
        raise CapacityError(
            f"context length {context_length:,}{made_of} exceeds {model.name}'s maximum "
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
    kda_rollback: str = DEFAULT_KDA_ROLLBACK, ring_len: int = DEFAULT_REPLAY_RING_LEN,
    dcp: int = 1, redundant_experts: int = 0,
) -> tuple[_StageNeeds, ...]:
    """What each stage's GPU holds, independent of which GPU it is: a sweep asks for the same
    shape on every GPU type and memory fraction. `verify_rows` is None without speculation."""
    rows = verify_rows or 1
    cached_tokens = ceil((context_length + rows) / KV_PAGE_TOKENS) * KV_PAGE_TOKENS
    mla_tokens = dcp_kv_tokens(context_length + rows, dcp)
    mla_per_layer_token = (
        (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * kv_bytes if model.mla else 0
    )
    kda_per_layer = _kda_state_per_layer(model)
    stage_weights = _stage_weights(
        model, fmt_key, pipeline_stages, attention_tp, expert_parallel, moe_tp, redundant_experts
    )
    attention_layers = _stage_attention_layers(model, pipeline_stages)
    out: list[_StageNeeds] = []
    for index, (start, end) in enumerate(_stage_bounds(len(model.layers), pipeline_stages)):
        weights = dict(stage_weights[index])
        mla_here, kda_here = attention_layers[index]
        per_request = {
            # Under DCP each rank holds 1/dcp of the request's tokens (dcp_kv_tokens); the
            # draft's KV below stays whole (SGLang replicates a draft's pool).
            "mla_kv": mla_tokens * mla_per_layer_token * mla_here,
            "kda_state": ceil(kda_per_layer * kda_here * kda_state_slots / attention_tp),
        }
        if verify_rows is not None and kda_here and kda_rollback == "replay":
            # ReplaySSM: the verify keeps only the conv windows per verified position; each
            # of the request's state slots carries a ring of the window's inputs.
            costs = kda_rollback_costs(model, verify_rows, attention_tp, kda_rollback, ring_len,
                                       kda_state_slots, kda_layers=kda_here)
            per_request["kda_verify_conv_windows"] = costs.per_request_conv_bytes
            per_request["kda_replay_ring"] = costs.per_slot_ring_bytes * kda_state_slots
        elif verify_rows is not None and kda_here:
            # Hybrid linear-attention models keep one state per verified position so a
            # rejected draft can be rolled back (SGLang's intermediate_ssm and
            # intermediate_conv_window, see kda_rollback_costs).
            per_request["kda_verify_states"] = ceil(
                kda_per_layer * kda_here * verify_rows / attention_tp
            )
        if model.vision is not None:
            # SGLang builds the tower and projector whole, in BF16, on every rank of every
            # stage (capacity.vision), images or not.
            weights["vision_tower"] = model.vision.tower_bytes
            weights["mm_projector"] = model.vision.projector_bytes
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
    kda_rollback: str = DEFAULT_KDA_ROLLBACK,
    ring_len: int = DEFAULT_REPLAY_RING_LEN,
) -> MemoryReport:
    """Per-GPU memory of `layout` serving `model` (and `draft`) at the workload's context,
    with the largest number of concurrent requests that fits. `kda_rollback` is how the
    speculative verify rolls the KDA state back ("scratch" or "replay" with a ring of
    `ring_len`, see kda_rollback_costs)."""
    check_context(model, workload.context_length)
    check_layout(model, layout)
    if draft is not None and speculation is None:
        speculation = Speculation.for_draft(draft)
    check_kda_rollback(kda_rollback, speculation.gamma + 1 if speculation else 0, ring_len)
    kv_bytes = KV_DTYPE_BYTES[layout.kv_dtype]
    verify_rows = (speculation.gamma + 1) if speculation else 1
    capacity = gpu.memory_bytes
    budget = int(capacity * layout.mem_fraction)
    activation = (
        workload.prefill_chunk_tokens * model.hidden_size * ACTIVATION_BYTES
        * ACTIVATION_HIDDEN_BUFFERS
        + ceil(max_running_requests(draft) * verify_rows * model.vocab_size * LOGIT_BYTES
               / layout.tp)
    )
    outside = {"activation_workspace": activation, "runtime_reserve": RUNTIME_OTHER_BYTES + NCCL_BYTES}
    if model.vision is not None:
        # The tower runs before the text layers of the same step; counted beside their
        # workspace rather than inside it, since the caching allocator keeps both sizes.
        outside["vision_activation"] = activation_peak(model, workload.images,
                                                       layout.attention_tp)[1]
    needs = _stage_needs(
        model, draft, verify_rows if speculation else None,
        layout.weight_format.value if layout.weight_format else None, layout.pp,
        layout.attention_tp, layout.ep, layout.moe_tp, kv_bytes,
        workload.context_length, workload.kda_state_slots, kda_rollback, ring_len,
        layout.dcp, layout.redundant_experts,
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
MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = 3


def mamba_slots_per_request(strategy: str = "extra_buffer") -> int:
    """KDA state slots SGLang 0.5.23 keeps per running request under a radix-cache strategy:
    `_calculate_mamba_ratio` (mem_cache/kv_cache_configurator.py:3062-3092) = 3
    (MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO, :227) + get_mamba_tracking_slots
    (mem_cache/allocation_sizing.py:11-19): 2 ping-pong slots for extra_buffer under the
    overlap scheduler, 1 for extra_buffer_lazy (the second is taken only when needed). So 5
    and 4: lazy runs 5/4 = 1.25x the requests in the same state pool."""
    tracking = {"extra_buffer": 2, "extra_buffer_lazy": 1}
    if strategy not in tracking:
        raise CapacityError(f"mamba radix cache strategy must be one of {', '.join(tracking)}, "
                            f"got {strategy!r}")
    return MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO + tracking[strategy]


def dcp_kv_tokens(tokens: int, dcp: int = 1) -> int:
    """MLA KV rows one rank of a decode-context-parallel group holds for a request of
    `tokens`: SGLang pages the radix tree at page_size x dcp (arg_groups/overrides.py:216-219,
    mem_cache/allocation_sizing.py:24-25) and each rank stores page_size rows of every logical
    page (a pool of N rows per rank holds N x dcp request tokens, kv_cache_configurator.py:
    403-415), so ceil(tokens / (64 x dcp)) x 64 with FlashMLA's 64-token page."""
    return ceil(tokens / (KV_PAGE_TOKENS * dcp)) * KV_PAGE_TOKENS
# Speculative verify scratch (intermediate_ssm): (running + 1) x speculative_num_draft_tokens
# states; DSPARK's draft tokens are gamma + 1 (speculative_hook: "must equal gamma + 1").
# Each pool also keeps one padding slot.


# --- speculative verify on the hybrid: how a rejected draft is rolled back --------------------

# SGLang 0.5.23 keeps the KDA state of the last accepted draft one of two ways:
# - "scratch" (the default): verify writes the full state after every verified position,
#   intermediate_ssm [layers, R + 1, D, h/t, V, K] in the SSM dtype and intermediate_conv_window
#   [layers, R + 1, D, K - 1, 3P/t] in the conv dtype (dense for KDA: the window dedup is off),
#   and commit copies the accepted one back (mem_cache/memory_pool.py:864-965). The configurator
#   reserves mamba_cache_per_req x D x (R + 1) for both (kv_cache_configurator.py:3297-3374).
# - "replay" (--enable-linear-replayssm-spec): no intermediate_ssm (memory_pool.py:880-882);
#   verify logs each step's inputs into a ring of L positions attached to EVERY mamba slot, the
#   pool's padding slot included (memory_pool.py:767-771; kv_cache_configurator.py:3263-3290,
#   3404-3409), and commit replays the accepted prefix into the FP32 state in place. The conv
#   windows stay (conv rollback still reads them), though the configurator does not reserve
#   them under ReplaySSM (reserves_spec_state, kv_cache_configurator.py:3294-3298): the planner
#   counts them anyway, they are allocated.
# R = running requests per attention-DP rank, D = speculative_num_draft_tokens (gamma + 1).


def replay_ring_bytes_per_layer(model: ModelDescriptor, ring_len: int = DEFAULT_REPLAY_RING_LEN,
                                attention_tp: int = 1,
                                conv_bytes: int = CONV_STATE_BYTES) -> int:
    """The ReplaySSM ring of one mamba slot in one KDA layer on one attention-TP rank,
    BaseLinearStateParams.replayssm_ring_bytes_per_req's KDA branch (configs/mamba_utils.py:
    127-157), hv = h_k = heads / tp (K3 has as many key heads as heads), V = K = head_dim:
    raw v and pre-norm raw k (conv dtype), beta and the per-K log-gate g (FP32), and the d and k
    decode rings, kept allocated for KDA (conv dtype, memory_pool.py:784-803)."""
    if model.kda is None:
        return 0
    # kda_layer_ssm_bytes raises unless attention_tp divides the heads.
    heads = model.kda_layer_ssm_bytes(1, attention_tp) // (model.kda.head_dim ** 2)
    dim = model.kda.head_dim
    raw_v = heads * ring_len * dim * conv_bytes
    raw_k = heads * ring_len * dim * conv_bytes
    beta = heads * ring_len * FP32_BYTES
    gate = heads * ring_len * dim * FP32_BYTES
    d_ring = heads * ring_len * dim * conv_bytes
    k_ring = heads * ring_len * dim * conv_bytes
    return raw_v + raw_k + beta + gate + d_ring + k_ring


def check_kda_rollback(strategy: str, draft_tokens: int, ring_len: int) -> None:
    """SGLang's own checks on the strategy: the ring is at least 1 long (arg check,
    arg_groups/attention_hook.py:434-438) and, for KDA, a power of two of at least twice the
    draft tokens (the pool's backstop, memory_pool.py:818-834)."""
    if strategy not in KDA_ROLLBACKS:
        raise CapacityError(f"kda_rollback must be one of {', '.join(KDA_ROLLBACKS)}, got "
                            f"{strategy!r}")
    if draft_tokens < 0:
        raise CapacityError(f"draft tokens must not be negative, got {draft_tokens}")
    if strategy != "replay":
        return
    if draft_tokens < 1:
        raise CapacityError("kda_rollback 'replay' is the speculative verify's rollback: it "
                            "needs a draft (speculation)")
    if ring_len < 1 or ring_len & (ring_len - 1):
        raise CapacityError(f"replay ring length (--linear-replayssm-cache-len) must be a power "
                            f"of two, got {ring_len}")
    if ring_len < 2 * draft_tokens:
        raise CapacityError(f"replay ring length (--linear-replayssm-cache-len) {ring_len} is "
                            f"below 2 x {draft_tokens} draft tokens (SGLang's early-flush margin)")


@dataclass(frozen=True)
class KdaRollbackCosts:
    """Per GPU (one attention-TP rank, `kda_layers` KDA layers): the KDA bytes a running request
    holds under one rollback strategy. `per_request_bytes` is the verify scratch one running
    request's row holds (D full states for scratch, D conv windows for replay);
    `per_slot_ring_bytes` the replay ring of one mamba slot (0 for scratch)."""

    strategy: str
    draft_tokens: int
    attention_tp: int
    ring_len: int
    kda_layers: int
    mamba_slots_per_request: int
    state_slot_bytes: int  # one persistent mamba slot: conv + SSM state of every KDA layer
    per_request_ssm_bytes: int  # intermediate_ssm of one request row (0 for replay)
    per_request_conv_bytes: int  # intermediate_conv_window of one request row
    per_slot_ring_bytes: int

    @property
    def per_request_bytes(self) -> int:
        return self.per_request_ssm_bytes + self.per_request_conv_bytes

    @property
    def rollback_bytes_per_request(self) -> int:
        """What the strategy adds per running request: its verify row and its slots' rings."""
        return self.per_request_bytes + self.mamba_slots_per_request * self.per_slot_ring_bytes

    @property
    def rollback_padding_bytes(self) -> int:
        """The padding row of the verify buffers and the padding slot's ring."""
        return self.per_request_bytes + self.per_slot_ring_bytes

    def rollback_bytes(self, running: int) -> int:
        """The strategy's bytes per GPU with `running` requests on this attention-DP rank,
        padding included (the scratch default at TP8, R = 48: 49 x 449 MB = 22.0 GB)."""
        return running * self.rollback_bytes_per_request + self.rollback_padding_bytes

    @property
    def state_bytes_per_request(self) -> int:
        """Every KDA byte one running request holds: its mamba slots (with their rings) and its
        verify row."""
        return self.mamba_slots_per_request * self.state_slot_bytes + self.rollback_bytes_per_request

    @property
    def state_padding_bytes(self) -> int:
        """The pools' padding: one mamba slot (with its ring) and one verify row."""
        return self.state_slot_bytes + self.rollback_padding_bytes

    def state_bytes(self, running: int) -> int:
        """All KDA bytes per GPU (persistent slots, rollback, padding) for `running` requests."""
        return running * self.state_bytes_per_request + self.state_padding_bytes


def kda_rollback_costs(
    model: ModelDescriptor,
    draft_tokens: int,
    attention_tp: int = 1,
    strategy: str = DEFAULT_KDA_ROLLBACK,
    ring_len: int = DEFAULT_REPLAY_RING_LEN,
    mamba_slots_per_request: int = MAMBA_SLOTS_PER_RUNNING_REQUEST,
    *,
    kda_layers: int | None = None,
    conv_bytes: int = CONV_STATE_BYTES,
    ssm_bytes: int = KDA_STATE_BYTES,
) -> KdaRollbackCosts:
    """The KDA state and verify scratch of one running request per GPU under a rollback
    strategy ("scratch" or "replay", see KDA_ROLLBACKS), from SGLang 0.5.23's own formulas.
    `draft_tokens` is speculative_num_draft_tokens (gamma + 1; 0 without speculation),
    `kda_layers` the KDA layers on the GPU's pipeline stage (default: all of them). Raises
    CapacityError on a strategy SGLang refuses (see check_kda_rollback) or heads TP does not
    divide."""
    check_kda_rollback(strategy, draft_tokens, ring_len)
    layers = model.kda_layers if kda_layers is None else kda_layers
    conv = model.kda_layer_conv_bytes(conv_bytes, attention_tp)
    ssm = model.kda_layer_ssm_bytes(ssm_bytes, attention_tp)
    replay = strategy == "replay"
    return KdaRollbackCosts(
        strategy=strategy, draft_tokens=draft_tokens, attention_tp=attention_tp,
        ring_len=ring_len, kda_layers=layers, mamba_slots_per_request=mamba_slots_per_request,
        state_slot_bytes=(conv + ssm) * layers,
        per_request_ssm_bytes=0 if replay else draft_tokens * ssm * layers,
        per_request_conv_bytes=draft_tokens * conv * layers,
        per_slot_ring_bytes=(replay_ring_bytes_per_layer(model, ring_len, attention_tp, conv_bytes)
                             * layers if replay else 0),
    )


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
    kda_rollback: str = DEFAULT_KDA_ROLLBACK
    rollback: KdaRollbackCosts | None = None  # the busiest stage's KDA costs
    mamba_slots: int = MAMBA_SLOTS_PER_RUNNING_REQUEST  # per running request (the strategy's)

    @property
    def running_per_rank(self) -> int:
        return self.max_running_requests // self.attention_dp

    @property
    def state_bytes(self) -> int:
        """Per GPU, the KDA states (slots, verify scratch or replay rings, padding) of the
        running requests."""
        return self.running_per_rank * self.state_bytes_per_request + self.state_padding_bytes

    @property
    def kv_room_bytes(self) -> int:
        """Per GPU, what the static pool leaves for MLA (+ draft) KV beside those states."""
        return self.free_bytes - self.state_bytes

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
        return self.max_running_requests * self.mamba_slots


def running_fit(
    model: ModelDescriptor,
    layout: Layout,
    gpu: GpuSpec,
    context_length: int,
    draft: ModelDescriptor | None = None,
    speculation: Speculation | None = None,
    running_cap: int | None = None,
    running: int | None = None,
    kda_rollback: str = DEFAULT_KDA_ROLLBACK,
    ring_len: int = DEFAULT_REPLAY_RING_LEN,
) -> RunningFit:
    """How many requests a deployment may run at once and how many of them may be at full
    context: the most running requests (up to SGLang's cap, `max_running_requests(draft)`) whose
    KDA states still leave the KV of one full-context request, and how many full-context
    requests' KV then fit. `max_running_requests` 0 means one full-context request does not fit
    even alone. With `running` given (a deployment's setting), that many run: how many of them
    may be at full context. `kda_rollback` ("scratch", SGLang's default, or "replay" with a
    ring of `ring_len`) is how the verify rolls KDA states back (kda_rollback_costs).
    A deployment's pools are what SGLang 0.5.23 leaves beside the weights it holds: K3's
    native layout is sized with BF16 experts where SGLang upcasts the MXFP4 ones at load
    (capacity/sglang_k3_paths.py), as `plan` and `emit` size it and the app's start-up check
    verifies it."""
    if draft is not None and speculation is None:
        speculation = Speculation.for_draft(draft)
    layout = held_layout(model, layout)
    slots = mamba_slots_per_request(layout.mamba_strategy)
    report = memory_per_gpu(model, layout, Workload(context_length=context_length), gpu, draft,
                            speculation, kda_rollback, ring_len)
    draft_tokens = speculation.gamma + 1 if speculation else 0
    cap = running_cap if running_cap is not None else max_running_requests(draft)
    per_rank_cap = max(1, cap // layout.attention_dp)
    ok = True
    shapes: list[tuple[StageMemory, int, int, int]] = []  # (stage, kv, state, padding)
    costs: dict[int, KdaRollbackCosts] = {}
    attention_layers = _stage_attention_layers(model, layout.pp)
    for stage in report.stages:
        kv = sum(v for k, v in stage.per_request.items() if k.endswith("_kv"))
        # One state slot per mamba slot (the Workload default: 1), a verify row per request.
        cost = costs[stage.stage] = kda_rollback_costs(
            model, draft_tokens, layout.attention_tp, kda_rollback, ring_len, slots,
            kda_layers=attention_layers[stage.stage][1])
        shapes.append((stage, kv, cost.state_bytes_per_request, cost.state_padding_bytes))
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
        attention_dp=layout.attention_dp, kda_rollback=kda_rollback,
        rollback=costs[stage.stage] if model.kda_layers else None, mamba_slots=slots,
    )


# --- HiCache: the host tier ------------------------------------------------------------------

# SGLang 0.5.23's HiCache host sizing (mem_cache/pool_host/base.py, hicache_auto_size.py,
# arg_groups/hicache_hook.py): a rank may use (host RAM - 10 GiB reserve) / ranks on the host
# (base.py:28, 84-108) x --hicache-host-memory-fraction (default 0.8); the default ratio 2.0
# (hicache_hook.py:119-122) is cut to budget x (1 - 0.05 slack) / device pool bytes when it
# does not fit (hicache_auto_size.py:33, 94-97). Every device pool (MLA KV and the KDA/mamba
# state pool) gets a host pool of ratio x its own size (hybrid_pool_assembler.py:1319-1356).
HICACHE_RESERVE_BYTES = 10 * 1024**3
HICACHE_HOST_MEMORY_FRACTION = 0.8
HICACHE_DEFAULT_RATIO = 2.0
HICACHE_SLACK = 0.05


@dataclass(frozen=True)
class HostTier:
    """The HiCache host tier of one deployment, per GPU (rank) and per node."""

    ratio: float
    device_pool_bytes: int  # per rank: the KV + KDA state pools the host tier mirrors
    budget_bytes: int  # per rank: what SGLang lets one rank's host pools take

    @property
    def host_bytes_per_rank(self) -> int:
        return int(self.ratio * self.device_pool_bytes)

    @property
    def fits(self) -> bool:
        return self.host_bytes_per_rank <= self.budget_bytes


def hicache_budget_per_rank(gpu: GpuSpec, ranks_per_node: int,
                            fraction: float = HICACHE_HOST_MEMORY_FRACTION) -> int | None:
    """Host bytes one rank's HiCache pools may take on a node of `gpu` (None: the node's host
    RAM is not in the GPU table)."""
    if gpu.host_ram_bytes is None:
        return None
    return int(max(0, gpu.host_ram_bytes - HICACHE_RESERVE_BYTES) // ranks_per_node * fraction)


def hicache_ratio(gpu: GpuSpec, ranks_per_node: int, device_pool_bytes: int,
                  requested: float = HICACHE_DEFAULT_RATIO) -> float:
    """The host/device ratio SGLang's auto-sizing settles on: the requested ratio (default
    2.0), cut to what the host budget holds with 5% slack; 0.0 when the host RAM is unknown
    or holds nothing. Rounded down to 2 decimals (the value emit writes as --hicache-ratio)."""
    budget = hicache_budget_per_rank(gpu, ranks_per_node)
    if budget is None or device_pool_bytes <= 0:
        return 0.0
    ratio = min(requested, budget * (1 - HICACHE_SLACK) / device_pool_bytes)
    return max(0.0, int(ratio * 100) / 100)


def hicache_host(layout: Layout, gpu: GpuSpec, device_pool_bytes: int) -> HostTier | None:
    """The host tier `layout` asks for (None: HiCache off or the host RAM unknown)."""
    budget = hicache_budget_per_rank(gpu, layout.gpus_per_node)
    if not layout.hicache_ratio or budget is None:
        return None
    return HostTier(layout.hicache_ratio, device_pool_bytes, budget)
