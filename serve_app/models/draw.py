"""Drawing tokens from distributions: the one sampler of the draft's block and the target's
verify (models/dspark.py, engines/reference/sampling.py).

By inversion: a row's token is the first whose cumulative probability exceeds u·total, for one
uniform u from the request's generator. torch.multinomial draws one exponential per vocabulary
entry instead: 94 µs for a 4,096-token row on one CPU thread against ~10 µs here, seven times a
sampled draft block. The cumulative sums are float64, so the rounding of a 163,840-token
vocabulary's running sum stays near 1e-12 (float32's would reach ~1e-5 of its mass); a token of
probability 0 has an empty interval and is never drawn (grammar masks, top-p cuts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def draw_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [S, V] (non-negative, some mass; need not sum to 1), row i
    with generators[i] (None: torch's default generator) -> [S] int64."""
    cdf = probs.to(torch.float64).cumsum(-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64, device=probs.device)
                     for g in generators])
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    over = tokens >= probs.shape[-1]
    if bool(over.any()):
        # u·total rounded up to the total itself: the last token with mass.
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
        tokens = torch.where(over, last, tokens)
    return tokens


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from one distribution [V]."""
    return int(draw_rows(probs[None], [generator])[0])
