"""Constrained decoding through the real server: the random mini K3 in K3's chat format (the
hardest case: only the grammar makes an answer valid), speculation on, 16 concurrent clients
mixing json_schema answers, forced tool calls and plain chat, streaming and not."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tiny_models import served, write_k3_format_pair

from serve_app.config import AppConfig

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


def test_every_constrained_answer_validates_at_16_concurrent_requests(base_url: str) -> None:
    results = asyncio.run(load.run_load(base_url, MODEL, 36, 16,
                                        [load.person, load.forced_call, load.plain]))
    assert [r for r in results if not r["valid"]] == []
    assert all("status" not in r for r in results)  # no error at all, 5xx or otherwise
    # Both streamed and whole answers, and speculation ran under every kind.
    assert all(r["accept"] is not None and r["accept"] >= 1 for r in results)
    assert sum(r["kind"] == "forced_call" for r in results) == 12  # each with its one call


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

