"""The Serve app for real: Ray, serve.run, HTTP, the official openai client."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from app_configs import INGRESS, tiny_app
from ray import serve
from tiny_models import served, write_tiny_serving_pair

from serve_app.app import ConfigError, validate
from serve_app.chat.jinja_render import apply_chat_template
from serve_app.config import AppConfig
from serve_app.engines.reference.builder import build_engine, build_runner
from serve_app.protocol.generation import SamplingParams
from serve_app.tokenizer import load_tokenizer

pytestmark = pytest.mark.ray_cluster("shared")

MODEL = "tiny-kimi-dspark"



def app_config(paths: dict[str, Path], **overrides: Any) -> dict[str, Any]:
    """The module's app, each of `overrides` updating its section one level deep."""
    cfg = tiny_app(paths, MODEL, engine={"reference": {"speculation": {"enabled": True}}},
                   parallelism={"tp": 2}, ingress=INGRESS)
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_tiny_serving_pair(tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="module")
def server(paths: dict[str, Path]) -> Any:
    cfg = AppConfig.model_validate(app_config(paths))
    with served(cfg) as port:
        yield f"http://127.0.0.1:{port}", cfg


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def direct(paths: dict[str, Path], server: Any) -> Any:
    """The same engine, in-process, TP 1: what the HTTP path must reproduce (greedy)."""
    cfg: AppConfig = server[1]
    tokenizer = load_tokenizer(paths["target"])
    engine = build_engine(build_runner(paths["target"], paths["draft"], cfg.engine.reference),
                          cfg.engine.reference, [tokenizer.eos_token_id], tokenizer.decode)
    return engine, tokenizer


def target_handle() -> Any:
    return serve.get_deployment_handle("TargetDeployment", app_name="kimi")


# --- happy paths --------------------------------------------------------------------------------


def test_chat_completion_matches_the_engine(client: openai.OpenAI, direct: Any) -> None:
    engine, tokenizer = direct
    messages = [{"role": "user", "content": "def hello(name):"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                          temperature=0)
    expected = engine.generate([apply_chat_template(tokenizer, messages)],
                               SamplingParams(temperature=0, max_tokens=24))[0]
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.completion_tokens == expected.completion_tokens
    assert resp.usage.prompt_tokens == len(apply_chat_template(tokenizer, messages))
    extra = resp.usage.model_extra
    assert extra["spec_verify_ct"] >= 1
    # SGLang's definition: completion tokens per verify step (the bonus token included).
    assert extra["spec_accept_length"] == pytest.approx(
        resp.usage.completion_tokens / extra["spec_verify_ct"])
    assert sum(extra["spec_correct_drafts_histogram"]) == extra["spec_verify_ct"]


def test_completion_streaming_with_usage(client: openai.OpenAI, direct: Any) -> None:
    engine, tokenizer = direct
    prompt = "import os\nprint("
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    expected = engine.generate([tokenizer.encode(prompt)],
                               SamplingParams(temperature=0, max_tokens=20))[0]
    assert text == expected.text
    assert usage is not None and usage.completion_tokens == expected.completion_tokens
    assert usage.model_extra["spec_accept_length"] >= 1.0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_chat_streaming_and_completion_non_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "quick brown"}], max_tokens=12,
        temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "quick brown"}], max_tokens=12,
        temperature=0)
    assert content == plain.choices[0].message.content
    done = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0.7,
                                     seed=3)
    again = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5,
                                      temperature=0.7, seed=3)
    assert done.choices[0].text == again.choices[0].text  # seeded sampling is reproducible
    assert done.usage.prompt_tokens == 3


def test_concurrent_streams(server: Any, client: openai.OpenAI) -> None:
    prompts = ["def hello", "The quick", "import os", "print(os"]
    sequential = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
                  .choices[0].text for p in prompts]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(all_at_once()) == sequential


def test_models_and_health(server: Any) -> None:
    models = httpx.get(server[0] + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}
    handle = target_handle()
    placement = handle.placement.remote().result()
    assert [p["rank"] for p in placement] == [0, 1]
    handle.check_health.remote().result()  # a real 1-token generation through both ranks


