"""Speculative decoding vs target-only decoding on CPU, in one run, on the same prompts.

    python bench/spec_decode.py                      # the embedded trained pair (default)
    python bench/spec_decode.py --pair random        # random weights: overhead only
    python bench/spec_decode.py --temperatures 0 0.7 --repeats 3 --json out.json

The embedded pair is measured greedy and at Kimi K3's own sampling parameters (`k3-thinking`:
T 1.0, top_p 0.95, what a K3 request samples at by default; `k3-instant`: T 0.6, top_p 0.95),
where acceptance is lowest; then at 1, 4, 16 and 32 concurrent requests (`--concurrency`; a
level below 8 runs 8 requests, c at a time), in each of those settings: target-only,
speculation verifying the whole block every step (always on), and the adaptive verify budget
(the engine's default, engines/reference/spec_budget.py) with the windows it chose and its cost
model's error.

Every held-out prompt (serve_app/assets/heldout_prompts.json: cut from corpus files the models
never trained on) is decoded one request at a time (single-user latency, batch 1) for
`--max-tokens` new tokens (EOS ignored, so both modes do the same work), target-only and with
DSpark speculation (the adaptive budget, as the engine runs by default), `--repeats` times.
The modes being compared run side by side, taking turns step by step (`interleaved`), each
timed over its own steps: on a shared machine the speed of the same work drifts by ±15% over
seconds, and whole runs one after the other took that drift as a difference between modes.
Reported:

- tokens/s per mode: the median over prompts of each prompt's median-of-repeats rate, and the
  aggregate (all tokens / all time);
- speedup: median over prompts of the per-prompt ratio, and the ratio of aggregates;
- acceptance as SGLang reports it: per request spec_accept_length = completion tokens /
  verify steps (bonus included); the macro average (per prompt, then equally across prompts,
  as the DSpark model card reports) and the token-weighted average beside it;
  spec_accept_rate and spec_correct_drafts_histogram (verify steps that accepted exactly i
  drafts) summed over requests;
- greedy only: whether speculative outputs are identical to target-only outputs (lossless);
- a per-call time breakdown: target decode forward (1 token), verify forward (1 + gamma),
  draft propose (with the draft context rows it writes for the tokens since it last drafted),
  commit (cache rollback).

`--pair random` builds a target and a draft of the same shapes with random weights on the fly:
its acceptance is meaningless (about 1) and it is labelled as such; it shows the engine's cost
of speculation when nothing is accepted.

`--pair random-k3` is the Kimi K3 hybrid (KDA + MLA): the tests' random mini K3 and its DSpark
draft (tests/tiny_models.py write_random_k3_pair), `--k3-prompts` seeded random-token prompts
of `--prompt-min`..`--prompt-max` tokens, decoded target-only and speculatively with each KDA
rollback strategy (`speculation.kda_rollback` scratch and replay), variant order alternating
across prompts and repeats, greedy by default. Overhead only (random weights); to make commit
roll back partially, `--proposer oracle-partial` (the default here) keeps the DSpark draft
running (timed) but replaces its tokens by the target's greedy continuation with a uniform
0..gamma of them right (`--proposer dspark`: the random draft's own, ~0 accepted). Reported per
variant: tok/s, acceptance, lossless, per step (full verify windows) the verify forward, the
commit split into HybridCache.commit (the KDA state copy or replay) and the rest (allocator
truncation, holding the draft's taps; the draft's context rows are written inside its propose),
the verify scratch per request measured from the windows' tensors beside the
state slot; then what the capacity planner says each strategy costs for the real K3 on
2 x 8 H200 (TP16). A table, then the report as one JSON line.

    python bench/spec_decode.py --pair random-k3                     # about 3 min on 2 cores
    python bench/spec_decode.py --pair random-k3 --repeats 1 --max-tokens 16   # < 1 min
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from serve_app.chat.parameters import K3_TEMPERATURE, K3_TOP_P  # noqa: E402
from serve_app.embedded import (  # noqa: E402
    DRAFT,
    TARGET,
    TOKENIZER,
    heldout_prompt_ids,
    heldout_prompts,
)
from serve_app.engines.reference.engine import EngineCore  # noqa: E402
from serve_app.engines.reference.sampling import SamplingParams  # noqa: E402
from serve_app.tokenizer import load_tokenizer  # noqa: E402
from serve_app.training.evaluate import is_looping, pair_engine  # noqa: E402


def random_pair(folder: Path, seed: int = 0, draft_layers: int | None = None,
                markov_rank: int | None = None) -> tuple[Path, Path]:
    """A target and a draft with the embedded pair's shapes (or another draft size) and random
    weights."""
    from serve_app.models.dspark import DSparkDraft, save_dspark
    from serve_app.models.k3 import K3ForCausalLM
    from serve_app.models.k3_weights import save_k3
    from serve_app.training.train_draft import (
        DRAFT_LAYERS,
        MARKOV_RANK,
        init_draft,
        mini_draft_config,
    )
    from serve_app.training.train_target import init_weights, mini_target_config

    torch.manual_seed(seed)
    tok = load_tokenizer(TOKENIZER)
    target = K3ForCausalLM(mini_target_config(tok))
    init_weights(target, std=0.1)  # spread enough that greedy output is not one token
    draft = DSparkDraft(mini_draft_config(target, tok, draft_layers or DRAFT_LAYERS,
                                          markov_rank or MARKOV_RANK))
    init_draft(draft, std=0.1)
    save_k3(target, folder / "target")
    save_dspark(draft, folder / "draft")
    return folder / "target", folder / "draft"


class CallTimer:
    """Wall time of every call of a few runner methods, by name."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def wrap(self, name: str, fn: Callable[..., Any],
             classify: Callable[..., str] | None = None) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            key = classify(*args, **kwargs) if classify else name
            self.times.setdefault(key, []).append(time.perf_counter() - t0)
            return out
        return timed

    def summary(self) -> dict[str, dict[str, float]]:
        return {k: {"calls": len(v), "mean_ms": 1e3 * statistics.fmean(v),
                    "median_ms": 1e3 * statistics.median(v)}
                for k, v in sorted(self.times.items())}


