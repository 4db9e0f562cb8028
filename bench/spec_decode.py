"""Speculative decoding vs target-only decoding on CPU, in one run, on the same prompts.

    python bench/spec_decode.py                      # the embedded trained pair (default)
    python bench/spec_decode.py --pair random        # random weights: overhead only
    python bench/spec_decode.py --temperatures 0 0.7 --repeats 3 --json out.json

Every held-out prompt (serve_app/assets/heldout_prompts.json: cut from corpus files the models
never trained on) is decoded one request at a time (single-user latency, batch 1) for
`--max-tokens` new tokens (EOS ignored, so both modes do the same work), target-only and with
DSpark speculation, alternating, `--repeats` times. Reported:

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
  draft propose, commit (cache rollback + draft context append).

`--pair random` builds a target and a draft of the same shapes with random weights on the fly:
its acceptance is meaningless (about 1) and it is labelled as such; it shows the engine's cost
of speculation when nothing is accepted.
"""

from __future__ import annotations

import argparse
import json
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

from serve_app.embedded import DRAFT, TARGET, TOKENIZER, heldout_prompt_ids  # noqa: E402
from serve_app.engines.reference.engine import EngineCore  # noqa: E402
from serve_app.engines.reference.sampling import SamplingParams  # noqa: E402
from serve_app.tokenizer import load_tokenizer  # noqa: E402
from serve_app.training.evaluate import pair_engine  # noqa: E402


def random_pair(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """A target and a draft with the embedded pair's shapes and random weights."""
    from serve_app.models.dspark import DSparkDraft, save_dspark
    from serve_app.models.kimi import KimiForCausalLM
    from serve_app.models.kimi_weights import save_kimi
    from serve_app.training.train_draft import init_draft, mini_draft_config
    from serve_app.training.train_target import init_weights, mini_target_config

    torch.manual_seed(seed)
    tok = load_tokenizer(TOKENIZER)
    target = KimiForCausalLM(mini_target_config(tok))
    init_weights(target, std=0.1)  # spread enough that greedy output is not one token
    draft = DSparkDraft(mini_draft_config(target, tok))
    init_draft(draft, std=0.1)
    save_kimi(target, folder / "target")
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


def _forward_kind(rows: Any, rids: Any, capture: bool) -> str:
    width = max(len(r) for r in rows)
    if width == 1:
        return "target_decode_forward"
    return "verify_forward" if capture and width <= 16 else "prefill_forward"


def make_engine(target: Path, draft: Path, speculative: bool, timer: CallTimer) -> EngineCore:
    engine = pair_engine(target, draft, speculative)
    runner = engine.runner  # the engine looks these up per call: wrapping after build is enough
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
        target, draft = random_pair(Path(tmp.name))
        label = "RANDOM-WEIGHT mini target + random DSpark draft (untrained: overhead only)"
    else:
        target, draft = TARGET, DRAFT
        label = "embedded trained pair: kimi-mini + kimi-mini-dspark"
    prompts = heldout_prompt_ids(tok, args.completion_prompts, args.chat_prompts)
    report: dict[str, Any] = {
        "pair": args.pair, "label": label, "threads": args.threads,
        "max_tokens": args.max_tokens, "prompts": len(prompts), "repeats": args.repeats,
        "batch_size": 1, "results": [],
    }
    for temperature in args.temperatures:
        timers = {"target_only": CallTimer(), "speculative": CallTimer()}
        engines = {"target_only": make_engine(target, draft, False, timers["target_only"]),
                   "speculative": make_engine(target, draft, True, timers["speculative"])}
        # Warm-up: first calls allocate and fault in pages.
        for e in engines.values():
            e.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True))
        for t in timers.values():
            t.times.clear()
        per_prompt = []
        for i, prompt in enumerate(prompts):
            times: dict[str, list[float]] = {"target_only": [], "speculative": []}
            outputs: dict[str, list[list[int]]] = {"target_only": [], "speculative": []}
            accept: list[float] = []
            verify_ct, tokens_spec = 0, 0
            hist: list[int] = []
            proposed = accepted = 0
            for r in range(args.repeats):
                params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                        ignore_eos=True, seed=1000 * i + r)
                for mode in ("target_only", "speculative"):
                    t0 = time.perf_counter()
                    out = engines[mode].generate([prompt], params)[0]
                    times[mode].append(time.perf_counter() - t0)
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
                "prompt": i, "prompt_tokens": len(prompt), "new_tokens": n_tok,
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
        report["results"].append(summarize(temperature, per_prompt, timers))
        if args.show_text and temperature == 0:
            out = engines["target_only"].generate([prompts[0]], SamplingParams(
                temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))[0]
            report["sample"] = {"prompt": tok.decode(prompts[0]),
                                "completion": tok.decode(out.token_ids)}
    if tmp is not None:
        tmp.cleanup()
    return report


