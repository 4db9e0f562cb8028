"""Roofline time model: decode steps, speculative verify + draft, and prefill.

Shape (the standard roofline):
  step = max(bytes / (HBM x hbm_efficiency), FLOPs / (peak x compute_efficiency))
         + per-layer fixed latency (launch + collective hops) + communication time.
Bytes per GPU: non-expert weights of the stage / their split + distinct experts touched x expert
bytes / EP + MLA KV read + KDA state read and write. Distinct experts touched by T tokens in a
layer: E x (1 - (1 - k/E)^T). Speculation verifies B x (gamma + 1) tokens in one pass, so expert
reads grow with the tokens verified while dense reads are shared; a step commits B x acceptance
tokens. The constants are fitted to published measurements (capacity.calibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from capacity.acceptance import adaptive_acceptance, verify_width
from capacity.config import Images, Layout, Speculation
from capacity.dspark_verify import static_verify_reason
from capacity.formats import FOUR_BIT_FORMATS, WeightFormat
from capacity.memory import _stage_bounds, _stage_component_bytes
from capacity.model import COMPONENT_SHARDING, Component, ModelDescriptor, Sharding
from capacity.tables import GpuSpec
from capacity.vision import images_per_rank, request_images

BF16_BYTES = 2
# DeepEP dispatches tokens in FP8 (1 byte/element) and combines in BF16 (2 bytes/element).
EP_BYTES_PER_ELEMENT = 3


@dataclass(frozen=True)
class TimeConstants:
    """Fitted by `kimi-capacity calibrate --fit` against the K3 anchors in capacity.calibration
    (published K3 measurements on GB300, B300, GB200, MI355X and MI325X; the K2 H200 anchors
    are a cross-check, not fitted). Ranges in the comments are the search bounds, chosen from
    what the hardware can physically reach."""

    hbm_efficiency: float = 0.8375  # share of HBM peak when streaming weights / KV [0.5, 0.95]
    compute_efficiency: float = 0.725  # decode GEMM share of dense peak [0.2, 0.8]
    prefill_compute_efficiency: float = 0.294  # large prefill GEMMs [0.2, 0.8]
    layer_overhead_us: float = 5.0  # launches, norms, routing per layer, batch 1 [5, 120]
    collective_hop_us: float = 9.72  # per collective per log2(ranks) inside scale-up [0.5, 30]
    internode_collective_us: float = 0.0  # extra per collective crossing nodes [0, 100]
    comm_efficiency: float = 0.381  # share of link bandwidth reached by collectives [0.3, 0.95]
    draft_fixed_us: float = 94.0  # DSpark forward + sequential Markov loop overhead [0, 3000]
    # Consecutive positions of one sequence share experts more than independent tokens do; a
    # verify window of w rows routes like 1 + (w - 1) x this many independent tokens [0.2, 1].
    verify_token_independence: float = 0.2
    # The ROCm stacks that serve K3 (SGLang/AITER on gfx950, vLLM on gfx942) are fitted apart
    # from CUDA's: their per-layer launch + un-fused kernel latency [5, 300] and the share of
    # the CUDA GEMM efficiencies their kernels reach [0.1, 1] (capacity.calibration's AMD
    # anchors; until those exist for a GPU, its rows are roofline extrapolations).
    rocm_layer_overhead_us: float = 134.0
    rocm_efficiency: float = 0.634


DEFAULT_CONSTANTS = TimeConstants()


def _is_rocm(gpu: GpuSpec) -> bool:
    return gpu.vendor.upper() == "AMD"


def layer_overhead_s(gpu: GpuSpec, c: TimeConstants) -> float:
    """Fixed latency per layer (launches, norms, routing) on this GPU's software stack."""
    return (c.rocm_layer_overhead_us if _is_rocm(gpu) else c.layer_overhead_us) * 1e-6


