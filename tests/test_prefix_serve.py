"""The prefix cache through the whole app, for real: two ingress replicas (Serve's proxy spreads
requests over both) in front of two target replicas of a tiny random K3-layout hybrid with the
prefix cache on. Questions on one document land where the document is cached, whichever ingress
takes them (the other ingress learns it from the engine's cache events, not from its own
dispatch), and each reports its hit in `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import pytest
from app_configs import tiny_k3_app
from ray import serve
from tiny_models import served

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("shared")]

MODEL = "tiny-kimi-dspark"
GRID = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = tiny_k3_app(
        tmp_path_factory.mktemp("prefix"),
        engine={"kv_capacity_tokens": 2048, "state_slots": 4,
                "prefix_cache": {"enabled": True, "snapshot_interval": GRID}},
        ingress={"default_max_tokens": 8, "max_tokens_limit": 512, "replicas": 2,
                 "ingress_cpus": 0.1},
        router={"block_size": 16, "long_threshold": 4096, "client_max_kv_share": 1.0},
        model=MODEL)
    with served(cfg) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                           timeout=180) as client:
        yield client


def _stats() -> dict[str, dict[str, Any]]:
    handle = serve.get_deployment_handle("TargetDeployment", app_name="kimi")
    infos = handle.broadcast("routing_info").results(timeout_s=30)
    stats = handle.broadcast("stats").results(timeout_s=30)
    return {i["replica"]: s for i, s in zip(infos, stats, strict=True)}


def test_questions_on_a_document_land_where_it_is_cached(server: httpx.Client) -> None:
    rng = random.Random(3)
    document = [rng.randrange(20, 300) for _ in range(200)]
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = server.post("/v1/completions", json={**body, "prompt": [*document, 5]})
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(2.5)  # both ingresses read the replicas' cache events (every second)
    before = _stats()
    cached = []
    for q in range(8):  # Serve's proxy spreads these over both ingresses
        r = server.post("/v1/completions", json={**body, "prompt": [*document, 7, q]})
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    # Every question reused the document up to its last KDA snapshot (the grid line at 192).
    assert cached == [192] * 8
    after = _stats()
    gained = {r: after[r]["cached_tokens_total"] - before[r]["cached_tokens_total"]
              for r in after}
    assert sorted(gained.values()) == [0, 8 * 192]  # all on the replica that holds it
    # Streaming reports the hit too.
    with server.stream("POST", "/v1/completions", json={
            **body, "prompt": [*document, 9], "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1][6:])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 192
