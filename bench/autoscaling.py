"""A load step on the embedded deployment, under this project's autoscaling policy and under
Ray Serve's default request-count policy, side by side in one run.

Each variant deploys the embedded pair (CPU, TP 1) with `placement.autoscaling` (min 1, the
same bounds and delays), then drives streaming completions from a fixed number of clients:
`--base-clients` for `--base-s`, a step to `--step-clients` for `--step-s`, and the base again
until the deployment is back at its minimum (or `--tail-s` runs out). The requests are
KV-heavy (max_tokens `--max-tokens` against a `--kv-tokens` replica): a replica is full by its
KV tokens long before it runs many requests, which the ledger policy sees (reserved KV and
the admission queue) and a request count does not.

Per variant: the replicas over time, the time from the step to the policy's scale-up (a new
replica placed) and to the first new replica serving (its cold start: the weights load), the
most replicas, the time from the step's end back to one, TTFT p50 / p99 during the step,
requests completed and failed, and the requests moved off leaving replicas.

On one CPU machine every replica shares the same cores: more replicas add no compute (a
starting one takes some), so this run shows what each policy decides and when, not the
TTFT a GPU fleet gains from a replica; its TTFT columns say what the clients saw here.

    python bench/autoscaling.py [--step-clients 12] [--step-s 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("ledger", "ray_requests")
PROMPTS = ["def fibonacci(n):", "The history of the printing press", "Write a haiku about rain",
           "import numpy as np\n", "Explain what a KV cache is", "Once upon a time, there"]


def _config(args: argparse.Namespace, policy: str) -> Any:
    from serve_app.config import AppConfig
    from serve_app.embedded import DRAFT, TARGET, TOKENIZER

    return AppConfig.model_validate({
        "models": {"target": str(TARGET), "draft": str(DRAFT), "tokenizer": str(TOKENIZER),
                   "served_model_name": "bench"},
        "engine": {"reference": {"kv_capacity_tokens": args.kv_tokens, "max_batch_size": 16}},
        "parallelism": {"tp": 1},
        "placement": {"accelerator": "CPU", "cpus_per_rank": 0.25, "autoscaling": {
            "policy": policy, "min_replicas": 1, "max_replicas": args.max_replicas,
            "upscale_delay_s": args.upscale_delay_s,
            "downscale_delay_s": args.downscale_delay_s, "metrics_interval_s": 0.5,
            "look_back_period_s": 2.0, "max_queue_wait_s": 2.0}},
        "ingress": {"max_tokens_limit": 4096},
        "router": {"queue_timeout_s": 600},
    })


class Replicas(threading.Thread):
    """Samples the target deployment every 0.25 s: (when, replicas serving, replicas Serve
    has placed: starting or serving, i.e. what the policy decided)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from ray import serve

        while not self.stop.wait(0.25):
            try:
                app = serve.status().applications.get("kimi")
                dep = app.deployments.get("TargetDeployment") if app else None
                states = dict(dep.replica_states) if dep else {}
            except Exception:  # the controller is busy: skip a sample
                continue
            running = states.get("RUNNING", 0)
            placed = running + sum(v for k, v in states.items()
                                   if k in ("STARTING", "PENDING_MIGRATION", "RECOVERING"))
            self.samples.append((time.monotonic(), running, placed))

    def now(self) -> int:
        return self.samples[-1][1] if self.samples else 0