def efficiency(gpu: GpuSpec, c: TimeConstants, base: float) -> float:
    """A fitted GEMM efficiency, scaled for the ROCm stacks."""
    return base * (c.rocm_efficiency if _is_rocm(gpu) else 1.0)


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds of one decode step (per pipeline stage summed over stages) and its parts."""

    memory_s: float
    compute_s: float
    fixed_s: float
    communication_s: float
    draft_s: float
    tokens_per_step: float
    bytes_per_gpu: float
    flops_per_gpu: float

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.fixed_s + self.communication_s + self.draft_s


@dataclass(frozen=True)
class DecodeRate:
    concurrency: int
    step: StepBreakdown
    per_user_tokens_s: float
    total_tokens_s: float


@dataclass(frozen=True)
class _StageParams:
    attention: int  # params split by attention TP
    dense: int  # params split over the stage
    expert_active_per_token: int  # top-k experts' params across the stage's MoE layers
    lm_head: int
    mla_layers: int
    kda_layers: int
    moe_layers: int
    layers: int


@cache
def _stage_sharded_bytes(
    model: ModelDescriptor, fmt_key: str | None, stages: int
) -> tuple[tuple[int, int, int, int], ...]:
    """(attention, dense, replicated, routed-expert) bytes per stage; the embedding table is
    left out because a decode step gathers only a few of its rows."""
    out = []
    for stage in _stage_component_bytes(model, fmt_key, stages):
        parts = {s: 0 for s in Sharding}
        for comp, size in stage.items():
            if comp is not Component.EMBEDDINGS:
                parts[COMPONENT_SHARDING[comp]] += size
        out.append((parts[Sharding.ATTENTION], parts[Sharding.DENSE],
                    parts[Sharding.REPLICATED], parts[Sharding.EXPERT]))
    return tuple(out)


@cache
def _stage_params(model: ModelDescriptor, stages: int) -> tuple[_StageParams, ...]:
    out = []
    k_over_e = model.moe.top_k / model.moe.experts if model.moe else 0.0
    for index, (start, end) in enumerate(_stage_bounds(len(model.layers), stages)):
        attention = dense = expert = 0
        for kind in model.layers[start:end]:
            for group in model.layer_groups[kind]:
                sharding = COMPONENT_SHARDING[group.component]
                if sharding is Sharding.ATTENTION:
                    attention += group.params
                elif sharding is Sharding.EXPERT:
                    expert += group.params
                elif group.cols > 1:
                    dense += group.params
        kinds = model.layers[start:end]
        lm_head = 0
        if index == stages - 1:
            lm_head = sum(g.params for g in model.global_groups if g.component is Component.LM_HEAD)
        out.append(
            _StageParams(
                attention=attention,
                dense=dense,
                expert_active_per_token=int(expert * k_over_e),
                lm_head=lm_head,
                mla_layers=sum(1 for k in kinds if k.attention == "mla"),
                kda_layers=sum(1 for k in kinds if k.attention == "kda"),
                moe_layers=sum(1 for k in kinds if k.ffn == "moe"),
                layers=len(kinds),
            )
        )
    return tuple(out)


def _expert_peak_tflops(gpu: GpuSpec, fmt: WeightFormat) -> float:
    """Expert GEMM peak at the precision the MoE kernels multiply in. MXFP4 experts run W4A8 on
    GPUs with native FP4 (SGLang 0.5.23's K3 runners quantize activations to MXFP8/FP8: the
    trtllm-gen SiTU runner on SM100, DeepGEMM fp8 x fp4, AITER A8W4 on gfx950), so they run at
    the FP8 peak; only NVFP4 runs W4A4 at the FP4 peak. Hopper and MI300X/MI325X multiply 4-bit
    weights in 16 bits (W4A16)."""
    if fmt is WeightFormat.NVFP4 and gpu.native_fp4 and gpu.fp4_tflops:
        return gpu.fp4_tflops
    if fmt in FOUR_BIT_FORMATS and gpu.native_fp4 and gpu.fp8_tflops:
        return gpu.fp8_tflops
    if fmt is WeightFormat.FP8 and gpu.fp8_tflops:
        return gpu.fp8_tflops
    return gpu.bf16_tflops


def _distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _group_comm_s(
    bytes_per_gpu: float, group: int, reach: int, gpu: GpuSpec, c: TimeConstants
) -> float:
    if group <= 1 or bytes_per_gpu <= 0:
        return 0.0
    domain = min(group, reach)
    remote = max(0.0, 1.0 - domain / group)
    up = bytes_per_gpu * (1 - remote) / (gpu.scale_up_gbps * 1e9 * c.comm_efficiency)
    out = bytes_per_gpu * remote / (gpu.scale_out_gbps * 1e9 * c.comm_efficiency)
    return max(up, out)


def _ep_comm_s(
    tokens_per_gpu: float, top_k: int, hidden: int, layout: Layout, reach_all: int,
    gpu: GpuSpec, c: TimeConstants,
) -> float:
    """DeepEP-style dispatch + combine: a token crosses the network once per distinct remote
    scale-up domain among its top-k experts, then fans out over scale-up links."""
    g = layout.tp
    if g <= 1 or tokens_per_gpu <= 0:
        return 0.0
    reach = min(g, reach_all)
    domains = max(1, g // reach)
    per_copy = hidden * EP_BYTES_PER_ELEMENT
    local_copies = top_k * (reach - 1) / g
    up = tokens_per_gpu * local_copies * per_copy / (gpu.scale_up_gbps * 1e9 * c.comm_efficiency)
    if domains == 1:
        return up
    distinct = domains * (1 - (1 - 1 / domains) ** top_k)
    remote_copies = distinct * (domains - 1) / domains
    out = tokens_per_gpu * remote_copies * per_copy / (
        gpu.scale_out_gbps * 1e9 * c.comm_efficiency
    )
    return max(up, out)


def _scale_up_reach(layout: Layout, gpu: GpuSpec) -> int:
    """GPUs a rank reaches over scale-up links: the node, or the rack on NVL72 parts."""
    return max(layout.gpus_per_node, min(gpu.scale_up_domain, layout.total_gpus))


def _collective_latency_s(group: int, reach: int, c: TimeConstants) -> float:
    if group <= 1:
        return 0.0
    latency = c.collective_hop_us * math.log2(group)
    if group > reach:
        latency += c.internode_collective_us
    return latency * 1e-6


def _forward_s(
    model: ModelDescriptor,
    layout: Layout,
    gpu: GpuSpec,
    tokens_total: float,
    requests: float,
    context: int,
    c: TimeConstants,
    compute_efficiency: float,
    weight_passes: float = 1.0,
    busy_dp: int | None = None,
    expert_tokens: float | None = None,
) -> tuple[float, float, float, float, float, float]:
    """One forward pass over `tokens_total` tokens belonging to `requests` requests, each
    attending to `context` cached tokens. Returns (memory_s, compute_s, fixed_s, comm_s,
    bytes_per_gpu, flops_per_gpu) summed over pipeline stages."""
    fmt = layout.weight_format or model.native_format
    fmt_key = layout.weight_format.value if layout.weight_format else None
    stage_bytes = _stage_sharded_bytes(model, fmt_key, layout.pp)
    stage_params = _stage_params(model, layout.pp)
    dp = layout.attention_dp
    tp = layout.attention_tp
    g = layout.tp
    # Attention work lands on the DP ranks that hold requests; idle ranks do not help.
    tokens_dp = tokens_total / (busy_dp or dp)
    requests_dp = requests / dp
    bw = gpu.hbm_tbps * 1e12 * c.hbm_efficiency
    compute_efficiency = efficiency(gpu, c, compute_efficiency)
    bf16_peak = gpu.bf16_tflops * 1e12 * compute_efficiency
    expert_peak = _expert_peak_tflops(gpu, fmt) * 1e12 * compute_efficiency
    hidden = model.hidden_size
    kv_token_layer = (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) if model.mla else 0
    kv_bytes = 1 if layout.kv_dtype.value == "fp8" else 2
    kda_state_layer = model.kda_state_bytes() / model.kda_layers if model.kda_layers else 0.0

    reach = _scale_up_reach(layout, gpu)
    collectives = _collective_latency_s(tp, reach, c) + _collective_latency_s(g, reach, c)
    memory_s = compute_s = fixed_s = comm_s = 0.0
    bytes_total = flops_total = 0.0
    for (attention_b, dense_b, replicated_b, expert_b), params in zip(
        stage_bytes, stage_params, strict=True
    ):
        weight_bytes = attention_b / tp + dense_b / g + replicated_b
        expert_bytes = 0.0
        if model.moe and params.moe_layers:
            routed = tokens_total if expert_tokens is None else expert_tokens
            distinct = _distinct_experts(model.moe.experts, model.moe.top_k, routed)
            expert_bytes = expert_b * distinct / model.moe.experts / g
        # Decode context parallelism: each rank reads (and attends over) its 1/dcp of the KV.
        kv_read = (requests_dp * context * kv_token_layer * kv_bytes * params.mla_layers
                   / layout.dcp)
        kda_rw = 2 * requests_dp * kda_state_layer * params.kda_layers / tp
        moved = (weight_bytes + expert_bytes) * weight_passes + kv_read + kda_rw

        linear_flops = 2 * tokens_dp * params.attention / tp + 2 * tokens_total * (
            params.dense + params.lm_head
        ) / g
        expert_flops = 2 * tokens_total * params.expert_active_per_token / g
        attn_flops = 0.0
        if model.mla:
            absorbed = 2 * model.mla.kv_lora_rank + model.mla.qk_rope_head_dim
            attn_flops += (
                tokens_dp * params.mla_layers * 2 * (model.mla.heads / tp) * context * absorbed
                / layout.dcp
            )
        if model.kda:
            attn_flops += tokens_dp * params.kda_layers * 4 * (model.kda.heads / tp) * (
                model.kda.head_dim**2
            )
        compute = (linear_flops + attn_flops) / bf16_peak + expert_flops / expert_peak
        memory = moved / bw

        fixed = params.layers * (layer_overhead_s(gpu, c) + collectives)
        attn_comm = 2 * tokens_dp * hidden * BF16_BYTES * (tp - 1) / tp if tp > 1 else 0.0
        if model.moe and layout.ep > 1:
            comm = params.layers * (
                _group_comm_s(attn_comm, tp, reach, gpu, c)
                + _ep_comm_s(tokens_total / g, model.moe.top_k, hidden, layout, reach, gpu, c)
            )
        else:
            moe_comm = 2 * tokens_total * hidden * BF16_BYTES * (g - 1) / g / max(1, dp)
            comm = params.layers * (
                _group_comm_s(attn_comm, tp, reach, gpu, c)
                + _group_comm_s(moe_comm, g, reach, gpu, c)
            )
        if layout.dcp > 1 and model.mla and params.mla_layers and requests:
            # DCP's attention reduction (SGLang's default ag_rs, arg_groups/overrides.py:
            # 1374-1393): per MLA layer an all-gather of the queries and a reduce-scatter of
            # the partial outputs + LSE over the dcp ranks, each about heads/tp x kv_lora
            # BF16 values per token (an estimate: no published K3 DCP step breakdown).
            dcp_bytes = (2 * tokens_dp * (model.mla.heads / tp) * model.mla.kv_lora_rank
                         * BF16_BYTES * (layout.dcp - 1) / layout.dcp)
            comm += params.mla_layers * _group_comm_s(dcp_bytes, layout.dcp, reach, gpu, c)
            fixed += params.mla_layers * 2 * _collective_latency_s(layout.dcp, reach, c)
        memory_s += memory
        compute_s += compute
        fixed_s += fixed
        comm_s += comm
        bytes_total += moved
        flops_total += linear_flops + attn_flops + expert_flops
    if layout.pp > 1:
        handoff = tokens_total * hidden * BF16_BYTES
        fixed_s += (layout.pp - 1) * (c.internode_collective_us * 1e-6)
        comm_s += (layout.pp - 1) * handoff / (
            gpu.scale_out_gbps * 1e9 * c.comm_efficiency
        )
    return memory_s, compute_s, fixed_s, comm_s, bytes_total, flops_total


def _draft_s(
    draft: ModelDescriptor,
    target: ModelDescriptor,
    layout: Layout,
    gpu: GpuSpec,
    requests: float,
    context: int,
    spec: Speculation,
    c: TimeConstants,
) -> float:
    """One DSpark step: a single forward over gamma block rows per request (parallel
    drafting), projecting the newly committed target rows into the draft cache, plus the
    target's lm_head over the block rows."""
    tp = layout.attention_tp
    requests_dp = requests / layout.attention_dp
    rows = requests_dp * (spec.gamma + spec.acceptance_length)
    weight_bytes = draft.total_bytes() / tp + target.global_component_bytes().get(
        Component.LM_HEAD, 0
    ) / layout.tp
    kv_read = 0.0
    attn_flops = 0.0
    if draft.gqa:
        heads_rank = draft.gqa_kv_heads_per_rank(tp)
        kv_read = requests_dp * context * len(draft.layers) * 2 * heads_rank * draft.gqa.head_dim * 2
        attn_flops = (
            requests_dp * spec.gamma * len(draft.layers) * 4 * (draft.gqa.heads / tp)
            * context * draft.gqa.head_dim
        )
    lm_head_params = target.vocab_size * target.hidden_size
    flops = 2 * rows * draft.total_params / tp + 2 * requests_dp * spec.gamma * lm_head_params / (
        layout.tp
    ) + attn_flops
    memory = (weight_bytes + kv_read) / (gpu.hbm_tbps * 1e12 * c.hbm_efficiency)
    compute = flops / (gpu.bf16_tflops * 1e12 * efficiency(gpu, c, c.compute_efficiency))
    collectives = 2 * _collective_latency_s(tp, _scale_up_reach(layout, gpu), c)
    fixed = len(draft.layers) * (layer_overhead_s(gpu, c) + collectives) + c.draft_fixed_us * 1e-6
    return max(memory, compute) + fixed


