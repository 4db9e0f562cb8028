"""Plans: feasibility facts (what holds K3), ranking, Pareto frontier, errors."""

from __future__ import annotations

import pytest

from capacity import (
    CapacityError,
    Layout,
    Workload,
    describe_model,
    load_gpus,
    load_prices,
    memory_per_gpu,
    plan,
)
from capacity.planner import explain_infeasible


@pytest.fixture(scope="module")
def env():
    return (describe_model("kimi-k3"), describe_model("kimi-k3-dspark"), load_gpus(),
            load_prices())


def fits(env, gpu: str, nodes: int) -> bool:
    k3, draft, gpus, _ = env
    spec = gpus[gpu]
    world = nodes * spec.gpus_per_node
    layout = Layout(gpu=gpu, nodes=nodes, tp=world, ep=world)
    return memory_per_gpu(k3, layout, Workload(context_length=8192), spec, draft).fits


def test_which_fleets_hold_k3s_weights(env):
    # 8 x H200 cannot hold the weights; MI300X needs 16; MI325X and MI355X
    # fit in 8; the published H200 recipe (SGLang cookbook) is 2 nodes x 8.
    assert not fits(env, "H200", 1) and fits(env, "H200", 2)
    assert not fits(env, "MI300X", 1) and fits(env, "MI300X", 2)
    assert fits(env, "MI325X", 1) and fits(env, "MI355X", 1)


def test_plan_ranks_by_cost_per_token(env):
    k3, draft, gpus, prices = env
    result = plan(k3, gpus, prices, 131_072, draft, allowed_gpus=["MI300X", "H100", "H200"],
                  max_nodes=4)
    costs = [r.usd_per_million_tokens for r in result.rows if r.usd_per_million_tokens]
    assert costs == sorted(costs) and len(costs) > 5
    top = result.rows[0]
    assert top.memory.fits and top.memory.max_concurrent >= top.concurrency_per_replica
    assert top.price is not None and top.price.usd_per_gpu_hour > 0
    assert {r.layout.gpu for r in result.rows} <= {"MI300X", "H100", "H200"}
    # DSpark runs pipeline stages only on a PD prefill server: an aggregated plan has none,
    # where the same plan without the draft offers them.
    assert all(r.layout.pp == 1 for r in result.rows)
    plain = plan(k3, gpus, prices, 131_072, None, allowed_gpus=["MI300X", "H100", "H200"],
                 max_nodes=4)
    assert any(r.layout.pp > 1 for r in plain.rows)


def test_pareto_frontier_is_not_dominated(env):
    k3, draft, gpus, prices = env
    result = plan(k3, gpus, prices, 131_072, draft, max_nodes=3)
    frontier = result.pareto()
    priced = [r for r in result.rows if r.usd_per_hour is not None]
    assert len(frontier) >= 2
    for row in frontier:
        assert not any(o.usd_per_hour < row.usd_per_hour and o.total_tokens_s > row.total_tokens_s
                       for o in priced)


def test_concurrency_adds_replicas(env):
    k3, draft, gpus, prices = env
    result = plan(k3, gpus, prices, 131_072, draft, allowed_gpus=["H200"], max_nodes=2,
                  concurrency=100)
    row = result.rows[0]
    assert row.replicas * row.concurrency_per_replica >= 100
    assert row.concurrency_per_replica <= row.memory.max_concurrent


def test_infeasible_explains_why(env):
    k3, draft, gpus, prices = env
    result = plan(k3, gpus, prices, 1_048_576, draft, allowed_gpus=["H100"], max_nodes=2)
    assert not result.rows
    message = explain_infeasible(result, 2)
    assert "H100" in message and "GB per GPU" in message


def test_bad_inputs(env):
    k3, _draft, gpus, prices = env
    with pytest.raises(CapacityError, match="unknown GPU 'TPU'"):
        plan(k3, gpus, prices, 8192, allowed_gpus=["TPU"])
    with pytest.raises(CapacityError, match="exceeds"):
        plan(k3, gpus, prices, 2_000_000)
    with pytest.raises(CapacityError, match="concurrency must be positive"):
        plan(k3, gpus, prices, 8192, concurrency=0)
