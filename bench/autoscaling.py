"""A load step on the embedded deployment, under this project's autoscaling policy and under
Ray Serve's default request-count policy, side by side in one run; and the same step on the
disaggregated pair, whose prefill and decode pools each scale on their own load, under a
long-prompt-heavy load and a decode-heavy one.

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

The disaggregated variants (`pd_*`) deploy the pair with both pools autoscaled (min 1, max
`--max-replicas`) and step from `--base-clients` to a load of one shape:
- pd_long_prompts: `--long-clients` clients sending prompts of `--long-prompt-tokens` tokens
  (the long class) for `--long-max-tokens` tokens each. The prefill pool runs one long
  prefill at a time per replica, so they wait in its admission queue, which its policy reads
  (`--prefill-queue-wait-s`); the decode pool holds them briefly (and does not count those
  still at the prefill side), so it stays at one.
- pd_decode_heavy: `--step-clients` clients, short prompts, `--decode-max-tokens` each:
  the decode pool's KV fills and it scales; prefills stay short.
Each pool gets a row; both pools' replicas have `--pd-kv-tokens`. Every prefill replica may
run a long prefill here (`long_prefill_replica_fraction` 1.0): at the default 0.5 a second
replica would add no room for long prompts (docs/runbook.md "Autoscaling"). All variants:
the clients stand for many users from one address, so no per-client KV share applies.

On one CPU machine every replica shares the same cores: more replicas add no compute (a
starting one takes some), so this run shows what each policy decides and when, not the
TTFT a GPU fleet gains from a replica; its TTFT columns say what the clients saw here.

    python bench/autoscaling.py [--step-clients 12] [--step-s 40] [--variants ...]
                                [--json out.json]
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
VARIANTS = ("ledger", "ray_requests", "pd_long_prompts", "pd_decode_heavy")
# The target deployments each variant scales (app.py names them).
AGGREGATED, PREFILL, DECODE = "TargetDeployment", "PrefillDeployment", "DecodeDeployment"
PROMPTS = ["def fibonacci(n):", "The history of the printing press", "Write a haiku about rain",
           "import numpy as np\n", "Explain what a KV cache is", "Once upon a time, there"]


def _config(args: argparse.Namespace, variant: str) -> Any:
    from serve_app.config import AppConfig
    from serve_app.embedded import DRAFT, TARGET, TOKENIZER

    def scaling(policy: str, max_queue_wait_s: float) -> dict[str, Any]:
        return {"policy": policy, "min_replicas": 1, "max_replicas": args.max_replicas,
                "upscale_delay_s": args.upscale_delay_s,
                "downscale_delay_s": args.downscale_delay_s, "metrics_interval_s": 0.5,
                "look_back_period_s": 2.0, "max_queue_wait_s": max_queue_wait_s}

    config: dict[str, Any] = {
        "models": {"target": str(TARGET), "draft": str(DRAFT), "tokenizer": str(TOKENIZER),
                   "served_model_name": "bench"},
        "engine": {"reference": {"kv_capacity_tokens": (
            args.pd_kv_tokens if variant.startswith("pd_") else args.kv_tokens),
            "max_batch_size": 16}},
        "parallelism": {"tp": 1},
        "placement": {"accelerator": "CPU", "cpus_per_rank": 0.25},
        "ingress": {"max_tokens_limit": 4096},
        # The bench's clients stand for many users, from one address: no per-client share.
        "router": {"queue_timeout_s": 600, "client_max_kv_share": 1.0},
    }
    if variant.startswith("pd_"):
        config["disaggregation"] = {
            "enabled": True,
            "prefill": {"autoscaling": scaling("ledger", args.prefill_queue_wait_s)},
            "decode": {"autoscaling": scaling("ledger", 2.0)}}
        config["router"]["long_prefill_replica_fraction"] = 1.0
    else:
        config["placement"]["autoscaling"] = scaling(variant, 2.0)
    return AppConfig.model_validate(config)


def _pools(variant: str) -> tuple[str, ...]:
    return (PREFILL, DECODE) if variant.startswith("pd_") else (AGGREGATED,)


class Replicas(threading.Thread):
    """Samples the scaled deployments every 0.25 s: (when, {deployment: (replicas serving,
    replicas Serve has placed: starting or serving, i.e. what the policy decided)})."""

    def __init__(self, pools: tuple[str, ...]) -> None:
        super().__init__(daemon=True)
        self.pools = pools
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from ray import serve

        while not self.stop.wait(0.25):
            try:
                app = serve.status().applications.get("kimi")
                deps = app.deployments if app else {}
            except Exception:  # the controller is busy: skip a sample
                continue
            sample = {}
            for pool in self.pools:
                states = dict(deps[pool].replica_states) if pool in deps else {}
                running = states.get("RUNNING", 0)
                sample[pool] = (running, running + sum(
                    v for k, v in states.items()
                    if k in ("STARTING", "PENDING_MIGRATION", "RECOVERING")))
            self.samples.append((time.monotonic(), sample))

    def at_minimum(self) -> bool:
        """Every pool is down to one replica, serving and placed: a pool whose new replica
        is still starting as the step ends has not come back yet."""
        return bool(self.samples) and all(p <= 1 for _, p in self.samples[-1][1].values())


def _long_prompt(tokenizer: Any, body: list[int], tokens: int, i: int, n: int) -> list[int]:
    """A prompt of `tokens` ids: `body` (held-out code) after a line of its own, so that no
    two requests share a cached prefix (each is a full long prefill)."""
    ids = tokenizer.encode_text(f"# request {i}.{n}\n")
    while len(ids) < tokens:
        ids += body
    return ids[:tokens]


async def _client(base: str, stop_at: list[float], log: list[dict[str, Any]], i: int,
                  max_tokens: int, prompt: Any = None) -> None:
    """One streaming client: a request after the other until `stop_at[0]`; `prompt(i, n)`
    makes its n-th prompt (default: one of the short PROMPTS)."""
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
                text = prompt(i, n) if prompt else PROMPTS[(i + n) % len(PROMPTS)]
                async with client.stream("POST", f"{base}/v1/completions",
                                         json={**body, "prompt": text}) as resp:
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


async def _drive(base: str, args: argparse.Namespace, variant: str,
                 replicas: Replicas) -> dict[str, Any]:
    log: list[dict[str, Any]] = []
    t0 = time.monotonic()
    step_at, step_end = t0 + args.base_s, t0 + args.base_s + args.step_s
    base_stop = [step_end + args.tail_s]
    step_stop = [step_end]
    tasks = [asyncio.create_task(_client(base, base_stop, log, i, args.max_tokens))
             for i in range(args.base_clients)]
    await asyncio.sleep(max(0.0, step_at - time.monotonic()))
    if variant == "pd_long_prompts":
        from serve_app.embedded import heldout_prompts
        from serve_app.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
        body = tokenizer.encode_text("\n\n".join(heldout_prompts()["completion"]))

        def prompt(i: int, n: int) -> list[int]:
            return _long_prompt(tokenizer, body, args.long_prompt_tokens, i, n)

        tasks += [asyncio.create_task(_client(base, step_stop, log, 100 + i,
                                              args.long_max_tokens, prompt))
                  for i in range(args.long_clients)]
    else:
        max_tokens = args.decode_max_tokens if variant == "pd_decode_heavy" else args.max_tokens
        tasks += [asyncio.create_task(_client(base, step_stop, log, 100 + i, max_tokens))
                  for i in range(args.step_clients - args.base_clients)]
    await asyncio.sleep(max(0.0, step_end - time.monotonic()))
    # The tail: the base load until every pool is back at one replica.
    while time.monotonic() < base_stop[0] and not replicas.at_minimum():
        await asyncio.sleep(0.25)
    base_stop[0] = time.monotonic()
    await asyncio.gather(*tasks)
    return {"log": log, "t0": t0, "step_at": step_at, "step_end": step_end}


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _run_variant(variant: str, args: argparse.Namespace, port: int) -> list[dict[str, Any]]:
    """One row per scaled pool."""
    import httpx
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(_config(args, variant)), name="kimi", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    httpx.post(f"{base}/v1/completions", json={"model": "bench", "prompt": "hi",
                                               "max_tokens": 2}, timeout=120)
    replicas = Replicas(_pools(variant))
    replicas.start()
    run = asyncio.run(_drive(base, args, variant, replicas))
    moves = httpx.get(f"{base}/v1/router", timeout=30).json().get("moves", 0)
    replicas.stop.set()
    replicas.join()
    serve.delete("kimi")
    step_at, step_end = run["step_at"], run["step_end"]
    during = [e for e in run["log"] if step_at <= e["start"] < step_end]
    ttfts = [e["ttft"] for e in during if e["ttft"] is not None]
    rows = []
    for pool in replicas.pools:
        samples = [(t, s[pool][0], s[pool][1]) for t, s in replicas.samples]
        timeline, last = [], None
        for t, n, p in samples:  # the changes only
            if (n, p) != last:
                timeline.append((round(t - run["t0"], 2), n, p))
                last = (n, p)
        rows.append({
            "variant": variant,
            "pool": pool.removesuffix("Deployment").lower(),
            "replicas_max": max((n for _, n, _ in samples), default=0),
            "time_to_scale_up_s": next(
                (t - step_at for t, _, p in samples if t >= step_at and p > 1), None),
            "time_to_new_replica_s": next(
                (t - step_at for t, n, _ in samples if t >= step_at and n > 1), None),
            "time_back_to_one_s": next(
                (t - step_end for t, _, p in samples if t >= step_end and p <= 1), None),
            "step_ttft_p50_s": _percentile(ttfts, 0.5),
            "step_ttft_p99_s": _percentile(ttfts, 0.99),
            "step_requests": len(during),
            "completed": sum(e["ok"] for e in run["log"]),
            "failed": sum(not e["ok"] for e in run["log"]),
            "moved": moves,
            "timeline": timeline,
        })
    return rows


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
    parser.add_argument("--pd-kv-tokens", type=int, default=4096,
                        help="KV tokens per replica of either pool (pd_*): a decode replica "
                        "holds the long step's prompts")
    parser.add_argument("--decode-max-tokens", type=int, default=384,
                        help="pd_decode_heavy: max_tokens of the step's requests")
    parser.add_argument("--long-clients", type=int, default=6,
                        help="pd_long_prompts: clients in the step")
    parser.add_argument("--long-prompt-tokens", type=int, default=512)
    parser.add_argument("--long-max-tokens", type=int, default=4)
    parser.add_argument("--prefill-queue-wait-s", type=float, default=1.0,
                        help="the prefill pool's max_queue_wait_s")
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
        rows = [row for v in args.variants.split(",") for row in _run_variant(v, args, port)]
    finally:
        serve.shutdown()
        ray.shutdown()

    cols = ["variant", "pool", "replicas_max", "time_to_scale_up_s", "time_to_new_replica_s",
            "time_back_to_one_s", "step_ttft_p50_s", "step_ttft_p99_s", "step_requests",
            "completed", "failed", "moved"]
    print(f"load step: {args.base_clients} -> {args.step_clients} streaming clients for "
          f"{args.step_s:g} s, max_tokens {args.max_tokens}, {args.kv_tokens} KV tokens a "
          f"replica, 1..{args.max_replicas} replicas a pool; pd_long_prompts: "
          f"{args.long_clients} clients of {args.long_prompt_tokens}-token prompts, "
          f"max_tokens {args.long_max_tokens}")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(_fmt(r[c]) for c in cols))
        print(f"  replicas over time (s from start, serving, placed): {r['timeline']}")
    variants: dict[str, Any] = {}
    for r in rows:
        variants.setdefault(r["variant"], {})[r["pool"]] = r
    report = {"bench": "autoscaling", "args": vars(args), "variants": variants}
    line = json.dumps(report, sort_keys=True)
    print(line)
    if args.json:
        Path(args.json).write_text(line)


if __name__ == "__main__":
    sys.exit(main())
