"""Scaling that needs nodes gets them: a cluster whose GPU nodes Ray's own autoscaler starts
and stops (its fake multi-node provider: each node a raylet on this machine with one fake
GPU). A target replica of the tiny serving pair runs TP 2 over two nodes (one bundle per
node, STRICT_SPREAD, as a K3 replica spans its nodes); a second replica's placement group
asks the autoscaler for two more nodes, its ranks land on them, spread; after the scale-down
the idle nodes go away. The deployment is scaled as an operator's config file scales it (a
lightweight update of `num_replicas`): the autoscaling policy's decision reaches Serve the
same way."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from app_configs import tiny_app
from ray import serve
from tiny_models import deploy_declared, fake_autoscaling_cluster, wait_for, write_tiny_serving_pair

from serve_app.config import AppConfig
from serve_app.netutil import free_port
from serve_app.protocol.generation import GenerateRequest, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("own")]


def _placements() -> list[list[dict[str, Any]]]:
    """Each running target replica's ranks (rank, node_id, ...), one list per replica."""
    handle = serve.get_deployment_handle("TargetDeployment", app_name="kimi")
    return handle.broadcast("placement").results(timeout_s=30)


def _replicas_placed(n: int) -> list[list[dict[str, Any]]] | None:
    try:
        placed = _placements()
    except Exception:  # the deployment is still starting
        return None
    return placed if len(placed) == n else None


def _nodes(ranks: list[dict[str, Any]]) -> frozenset[str]:
    return frozenset(p["node_id"] for p in ranks)


def test_a_replica_that_needs_nodes_gets_them_and_they_leave_with_it(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    paths = write_tiny_serving_pair(tmp_path_factory.mktemp("nodes"))
    config = AppConfig.model_validate(tiny_app(
        paths, model=None, engine={"reference": {"kv_capacity_tokens": 2048}},
        parallelism={"tp": 2, "nodes": 2},
        # Fake GPUs: Ray schedules by them; the tiny model computes on CPU.
        placement={"accelerator": "GPU", "cpus_per_rank": 0.25}))
    assert config.strategy == "STRICT_SPREAD"
    with fake_autoscaling_cluster(node_cpus=1, node_gpus=1, max_nodes=4) as gpu_nodes:
        assert gpu_nodes() == set()  # nothing runs on GPU nodes yet: none started
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        deploy_declared(config, 1)
        one = wait_for(lambda: _replicas_placed(1), 180)
        assert one, "the first replica's nodes never came"
        first_nodes = _nodes(one[0])
        assert len(first_nodes) == 2 and first_nodes <= gpu_nodes()

        deploy_declared(config, 2)  # the scale-up: its placement group needs two new nodes
        two = wait_for(lambda: _replicas_placed(2), 180)
        assert two, "the second replica's nodes never came"
        assert len(gpu_nodes()) == 4
        for ranks in two:
            assert sorted(p["rank"] for p in ranks) == [0, 1]
        # STRICT_SPREAD: each replica's two ranks on two nodes, the replicas on four; the
        # first replica where it was (scaled in place), the new one on the new nodes.
        assert sorted(map(len, map(_nodes, two))) == [2, 2]
        assert len(_nodes(two[0]) | _nodes(two[1])) == 4
        assert first_nodes in set(map(_nodes, two))

        # It serves (TP 2 across its two fake nodes).
        handle = serve.get_deployment_handle("TargetDeployment", app_name="kimi")
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        async def generate() -> list[int]:
            stream = handle.options(stream=True).generate.remote(
                GenerateRequest("r0", [5, 17, 42], params))
            return [t async for out in stream for t in out.token_ids]

        assert len(asyncio.run(generate())) == 4

        deploy_declared(config, 1)  # the scale-down: the leaving replica's nodes go idle
        assert wait_for(lambda: _replicas_placed(1), 120)
        assert wait_for(lambda: len(gpu_nodes()) == 2, 120), gpu_nodes()
        (stayed,) = _placements()
        assert _nodes(stayed) <= gpu_nodes()
        serve.shutdown()