def interleaved(engines: dict[str, EngineCore], prompts: list[list[int]],
                params: SamplingParams) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """Every engine decodes `prompts` together (one batch each), the engines taking turns one
    step at a time. Returns each engine's seconds (its own steps only) and its final outputs
    in prompt order, with all their tokens (as EngineCore.generate returns them). Taking turns
    puts the machine's drift on every mode alike: on this 2-core VM, 16 greedy requests'
    target-only / always-on ratio spread 0.95-1.26 over 8 back-to-back whole runs, and
    0.95-1.07 taking turns step by step. Who goes first moves round by round: the engine that
    stepped first read 0.3% faster than the same engine stepping third (six 16-request runs of
    two target-only engines)."""
    rids = {m: [e.add_request(p, params) for p in prompts] for m, e in engines.items()}
    tokens: dict[str, dict[str, list[int]]] = {m: {r: [] for r in rids[m]} for m in engines}
    final: dict[str, dict[str, Any]] = {m: {} for m in engines}
    seconds = dict.fromkeys(engines, 0.0)
    names = list(engines)
    turn = 0
    while any(len(final[m]) < len(rids[m]) for m in engines):
        first = turn % len(names)
        turn += 1
        for m in names[first:] + names[:first]:
            engine = engines[m]
            if len(final[m]) == len(rids[m]):
                continue
            t0 = time.perf_counter()
            outs = engine.step()
            seconds[m] += time.perf_counter() - t0
            for out in outs:
                tokens[m][out.request_id] += out.token_ids
                if out.finished:
                    out.token_ids = tokens[m][out.request_id]
                    final[m][out.request_id] = out
    return seconds, {m: [final[m][r] for r in rids[m]] for m in engines}


def _forward_kind(rows: Any, rids: Any, capture: bool, verify: bool = False,
                  last_only: bool = False) -> str:
    if verify:  # the engine marks its verify windows (ModelRunner.forward's `verify`)
        return "verify_forward"
    return "target_decode_forward" if max(len(r) for r in rows) == 1 else "prefill_forward"


# Kimi K3's own sampling parameters (chat/parameters.py): (temperature, top_p).
K3_SAMPLING = {"k3-thinking": (K3_TEMPERATURE[True], K3_TOP_P),
               "k3-instant": (K3_TEMPERATURE[False], K3_TOP_P)}


def make_engine(target: Path, draft: Path, speculative: bool, timer: CallTimer,
                log: StepLog | None = None) -> EngineCore:
    engine = pair_engine(target, draft, speculative)
    runner = engine.runner  # the engine looks these up per call: wrapping after build is enough
    if log is not None:
        log.instrument(runner)  # innermost: its times exclude the timer's bookkeeping
    runner.forward = timer.wrap("forward", runner.forward, _forward_kind)  # type: ignore[method-assign]
    if speculative:
        runner.propose = timer.wrap("draft_propose", runner.propose)  # type: ignore[method-assign]
        runner.commit = timer.wrap("commit", runner.commit)  # type: ignore[method-assign]
    return engine