def decode_step(
    model: ModelDescriptor,
    layout: Layout,
    gpu: GpuSpec,
    concurrency: int,
    context: int,
    draft: ModelDescriptor | None = None,
    speculation: Speculation | None = None,
    constants: TimeConstants = DEFAULT_CONSTANTS,
) -> StepBreakdown:
    """One decode step of `concurrency` requests at `context` tokens each, with pipelining:
    each stage works on 1/stages of the requests at a time."""
    if draft is not None and speculation is None:
        speculation = Speculation.for_draft(draft)
    spec = speculation if draft is not None else None
    microbatch = concurrency / layout.pp
    rows: float = (spec.gamma + 1) if spec else 1
    accepted = spec.acceptance_length if spec else 1.0
    # The deployments verify adaptively unless SGLang needs the static verify for the layout
    # (ROCm, attention DP, DCP: capacity.dspark_verify.static_verify_reason).
    if spec is not None and spec.adaptive_verify and static_verify_reason(layout) is None:
        accepted = adaptive_acceptance(spec.acceptance_length, concurrency)
        rows = verify_width(spec.acceptance_length, accepted, spec.gamma + 1)
    independent = microbatch * (1 + (rows - 1) * constants.verify_token_independence)
    memory, compute, fixed, comm, moved, flops = _forward_s(
        model, layout, gpu, microbatch * rows, microbatch, context, constants,
        constants.compute_efficiency, expert_tokens=independent,
    )
    draft_s = (
        _draft_s(draft, model, layout, gpu, microbatch, context, spec, constants)
        if draft is not None and spec is not None else 0.0
    )
    # A request advances once per full pass of the pipeline; the stages overlap microbatches.
    tokens = concurrency * accepted
    return StepBreakdown(
        memory_s=memory,
        compute_s=compute,
        fixed_s=fixed,
        communication_s=comm,
        draft_s=draft_s,
        tokens_per_step=tokens,
        bytes_per_gpu=moved,
        flops_per_gpu=flops,
    )


