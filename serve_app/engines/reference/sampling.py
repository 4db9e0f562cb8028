"""Sampling parameters, the target distribution p, and lossless verification of drafts.

Verification follows dspark.md / SGLang: greedy requests accept the longest prefix of drafts
that equal the target's argmax and add the target's token at the first mismatch (the bonus);
sampled requests use chain rejection sampling, which leaves the output distributed exactly as
the target's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from serve_app.engines.types import SamplingParams

__all__ = ["SamplingParams", "Verdict", "residual_distribution", "sample_token",
           "target_probs", "verify_drafts"]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p over the vocabulary for rows of one request: temperature, then top-k, then top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> int:
    """One token from one row of logits."""
    if params.greedy:
        return int(logits.argmax())
    probs = target_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class Verdict:
    """The outcome of verifying one request's drafts: tokens to commit (accepted drafts + the
    bonus/correction token) and how many drafts were accepted."""

    tokens: list[int]
    accepted: int = field(default=0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The rejection rule's correction distribution: normalize(max(p - q, 0))."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    # p == q exactly (possible for one-hot q at a one-hot p): any draw from p is right.
    return residual / total if total > 0 else p


ResidualRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def verify_drafts(
    target_logits: torch.Tensor,
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    residual_rule: ResidualRule = residual_distribution,
) -> Verdict:
    """target_logits: [k+1, V] rows for [anchor, d_1..d_k]; row j scores the token after the
    j-th input. drafts: the k proposed tokens; draft_probs: [k, V] the draft distributions they
    were drawn from (None: one-hot, i.e. deterministic proposals)."""
    k = len(drafts)
    if params.greedy:
        target = target_logits.argmax(-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == target[accepted]:
            accepted += 1
        return Verdict([*list(drafts[:accepted]), target[accepted]], accepted)
    p = target_probs(target_logits, params)
    for j in range(k):
        d = int(drafts[j])
        q_row = (draft_probs[j].float() if draft_probs is not None
                 else torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).float())
        q_d, p_d = float(q_row[d]), float(p[j, d])
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u * q_d < p_d:
            continue
        correction = int(torch.multinomial(residual_rule(p[j], q_row), 1, generator=generator))
        return Verdict([int(t) for t in drafts[:j]] + [correction], j)
    bonus = int(torch.multinomial(p[k], 1, generator=generator))
    return Verdict([int(t) for t in drafts] + [bonus], k)
