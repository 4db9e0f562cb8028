"""The router for real: Ray, Serve, two target replicas (a tiny random K3-layout hybrid pair, whose
state slots are real KDA state slots; TP 1, CPU), HTTP."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from app_configs import tiny_k3_app
from ray import serve
from tiny_models import served

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("shared")]

MODEL = "tiny-kimi-dspark"
KV = 1024  # tokens per replica: two 420-token requests fit, a third does not
SLOTS = 2  # KDA state slots per replica (engine.reference.state_slots): running requests
QUEUE = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = tiny_k3_app(
        tmp_path_factory.mktemp("router"),
        engine={"kv_capacity_tokens": KV, "state_slots": SLOTS, "speculation": {"enabled": True}},
        ingress={"default_max_tokens": 16, "max_tokens_limit": 1500},
        # One client sends everything here: the per-client KV share would hold back what
        # these tests count on the capacity to admit (tests/test_hardening.py tests it).
        router={"block_size": 16, "queue_size": QUEUE, "queue_timeout_s": 120,
                "long_threshold": 256, "client_max_kv_share": 1.0},
        model=MODEL)
    with served(cfg) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                           timeout=180) as client:
        yield client


def _complete(client: httpx.Client, prompt: list[int], max_tokens: int,
              ignore_eos: bool = False) -> httpx.Response:
    return client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": ignore_eos})


def _replica_of(client: httpx.Client, request_id: str) -> str:
    recent = client.get("/v1/router").json()["recent"]
    return next(d["replica"] for d in recent if d["id"] == request_id)


def test_router_knows_both_replicas_capacity(server: httpx.Client) -> None:
    assert _complete(server, [5, 6, 7], 2).status_code == 200
    state = server.get("/v1/router").json()
    assert state["policy"] == "kv_aware"
    assert len(state["replicas"]) == 2
    assert all(r["kv_tokens_total"] == KV for r in state["replicas"].values())
    # The second resource, from each engine's capacity(): its state slots.
    assert all(r["state_slots_total"] == SLOTS for r in state["replicas"].values())


def test_shared_long_prefix_lands_on_one_replica(server: httpx.Client) -> None:
    doc = [(i * 7) % 250 + 10 for i in range(480)]
    replicas = set()
    for q in range(4):
        resp = _complete(server, [*doc, 280 + q, 290 + q], 4)
        assert resp.status_code == 200, resp.text
        replicas.add(_replica_of(server, resp.json()["id"]))
    assert len(replicas) == 1
    # Later, the same document still follows its prefix.
    resp = _complete(server, [*doc, 42], 4)
    assert _replica_of(server, resp.json()["id"]) in replicas


def test_over_capacity_request_gets_400_naming_both_numbers(server: httpx.Client) -> None:
    resp = _complete(server, [3] * 20, 1100)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "1120" in message and str(KV) in message
    assert resp.json()["error"]["code"] == "kv_capacity_exceeded"


def test_flood_beyond_the_queue_gets_429_and_loses_nothing_accepted(
        server: httpx.Client) -> None:
    n = 14

    def one(i: int) -> httpx.Response:
        # 200 tokens: each runs for seconds, while all 14 arrive within a fraction of one.
        return _complete(server, [20 + i] * 20, 200, ignore_eos=True)

    with ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(one, range(n)))
    codes = [r.status_code for r in responses]
    accepted = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert len(accepted) + len(limited) == n, codes
    # 2 replicas x 2 requests in KV + QUEUE waiting are accepted; the rest is refused.
    assert len(accepted) >= 2 * 2 + QUEUE, codes
    assert limited, codes
    assert all(r.headers.get("retry-after") for r in limited)
    assert all(r.json()["error"]["code"] == "router_queue_full" for r in limited)
    # Nothing accepted was lost: every accepted request produced its full completion.
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in accepted)
    # The routing hooks released every token.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = server.get("/v1/router").json()
        if all(r["kv_tokens_committed"] == 0 for r in state["replicas"].values()):
            break
        time.sleep(0.2)
    assert all(r["kv_tokens_committed"] == 0 for r in state["replicas"].values()), state
    assert state["queued"] == 0


def test_engine_capacity_stays_within_bounds_during_load(server: httpx.Client,
                                                         tmp_path: Path) -> None:
    handle = serve.get_deployment_handle("TargetDeployment", app_name="kimi")
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_complete, server, [30 + i] * 20, 150, True) for i in range(6)]
        seen = 0
        while not all(f.done() for f in futures):
            cap = handle.capacity.remote().result()
            assert cap["kv_tokens_used"] <= cap["kv_tokens_total"]
            seen += 1
            time.sleep(0.1)
    assert all(f.result().status_code == 200 for f in futures)
    assert seen > 0


def _idle(client: httpx.Client) -> dict[str, Any]:
    """The router state once nothing is reserved (earlier tests' requests have finished)."""
    deadline = time.monotonic() + 60
    while True:
        state = client.get("/v1/router").json()
        if state["queued"] == 0 and all(r["state_slots_reserved"] == 0
                                        for r in state["replicas"].values()):
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.2)


