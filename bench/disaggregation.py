"""Decode inter-token latency while a long prompt prefills: the aggregated app against the
prefill/decode-disaggregated app on the same cores, side by side in one run.

The probe (issue 26): --streams requests decode (each, when it ends, is followed by the next);
after --quiet-s seconds one long prompt (--long-chars characters of a held-out stdlib file)
arrives. The streams' gaps between SSE events are split by when they end: "quiet" (before the
long prompt arrives) and "during" (from its arrival to its first token). Per variant: p50 and
p99 of each, during p99 / quiet p99, and the long prompt's time to first token. Medians over
--rounds probes.

Variants (the embedded pair, deployments/local.yaml's engine and router: kv_aware, which places
a disaggregated request on a (decode, prefill) pair; one local cluster, the same --cores torch
threads in all):
  aggregated:    one replica at TP 1 with --cores threads; the long prompt is prefilled in
                 chunks between the streams' decode steps.
  disaggregated: one prefill replica and one decode replica at TP 1, --cores / 2 threads each;
                 the long prompt is prefilled on the prefill replica and handed over.

Goal: disaggregated during p99 <= 1.2 x its quiet p99.

    python bench/disaggregation.py [--streams 4] [--long-chars 12000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[1]


def _config(variant: str, cores: int) -> Any:
    """deployments/local.yaml's app at TP 1 on `cores` threads, aggregated or disaggregated."""
    from serve_app.config import AppConfig

    raw = yaml.safe_load((ROOT / "deployments/local.yaml").read_text())["applications"][0]["args"]
    raw["parallelism"] = {"tp": 1}
    raw["ingress"] = {**raw.get("ingress", {}), "max_tokens_limit": 4096}
    raw["api"] = {}  # the OpenAI contract: the probe's completions set their own temperature
    if variant == "aggregated":
        raw["placement"] = {"accelerator": "CPU", "cpus_per_rank": cores}
    else:
        # Each side one rank with half the threads: the same cores in all.
        raw["placement"] = {"accelerator": "CPU", "cpus_per_rank": max(1, cores // 2)}
        raw["disaggregation"] = {"enabled": True, "prefill": {"parallelism": {"tp": 1}},
                                 "decode": {"parallelism": {"tp": 1}}}
    return AppConfig.model_validate(raw)


def _long_prompt(chars: int) -> str:
    """`chars` characters of held-out stdlib source (never trained on)."""
    import sysconfig

    from serve_app.embedded import HELDOUT_PROMPTS

    text = ""
    for rel in json.loads(HELDOUT_PROMPTS.read_text())["heldout_files"]:
        path = Path(sysconfig.get_paths()["stdlib"]) / rel
        if path.exists():
            text += path.read_text(errors="replace")
        if len(text) >= chars:
            break
    return text[:chars]


def _pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if ordered else float("nan")


async def _probe(base: str, model: str, args: argparse.Namespace, long_prompt: str
                 ) -> dict[str, Any]:
    marks: dict[str, float] = {}
    gaps: list[tuple[float, float]] = []  # (end time, gap)
    stop = asyncio.Event()
    prompts = ["def parse(", "class Cache:\n    def ", "import os\n\ndef walk(", "for i in range("]

    async def stream(client: httpx.AsyncClient, k: int) -> None:
        n = 0
        while not stop.is_set():
            body = {"model": model, "prompt": prompts[k % len(prompts)], "stream": True,
                    "max_tokens": 512, "temperature": 0.7, "seed": 1000 * k + n}
            n += 1
            last = None
            async with client.stream("POST", base + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now, now - last))
                    last = now
                    if stop.is_set():
                        break

    async def long_request(client: httpx.AsyncClient) -> None:
        await asyncio.sleep(args.quiet_s)
        body = {"model": model, "prompt": long_prompt, "stream": True, "max_tokens": 1,
                "temperature": 0}
        marks["sent"] = time.perf_counter()
        async with client.stream("POST", base + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and "first" not in marks:
                    marks["first"] = time.perf_counter()
        await asyncio.sleep(1.0)  # the streams' gaps right after, for the record
        stop.set()

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(stream(client, k)) for k in range(args.streams)]
        await long_request(client)
        await asyncio.gather(*tasks)
    warm = start + 1.0  # the streams' first prefills are not decode gaps
    quiet = [g for t, g in gaps if warm <= t < marks["sent"]]
    during = [g for t, g in gaps if marks["sent"] <= t <= marks["first"]]
    return {"quiet_p50_ms": _pct(quiet, 0.5), "quiet_p99_ms": _pct(quiet, 0.99),
            "during_p50_ms": _pct(during, 0.5), "during_p99_ms": _pct(during, 0.99),
            "p99_ratio": _pct(during, 0.99) / _pct(quiet, 0.99),
            "long_ttft_s": marks["first"] - marks["sent"], "gaps": [len(quiet), len(during)],
            # The longest gaps during, each with when it ended (s after the long prompt's
            # arrival): where the tail comes from.
            "during_longest": sorted(((round(g * 1e3), round(t - marks["sent"], 2))
                                      for t, g in gaps
                                      if marks["sent"] <= t <= marks["first"]), reverse=True)[:5]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-chars", type=int, default=12000)
    parser.add_argument("--quiet-s", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()

    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import resolve_path
    from serve_app.netutil import free_port
    from serve_app.tokenizer import load_tokenizer

    long_prompt = _long_prompt(args.long_chars)
    base_cfg = _config("aggregated", args.cores)
    long_tokens = len(load_tokenizer(resolve_path(base_cfg.models.tokenizer)).encode(long_prompt))
    ray.init(address="local", num_cpus=2 * args.cores + 2, include_dashboard=False,
             log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results: dict[str, Any] = {"streams": args.streams, "long_prompt_tokens": long_tokens,
                               "cores": args.cores, "rounds": args.rounds}
    try:
        for variant in ("aggregated", "disaggregated"):
            serve.run(build_app(_config(variant, args.cores)), name="kimi", route_prefix="/")
            # A first line of its own each round: the prefix cache must not serve the prompt.
            runs = [asyncio.run(_probe(f"http://127.0.0.1:{port}",
                                       base_cfg.models.served_model_name, args,
                                       f"# {variant} round {i}\n{long_prompt}"))
                    for i in range(args.rounds)]
            serve.delete("kimi")
            results[variant] = {k: statistics.median(r[k] for r in runs)
                                for k in runs[0] if k not in ("gaps", "during_longest")}
            results[variant]["gaps_per_round"] = [r["gaps"] for r in runs]
            results[variant]["during_longest_ms_at_s"] = [r["during_longest"] for r in runs]
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"{args.streams} streams decoding, one {long_tokens}-token prompt arriving; "
          f"{args.cores} cores; medians of {args.rounds} rounds\n")
    print(f"{'variant':<15}{'quiet p50':>10}{'quiet p99':>10}{'during p50':>11}"
          f"{'during p99':>11}{'p99 ratio':>10}{'long TTFT':>10}")
    for variant in ("aggregated", "disaggregated"):
        r = results[variant]
        print(f"{variant:<15}{r['quiet_p50_ms']:>8.0f}ms{r['quiet_p99_ms']:>8.0f}ms"
              f"{r['during_p50_ms']:>9.0f}ms{r['during_p99_ms']:>9.0f}ms{r['p99_ratio']:>9.2f}x"
              f"{r['long_ttft_s']:>9.2f}s")
    print("\ngoal: disaggregated p99 ratio <= 1.2x")
    line = json.dumps(results)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
