"""The DSpark draft model in plain PyTorch, compatible with RadixArk/Kimi-K3-DSpark.

Context: the outputs of the target layers in `target_layer_ids` are concatenated, projected by
`fc` and normalised by `hidden_norm`. Those rows are only ever keys/values: each draft layer
applies its own k_proj/v_proj (+ k_norm, + RoPE) to them and caches the result.

One draft step: query rows `[anchor, MASK x (gamma-1)]` at positions p..p+gamma-1 run through
N Qwen3-style layers that attend, non-causally, to [cached context ; block]. Row k predicts the
token at p+k+1. A Markov head corrects each row's logits with the previous token
(left to right), and a confidence head estimates the chance each draft is accepted.

The target's embedding and lm_head are passed in; the draft never owns them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.models.checkpoint import (
    TORCH_DTYPES,
    TensorSpec,
    expected_from_module,
    load_tensors,
    save_tensors,
    uninitialised,
)
from serve_app.models.draw import draw_rows
from serve_app.models.dspark_config import DSparkConfig
from serve_app.models.kv_cache import PagedKVCache
from serve_app.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary


class DSparkAttention(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [..., T, hidden] -> k, v: [..., T, kv_heads, head_dim] (k normed and rotated)."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape))
        k = apply_rotary(k, cos.unsqueeze(-2), sin.unsqueeze(-2))
        return k, self.v_proj(x).view(shape)

    def _heads(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block rows x [B, T, hidden] -> q [B, T, heads, d] (normed, rotated) and k, v
        [B, kv_heads, L + T, d]: the context's entries followed by the block's own."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))
        q = apply_rotary(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        k_block, v_block = self.key_value(x, cos, sin)
        k = torch.cat([context_k, k_block], dim=1).transpose(1, 2)
        v = torch.cat([context_v, v_block], dim=1).transpose(1, 2)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        context_valid: torch.Tensor,
    ) -> torch.Tensor:
        """x: [B, G, hidden] block rows; context_k/v: [B, L, kv_heads, head_dim];
        context_valid: [B, L] (requests have different context lengths)."""
        b, g, _ = x.shape
        q, k, v = self._heads(x, cos, sin, context_k, context_v)
        valid = torch.cat([context_valid, context_valid.new_ones(b, g)], dim=1)
        # Non-causal: every block row sees every valid context entry and the whole block.
        mask = valid[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, g, -1))

    def forward_masked(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Training: x [B, Q, hidden] holds many blocks at once; mask [B, 1, Q, L + Q] says
        which context and block keys each query row sees. Differentiable."""
        b, n, _ = x.shape
        q, k, v = self._heads(x, cos, sin, context_k, context_v)
        groups = self.num_heads // self.num_kv_heads
        # Repeated, not enable_gqa: the CPU backward of a GQA-broadcast SDPA is not guaranteed.
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DSparkLayer(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        context_valid: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(
            self.input_layernorm(x), cos, sin, context_k, context_v, context_valid
        )
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Low-rank bigram correction: logits += W2 @ W1[previous token]."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logit correction [..., vocab], previous-token features [..., rank])."""
        feats = self.markov_w1(prev_tokens)
        return self.markov_w2(feats), feats


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(features).float()).squeeze(-1)


# Constrained decoding's per-position mask: (block position, previous tokens [B]) -> allowed
# tokens [B, V], or None when no row is constrained (serve_app/grammar/matchers.py DraftMasks).
DraftMask = Callable[[int, torch.Tensor], torch.Tensor | None]


@dataclass
class DraftOutput:
    """One draft step for a batch of B requests, gamma drafts each."""

    tokens: torch.Tensor  # [B, gamma] int64
    # [B, gamma, vocab] draft distributions q for rejection sampling; rows of greedy requests
    # (temperature 0) are one-hot. None when every request in the batch is greedy.
    probs: torch.Tensor | None
    confidence: torch.Tensor | None  # [B, gamma] in (0, 1): P(draft k accepted | k-1 accepted)
    logits: torch.Tensor  # [B, gamma, vocab] Markov-corrected logits, before temperature


