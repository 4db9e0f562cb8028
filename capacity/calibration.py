"""Published measurements the time model is fitted to, and the fit itself.

Every anchor is a published measurement; what its source leaves open (context length,
acceptance length, how GPUs were split) is an explicit assumption printed beside the error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from capacity.config import Layout
from capacity.families import describe_model
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
}


@dataclass(frozen=True)
class Anchor:
    name: str
    measured: float
    unit: str
    source: str
    assumption: str
    predict: Callable[[TimeConstants], float] | None  # None: not enough published to model


@dataclass(frozen=True)
class AnchorResult:
    anchor: Anchor
    predicted: float | None

    @property
    def error(self) -> float | None:
        if self.predicted is None:
            return None
        return self.predicted / self.anchor.measured - 1.0


def _layout(gpu: str, gpn: int, nodes: int, tp: int, dp: int = 1) -> Layout:
    """`tp`: attention TP, as the published anchors state it (SGLang's tp_size is tp x dp)."""
    layout = Layout(gpu=gpu, nodes=nodes, tp=tp * dp, attention_dp=dp, ep=tp * dp)
    assert layout.gpus_per_node == gpn, (gpu, gpn, nodes, tp, dp)
    return layout


def anchors() -> list[Anchor]:
    k3 = describe_model("kimi-k3")
    k2 = describe_model("kimi-k2")
    dspark = describe_model("kimi-k3-dspark")
    gpus = load_gpus()
    gb300_tp16 = _layout("GB300", 4, 4, 16)
    gb300_tp8 = _layout("GB300", 4, 2, 8)
    b300 = _layout("B300", 8, 1, 8)
    # K2 disaggregated: one prefill group of 4 nodes and one decode group of 12 nodes, both
    # DP-attention + EP over the whole group (the SGLang large-EP recipe).
    k2_prefill = _layout("H200", 8, 4, 1, 32)
    k2_decode = _layout("H200", 8, 12, 1, 96)

    def user_rate(model: ModelDescriptor, layout: Layout, draft: ModelDescriptor | None,
                  context: int) -> Callable[[TimeConstants], float]:
        gpu: GpuSpec = gpus[layout.gpu]
        return lambda c: decode_rate(model, layout, gpu, 1, context, draft, None, c).per_user_tokens_s

    def tpot_ms(draft: ModelDescriptor | None) -> Callable[[TimeConstants], float]:
        rate = user_rate(k3, b300, draft, 8192 + 512)
        return lambda c: 1000.0 / rate(c)

    def bench(concurrency: int, draft: ModelDescriptor | None) -> Callable[[TimeConstants], float]:
        gpu = gpus["B300"]
        cap = max_running_requests(draft)
        return lambda c: serving_throughput(
            k3, b300, gpu, concurrency, 8192, 1024, draft, None, c, max_running=cap
        )

    def k2_prefill_rate(c: TimeConstants) -> float:
        requests = 32 * 8
        seconds = prefill_seconds(k2, k2_prefill, gpus["H200"], 2000, requests, c)
        return requests * 2000 / seconds / k2_prefill.total_gpus

    def k2_decode_rate(c: TimeConstants) -> float:
        rate = decode_rate(k2, k2_decode, gpus["H200"], 96 * 256, 2050, None, None, c)
        return rate.total_tokens_s / k2_decode.total_gpus

    gb300_src = "published: K3 on GB300, single user"
    b300_src = "published: K3 on 8 x B300, RadixArk DSpark, SGLang, 8k in / 1k out"
    spec = "acceptance 3.45 (DSpark card mean over 10 benchmarks), gamma 7"
    return [
        Anchor("K3 GB300 TP16 no spec, batch 1", 118, "tok/s per user", gb300_src,
               "context 8k", user_rate(k3, gb300_tp16, None, 8192)),
        Anchor("K3 GB300 TP16 DSpark, batch 1", 370, "tok/s per user", gb300_src,
               f"context 8k; {spec}", user_rate(k3, gb300_tp16, dspark, 8192)),
        Anchor("K3 GB300 TP8 no spec, batch 1", 111, "tok/s per user", gb300_src,
               "context 8k", user_rate(k3, gb300_tp8, None, 8192)),
        Anchor("K3 8xB300 TPOT no spec, c=1", 8.51, "ms", b300_src, "context 8.7k",
               tpot_ms(None)),
        Anchor("K3 8xB300 TPOT DSpark, c=1", 2.84, "ms", b300_src, f"context 8.7k; {spec}",
               tpot_ms(dspark)),
        Anchor("K3 8xB300 no spec, c=16", 785, "tok/s total", b300_src,
               "the source's 'tokens/s per GPU' read as the server's output tokens/s (at c=1 "
               "it equals 1/TPOT); closed loop, prefill stalls decode; DSpark runs at most 48 "
               "requests (SGLang's forced max_running_requests)", bench(16, None)),
        Anchor("K3 8xB300 DSpark, c=16", 1319, "tok/s total", b300_src, f"as above; {spec}",
               bench(16, dspark)),
        Anchor("K3 8xB300 no spec, c=64", 1395, "tok/s total", b300_src, "as above",
               bench(64, None)),
        Anchor("K3 8xB300 DSpark, c=64", 1987, "tok/s total", b300_src, f"as above; {spec}",
               bench(64, dspark)),
        Anchor("K2 128xH200 prefill", 896_000 / 128, "tok/s per GPU",
               "published: K2 on 128 H200, 1 prefill + 1 decode group, 2000 in",
               "896k tok/s over all 128 GPUs; modeled as 32 GPUs DP32 EP32 prefilling 8 "
               "prompts per GPU", k2_prefill_rate),
        Anchor("K2 128xH200 decode", 384_000 / 128, "tok/s per GPU",
               "published: K2 on 128 H200, 100 out",
               "384k tok/s over all 128 GPUs; modeled as 96 GPUs DP96 EP96, 256 requests "
               "per GPU at 2k context", k2_decode_rate),
        Anchor("K3 GB300 Dynamo aggregated", 84, "tok/s per GPU",
               "published: K3 on GB300 via Dynamo, 573 ms TTFT",
               "not modeled: layout, input/output lengths and concurrency are not published",
               None),
    ]


def evaluate(constants: TimeConstants = DEFAULT_CONSTANTS,
             anchor_list: list[Anchor] | None = None) -> list[AnchorResult]:
    return [
        AnchorResult(a, a.predict(constants) if a.predict else None)
        for a in (anchor_list or anchors())
    ]


def _loss(results: list[AnchorResult]) -> float:
    errors = [math.log1p(r.error) for r in results if r.error is not None]
    # Sum of squared log errors plus the worst one, so no single anchor is sacrificed.
    return sum(e * e for e in errors) + 2 * max(e * e for e in errors)


def fit(start: TimeConstants = DEFAULT_CONSTANTS, rounds: int = 6,
        steps: int = 13) -> TimeConstants:
    """Coordinate descent over the bounded constants, minimising squared log error."""
    anchor_list = anchors()
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
