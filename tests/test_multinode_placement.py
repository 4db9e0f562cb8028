"""Multi-node placement on a simulated cluster: two nodes with two fake GPUs each."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import pytest
from app_configs import tiny_app
from ray import serve
from tiny_models import fake_gpu_cluster, write_tiny_serving_pair

from serve_app.app import build_app
from serve_app.config import AppConfig, ReferenceEngineConfig
from serve_app.engines.reference.builder import build_engine, build_runner
from serve_app.protocol.generation import GenerateRequest, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("own")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    paths = write_tiny_serving_pair(tmp_path_factory.mktemp("multinode"))
    with fake_gpu_cluster(nodes=2, cpus_per_node=2, gpus_per_node=2, head_cpus=2) as (_, nodes):
        yield paths, nodes


def test_two_nodes_two_gpus_each(cluster: Any) -> None:
    paths, gpu_nodes = cluster
    config = AppConfig.model_validate(tiny_app(
        paths, model=None, engine={"reference": {"kv_capacity_tokens": 2048}},
        parallelism={"tp": 4, "nodes": 2},
        # Fake GPUs: Ray schedules by them; the tiny model computes on CPU (its collectives
        # through shared memory: the fake nodes are one host).
        placement={"accelerator": "GPU"}))
    assert config.strategy == "STRICT_SPREAD"
    assert config.bundles() == [{"CPU": 0.5, "GPU": 2.0}, {"CPU": 0.5, "GPU": 2.0}]
    serve.run(build_app(config), name="kimi", route_prefix=None)
    handle = serve.get_deployment_handle("TargetDeployment", app_name="kimi")

    placement = handle.placement.remote().result()
    assert sorted(p["rank"] for p in placement) == [0, 1, 2, 3]
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in placement:
        by_node[p["node_id"]].append(p)
    assert set(by_node) == gpu_nodes  # both GPU nodes, nothing on the GPU-less head
    for ranks in by_node.values():
        assert len(ranks) == 2
        assert sorted(p["device_index"] for p in ranks) == [0, 1]
        assert all(len(p["gpu_ids"]) == 1 for p in ranks)
    # Ranks 0-1 share bundle 0's node, ranks 2-3 bundle 1's.
    node_of = {p["rank"]: p["node_id"] for p in placement}
    assert node_of[0] == node_of[1] != node_of[2] == node_of[3]

    # TP 4 generates what a single-process engine generates (greedy).
    prompt = [5, 17, 42, 8, 99]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def collect() -> list[int]:
        tokens: list[int] = []
        stream = handle.options(stream=True).generate.remote(GenerateRequest("r0", prompt, params))
        async for out in stream:
            tokens += out.token_ids
        return tokens

    served = asyncio.run(collect())
    engine_cfg = ReferenceEngineConfig(kv_capacity_tokens=2048)
    local = build_engine(build_runner(paths["target"], paths["draft"], engine_cfg), engine_cfg)
    assert served == local.generate([prompt], params)[0].token_ids
    handle.check_health.remote().result()
    assert handle.stats.remote().result()["spec_verify_ct"] >= 1