def decode_rate(
    model: ModelDescriptor,
    layout: Layout,
    gpu: GpuSpec,
    concurrency: int,
    context: int,
    draft: ModelDescriptor | None = None,
    speculation: Speculation | None = None,
    constants: TimeConstants = DEFAULT_CONSTANTS,
) -> DecodeRate:
    step = decode_step(model, layout, gpu, concurrency, context, draft, speculation, constants)
    per_user = step.tokens_per_step / concurrency / step.step_s
    return DecodeRate(concurrency, step, per_user, per_user * concurrency)


# LMSYS's measured strong-scaling efficiency of SGLang's chunked pipeline prefill (PP4 TP8).
PP_PREFILL_EFFICIENCY = 0.828


def prefill_seconds(
    model: ModelDescriptor,
    layout: Layout,
    gpu: GpuSpec,
    prompt_tokens: int,
    requests: int = 1,
    constants: TimeConstants = DEFAULT_CONSTANTS,
    chunk_tokens: int = 8192,
    pipelined: bool = True,
) -> float:
    """Time to prefill `requests` prompts of `prompt_tokens` each, run together.
    `pipelined` False: a pipeline's stages one after another (the sum a steady stream of
    prompts overlaps, keeping every stage busy: throughput pp / that sum).

    FLOPs: 2 x active params x tokens, plus causal MLA attention (about L^2 x heads x
    (d_qk + d_v) per layer and request) and linear KDA. Attention of one request runs only on
    its attention-DP rank; chunks of `chunk_tokens` per rank each pay the fixed per-layer cost.
    """
    tokens_total = float(prompt_tokens * requests)
    busy_dp = min(layout.attention_dp, requests)
    passes = max(1.0, math.ceil(prompt_tokens * requests / busy_dp / chunk_tokens))
    # The linear layers see every token once; attention over the prompt is added separately.
    memory, compute, fixed, comm, _, _ = _forward_s(
        model, layout, gpu, tokens_total, 0, 0, constants, constants.prefill_compute_efficiency,
        weight_passes=passes, busy_dp=busy_dp,
    )
    attention_flops = 0.0
    if model.mla:
        qk_v = model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim + model.mla.v_head_dim
        attention_flops += (
            model.mla_layers * requests * float(prompt_tokens) ** 2 * model.mla.heads * qk_v
        )
    per_gpu = attention_flops / (busy_dp * layout.attention_tp)
    attention_s = per_gpu / (gpu.bf16_tflops * 1e12
                             * efficiency(gpu, constants, constants.prefill_compute_efficiency))
    sequential = max(memory, compute) + attention_s + fixed * passes + comm
    if layout.pp == 1 or not pipelined:
        return sequential
    # Chunked pipeline parallelism (SGLang's PP prefill): chunk k + 1 enters stage 0 while
    # chunk k is on stage 1, so `passes` chunks over pp balanced stages take (passes + pp - 1)
    # stage-steps of sequential / (pp x passes) each, at the strong-scaling efficiency LMSYS
    # measured (82.8% at PP4 TP8, DeepSeek-V3.1 on H20, "Pipeline Parallelism in SGLang:
    # Scaling to Million-Token Contexts and Beyond", lmsys.org/blog/2026-01-15-chunked-
    # pipeline). Never slower than running the stages one after another.
    pipelined = (sequential * (passes + layout.pp - 1) / (passes * layout.pp)
                 / PP_PREFILL_EFFICIENCY)
    return min(sequential, pipelined)


