"""The reference engine's prefix cache, and the router's use of it, on the embedded CPU pair.

One client asks one document (a few thousand tokens of committed text: docs/router.md) ten
different short questions, one after the other (streamed chat completions, greedy, max_tokens
16), against four apps served side by side from one Ray cluster (their questions interleaved,
so that this machine's drift falls on all four alike):

  a  1 replica, prefix cache off
  b  1 replica, prefix cache on
  c  2 replicas, prefix cache on, router kv_aware   (prefix affinity + least work + admission)
  d  2 replicas, prefix cache on, router power_of_two

The engine settings are deployments/local.yaml's (the committed mini Kimi target + DSpark
draft, speculation on) with TP 1 and 0.25 CPU per rank, so that six replicas fit two cores.
Per variant: client-side TTFT (time to the first chunk with content) p50 / p99 / mean, the
cache hit rate from the replicas' own stats (sum over replicas of cached_tokens_total over
the prompt tokens they served, measured as differences around the questions), where the
router sent each question, and `usage.prompt_tokens_details.cached_tokens` when the ingress
reports it. Before the questions every replica gets one unrelated prompt as long as the
document (the first long prefill in a fresh replica costs about twice a later one); the
replicas' prompt tokens also count Serve's 1-token health-check generations (a few dozen
tokens in 30,000). Then the router simulator (bench/router_simulator.py: its default K3 + DSpark
on 2 x 8 H200 costs, the real policy classes) on the same shape: one document of as many
tokens, 10 questions arriving one after another, 2 replicas, kv_aware vs power_of_two, in the
engine's 16-token pages (the simulator's one block size serves its router and its cache) and
in the router's 256-token blocks.

    python bench/prefix_cache.py [--questions 10] [--doc-tokens 3000] [--max-tokens 16]
                                 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Before ray is imported anywhere: a local single-machine cluster without tokens, and torch
# threads that do not fight over two cores.
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODEL = "kimi-k3-mini-dspark"
DOCUMENT = ROOT / "docs" / "router.md"
QUESTIONS = [
    "What does the router do when no replica can hold a request?",
    "Which file holds the discrete-event simulator?",
    "What is the default block size of the prefix index?",
    "How many KV tokens does one K3 replica hold?",
    "What does a request reserve when it is dispatched?",
    "Which policy is Ray Serve's default?",
    "What is the short-request TTFT SLO?",
    "Why is the ledger released in the ingress and not in the request router?",
    "What does long_prefill_replica_fraction control?",
    "How often does the admission stage refresh the replica list?",
    "Which SGLang flag bounds the running requests?",
    "What happens to a request larger than every replica?",
]
VARIANTS = [  # name, replicas, prefix cache, router policy
    ("a", 1, False, "kv_aware"),
    ("b", 1, True, "kv_aware"),
    ("c", 2, True, "kv_aware"),
    ("d", 2, True, "power_of_two"),
]
LABELS = {"a": "1 replica, cache off", "b": "1 replica, cache on",
          "c": "2 replicas, cache on, kv_aware", "d": "2 replicas, cache on, power_of_two"}


def _pcts(samples: list[float]) -> dict[str, float]:
    """p50 / p99 (of 10 samples: the largest) / mean, in ms."""
    s = sorted(samples)
    return {"p50_ms": statistics.median(s) * 1e3,
            "p99_ms": s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3,
            "mean_ms": statistics.fmean(s) * 1e3, "n": len(s)}


def _document(tokenizer: Any, limit: int, path: Path = DOCUMENT) -> str:
    """A committed file's leading whole lines, at most `limit` tokens."""
    lines = path.read_text().splitlines(keepends=True)
    lo, hi = 1, len(lines)
    while lo < hi:  # the most lines whose encoding fits
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode("".join(lines[:mid]))) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def _message(doc: str, question: str) -> str:
    return f"Read this document and answer the question.\n\n{doc}\nQuestion: {question}"


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def _config(base: dict[str, Any], replicas: int, cache: bool, policy: str) -> Any:
    from serve_app.config import AppConfig

    raw = json.loads(json.dumps(base))
    ref = raw["engine"]["reference"]
    ref["prefix_cache"] = {"enabled": cache}
    raw["parallelism"] = {"tp": 1, "nodes": 1}
    raw["placement"] = {**raw.get("placement", {}), "accelerator": "CPU",
                        "cpus_per_rank": 0.25, "replicas": replicas}
    raw["router"] = {**raw.get("router", {}), "policy": policy}
    return AppConfig.model_validate(raw)


