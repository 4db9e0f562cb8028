"""The target model: a Kimi K2 / DeepseekV3-architecture decoder in plain PyTorch.

Parameter names are exactly Hugging Face DeepseekV3's, so a published checkpoint folder (BF16 or
FP8 block-quantized) loads without conversion (loading and saving: serve_app.models.kimi_weights).

Attention is MLA in the weight-absorbed form: the cache holds, per token and layer, only the
normalized compressed latent c (kv_lora_rank) and the rotated shared rope key k_pe. Each head's
no-rope query is mapped into latent space through kv_b_proj's K rows (q_nope @ W_uk), so
scores = (q_nope W_uk) . c + q_pe . k_pe, and the attention output (a mix of latents) goes back
through kv_b_proj's V rows. Per-head keys and values are never materialized.

Tensor parallelism (gpt-fast style: each rank builds modules of its own shard's shape):
  - attention heads split across ranks: q_b_proj / q_proj and kv_b_proj rows by head, o_proj
    columns by head; q_a / kv_a projections and their norms are replicated, so every rank
    computes (and caches) the same latents;
  - dense MLP and shared experts: gate/up split by rows, down by columns;
  - routed experts: rank r owns the CONTIGUOUS range [r * E/tp, (r+1) * E/tp) (the layout of
    SGLang's expert parallelism); the router is replicated and routing is computed identically
    on every rank, each rank adds only its own experts' contributions;
  - embeddings, final norm and lm_head replicated, so every rank returns the full logits;
  - one all-reduce after o_proj and one after each MLP/MoE block.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.models.kimi_config import KimiConfig, KimiConfigError
from serve_app.models.kv_cache import PagedAllocator, PagedBatch, PagedKVCache
from serve_app.models.layers import (
    GatedMLP,
    MLAProjections,
    RMSNorm,
    noaux_tc_topk,
    rope_inv_freq,
)
from serve_app.models.target import Collectives, TargetOutput, TPContext, last_new

__all__ = [
    "KimiConfig",
    "KimiConfigError",
    "KimiForCausalLM",
]

# --- rotary (DeepSeek: interleaved pairs) ------------------------------------------------------


class DeepseekRotary(nn.Module):
    """cos/sin of shape [..., rope_dim/2] for absolute positions, YaRN-scaled like SGLang's
    DeepseekScalingRotaryEmbedding (inverse frequencies from `layers.rope_inv_freq`)."""

    def __init__(self, config: KimiConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: it must stay fp32 (model.to(bf16) would round it) and
        # real even when the modules are built on the meta device.
        with torch.device("cpu"):
            self.inv_freq, _ = rope_inv_freq(config.qk_rope_head_dim, config.rope_parameters)
        self.attention_factor = config.rope_attention_factor

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by frequency i (SGLang is_neox_style=False, DeepSeek's
    default). HF DeepseekV3 de-interleaves first and returns a permuted layout; attention scores
    are the same because q_pe and k_pe receive the same permutation."""
    x32 = x.float()
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


# --- attention -------------------------------------------------------------------------------


@dataclass
class AttentionBatch(PagedBatch):
    """PagedBatch plus the new tokens' rotary tables, computed once per forward."""

    cos: torch.Tensor  # [B, T, rope/2]
    sin: torch.Tensor


class KimiAttention(MLAProjections):
    def __init__(self, config: KimiConfig, tp: TPContext) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads // tp.size,
                         config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim,
                         config.qk_rope_head_dim, config.v_head_dim, config.softmax_scale,
                         config.rms_norm_eps)
        self.tp = tp

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> cache entries [..., kv_lora_rank + rope]: normalized compressed
        KV and the rotated single-head rope key."""
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], -1)
        return torch.cat(
            [self.kv_a_layernorm(compressed), apply_rotary_interleaved(k_pe, cos, sin)], dim=-1
        )

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache_layer: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden]; cache_layer: this layer's [slots, latent_dim] pool (written in
        place for the valid new tokens)."""
        q_nope, q_pe = self.query(x).split([self.nope, self.rope], dim=-1)
        q_pe = apply_rotary_interleaved(q_pe, batch.cos[:, :, None], batch.sin[:, :, None])
        # Round new entries through the cache dtype so a token's key is bit-identical whether it
        # is attended in the pass that computed it or read back from the cache later.
        new = self.latent(x, batch.cos, batch.sin).to(cache_layer.dtype)
        cache_layer[batch.slots] = new[batch.valid]
        keys = torch.cat([cache_layer[batch.context_index], new], dim=1).to(x.dtype)
        out = self.attend(q_nope, q_pe, keys, batch.mask)
        return self.tp.all_reduce(self.o_proj(out))

# --- MLP and MoE -----------------------------------------------------------------------------


class MoEGate(nn.Module):
    """Router: `weight` [experts, hidden] and the noaux_tc `e_score_correction_bias` [experts]
    (fp32, as HF stores it: in bf16 its spread collapses and reorders top-k)."""

    def __init__(self, config: KimiConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.n_routed_experts, dtype=torch.float32)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> (weights [N, k] fp32, expert ids [N, k] int64). DeepseekV3 noaux_tc:
        the bias only steers the choice; weights are the unbiased scores of the chosen experts,
        renormalized if norm_topk_prob, times routed_scaling_factor."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        return noaux_tc_topk(scores, self.e_score_correction_bias, c.n_group, c.topk_group,
                             c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor)


