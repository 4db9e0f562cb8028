"""Building blocks shared by the target and the draft: RMSNorm, rotary embeddings (with YaRN).

Plain PyTorch, no fused kernels: the reference engine favours readability; the production path
is SGLang.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much precision at hidden 7168.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def column_major_linears(model: nn.Module) -> nn.Module:
    """For inference on CPU: every nn.Linear's weight [out, in] kept with the same values and
    shape but stored column-major (the transpose of a contiguous [in, out] copy), so F.linear's
    x @ Wᵀ reads a contiguous matrix. CPU GEMMs of a few rows run much faster that way alone
    (one thread: 8 x 192 by a 4096-row LM head 426 -> 141 µs, 32 x 1536 by 128 rows 390 ->
    106 µs), a verify window's and a decode batch's shapes; in the embedded pair's engine an
    8-token verify forward took 0.96x, a decode step of 16 requests 0.95x, of one 1.01x. Not
    for training (an optimizer step would keep the layout, but safetensors saves contiguous
    tensors only). Returns `model`."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()
    return model


# SGLang's `_RENORMALIZE_SUM_EPSILON` (`srt/layers/moe/topk.py`): keeps an all-zero top-k finite.
RENORMALIZE_EPS = 1e-20


def noaux_tc_topk(scores: torch.Tensor, bias: torch.Tensor, groups: int, topk_group: int,
                  k: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc expert choice, as SGLang's biased_grouped_topk computes it (fp32).
    scores: [N, E] router scores; bias: [E] e_score_correction_bias, which steers only the
    choice. Each of `groups` expert groups is scored by the sum of its top-2 biased scores, the
    best `topk_group` groups are kept, the top `k` experts are chosen among them; the weights are
    their unbiased scores, renormalized if asked, times `scaling`.
    Returns (weights [N, k] fp32, expert ids [N, k] int64)."""
    n, e = scores.shape
    choice = scores + bias.float()
    if groups > 1:  # with one group the masking below keeps everything
        grouped = choice.view(n, groups, e // groups)
        group_scores = grouped.topk(min(2, e // groups), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORMALIZE_EPS)
    return weights * scaling, ids


class MLAProjections(nn.Module):
    """The low-rank MLA projections K2/DeepSeek-V3 and K3 share, under SGLang's names: the query
    (q_a_proj -> q_a_layernorm -> q_b_proj, or q_proj when q_lora_rank is None),
    kv_a_proj_with_mqa -> [latent | k_pe] with kv_a_layernorm on the latent, kv_b_proj per
    head, o_proj. `heads` are this rank's."""

    def __init__(self, hidden: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 nope: int, rope: int, v_dim: int, softmax_scale: float, eps: float) -> None:
        super().__init__()
        self.num_heads, self.nope, self.rope, self.v_dim = heads, nope, rope, v_dim
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.softmax_scale = softmax_scale
        q_out = heads * (nope + rope)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + rope, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, hidden, bias=False)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] -> q: [B, T, heads, nope + rope] (the rope part not rotated)."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:-1], self.num_heads, self.nope + self.rope)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_uk [heads, nope, lora] and W_uv [heads, v, lora]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, keys: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Absorbed MLA attention of T queries over L cache entries. q_nope [B, T, n, dn] and
        q_pe [B, T, n, dr] (rotated where the model rotates), keys [B, L, lora + dr] (the
        entries, the new tokens' included), mask broadcastable to [B, 1, n·T, L] (True: the key
        is visible; row h·T + i is head h's query i) -> [B, T, n·dv] before o_proj.

        q_nope · k_nope = (q_nope W_uk) · c, so scores are taken against the cached entry
        itself, and the output, a mix of latents, goes back through W_uv. One shared latent
        "head" (MQA): the heads are folded into the query rows, as FlashMLA does, so the keys
        are read once per request instead of once per head (on CPU an 8-row verify's attention
        ran 6.5x faster than SDPA's GQA broadcast)."""
        b, t = q_nope.shape[:2]
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("bthn,hnl->bhtl", q_nope, w_uk)
        q_full = torch.cat([q_latent, q_pe.transpose(1, 2)], dim=-1)  # [B, n, T, lora + dr]
        out_latent = F.scaled_dot_product_attention(
            q_full.reshape(b, 1, self.num_heads * t, -1),
            keys[:, None],
            keys[:, None, :, : self.kv_lora_rank],
            attn_mask=mask,
            scale=self.softmax_scale,
        ).view(b, self.num_heads, t, self.kv_lora_rank)
        return torch.einsum("bhtl,hvl->bthv", out_latent, w_uv).reshape(b, t, -1)


class GatedMLP(nn.Module):
    """SiLU-gated MLP (Qwen3 / DeepseekV3 naming). Under tensor parallelism `intermediate` is
    this rank's share and the caller all-reduces the output."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(
    head_dim: int, rope_parameters: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale ("attention factor") for a rope config.

    Follows the Hugging Face `rope_type` conventions (default, linear, yarn) that both SGLang and
    transformers implement for Qwen3 and DeepseekV3.
    """
    base = float(rope_parameters.get("rope_theta", 10000.0))
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    pos_freqs = base**exponents
    if rope_type in ("default", None):
        return (1.0 / pos_freqs).float(), 1.0
    factor = float(rope_parameters["factor"])
    if rope_type == "linear":
        return (1.0 / (factor * pos_freqs)).float(), 1.0
    if rope_type != "yarn":
        raise ValueError(
            f"rope_parameters.rope_type={rope_type!r} is not supported; "
            "allowed: 'default', 'linear', 'yarn'"
        )
    original_max = int(rope_parameters["original_max_position_embeddings"])
    beta_fast = float(rope_parameters.get("beta_fast", 32.0))
    beta_slow = float(rope_parameters.get("beta_slow", 1.0))
    low = math.floor(_yarn_correction_dim(beta_fast, head_dim, base, original_max))
    high = math.ceil(_yarn_correction_dim(beta_slow, head_dim, base, original_max))
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    # SGLang ignores HF's `attention_factor` key; so do we, to produce the same numbers.
    if "mscale" in rope_parameters and "mscale_all_dim" in rope_parameters:
        attention_factor = _yarn_mscale(factor, rope_parameters["mscale"]) / _yarn_mscale(
            factor, rope_parameters["mscale_all_dim"]
        )
    else:
        attention_factor = _yarn_mscale(factor)
    return inv_freq.float(), attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary absolute positions (requests in a batch sit at different offsets)."""

    def __init__(self, head_dim: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(head_dim, rope_parameters)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style (rotate-half) rotation. x: [..., T, D]; cos/sin broadcastable to x."""
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)
