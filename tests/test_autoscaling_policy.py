"""The autoscaling policy (serve_app/routing/autoscaling.py) against hand computations, and its
Serve adapter fed a real `ray.serve.config.AutoscalingContext`: sized for the reserved and
queued KV tokens and state slots at the target utilization, one more for a queue wait or a
TTFT over its bound (not while replicas start), one fewer only below the scale-down
threshold, nothing counted of a leaving replica's capacity."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from serve_app.routing.autoscaling import ReplicaLoad, decide
from serve_app.routing.settings import AutoscalingSettings

S = AutoscalingSettings(min_replicas=1, max_replicas=8, target_utilization=0.75,
                        scale_down_utilization=0.45, max_queue_wait_s=5.0, ttft_slo_s=2.0,
                        max_step=4)
KV, SLOTS = 10_000.0, 16.0


def replica(kv: float = 0, slots: float = 0, **queue: float) -> ReplicaLoad:
    return ReplicaLoad(kv_committed=kv, kv_total=KV, slots_reserved=slots, slots_total=SLOTS,
                       **queue)


def test_sized_for_the_committed_and_queued_kv_at_the_target_utilization() -> None:
    # Two replicas, 7,000 + 6,000 committed, 4,000 queued: 17,000 / (0.75 x 10,000) = 3.
    loads = [replica(7000, 3, queued=2, queued_tokens=4000),
             replica(6000, 3, queued=2, queued_tokens=4000)]
    d = decide(S, 2, 2, loads)
    assert (d.replicas, d.reason) == (math.ceil(17_000 / 7_500), "kv")
    assert d.load["demand_kv_tokens"] == 17_000 and d.load["queued"] == 2


def test_sized_for_state_slots_when_they_bind_first() -> None:
    # Many short requests: 30 slots + 10 queued = 40 / (0.75 x 16) = 4 replicas; KV says 1.
    loads = [replica(1000, 15, queued=10, queued_tokens=500), replica(1000, 15, queued=10)]
    d = decide(S, 2, 2, loads)
    assert (d.replicas, d.reason) == (4, "slots")


def test_a_step_adds_at_most_max_step() -> None:
    loads = [replica(10_000, 16, queued=200, queued_tokens=500_000)]
    assert decide(S, 1, 1, loads).replicas == 1 + S.max_step


def test_a_long_wait_adds_one_even_when_the_sizes_fit() -> None:
    loads = [replica(2000, 2, queued=1, queued_tokens=100, oldest_wait_s=6.0)]
    d = decide(S, 1, 1, loads)
    assert (d.replicas, d.reason) == (2, "queue_wait")
    # Not while a replica is starting: its capacity is on its way (a K3 cold start takes
    # minutes, and adding one per decision meanwhile would overshoot).
    assert (decide(S, 1, 2, loads).replicas, decide(S, 1, 2, loads).reason) == (2, "starting")


def test_a_ttft_over_the_slo_adds_one() -> None:
    d = decide(S, 2, 2, [replica(5000, 4, ttft_p90_s=2.5), replica(5000, 4)])
    assert (d.replicas, d.reason) == (3, "ttft")
    no_slo = S.model_copy(update={"ttft_slo_s": None})
    assert decide(no_slo, 2, 2, [replica(5000, 4, ttft_p90_s=2.5), replica(5000, 4)]
                  ).reason == "within_band"


def test_the_band_between_the_thresholds_holds_the_size() -> None:
    # 3 replicas, 12,000 committed: 2 would run at 0.60 (over 0.45, under 0.75): hold.
    loads = [replica(4000, 2)] * 3
    d = decide(S, 3, 3, loads)
    assert (d.replicas, d.reason) == (3, "within_band")
    # 3 replicas, 8,000 committed: 2 would run at 0.40: one fewer, one at a time.
    loads = [replica(8000 / 3, 1)] * 3
    d = decide(S, 3, 3, loads)
    assert (d.replicas, d.reason) == (2, "underused")
    idle = [replica()] * 3
    assert decide(S, 3, 3, idle).replicas == 2  # never more than one fewer a decision


def test_nothing_leaves_while_requests_wait_or_replicas_start() -> None:
    assert decide(S, 3, 3, [replica(100, 1, queued=1, queued_tokens=50)] * 3).replicas == 3
    assert decide(S, 2, 3, [replica()] * 2).reason == "starting"


def test_a_leaving_replica_counts_its_load_not_its_capacity() -> None:
    leaving = ReplicaLoad(kv_committed=6000, kv_total=KV, slots_reserved=2,
                          slots_total=SLOTS, draining=True)
    d = decide(S, 2, 2, [leaving, replica(3000, 2)])
    # 9,000 / 7,500 = 2, sized on the replica that stays.
    assert d.replicas == 2 and d.load["kv_tokens_per_replica"] == KV


def test_no_reports_keeps_the_size() -> None:
    assert (decide(S, 2, 2, []).replicas, decide(S, 2, 2, []).reason) == (2, "no_reports")


def test_the_settings_refuse_a_band_that_would_flap() -> None:
    with pytest.raises(ValidationError, match="scale_down_utilization"):
        AutoscalingSettings(target_utilization=0.5, scale_down_utilization=0.6)
    with pytest.raises(ValidationError, match="min_replicas=3 exceeds"):
        AutoscalingSettings(min_replicas=3, max_replicas=2)


def test_the_serve_adapter_reads_servess_context() -> None:
    """A real AutoscalingContext, as Serve's controller builds it: per-metric, per-replica
    averages in; the count and the decision (with its reason) in the policy state out."""
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from serve_app.routing.serve_autoscaling import LedgerPolicy

    dep = DeploymentID(name="TargetDeployment", app_name="kimi")
    r1, r2 = ReplicaID("a", dep), ReplicaID("b", dep)
    metrics = {"kv_committed": {r1: 7000.0, r2: 6000.0}, "kv_total": {r1: KV, r2: KV},
               "slots_reserved": {r1: 3.0, r2: 3.0}, "slots_total": {r1: SLOTS, r2: SLOTS},
               "queued_tokens": {r1: 4000.0, r2: 4000.0}, "queued": {r1: 2.0, r2: 2.0}}
    ctx = AutoscalingContext(
        deployment_id=dep, deployment_name="TargetDeployment", app_name="kimi",
        current_num_replicas=2, target_num_replicas=2, running_replicas=[r1, r2],
        total_num_requests=6.0, total_queued_requests=0.0, aggregated_metrics=metrics,
        raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=0.0, config=AutoscalingConfig(min_replicas=1, max_replicas=8))
    replicas, state = LedgerPolicy(**S.model_dump())(ctx)
    assert replicas == 3
    assert state["decision"]["reason"] == "kv" and state["decision"]["replicas"] == 3


def test_the_config_tree_places_autoscaling_where_it_applies() -> None:
    """placement.autoscaling for an aggregated app, each side's for a disaggregated one (each
    pool follows its own load): the other way round is refused, naming the field; each side
    of a disaggregated app runs its own section."""
    from serve_app.config import AppConfig

    models = {"target": "/models/t", "draft": "/models/d"}
    pools = {"prefill": {"autoscaling": {"max_replicas": 3}},
             "decode": {"autoscaling": {"max_replicas": 5}}}
    with pytest.raises(ValidationError, match=r"placement\.autoscaling: a disaggregated app"):
        AppConfig.model_validate({"models": models, "placement": {"autoscaling": {}},
                                  "disaggregation": {"enabled": True}})
    with pytest.raises(ValidationError, match=r"disaggregation\.\*\.autoscaling: for a disagg"):
        AppConfig.model_validate({"models": models, "disaggregation": pools})
    app = AppConfig.model_validate({"models": models,
                                    "disaggregation": {"enabled": True, **pools}})
    assert [app.autoscaling(side).max_replicas for side in ("prefill", "decode")] == [3, 5]
    assert app.autoscaling() is None
    # Each side's replicas validate the config they are given again (app.py passes it as
    # JSON), and it still tells their pool's autoscaling.
    for side, most in (("prefill", 3), ("decode", 5)):
        again = AppConfig.model_validate_json(app.side(side).model_dump_json())
        assert again.autoscaling(side).max_replicas == most