class KimiMoE(nn.Module):
    def __init__(self, config: KimiConfig, tp: TPContext) -> None:
        super().__init__()
        per_rank = config.n_routed_experts // tp.size
        self.expert_range = range(tp.rank * per_rank, (tp.rank + 1) * per_rank)
        self.gate = MoEGate(config)
        # Keyed by the GLOBAL expert id so state-dict names match the checkpoint's on every rank.
        self.experts = nn.ModuleDict(
            {str(e): GatedMLP(config.hidden_size, config.moe_intermediate_size)
             for e in self.expert_range}
        )
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.shared_intermediate_size // tp.size)
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] -> this rank's partial sum [N, hidden] (the caller all-reduces)."""
        weights, ids = self.gate(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.gate.weight.shape[0]).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n and e in self.expert_range:
                rows = token_of[start : start + n]
                y = self.experts[str(e)](x[rows]).float() * weight_of[start : start + n, None]
                out.index_add_(0, rows, y)
            start += n
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return out.to(x.dtype)


# --- decoder ---------------------------------------------------------------------------------


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: KimiConfig, layer: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.self_attn = KimiAttention(config, tp)
        self.mlp: GatedMLP | KimiMoE = (
            KimiMoE(config, tp)
            if config.is_moe_layer(layer)
            else GatedMLP(config.hidden_size, config.intermediate_size // tp.size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache_layer: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cache_layer)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, KimiMoE):
            # Route only real tokens: padding must not cost expert compute.
            mlp_out = torch.zeros_like(h)
            mlp_out[batch.valid] = self.mlp(h[batch.valid])
        else:
            mlp_out = self.mlp(h)
        return x + self.tp.all_reduce(mlp_out)


class KimiModel(nn.Module):
    def __init__(self, config: KimiConfig, tp: TPContext) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            KimiDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class KimiForCausalLM(nn.Module):
    def __init__(
        self,
        config: KimiConfig,
        tp_rank: int = 0,
        tp_size: int = 1,
        group: Collectives | None = None,
    ) -> None:
        super().__init__()
        config.validate_tp(tp_size)
        if not 0 <= tp_rank < tp_size:
            raise KimiConfigError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
        self.config = config
        self.tp = TPContext(tp_rank, tp_size, group)
        self.model = KimiModel(config, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = DeepseekRotary(config)

    @property
    def embed_weight(self) -> torch.Tensor:
        """The embedding the DSpark draft shares (as `lm_head_weight`)."""
        return self.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    # --- cache -------------------------------------------------------------------------------

    def new_cache(
        self, capacity_tokens: int, page_size: int = 16, allocator: PagedAllocator | None = None
    ) -> PagedKVCache:
        """A latent cache: per layer and token, kv_lora_rank + qk_rope_head_dim elements
        (replicated on every TP rank, like SGLang's MLA cache)."""
        w = self.model.embed_tokens.weight
        return PagedKVCache(
            self.config.num_hidden_layers,
            {"latent": (self.config.latent_dim,)},
            capacity_tokens,
            page_size,
            dtype=w.dtype,
            device=w.device,
            allocator=allocator,
        )

    # --- forward -----------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: PagedKVCache,
        rids: Sequence[Hashable],
        num_new: torch.Tensor,
        capture_layers: Sequence[int] = (),
        verify: bool = False,
        last_only: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Append num_new[b] tokens (row b of input_ids, right-padded) to each request at
        positions cache.length(rids[b]) + arange(num_new[b]); attend causally over the cached
        tokens and the new ones; cache the new tokens' latents. A verify window (`verify`)
        needs nothing more here: the latent cache rolls back by truncation."""
        b, t = input_ids.shape
        counts = [int(n) for n in torch.as_tensor(num_new).tolist()]
        layers = list(capture_layers)
        problems = []
        if len(rids) != b or len(counts) != b:
            problems.append(f"{len(rids)} rids and {len(counts)} num_new for {b} rows")
        if any(not 0 <= n <= t for n in counts):
            problems.append(f"num_new {counts} must be in [0, T={t}]")
        bad = [i for i in layers if not 0 <= i < self.config.num_hidden_layers]
        if bad:
            problems.append(f"capture_layers {bad} outside [0, {self.config.num_hidden_layers})")
        if problems:
            raise ValueError("; ".join(problems))

        dev = self.model.embed_tokens.weight.device
        starts = [cache.length(r) for r in rids]
        # Reserve first: a KVCapacityError leaves the cache untouched and costs no compute.
        slots = cache.reserve_append(rids, counts).to(dev)
        batch = self._attention_batch(cache, rids, starts, counts, slots, t)

        ids = torch.where(batch.valid, input_ids.to(dev), 0)
        x = self.model.embed_tokens(ids) if inputs_embeds is None else inputs_embeds.to(dev)
        pool = cache.buffers["latent"]
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, batch, pool[i])
            if i in layers:
                captured[i] = x
        taps = torch.cat([captured[i] for i in layers], dim=-1) if layers else None
        if last_only:
            x = last_new(x, num_new)
        logits = self.lm_head(self.model.norm(x)).float()
        return TargetOutput(logits=logits, taps=taps)

    def _attention_batch(
        self,
        cache: PagedKVCache,
        rids: Sequence[Hashable],
        starts: list[int],
        counts: list[int],
        slots: torch.Tensor,
        t: int,
    ) -> AttentionBatch:
        dev = slots.device
        steps = torch.arange(t, device=dev)
        start = torch.tensor(starts, dtype=torch.long, device=dev)
        cos, sin = self.rotary(start[:, None] + steps[None, :])
        heads = self.model.layers[0].self_attn.num_heads
        paged = cache.batch(rids, starts, counts, slots, t, heads)
        return AttentionBatch(**vars(paged), cos=cos, sin=sin)
