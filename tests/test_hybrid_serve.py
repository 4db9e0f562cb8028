"""The Serve app on the random miniature K3 pair (KDA + MLA hybrid, its DSpark draft), for real:
Ray, serve.run, TP 2 inside the replica, HTTP, the official openai client."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from app_configs import INGRESS, tiny_app
from ray import serve
from tiny_models import served, write_k3_serving_pair

from serve_app.chat.jinja_render import apply_chat_template
from serve_app.config import AppConfig
from serve_app.engines.reference.builder import build_engine, build_runner
from serve_app.models.k3_paged import PagedK3
from serve_app.protocol.generation import SamplingParams
from serve_app.tokenizer import load_tokenizer

pytestmark = pytest.mark.ray_cluster("shared")

MODEL = "mini-k3-dspark"
SLOTS = 3


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_k3_serving_pair(tmp_path_factory.mktemp("k3serving"))


@pytest.fixture(scope="module")
def server(paths: dict[str, Path]) -> Any:
    cfg = AppConfig.model_validate(tiny_app(
        paths, MODEL,
        engine={"reference": {"state_slots": SLOTS, "prefill_chunk_tokens": 48,
                              "speculation": {"kda_rollback": "replay"}}},
        parallelism={"tp": 2}, ingress=INGRESS))
    with served(cfg) as port:
        yield f"http://127.0.0.1:{port}", cfg


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def slots_in_use() -> list[int]:
    handle = serve.get_deployment_handle("TargetDeployment", app_name="kimi")
    return [info["state_slots_used"] for info in
            handle.broadcast("routing_info").results(timeout_s=30)]


def test_streams_the_hybrid_pair_with_acceptance_stats(server: Any, client: openai.OpenAI,
                                                       paths: dict[str, Path]) -> None:
    cfg: AppConfig = server[1]
    tokenizer = load_tokenizer(paths["target"])
    engine = build_engine(build_runner(paths["target"], paths["draft"], cfg.engine.reference),
                          cfg.engine.reference, [tokenizer.eos_token_id], tokenizer.decode)
    assert isinstance(engine.runner.target, PagedK3)
    messages = [{"role": "user", "content": "def hello(name):\n" * 6}]  # > one prefill chunk
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    # TP 2 in the replica == TP 1 in this process (greedy).
    expected = engine.generate([apply_chat_template(tokenizer, messages)],
                               SamplingParams(temperature=0, max_tokens=24))[0]
    assert text == expected.text
    assert usage is not None and usage.completion_tokens == expected.completion_tokens
    extra = usage.model_extra
    assert extra["spec_verify_ct"] >= 1
    assert sum(extra["spec_correct_drafts_histogram"]) == extra["spec_verify_ct"]
    assert extra["spec_accept_length"] == pytest.approx(
        usage.completion_tokens / extra["spec_verify_ct"])


def test_the_router_reports_the_replicas_state_slots(server: Any) -> None:
    state = httpx.get(server[0] + "/v1/router", timeout=30).json()
    assert [r["state_slots_total"] for r in state["replicas"].values()] == [SLOTS]


def test_a_dropped_stream_gives_its_state_slot_back(server: Any) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert slots_in_use() == [1]
    deadline = time.monotonic() + 30
    while slots_in_use() != [0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert slots_in_use() == [0]
