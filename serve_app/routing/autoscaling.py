"""How many target replicas a pool needs, from what the router holds (docs/runbook.md
"Autoscaling"). Pure policy, no Ray: the Serve adapter (serve_app/routing/serve_autoscaling.py)
turns Serve's AutoscalingContext into `ReplicaLoad`s, and the benchmark drives the same
function.

Why these signals and not requests per replica (Serve's default) or a latency after the fact:
a K3 replica is full when its KV tokens or its state slots are committed, whatever the number
of requests (one 1M-token agent holds a replica that thirty chats would not), and the router
knows both before the engine does: every admitted request reserved prompt + max_tokens and one
slot on its replica's ledger, and every request it could not place yet waits in an admission
queue with its size. So the pool is sized for the committed load plus the queued demand at
`target_utilization`, and a request that has waited longer than `max_queue_wait_s` (or a
measured TTFT over the SLO) adds one replica even when the sizes say it fits (a queue of long
prompts waiting for a prefill slot). Down only when one replica fewer would still run under
`scale_down_utilization`: the band between the two thresholds, and Serve's delays, are the
hysteresis; down one replica at a time, since a replica is dear to start again (its weights
load for minutes) and each one that leaves moves its running requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from serve_app.routing.settings import AutoscalingSettings

# What each target replica reports to Serve's autoscaler (TargetReplica.record_autoscaling_stats)
# and the policy reads, by name.
METRICS = ("kv_committed", "kv_total", "slots_reserved", "slots_total", "queued",
           "queued_tokens", "oldest_wait_s", "ttft_p90_s", "draining")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's report. `kv_committed` / `slots_reserved`: its ledger's reservations
    (every caller's); `kv_total` / `slots_total`: its capacity (slots 0: unbounded). The
    queue fields are the callers' admission queues as they last told this replica (every
    replica hears every caller, so the pool's queue is the largest report, not the sum):
    requests waiting, their KV tokens (prompt + max_tokens), the oldest wait, and the p90
    time to first token the callers measured."""

    kv_committed: float = 0.0
    kv_total: float = 0.0
    slots_reserved: float = 0.0
    slots_total: float = 0.0
    queued: float = 0.0
    queued_tokens: float = 0.0
    oldest_wait_s: float = 0.0
    ttft_p90_s: float = 0.0
    draining: bool = False

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> ReplicaLoad:
        return cls(**{k: float(metrics.get(k, 0.0)) for k in METRICS if k != "draining"},
                   draining=bool(metrics.get("draining", 0.0)))


@dataclass(frozen=True)
class Decision:
    """How many replicas, and why: `reason` is one of kv, slots (sized for that resource),
    queue_wait, ttft (one more: the wait or the TTFT is over its bound), underused (one
    fewer), within_band (no change), starting (replicas still starting: sized ones only),
    no_reports (nothing reported yet: no change). `load`: the numbers it decided on."""

    replicas: int
    reason: str
    load: dict[str, float]


def decide(settings: AutoscalingSettings, running: int, target: int,
           loads: Sequence[ReplicaLoad]) -> Decision:
    """The pool's size. `running`: replicas serving; `target`: the size Serve is moving to
    (more than running while new replicas start: their capacity is on its way, so the
    wait and TTFT rules do not add another); `loads`: the running replicas' reports."""
    serving = [r for r in loads if not r.draining and r.kv_total > 0]
    if not serving:
        return Decision(target, "no_reports", {})
    kv_each = sum(r.kv_total for r in serving) / len(serving)
    slots_each = sum(r.slots_total for r in serving) / len(serving)
    queued = max(r.queued for r in loads)
    demand_kv = sum(r.kv_committed for r in loads) + max(r.queued_tokens for r in loads)
    demand_slots = sum(r.slots_reserved for r in loads) + queued
    wait = max(r.oldest_wait_s for r in loads)
    ttft = max(r.ttft_p90_s for r in loads)
    load = {"demand_kv_tokens": demand_kv, "demand_slots": demand_slots, "queued": queued,
            "oldest_wait_s": wait, "ttft_p90_s": ttft, "kv_tokens_per_replica": kv_each,
            "slots_per_replica": slots_each}

    def needed(utilization: float) -> tuple[int, str]:
        kv = math.ceil(demand_kv / (utilization * kv_each))
        slots = math.ceil(demand_slots / (utilization * slots_each)) if slots_each > 0 else 0
        return (kv, "kv") if kv >= slots else (slots, "slots")

    up, reason = needed(settings.target_utilization)
    starting = target > running
    if not starting:
        if queued > 0 and wait > settings.max_queue_wait_s and up <= target:
            up, reason = target + 1, "queue_wait"
        elif settings.ttft_slo_s is not None and ttft > settings.ttft_slo_s and up <= target:
            up, reason = target + 1, "ttft"
    if up > target:
        return Decision(min(up, target + settings.max_step), reason, load)
    down, _ = needed(settings.scale_down_utilization)
    if down < target and not starting and queued == 0:
        return Decision(target - 1, "underused", load)
    return Decision(target, "starting" if starting else "within_band", load)


def decision_record(decision: Decision) -> dict[str, Any]:
    """A decision as the policy's state and the log carry it (JSON)."""
    return asdict(decision)
