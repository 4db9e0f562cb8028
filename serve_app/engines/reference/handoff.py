"""A request moving from one engine to another: from a prefill engine to a decode engine
(prefill/decode disaggregation), or a running request leaving a replica that is scaled down or
restarted (a migration: `EngineCore.export` of a decoding request, docs/runbook.md
"Autoscaling").

After its prompt is prefilled and its first token sampled, or between any two decode steps,
everything a request is on its engine fits in one `RequestHandoff`: its tokens and sampling
parameters, the sampler's
generator state (a seeded request draws the same numbers on either side), and each tensor-
parallel rank's share of its caches (`ModelRunner.export`): the target's (for K3: the MLA
latents of every prompt token, and every KDA layer's conv window and recurrent state) and the
DSpark draft's context rows. The other engine `adopt`s it and decodes exactly as if it had
run the request from the start; the grammar matcher, if any, is rebuilt there from the tokens,
and what the client has already been sent (`reported_tokens`, `streamed_text`) is not sent
again.

An image prompt travels as it is (the pad runs in its ids) with its images' descriptors, whose
digests key the pad runs in the decode side's prefix cache as on the prefill side; their
pixels stay behind (`image_keys`): the features were needed only to prefill, and the caches
carry what the prompt's images did to every later position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from serve_app.engines.spec_stats import SpecStats
from serve_app.protocol.generation import SamplingParams
from serve_app.protocol.media import ImageInput

# One rank's share: {"target": named tensors, "draft": named tensors (with a draft)}.
RankShare = dict[str, dict[str, torch.Tensor]]


@dataclass
class RequestHandoff:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # sampled on the sending side; the last is the next step's anchor
    params: SamplingParams
    num_cached: int  # tokens in the shares' caches: prompt + outputs except the anchor
    cached_tokens: int  # prompt tokens the prefill side's prefix cache supplied (usage)
    generator_state: torch.Tensor
    shares: list[RankShare]  # per tensor-parallel rank of the prefill engine, in rank order
    images: tuple[ImageInput, ...] = ()  # the prompt's images, without pixels (`image_keys`)
    # A migrated request's stream so far: the outputs and text already sent to the client
    # (a prefill hand-over has sent nothing), its detokenized text, and its speculative
    # counts (its final usage covers both engines).
    reported_tokens: int = 0
    streamed_text: int = 0
    text: str = ""
    stats: SpecStats | None = None

    @property
    def nbytes(self) -> int:
        """What the hand-over moves (every rank's cache share)."""
        return sum(t.nbytes for share in self.shares for part in share.values()
                   for t in part.values())


def image_keys(images: Sequence[ImageInput]) -> list[ImageInput]:
    """The images as a decode side needs them: where each pad run is and its digest (the
    prefix cache's key), not its pixels."""
    return [replace(image, patches=None, png=b"") for image in images]


# How a request's cache entries are split across tensor-parallel ranks, by entry name, so a
# hand-over can move between different TP sizes (`reshard`):
# - "latent" (the MLA latent, K3's and K2's): every rank computes and keeps all of it;
# - "kda.{layer}.ssm" [heads/t, D, D]: each rank holds its contiguous heads;
# - "kda.{layer}.conv" [K−1, 3P/t]: each rank holds its heads' q, k and v channels, q|k|v;
# - the draft's "k" / "v" [layers, length, kv_heads/t, D]: its KV heads, when every rank has
#   its own (tensor_parallel.shard_dspark; with more ranks than KV heads they repeat, and
#   the layouts do not allow a different TP on the other side).
def _merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if name == "latent":
        return parts[0]
    if name.endswith(".ssm"):
        return torch.cat(parts, dim=0)
    if name.endswith(".conv"):
        q, k, v = zip(*(p.chunk(3, dim=-1) for p in parts), strict=True)
        return torch.cat([*q, *k, *v], dim=-1)
    if name in ("k", "v"):
        return torch.cat(parts, dim=2)
    raise ValueError(f"no tensor-parallel layout is known for cache entry {name!r}")


def _split(name: str, whole: torch.Tensor, tp: int) -> list[torch.Tensor]:
    if name == "latent":
        return [whole] * tp
    if name.endswith(".ssm"):
        return list(whole.chunk(tp, dim=0))
    if name.endswith(".conv"):
        q, k, v = (x.chunk(tp, dim=-1) for x in whole.chunk(3, dim=-1))
        return [torch.cat([q[r], k[r], v[r]], dim=-1) for r in range(tp)]
    if name in ("k", "v"):
        return list(whole.chunk(tp, dim=2))
    raise ValueError(f"no tensor-parallel layout is known for cache entry {name!r}")


def _split_size(name: str, whole: torch.Tensor) -> int:
    """How many ways an entry can be split (its heads)."""
    if name == "latent":
        return 0  # any
    if name.endswith(".ssm"):
        return whole.shape[0]
    if name.endswith(".conv"):
        return whole.shape[-1] // 3
    return whole.shape[2]


def reshard(shares: list[RankShare], tp: int, draft_kv_heads: int | None = None
            ) -> list[RankShare]:
    """The same request's cache shares for `tp` ranks instead of len(shares). `draft_kv_heads`:
    the draft's configured KV heads; a side with more ranks than that repeats them, which no
    other TP can be rebuilt from or into."""
    if tp == len(shares):
        return shares
    for n in (tp, len(shares)):
        if draft_kv_heads is not None and n > draft_kv_heads:
            raise ValueError(f"the draft's {draft_kv_heads} KV heads repeat over {n} ranks: "
                             "the hand-over cannot change its tensor-parallel size")
    out: list[RankShare] = [{part: {} for part in shares[0]} for _ in range(tp)]
    for part, entries in shares[0].items():
        for name in entries:
            whole = _merge(name, [s[part][name] for s in shares])
            size = _split_size(name, whole)
            if size and size % tp:
                raise ValueError(f"cache entry {part}.{name} has {size} heads, which "
                                 f"{tp} ranks cannot split evenly")
            for r, piece in enumerate(_split(name, whole, tp)):
                out[r][part][name] = piece.clone()
    return out