def add_histograms(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two spec_correct_drafts_histogram lists of any lengths."""
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)), strict=True)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(TOKENIZER)
    tmp = None
    if args.pair == "random":
        tmp = tempfile.TemporaryDirectory()
        target, draft = random_pair(Path(tmp.name), draft_layers=args.draft_layers,
                                    markov_rank=args.markov_rank)
        label = ("RANDOM-WEIGHT mini K3 target + random DSpark draft of the embedded shapes "
                 "(untrained: overhead only)")
    else:
        target, draft = TARGET, DRAFT
        label = f"embedded trained pair: {TARGET.name} + {DRAFT.name}"
    prompts = heldout_prompt_ids(tok, args.completion_prompts, args.chat_prompts)
    n_code = len(heldout_prompts()["completion"][:args.completion_prompts])
    report: dict[str, Any] = {
        "pair": args.pair, "label": label, "threads": args.threads,
        "max_tokens": args.max_tokens, "prompts": len(prompts), "repeats": args.repeats,
        "batch_size": 1, "results": [],
    }
    for setting in args.settings:
        temperature, top_p = setting["temperature"], setting["top_p"]
        timers = {"target_only": CallTimer(), "speculative": CallTimer()}
        log = StepLog()
        engines = {"target_only": make_engine(target, draft, False, timers["target_only"]),
                   "speculative": make_engine(target, draft, True, timers["speculative"], log)}
        # Warm-up: first calls allocate and fault in pages.
        for e in engines.values():
            e.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True))
        for t in timers.values():
            t.times.clear()
        log.clear()
        per_prompt = []
        for i, prompt in enumerate(prompts):
            times: dict[str, list[float]] = {"target_only": [], "speculative": []}
            outputs: dict[str, list[list[int]]] = {"target_only": [], "speculative": []}
            accept: list[float] = []
            verify_ct, tokens_spec = 0, 0
            hist: list[int] = []
            proposed = accepted = 0
            for _ in range(args.repeats):
                # Unseeded: a seeded sampled request verifies whole blocks (reproducible), which
                # is not what the adaptive budget does for the rest (docs/speculation.md).
                params = SamplingParams(temperature=temperature, top_p=top_p,
                                        max_tokens=args.max_tokens, ignore_eos=True)
                seconds, finals = interleaved(engines, [prompt], params)
                for mode, (out,) in finals.items():
                    times[mode].append(seconds[mode])
                    outputs[mode].append(out.token_ids)
                    if mode == "speculative" and out.spec is not None:
                        accept.append(out.spec["spec_accept_length"])
                        verify_ct += out.spec["spec_verify_ct"]
                        tokens_spec += out.completion_tokens
                        proposed += out.spec["spec_proposed_drafts"]
                        accepted += out.spec["spec_accepted_drafts"]
                        hist = add_histograms(hist, out.spec["spec_correct_drafts_histogram"])
            n_tok = len(outputs["target_only"][0])
            med = {m: statistics.median(v) for m, v in times.items()}
            per_prompt.append({
                "prompt": i, "set": "code" if i < n_code else "conversation",
                "prompt_tokens": len(prompt), "new_tokens": n_tok,
                # The target's own continuation (its first repeat) decides the class, so both
                # modes of a prompt land in the same one.
                "looping": is_looping(outputs["target_only"][0]),
                "target_only_tok_s": n_tok / med["target_only"],
                "speculative_tok_s": n_tok / med["speculative"],
                "speedup": med["target_only"] / med["speculative"],
                "time_s": {m: sum(v) for m, v in times.items()},
                "tokens": {m: sum(map(len, v)) for m, v in outputs.items()},
                "identical": (outputs["target_only"] == outputs["speculative"]
                              if temperature == 0 else None),
                "spec_accept_length": statistics.fmean(accept) if accept else None,
                "verify_ct": verify_ct, "spec_tokens": tokens_spec, "histogram": hist,
                "proposed": proposed, "accepted": accepted,
            })
        report["results"].append({"sampling": setting["name"], "top_p": top_p,
                                  **summarize(temperature, per_prompt, timers, log)})
        if args.show_text and temperature == 0:
            out = engines["target_only"].generate([prompts[0]], SamplingParams(
                temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))[0]
            report["sample"] = {"prompt": tok.decode(prompts[0]),
                                "completion": tok.decode(out.token_ids)}
    if args.concurrency:
        report["concurrency"] = run_concurrency(args, target, draft, prompts)
    if tmp is not None:
        tmp.cleanup()
    return report


# The three ways to decode a concurrent batch: the draft off, verifying its whole block every
# step (speculation.adaptive false), and the adaptive verify budget (the default).
CONCURRENCY_MODES = ("target_only", "always_on", "adaptive")
# Below this many requests a concurrency level runs this many, c at a time (one request alone
# is one prompt's luck: the 1-request cell read 0.94x on a prompt where the 19-prompt batch-1
# median read 1.13x).
CONCURRENCY_MIN_REQUESTS = 8


def run_concurrency(args: argparse.Namespace, target: Path, draft: Path,
                    prompts: list[list[int]]) -> dict[str, Any]:
    """Throughput with c requests decoding together (c = each of --concurrency) in each
    sampling setting, the three CONCURRENCY_MODES side by side: the held-out prompts cycled to
    max(c, CONCURRENCY_MIN_REQUESTS) requests (at most the prompts there are, never below c),
    submitted c at a time, each group when the last has finished, `max_tokens` each;
    tokens/s = requests * max_tokens / seconds, the median of the repeats (the modes taking
    turns step by step, `interleaved`),
    with the lowest and highest of each repeat's own ratio to target-only beside it. Every adaptive engine shares one cost table file
    (speculation.cost_table), as a restarted replica reads its last fit: the first measures
    from the cold prior, the rest start from what the previous ones learned. Reported for the
    adaptive engine: how many drafts its requests verified (a histogram over 0..gamma), its
    plain (draft skipped) and speculative steps, and the median error of its cost model's
    prediction of each step's time, made before the step ran."""
    rows = []
    table_dir = tempfile.TemporaryDirectory()
    table = Path(table_dir.name) / "step_cost.json"
    for setting in args.settings:
        temperature, top_p = setting["temperature"], setting["top_p"]
        for c in args.concurrency:
            requests = max(c, min(len(prompts), CONCURRENCY_MIN_REQUESTS))
            cycled = [prompts[i % len(prompts)] for i in range(requests)]
            groups = [cycled[i:i + c] for i in range(0, requests, c)]
            kv = max(sum(len(p) + args.max_tokens + 16 for p in g) for g in groups) + 256
            engines = {m: pair_engine(target, draft, m != "target_only", kv_capacity_tokens=kv,
                                      adaptive=m == "adaptive", cost_table=table)
                       for m in CONCURRENCY_MODES}
            # Warm-up, the measured batch's shape at its sampling: long enough for the adaptive
            # budget's warm-up steps (spec_budget.WARMUP_STEPS), which draft for everyone.
            for e in engines.values():
                e.generate(groups[0], [SamplingParams(temperature=temperature, top_p=top_p,
                                                      max_tokens=32, ignore_eos=True)] * c)
            budget = engines["adaptive"].budget
            assert budget is not None
            before = budget.stats()
            errors_before = len(budget.cost.errors)
            walls: dict[str, list[float]] = {m: [] for m in engines}
            accept: dict[str, list[float]] = {m: [] for m in engines}
            for _ in range(args.repeats):
                params = SamplingParams(temperature=temperature, top_p=top_p,
                                        max_tokens=args.max_tokens, ignore_eos=True)
                for mode in engines:
                    walls[mode].append(0.0)
                for g in groups:
                    seconds, finals = interleaved(engines, g, params)
                    for mode, outs in finals.items():
                        walls[mode][-1] += seconds[mode]
                        accept[mode] += [o.spec["spec_accept_length"] for o in outs if o.spec]
            budget.save()
            after = budget.stats()
            errors = sorted(budget.cost.errors[errors_before:])
            tok_s = {m: requests * args.max_tokens / statistics.median(w)
                     for m, w in walls.items()}
            per_repeat = {m: [t / w for t, w in zip(walls["target_only"], walls[m], strict=True)]
                          for m in ("always_on", "adaptive")}
            rows.append({
                "sampling": setting["name"], "temperature": temperature, "top_p": top_p,
                "concurrency": c, "requests": requests,
                **{f"{m}_tok_s": tok_s[m] for m in CONCURRENCY_MODES},
                "always_on_speedup": tok_s["always_on"] / tok_s["target_only"],
                "adaptive_speedup": tok_s["adaptive"] / tok_s["target_only"],
                **{f"{m}_speedup_range": [min(v), max(v)] for m, v in per_repeat.items()},
                "always_on_accept_length": statistics.fmean(accept["always_on"]),
                "adaptive_accept_length": statistics.fmean(accept["adaptive"]),
                "adaptive_draft_histogram": [
                    x - y for x, y in zip(after["spec_budget_draft_histogram"],
                                          before["spec_budget_draft_histogram"], strict=True)],
                "adaptive_speculative_steps": (after["spec_budget_speculative_steps"]
                                               - before["spec_budget_speculative_steps"]),
                "adaptive_plain_steps": (after["spec_budget_plain_steps"]
                                         - before["spec_budget_plain_steps"]),
                "cost_error_median": errors[len(errors) // 2] if errors else None,
            })
    table_dir.cleanup()
    return {"max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows}


def by_class(rows: list[dict[str, Any]], key: str, classes: dict[str, Any]) -> dict[str, Any]:
    """Acceptance and speedup of the prompts whose `key` is each class's value, apart."""
    out: dict[str, Any] = {}
    for name, want in classes.items():
        sel = [r for r in rows if r[key] == want]
        verify = sum(r["verify_ct"] for r in sel)
        out[name] = {
            "prompts": len(sel),
            "spec_accept_length_macro": (statistics.fmean(r["spec_accept_length"] for r in sel)
                                         if sel else None),
            "spec_accept_length_token_weighted": (sum(r["spec_tokens"] for r in sel) / verify
                                                  if verify else None),
            "speedup_median": statistics.median(r["speedup"] for r in sel) if sel else None,
        }
    return out


def speedup_bound(calls: dict[str, dict[str, dict[str, float]]], log: StepLog,
                  accept: float | None) -> dict[str, Any] | None:
    """What the per-call costs allow: a verify step yields `accept` tokens (token-weighted) for
    one draft propose, one verify forward and one commit, against one decode forward per
    token target-only. speedup <= accept / (verify/decode + draft/decode) ignores the commit
    and the engine's own step work; the second bound adds the commit."""
    decode = calls["target_only"].get("target_decode_forward", {}).get("median_ms")
    spec = calls["speculative"]
    if not (decode and accept and "verify_forward" in spec and "draft_propose" in spec):
        return None
    verify, draft = spec["verify_forward"]["median_ms"], spec["draft_propose"]["median_ms"]
    commit = spec["commit"]["median_ms"] if "commit" in spec else 0.0
    kda = _median_ms([s["truncate_s"] for s in log.steps])
    return {
        "decode_ms": decode, "verify_ms": verify, "draft_ms": draft, "commit_ms": commit,
        "commit_hybrid_cache_ms": kda,  # HybridCache.commit: KDA state + latent truncation
        "verify_over_decode": verify / decode, "draft_over_decode": draft / decode,
        "commit_over_decode": commit / decode,
        "accept_token_weighted": accept,
        "bound_verify_draft": accept / ((verify + draft) / decode),
        "bound_verify_draft_commit": accept / ((verify + draft + commit) / decode),
    }


def summarize(temperature: float, rows: list[dict[str, Any]],
              timers: dict[str, CallTimer], log: StepLog) -> dict[str, Any]:
    hist: list[int] = []
    for r in rows:
        hist = add_histograms(hist, r["histogram"])
    tot = {m: sum(r["time_s"][m] for r in rows) for m in ("target_only", "speculative")}
    toks = {m: sum(r["tokens"][m] for r in rows) for m in ("target_only", "speculative")}
    agg = {m: toks[m] / tot[m] for m in tot}
    verify = sum(r["verify_ct"] for r in rows)
    identical = [r["identical"] for r in rows]
    calls = {m: t.summary() for m, t in timers.items()}
    accept_tw = sum(r["spec_tokens"] for r in rows) / verify if verify else None
    bound = speedup_bound(calls, log, accept_tw)
    speedup_agg = agg["speculative"] / agg["target_only"]
    return {
        "temperature": temperature,
        "target_only_tok_s": {"median": statistics.median(r["target_only_tok_s"] for r in rows),
                              "aggregate": agg["target_only"]},
        "speculative_tok_s": {"median": statistics.median(r["speculative_tok_s"] for r in rows),
                              "aggregate": agg["speculative"]},
        "speedup": {"median": statistics.median(r["speedup"] for r in rows),
                    "aggregate": speedup_agg},
        "spec_accept_length": {
            "macro": statistics.fmean(r["spec_accept_length"] for r in rows),
            "token_weighted": accept_tw,
        },
        "loop_fraction": statistics.fmean(r["looping"] for r in rows),
        # A loop is easy to draft: pooled, repetition would flatter the acceptance.
        "by_loop_class": by_class(rows, "looping", {"non_looping": False, "looping": True}),
        # Code continuations and K3 conversations are different work for the draft.
        "by_prompt_set": by_class(rows, "set", {"code": "code", "conversation": "conversation"}),
        "speedup_bound": bound,
        "speedup_over_bound": (speedup_agg / bound["bound_verify_draft"] if bound else None),
        "spec_accept_rate": (sum(r["accepted"] for r in rows)
                             / max(1, sum(r["proposed"] for r in rows))),
        "spec_verify_ct": verify,
        "spec_correct_drafts_histogram": hist,
        "lossless_identical": all(identical) if temperature == 0 else None,
        "call_times": calls,
        "per_prompt": [{k: v for k, v in r.items() if k not in ("time_s", "tokens")}
                       for r in rows],
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['label']}")
    print(f"{report['prompts']} held-out prompts x {report['max_tokens']} new tokens, batch 1, "
          f"{report['repeats']} repeats, {report['threads']} threads")
    head = (f"{'sampling':>12} {'T':>4} {'top_p':>5} {'target tok/s':>13} {'spec tok/s':>11} {'speedup':>8} "
            f"{'(aggr.)':>8} {'acc.len':>8} {'(tok-w)':>8} {'acc.rate':>9} {'lossless':>9}")
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        lossless = {True: "yes", False: "NO", None: "n/a"}[r["lossless_identical"]]
        print(f"{r['sampling']:>12} {r['temperature']:>4} {r['top_p']:>5} "
              f"{r['target_only_tok_s']['median']:>13.1f} "
              f"{r['speculative_tok_s']['median']:>11.1f} {r['speedup']['median']:>7.2f}x "
              f"{r['speedup']['aggregate']:>7.2f}x {r['spec_accept_length']['macro']:>8.2f} "
              f"{r['spec_accept_length']['token_weighted']:>8.2f} "
              f"{r['spec_accept_rate']:>9.3f} {lossless:>9}")
    for r in report["results"]:
        print(f"{r['sampling']}: spec_correct_drafts_histogram "
              f"{r['spec_correct_drafts_histogram']}")
        parts = []
        for name, c in [*r["by_loop_class"].items(), *r["by_prompt_set"].items()]:
            if c["prompts"]:
                parts.append(f"{name} {c['prompts']} prompts: acc.len {c['spec_accept_length_macro']:.2f}"
                             f" (tok-w {c['spec_accept_length_token_weighted']:.2f}), speedup "
                             f"{c['speedup_median']:.2f}x")
        print(f"  loop fraction {r['loop_fraction']:.2f} (target-only output: repeated 4-grams "
              f"> half of it); " + "; ".join(parts))
        for mode, calls in r["call_times"].items():
            parts = [f"{k} {v['median_ms']:.2f} ms x{v['calls']}" for k, v in calls.items()]
            print(f"  {mode:<12} " + ", ".join(parts))
        b = r["speedup_bound"]
        if b:
            print(f"  per call / decode: verify {b['verify_over_decode']:.2f}, draft "
                  f"{b['draft_over_decode']:.2f}, commit {b['commit_over_decode']:.2f} (of it "
                  f"HybridCache.commit {_fmt_ms(b['commit_hybrid_cache_ms'])} ms); bound "
                  f"acc / (verify/decode + draft/decode) = {b['bound_verify_draft']:.2f}x, with "
                  f"commit {b['bound_verify_draft_commit']:.2f}x; measured "
                  f"{r['speedup']['aggregate']:.2f}x aggregate = "
                  f"{100 * r['speedup_over_bound']:.0f}% of the first")
    conc = report.get("concurrency")
    if conc:
        print(f"\nconcurrent requests, {conc['max_tokens']} tokens each, median of "
              f"{conc['repeats']}; tok/s and x target-only (in brackets: the lowest and highest "
              f"repeat's own ratio); requests: how many, run c at a time; k: the adaptive "
              f"windows' drafts "
              f"(histogram 0..gamma), plain: steps it ran without the draft; cost err: median "
              f"|predicted - measured| step time")
        head = (f"{'sampling':>12} {'c':>3} {'requests':>8} {'target':>8} {'always-on':>28} "
                f"{'adaptive':>28} {'acc.len':>11} {'plain/steps':>12} {'cost err':>9}  k")
        print(head)
        print("-" * len(head))
        for row in conc["rows"]:
            steps = row["adaptive_plain_steps"] + row["adaptive_speculative_steps"]
            err = row["cost_error_median"]
            spread = {m: "({:.2f}-{:.2f})".format(*row[f"{m}_speedup_range"])
                      for m in ("always_on", "adaptive")}
            print(f"{row['sampling']:>12} {row['concurrency']:>3} {row['requests']:>8} "
                  f"{row['target_only_tok_s']:>8.1f} {row['always_on_tok_s']:>9.1f} "
                  f"{row['always_on_speedup']:>5.2f}x {spread['always_on']:>12} "
                  f"{row['adaptive_tok_s']:>9.1f} {row['adaptive_speedup']:>5.2f}x "
                  f"{spread['adaptive']:>12} "
                  f"{row['always_on_accept_length']:>5.2f}/{row['adaptive_accept_length']:<5.2f} "
                  f"{row['adaptive_plain_steps']:>5}/{steps:<6} "
                  f"{'-' if err is None else f'{100 * err:.0f}%':>9}  "
                  f"{row['adaptive_draft_histogram']}")


# --- --pair random-k3: the hybrid target, KDA rollback by scratch vs replay -------------------

K3_VARIANTS = ("target_only", "scratch", "replay")


def random_k3_pair(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """The tests' random mini K3 target and its DSpark draft (tests/tiny_models.py, as
    bench/k3_model.py uses it), written as the engine loads them."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import write_random_k3_pair

    return write_random_k3_pair(folder, seed=seed)


def random_prompts(n: int, vocab: int, low: int, high: int, seed: int) -> list[list[int]]:
    """`n` prompts of `low`..`high` uniform random tokens, clear of the special ids (bos 1,
    eos 2, pad 0 below; media placeholder / mask at the top of the vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 8) for _ in range(rng.randint(low, high))]
            for _ in range(n)]


def window_bytes(windows: dict[int, Any]) -> tuple[int, int, int]:
    """(batch rows, the tensors' nbytes, their distinct storages' bytes) of a HybridCache's
    last verify windows: KDAWindowStates (scratch) or KDAWindowLog (replay), every layer."""
    logical, storages, rows = 0, {}, 0
    for win in windows.values():
        for t in vars(win).values():
            if isinstance(t, torch.Tensor):
                rows = t.shape[0]
                logical += t.nbytes
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
    return rows, logical, sum(storages.values())


class OracleDrafts:
    """`--proposer oracle-partial`: the draft still runs (its propose and its context writes are
    timed as for DSpark), then its tokens are replaced by the target's own greedy continuation
    (a reference decoded once per prompt, target-only), of which the first n stay right and
    the rest are made wrong; n is uniform in 0..gamma, a function of (prompt, position) only,
    so every variant does the same work. The idea of tests/spec_helpers.py's OracleProposer
    with a lookup instead of a greedy decode per step. Greedy only: at T > 0 the drafts are the
    greedy path's tokens (one-hot q), accepted at the target's probability of them."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.seed = vocab, seed
        self.reference: dict[tuple[int, ...], list[int]] = {}

    def wrap(self, propose: Callable[..., Any]) -> Callable[..., Any]:
        from serve_app.models.dspark import DraftOutput

        def oracle(seqs: Any) -> Any:
            out = propose(seqs)
            gamma = out.tokens.shape[1]
            rows = []
            for s in seqs:
                key, pos = tuple(s.prompt_ids), len(s.output_ids)
                ref = self.reference[key][pos:pos + gamma]
                ref += [3] * (gamma - len(ref))  # past the reference: never verified
                n = random.Random(hash((self.seed, key, pos))).randint(0, gamma)
                rows.append([t if j < n else (t + 1 + j) % self.vocab
                             for j, t in enumerate(ref)])
            return DraftOutput(torch.tensor(rows), None, out.confidence, out.logits)
        return oracle


class StepLog:
    """Per verify step (batch 1): the verify forward's time and width, the commit's time split
    into HybridCache.commit (the KDA state copy or replay, and the latent truncation) and the
    rest (allocator truncation, the draft's taps held for its context), the drafts accepted; and the
    verify scratch the windows hold per request, by window width."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.scratch: dict[int, dict[str, int]] = {}  # window width -> bytes per request
        self._pending: dict[str, float] | None = None
        self._truncate: list[tuple[float, int]] = []

    def clear(self) -> None:
        self.steps.clear()
        self._pending, self._truncate = None, []

    def instrument(self, runner: Any) -> None:
        forward, commit, cache = runner.forward, runner.commit, runner.cache
        cache_commit = cache.commit

        def timed_forward(rows: Any, rids: Any, capture: bool, verify: bool = False,
                          last_only: bool = False) -> Any:
            t0 = time.perf_counter()
            out = forward(rows, rids, capture, verify, last_only)
            dt = time.perf_counter() - t0
            if verify:
                width = max(len(r) for r in rows)
                self._pending = {"verify_s": dt, "width": width}
                if width not in self.scratch:  # the same for every window of that width
                    b, logical, storage = window_bytes(cache.windows)
                    self.scratch[width] = {"tensor_bytes": logical // b,
                                           "storage_bytes": storage // b}
            return out

        def timed_truncate(rids: Any, lengths: Any) -> None:
            windows = [cache.window_rows.get(rid) for rid in rids]
            t0 = time.perf_counter()
            cache_commit(rids, lengths)
            accepted = sum(n - w[1] - 1 for w, n in zip(windows, lengths, strict=True)
                           if w is not None)
            self._truncate.append((time.perf_counter() - t0, accepted))

        def timed_commit(rids: Any, lengths: Any, tap_rows: Any, *rest: Any) -> None:
            self._truncate = []
            t0 = time.perf_counter()
            commit(rids, lengths, tap_rows, *rest)
            dt = time.perf_counter() - t0
            if self._pending is not None:  # not a prefill chunk's commit
                trunc = sum(t for t, _ in self._truncate)
                self.steps.append({**self._pending, "commit_s": dt, "truncate_s": trunc,
                                   "commit_rest_s": dt - trunc,
                                   "accepted": sum(a for _, a in self._truncate)})
            self._pending = None

        runner.forward = timed_forward
        runner.commit = timed_commit
        cache.commit = timed_truncate


def make_k3_engine(target: Path, draft: Path, rollback: str | None, timer: CallTimer,
                   log: StepLog, oracle: OracleDrafts | None) -> EngineCore:
    """The builder's engine for the K3 pair: target-only (rollback None) or speculative with
    `kda_rollback` = rollback; fp32 on CPU."""
    from serve_app.config import ReferenceEngineConfig, SpeculationConfig
    from serve_app.engines.reference.builder import build_engine, build_runner

    speculative = rollback is not None
    # Fixed windows: the two rollbacks then verify the same windows, compared step by step.
    cfg = ReferenceEngineConfig(kv_capacity_tokens=4096, max_batch_size=4, speculation=(
        SpeculationConfig(enabled=speculative, kda_rollback=rollback or "scratch",
                          adaptive=False)))
    engine = build_engine(build_runner(target, draft if speculative else None, cfg), cfg)
    runner = engine.runner
    log.instrument(runner)  # innermost: the step log's times exclude the timer's bookkeeping
    runner.forward = timer.wrap("forward", runner.forward, _forward_kind)  # type: ignore[method-assign]
    if speculative:
        propose = oracle.wrap(runner.propose) if oracle is not None else runner.propose
        runner.propose = timer.wrap("draft_propose", propose)  # type: ignore[method-assign]
        runner.commit = timer.wrap("commit", runner.commit)  # type: ignore[method-assign]
        runner.cache.commit = timer.wrap(  # type: ignore[method-assign]
            "commit_kda_truncate", runner.cache.commit)
        assert runner.proposer is not None
        # The draft's context rows are written when it next drafts (inside draft_propose).
        runner.proposer.settle = timer.wrap(  # type: ignore[method-assign]
            "draft_context_write", runner.proposer.settle)
    return engine


def _median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def planner_rollback(ring_len: int = 16) -> dict[str, Any]:
    """What the capacity planner says each strategy costs for the real K3 + DSpark on the
    flagship deployment (deployments/kimi_dspark.yaml: 2 x 8 H200, TP16 EP16, FP8 KV, 1M)."""
    from capacity import Layout, Speculation, describe_model, load_gpus
    from capacity.formats import KvDtype
    from capacity.memory import kda_rollback_costs, running_fit

    k3, draft, h200 = describe_model("kimi-k3"), describe_model("kimi-k3-dspark"), load_gpus()["H200"]
    layout = Layout(gpu="H200", nodes=2, tp=16, ep=16, kv_dtype=KvDtype.FP8)
    context = 1_048_576
    spec = Speculation.for_draft(draft)
    out: dict[str, Any] = {"deployment": "2 x 8 H200, TP16 EP16, FP8 KV, 1M context "
                                         "(deployments/kimi_dspark.yaml)",
                           "draft_tokens": spec.gamma + 1, "ring_len": ring_len,
                           "strategies": {}}
    for strategy in ("scratch", "replay"):
        cost = kda_rollback_costs(k3, spec.gamma + 1, layout.attention_tp, strategy, ring_len)
        fit = running_fit(k3, layout, h200, context, draft, spec, kda_rollback=strategy,
                          ring_len=ring_len)
        at48 = running_fit(k3, layout, h200, context, draft, spec, running=48,
                           kda_rollback=strategy, ring_len=ring_len)
        out["strategies"][strategy] = {
            "state_slot_bytes": cost.state_slot_bytes,
            "rollback_bytes_per_request": cost.rollback_bytes_per_request,
            "state_bytes_per_request": cost.state_bytes_per_request,
            "rollback_bytes_per_gpu_at_48": cost.rollback_bytes(48),
            "state_bytes_per_gpu_at_48": cost.state_bytes(48),
            "max_running_requests": fit.max_running_requests,
            "kv_room_bytes_at_max_running": fit.kv_room_bytes,
            "full_context_requests_at_max_running": fit.full_context_requests,
            "kv_room_bytes_at_48": at48.kv_room_bytes,
            "full_context_requests_at_48": at48.full_context_requests,
        }
    return out


def planner_mini(target: Path, draft_tokens: int, ring_len: int = 16) -> dict[str, Any]:
    """The planner's formulas for this run's mini K3 (TP1, conv and SSM fp32 as run here), to
    set beside the measured windows: SGLang's buffers, not this engine's (replay here logs the
    window's inputs per request; SGLang keeps a ring per mamba slot)."""
    from capacity import describe_model
    from capacity.memory import kda_rollback_costs

    model = describe_model(target)
    out = {}
    for strategy in ("scratch", "replay"):
        c = kda_rollback_costs(model, draft_tokens, 1, strategy, ring_len, conv_bytes=4,
                               ssm_bytes=4)
        out[strategy] = {"state_slot_bytes": c.state_slot_bytes,
                         "verify_row_bytes": c.per_request_bytes,
                         "ring_bytes_per_slot": c.per_slot_ring_bytes}
    return out


def run_k3(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    proposer = args.proposer or "oracle-partial"
    tmp = tempfile.TemporaryDirectory()
    target, draft = random_k3_pair(Path(tmp.name))
    from serve_app.models.target_config import load_target_config

    tcfg = load_target_config(target)
    prompts = random_prompts(args.k3_prompts, tcfg.vocab_size, args.prompt_min,
                             args.prompt_max, args.prompt_seed)
    oracle = OracleDrafts(tcfg.vocab_size) if proposer == "oracle-partial" else None
    label = ("RANDOM-WEIGHT mini K3 target + random DSpark draft (overhead only: random "
             "weights, acceptance meaningless); drafts: " + (
                 "oracle-partial (the target's greedy continuation, a uniform 0..gamma of "
                 "them kept right; the DSpark draft still runs and is timed)"
                 if oracle else "the random DSpark draft (accepts ~0: commit keeps 1 position)"))
    report: dict[str, Any] = {
        "pair": "random-k3", "label": label, "proposer": proposer, "threads": args.threads,
        "max_tokens": args.max_tokens, "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts], "repeats": args.repeats, "batch_size": 1,
        "results": [],
    }
    timers = {v: CallTimer() for v in K3_VARIANTS}
    logs = {v: StepLog() for v in K3_VARIANTS}
    engines = {v: make_k3_engine(target, draft, None if v == "target_only" else v, timers[v],
                                 logs[v], oracle) for v in K3_VARIANTS}
    runner = engines["scratch"].runner
    gamma = runner.proposer.gamma  # type: ignore[union-attr]
    report["gamma"] = gamma
    report["state_slot_bytes"] = runner.cache.states.bytes_per_slot  # type: ignore[union-attr]
    report["planner_mini"] = planner_mini(target, gamma + 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens + gamma + 1,
                            ignore_eos=True)
    if oracle is not None:  # the reference continuations (not timed)
        for p in prompts:
            oracle.reference[tuple(p)] = engines["target_only"].generate([p], greedy)[0].token_ids
    for e in engines.values():  # warm-up: first calls allocate and fault in pages
        e.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for temperature in args.temperatures:
        for v in K3_VARIANTS:
            timers[v].times.clear()
            logs[v].clear()
        rows = []
        for i, prompt in enumerate(prompts):
            times: dict[str, list[float]] = {v: [] for v in K3_VARIANTS}
            decode: dict[str, list[float]] = {v: [] for v in K3_VARIANTS}  # minus prefill
            outputs: dict[str, list[list[int]]] = {v: [] for v in K3_VARIANTS}
            spec: dict[str, dict[str, Any]] = {v: {"verify_ct": 0, "tokens": 0, "hist": []}
                                               for v in K3_VARIANTS[1:]}
            for r in range(args.repeats):
                params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                        ignore_eos=True, seed=1000 * i + r)
                order = K3_VARIANTS if (i + r) % 2 == 0 else K3_VARIANTS[::-1]
                for v in order:
                    prefills = timers[v].times.setdefault("prefill_forward", [])
                    before = len(prefills)
                    t0 = time.perf_counter()
                    out = engines[v].generate([prompt], params)[0]
                    times[v].append(time.perf_counter() - t0)
                    decode[v].append(times[v][-1] - sum(prefills[before:]))
                    outputs[v].append(out.token_ids)
                    if out.spec is not None:
                        s = spec[v]
                        s["verify_ct"] += out.spec["spec_verify_ct"]
                        s["tokens"] += out.completion_tokens
                        s["hist"] = add_histograms(s["hist"],
                                                   out.spec["spec_correct_drafts_histogram"])
            n_tok = len(outputs["target_only"][0])
            rows.append({
                "prompt": i, "prompt_tokens": len(prompt), "new_tokens": n_tok,
                **{f"{v}_tok_s": n_tok / statistics.median(times[v]) for v in K3_VARIANTS},
                # The tokens after the first (which the prefill samples) over the time outside
                # the prefill forwards: the same prefill in every variant, and noisy.
                **{f"{v}_decode_tok_s": (n_tok - 1) / statistics.median(decode[v])
                   for v in K3_VARIANTS},
                "time_s": {v: sum(t) for v, t in times.items()},
                "decode_s": {v: sum(t) for v, t in decode.items()},
                "tokens": {v: sum(map(len, o)) for v, o in outputs.items()},
                "identical": {v: outputs[v] == outputs["target_only"] for v in K3_VARIANTS[1:]}
                if temperature == 0 else None,
                "spec": spec,
            })
        report["results"].append(summarize_k3(temperature, rows, timers, logs, gamma))
    report["planner"] = planner_rollback()
    tmp.cleanup()
    return report


def summarize_k3(temperature: float, rows: list[dict[str, Any]], timers: dict[str, CallTimer],
                 logs: dict[str, StepLog], gamma: int) -> dict[str, Any]:
    agg = {v: sum(r["tokens"][v] for r in rows) / sum(r["time_s"][v] for r in rows)
           for v in K3_VARIANTS}
    # Decode-only: every run's tokens but its first (one per run) over the time outside prefill.
    dec = {v: sum(r["tokens"][v] - r["tokens"][v] // r["new_tokens"] for r in rows)
           / sum(r["decode_s"][v] for r in rows) for v in K3_VARIANTS}
    variants: dict[str, Any] = {}
    for v in K3_VARIANTS:
        calls = timers[v].summary()
        # Full windows only (1 + gamma rows, or the widest there was): the last steps before
        # max_tokens verify fewer drafts.
        width = max((s["width"] for s in logs[v].steps), default=gamma + 1)
        full = [s for s in logs[v].steps if s["width"] == width]
        entry: dict[str, Any] = {
            "tok_s": {"median": statistics.median(r[f"{v}_tok_s"] for r in rows),
                      "aggregate": agg[v]},
            "decode_tok_s": {"median": statistics.median(r[f"{v}_decode_tok_s"] for r in rows),
                             "aggregate": dec[v]},
            "call_times": calls,
        }
        if v != "target_only":
            verify_ct = sum(r["spec"][v]["verify_ct"] for r in rows)
            hist: list[int] = []
            for r in rows:
                hist = add_histograms(hist, r["spec"][v]["hist"])
            entry.update({
                "spec_accept_length": sum(r["spec"][v]["tokens"] for r in rows) / verify_ct,
                "spec_verify_ct": verify_ct,
                "spec_correct_drafts_histogram": hist,
                "lossless_identical": (all(r["identical"][v] for r in rows)
                                       if temperature == 0 else None),
                "window_rows": int(width), "full_window_steps": len(full),
                "step_ms": {k: _median_ms([s[f"{k}_s"] for s in full])
                            for k in ("verify", "commit", "truncate", "commit_rest")},
                "verify_plus_commit_ms": _median_ms([s["verify_s"] + s["commit_s"]
                                                     for s in full]),
                "scratch_bytes_per_request": logs[v].scratch.get(width),
            })
        variants[v] = entry
    sc, rp = variants["scratch"], variants["replay"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return {
        "temperature": temperature, "variants": variants,
        "replay_over_scratch": {
            "verify_plus_commit_ms": ratio(rp["verify_plus_commit_ms"],
                                           sc["verify_plus_commit_ms"]),
            "verify_ms": ratio(rp["step_ms"]["verify"], sc["step_ms"]["verify"]),
            "truncate_ms": ratio(rp["step_ms"]["truncate"], sc["step_ms"]["truncate"]),
            "tok_s_aggregate": ratio(rp["tok_s"]["aggregate"], sc["tok_s"]["aggregate"]),
            "tok_s_median_per_prompt": statistics.median(
                r["replay_tok_s"] / r["scratch_tok_s"] for r in rows),
            "decode_tok_s_aggregate": ratio(rp["decode_tok_s"]["aggregate"],
                                            sc["decode_tok_s"]["aggregate"]),
            "decode_tok_s_median_per_prompt": statistics.median(
                r["replay_decode_tok_s"] / r["scratch_decode_tok_s"] for r in rows),
        },
        "speedup_vs_target_only": {v: ratio(variants[v]["tok_s"]["aggregate"],
                                            variants["target_only"]["tok_s"]["aggregate"])
                                   for v in K3_VARIANTS[1:]},
        "per_prompt": [{k: x for k, x in r.items() if k not in ("time_s", "tokens", "decode_s")}
                       for r in rows],
    }


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def print_k3_table(report: dict[str, Any]) -> None:
    print(f"\n{report['label']}")
    print(f"{report['prompts']} random-token prompts ({min(report['prompt_tokens'])}-"
          f"{max(report['prompt_tokens'])} tokens) x {report['max_tokens']} new tokens, batch 1, "
          f"gamma {report['gamma']}, {report['repeats']} repeats (variant order alternating), "
          f"{report['threads']} threads; medians")
    for r in report["results"]:
        vs = r["variants"]
        print(f"\nT={r['temperature']}")
        head = (f"{'variant':<12} {'tok/s med':>9} {'(aggr.)':>8} {'vs target':>9} "
                f"{'dec tok/s':>9} "
                f"{'acc.len':>7} {'lossless':>8} {'propose':>8} {'verify':>8} {'commit':>8} "
                f"{'truncate':>8} {'rest':>6} {'v+c/step':>8} {'decode':>7}")
        print(head)
        print("-" * len(head))
        for v, e in vs.items():
            calls = e["call_times"]
            if v == "target_only":
                dec = calls.get("target_decode_forward", {}).get("median_ms")
                print(f"{v:<12} {e['tok_s']['median']:>9.1f} {e['tok_s']['aggregate']:>8.1f} "
                      f"{'1.00x':>9} {e['decode_tok_s']['aggregate']:>9.1f} {'-':>7} {'-':>8} {'-':>8} {'-':>8} {'-':>8} {'-':>8} "
                      f"{'-':>6} {'-':>8} {_fmt_ms(dec):>7}")
                continue
            lossless = {True: "yes", False: "NO", None: "n/a"}[e["lossless_identical"]]
            st = e["step_ms"]
            print(f"{v:<12} {e['tok_s']['median']:>9.1f} {e['tok_s']['aggregate']:>8.1f} "
                  f"{r['speedup_vs_target_only'][v]:>8.2f}x {e['decode_tok_s']['aggregate']:>9.1f} "
                  f"{e['spec_accept_length']:>7.2f} "
                  f"{lossless:>8} {_fmt_ms(calls['draft_propose']['median_ms']):>8} "
                  f"{_fmt_ms(st['verify']):>8} {_fmt_ms(st['commit']):>8} "
                  f"{_fmt_ms(st['truncate']):>8} {_fmt_ms(st['commit_rest']):>6} "
                  f"{_fmt_ms(e['verify_plus_commit_ms']):>8} {'-':>7}")
        print(f"ms per call; verify/commit/truncate/rest/v+c: full windows "
              f"({vs['scratch']['window_rows']} rows) only; "
              "truncate = HybridCache.commit (KDA state copy or replay + latent truncation), "
              "rest = the rest of commit (allocator truncation, the draft's taps held); "
              "dec tok/s: aggregate, without the prefill forwards and their first tokens; "
              "decode: the target-only decode forward")
        for v in ("scratch", "replay"):
            e = vs[v]
            sb = e["scratch_bytes_per_request"] or {}
            print(f"  {v:<8} histogram {e['spec_correct_drafts_histogram']} "
                  f"({e['full_window_steps']} full-window steps); verify scratch per request "
                  f"{sb.get('tensor_bytes', 0) / 1e6:.3f} MB (tensors) / "
                  f"{sb.get('storage_bytes', 0) / 1e6:.3f} MB (storages held), "
                  f"state slot {report['state_slot_bytes'] / 1e6:.3f} MB; planner for this "
                  f"model: verify row {report['planner_mini'][v]['verify_row_bytes'] / 1e6:.3f}"
                  f" MB + ring {report['planner_mini'][v]['ring_bytes_per_slot'] / 1e6:.3f} MB "
                  f"per mamba slot, slot {report['planner_mini'][v]['state_slot_bytes'] / 1e6:.3f}"
                  " MB")
        q = r["replay_over_scratch"]
        print(f"  replay / scratch: verify+commit per step {_fmt_x(q['verify_plus_commit_ms'])} "
              f"(verify {_fmt_x(q['verify_ms'])}, truncate {_fmt_x(q['truncate_ms'])}); tok/s "
              f"{_fmt_x(q['tok_s_aggregate'])} aggregate, {_fmt_x(q['tok_s_median_per_prompt'])} "
              f"median per prompt; decode-only tok/s {_fmt_x(q['decode_tok_s_aggregate'])} "
              f"aggregate, {_fmt_x(q['decode_tok_s_median_per_prompt'])} median per prompt")
    p = report["planner"]
    print(f"\nplanner, real K3 + DSpark on {p['deployment']}, draft tokens "
          f"{p['draft_tokens']}, replay ring {p['ring_len']} (capacity.memory):")
    cols = ("rollback/req", "KDA/req", "rollback@48", "KDA@48", "KV room@48", "full@48",
            "max running", "KV room@max", "full@max")
    head = f"{'strategy':<8} " + " ".join(f"{c:>11}" for c in cols)
    print(head)
    print("-" * len(head))
    for s, c in p["strategies"].items():
        cells = (f"{c['rollback_bytes_per_request'] / 1e6:.1f} MB",
                 f"{c['state_bytes_per_request'] / 1e6:.1f} MB",
                 f"{c['rollback_bytes_per_gpu_at_48'] / 1e9:.2f} GB",
                 f"{c['state_bytes_per_gpu_at_48'] / 1e9:.2f} GB",
                 f"{c['kv_room_bytes_at_48'] / 1e9:.2f} GB",
                 str(c["full_context_requests_at_48"]), str(c["max_running_requests"]),
                 f"{c['kv_room_bytes_at_max_running'] / 1e9:.2f} GB",
                 str(c["full_context_requests_at_max_running"]))
        print(f"{s:<8} " + " ".join(f"{x:>11}" for x in cells))
    print("per GPU; /req: one running request (verify row + its 5 mamba slots' rings; KDA: "
          "+ the slots); @48: 48 running + padding; KV room: static pool after weights minus "
          "every KDA state; full: full-context (1M) requests whose KV fits in it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=["embedded", "random", "random-k3"],
                        default="embedded")
    parser.add_argument("--temperatures", type=float, nargs="+", default=None,
                        help="default 0, beside --k3-sampling (random-k3: 0, the oracle drafts "
                             "are greedy)")
    parser.add_argument("--k3-sampling", nargs="*", choices=sorted(K3_SAMPLING), default=None,
                        help="K3's own sampling parameters beside --temperatures (default for "
                             "the embedded pair: both)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=None,
                        help="also measure c requests decoding together, target-only, "
                             "always-on and adaptive speculation, in every sampling setting "
                             "(default for the embedded pair: 1 4 16 32)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (random-k3: 5)")
    parser.add_argument("--completion-prompts", type=int, default=None,
                        help="how many held-out completion prompts (default all)")
    parser.add_argument("--chat-prompts", type=int, default=9,
                        help="how many held-out K3 conversations (default 9: one of each kind)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: batch-1 decode gains nothing from more)")
    parser.add_argument("--show-text", action="store_true", help="add a decoded sample")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="--pair random: the draft's layers (default the embedded draft's)")
    parser.add_argument("--markov-rank", type=int, default=None,
                        help="--pair random: the draft's Markov rank")
    k3 = parser.add_argument_group("--pair random-k3")
    k3.add_argument("--proposer", choices=["dspark", "oracle-partial"], default=None,
                    help="drafts: the random DSpark draft's, or the target's greedy "
                         "continuation partly kept right (default for random-k3)")
    k3.add_argument("--k3-prompts", type=int, default=8, help="random-token prompts")
    k3.add_argument("--prompt-min", type=int, default=32, help="shortest prompt, tokens")
    k3.add_argument("--prompt-max", type=int, default=200, help="longest prompt, tokens")
    k3.add_argument("--prompt-seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 5 if args.pair == "random-k3" else 3
    if args.temperatures is None:
        args.temperatures = [0.0]
    if args.k3_sampling is None:
        args.k3_sampling = [] if args.pair == "random-k3" else sorted(K3_SAMPLING)
    if args.concurrency is None:
        args.concurrency = [1, 4, 16, 32] if args.pair == "embedded" else []
    args.settings = [{"name": "greedy" if t == 0 else f"T={t}", "temperature": t, "top_p": 1.0}
                     for t in args.temperatures]
    args.settings += [{"name": n, "temperature": K3_SAMPLING[n][0], "top_p": K3_SAMPLING[n][1]}
                      for n in args.k3_sampling]
    if args.pair != "random-k3" and args.proposer not in (None, "dspark"):
        parser.error("--proposer oracle-partial is for --pair random-k3")
    if args.pair == "random-k3":
        report = run_k3(args)
        print_k3_table(report)
        print(json.dumps(report, separators=(",", ":")))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    report = run(args)
    print_table(report)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
