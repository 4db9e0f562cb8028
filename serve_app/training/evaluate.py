"""Measure a trained pair with the reference engine, the way the test and the benchmark do."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from serve_app.config import ReferenceEngineConfig, SpeculationConfig
from serve_app.engines.reference.builder import (
    build_engine,
    build_runner,
)
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.sampling import SamplingParams

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
                speculation_max_batch: int | None = None) -> EngineCore:
    """A reference engine on a target/draft pair, fp32 on CPU; target-only without speculation
    (`speculation_max_batch`: speculation.max_batch_size)."""
    cfg = ReferenceEngineConfig(kv_capacity_tokens=kv_capacity_tokens,
                                speculation=SpeculationConfig(
                                    enabled=speculative, max_batch_size=speculation_max_batch))
    return build_engine(build_runner(target, draft if speculative else None, cfg), cfg)


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
