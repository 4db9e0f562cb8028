"""Constrained decoding through the real server: the random mini K3 in K3's chat format (the
hardest case: only the grammar makes an answer valid), speculation on, 16 concurrent clients
mixing json_schema answers, forced tool calls and plain chat, streaming and not."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from tiny_models import served, write_k3_format_pair

from serve_app.config import AppConfig

MODEL = "k3-grammar"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "strict": True, "parameters": {
        "type": "object", "$defs": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
        "properties": {"id": {"$ref": "#/$defs/id"}}, "required": ["id"],
        "additionalProperties": False}}}
OFF = {"chat_template_kwargs": {"thinking": False}}  # a random model would think forever


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    paths = write_k3_format_pair(tmp_path_factory.mktemp("k3gs"))
    config = AppConfig.model_validate({
        "models": {"target": str(paths["target"]), "draft": str(paths["draft"]),
                   "served_model_name": MODEL},
        "engine": {"reference": {"kv_capacity_tokens": 16384, "max_batch_size": 16}},
        "parallelism": {"tp": 1},
        "placement": {"accelerator": "CPU", "cpus_per_rank": 0.25, "replicas": 1},
        "router": {"policy": "ray_default"},
        "ingress": {"default_max_tokens": 256, "ingress_cpus": 0.1}})
    with served(config) as port:
        yield f"http://127.0.0.1:{port}"


def person(i: int) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON}}, "stream": i % 2 == 1}


def forced_call(i: int) -> dict[str, Any]:
    return {"tools": [WEATHER, LOOKUP], "tool_choice": "required", "stream": i % 2 == 1}


def plain(i: int) -> dict[str, Any]:
    return {"max_tokens": 24, "stream": i % 2 == 1}


async def answer(client: openai.AsyncOpenAI, i: int, kind: Any) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 220, "temperature": 1.0, "seed": i, "extra_body": OFF,
            "messages": [{"role": "user", "content": f"request {i}: {kind.__name__}"}],
            **kind(i)}
    if not body.get("stream"):
        r = await client.chat.completions.create(**body)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return {"content": m.content, "calls": calls, "finish": r.choices[0].finish_reason,
                "accept": r.usage.model_extra.get("spec_accept_length")}
    content, calls, finish, accept = "", {}, None, None
    async for chunk in await client.chat.completions.create(**body):
        if chunk.usage is not None:
            accept = chunk.usage.model_extra.get("spec_accept_length")
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                name, args = calls.get(c.index, ("", ""))
                calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
            finish = choice.finish_reason or finish
    return {"content": content, "calls": list(calls.values()), "finish": finish, "accept": accept}


def test_every_constrained_answer_validates_at_16_concurrent_requests(base_url: str) -> None:
    kinds = [person, forced_call, plain]

    async def run() -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        limit = asyncio.Semaphore(16)

        async def one(i: int) -> dict[str, Any]:
            async with limit:
                return {"kind": kinds[i % 3].__name__, **await answer(client, i, kinds[i % 3])}
        return await asyncio.gather(*(one(i) for i in range(36)))

    results = asyncio.run(run())
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, LOOKUP)}
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_kind.setdefault(r["kind"], []).append(r)
    for r in by_kind["person"]:
        assert r["finish"] == "stop", r
        assert "\n" not in r["content"] and " " not in r["content"]  # compact (K3's contract)
        jsonschema.validate(json.loads(r["content"]), PERSON)
    for r in by_kind["forced_call"]:
        assert r["finish"] == "tool_calls" and r["calls"], r
        for name, arguments in r["calls"]:
            jsonschema.validate(json.loads(arguments), tools[name])
    assert all(r["finish"] in ("stop", "length") for r in by_kind["plain"])
    # Speculation ran under every kind (acceptance reported with and without grammars).
    assert all(r["accept"] is not None and r["accept"] >= 1 for r in results)


def test_a_hostile_schema_is_a_400_naming_the_field_while_others_are_served(
        base_url: str) -> None:
    hostile = {"type": "string", "minLength": 999_999_999_999}

    async def run() -> tuple[httpx.Response, float, list[dict[str, Any]]]:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        others = [asyncio.create_task(answer(client, i, person)) for i in range(4)]
        start = time.perf_counter()
        async with httpx.AsyncClient(timeout=60) as http:
            bad = await http.post(base_url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}], **OFF,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "h", "schema": hostile}}})
        elapsed = time.perf_counter() - start
        return bad, elapsed, await asyncio.gather(*others)

    bad, elapsed, others = asyncio.run(run())
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "Traceback" not in error["message"] and "/" not in error["message"].split(":")[0]
    assert elapsed < 10  # a refusal, not a stalled batch (the compile itself is bounded at 2 s)
    for r in others:
        jsonschema.validate(json.loads(r["content"]), PERSON)