def serving_throughput(
    model: ModelDescriptor,
    layout: Layout,
    gpu: GpuSpec,
    concurrency: int,
    input_tokens: int,
    output_tokens: int,
    draft: ModelDescriptor | None = None,
    speculation: Speculation | None = None,
    constants: TimeConstants = DEFAULT_CONSTANTS,
    max_running: int | None = None,
) -> float:
    """Output tokens/s of a closed-loop benchmark (every finished request is replaced): each
    request's prompt is prefilled once per `output_tokens` generated, and prefill stalls decode
    (no disaggregation)."""
    # Requests beyond the engine's running cap wait in its queue and add nothing.
    running = min(concurrency, max_running) if max_running else concurrency
    middle = input_tokens + output_tokens // 2
    rate = decode_rate(model, layout, gpu, running, middle, draft, speculation, constants)
    steps = output_tokens / (rate.step.tokens_per_step / running)
    decode_time = steps * rate.step.step_s
    prefill_time = prefill_seconds(model, layout, gpu, input_tokens, running, constants)
    return running * output_tokens / (decode_time + prefill_time)


def with_constants(constants: TimeConstants, **changes: float) -> TimeConstants:
    return replace(constants, **changes)


@dataclass(frozen=True)
class VisionTime:
    """Seconds the vision tower + projector add to one request's prefill."""

    per_image_s: float  # one image alone through tower + projector on one GPU
    request_s: float  # the request's images, split image-wise over the attention-TP ranks
    images_on_busiest_rank: int