# --- bad requests: clear errors, and the server keeps serving -----------------------------------


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ("{not json", 400, "not valid JSON"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
         400, "temperature"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
         400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
         400, "limit"),
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-4"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n > 1"),
    ],
)
def test_malformed_requests(server: Any, client: openai.OpenAI, body: Any, status: int,
                            needle: str) -> None:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    resp = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                      headers={"content-type": "application/json"}, **kwargs)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert needle in error["message"] and error["type"]
    ok = client.completions.create(model=MODEL, prompt="def", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_prompt_longer_than_context(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=[5] * 2100, max_tokens=16)
    assert exc.value.status_code == 400
    assert "maximum context length is 2048 tokens" in exc.value.message
    assert exc.value.code == "context_length_exceeded"


def test_client_disconnect_aborts_the_generation(server: Any) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "temperature": 0.8,
            "ignore_eos": True, "stream": True}
    handle = target_handle()
    before = handle.stats.remote().result()
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 30
    while time.time() < deadline:
        stats, capacity = handle.stats.remote().result(), handle.capacity.remote().result()
        if stats["running"] == 0 and capacity["kv_tokens_used"] == 0:
            break
        time.sleep(0.2)
    assert stats["running"] == 0 and capacity["kv_tokens_used"] == 0
    # It was aborted, not run to the end: the replica's finished requests never gained its 400
    # tokens (an aborted request's are not counted; a health check's one-token requests are).
    assert stats["completion_tokens"] - before["completion_tokens"] < body["max_tokens"], (
        before, stats)


# --- config errors ------------------------------------------------------------------------------


def _config_error(paths: dict[str, Path], **overrides: Any) -> str:
    with pytest.raises((ConfigError, ValueError)) as exc:
        validate(AppConfig.model_validate(app_config(paths, **overrides)))
    return str(exc.value)


def test_config_errors_name_the_field(paths: dict[str, Path], tmp_path: Path) -> None:
    assert "parallelism.tp (3) x parallelism.pp (1) = 3 ranks must split evenly over " \
        "parallelism.nodes (2)" in _config_error(paths, parallelism={"tp": 3, "nodes": 2})
    # The devices per node follow from tp / nodes: one value, one field.
    assert "parallelism.devices_per_node is not a field" in _config_error(
        paths, parallelism={"tp": 2, "devices_per_node": 2})
    assert "parallelism.pp=2: the reference engine has no pipeline parallelism" in _config_error(
        paths, parallelism={"tp": 1, "pp": 2, "nodes": 1})
    assert "engine.max_model_len=9999 exceeds" in _config_error(
        paths, engine={"max_model_len": 9999})
    assert "speculation.gamma=9 exceeds the draft's block_size=7" in _config_error(
        paths, engine={"reference": {"speculation": {"gamma": 9}}})
    # A draft that taps a layer the target does not have, with another vocabulary.
    import json
    import shutil

    bad = tmp_path / "bad-draft"
    shutil.copytree(paths["draft"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 9]
    cfg["num_target_layers"] = 12
    cfg["vocab_size"] = 400
    (bad / "config.json").write_text(json.dumps(cfg))
    message = _config_error(paths, models={"draft": str(bad)})
    assert "target_layer_ids [9] do not exist in the target" in message
    assert "draft vocab_size=400 != target vocab_size=320" in message
    with pytest.raises(ValueError, match=r"speculation\.enabled=true needs models\.draft"):
        AppConfig.model_validate(app_config(paths, models={"draft": None}))
    with pytest.raises(ValueError, match=r"placement\.strategy"):
        AppConfig.model_validate(app_config(paths, placement={"strategy": "RANDOM"}))
    # Disaggregation: each side's layout is checked against the models like the app's.
    pd = {"enabled": True}
    assert "disaggregation.decode: parallelism.tp=3 cannot shard" in _config_error(
        paths, disaggregation={**pd, "decode": {"parallelism": {"tp": 3}}})
