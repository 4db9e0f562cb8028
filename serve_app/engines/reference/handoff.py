"""A request moving from a prefill engine to a decode engine (prefill/decode disaggregation).

After its prompt is prefilled and its first token sampled, everything a request is on the
prefill engine fits in one `RequestHandoff`: its tokens and sampling parameters, the sampler's
generator state (a seeded request draws the same numbers on either side), and each tensor-
parallel rank's share of its caches (`ModelRunner.export`): the target's (for K3: the MLA
latents of every prompt token, and every KDA layer's conv window and recurrent state) and the
DSpark draft's context rows. The decode engine `adopt`s it and decodes exactly as if it had
prefilled the prompt itself; the grammar matcher, if any, is rebuilt there from the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve_app.engines.types import SamplingParams

# One rank's share: {"target": named tensors, "draft": named tensors (with a draft)}.
RankShare = dict[str, dict[str, torch.Tensor]]


@dataclass
class RequestHandoff:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # sampled on the prefill side; the last is the next step's anchor
    params: SamplingParams
    num_cached: int  # tokens in the shares' caches (the prompt)
    cached_tokens: int  # prompt tokens the prefill side's prefix cache supplied (usage)
    generator_state: torch.Tensor
    shares: list[RankShare]  # per tensor-parallel rank of the prefill engine, in rank order

    @property
    def nbytes(self) -> int:
        """What the hand-over moves (every rank's cache share)."""
        return sum(t.nbytes for share in self.shares for part in share.values()
                   for t in part.values())