def _vision_pass_s(flops: float, weight_bytes: int, layers: int, gpu: GpuSpec,
                   c: TimeConstants) -> float:
    """One call of a replicated module on one GPU: the roofline, plus the per-layer launch cost
    the text model is fitted with."""
    compute = flops / (gpu.bf16_tflops * 1e12 * efficiency(gpu, c, c.prefill_compute_efficiency))
    memory = weight_bytes / (gpu.hbm_tbps * 1e12 * c.hbm_efficiency)
    return max(compute, memory) + layers * layer_overhead_s(gpu, c)


def vision_seconds(
    model: ModelDescriptor,
    layout: Layout,
    gpu: GpuSpec,
    images: Images,
    constants: TimeConstants = DEFAULT_CONSTANTS,
) -> VisionTime:
    """The tower's time for one request's images (capacity.vision): each attention-TP rank
    encodes whole images in one packed call (attention per image, so FLOPs add per image),
    then every rank projects all of them after the all-gather. The tower's BF16 math runs at
    the planner's prefill efficiency of the GPU's dense BF16 peak."""
    grid = request_images(model, images)
    if grid is None or model.vision is None:
        return VisionTime(0.0, 0.0, 0)
    v = model.vision
    c = constants

    def tower(n: int) -> float:
        return _vision_pass_s(n * v.tower_flops(grid.patches), v.tower_bytes, v.layers, gpu, c)

    def projector(n: int) -> float:
        return _vision_pass_s(n * v.projector_flops(grid.tokens), v.projector_bytes, 1, gpu, c)

    busiest = images_per_rank(images, layout.attention_tp)
    return VisionTime(
        per_image_s=tower(1) + projector(1),
        request_s=tower(busiest) + projector(images.per_request),
        images_on_busiest_rank=busiest,
    )