def test_a_replica_with_kv_room_but_no_free_slot_gets_no_new_request(
        server: httpx.Client) -> None:
    """Two slots per replica. X runs one long stream (620 KV tokens); Y runs two streams
    (600 KV tokens together, so Y has more KV free and less committed than X, and by KV alone
    would be chosen). A new request goes to X; when X's second slot is taken too, the next
    request waits in the router (queued, both replicas with KV room) and is served when a
    slot frees (its streams' clients hang up). The engines agree: none ever runs more than its
    slots."""
    _idle(server)
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                        timeout=180)
    handle = serve.get_deployment_handle("TargetDeployment", app_name="kimi")

    def stream(first_token: int, max_tokens: int) -> tuple[Any, str]:
        s = oai.completions.create(model=MODEL, prompt=list(range(first_token, first_token + 20)),
                                   max_tokens=max_tokens, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
        first = next(iter(s))  # the first token: prefilled, decoding
        return s, first.id

    streams = []
    big, big_id = stream(100, 600)
    streams.append(big)
    x = _replica_of(server, big_id)
    for start in (130, 160):
        s, rid = stream(start, 280)
        streams.append(s)
        assert _replica_of(server, rid) != x  # less work and less committed than X
    y = next(r for r in server.get("/v1/router").json()["replicas"] if r != x)
    assert _replica_of(server, rid) == y
    state = server.get("/v1/router").json()["replicas"]
    assert (state[y]["state_slots_reserved"], state[y]["state_slots_total"]) == (SLOTS, SLOTS)
    assert state[y]["kv_tokens_committed"] == 600 < state[x]["kv_tokens_committed"] == 620
    # Y has 424 KV tokens free, X 404: by KV alone Y would take the next request.
    probe = _complete(server, list(range(190, 210)), 16)
    assert probe.status_code == 200, probe.text
    assert _replica_of(server, probe.json()["id"]) == x
    # Every slot taken: the next request waits in the router, though both have KV room.
    s3, rid3 = stream(220, 280)
    streams.append(s3)
    assert _replica_of(server, rid3) == x
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_complete, server, list(range(250, 270)), 16)
        seen_queued = False
        deadline = time.monotonic() + 10
        while not waiting.done() and time.monotonic() < deadline:
            state = server.get("/v1/router").json()
            reps = state["replicas"]
            assert all(r["state_slots_reserved"] <= SLOTS for r in reps.values()), state
            for info in handle.broadcast("routing_info").results(timeout_s=30):
                assert info["state_slots_used"] <= info["state_slots_total"] == SLOTS, info
            if state["queued"] == 1:
                assert all(r["state_slots_reserved"] == SLOTS for r in reps.values()), state
                assert all(r["kv_tokens_total"] - r["kv_tokens_committed"] >= 36
                           for r in reps.values()), state
                seen_queued = True
                break
            time.sleep(0.05)
        assert seen_queued, "the request was not held in the router while every slot was taken"
        # The streams' clients hang up (the abort frees their slots as a finish does, and costs
        # no 1,440 tokens of decoding); the waiting request is then served.
        for s in streams:
            s.close()
        served = waiting.result()
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 16
    _idle(server)
