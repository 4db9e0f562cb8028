"""Measure a trained pair with the reference engine, the way the test and the benchmark do."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from serve_app.chat.formats import ChatPlan, chat_format_for
from serve_app.chat.segments import encode_segments
from serve_app.chat.xtml_render import END_OF_MSG, HistoryCall, Message, assistant_completion
from serve_app.config import ReferenceEngineConfig, SpeculationConfig
from serve_app.engines.reference.builder import (
    build_engine,
    build_runner,
)
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.sampling import SamplingParams
from serve_app.protocol.grammar import ToolStrictLevel
from serve_app.tokenizer import Tokenizer, stop_token_ids

LOOP_NGRAM = 4
LOOP_COVERAGE = 0.5


def repeated_ngram_coverage(token_ids: list[int], n: int = LOOP_NGRAM) -> float:
    """The fraction of tokens that lie inside an n-gram occurring at least twice in the
    sequence (0 for sequences shorter than 2n)."""
    if len(token_ids) < 2 * n:
        return 0.0
    grams = [tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1)]
    seen: dict[tuple[int, ...], int] = {}
    for gram in grams:
        seen[gram] = seen.get(gram, 0) + 1
    covered = [False] * len(token_ids)
    for i, gram in enumerate(grams):
        if seen[gram] > 1:
            covered[i:i + n] = [True] * n
    return sum(covered) / len(token_ids)


def is_looping(token_ids: list[int]) -> bool:
    """A continuation that fell into a loop: repeated 4-grams make up more than half of it.
    Code repeats itself a little (indentation, `self.`); a loop repeats itself wholesale."""
    return repeated_ngram_coverage(token_ids) > LOOP_COVERAGE


def pair_engine(target: Path, draft: Path, speculative: bool,
                kv_capacity_tokens: int = 4096,
                speculation_max_batch: int | None = None,
                tokenizer: Tokenizer | None = None, adaptive: bool = True,
                cost_table: Path | None = None) -> EngineCore:
    """A reference engine on a target/draft pair, fp32 on CPU; target-only without speculation
    (`speculation_max_batch`: speculation.max_batch_size; `adaptive`, `cost_table`: the
    adaptive verify budget's, speculation.adaptive and .cost_table). With the pair's
    `tokenizer` it constrains output and stops where the server's engine does (EOS and
    <|end_of_msg|>), so a grammar's end admits the end of the message, not only EOS."""
    cfg = ReferenceEngineConfig(kv_capacity_tokens=kv_capacity_tokens,
                                speculation=SpeculationConfig(
                                    enabled=speculative, max_batch_size=speculation_max_batch,
                                    adaptive=adaptive,
                                    cost_table=str(cost_table) if cost_table else None))
    return build_engine(build_runner(target, draft if speculative else None, cfg), cfg,
                        eos_token_ids=stop_token_ids(tokenizer) if tokenizer else None,
                        tokenizer=tokenizer)


def measure_acceptance(target: Path, draft: Path, prompts: list[list[int]],
                       max_tokens: int = 64, temperature: float = 0.0,
                       seed: int = 0) -> dict[str, Any]:
    """Decode each prompt alone (batch 1) with speculation; SGLang's acceptance statistics:
    the per-request spec_accept_length macro-averaged over prompts, and token-weighted.
    Greedy runs also decode target-only and report whether the outputs are identical."""
    spec = pair_engine(target, draft, True)
    outs = [spec.generate([p], SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                              ignore_eos=True, seed=seed + i))[0]
            for i, p in enumerate(prompts)]
    stats = spec.stats()
    result: dict[str, Any] = {
        "prompts": len(prompts), "max_tokens": max_tokens, "temperature": temperature,
        "spec_accept_length_macro": statistics.fmean(o.spec["spec_accept_length"] for o in outs),
        "spec_accept_length_token_weighted": stats["spec_accept_length"],
        "spec_accept_rate": stats["spec_accept_rate"],
        "spec_correct_drafts_histogram": stats["spec_correct_drafts_histogram"],
        "per_prompt_accept_length": [round(o.spec["spec_accept_length"], 3) for o in outs],
    }
    if temperature == 0:
        base = pair_engine(target, draft, False)
        ref = [base.generate([p], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                 ignore_eos=True))[0].token_ids for p in prompts]
        result["identical_to_target_only"] = ref == [o.token_ids for o in outs]
    return result