class DSparkDraft(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.config = config
        taps = len(config.target_layer_ids)
        self.fc = nn.Linear(taps * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.markov_head = (
            MarkovHead(config.vocab_size, config.markov_rank) if config.has_markov else None
        )
        if config.enable_confidence_head:
            extra = config.markov_rank if config.has_markov and config.confidence_head_with_markov else 0
            self.confidence_head: ConfidenceHead | None = ConfidenceHead(
                config.hidden_size + extra
            )
        else:
            self.confidence_head = None
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_parameters)

    # --- cache -------------------------------------------------------------------------------

    def new_cache(
        self, capacity_tokens: int, page_size: int = 16, **kwargs: object
    ) -> PagedKVCache:
        p = next(self.parameters())
        # Local KV heads: fewer than the config's once the draft is tensor-parallel sharded.
        entry = (self.layers[0].self_attn.num_kv_heads, self.config.head_dim)
        return PagedKVCache(
            self.config.num_hidden_layers,
            {"k": entry, "v": entry},
            capacity_tokens,
            page_size,
            dtype=p.dtype,
            device=p.device,
            **kwargs,  # type: ignore[arg-type]
        )

    def project_context(self, taps: torch.Tensor) -> torch.Tensor:
        """[N, taps * target_hidden] concatenated target layer outputs -> [N, hidden]."""
        return self.hidden_norm(self.fc(taps))

    @torch.no_grad()
    def append_context(
        self, cache: PagedKVCache, rids: Sequence[Hashable], taps: Sequence[torch.Tensor]
    ) -> None:
        """Commit target rows: taps[i] is [n_i, taps * target_hidden] for the next n_i positions
        of request rids[i]. All requests are projected in one batch."""
        counts = [t.shape[0] for t in taps]
        if not sum(counts):
            return
        positions = torch.cat(
            [torch.arange(cache.length(r), cache.length(r) + n) for r, n in zip(rids, counts, strict=True)]
        )
        slots = cache.reserve_append(rids, counts)
        dev = cache.device
        rows = self.project_context(torch.cat(list(taps)).to(dev, self.fc.weight.dtype))
        cos, sin = self.rotary(positions.to(dev))
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(rows, cos, sin)
            cache.buffers["k"][i, slots] = k.to(cache.buffers["k"].dtype)
            cache.buffers["v"][i, slots] = v.to(cache.buffers["v"].dtype)

    # --- drafting ----------------------------------------------------------------------------

    def block_hidden(
        self,
        cache: PagedKVCache,
        rids: Sequence[Hashable],
        anchors: torch.Tensor,
        embed_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """Final-normed hidden states of the gamma block rows: [B, gamma, hidden]."""
        gamma = self.config.block_size
        b = len(rids)
        dev = embed_tokens.device
        block_ids = torch.full((b, gamma), self.config.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = anchors.to(dev)
        x = F.embedding(block_ids, embed_tokens).to(self.fc.weight.dtype)
        index, valid = cache.context(rids)
        starts = torch.tensor([cache.length(r) for r in rids], device=dev)
        positions = starts[:, None] + torch.arange(gamma, device=dev)[None, :]
        cos, sin = self.rotary(positions)
        for i, layer in enumerate(self.layers):
            k, v = cache.buffers["k"][i][index], cache.buffers["v"][i][index]
            x = layer(x, cos, sin, k, v, valid)
        return self.norm(x)

    @torch.no_grad()
    def draft(
        self,
        cache: PagedKVCache,
        rids: Sequence[Hashable],
        anchors: torch.Tensor,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        temperature: torch.Tensor | float = 0.0,
        generators: Sequence[torch.Generator | None] | torch.Generator | None = None,
        masks: DraftMask | None = None,
    ) -> DraftOutput:
        """Propose gamma tokens per request after its anchor (the last verified token, whose
        context entry is not yet cached). `temperature` is per request ([B]) or shared; 0 means
        greedy. `generators`: one per request (or one shared). Sampled drafts come with their
        distributions q for rejection sampling. `masks`: see decode_heads."""
        h = self.block_hidden(cache, rids, anchors, embed_tokens)
        base_logits = (h @ lm_head.to(h.dtype).T).float()
        return self.decode_heads(h, base_logits, anchors, temperature, generators, masks)

    def decode_heads(
        self,
        h: torch.Tensor,
        base_logits: torch.Tensor,
        anchors: torch.Tensor,
        temperature: torch.Tensor | float = 0.0,
        generators: Sequence[torch.Generator | None] | torch.Generator | None = None,
        masks: DraftMask | None = None,
    ) -> DraftOutput:
        """Apply the Markov head left to right, choose drafts, and score confidence. `masks`
        (constrained decoding): called at each block position with the previous tokens, it
        returns the tokens that position may take [B, V] (or None: all); the draft chooses
        among them and its q is the masked distribution, so a grammar's block keeps its
        acceptance."""
        b, gamma, _ = base_logits.shape
        dev = base_logits.device
        temp = torch.as_tensor(temperature, dtype=torch.float32, device=dev).expand(b)
        sampled = temp > 0
        if generators is None or isinstance(generators, torch.Generator):
            generators = [generators] * b
        sampled_rows = sampled.nonzero().flatten().tolist()
        # Index tensors made once per block, and no one-hot rows when every request samples:
        # a sampled block then costs what a greedy one does, plus one softmax and one draw a
        # position.
        every_row = len(sampled_rows) == b
        rows = torch.tensor(sampled_rows, dtype=torch.long, device=dev)
        inv_temp = (1.0 / temp[rows])[:, None] if sampled_rows else None
        row_generators = [generators[r] for r in sampled_rows]
        prev = anchors.to(dev).long()
        tokens, logits_out, probs_out, feats_out = [], [], [], []
        for k in range(gamma):
            logits = base_logits[:, k]
            feats = None
            if self.markov_head is not None:
                correction, feats = self.markov_head(prev)
                logits = logits + correction.float()
            allowed = masks(k, prev) if masks is not None else None
            if allowed is not None:
                logits = logits.masked_fill(~allowed.to(dev), float("-inf"))
            # q is only needed when some request samples: greedy verification ignores it.
            if every_row:
                probs = torch.softmax(logits * inv_temp, dim=-1)
                tok = draw_rows(probs, row_generators)
                probs_out.append(probs)
            elif sampled_rows:
                tok = logits.argmax(-1)
                q = torch.softmax(logits.index_select(0, rows) * inv_temp, dim=-1)
                probs = F.one_hot(tok, logits.shape[-1]).float().index_copy_(0, rows, q)
                tok = tok.index_copy(0, rows, draw_rows(q, row_generators))
                probs_out.append(probs)
            else:
                tok = logits.argmax(-1)
            tokens.append(tok)
            logits_out.append(logits)
            feats_out.append(feats)
            prev = tok
        confidence = None
        if self.confidence_head is not None:
            parts = [h]
            if self.markov_head is not None and self.config.confidence_head_with_markov:
                parts.append(torch.stack(feats_out, dim=1).to(h.dtype))  # type: ignore[arg-type]
            confidence = self.confidence_head(torch.cat(parts, dim=-1))
        return DraftOutput(
            tokens=torch.stack(tokens, dim=1),
            probs=torch.stack(probs_out, dim=1) if probs_out else None,
            confidence=confidence,
            logits=torch.stack(logits_out, dim=1),
        )

    def forward_train(
        self,
        taps: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
    ) -> TrainBlocks:
        """Differentiable draft forward for training, many anchors per sequence at once.

        taps: [B, T, taps * target_hidden] the target's tap outputs for every token of the
        sequences; input_ids: [B, T]; anchors: [B, A] positions p (the anchor token is
        input_ids[b, p]; its block rows sit at positions p..p+gamma-1 and row k predicts the token
        at p+k+1). The Markov head is teacher-forced with the sequence's tokens
        (prev_k = input_ids[p + k]). Anchors need p + gamma <= T - 1 only where labels are read.

        Equal, anchor by anchor, to `draft()` on a cache holding the first p context rows.
        """
        gamma = self.config.block_size
        b, t = input_ids.shape
        a = anchors.shape[1]
        dev = input_ids.device
        ctx = self.project_context(taps.to(self.fc.weight.dtype))  # [B, T, hidden]
        cos_c, sin_c = self.rotary(torch.arange(t, device=dev))
        positions = (anchors[:, :, None] + torch.arange(gamma, device=dev)).reshape(b, a * gamma)
        block_ids = torch.full((b, a, gamma), self.config.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        x = F.embedding(block_ids.view(b, a * gamma), embed_tokens).to(self.fc.weight.dtype)
        cos_b, sin_b = self.rotary(positions)
        mask = block_attention_mask(anchors, t, gamma)
        for layer in self.layers:
            k, v = layer.self_attn.key_value(ctx, cos_c, sin_c)
            x = x + layer.self_attn.forward_masked(layer.input_layernorm(x), cos_b, sin_b, k, v, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.norm(x).view(b, a, gamma, -1)
        logits = (h @ lm_head.to(h.dtype).T).float()
        prev = input_ids.gather(1, positions.clamp(max=t - 1)).view(b, a, gamma)
        feats = None
        if self.markov_head is not None:
            correction, feats = self.markov_head(prev)
            logits = logits + correction.float()
        confidence = None
        if self.confidence_head is not None:
            parts = [h]
            if feats is not None and self.config.confidence_head_with_markov:
                parts.append(feats.to(h.dtype))
            confidence = self.confidence_head(torch.cat(parts, dim=-1))
        return TrainBlocks(hidden=h, logits=logits, confidence=confidence)


@dataclass
class TrainBlocks:
    """A training forward over many blocks (one per anchor) of B sequences."""

    hidden: torch.Tensor  # [B, A, gamma, hidden] final-normed block rows
    logits: torch.Tensor  # [B, A, gamma, vocab] Markov-corrected (teacher-forced) logits
    confidence: torch.Tensor | None  # [B, A, gamma]


def block_attention_mask(anchors: torch.Tensor, context_len: int, gamma: int) -> torch.Tensor:
    """[B, 1, A*gamma, context_len + A*gamma]: block rows of the anchor at position p see the
    context entries at positions < p (what the inference cache holds when that anchor is drafted)
    and the gamma rows of their own block, non-causally."""
    b, a = anchors.shape
    dev = anchors.device
    ctx = torch.arange(context_len, device=dev)[None, None, :] < anchors[:, :, None]  # [B, A, L]
    ctx = ctx.repeat_interleave(gamma, dim=1)  # [B, A*g, L]
    owner = torch.arange(a, device=dev).repeat_interleave(gamma)
    same = (owner[:, None] == owner[None, :]).expand(b, -1, -1)  # [B, A*g, A*g]
    return torch.cat([ctx, same], dim=-1)[:, None]


def survival_draft_count(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """How many drafts per request are worth verifying: the longest prefix whose cumulative
    acceptance probability stays >= threshold (at least 1). threshold 0 keeps all of them."""
    if threshold <= 0:
        return torch.full(confidence.shape[:1], confidence.shape[1], dtype=torch.long)
    survival = torch.cumprod(confidence.float(), dim=1)
    return (survival >= threshold).long().cumprod(dim=1).sum(dim=1).clamp(min=1)


# --- checkpoints ----------------------------------------------------------------------------

def expected_tensors(config: DSparkConfig) -> dict[str, TensorSpec]:
    """Names and shapes of a DSpark checkpoint, derived from the module on the meta device."""
    with uninitialised():
        return expected_from_module(DSparkDraft(config))


def load_dspark(
    path: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> DSparkDraft:
    """Load a DSpark checkpoint folder strictly and memory-mapped (dtype defaults to the
    config's)."""
    config = DSparkConfig.from_file(path)
    dtype = dtype or TORCH_DTYPES[config.dtype]
    with uninitialised():
        model = DSparkDraft(config)
    state = load_tensors(path, expected_from_module(model), dtype=dtype, device=device)
    model.load_state_dict(state, assign=True)
    # Non-persistent buffers were built on the CPU; rebuild them on `device`.
    model.rotary = RotaryEmbedding(config.head_dim, config.rope_parameters).to(device)
    return model.eval()


def save_dspark(
    model: DSparkDraft, path: str | os.PathLike[str], max_shard_bytes: int | None = None
) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    save_tensors(path, model.state_dict(), max_shard_bytes=max_shard_bytes)
