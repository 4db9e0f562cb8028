"""The placement deployments/kimi_dspark.yaml asks for, executed by Ray on a simulated cluster:
a GPU-free head and 2 nodes x 8 fake GPUs. SGLang is not started: a stand-in for the replica
sits where Serve puts it (bundle 0, no GPU, capturing child tasks) and creates one actor per
GPU exactly as SGLang 0.5.23's RayEngine creates its SchedulerActors (auto placement-group
mode: num_cpus=0, num_gpus=1, PlacementGroupSchedulingStrategy(pg, bundle), node 0 = the
engine's bundle)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import ray
from ray.util.placement_group import (
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from sglang_helpers import app_config, rank_plan
from tiny_models import fake_gpu_cluster

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("own")]


@ray.remote(num_cpus=0, num_gpus=1)
class FakeScheduler:
    """Where a SchedulerActor runs: its node and the GPU Ray assigned it."""

    def __init__(self, tp_rank: int, gpu_id: int) -> None:
        self.tp_rank, self.gpu_id = tp_rank, gpu_id

    def where(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"tp_rank": self.tp_rank, "passed_gpu_id": self.gpu_id,
                "node_id": ctx.get_node_id(),
                "ray_gpu_ids": [int(g) for g in ctx.get_accelerator_ids()["GPU"]]}


@ray.remote
class ReplicaStandIn:
    """The target replica's process: what RayEngine does from inside it."""

    def launch(self, nnodes: int, plans: list[list[tuple[int, int, int]]]) -> dict[str, Any]:
        """`plans[b]`: (tp_rank, bundle, gpu_id) per rank when the engine sits on bundle b
        (rank_plan, computed by the driver: tests/ is not importable on Ray's workers)."""
        pg = get_current_placement_group()  # RayEngine's `ray.util.get_current_placement_group()`
        assert pg is not None
        my_node = ray.get_runtime_context().get_node_id()

        # `_find_engine_bundle`: which bundle is on the engine's node. SGLang compares node IPs;
        # the simulated nodes share one IP, so node ids stand in for them here.
        @ray.remote(num_cpus=0, num_gpus=0)
        def node_of_bundle() -> str:
            return ray.get_runtime_context().get_node_id()

        bundle_nodes = ray.get([node_of_bundle.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
            for i in range(nnodes)])
        engine_bundle = bundle_nodes.index(my_node)
        actors = [FakeScheduler.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle)).remote(tp_rank, gpu_id)
            for tp_rank, bundle, gpu_id in plans[engine_bundle]]
        ranks = ray.get([a.where.remote() for a in actors], timeout=120)
        return {"engine_node": my_node, "engine_bundle": engine_bundle,
                "bundle_nodes": bundle_nodes, "ranks": ranks}


@pytest.fixture(scope="module")
def cluster() -> Any:
    with fake_gpu_cluster(nodes=2, cpus_per_node=2, gpus_per_node=8) as made:
        yield made


def test_production_placement_on_two_fake_h200_nodes(cluster: Any) -> None:
    _, gpu_nodes = cluster
    # The production file, with a small CPU reservation so it fits the simulated nodes.
    config = app_config("deployments/kimi_dspark.yaml", placement={"cpus_per_rank": 0.125})
    assert config.strategy == "STRICT_SPREAD"
    assert config.bundles() == [{"CPU": 1.0, "GPU": 8.0}, {"CPU": 1.0, "GPU": 8.0}]
    pg = placement_group(config.bundles(), strategy=config.strategy)
    ray.get(pg.ready(), timeout=60)
    try:
        # As Serve places a replica: in bundle 0, capturing its children; no GPU of its own
        # (build_app gives the SGLang replica num_gpus=0).
        replica = ReplicaStandIn.options(
            num_cpus=config.placement.cpus_per_rank, num_gpus=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True)).remote()
        nodes, tp = config.parallelism.nodes, config.parallelism.tp
        plans = [[(s.tp_rank, s.bundle_index, s.gpu_id)
                  for s in rank_plan(nodes, tp, engine_bundle=b)] for b in range(nodes)]
        result = ray.get(replica.launch.remote(nodes, plans), timeout=180)
    finally:
        remove_placement_group(pg)

    ranks = result["ranks"]
    assert sorted(r["tp_rank"] for r in ranks) == list(range(16))
    assert set(result["bundle_nodes"]) == gpu_nodes  # STRICT_SPREAD over both GPU nodes
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in ranks:
        by_node[r["node_id"]].append(r)
    assert set(by_node) == gpu_nodes  # nothing on the GPU-free head
    engine_node = result["engine_node"]
    node_of = {r["tp_rank"]: r["node_id"] for r in ranks}
    # Rank 0 (and ranks 0-7) on the replica's node, ranks 8-15 on the other.
    assert {node_of[i] for i in range(8)} == {engine_node}
    assert {node_of[i] for i in range(8, 16)} == gpu_nodes - {engine_node}
    for node_ranks in by_node.values():
        assert len(node_ranks) == 8
        assert sorted(g for r in node_ranks for g in r["ray_gpu_ids"]) == list(range(8))
        assert sorted(r["passed_gpu_id"] for r in node_ranks) == list(range(8))