async def _client(base: str, stop_at: list[float], log: list[dict[str, Any]], i: int,
                  max_tokens: int) -> None:
    import httpx

    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client:
        n = 0
        while time.monotonic() < stop_at[0]:
            n += 1
            start = time.monotonic()
            entry: dict[str, Any] = {"start": start, "ttft": None, "ok": False}
            try:
                prompt = PROMPTS[(i + n) % len(PROMPTS)]
                async with client.stream("POST", f"{base}/v1/completions",
                                         json={**body, "prompt": prompt}) as resp:
                    resp.raise_for_status()
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {") and entry["ttft"] is None:
                            entry["ttft"] = time.monotonic() - start
                        if line == "data: [DONE]":
                            entry["ok"] = True
            except Exception as exc:
                entry["error"] = type(exc).__name__
            entry["end"] = time.monotonic()
            log.append(entry)


async def _drive(base: str, args: argparse.Namespace, replicas: Replicas) -> dict[str, Any]:
    log: list[dict[str, Any]] = []
    t0 = time.monotonic()
    step_at, step_end = t0 + args.base_s, t0 + args.base_s + args.step_s
    base_stop = [step_end + args.tail_s]
    step_stop = [step_end]
    tasks = [asyncio.create_task(_client(base, base_stop, log, i, args.max_tokens))
             for i in range(args.base_clients)]
    await asyncio.sleep(max(0.0, step_at - time.monotonic()))
    tasks += [asyncio.create_task(_client(base, step_stop, log, 100 + i, args.max_tokens))
              for i in range(args.step_clients - args.base_clients)]
    await asyncio.sleep(max(0.0, step_end - time.monotonic()))
    # The tail: the base load until the deployment is back at one replica.
    while time.monotonic() < base_stop[0] and replicas.now() > 1:
        await asyncio.sleep(0.25)
    base_stop[0] = time.monotonic()
    await asyncio.gather(*tasks)
    return {"log": log, "t0": t0, "step_at": step_at, "step_end": step_end}


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _run_variant(policy: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    import httpx
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(_config(args, policy)), name="kimi", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    httpx.post(f"{base}/v1/completions", json={"model": "bench", "prompt": "hi",
                                               "max_tokens": 2}, timeout=120)
    replicas = Replicas()
    replicas.start()
    run = asyncio.run(_drive(base, args, replicas))
    moves = httpx.get(f"{base}/v1/router", timeout=30).json().get("moves", 0)
    replicas.stop.set()
    replicas.join()
    serve.delete("kimi")
    step_at, step_end = run["step_at"], run["step_end"]
    samples = replicas.samples
    decided = next((t - step_at for t, _, p in samples if t >= step_at and p > 1), None)
    first_new = next((t - step_at for t, n, _ in samples if t >= step_at and n > 1), None)
    back = next((t - step_end for t, n, _ in samples if t >= step_end and n <= 1), None)
    timeline, last = [], None
    for t, n, p in samples:  # the changes only
        if (n, p) != last:
            timeline.append((round(t - run["t0"], 2), n, p))
            last = (n, p)
    during = [e for e in run["log"] if step_at <= e["start"] < step_end]
    ttfts = [e["ttft"] for e in during if e["ttft"] is not None]
    return {
        "policy": policy,
        "replicas_max": max((n for _, n, _ in samples), default=0),
        "time_to_scale_up_s": decided,
        "time_to_new_replica_s": first_new,
        "time_back_to_one_s": back,
        "step_ttft_p50_s": _percentile(ttfts, 0.5),
        "step_ttft_p99_s": _percentile(ttfts, 0.99),
        "step_requests": len(during),
        "completed": sum(e["ok"] for e in run["log"]),
        "failed": sum(not e["ok"] for e in run["log"]),
        "moved": moves,
        "timeline": timeline,
    }


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-clients", type=int, default=1)
    parser.add_argument("--step-clients", type=int, default=12)
    parser.add_argument("--base-s", type=float, default=10.0)
    parser.add_argument("--step-s", type=float, default=40.0)
    parser.add_argument("--tail-s", type=float, default=60.0,
                        help="longest wait for the deployment to come back to one replica")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--kv-tokens", type=int, default=2048,
                        help="KV tokens per replica (a replica holds ~7 requests by KV)")
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--upscale-delay-s", type=float, default=1.0)
    parser.add_argument("--downscale-delay-s", type=float, default=5.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json")
    args = parser.parse_args()

    import ray
    from ray import serve

    from serve_app.netutil import free_port

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        results = [_run_variant(v, args, port) for v in args.variants.split(",")]
    finally:
        serve.shutdown()
        ray.shutdown()

    cols = ["policy", "replicas_max", "time_to_scale_up_s", "time_to_new_replica_s",
            "time_back_to_one_s",
            "step_ttft_p50_s", "step_ttft_p99_s", "step_requests", "completed", "failed",
            "moved"]
    print(f"load step: {args.base_clients} -> {args.step_clients} streaming clients for "
          f"{args.step_s:g} s, max_tokens {args.max_tokens}, {args.kv_tokens} KV tokens a "
          f"replica, 1..{args.max_replicas} replicas")
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(_fmt(r[c]) for c in cols))
        print(f"  replicas over time (s from start, serving, placed): {r['timeline']}")
    report = {"bench": "autoscaling", "args": vars(args),
              "variants": {r["policy"]: r for r in results}}
    line = json.dumps(report, sort_keys=True)
    print(line)
    if args.json:
        Path(args.json).write_text(line)


if __name__ == "__main__":
    sys.exit(main())