@dataclass
class Variant:
    name: str
    replicas: int
    cache: bool
    policy: str
    config: Any
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    usage_cached: list[int | None] = field(default_factory=list)
    replica_of: list[str] = field(default_factory=list)
    stats_before: list[dict[str, Any]] = field(default_factory=list)
    stats_after: list[dict[str, Any]] = field(default_factory=list)
    warm_ids: list[str] = field(default_factory=list)
    warm_replicas: int = 0


def _ask(client: httpx.Client, prefix: str, content: str, max_tokens: int
         ) -> tuple[float, float, dict[str, Any], str]:
    """One streamed chat completion: (TTFT to the first content chunk, end to end, usage, id)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage, rid = None, {}, ""
    with client.stream("POST", f"{prefix}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                raise RuntimeError(f"{prefix}: {payload['error']}")
            rid = payload.get("id", rid)
            for choice in payload.get("choices", []):
                if ttft is None and choice.get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
            if payload.get("usage"):
                usage = payload["usage"]
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), total, usage, rid


def _stats(app: str) -> list[dict[str, Any]]:
    from ray import serve

    handle = serve.get_deployment_handle("TargetDeployment", app_name=app)
    return list(handle.broadcast("stats").results(timeout_s=60))


def _delta(v: Variant, key: str) -> int:
    return (sum(int(s.get(key, 0)) for s in v.stats_after)
            - sum(int(s.get(key, 0)) for s in v.stats_before))


def _run_serve(variants: list[Variant], doc: str, questions: list[str], max_tokens: int,
               warm_text: str) -> float:
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.netutil import free_port

    for attempt in range(3):  # a loaded 2-core machine sometimes misses Ray's start timeout
        try:
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
            break
        except Exception as exc:
            if attempt == 2:
                raise
            print(f"ray.init failed ({exc}); retrying", flush=True)
            ray.shutdown()
            time.sleep(5)
    started = time.perf_counter()
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for v in variants:
            serve.run(build_app(v.config), name=f"pc_{v.name}", route_prefix=f"/{v.name}")
        print(f"[{time.perf_counter() - started:.0f} s] {len(variants)} apps up", flush=True)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=300) as client:
            # Warm every replica (two concurrent requests reach both replicas under either
            # policy: the second sees the first in flight) with a prompt as long as the
            # document's, of unrelated text, so that nothing of the document is cached before
            # its first question.
            for v in variants:
                with ThreadPoolExecutor(2) as pool:
                    warm = list(pool.map(lambda i, v=v: _ask(client, f"/{v.name}",
                                                             f"# warm-up {i}\n{warm_text}", 4),
                                         range(2)))
                v.warm_ids = [w[3] for w in warm]
                v.stats_before = _stats(f"pc_{v.name}")
            print(f"[{time.perf_counter() - started:.0f} s] warm", flush=True)
            for q in questions:
                for v in variants:
                    ttft, total, usage, rid = _ask(client, f"/{v.name}", _message(doc, q),
                                                   max_tokens)
                    v.ttft.append(ttft)
                    v.e2e.append(total)
                    v.prompt_tokens.append(int(usage.get("prompt_tokens", 0)))
                    details = usage.get("prompt_tokens_details") or {}
                    v.usage_cached.append(details.get("cached_tokens"))
                    v.replica_of.append(rid)
            for v in variants:
                v.stats_after = _stats(f"pc_{v.name}")
                recent = {d["id"]: d["replica"] for d in
                          client.get(f"/{v.name}/v1/router").json().get("recent", [])}
                v.replica_of = [recent.get(rid, "?") for rid in v.replica_of]
                v.warm_replicas = len({recent.get(rid, "?") for rid in v.warm_ids})
        print(f"[{time.perf_counter() - started:.0f} s] asked", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return time.perf_counter() - started


def _simulate(doc_tokens: int, question_tokens: int, output_tokens: int, n: int,
              warm_tokens: int, settings: Any, seeds: int) -> dict[str, Any]:
    """The router simulator on this workload: one document, n questions one after another
    (each arriving long after the previous one finished), 2 replicas; its default cost model
    (K3 + DSpark, 2 x 8 H200). The two concurrent warm-up requests of the real run come first,
    so that power_of_two's seed-0 draws fall on the questions as they did in the app (its
    policy also runs with seed 0); other seeds give the spread of that luck."""
    from router_simulator import CostModel, FleetSpec, SimRequest, simulate

    from serve_app.routing.policy import make_policy
    from serve_app.routing.prefix_index import chain_hashes

    cost = CostModel(FleetSpec(replicas=2))
    bs = settings.block_size
    blocks = chain_hashes(("doc", 0, i) for i in range(doc_tokens // bs))
    gap = 600.0
    prompt = doc_tokens + question_tokens
    cls = "long" if prompt >= settings.long_threshold else "short"
    warm = [SimRequest(f"w{j}", j * 1e-4, "long" if warm_tokens >= settings.long_threshold
                       else "short", warm_tokens, 4,
                       blocks=chain_hashes(("warm", j, i) for i in range(warm_tokens // bs)))
            for j in range(2)]
    reqs = warm + [SimRequest(f"q{i}", (i + 1) * gap, cls, prompt, output_tokens, doc=0,
                              doc_tokens=doc_tokens, blocks=blocks) for i in range(n)]
    out: dict[str, Any] = {"fleet": "K3 + DSpark, 2 x 8 H200 per replica (simulator default)",
                           "block_size": bs, "doc_tokens": doc_tokens,
                           "question_tokens": question_tokens}
    for policy in ("kv_aware", "power_of_two"):
        rows = []
        for seed in range(seeds if policy == "power_of_two" else 1):
            pol = make_policy(settings.model_copy(update={"seed": seed}), policy)
            outs, _, _, _ = simulate(reqs, cost, pol)
            done = [o for o in outs if o.status == "ok" and o.request_id.startswith("q")]
            assert len(done) == n, [o.status for o in outs]
            rows.append({
                "hit_rate": sum(o.cached_tokens for o in done) / sum(o.prompt_tokens
                                                                      for o in done),
                "ttft": _pcts([o.ttft for o in done]),
                "replicas": [o.replica for o in done]})
        hits = [r["hit_rate"] for r in rows]
        out[policy] = {**rows[0], "seeds": len(rows),
                       "hit_rate_over_seeds": {"mean": statistics.fmean(hits),
                                               "min": min(hits), "max": max(hits)},
                       "ttft_mean_ms_over_seeds": statistics.fmean(r["ttft"]["mean_ms"]
                                                                   for r in rows)}
    kv, p2 = out["kv_aware"], out["power_of_two"]
    out["ttft_ratio_p50"] = kv["ttft"]["p50_ms"] / p2["ttft"]["p50_ms"]
    out["ttft_ratio_mean"] = kv["ttft"]["mean_ms"] / p2["ttft"]["mean_ms"]
    out["ttft_ratio_mean_over_seeds"] = kv["ttft"]["mean_ms"] / p2["ttft_mean_ms_over_seeds"]
    return out


def _by_first_use(replicas: list[str]) -> str:
    """A replica sequence as letters in order of first use (AABA...): comparable across runs
    whatever the replicas are called."""
    names: dict[str, str] = {}
    for r in replicas:
        names.setdefault(r, "ABCDEFGH"[len(names)] if len(names) < 8 else "?")
    return "".join(names[r] for r in replicas)


def _direction(ratio: float) -> str:
    return "lower" if ratio < 0.9 else "higher" if ratio > 1.1 else "about equal"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--doc-tokens", type=int, default=3000,
                        help="document length (the models' context is 4,096)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sim-seeds", type=int, default=20,
                        help="power_of_two seeds averaged in the simulator")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.questions > len(QUESTIONS):
        sys.exit(f"--questions: at most {len(QUESTIONS)}")
    wall0 = time.perf_counter()

    from serve_app.config import context_length
    from serve_app.embedded import chat_prompt_ids
    from serve_app.tokenizer import load_tokenizer

    base = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    base = base["applications"][0]["args"]
    variants = [Variant(n, r, c, p, _config(base, r, c, p)) for n, r, c, p in VARIANTS]
    cfg = variants[0].config
    tokenizer = load_tokenizer(cfg.models.tokenizer_path())
    ctx = context_length(cfg)
    doc = _document(tokenizer, args.doc_tokens)
    questions = QUESTIONS[:args.questions]
    # The prompts as the ingress makes them (the tokenizer folder's chat format: K3's XTML).
    prompts = [chat_prompt_ids(tokenizer, {"messages": [{"role": "user",
                                                         "content": _message(doc, q)}]})
               for q in questions]
    longest = max(len(p) for p in prompts)
    if longest + args.max_tokens > ctx:
        sys.exit(f"prompt {longest} + {args.max_tokens} tokens exceeds the context {ctx}")
    shared = _common_prefix(prompts)
    page = cfg.engine.reference.page_size
    # What a perfect cache could serve: every question after the first, its shared prefix in
    # whole pages (at least one prompt token is always computed).
    ideal = sum(min(shared, len(p) - 1) // page * page for p in prompts[1:])
    ideal_rate = ideal / sum(len(p) for p in prompts)
    ref = cfg.engine.reference
    print(f"document: {DOCUMENT.relative_to(ROOT)}, {len(tokenizer.encode(doc))} tokens; "
          f"prompts {min(len(p) for p in prompts)}..{longest} tokens, shared prefix {shared}; "
          f"context {ctx}, kv_capacity {ref.kv_capacity_tokens}, page {page}, prefill chunk "
          f"{ref.prefill_chunk_tokens} (per request {ref.max_prefill_tokens_per_request or 'default'}"
          f"), speculation {ref.speculation.enabled}", flush=True)

    # As long as the document and unrelated to it (after a 400-token warm-up the first
    # question still cost 8.8 s against 4.3 s for later cold ones).
    warm_text = _document(tokenizer, args.doc_tokens, ROOT / "serve_app" / "routing" / "policy.py")
    serve_s = _run_serve(variants, doc, questions, args.max_tokens, warm_text)

    settings = variants[2].config.router.settings(cfg.engine.backend, ctx)
    mean_prompt = round(statistics.fmean(len(p) for p in prompts))
    warm_tokens = len(chat_prompt_ids(tokenizer, {"messages": [{"role": "user",
                                                                "content": warm_text}]}))
    # The simulator has one block size, for the router's index and the engine's cache alike;
    # the engine caches page_size pages, the router hashes block_size blocks. The comparison
    # runs it at the engine's page (what the replicas can hit); the router's block size is
    # reported beside it.
    sims = {}
    for bs in (page, settings.block_size):
        doc_blocks = shared - shared % bs
        sims[bs] = _simulate(doc_blocks, mean_prompt - doc_blocks, args.max_tokens,
                             len(questions), warm_tokens,
                             settings.model_copy(update={"block_size": bs}), args.sim_seeds)
    sim = sims[page]

    results: dict[str, Any] = {
        "document": str(DOCUMENT.relative_to(ROOT)), "doc_tokens": len(tokenizer.encode(doc)),
        "questions": len(questions), "max_tokens": args.max_tokens,
        "prompt_tokens_mean": mean_prompt, "shared_prefix_tokens": shared,
        "ideal_hit_rate": ideal_rate, "variants": {}}
    print()
    head = (f"{'variant':<36}{'TTFT p50':>10}{'p99':>9}{'mean':>9}{'e2e p50':>9}"
            f"{'hit rate':>10}{'cached/prompt tok':>19}  requests per replica")
    print(head)
    print("-" * len(head))
    for v in variants:
        cached = _delta(v, "cached_tokens_total") if v.cache else 0
        prompt = _delta(v, "prompt_tokens")
        # Which replica each question went to, in order of first use (A, B).
        sequence = _by_first_use(v.replica_of)
        per = {n: sequence.count(n) for n in sorted(set(sequence))}
        if v.replicas == 2:
            per.setdefault("B", 0)
        t = _pcts(v.ttft)
        usage_cached = [c for c in v.usage_cached if c is not None]
        row = {"label": LABELS[v.name], "replicas": v.replicas, "prefix_cache": v.cache,
               "policy": v.policy, "ttft": t, "e2e": _pcts(v.e2e),
               "ttft_per_question_ms": [x * 1e3 for x in v.ttft],
               "cached_tokens": cached, "prompt_tokens": prompt,
               "hit_rate": cached / prompt if prompt else 0.0,
               "replica_sequence": sequence,
               "requests_per_replica": per, "replicas_warmed": v.warm_replicas,
               "engine_cache_hit_rate": [s.get("cache_hit_rate") for s in v.stats_after],
               "prefix_cached_pages": [s.get("prefix_cached_pages") for s in v.stats_after],
               "prefix_evicted_pages": [s.get("prefix_evicted_pages") for s in v.stats_after],
               "usage_cached_tokens": usage_cached or None}
        if prompt != sum(v.prompt_tokens):
            row["note"] = (f"replica stats count {prompt} prompt tokens, usage "
                           f"{sum(v.prompt_tokens)}")
        results["variants"][v.name] = row
        seq = "/".join(str(per[k]) for k in sorted(per))
        print(f"{v.name + ' ' + LABELS[v.name]:<36}{t['p50_ms']:>10.1f}{t['p99_ms']:>9.1f}"
              f"{t['mean_ms']:>9.1f}{row['e2e']['p50_ms']:>9.1f}{row['hit_rate']:>10.1%}"
              f"{f'{cached}/{prompt}':>19}  {seq} ({row['replica_sequence']})")
    print(f"(ms; p99 of {len(questions)} questions is the slowest; ideal hit rate "
          f"{ideal_rate:.1%}: every question after the first hits its {shared}-token shared "
          f"prefix in whole {page}-token pages)")
    if any(r["usage_cached_tokens"] for r in results["variants"].values()):
        for name, r in results["variants"].items():
            print(f"  usage.prompt_tokens_details.cached_tokens {name}: {r['usage_cached_tokens']}")
    else:
        print("  usage.prompt_tokens_details: not in the responses")

    rv = results["variants"]
    ratios = {
        "ttft_p50_cache_on_vs_off": rv["b"]["ttft"]["p50_ms"] / rv["a"]["ttft"]["p50_ms"],
        "ttft_p99_cache_on_vs_off": rv["b"]["ttft"]["p99_ms"] / rv["a"]["ttft"]["p99_ms"],
        "ttft_mean_cache_on_vs_off": rv["b"]["ttft"]["mean_ms"] / rv["a"]["ttft"]["mean_ms"],
        "ttft_p50_kv_aware_vs_power_of_two": rv["c"]["ttft"]["p50_ms"] / rv["d"]["ttft"]["p50_ms"],
        "ttft_p99_kv_aware_vs_power_of_two": rv["c"]["ttft"]["p99_ms"] / rv["d"]["ttft"]["p99_ms"],
        "ttft_mean_kv_aware_vs_power_of_two": (rv["c"]["ttft"]["mean_ms"]
                                               / rv["d"]["ttft"]["mean_ms"]),
    }
    results["ratios"] = ratios
    print(f"\nTTFT cache on / off (b/a):            p50 {ratios['ttft_p50_cache_on_vs_off']:.3f}"
          f"  p99 {ratios['ttft_p99_cache_on_vs_off']:.3f}"
          f"  mean {ratios['ttft_mean_cache_on_vs_off']:.3f}")
    print(f"TTFT kv_aware / power_of_two (c/d):   p50 "
          f"{ratios['ttft_p50_kv_aware_vs_power_of_two']:.3f}"
          f"  p99 {ratios['ttft_p99_kv_aware_vs_power_of_two']:.3f}"
          f"  mean {ratios['ttft_mean_kv_aware_vs_power_of_two']:.3f}")

    results["simulator"] = sim
    results["simulator_router_block"] = sims[settings.block_size]
    kv, p2 = sim["kv_aware"], sim["power_of_two"]
    print(f"\nrouter simulator, same shape ({sim['doc_tokens']}-token document in "
          f"{sim['block_size']}-token blocks + {sim['question_tokens']}-token questions, "
          f"{len(questions)} sequential, 2 replicas; {sim['fleet']}):")
    print(f"{'':<14}{'hit rate sim':>14}{'real':>8}{'TTFT p50 sim ms':>17}{'mean':>8}"
          f"  replicas (sim)")
    for name, key in (("kv_aware", "c"), ("power_of_two", "d")):
        s = sim[name]
        seq = _by_first_use(s["replicas"])
        print(f"{name:<14}{s['hit_rate']:>14.1%}{rv[key]['hit_rate']:>8.1%}"
              f"{s['ttft']['p50_ms']:>17.1f}{s['ttft']['mean_ms']:>8.1f}  {seq}")
    coarse = sims[settings.block_size]
    print(f"(at the router's {settings.block_size}-token block instead: hit rate kv_aware "
          f"{coarse['kv_aware']['hit_rate']:.1%}, power_of_two "
          f"{coarse['power_of_two']['hit_rate']:.1%}, TTFT mean ratio "
          f"{coarse['ttft_ratio_mean']:.3f})")
    spread = p2["hit_rate_over_seeds"]
    print(f"power_of_two over {p2['seeds']} seeds: hit rate {spread['mean']:.1%} "
          f"({spread['min']:.1%}..{spread['max']:.1%}), TTFT mean "
          f"{p2['ttft_mean_ms_over_seeds']:.1f} ms")
    real_ratio = ratios["ttft_mean_kv_aware_vs_power_of_two"]
    print(f"TTFT kv_aware / power_of_two: sim p50 {sim['ttft_ratio_p50']:.3f} mean "
          f"{sim['ttft_ratio_mean']:.3f} (over seeds {sim['ttft_ratio_mean_over_seeds']:.3f}); "
          f"real p50 {ratios['ttft_p50_kv_aware_vs_power_of_two']:.3f} mean {real_ratio:.3f}")
    # Agree: hit rates within 5 points for both policies (power_of_two with the same seed-0
    # draws as the app) and kv_aware's mean TTFT on the same side of power_of_two's.
    gaps = {"kv_aware": abs(kv["hit_rate"] - rv["c"]["hit_rate"]),
            "power_of_two": abs(p2["hit_rate"] - rv["d"]["hit_rate"])}
    same_route = _by_first_use(p2["replicas"]) == rv["d"]["replica_sequence"]
    agree = (max(gaps.values()) <= 0.05
             and _direction(sim["ttft_ratio_mean"]) == _direction(real_ratio))
    verdict = (f"{'AGREE' if agree else 'DISAGREE'}: hit rate kv_aware sim {kv['hit_rate']:.1%}"
               f" vs real {rv['c']['hit_rate']:.1%}, power_of_two sim {p2['hit_rate']:.1%} vs "
               f"real {rv['d']['hit_rate']:.1%} (tolerance 5 points; power_of_two routed "
               f"{'the same' if same_route else 'differently'}); kv_aware mean TTFT "
               f"{_direction(sim['ttft_ratio_mean'])} in the sim ({sim['ttft_ratio_mean']:.2f}x), "
               f"{_direction(real_ratio)} for real ({real_ratio:.2f}x)")
    results["agreement"] = {"agree": agree, "hit_rate_gaps": gaps,
                            "power_of_two_same_routing": same_route, "line": verdict}
    print(verdict)
    results["serve_wall_s"] = serve_s
    results["wall_s"] = time.perf_counter() - wall0
    print(f"wall {results['wall_s']:.0f} s (Serve part {serve_s:.0f} s)")
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
