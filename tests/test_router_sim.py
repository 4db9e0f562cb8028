"""A small simulator run on the capacity planner's K3 + DSpark 2 x 8 H200 model: invariants."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from serve_app.routing import RouterSettings, make_policy

# The simulator lives beside its only other user, bench/router_sim.py; bench/ is a folder of
# scripts, not a package, so it is put on the path here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from router_simulator import (
    SLO,
    CostModel,
    FleetSpec,
    WorkloadSpec,
    generate_workload,
    load_trace,
    run_policies,
    simulate,
)

FLEET = FleetSpec(replicas=2)
WORK = WorkloadSpec(rate=0.5, duration_s=120.0, seed=3)


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel(FLEET)


def test_cost_model_comes_from_the_planner(cost: CostModel) -> None:
    from capacity.timing import prefill_seconds

    assert 1_048_576 < cost.kv_tokens < 2_000_000  # FP8 KV, 16 KDA state slots
    assert cost.prefill_s(1_048_576) == pytest.approx(
        prefill_seconds(cost.model, cost.layout, cost.gpu, 1_048_576))
    step_s, per_request = cost.decode_step(8, 4096)
    assert per_request == pytest.approx(FLEET.acceptance_length)
    assert 0.005 < step_s < 0.2


@pytest.mark.parametrize("name", ["round_robin", "power_of_two", "cache_aware", "kv_aware"])
def test_every_request_accounted_and_capacity_never_exceeded(cost: CostModel, name: str) -> None:
    s = RouterSettings()
    reqs = generate_workload(WORK, s.block_size, 1 << 20)
    assert reqs and {r.cls for r in reqs} == {"short", "long"}
    outs, reps, _, _ = simulate(reqs, cost, make_policy(s, name), drain_s=1800)
    assert len(outs) == len(reqs)
    assert {o.status for o in outs} <= {"ok", "rejected_429", "rejected_400", "timeout_503"}
    assert all(r.max_used <= r.kv_total for r in reps)  # the engine also asserts it per admit
    assert all(r.max_running <= r.slots_total == FLEET.max_running for r in reps)
    for o in outs:
        if o.status == "ok":
            assert o.arrival <= o.routed_at <= o.admitted_at <= o.first_token <= o.finished
    if name == "kv_aware":
        # With admission nothing waits for KV or a state slot inside an engine.
        assert all(not r.waiting for r in reps)
        assert all(r.slot_waits == 0 for r in reps)


def test_kv_aware_holds_what_finds_no_state_slot_baselines_send_it() -> None:
    """Two state slots per replica (max running requests) and KV for many more: the
    baselines send requests to replicas whose slots are taken (they wait inside the engine,
    unseen by the router); kv_aware, told each replica's slots, holds them in its own queue
    and still serves every request."""
    fleet = FleetSpec(replicas=2, max_running=2)
    cost = CostModel(fleet)
    s = RouterSettings()
    reqs = generate_workload(WORK, s.block_size, 1 << 20)
    _, base, _, _ = simulate(reqs, cost, make_policy(s, "round_robin"), drain_s=1800)
    assert sum(r.slot_waits for r in base) > 0
    outs, reps, _, peak = simulate(reqs, cost, make_policy(s, "kv_aware"), drain_s=1800)
    assert all(o.status == "ok" for o in outs)
    assert all(r.slot_waits == 0 and r.max_running <= 2 for r in reps)
    assert peak > 0  # they waited in the router instead


def test_seeded_runs_are_deterministic() -> None:
    rows1, _ = run_policies(["kv_aware", "cache_aware"], [0.5], FLEET, WORK, RouterSettings(),
                            SLO(), drain_s=1800)
    rows2, _ = run_policies(["kv_aware", "cache_aware"], [0.5], FLEET, WORK, RouterSettings(),
                            SLO(), drain_s=1800)
    assert json.dumps(rows1, sort_keys=True) == json.dumps(rows2, sort_keys=True)


def test_trace_from_jsonl(tmp_path: Path, cost: CostModel) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [{"arrival": 0.0, "prompt_tokens": 200_000, "output_tokens": 100, "doc": 1,
              "doc_tokens": 199_936},
             {"arrival": 1.0, "prompt_tokens": 200_100, "output_tokens": 100, "doc": 1,
              "doc_tokens": 199_936},
             {"arrival": 2.0, "prompt_tokens": 500, "output_tokens": 50}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    reqs = load_trace(path, 256)
    outs, _, _, _ = simulate(reqs, cost, make_policy(RouterSettings()), drain_s=600)
    assert all(o.status == "ok" for o in outs)
    # The second question reuses the document the first one prefilled.
    assert outs[1].cached_tokens >= 199_936 - 256
    assert outs[1].replica == outs[0].replica


def test_k2_fleet_is_sized_at_k2s_own_context() -> None:
    """The cost model sizes a replica at the model's own context (its descriptor's
    `max_context`), not at K3's 1M: a K2 fleet is sized at 131,072."""
    from capacity import describe_model

    k2 = FleetSpec(model="kimi-k2", draft=None, replicas=2)
    cost = CostModel(k2)
    assert describe_model("kimi-k2").max_context == 131_072
    assert cost.context_length == 131_072 != 1_048_576
    assert cost.kv_tokens > 131_072
