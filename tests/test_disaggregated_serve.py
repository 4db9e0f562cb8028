"""The Serve app disaggregated, for real: a prefill deployment at TP 2 prefills each request on
its ranks and hands it over (MLA latents, KDA states, the draft's context, re-split to TP 1)
to a decode deployment at TP 1, through Ray's object store; the client streams from the
decode side through the unchanged ingress path, with the official openai client. The answer
is the aggregated engine's, and a dropped stream leaves nothing held on either side."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from app_configs import INGRESS, tiny_app
from ray import serve
from tiny_models import served, wait_for, write_k3_serving_pair

from serve_app.config import AppConfig
from serve_app.engines.reference.builder import build_engine, build_runner
from serve_app.engines.types import SamplingParams
from serve_app.tokenizer import load_tokenizer

pytestmark = pytest.mark.ray_cluster("shared")

MODEL = "mini-k3-pd"


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_k3_serving_pair(tmp_path_factory.mktemp("k3pd"), tiny=True)


@pytest.fixture(scope="module")
def server(paths: dict[str, Path]) -> Any:
    cfg = AppConfig.model_validate(tiny_app(
        paths, MODEL,
        engine={"reference": {"prefill_chunk_tokens": 48, "prefix_cache": {"enabled": True}}},
        ingress=INGRESS,
        disaggregation={"enabled": True, "prefill": {"parallelism": {"tp": 2}},
                        "decode": {"parallelism": {"tp": 1}}}))
    with served(cfg) as port:
        url = f"http://127.0.0.1:{port}"
        # Both admission stages know their replica before any test stops one (a stage that
        # has never heard from the decode side could not place a request there).
        assert wait_for(lambda: all(side["replicas"] for side in router_view(url)),
                        timeout=60, interval=0.2)
        yield url, cfg


def held(deployment: str) -> list[tuple[int, int]]:
    """(KV tokens requests hold, state slots used) of each replica of `deployment`: the
    prefix cache's evictable pages are no request's."""
    handle = serve.get_deployment_handle(deployment, app_name="kimi")
    return [(c["kv_tokens_used"] - c["kv_tokens_evictable"], c["state_slots_used"])
            for c in handle.broadcast("capacity").results(timeout_s=30)]


def holds_nothing(deployment: str) -> bool:
    """Whether `deployment`'s replicas come to hold nothing (within 30 s: Serve's health
    check may be running its one-token generation right now)."""
    return bool(wait_for(lambda: held(deployment) == [(0, 0)], timeout=30, interval=0.1))


def router_view(url: str) -> list[dict[str, Any]]:
    """/v1/router's two sides, prefill then decode: each the ingress's admission stage."""
    view = httpx.get(url + "/v1/router", timeout=30).json()
    return [view, view["decode"]]


def _reserves_nothing(url: str) -> bool:
    return all(r["kv_tokens_committed"] == 0 and r["state_slots_reserved"] == 0
               and r["replica_kv_tokens_committed"] in (0, None)
               and r["replica_state_slots_reserved"] in (0, None)
               for side in router_view(url) for r in side["replicas"].values())


def router_holds_nothing(url: str) -> bool:
    """Whether the router comes to reserve nothing on either side (within 30 s: the
    replicas' own ledgers arrive with their next report, every second): neither the
    ingress's admission stages nor any replica's authoritative ledger."""
    return bool(wait_for(lambda: _reserves_nothing(url), timeout=30, interval=0.2))


def replica(deployment: str) -> Any:
    """The one replica actor of `deployment`."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::kimi#{deployment}#")]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def _answers(url: str) -> bool:
    try:
        return httpx.post(url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
                          ).status_code == 200
    except httpx.HTTPError:
        return False


def recovered(url: str) -> None:
    """Wait (up to 3 minutes) until Serve has replaced a killed replica and a request is
    answered again, so each test leaves the app whole, in any order."""
    assert wait_for(lambda: _answers(url), timeout=180, interval=1.0), "the app did not recover"


@contextmanager
def frozen(deployment: str) -> Iterator[None]:
    """`deployment`'s replica process stopped (SIGSTOP): calls to it wait in transit."""
    pid = serve.get_deployment_handle(deployment, app_name="kimi").placement.remote().result(
        timeout_s=30)[0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def stream(url: str, max_tokens: int) -> Any:
    return httpx.stream("POST", url + "/v1/completions", json=body(max_tokens), timeout=60)


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


def test_the_prefill_sides_prefix_cache_serves_a_repeated_prompt(server: Any) -> None:
    """The prefill replica keeps each prompt in its prefix cache (pages and KDA snapshots) after
    handing it over: the same prompt again is prefilled from the cache (`cached_tokens`, which
    the decode side reports in `usage`) and answered exactly as the first time."""
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    messages = [{"role": "user", "content": "class Cache:\n    def get(self, key):\n" * 8}]
    answers = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                              temperature=0) for _ in range(2)]
    assert answers[0].usage.prompt_tokens > 64  # past the first snapshot (every 64 tokens)
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    assert cached[0] == 0 and cached[1] >= 64
    assert answers[1].choices[0].message.content == answers[0].choices[0].message.content
    assert holds_nothing("DecodeDeployment")