def summarize(temperature: float, rows: list[dict[str, Any]],
              timers: dict[str, CallTimer]) -> dict[str, Any]:
    hist: list[int] = []
    for r in rows:
        hist = add_histograms(hist, r["histogram"])
    tot = {m: sum(r["time_s"][m] for r in rows) for m in ("target_only", "speculative")}
    toks = {m: sum(r["tokens"][m] for r in rows) for m in ("target_only", "speculative")}
    agg = {m: toks[m] / tot[m] for m in tot}
    verify = sum(r["verify_ct"] for r in rows)
    identical = [r["identical"] for r in rows]
    return {
        "temperature": temperature,
        "target_only_tok_s": {"median": statistics.median(r["target_only_tok_s"] for r in rows),
                              "aggregate": agg["target_only"]},
        "speculative_tok_s": {"median": statistics.median(r["speculative_tok_s"] for r in rows),
                              "aggregate": agg["speculative"]},
        "speedup": {"median": statistics.median(r["speedup"] for r in rows),
                    "aggregate": agg["speculative"] / agg["target_only"]},
        "spec_accept_length": {
            "macro": statistics.fmean(r["spec_accept_length"] for r in rows),
            "token_weighted": sum(r["spec_tokens"] for r in rows) / verify if verify else None,
        },
        "spec_accept_rate": (sum(r["accepted"] for r in rows)
                             / max(1, sum(r["proposed"] for r in rows))),
        "spec_verify_ct": verify,
        "spec_correct_drafts_histogram": hist,
        "lossless_identical": all(identical) if temperature == 0 else None,
        "call_times": {m: t.summary() for m, t in timers.items()},
        "per_prompt": [{k: v for k, v in r.items() if k not in ("time_s", "tokens")}
                       for r in rows],
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['label']}")
    print(f"{report['prompts']} held-out prompts x {report['max_tokens']} new tokens, batch 1, "
          f"{report['repeats']} repeats, {report['threads']} threads")
    head = (f"{'T':>4} {'target tok/s':>13} {'spec tok/s':>11} {'speedup':>8} "
            f"{'(aggr.)':>8} {'acc.len':>8} {'(tok-w)':>8} {'acc.rate':>9} {'lossless':>9}")
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        lossless = {True: "yes", False: "NO", None: "n/a"}[r["lossless_identical"]]
        print(f"{r['temperature']:>4} {r['target_only_tok_s']['median']:>13.1f} "
              f"{r['speculative_tok_s']['median']:>11.1f} {r['speedup']['median']:>7.2f}x "
              f"{r['speedup']['aggregate']:>7.2f}x {r['spec_accept_length']['macro']:>8.2f} "
              f"{r['spec_accept_length']['token_weighted']:>8.2f} "
              f"{r['spec_accept_rate']:>9.3f} {lossless:>9}")
    for r in report["results"]:
        print(f"T={r['temperature']}: spec_correct_drafts_histogram "
              f"{r['spec_correct_drafts_histogram']}")
        for mode, calls in r["call_times"].items():
            parts = ", ".join(f"{k} {v['median_ms']:.2f} ms x{v['calls']}"
                              for k, v in calls.items())
            print(f"  {mode:<12} {parts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=["embedded", "random"], default="embedded")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--completion-prompts", type=int, default=None,
                        help="how many held-out completion prompts (default all)")
    parser.add_argument("--chat-prompts", type=int, default=None,
                        help="how many held-out chat prompts (default all)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: batch-1 decode gains nothing from more)")
    parser.add_argument("--show-text", action="store_true", help="add a decoded sample")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    report = run(args)
    print_table(report)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
