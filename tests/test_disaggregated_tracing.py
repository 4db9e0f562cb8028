"""A disaggregated request's trace, on a cluster whose every process exports its spans: the
prefill replica's engine.request (its prefill) and the decode replica's (its verify steps)
both hang under the ingress's span, in the client's trace."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from app_configs import tiny_app
from ray import serve
from tiny_models import trace_spans, traced_cluster, write_tiny_serving_pair

from serve_app.app import build_app
from serve_app.config import AppConfig

pytestmark = pytest.mark.ray_cluster("own")

MODEL = "tiny-pd-traced"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    paths = write_tiny_serving_pair(tmp_path_factory.mktemp("pdtrace"))
    config = AppConfig.model_validate(tiny_app(paths, MODEL, disaggregation={"enabled": True}))
    with traced_cluster() as http_port:
        serve.run(build_app(config), name="kimi", route_prefix="/")
        yield f"http://127.0.0.1:{http_port}"


def _engine_request_of(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> str:
    """The span id of `span`'s engine.request ancestor."""
    while span["name"] != "engine.request":
        span = by_id[span["parent_span_id"]]
    return span["span_id"]


def test_a_disaggregated_requests_trace_spans_both_sides(server: str) -> None:
    trace_id, client_span = "5cf92f3577b34da6a3ce929d0e0e4737", "01f067aa0ba902b8"
    resp = httpx.post(server + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "def hello(name):", "max_tokens": 20, "temperature": 0,
        "ignore_eos": True}, headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    wanted = {"ingress.request", "engine.request", "engine.prefill_chunk", "engine.verify"}
    spans = trace_spans(trace_id, wanted, chain=("ingress.request", client_span))
    by_id = {s["span_id"]: s for s in spans}
    [ingress] = [s for s in spans if s["name"] == "ingress.request"]
    sides = [s for s in spans if s["name"] == "engine.request"]
    assert len(sides) == 2  # one per side
    for side in sides:  # each under the ingress's span, unbroken
        parent = side
        while parent["parent_span_id"] in by_id and parent["name"] != "ingress.request":
            parent = by_id[parent["parent_span_id"]]
        assert parent is ingress
    prefills = {_engine_request_of(s, by_id) for s in spans
                if s["name"] == "engine.prefill_chunk"}
    verifies = [s for s in spans if s["name"] == "engine.verify"]
    decodes = {_engine_request_of(v, by_id) for v in verifies}
    # The prefill on one side, every verify step on the other.
    assert len(prefills) == len(decodes) == 1 and prefills != decodes
    assert sum(v["attributes"]["committed"] for v in verifies) == usage["completion_tokens"] - 1