def test_a_pair_holds_the_decode_side_for_the_answer(server: Any) -> None:
    """The router places a request on a (decode, prefill) pair, both on this one node: while
    it decodes, the decode side holds its prompt + max_tokens and a state slot (in the
    ingress's stage and in the replica's own ledger), the prefill side nothing once the
    hand-over is made; a dropped stream then leaves nothing reserved or held anywhere."""
    url = server[0]
    with stream(url, 400) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert held("DecodeDeployment")[0][1] >= 1  # decoding there
        assert holds_nothing("TargetDeployment")  # handed over: nothing on the prefill side
        prefill, decode = router_view(url)
        [(_, p)] = prefill["replicas"].items()
        [(decode_id, d)] = decode["replicas"].items()
        assert p["node"] == d["node"] is not None
        assert (d["kv_tokens_committed"], d["state_slots_reserved"]) == (4 + 400, 1)
        assert (p["kv_tokens_committed"], p["state_slots_reserved"]) == (0, 0)
        assert wait_for(lambda: router_view(url)[1]["replicas"][decode_id][
            "replica_kv_tokens_committed"] == 4 + 400, timeout=10, interval=0.2)
    assert holds_nothing("DecodeDeployment")
    assert router_holds_nothing(url)


def test_a_prefill_replica_that_dies_mid_answer_does_not_touch_the_answer(server: Any
                                                                         ) -> None:
    """After the hand-over the answer streams from the decode replica to the ingress: killing
    the prefill replica mid-answer changes nothing for it (all 300 tokens arrive, with
    finish_reason length), and Serve replaces the prefill replica."""
    import ray

    with stream(server[0], 300) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert held("DecodeDeployment")[0][1] >= 1
        ray.kill(replica("TargetDeployment"), no_restart=False)
        events = [json.loads(line[len("data: "):]) for line in lines
                  if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 300
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert holds_nothing("DecodeDeployment")
    recovered(server[0])
    assert holds_nothing("TargetDeployment")
    assert router_holds_nothing(server[0])


def test_a_prefill_replica_that_dies_mid_transfer_leaves_nothing_held(server: Any) -> None:
    """Killed while its hand-over is in transit (prefilled and exported into its object store,
    the ingress's decode call waiting on a decode replica that is stopped, so it cannot have
    fetched it yet): the hand-over is lost with its owner, the client gets an OpenAI-shaped
    503 (no token had been sent), and the decode replica holds nothing. Or the client gets its
    whole answer: the node's object store frees a dead owner's objects when its raylet gets to
    it, and a decode replica that reads the hand-over first decodes it (seen once in a random-
    order run beside the other xdist worker). Either way nothing stays held."""
    import ray

    url = server[0]
    with ThreadPoolExecutor(1) as pool:
        with frozen("DecodeDeployment"):
            answer = pool.submit(httpx.post, url + "/v1/completions", json=body(50),
                                 timeout=60)
            time.sleep(1.5)  # prefill + export of 4 tokens: milliseconds
            assert holds_nothing("TargetDeployment")  # exported: nothing left there
            assert not answer.done()  # no first token: the answer waits on the decode side
            ray.kill(replica("TargetDeployment"), no_restart=False)
            time.sleep(1.0)
        resp = answer.result(timeout=60)
    if resp.status_code == 200:
        assert '"completion_tokens": 50' in resp.text and resp.text.endswith("data: [DONE]\n\n")
    else:
        assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
        assert resp.json()["error"]["code"] == "service_unavailable"
    assert holds_nothing("DecodeDeployment")
    recovered(url)
    assert holds_nothing("TargetDeployment") and holds_nothing("DecodeDeployment")
    assert router_holds_nothing(url)


def test_a_client_gone_mid_transfer_leaves_nothing_held(server: Any) -> None:
    """The client hangs up while its hand-over is in transit: the ingress cancels the decode
    call, and neither side keeps the request."""
    url = server[0]
    with frozen("DecodeDeployment"):
        with pytest.raises(httpx.ReadTimeout):  # gives up after 1.5 s and closes
            httpx.post(url + "/v1/completions", json=body(50),
                       timeout=httpx.Timeout(60, read=1.5))
        assert holds_nothing("TargetDeployment")
        time.sleep(0.5)  # the ingress sees the disconnect
    assert holds_nothing("DecodeDeployment") and holds_nothing("TargetDeployment")
    assert router_holds_nothing(url)
    recovered(url)


def test_health_covers_the_decode_side(server: Any) -> None:
    """/health is 503 while no decode replica can answer (one stopped with SIGSTOP), naming
    that side, though every prefill replica is fine: requests could not be answered. 200
    again once it runs."""
    url = server[0]
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    with frozen("DecodeDeployment"):
        time.sleep(1.1)  # past the probe's 1 s cache
        resp = httpx.get(url + "/health", timeout=30)  # waits out the 3 s probe timeout
        assert resp.status_code == 503 and resp.headers["retry-after"]
        assert resp.json()["error"]["message"].startswith("decode side: ")
    # The replica first works off what queued while it was stopped.
    assert wait_for(lambda: httpx.get(url + "/health", timeout=30).status_code == 200,
                    timeout=60, interval=0.5), "/health stayed 503 after the decode side resumed"


def test_a_decode_replica_that_dies_mid_answer_fails_the_stream(server: Any) -> None:
    """Killed after the hand-over, mid-answer: the client's stream ends with an OpenAI-shaped
    error event (503, retry), never with its 500 tokens' finish; the prefill side holds
    nothing, and the replacement decode replica serves the next request."""
    import ray

    with stream(server[0], 500) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        ray.kill(replica("DecodeDeployment"), no_restart=False)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"  # the stream's end, after the error event
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "service_unavailable"
    assert not any('"finish_reason":"length"' in line.replace(" ", "") for line in rest)
    assert holds_nothing("TargetDeployment")
    recovered(server[0])
    assert holds_nothing("DecodeDeployment")
    assert router_holds_nothing(server[0])