def well_formed(tokenizer: Tokenizer, plan: ChatPlan, ids: Sequence[int]) -> bool:
    """An answer in K3's format that the output parser reads in full and that the renderer
    would write back unchanged: it ends the message (<|end_of_msg|>), and re-rendering the
    reasoning, content and tool calls the parser read gives the same text, control tokens
    included (so no stray tag, channel or call was dropped on the way)."""
    assert plan.k3 is not None
    end = tokenizer.special_ids[END_OF_MSG]
    if not ids or ids[-1] != end:
        return False
    output = chat_format_for(tokenizer).output(plan)
    output.parser.feed(ids)
    output.parser.finish()
    p = output.parser
    if any(not c.complete for c in p.tool_calls):
        return False
    try:
        calls = tuple(HistoryCall(c.name, arguments=json.loads(c.arguments))
                      for c in p.tool_calls)
    except ValueError:
        return False
    if any(not isinstance(c.arguments, dict) for c in calls):
        return False
    answer = Message("assistant", (p.content,), reasoning=p.reasoning, tool_calls=calls)
    rendered = encode_segments(tokenizer, assistant_completion(answer, plan.k3.thinking))
    return tokenizer.decode(rendered, skip_special_tokens=False) == tokenizer.decode(
        list(ids), skip_special_tokens=False)


def valid_call(plan: ChatPlan, arguments: str, name: str) -> bool:
    """A call of a declared tool whose arguments validate against its parameters schema."""
    import jsonschema

    assert plan.k3 is not None
    fn = plan.k3.declared.get(name)
    if fn is None:
        return False
    try:
        jsonschema.validate(json.loads(arguments), fn.get("parameters") or {"type": "object"})
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def measure_conversations(target: Path, draft: Path, tokenizer: Tokenizer,
                          conversations: list[dict[str, Any]], max_tokens: int = 384,
                          seed: int = 0, grammar: bool = False,
                          tool_strict_level: ToolStrictLevel = "off") -> dict[str, Any]:
    """The held-out conversations answered at K3's own sampling parameters (thinking: T 1.0,
    non-thinking: T 0.6; top_p 0.95), with speculation, one at a time: the share of
    well-formed answers (`well_formed`) and, for tool_choice required, of answers that call a
    declared tool with valid arguments; `grammar` constrains as a server at
    `tool_strict_level` would."""
    from serve_app.chat.parameters import K3_TEMPERATURE, K3_TOP_P
    from serve_app.protocol.openai import ChatCompletionRequest

    engine = pair_engine(target, draft, True, tokenizer=tokenizer)
    fmt = chat_format_for(tokenizer, tool_strict_level if grammar else "off")
    # Only the end of the message stops (EOS ignored), so a "stop" is an <|end_of_msg|>, which
    # the engine does not return: it is put back for the check.
    end = tokenizer.special_ids[END_OF_MSG]
    formed, required, required_ok, by_kind = 0, 0, 0, {}
    for i, c in enumerate(conversations):
        body = ChatCompletionRequest.model_validate({"model": "embedded", **c["request"]})
        plan = fmt.plan(body)
        assert plan.k3 is not None
        params = SamplingParams(temperature=K3_TEMPERATURE[plan.k3.thinking], top_p=K3_TOP_P,
                                max_tokens=max_tokens, seed=seed + i, stop_token_ids=(end,),
                                ignore_eos=True, grammar=plan.grammar if grammar else None)
        out = engine.generate([encode_segments(tokenizer, plan.segments)], params)[0]
        ids = out.token_ids + ([end] if out.finish_reason == "stop" else [])
        ok = well_formed(tokenizer, plan, ids)
        formed += ok
        kind = by_kind.setdefault(c["kind"], [0, 0])
        kind[0] += ok
        kind[1] += 1
        if c["request"].get("tool_choice") == "required":
            required += 1
            output = fmt.output(plan)
            output.parser.feed(ids)
            output.parser.finish()
            calls = output.parser.tool_calls
            required_ok += bool(calls) and all(valid_call(plan, t.arguments, t.name)
                                               for t in calls)
    stats = engine.stats()
    return {"conversations": len(conversations), "max_tokens": max_tokens, "grammar": grammar,
            "tool_strict_level": tool_strict_level if grammar else None,
            "well_formed": formed / max(1, len(conversations)),
            "well_formed_by_kind": {k: f"{a}/{n}" for k, (a, n) in by_kind.items()},
            "tool_required": required, "tool_required_valid": required_ok / max(1, required),
            "spec_accept_length_token_weighted": stats["spec_accept_length"]}
