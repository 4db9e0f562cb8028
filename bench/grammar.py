"""What constrained decoding costs the reference engine on CPU, in one run.

    python bench/grammar.py                          # about 1-2 min on 2 cores
    python bench/grammar.py --repeats 3 --json out.json

1. Compile time (serve_app/grammar/compiler.py) over KVV's 212 walle schemas
   (tests/data/kvv/walle_validator_cases), p50 / p99 / max in ms, for three sets:

   - k3-tool: each schema as a strict tool's `value` (as KVV wraps it) under tool_choice
     required, K3's format (thinking on), with the K3-style tokenizer (163,840 ids);
   - plain: each schema as a plain response_format json_schema, the embedded tokenizer (4,096);
   - plain-k3vocab: the same with the K3-style tokenizer (what the vocabulary alone changes).

   Every schema gets a fresh GrammarCompiler (the 212 hold duplicates, which one shared
   compiler would answer from its cache). Per set: how many raised GrammarError, how many
   strict tools fell back to free arguments ("relaxed"), and, on the same compiler, the time
   of a cache hit (`prepare` again) and of `matcher()` (the deep copy a request gets).

2. Mask cost on the embedded pair (kimi-k3-mini + kimi-k3-mini-dspark), plain format: the
   held-out prompts in batches, greedy, with no grammar ("free") and under each of GRAMMARS,
   speculation off and on, variant order alternating across repeats. Each decode step (one
   decode forward off; one draft proposal + verify window per request on) is timed with the
   masks it computed (GrammarStates.mask_seconds / masks_computed). Only full-batch steps
   count (constrained answers end at different lengths): the median step time, its ratio to
   the free step, masks per step and their time (the mask alone: the matcher's consume,
   roll-back and the masking itself are in the step ratio, not here). With speculation:
   spec_accept_length (token-weighted, as engine.stats() reports it) per grammar beside the
   free run, and whether greedy spec-on outputs equal spec-off outputs (lossless). The same
   again with `grammar_budget: close` (close_off / close_on), and per grammar the share of
   answers that parse as JSON (what closing changes at this max_tokens).

   The embedded vocabulary is 40x smaller than K3's, and llguidance's mask work grows with
   it: the greedy answers are replayed through GrammarStates with both tokenizers to give
   the time per mask at 4,096 and at 163,840 ids.

A printed table, then the report as one JSON line (also written to --json FILE).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
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
sys.path.insert(0, str(ROOT / "tests"))  # the K3-style tokenizer fixture the tests use

from tiny_models import WALLE_CASES, kvv_walle_tool, write_k3_style_tokenizer  # noqa: E402

from serve_app.config import ReferenceEngineConfig, SpeculationConfig  # noqa: E402
from serve_app.embedded import DRAFT, TARGET, TOKENIZER, heldout_prompt_ids  # noqa: E402
from serve_app.engines.reference.builder import build_engine, build_runner  # noqa: E402
from serve_app.engines.reference.engine import EngineCore  # noqa: E402
from serve_app.grammar.compiler import GrammarCompiler, GrammarError, ll_tokenizer  # noqa: E402
from serve_app.grammar.matchers import GrammarFault, GrammarStates  # noqa: E402
from serve_app.protocol.generation import RequestOutput, SamplingParams  # noqa: E402
from serve_app.protocol.grammar import GrammarSpec  # noqa: E402
from serve_app.tokenizer import Tokenizer, load_tokenizer, stop_token_ids  # noqa: E402

K3_VOCAB = 163_840
RESPONSE = "response_format.json_schema.schema"

# Bounded answers the embedded model fills differently (a few tokens to max_tokens).
RECORD = {"type": "object", "additionalProperties": False, "required": ["kind", "count", "note"],
          "properties": {"kind": {"enum": ["module", "class", "function"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "note": {"type": "string", "maxLength": 48}}}
IDENT_DOC = {"type": "object", "additionalProperties": False, "required": ["name", "doc"],
             "properties": {"name": {"type": "string", "pattern": "^[a-z_]+$", "maxLength": 24},
                            "doc": {"type": "string", "maxLength": 120}}}
WORDS = {"type": "array", "items": {"type": "string", "maxLength": 16},
         "minItems": 2, "maxItems": 8}
GRAMMARS = {
    "record": GrammarSpec("json_schema", RESPONSE, schema=RECORD),
    "ident_doc": GrammarSpec("json_schema", RESPONSE, schema=IDENT_DOC),
    "words": GrammarSpec("json_schema", RESPONSE, schema=WORDS),
    "json_object": GrammarSpec("json_object", "response_format"),
}
FREE = "free"
# (label, speculation, engine.reference.grammar_budget): the default engine, and one that
# closes constrained answers before max_tokens (serve_app/grammar/closing.py).
MODES = (("spec_off", False, "cut"), ("spec_on", True, "cut"),
         ("close_off", False, "close"), ("close_on", True, "close"))


# --- statistics ------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms_summary(seconds: list[float]) -> dict[str, float]:
    ms = [1e3 * s for s in seconds]
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms)}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- 1. compile time -------------------------------------------------------------------------

def walle_schemas() -> list[Any]:
    lines = [json.loads(line) for f in sorted(WALLE_CASES.glob("*/valid.jsonl"))
             for line in f.read_text().splitlines() if line.strip()]
    return [case.get("schema", case) if isinstance(case, dict) else case for case in lines]


def tool_spec(schema: Any) -> GrammarSpec:
    """KVV's tool_call_json_schema: the schema as a strict tool's only (required) argument,
    wrapped as KVV wraps it, thinking on."""
    return kvv_walle_tool(schema, thinking=True)[0]


def plain_spec(schema: Any) -> GrammarSpec:
    return GrammarSpec("json_schema", RESPONSE, schema=schema, chat_format="plain")


def compile_set(schemas: list[Any], make: Callable[[Any], GrammarSpec],
                vocab: Any) -> dict[str, Any]:
    """Each schema's spec compiled cold on its own compiler, then a cache hit and a matcher
    copy."""
    specs = [make(s) for s in schemas]
    compile_s, hit_s, copy_s = [], [], []
    errors: list[str] = []  # the schemas that raised GrammarError, shortened
    relaxed = 0
    GrammarCompiler(vocab).prepare(plain_spec({"type": "integer"}))  # llguidance's first call
    for schema, spec in zip(schemas, specs, strict=True):
        compiler = GrammarCompiler(vocab)
        start = time.perf_counter()
        try:
            compiler.prepare(spec)
        except GrammarError:
            errors.append(json.dumps(schema)[:80])
            continue
        finally:
            compile_s.append(time.perf_counter() - start)
        hit_s.append(timed(lambda c=compiler, s=spec: c.prepare(s)))
        copy_s.append(timed(lambda c=compiler, s=spec: c.matcher(s)))
        # The compiler's own rule for a strict tool it cannot enforce (compiler.py), on the
        # schemas as it enforces them.
        resolved = compiler._resolvable(spec)
        relaxed += sum(not compiler._compiles(resolved, t) for t in resolved.tools if t.strict)
    return {"schemas": len(specs), "distinct": len({s.key for s in specs}),
            "vocab": vocab.vocab_size, **ms_summary(compile_s), "grammar_errors": len(errors),
            "error_schemas": errors, "relaxed_tools": relaxed,
            "cache_hit_p50_us": 1e6 * statistics.median(hit_s),
            "matcher_copy_p50_us": 1e6 * statistics.median(copy_s),
            "matcher_copy_max_us": 1e6 * max(copy_s)}


def compile_report(embedded: Any, k3: Any, limit: int | None = None) -> dict[str, Any]:
    schemas = walle_schemas()[:limit]
    return {"k3-tool": compile_set(schemas, tool_spec, k3),
            "plain": compile_set(schemas, plain_spec, embedded),
            "plain-k3vocab": compile_set(schemas, plain_spec, k3)}


# --- 2. mask cost on the embedded pair -------------------------------------------------------

class StepLog:
    """Every decode step of an engine (EngineCore._decode): rows, wall time, masks computed
    and their time, filed under the variant being run."""

    def __init__(self, engine: EngineCore) -> None:
        self.variant = FREE
        self.steps: dict[str, list[dict[str, float]]] = {}
        decode = engine._decode
        states = engine.grammars

        def logged(seqs: list[Any]) -> Any:
            masks, mask_s = states.masks_computed, states.mask_seconds
            start = time.perf_counter()
            out = decode(seqs)
            self.steps.setdefault(self.variant, []).append({
                "rows": len(seqs), "s": time.perf_counter() - start,
                "masks": states.masks_computed - masks, "mask_s": states.mask_seconds - mask_s})
            return out

        engine._decode = logged  # type: ignore[method-assign]


def make_engine(tok: Tokenizer, speculative: bool, budget: str) -> EngineCore:
    cfg = ReferenceEngineConfig(kv_capacity_tokens=8192, grammar_budget=budget,
                                speculation=SpeculationConfig(enabled=speculative))
    runner = build_runner(TARGET, DRAFT if speculative else None, cfg)
    return build_engine(runner, cfg, eos_token_ids=stop_token_ids(tok), tokenizer=tok)


def run_mode(tok: Tokenizer, speculative: bool, budget: str, prompts: list[list[int]],
             args: argparse.Namespace) -> tuple[StepLog, dict[str, list[RequestOutput]]]:
    """Every variant on the same prompts, `args.repeats` times, order alternating."""
    engine = make_engine(tok, speculative, budget)
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    for spec in GRAMMARS.values():
        engine.grammar.prepare(spec)  # as the ingress does, off the step loop
    log = StepLog(engine)
    variants = [FREE, *GRAMMARS]
    outputs: dict[str, list[RequestOutput]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            log.variant = variant
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                    grammar=GRAMMARS.get(variant))
            for i in range(0, len(prompts), args.batch):
                outputs[variant] += engine.generate(prompts[i:i + args.batch], params)
    return log, outputs


def accept_length(outs: list[RequestOutput]) -> float | None:
    """Token-weighted spec_accept_length (completion tokens / verify steps)."""
    verify = sum(o.spec["spec_verify_ct"] for o in outs if o.spec)
    return sum(o.completion_tokens for o in outs if o.spec) / verify if verify else None


def valid_json(tok: Tokenizer, outs: list[RequestOutput]) -> float:
    """The share of answers that parse as JSON (complete: not cut inside a value)."""
    def parses(out: RequestOutput) -> bool:
        try:
            json.loads(tok.decode(out.token_ids))
        except ValueError:
            return False
        return True

    return sum(map(parses, outs)) / len(outs)


def summarize_mode(log: StepLog, outputs: dict[str, list[RequestOutput]],
                   batch: int, tok: Tokenizer) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for variant, steps in log.steps.items():
        full = [s for s in steps if s["rows"] == batch]
        masks = sum(s["masks"] for s in steps)
        rows[variant] = {
            "full_batch_steps": len(full),
            "step_ms": 1e3 * statistics.median(s["s"] for s in full) if full else None,
            "masks_per_step": statistics.fmean(s["masks"] for s in full) if full else None,
            "mask_ms_per_step": (1e3 * statistics.fmean(s["mask_s"] for s in full)
                                 if full else None),
            "mask_ms_per_mask": 1e3 * sum(s["mask_s"] for s in steps) / masks if masks else None,
            "tokens_per_request": statistics.fmean(o.completion_tokens
                                                   for o in outputs[variant]),
            "spec_accept_length": accept_length(outputs[variant]),
            "valid_json": None if variant == FREE else valid_json(tok, outputs[variant]),
        }
    free_ms = rows[FREE]["step_ms"]
    for r in rows.values():
        r["step_over_free"] = r["step_ms"] / free_ms if r["step_ms"] and free_ms else None
        r["mask_share_of_step"] = (r["mask_ms_per_step"] / r["step_ms"]
                                   if r["mask_ms_per_step"] is not None and r["step_ms"] else None)
    return rows


def mask_ms_by_vocab(texts: dict[str, list[str]], vocabs: dict[str, tuple[Any, Tokenizer]]
                     ) -> dict[str, dict[str, float | None]]:
    """The greedy answers replayed through GrammarStates (the engine's mask path) under each
    vocabulary: ms per mask."""
    out: dict[str, dict[str, float | None]] = {}
    for name, spec in GRAMMARS.items():
        out[name] = {}
        for label, (vocab, tok) in vocabs.items():
            compiler = GrammarCompiler(vocab)
            states = GrammarStates(vocab.vocab_size, stop_token_ids(tok))
            for text in texts[name]:
                grammar = states.start(compiler.matcher(spec), 0, 4096)
                # A tokenization the grammar refuses midway: the masks so far count.
                with contextlib.suppress(GrammarFault):
                    grammar.consume(tok.encode_text(text))
            out[name][label] = (1e3 * states.mask_seconds / states.masks_computed
                                if states.masks_computed else None)
    return out


# --- the report ------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(TOKENIZER)
    embedded_vocab = ll_tokenizer(tok, 4096, stop_token_ids(tok))
    with tempfile.TemporaryDirectory() as tmp:
        k3_tok = load_tokenizer(write_k3_style_tokenizer(Path(tmp) / "k3"))
    start = time.perf_counter()
    k3_vocab = ll_tokenizer(k3_tok, K3_VOCAB, stop_token_ids(k3_tok))
    report: dict[str, Any] = {
        "bench": "grammar", "threads": args.threads,
        "k3_ll_tokenizer_build_s": time.perf_counter() - start,
        "compile": compile_report(embedded_vocab, k3_vocab, args.schemas),
    }
    prompts = heldout_prompt_ids(tok, args.prompts - args.chat_prompts, args.chat_prompts)
    modes, outputs = {}, {}
    for label, speculative, budget in MODES:
        log, outputs[label] = run_mode(tok, speculative, budget, prompts, args)
        modes[label] = summarize_mode(log, outputs[label], args.batch, tok)
    lossless = {f"{on}/{v}": [o.token_ids for o in outputs[on][v]]
                == [o.token_ids for o in outputs[off][v]]
                for on, off in (("spec_on", "spec_off"), ("close_on", "close_off"))
                for v in (FREE, *GRAMMARS)}
    texts = {v: [tok.decode(o.token_ids) for o in outputs["spec_off"][v][: len(prompts)]]
             for v in GRAMMARS}
    report["mask"] = {
        "pair": f"{TARGET.name} + {DRAFT.name}", "prompts": len(prompts),
        "max_tokens": args.max_tokens, "batch": args.batch, "repeats": args.repeats,
        "temperature": 0.0, "modes": modes, "lossless": lossless,
        "lossless_all": all(lossless.values()),
        "mask_ms_per_mask_by_vocab": mask_ms_by_vocab(
            texts, {"4096": (embedded_vocab, tok), str(K3_VOCAB): (k3_vocab, k3_tok)}),
        "samples": {v: t[0] for v, t in texts.items()},
    }
    return report


def _f(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def print_table(report: dict[str, Any]) -> None:
    comp = report["compile"]
    any_set = next(iter(comp.values()))
    print(f"\nGrammar compile: {any_set['schemas']} KVV walle schemas ({any_set['distinct']} "
          "distinct), a fresh GrammarCompiler per schema")
    head = (f"{'set':<14} {'vocab':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'errors':>6} "
            f"{'relaxed':>7} {'hit us':>7} {'copy us':>8}")
    print(head)
    print("-" * len(head))
    for name, c in comp.items():
        print(f"{name:<14} {c['vocab']:>7} {c['p50_ms']:>7.2f} {c['p99_ms']:>7.2f} "
              f"{c['max_ms']:>7.2f} {c['grammar_errors']:>6} {c['relaxed_tools']:>7} "
              f"{c['cache_hit_p50_us']:>7.1f} {c['matcher_copy_p50_us']:>8.1f}")
    print("k3-tool: strict tool, tool_choice required, K3 format, thinking on (a strict tool is "
          "built alone first, then in the request's grammar); errors: GrammarError; relaxed: "
          "strict tools left with free arguments; hit: prepare() again (p50); copy: matcher() "
          f"(p50). K3 ll_tokenizer build: {report['k3_ll_tokenizer_build_s']:.2f} s (once)")
    for name, c in comp.items():
        for schema in c["error_schemas"]:
            print(f"  GrammarError ({name}): {schema}")

    m = report["mask"]
    print(f"\nMask cost: {m['pair']} (vocab 4096), plain format, {m['prompts']} held-out "
          f"prompts x <= {m['max_tokens']} tokens, greedy, batch {m['batch']}, {m['repeats']} "
          "repeats; per full-batch decode step (spec on: a draft proposal + a verify window "
          "per request)")
    head = (f"{'mode':<8} {'grammar':<12} {'steps':>5} {'step ms':>8} {'x free':>7} "
            f"{'masks/st':>8} {'mask ms/st':>10} {'mask %':>6} {'ms/mask':>7} {'tok/req':>7} "
            f"{'acc.len':>7} {'json ok':>7} {'lossless':>8}")
    print(head)
    print("-" * len(head))
    for mode, rows in m["modes"].items():
        for v, r in rows.items():
            same = m["lossless"].get(f"{mode}/{v}")
            lossless = "" if same is None else "yes" if same else "NO"
            share = r["mask_share_of_step"]
            print(f"{mode:<8} {v:<12} {r['full_batch_steps']:>5} {_f(r['step_ms']):>8} "
                  f"{_f(r['step_over_free'], '.3f', 'x'):>7} {_f(r['masks_per_step'], '.1f'):>8} "
                  f"{_f(r['mask_ms_per_step'], '.3f'):>10} "
                  f"{_f(None if share is None else 100 * share, '.1f'):>6} "
                  f"{_f(r['mask_ms_per_mask'], '.3f'):>7} {r['tokens_per_request']:>7.1f} "
                  f"{_f(r['spec_accept_length']):>7} {_f(r['valid_json']):>7} {lossless:>8}")
    print("medians over full-batch steps; x free: step time over the free step's (same mode); "
          "mask %: mask time alone / step; acc.len: token-weighted spec_accept_length; json "
          "ok: share of answers that parse (not cut inside a value); close_*: grammar_budget "
          "close")
    print(f"lossless: {'yes' if m['lossless_all'] else 'no'} (greedy spec-on == spec-off, "
          "every grammar and free, either budget)")
    by_vocab = m["mask_ms_per_mask_by_vocab"]
    labels = list(next(iter(by_vocab.values())))
    print("\nms per mask, the greedy answers replayed through GrammarStates: "
          + " / ".join(f"vocab {label}" for label in labels))
    for v, row in by_vocab.items():
        a, b = (row[label] for label in labels)
        ratio = f"{b / a:.1f}x" if a and b else "-"
        print(f"  {v:<12} " + " / ".join(_f(row[label], '.3f') for label in labels)
              + f"  ({ratio})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts in all")
    parser.add_argument("--chat-prompts", type=int, default=2, help="of which chat prompts")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--schemas", type=int, default=None,
                        help="compile only the first N walle schemas (default: all 212)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    report = run(args)
    print_table(report)
    print(json.dumps(report, separators=(",", ":")))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
