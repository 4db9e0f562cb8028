"""Constrained decoding through the real server: the random mini K3 in K3's chat format (the
hardest case: only the grammar makes an answer valid), speculation on, 16 concurrent clients
mixing json_schema answers, forced tool calls and plain chat, streaming and not; KVV's
k3_features requests (thinking on, as KVV sends no thinking field) closed within their
budget, as the K3-format deployment does (grammar_budget: close)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from app_configs import tiny_app
from bench_runner import json_line, run_bench
from tiny_models import served, write_k3_format_pair

from serve_app.config import AppConfig

pytestmark = pytest.mark.ray_cluster("shared")

MODEL = "k3-grammar"
# The load client is the benchmark's (bench/grammar_load.py): the same requests and checks.
_spec = importlib.util.spec_from_file_location(
    "grammar_load", Path(__file__).resolve().parents[1] / "bench" / "grammar_load.py")
assert _spec and _spec.loader
load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    paths = write_k3_format_pair(tmp_path_factory.mktemp("k3gs"))
    config = AppConfig.model_validate(tiny_app(
        paths, MODEL,
        engine={"reference": {"kv_capacity_tokens": 16384, "max_batch_size": 16,
                              "grammar_budget": "close"}},
        parallelism={"tp": 1}, placement={"replicas": 1}, router={"policy": "ray_default"},
        ingress={"default_max_tokens": 256, "ingress_cpus": 0.1}))
    with served(config) as port:
        yield f"http://127.0.0.1:{port}"


def test_every_constrained_answer_validates_at_16_concurrent_requests(base_url: str) -> None:
    results = asyncio.run(load.run_load(base_url, MODEL, 36, 16,
                                        [load.person, load.forced_call, load.plain]))
    assert [r for r in results if not r["valid"]] == []
    assert all("status" not in r for r in results)  # no error at all, 5xx or otherwise
    # Both streamed and whole answers, and speculation ran under every kind.
    assert all(r["accept"] is not None and r["accept"] >= 1 for r in results)
    assert sum(r["kind"] == "forced_call" for r in results) == 12  # each with its one call


def test_the_load_bench_runs_against_this_server(base_url: str) -> None:
    """bench/grammar_load.py as a script at smoke size: its table's JSON line over its
    five-request cycle (three json_schema answers, one forced call, one plain answer), every
    answer valid and no 5xx."""
    report = json_line(run_bench("bench/grammar_load.py", "--base-url", base_url, "--model",
                                 MODEL, "--requests", "5", "--concurrency", "2"))
    assert report["bench"] == "grammar_load" and report["requests"] == 5
    kinds = report["kinds"]
    assert {k: row["requests"] for k, row in kinds.items()} == {
        "person": 3, "forced_call": 1, "plain": 1}
    assert all(row["valid"] == row["requests"] and row["5xx"] == 0 for row in kinds.values())


def test_a_hostile_schema_is_a_400_naming_the_field_while_others_are_served(
        base_url: str) -> None:
    hostile = {"type": "string", "minLength": 999_999_999_999}

    async def run() -> tuple[httpx.Response, list[dict[str, Any]]]:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        others = [asyncio.create_task(load.answer(client, MODEL, i, load.person))
                  for i in range(4)]
        async with httpx.AsyncClient(timeout=60) as http:
            bad = await http.post(base_url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}],
                **load.THINKING_OFF,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "h", "schema": hostile}}})
        return bad, await asyncio.gather(*others)

    bad, others = asyncio.run(run())
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "Traceback" not in error["message"] and "/" not in error["message"].split(":")[0]
    assert all(load.check("person", r) for r in others)


# KVV's k3_features requests (tests/k3_features/test_tool_choice.py, test_response_format.py at
# 3dad65a): no thinking field, so K3 thinks, and the random model never ends its reasoning.
KVV_WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
KVV_WEATHER_SCHEMA = {"type": "object", "additionalProperties": False,
                      "required": ["city", "temperature"],
                      "properties": {"city": {"type": "string"}, "temperature": {"type": "number"}}}
KVV_REQUESTS = {
    "tool_calls": {"messages": [{"role": "user", "content": "请简要回答：北京天气怎么样？"}],
                   "tools": [KVV_WEATHER_TOOL], "tool_choice": "required"},
    "stop": {"messages": [{"role": "user", "content": "Return the weather of Beijing as JSON."}],
             "response_format": {"type": "json_schema", "json_schema": {
                 "name": "weather", "strict": True, "schema": KVV_WEATHER_SCHEMA}}},
}


@pytest.mark.parametrize("stream", [False, True], ids=["nostream", "stream"])
@pytest.mark.parametrize("finish", list(KVV_REQUESTS))
def test_a_closed_answer_is_complete_with_its_own_finish_reason(
        base_url: str, finish: str, stream: bool) -> None:
    """The forced call and the strict JSON answer end complete within 64 tokens (the random
    model's reasoning is closed for it), with the finish reason of a complete answer (what
    KVV asserts), and the choice says the budget closed it (`grammar_closed`)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "seed": 1, **KVV_REQUESTS[finish]}
    if stream:
        chunks = list(client.chat.completions.create(**body, stream=True))
        final = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(final) == 1
        choice, extra = final[0], final[0].model_extra
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
        arguments = "".join(c.function.arguments or "" for c in calls)
        names = [c.function.name for c in calls if c.function.name]
        tokens = chunks[-1].usage.completion_tokens
    else:
        r = client.chat.completions.create(**body)
        choice, extra = r.choices[0], r.choices[0].model_extra
        content = choice.message.content or ""
        calls = choice.message.tool_calls or []
        arguments = "".join(c.function.arguments for c in calls)
        names = [c.function.name for c in calls]
        tokens = r.usage.completion_tokens
    assert choice.finish_reason == finish
    assert extra.get("grammar_closed") is True
    assert tokens < 64  # ended by its end of message, not cut by max_tokens
    if finish == "tool_calls":
        assert names == ["get_weather"]
        # Not strict: the tool's schema is not enforced (OpenAI's strict: false), its JSON is.
        assert isinstance(json.loads(arguments), dict)
    else:
        jsonschema.validate(json.loads(content), KVV_WEATHER_SCHEMA)
