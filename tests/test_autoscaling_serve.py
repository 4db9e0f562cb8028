"""A replica leaves without losing a stream, for real: Ray, Serve (deployed as an operator's
config file deploys it), HTTP, the official `openai` client, a tiny random K3-layout hybrid
pair with its DSpark draft (TP 1, CPU), the kv_aware router. Serve stops a replica (a scale-down from 2 to 1, or a rolling restart of
every replica); its running requests move with the hand-over to the replicas that stay or
replace it, and every client's stream goes on: no request fails, each greedy stream is
token-identical to the same request on an unscaled deployment, and the replica that left let
go of everything (the line it logs as it leaves: docs/runbook.md "Autoscaling")."""

from __future__ import annotations

import glob
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from app_configs import tiny_k3_app
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from tiny_models import deploy_declared, own_cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("own")]

MODEL = "tiny-kimi-dspark"
STREAMS = 8
MAX_TOKENS = 240  # ~9 s a stream here: every one is mid-answer when its replica leaves


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_k3_app(
        tmp_path_factory.mktemp("leaving"),
        # Fixed verify windows: a greedy token then depends on the request's own history
        # alone, bit for bit, wherever it runs. (The adaptive budget's windows follow the
        # step times, and a window's width changes the chunked KDA arithmetic in the last
        # bits, which can flip a near-tie of a random model over hundreds of tokens: two unscaled
        # runs could differ too. Its losslessness is tested in the engine.)
        engine={"kv_capacity_tokens": 16384, "max_batch_size": 8,
                "speculation": {"enabled": True, "adaptive": False}},
        ingress={"default_max_tokens": 16, "max_tokens_limit": 2048, "ingress_cpus": 0.1},
        router={"block_size": 16, "queue_timeout_s": 120}, model=MODEL)


def _prompts() -> list[str]:
    return [f"Story {i}: once upon a time, in a land of {['red', 'blue', 'green', 'gold'][i % 4]}"
            for i in range(STREAMS)]


def _stream(client: openai.OpenAI, prompt: str, started: threading.Event | None
            ) -> tuple[str, str | None]:
    """One streaming completion: its whole text and finish reason."""
    text, reason = [], None
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in chunks:
        choice = chunk.choices[0]
        text.append(choice.text)
        reason = choice.finish_reason or reason
        if started is not None and len(text) >= 3:
            started.set()
    return "".join(text), reason


def _run_streams(port: int, during: Any = None) -> list[tuple[str, str | None]]:
    """The 8 streams at once; `during()` runs once every stream has received tokens."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=300)
    started = [threading.Event() for _ in range(STREAMS)]
    results: list[Any] = [None] * STREAMS

    def run(i: int, prompt: str) -> None:
        try:
            results[i] = _stream(client, prompt, started[i])
        except Exception as exc:  # a failed stream is what the test looks for
            results[i] = exc
            started[i].set()

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(_prompts())]
    for t in threads:
        t.start()
    if during is not None:
        for e in started:
            assert e.wait(120)
        during()
    for t in threads:
        t.join(600)
    return results


def _replicas() -> set[str]:
    """The target deployment's running replicas (Serve's unique ids)."""
    try:
        handle = serve.get_deployment_handle("TargetDeployment", app_name="kimi")
        infos = handle.broadcast("routing_info").results(timeout_s=30)
    except (KeyError, DeploymentUnavailableError):  # not deployed (or not running) yet
        return set()
    return {i["replica"] for i in infos}


def _left(replicas: set[str]) -> dict[str, dict[str, Any]]:
    """The holdings each of `replicas` logged as it left (Serve writes one log per replica:
    the line is JSON, its message the holdings)."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
    out = {}
    for replica in replicas:
        for path in glob.glob(str(logs / f"replica_kimi_TargetDeployment_{replica}.log")):
            for line in Path(path).read_text(errors="replace").splitlines():
                message = json.loads(line).get("message", "") if line.startswith("{") else line
                if message.startswith("replica left, holding "):
                    out[replica] = json.loads(message.removeprefix("replica left, holding "))
    return out


HELD = ("kv_tokens_committed", "state_slots_reserved", "running", "waiting", "state_slots_used",
        "kv_tokens_held")


def _router(port: int) -> dict[str, Any]:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/v1/router", timeout=30).json()


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with own_cluster() as http_port:
        yield http_port


@pytest.fixture(scope="module")
def unscaled(config: Any, port: int) -> list[tuple[str, str | None]]:
    deploy_declared(config, 2)
    assert wait_for(lambda: len(_replicas()) == 2, 120)
    results = _run_streams(port)
    assert all(isinstance(r, tuple) and r[1] == "length" for r in results), results
    return results


def test_a_scale_down_during_8_live_streams_moves_them_exactly(
        config: Any, port: int, unscaled: list[tuple[str, str | None]]) -> None:
    """2 -> 1 while 8 greedy streams run: one replica leaves, its requests move to the one
    that stays (a lightweight update: that one is not restarted)."""
    before = _replicas()
    assert len(before) == 2
    moves_before = _router(port)["moves"]
    results = _run_streams(port, during=lambda: deploy_declared(config, 1))
    assert [r for r in results if not isinstance(r, tuple)] == []  # no stream failed
    assert results == unscaled  # token-identical: nothing lost, nothing sent twice
    (stayed,) = _replicas()
    assert stayed in before  # scaled in place, not restarted
    left = wait_for(lambda: _left(before - {stayed}), 30)
    (gone,) = left.values()
    assert {k: gone[k] for k in HELD} == dict.fromkeys(HELD, 0), gone
    assert gone["moved_out"] >= 1  # it was running streams when it left
    assert _router(port)["moves"] - moves_before == gone["moved_out"]


def test_a_rolling_restart_during_8_live_streams_drops_none(
        config: Any, port: int, unscaled: list[tuple[str, str | None]]) -> None:
    """New settings for every replica (here the ingress's Retry-After, which every
    deployment's arguments carry) restart them all, the ingress too, while 8 streams run:
    the old replicas' requests move to the new ones, the old ingress keeps its streams to
    the end."""
    deploy_declared(config, 2)
    before = wait_for(lambda: len(r := _replicas()) == 2 and r, 120)
    restarted = config.model_copy(update={"ingress": config.ingress.model_copy(
        update={"retry_after_s": config.ingress.retry_after_s + 1})})
    results = _run_streams(port, during=lambda: deploy_declared(restarted, 2))
    assert [r for r in results if not isinstance(r, tuple)] == []
    assert results == unscaled
    assert wait_for(lambda: len(r := _replicas()) == 2 and not r & before, 120)
    left = wait_for(lambda: len(g := _left(before)) == len(before) and g, 60)
    for gone in left.values():
        assert {k: gone[k] for k in HELD} == dict.fromkeys(HELD, 0), gone
    assert sum(g["moved_out"] for g in left.values()) >= 1
