"""Traces, metrics and logs of one real Serve app (real Ray, HTTP, the openai client)."""

from __future__ import annotations

import glob
import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
from app_configs import tiny_app
from ray import serve
from tiny_models import trace_spans, traced_cluster, write_tiny_serving_pair

from serve_app.app import build_app
from serve_app.config import AppConfig
from serve_app.netutil import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("own")]
MODEL = "obs"
# The usage of every answered request this module sent, whichever test sent it and in whatever
# order they ran: the metrics test compares the exported counters with their sums exactly.
ANSWERED: list[dict[str, Any]] = []


def _complete(base: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    resp = httpx.post(base + "/v1/completions", json={"model": MODEL, **body}, timeout=60,
                      headers=headers)
    if resp.status_code == 200:
        ANSWERED.append(resp.json()["usage"])
    return resp


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    paths = write_tiny_serving_pair(tmp_path_factory.mktemp("obs"))
    metrics_port = free_port()
    config = AppConfig.model_validate(tiny_app(
        paths, MODEL, engine={"reference": {"prefix_cache": {"enabled": True}}}))
    with traced_cluster(metrics_port) as http_port:
        serve.run(build_app(config), name="kimi", route_prefix="/")
        yield f"http://127.0.0.1:{http_port}", metrics_port


def test_one_request_makes_the_expected_span_tree(server: Any) -> None:
    base, _ = server
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {"prompt": "def hello(name):", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    resp = _complete(base, body, traceparent=f"00-{trace_id}-{client_span}-01")
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    wanted = {"ingress.request", "engine.request", "engine.queue", "engine.prefill_chunk",
              "engine.decode", "engine.verify"}
    spans = trace_spans(trace_id, wanted, chain=("ingress.request", client_span))
    names = {s["name"] for s in spans}
    assert wanted <= names, f"missing spans: {wanted - names}"
    by_id = {s["span_id"]: s for s in spans}

    def ancestors(span: dict[str, Any]) -> list[str]:
        chain = []
        while span["parent_span_id"] in by_id:
            span = by_id[span["parent_span_id"]]
            chain.append(span["name"])
        return chain

    one = {s["name"]: s for s in spans}
    # The client's traceparent is the parent of the proxy's span (Serve names it after the
    # route): the whole tree shares the client's trace id.
    proxy = [s for s in spans if s["parent_span_id"] == client_span]
    assert proxy and any(s["name"].startswith("POST /v1/completions") for s in proxy)
    top = one["ingress.request"]
    while top["parent_span_id"] in by_id:
        top = by_id[top["parent_span_id"]]
    assert top["parent_span_id"] == client_span  # an unbroken chain up to the client's span
    assert "ingress.request" in ancestors(one["engine.request"])
    assert ancestors(one["engine.queue"])[0] == "engine.request"
    verifies = [s for s in spans if s["name"] == "engine.verify"]
    assert all(ancestors(v)[:2] == ["engine.decode", "engine.request"] for v in verifies)
    # Each verify step records what it drafted and accepted; together they account for every
    # token after the first (which came from the prefill).
    assert all(0 <= v["attributes"]["accepted"] <= v["attributes"]["drafted"] for v in verifies)
    assert sum(v["attributes"]["committed"] for v in verifies) == usage["completion_tokens"] - 1
    assert len(verifies) == usage["spec_verify_ct"]
    root = one["engine.request"]["attributes"]
    assert root["completion_tokens"] == usage["completion_tokens"]
    assert one["ingress.request"]["attributes"]["status"] == 200


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _buckets(text: str, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, summed over label sets."""
    counts: dict[float, float] = {}
    for le, value in re.findall(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', text, re.M):
        counts[float(le)] = counts.get(float(le), 0.0) + float(value)
    return counts


DOCS = Path(__file__).resolve().parents[1] / "docs/observability.md"


def documented_metrics() -> list[str]:
    """Every metric in docs/observability.md's table, as exported (a histogram by its
    `_count` series)."""
    rows = re.findall(r"^\| `(ray_kimi_\w+)` \| (\w+) \|", DOCS.read_text(), re.M)
    assert len(rows) >= 17, "docs/observability.md's metrics table not found"
    return [name + "_count" if kind == "histogram" else name for name, kind in rows]


# Exported only where this app does not go: the autoscaling policy's (Serve's controller runs it
# for an autoscaled deployment) and the moves of a leaving replica (which exits before the next
# report; tests/test_autoscaling_serve.py checks the moves it logs as it leaves).
SITUATIONAL = {"ray_kimi_autoscaling_decisions_total", "ray_kimi_requests_moved_total"}

SLOT_METRICS = ["ray_kimi_max_running_requests", "ray_kimi_router_state_slots_reserved",
                "ray_kimi_router_kv_tokens_committed"]


def test_metrics_endpoint_exports_every_metric_with_the_answered_values(server: Any) -> None:
    base, port = server
    document = "def hello(name):\n    return 'hello ' + name\n" * 4  # > 2 pages of tokens
    for prompt in ("def a", "import os", "The quick brown", document + "x", document + "y"):
        assert _complete(base, {"prompt": prompt, "max_tokens": 12,
                                "temperature": 0}).status_code == 200
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    names = [n for n in documented_metrics() if n not in SITUATIONAL]
    assert "ray_kimi_router_decisions_total" in names
    # State slots, the router's second resource: the engine's bound, the router's reservations.
    names += [n for n in SLOT_METRICS if n not in names]
    answered = list(ANSWERED)
    spec = [u for u in answered if u.get("spec_verify_ct")]
    completion_tokens = sum(u["completion_tokens"] for u in answered)
    # Every process exports on its own period: wait until the last answer and the router's
    # release of its reservations are in.
    deadline = time.time() + 60
    text = ""
    while time.time() < deadline:
        text = _scrape(port)
        if (all(re.search(rf"^{n}[{{ ]", text, re.M) for n in names)
                and _value(text, "ray_kimi_num_requests_total", status="404") >= 1
                and _value(text, "ray_kimi_generation_tokens_total") >= completion_tokens
                and _value(text, "ray_kimi_spec_accept_length_count") >= len(spec)
                and _value(text, "ray_kimi_router_kv_tokens_committed") == 0):
            break
        time.sleep(1)
    missing = [n for n in names if not re.search(rf"^{n}[{{ ]", text, re.M)]
    assert not missing, f"not exported: {missing}"
    # Counters equal the sums of what the clients were told.
    assert _value(text, "ray_kimi_generation_tokens_total") == completion_tokens
    assert _value(text, "ray_kimi_prompt_tokens_total") == sum(u["prompt_tokens"]
                                                              for u in answered)
    assert _value(text, "ray_kimi_num_requests_total", status="404") == 1
    assert _value(text, "ray_kimi_num_requests_total", status="200") == len(answered)
    # The speculative statistics: one accept-length observation per request that verified,
    # the draft counters and the engine's accept rate from the same counts.
    assert len(spec) >= 5
    assert _value(text, "ray_kimi_spec_accept_length_count") == len(spec)
    # Ray exports a histogram's sum from its bucket midpoints: the buckets are what is exact.
    buckets = _buckets(text, "ray_kimi_spec_accept_length")
    assert len(buckets) > 2 and buckets[float("inf")] == len(spec)
    for le, count in buckets.items():
        assert count == sum(u["spec_accept_length"] <= le for u in spec), le
    assert _value(text, "ray_kimi_spec_verify_calls_total") == sum(u["spec_verify_ct"]
                                                                   for u in spec)
    accepted = sum(u["spec_accepted_drafts"] for u in spec)
    proposed = sum(u["spec_proposed_drafts"] for u in spec)
    assert _value(text, "ray_kimi_spec_draft_tokens_total", outcome="accepted") == accepted
    assert _value(text, "ray_kimi_spec_draft_tokens_total", outcome="rejected") == proposed - accepted
    assert _value(text, "ray_kimi_spec_accept_rate") == pytest.approx(accepted / proposed,
                                                                      rel=1e-9)
    assert _value(text, "ray_kimi_max_total_num_tokens") == 4096
    assert _value(text, "ray_kimi_max_running_requests") == 32  # max_batch_size's default
    # Every request has finished: the router holds no reservation.
    assert _value(text, "ray_kimi_router_state_slots_reserved") == 0
    assert _value(text, "ray_kimi_router_kv_tokens_committed") == 0
    # The second question on the document was served from the prefix cache.
    assert _value(text, "ray_kimi_cached_tokens_total") >= 16
    assert 0 < _value(text, "ray_kimi_cache_hit_rate") < 1
    # One routing decision per admitted request, labelled by the kv_aware policy's reason.
    reasons = set(re.findall(r'^ray_kimi_router_decisions_total\{[^}]*reason="([^"]+)"', text,
                             re.M))
    assert reasons and reasons <= {"affinity", "least_work", "batched"}
    assert sum(_value(text, "ray_kimi_router_decisions_total", reason=r)
               for r in reasons) == len(answered)


def test_json_logs_carry_request_and_trace_ids(server: Any) -> None:
    base, _ = server
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    _complete(base, {"prompt": "x", "max_tokens": 3, "temperature": 0},
              traceparent=f"00-{trace_id}-b7ad6b7169203331-01")
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
    # The closing "request finished" line is written just after the response has left.
    deadline = time.time() + 20
    lines: list[dict[str, Any]] = []
    finished: list[dict[str, Any]] = []
    while time.time() < deadline and not finished:
        lines = [json.loads(line)
                 for path in glob.glob(str(logs / "replica_kimi_OpenAIIngress_*.log"))
                 for line in Path(path).read_text().splitlines() if trace_id in line]
        finished = [r for r in lines if "request finished" in r.get("message", "")]
        time.sleep(0.5)
    assert lines, "no JSON log line carries the request's trace id"
    assert finished and finished[0]["trace_id"] == trace_id
    assert finished[0]["request_id"] and finished[0]["status"] == 200
