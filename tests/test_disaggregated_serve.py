"""The Serve app disaggregated, for real: the ingress fronts a decode deployment at TP 1, whose
replica has each request prefilled on a prefill deployment at TP 2 (its own dispatcher admits
it there), fetches the hand-over (MLA latents, KDA states, the draft's context, re-split to
TP 1) through Ray's object store and streams the answer; the client sees the unchanged
ingress path, with the official openai client. The answer is the aggregated engine's, and a
dropped stream leaves nothing held on either side."""

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

from serve_app.chat.jinja_render import apply_chat_template
from serve_app.config import AppConfig
from serve_app.engines.reference.builder import build_engine, build_runner
from serve_app.protocol.generation import SamplingParams
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
        # has never heard from its side could not place a request there).
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
    """/v1/router's two sides, prefill then decode: the decode replica's own admission stage
    to the prefill side (under "downstream"), and the ingress's to the decode side."""
    view = httpx.get(url + "/v1/router", timeout=30).json()
    [prefill] = view.get("downstream", {}).values() or [{"replicas": {}}]
    return [prefill, view]


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
    expected = engine.generate([apply_chat_template(tokenizer, messages)],
                               SamplingParams(temperature=0, max_tokens=24))[0]
    assert text == expected.text
    assert usage is not None and usage.completion_tokens == expected.completion_tokens
    extra = usage.model_extra  # the decode side's speculation
    assert extra["spec_verify_ct"] >= 1
    assert extra["spec_accept_length"] == pytest.approx(
        usage.completion_tokens / extra["spec_verify_ct"])
    assert holds_nothing("PrefillDeployment") and holds_nothing("DecodeDeployment")


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
        assert holds_nothing("PrefillDeployment")  # handed over: nothing on the prefill side
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
        ray.kill(replica("PrefillDeployment"), no_restart=False)
        events = [json.loads(line[len("data: "):]) for line in lines
                  if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 300
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert holds_nothing("DecodeDeployment")
    recovered(server[0])
    assert holds_nothing("PrefillDeployment")
    assert router_holds_nothing(server[0])


def test_a_prefill_replica_that_dies_under_a_request_leaves_nothing_held(server: Any) -> None:
    """Killed while a request waits on it (stopped with SIGSTOP, so the decode replica's call
    waits there): either the client gets an OpenAI-shaped 503 with Retry-After (no token had
    been sent), or its whole answer (Serve sends a call its replica never took to the
    replacement: seen in this module run alone). Either way the decode replica holds
    nothing, and the app is whole again once Serve has replaced the prefill replica."""
    import ray

    url = server[0]
    with ThreadPoolExecutor(1) as pool:
        with frozen("PrefillDeployment"):
            answer = pool.submit(httpx.post, url + "/v1/completions", json=body(50),
                                 timeout=60)
            time.sleep(1.5)  # the decode replica has admitted it and called the prefill side
            assert not answer.done()  # no first token: the answer waits on the prefill side
            ray.kill(replica("PrefillDeployment"), no_restart=False)
        resp = answer.result(timeout=60)
    if resp.status_code == 200:
        assert '"completion_tokens": 50' in resp.text and resp.text.endswith("data: [DONE]\n\n")
    else:
        assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
        assert resp.json()["error"]["code"] == "service_unavailable"
    assert holds_nothing("DecodeDeployment")
    recovered(url)
    assert holds_nothing("PrefillDeployment") and holds_nothing("DecodeDeployment")
    assert router_holds_nothing(url)


def test_a_hand_over_lost_with_its_owner_is_a_retryable_failure(server: Any) -> None:
    """The hand-over lives in the prefill replica's object store: if that process dies
    before the decode replica has fetched it, the decode replica fails the request with
    EngineUnavailable (a 503 with Retry-After for the client), not an internal error."""
    import ray

    from serve_app.protocol.generation import EngineUnavailable, Prefilled
    from serve_app.serving.target import fetch_handoff

    @ray.remote(num_cpus=0)
    def hand_over_later() -> bytes:
        time.sleep(60)
        return b"never read"

    @ray.remote(num_cpus=0)
    class Owner:
        def prefilled(self) -> list[Prefilled]:
            # Owned by this actor, not yet in any object store: once the owner is gone it can
            # never be (a stored one is freed when the node's raylet gets to it, which a test
            # cannot wait for).
            return [Prefilled("r", hand_over_later.remote())]

    owner = Owner.remote()
    [prefilled] = ray.get(owner.prefilled.remote())
    ray.kill(owner)
    assert wait_for(lambda: _dead(owner), timeout=30, interval=0.2)

    import asyncio

    with pytest.raises(EngineUnavailable, match="hand-over"):
        asyncio.run(asyncio.wait_for(fetch_handoff(prefilled), 30))


def _dead(actor: Any) -> bool:
    import ray

    try:
        ray.get(actor.__ray_ready__.remote(), timeout=1)
    except Exception:
        return True
    return False


def test_a_client_gone_while_its_request_waits_on_the_prefill_side_leaves_nothing_held(
        server: Any) -> None:
    """The client hangs up while its request waits on the prefill side: the ingress cancels
    the decode replica's call, which cancels its own call to the prefill side, and neither
    side keeps the request."""
    url = server[0]
    with frozen("PrefillDeployment"):
        with pytest.raises(httpx.ReadTimeout):  # gives up after 1.5 s and closes
            httpx.post(url + "/v1/completions", json=body(50),
                       timeout=httpx.Timeout(60, read=1.5))
        assert holds_nothing("DecodeDeployment")
        time.sleep(0.5)  # the ingress sees the disconnect
    assert holds_nothing("DecodeDeployment") and holds_nothing("PrefillDeployment")
    assert router_holds_nothing(url)
    recovered(url)


@pytest.mark.parametrize("side", ["PrefillDeployment", "DecodeDeployment"])
def test_health_covers_both_sides(server: Any, side: str) -> None:
    """/health is 503 while either side cannot answer (one stopped with SIGSTOP), though the
    other is fine: requests could not be answered. The ingress asks the decode side, whose
    replica answers for the prefill side it sends to (naming it). 200 again once it runs."""
    url = server[0]
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    with frozen(side):
        time.sleep(1.1)  # past the probes' 1 s caches
        resp = httpx.get(url + "/health", timeout=30)  # waits out the 3 s probe timeout
        assert resp.status_code == 503 and resp.headers["retry-after"]
        message = resp.json()["error"]["message"]
        assert message.startswith("prefill side: ") == (side == "PrefillDeployment"), message
    # The replica first works off what queued while it was stopped.
    assert wait_for(lambda: httpx.get(url + "/health", timeout=30).status_code == 200,
                    timeout=60, interval=0.5), "/health stayed 503 after the side resumed"


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
    assert holds_nothing("PrefillDeployment")
    recovered(server[0])
    assert holds_nothing("DecodeDeployment")
    assert router_holds_nothing(server[0])
