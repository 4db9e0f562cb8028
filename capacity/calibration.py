"""Published measurements the time model is fitted to, and the fit itself.

Every anchor is a published measurement; what its source leaves open (context length,
acceptance length, how GPUs were split) is an explicit assumption printed beside the error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import cache

from capacity.config import Layout, Speculation
from capacity.families import describe_model
from capacity.formats import KvDtype, WeightFormat
from capacity.memory import max_running_requests
from capacity.model import ModelDescriptor
from capacity.tables import GpuSpec, load_gpus
from capacity.timing import (
    DEFAULT_CONSTANTS,
    TimeConstants,
    decode_rate,
    prefill_seconds,
    serving_throughput,
)

# Search bounds for the fit (physically reachable ranges, see TimeConstants).
BOUNDS: dict[str, tuple[float, float]] = {
    "hbm_efficiency": (0.5, 0.95),
    "compute_efficiency": (0.2, 0.8),
    "prefill_compute_efficiency": (0.2, 0.8),
    "layer_overhead_us": (5.0, 120.0),
    "collective_hop_us": (0.5, 30.0),
    "internode_collective_us": (0.0, 100.0),
    "comm_efficiency": (0.3, 0.95),
    "draft_fixed_us": (0.0, 3000.0),
    "verify_token_independence": (0.2, 1.0),
    "rocm_layer_overhead_us": (5.0, 300.0),
    "rocm_efficiency": (0.1, 1.0),
}


@dataclass(frozen=True)
class Anchor:
    """One published measurement. `source` names the publication and its date; `assumption`
    says what the source leaves open (or, with `predict` None, why it is not modeled)."""

    name: str
    measured: float
    unit: str
    source: str
    assumption: str
    predict: Callable[[TimeConstants], float] | None  # None: not enough published to model
    gpu: str = ""  # the GPU type measured (gpus.csv name)
    model: str = "K3"  # "K3" or "K2"
    engine: str = ""  # the serving engine that produced the number
    vendor_claim: bool = False  # published by the hardware vendor or its own engineers
    # False: printed with its error as a cross-check but left out of the fit (why: `assumption`)
    fitted: bool = True


@dataclass(frozen=True)
class AnchorResult:
    anchor: Anchor
    predicted: float | None

    @property
    def error(self) -> float | None:
        if self.predicted is None:
            return None
        return self.predicted / self.anchor.measured - 1.0


def _layout(gpu: str, gpn: int, nodes: int, tp: int, dp: int = 1, ep: int | None = None,
            **extra: object) -> Layout:
    """`tp`: attention TP, as the published anchors state it (SGLang's tp_size is tp x dp);
    `ep` defaults to the whole stage (SGLang's --ep-size equal to --tp)."""
    layout = Layout(gpu=gpu, nodes=nodes, tp=tp * dp, attention_dp=dp,
                    ep=tp * dp if ep is None else ep, **extra)  # type: ignore[arg-type]
    assert layout.gpus_per_node == gpn, (gpu, gpn, nodes, tp, dp)
    return layout


# Sources (dates as published). Each anchor's assumption repeats what its source leaves open.
VLLM_K3_DAY0 = ("vLLM blog 'Kimi K3 Is Here: Efficient Day-0 Support on vLLM' (vLLM team and "
                "Inferact), 2026-07-27, vllm-project.github.io/_posts/2026-07-27-k3.md: batch-1 "
                "decode on GB300 NVL72; DSpark = Inferact/Kimi-K3-DSpark, SPEED-Bench "
                "low_entropy, <= 10,240-token inputs, 1,536 out, T 1.0")
SGLANG_B300 = ("SGLang cookbook PR sgl-project/sglang#37878 'Kimi-K3: add measured B300 1x8 "
               "Unified 8k/1k speed numbers', 2026-09-03 (SGLang v0.5.18, RadixArk/Kimi-K3-DSpark, "
               "ISL 8192 / OSL 1024); its 'tok/s/GPU' is (input + output) tokens/s per GPU: at "
               "c=1, 9,216 / (TTFT 0.378 s + 1,023 x 8.51 ms) / 8 = 127, the published value")
SGLANG_MI355X = ("sgl-project/sglang#32548 '[Kimi-K3][AMD] Day 0 and Performance Tracking' (AMD "
                 "engineers), 2026-07-27: MI355X TP8, image rocm720-mi35x-k3-20260727, "
                 "SGLANG_USE_AITER=1, triton attention, no --ep-size; ISL 8192 / OSL 1024 (the "
                 "sweep ROCm/MAD#182 says matches these tables; 2 x 9,216 / 22.47 s = 820, the "
                 "published TTT at c=2)")
SGLANG_GB200 = ("sgl-project/sglang#32592 'update Kimi-K3 GB200 recipes from measured 4x4 runs' "
                "(SGLang + NVIDIA), 2026-07-28: 4 x 4 GB200, aggregated prefill, ISL 8192 / OSL 1")
SGLANG_GB200_DECODE = ("SGLang K3 cookbook config docs_new/src/snippets/configs/moonshotai/kimi-k3.jsx, "
                       "GB200 decode cells (measurements added by sgl-project/sglang#32592, "
                       "2026-07-28): PD decode side, 16 GB200, ISL 8192 / OSL 1024, behind a "
                       "shared PP2 x TP8 prefill; out tok/s per user read (its tok/s per GPU "
                       "counts GPUs the source does not list)")
GB200_DECODE_CROSS_CHECK = (
    "a cross-check, not fitted: day-0 SGLang GB200 decode measured without --enable-symm-mem "
    "(the cell says so), 2-3x slower per token than the B300 and GB300 anchors at the same "
    "batch, which no single set of hardware constants reproduces beside them")
VLLM_MI325X = ("vllm-project/vllm#50817 'Enable AITER MXFP4 MoE on gfx942 ... Kimi K3 on MI325X' "
               "(open, unmerged), 2026-08-03: 8 x MI325X, TP8, real MXFP4 checkpoint, Triton "
               "a16w4 + SiTU MoE (the experts stay MXFP4, 16-bit math)")
LMSYS_K3_DAY0 = ("LMSYS blog 'SGLang and Miles Add Day-0 Support for Kimi K3', 2026-07-27 "
                 "(lm-sys.github.io blog/2026-07-27-kimi-k3-day0-support.md; peak arm per "
                 "lm-sys.github.io#373): PD frontier with chunked PP8 prefill")
B300_SPEC = "acceptance 3.45 (RadixArk/Kimi-K3-DSpark card mean over 10 benchmarks), gamma 7"
LOW_ENTROPY_SPEC = ("acceptance 3.45 assumed, gamma 7: the blog gives none for its SPEED-Bench "
                    "low-entropy runs; its 'coding and other low-entropy tasks' figure is 4.73, "
                    "while a sibling Inferact draft's card (Kimi-K3.1-Pro-DSpark-preview) "
                    "measures 2.93 on SPEED-Bench low entropy 10K; 3.45 (the RadixArk card "
                    "mean) lies between (with 4.73 the fit needs a 1.5 ms fixed draft cost)")


def anchors() -> list[Anchor]:
    k3 = describe_model("kimi-k3")
    k2 = describe_model("kimi-k2")
    dspark = describe_model("kimi-k3-dspark")
    gpus = load_gpus()
    gb300_tp16 = _layout("GB300", 4, 4, 16)
    gb300_tp8 = _layout("GB300", 4, 2, 8, kv_dtype=KvDtype.FP8)  # the blog's TP8 command
    b300 = _layout("B300", 8, 1, 8)
    b300_nvfp4 = _layout("B300", 8, 1, 8, weight_format=WeightFormat.NVFP4)
    mi355x = _layout("MI355X", 8, 1, 8, ep=1)  # `--tp 8`, no --ep-size: MoE TP8
    gb200_tep16 = _layout("GB200", 4, 4, 16)
    gb200_pp16 = Layout(gpu="GB200", nodes=4, tp=1, pp=16, ep=1)  # the published prefill cell
    gb200_tp16 = _layout("GB200", 4, 4, 16, ep=1)
    gb200_pp2 = Layout(gpu="GB200", nodes=4, tp=8, pp=2, ep=1)
    gb200_dcp8_dp2 = Layout(gpu="GB200", nodes=4, tp=16, attention_dp=2, ep=16, dcp=8)
    gb200_dcp16 = Layout(gpu="GB200", nodes=4, tp=16, ep=16, dcp=16)
    mi325x = _layout("MI325X", 8, 1, 8, ep=1)  # vLLM TP8 without expert parallel
    # K2 disaggregated: one prefill group of 4 nodes and one decode group of 12 nodes, both
    # DP-attention + EP over the whole group (the SGLang large-EP recipe).
    k2_prefill = _layout("H200", 8, 4, 1, 32)
    k2_decode = _layout("H200", 8, 12, 1, 96)

    def spec(acceptance: float) -> Speculation:
        return Speculation(gamma=7, acceptance_length=acceptance)

    def user_rate(layout: Layout, draft: ModelDescriptor | None, context: int,
                  acceptance: float = 3.45, concurrency: int = 1,
                  ) -> Callable[[TimeConstants], float]:
        gpu: GpuSpec = gpus[layout.gpu]
        speculation = spec(acceptance) if draft else None
        return lambda c: decode_rate(k3, layout, gpu, concurrency, context, draft, speculation,
                                     c).per_user_tokens_s

    def tpot_ms(layout: Layout, draft: ModelDescriptor | None, concurrency: int = 1,
                acceptance: float = 3.45) -> Callable[[TimeConstants], float]:
        rate = user_rate(layout, draft, 8192 + 512, acceptance, concurrency)
        return lambda c: 1000.0 / rate(c)

    def bench_per_gpu(layout: Layout, concurrency: int, draft: ModelDescriptor | None,
                      isl: int = 8192, osl: int = 1024) -> Callable[[TimeConstants], float]:
        """A closed-loop benchmark's (input + output) tokens/s per GPU."""
        gpu = gpus[layout.gpu]
        cap = max_running_requests(draft)
        speculation = spec(3.45) if draft else None
        return lambda c: serving_throughput(
            k3, layout, gpu, concurrency, isl, osl, draft, speculation, c, max_running=cap
        ) * (isl + osl) / osl / layout.total_gpus

    def ttft_ms(layout: Layout, prompt: int) -> Callable[[TimeConstants], float]:
        gpu = gpus[layout.gpu]
        return lambda c: 1000.0 * prefill_seconds(k3, layout, gpu, prompt, 1, c)

    def prefill_per_gpu(layout: Layout, prompt: int, requests: int, pipelined: bool = True
                        ) -> Callable[[TimeConstants], float]:
        gpu = gpus[layout.gpu]
        return lambda c: requests * prompt / prefill_seconds(
            k3, layout, gpu, prompt, requests, c, pipelined=pipelined) / layout.total_gpus

    def k2_prefill_rate(c: TimeConstants) -> float:
        requests = 32 * 8
        seconds = prefill_seconds(k2, k2_prefill, gpus["H200"], 2000, requests, c)
        return requests * 2000 / seconds / k2_prefill.total_gpus

    def k2_decode_rate(c: TimeConstants) -> float:
        rate = decode_rate(k2, k2_decode, gpus["H200"], 96 * 256, 2050, None, None, c)
        return rate.total_tokens_s / k2_decode.total_gpus

    vllm = {"engine": "vLLM", "vendor_claim": False}
    sglang = {"engine": "SGLang", "vendor_claim": False}
    amd = {"engine": "SGLang", "vendor_claim": True}
    serving = ("closed loop, prefill stalls decode; DSpark runs at most 48 requests (SGLang's "
               "forced max_running_requests)")
    tpot = "median TPOT read as one decode step per token; context 8.7k (8k prompt + half the answer)"
    return [
        # --- GB300 (vLLM's launch numbers) ---
        Anchor("K3 GB300 TP16 no spec, batch 1", 118, "tok/s per user", VLLM_K3_DAY0,
               "context 8.7k (8k random prompt + half the answer); TP16 = 4 x 4 GB300, EP16, "
               "BF16 KV (the TP16 command is not published)",
               user_rate(gb300_tp16, None, 8192 + 512), gpu="GB300", **vllm),
        Anchor("K3 GB300 TP16 DSpark, batch 1", 370, "tok/s per user", VLLM_K3_DAY0,
               f"context 11k (10k prompt + half of 1,536 out); {LOW_ENTROPY_SPEC}; the draft is "
               "Inferact's (the planner models RadixArk's, 2.25B vs 2.7B parameters)",
               user_rate(gb300_tp16, dspark, 10240 + 768, 3.45), gpu="GB300", **vllm),
        Anchor("K3 GB300 TP8 no spec, batch 1", 111, "tok/s per user", VLLM_K3_DAY0,
               "context 8.7k; TP8 = 2 x 4 GB300, EP8, FP8 KV (the blog's TP8 command)",
               user_rate(gb300_tp8, None, 8192 + 512), gpu="GB300", **vllm),
        Anchor("K3 GB300 TP8 DSpark, batch 1", 331, "tok/s per user", VLLM_K3_DAY0,
               f"context 11k; {LOW_ENTROPY_SPEC}; FP8 KV",
               user_rate(gb300_tp8, dspark, 10240 + 768, 3.45), gpu="GB300", **vllm),
        # --- B300 (SGLang cookbook) ---
        Anchor("K3 8xB300 MXFP4 TPOT no spec, c=1", 8.51, "ms", SGLANG_B300,
               f"{tpot}; TP8 EP8", tpot_ms(b300, None), gpu="B300", **sglang),
        Anchor("K3 8xB300 MXFP4 TPOT DSpark, c=1", 2.84, "ms", SGLANG_B300,
               f"{tpot}; {B300_SPEC} (random prompts: the source gives no acceptance)",
               tpot_ms(b300, dspark), gpu="B300", **sglang),
        Anchor("K3 8xB300 NVFP4 TPOT no spec, c=1", 10.12, "ms", SGLANG_B300,
               f"{tpot}; nvidia/Kimi-K3-NVFP4 modeled as NVFP4 routed experts, the rest as "
               "the MXFP4 checkpoint's BF16", tpot_ms(b300_nvfp4, None), gpu="B300", **sglang),
        Anchor("K3 8xB300 NVFP4 TPOT DSpark, c=1", 3.24, "ms", SGLANG_B300,
               f"as above; {B300_SPEC}", tpot_ms(b300_nvfp4, dspark), gpu="B300", **sglang),
        Anchor("K3 8xB300 TTFT no spec, c=1", 378, "ms", SGLANG_B300,
               "median TTFT read as one 8,192-token prefill alone (no queue; HTTP and "
               "tokenization not modeled)", ttft_ms(b300, 8192), gpu="B300", **sglang),
        Anchor("K3 8xB300 no spec, c=16", 785, "tok/s per GPU (in+out)", SGLANG_B300,
               serving, bench_per_gpu(b300, 16, None), gpu="B300", **sglang),
        Anchor("K3 8xB300 DSpark, c=16", 1319, "tok/s per GPU (in+out)", SGLANG_B300,
               f"as above; {B300_SPEC}", bench_per_gpu(b300, 16, dspark), gpu="B300", **sglang),
        Anchor("K3 8xB300 no spec, c=64", 1395, "tok/s per GPU (in+out)", SGLANG_B300,
               "as above", bench_per_gpu(b300, 64, None), gpu="B300", **sglang),
        Anchor("K3 8xB300 DSpark, c=64", 1987, "tok/s per GPU (in+out)", SGLANG_B300,
               f"as above; {B300_SPEC}", bench_per_gpu(b300, 64, dspark), gpu="B300", **sglang),
        # --- MI355X (AMD's day-0 SGLang numbers: vendor claims) ---
        Anchor("K3 8xMI355X TPOT no spec, c=2", 20.86, "ms", SGLANG_MI355X,
               f"{tpot}; MXFP4 experts on AITER (A8W4)", tpot_ms(mi355x, None, 2),
               gpu="MI355X", **amd),
        Anchor("K3 8xMI355X TPOT no spec, c=4", 22.62, "ms", SGLANG_MI355X,
               f"{tpot}; MXFP4 experts on AITER (A8W4)", tpot_ms(mi355x, None, 4),
               gpu="MI355X", **amd),
        Anchor("K3 8xMI355X no spec, c=2", 820.02 / 8, "tok/s per GPU (in+out)",
               SGLANG_MI355X, f"the published TTT 820.02 / 8 GPUs; {serving}",
               bench_per_gpu(mi355x, 2, None), gpu="MI355X", **amd),
        Anchor("K3 8xMI355X no spec, c=4", 1474.71 / 8, "tok/s per GPU (in+out)",
               SGLANG_MI355X, "the published TTT 1,474.71 / 8 GPUs; as above",
               bench_per_gpu(mi355x, 4, None), gpu="MI355X", **amd),
        # --- GB200 ---
        Anchor("K3 16xGB200 TEP16 prefill, c=4", 1947, "prefill tok/s per GPU", SGLANG_GB200,
               "four 8,192-token prompts prefilled together (c=4 read as one batch); TEP16 = "
               "attention TP16 + EP16", prefill_per_gpu(gb200_tep16, 8192, 4), gpu="GB200",
               **sglang),
        Anchor("K3 16xGB200 PP16 prefill, c=64", 4552, "prefill tok/s per GPU", SGLANG_GB200,
               "64 prompts in flight fill the 16-stage pipeline: read as steady state, the "
               "stages overlap, so throughput = 16 / (sum of the stage times), without the "
               "fill and drain of one batch's chunked pipeline (prefill_seconds' TTFT model)",
               lambda c: 16 * prefill_per_gpu(gb200_pp16, 8192, 64, pipelined=False)(c),
               gpu="GB200", **sglang),
        Anchor("K3 16xGB200 TP16 decode, c=8", 40.7, "tok/s per user", SGLANG_GB200_DECODE,
               f"decode only (PD: no prefill stalls), context 8.7k; 'TP16' read as --tp-size 16 "
               f"without --ep-size (MoE TP16); {GB200_DECODE_CROSS_CHECK}",
               user_rate(gb200_tp16, None, 8192 + 512, concurrency=8), gpu="GB200",
               fitted=False, **sglang),
        Anchor("K3 16xGB200 PP2xTP8 decode, c=8", 57.7, "tok/s per user", SGLANG_GB200_DECODE,
               "as above; PP2 x TP8 (two pipeline stages of 2 x 4 GB200), MoE TP8; a "
               "cross-check, not fitted (as above)",
               user_rate(gb200_pp2, None, 8192 + 512, concurrency=8), gpu="GB200",
               fitted=False, **sglang),
        Anchor("K3 16xGB200 TP16 decode, c=256", 23.9, "tok/s per user", SGLANG_GB200_DECODE,
               "as above; the cell says the batch caps at about 125 running requests, so "
               "modeled at 125; a cross-check, not fitted (as above)",
               user_rate(gb200_tp16, None, 8192 + 512, concurrency=125), gpu="GB200",
               fitted=False, **sglang),
        # The DCP cells, now that the time model has decode context parallelism (KV read and
        # MLA attention / dcp plus two collectives per MLA layer: capacity/timing.py): the
        # same day-0 decode as the cells above, so cross-checks, not fitted.
        Anchor("K3 16xGB200 DCP8 x dp2 + EP16 decode, c=256", 25.4, "tok/s per user",
               SGLANG_GB200_DECODE,
               "as above; DCP8 inside each of 2 attention-DP groups of TP8, EP16 (--dcp-size 8 "
               "--dp 2 --ep-size 16), 256 running (145.5 out tok/s per GPU beside it); the DCP "
               "collectives' cost is the planner's estimate (no published K3 DCP step "
               f"breakdown); {GB200_DECODE_CROSS_CHECK}",
               user_rate(gb200_dcp8_dp2, None, 8192 + 512, concurrency=256), gpu="GB200",
               fitted=False, **sglang),
        Anchor("K3 16xGB200 DCP16 + EP16 decode, c=8", 39.7, "tok/s per user",
               SGLANG_GB200_DECODE,
               "as above; TP16 with DCP16 and EP16; a cross-check, not fitted (as above)",
               user_rate(gb200_dcp16, None, 8192 + 512, concurrency=8), gpu="GB200",
               fitted=False, **sglang),
        # --- MI325X (gfx942) ---
        Anchor("K3 8xMI325X prefill, 36k prompt", 6537, "prefill tok/s (8 GPUs)", VLLM_MI325X,
               "'36k' read as one 36,864-token prompt; an unmerged vLLM patch, not SGLang "
               "(SGLang 0.5.23 has no MXFP4 path on gfx942: see capacity/data/"
               "sglang_k3_paths.csv)", lambda c: prefill_per_gpu(mi325x, 36_864, 1)(c) * 8,
               gpu="MI325X", engine="vLLM (PR)", vendor_claim=False),
        Anchor("K3 8xMI325X decode", 99.67, "tok/s", VLLM_MI325X,
               "not modeled: the concurrency and lengths behind 'decode tok/s' are not "
               "published", None, gpu="MI325X", engine="vLLM (PR)"),
        # --- the PD / DCP frontier (LMSYS): layouts the time model cannot express yet ---
        Anchor("K3 PD 2xPP8 prefill -> 2xDCP8 decode", 2633, "tok/s per GPU", LMSYS_K3_DAY0,
               "not modeled: a PD frontier point: the ISL/OSL, GPU type (the blog's other runs "
               "are 2 x 4 GB300), the load and whether tok/s counts input are not stated, so "
               "no `plan --disagg` fleet can be set beside it", None, gpu="GB300", **sglang),
        Anchor("K3 PD PP8 -> TP8, 1P:1D, fp4", 2808, "tok/s per GPU", LMSYS_K3_DAY0,
               "not modeled: a PD frontier point: ISL/OSL, GPU type and load are not stated",
               None, gpu="GB300", **sglang),
        Anchor("K3 PD PP8 -> 4 x TP8 decode", 86, "tok/s per user", LMSYS_K3_DAY0,
               "not modeled: 'out past 86 tok/s per user' is read off a figure, load not stated",
               None, gpu="GB300", **sglang),
        Anchor("K3 2x4 GB300 DCP8 + HiCache, 48 agent sessions", 541, "tok/s", LMSYS_K3_DAY0,
               "not modeled: the HiCache host tier's reuse of an agent's prefix between turns "
               "(no TTFT or throughput credit in the planner) on sessions whose lengths and "
               "turns are not stated", None,
               gpu="GB300", **sglang),
        Anchor("K3 GB300 Dynamo aggregated", 84, "tok/s per GPU",
               "NVIDIA Dynamo Kimi-K3 recipe (ai-dynamo/dynamo recipes/kimi-k3, refreshed in "
               "PRs dated 2026-08-10 to 2026-08-13; the revision that published 84 tok/s/GPU at "
               "573 ms TTFT was not found again)",
               "not modeled: layout, input/output lengths and concurrency are not published",
               None, gpu="GB300", engine="Dynamo"),
        # --- K2 (the large-EP reference the prefill constant was first fitted on) ---
        Anchor("K2 128xH200 prefill", 896_000 / 128, "tok/s per GPU",
               "LMSYS 'Deploying Kimi K2 with PD disaggregation and large-scale EP on 128 "
               "H200', 2025-07-17: 1 prefill + 1 decode group, 2000 in",
               "896k tok/s over all 128 GPUs; modeled as 32 GPUs DP32 EP32 prefilling 8 "
               "prompts per GPU; a cross-check, not fitted (K2's prefill kernels are not K3's)",
               k2_prefill_rate, gpu="H200", model="K2", fitted=False, **sglang),
        Anchor("K2 128xH200 decode", 384_000 / 128, "tok/s per GPU",
               "LMSYS K2 large-scale EP blog, 2025-07-17: 100 out",
               "384k tok/s over all 128 GPUs; modeled as 96 GPUs DP96 EP96, 256 requests "
               "per GPU at 2k context; a cross-check, not fitted", k2_decode_rate, gpu="H200",
               model="K2", fitted=False, **sglang),
    ]


@cache
def k3_anchor_gpus() -> frozenset[str]:
    """GPU types (upper case) with at least one modeled K3 anchor."""
    return frozenset(a.gpu.upper() for a in anchors()
                     if a.model == "K3" and a.predict and a.fitted)


def evaluate(constants: TimeConstants = DEFAULT_CONSTANTS,
             anchor_list: list[Anchor] | None = None) -> list[AnchorResult]:
    return [
        AnchorResult(a, a.predict(constants) if a.predict else None)
        for a in (anchor_list or anchors())
    ]


def calibration_summary(results: list[AnchorResult]) -> dict[str, object]:
    """Fitted K3 anchors, K3 cross-checks and K2: how many are modeled, on which GPU types, and
    the worst and mean absolute error (what `kimi-capacity calibrate` prints and the tests
    hold)."""
    gpus = load_gpus()
    summary: dict[str, object] = {
        "not_modeled": sum(1 for r in results if r.error is None)}
    groups = {
        "k3": lambda a: a.model == "K3" and a.fitted,
        "k3_cross_check": lambda a: a.model == "K3" and not a.fitted,
        "k2": lambda a: a.model == "K2",
    }
    for key, member in groups.items():
        modeled = [r for r in results if member(r.anchor) and r.error is not None]
        types = sorted({r.anchor.gpu.upper() for r in modeled})
        worst = max(modeled, key=lambda r: abs(r.error or 0.0), default=None)
        summary[key] = {
            "modeled": len(modeled),
            "gpus": types,
            "amd_gpus": sum(1 for g in types if g in gpus and gpus[g].vendor.upper() == "AMD"),
            "worst_error": abs(worst.error or 0.0) if worst else 0.0,
            "worst_anchor": worst.anchor.name if worst else None,
            "mean_error": (sum(abs(r.error or 0.0) for r in modeled) / len(modeled)
                           if modeled else 0.0),
        }
    return summary


def _loss(results: list[AnchorResult]) -> float:
    errors = [math.log1p(r.error) for r in results if r.error is not None]
    # Sum of squared log errors plus the worst one, so no single anchor is sacrificed.
    return sum(e * e for e in errors) + 2 * max(e * e for e in errors)


def fit(start: TimeConstants = DEFAULT_CONSTANTS, rounds: int = 8,
        steps: int = 17) -> TimeConstants:
    """Coordinate descent over the bounded constants, minimising squared log error over the
    fitted anchors (K3's; the cross-checks are printed with their error but not fitted)."""
    anchor_list = [a for a in anchors() if a.fitted]
    best = start
    best_loss = _loss(evaluate(best, anchor_list))
    names = [f.name for f in fields(TimeConstants)]
    for _ in range(rounds):
        for name in names:
            low, high = BOUNDS[name]
            for i in range(steps):
                value = low + (high - low) * i / (steps - 1)
                candidate = replace(best, **{name: value})
                loss = _loss(evaluate(candidate, anchor_list))
                if loss < best_loss:
                    best, best_loss = candidate, loss
        # Refine around the current point with a finer, narrower grid each round.
        BOUNDS_SCALE = 0.5
        for name in names:
            low, high = BOUNDS[name]
            span = (high - low) * BOUNDS_SCALE / 2
            centre = getattr(best, name)
            for i in range(steps):
                value = min(high, max(low, centre - span + 2 * span * i / (steps - 1)))
                candidate = replace(best, **{name: value})
                loss = _loss(evaluate(candidate, anchor_list))
                if loss < best_loss:
                    best, best_loss = candidate, loss
    return best
