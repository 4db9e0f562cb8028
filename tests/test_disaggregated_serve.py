"""The Serve app disaggregated, for real: a prefill deployment at TP 2 prefills each request on
its ranks and hands it over (MLA latents, KDA states, the draft's context, re-split to TP 1)
to a decode deployment at TP 1, through Ray's object store; the client streams from the
decode side through the unchanged ingress path, with the official openai client. The answer
is the aggregated engine's, and a dropped stream leaves nothing held on either side."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ray import serve
from tiny_models import served, write_k3_serving_pair

from serve_app.config import AppConfig
from serve_app.engines.reference.builder import build_engine, build_runner
from serve_app.engines.types import SamplingParams
from serve_app.tokenizer import load_tokenizer

MODEL = "mini-k3-pd"


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_k3_serving_pair(tmp_path_factory.mktemp("k3pd"), tiny=True)


@pytest.fixture(scope="module")
def server(paths: dict[str, Path]) -> Any:
    cfg = AppConfig.model_validate({
        "models": {"target": str(paths["target"]), "draft": str(paths["draft"]),
                   "served_model_name": MODEL},
        "engine": {"reference": {"kv_capacity_tokens": 4096, "prefill_chunk_tokens": 48}},
        "placement": {"accelerator": "CPU", "cpus_per_rank": 0.25},
        "router": {"policy": "ray_default"},
        "ingress": {"default_max_tokens": 16, "max_tokens_limit": 512},
        "disaggregation": {"enabled": True, "prefill": {"parallelism": {"tp": 2}},
                           "decode": {"parallelism": {"tp": 1}}},
    })
    with served(cfg) as port:
        yield f"http://127.0.0.1:{port}", cfg


def held(deployment: str) -> list[tuple[int, int]]:
    """(KV tokens used, state slots used) of each replica of `deployment`."""
    handle = serve.get_deployment_handle(deployment, app_name="kimi")
    return [(c["kv_tokens_used"], c["state_slots_used"])
            for c in handle.broadcast("capacity").results(timeout_s=30)]


def holds_nothing(deployment: str) -> bool:
    """Whether `deployment`'s replicas come to hold nothing (within 30 s: Serve's health
    check may be running its one-token generation right now)."""
    deadline = time.monotonic() + 30
    while held(deployment) != [(0, 0)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_disaggregated_answer_is_the_aggregated_engines(server: Any,
                                                          paths: dict[str, Path]) -> None:
    url, cfg = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tokenizer = load_tokenizer(paths["target"])
    engine = build_engine(build_runner(paths["target"], paths["draft"], cfg.engine.reference),
                          cfg.engine.reference, [tokenizer.eos_token_id], tokenizer.decode)
    messages = [{"role": "user", "content": "def hello(name):\n" * 6}]  # > one prefill chunk
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    expected = engine.generate([tokenizer.apply_chat_template(messages)],
                               SamplingParams(temperature=0, max_tokens=24))[0]
    assert text == expected.text
    assert usage is not None and usage.completion_tokens == expected.completion_tokens
    extra = usage.model_extra  # the decode side's speculation
    assert extra["spec_verify_ct"] >= 1
    assert extra["spec_accept_length"] == pytest.approx(
        usage.completion_tokens / extra["spec_verify_ct"])
    assert holds_nothing("TargetDeployment") and holds_nothing("DecodeDeployment")


def test_a_dropped_stream_leaves_nothing_held(server: Any) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert held("DecodeDeployment")[0][1] >= 1  # decoding there
        assert holds_nothing("TargetDeployment")  # handed over: nothing on the prefill side
    assert holds_nothing("DecodeDeployment")


def test_a_prefill_replica_that_dies_mid_answer_frees_the_decode_side(server: Any) -> None:
    """The prefill replica relays the decode side's stream; killed after the hand-over, its
    client's stream ends and the decode replica (which watches it as its caller) aborts the
    request. Last in the module: Serve replaces the killed replica."""
    import ray

    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if "TargetDeployment" in a["name"] and a["name"].startswith("SERVE_REPLICA")]
    assert len(names) == 1
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert held("DecodeDeployment")[0][1] >= 1
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)
        with pytest.raises(httpx.HTTPError):
            for _ in lines:  # the stream breaks (or ends) without its 500 tokens
                pass
            raise httpx.ReadError("ended")
    assert holds_nothing("DecodeDeployment")
