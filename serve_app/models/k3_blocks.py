"""Kimi K3's FFN and MLA blocks in plain PyTorch: SiTU, the dense MLP / shared experts, the latent
MoE, and the NoPE MLA with its output gate.

One readable module for the math SGLang 0.5.23 computes (`srt/models/kimi_k3.py`,
`srt/layers/activation.py`, `srt/layers/moe/topk.py`):

    SiTU (GLU form, fp32; SGLang's `SituAndMul.forward_native`):
        act(gate, up) = β·tanh(gate/β)·σ(gate) · βₗ·tanh(up/βₗ)
    dense MLP / shared experts (K3MLP):
        out = down_proj( act(gate_proj x, up_proj x) )
    MoE (LatentMoE), x: [N, H]:
        s = σ(gate.weight · x) (fp32);  choice = s + e_score_correction_bias
        idx = grouped top-k of choice (noaux_tc);  w = s[idx] (no bias)
        w ← w / (Σw + 1e-20) if moe_renormalize;  w ← w · routed_scaling_factor
        ℓ = routed_expert_down_proj x;  y = Σ_k w_k · expert_{idx_k}(ℓ)
        y ← routed_expert_norm(y) if latent_moe_use_norm      (AFTER the weighted sum)
        out = routed_expert_up_proj y + shared_experts(x)     (shared on the ORIGINAL x)
    MLA (K3MLA), NoPE:
        q = q_b_proj(q_a_layernorm(q_a_proj x))  (or q_proj x)     [T, n, dn + dr]
        c, k_pe = split(kv_a_proj_with_mqa x);  c ← kv_a_layernorm(c)   k_pe: no norm, no rotary
        [k_nope | v] = kv_b_proj c;  k = [k_nope, k_pe]  (k_pe shared by all heads)
        o = softmax_causal(q·kᵀ · (dn + dr)^-1/2) · v
        o ← o ⊙ σ(g_proj x)   (mla_use_output_gate; x = the attention's own input)
        out = o_proj o

Parameter names are those of `k3_config.k3_layer_tensors` (SGLang's names after its loader's
renames), so one layer's `self_attn.` / `mlp.` state dict loads by name. SGLang's runtime
fusions (`gate_up_proj`, `fused_qkv_a_proj_with_mqa`) are never materialized here.

The MLA cache is the latent-only layout SGLang keeps: per token [c (kv_lora_rank), k_pe
(qk_rope_head_dim)] = `K3Config.mla_cache_dim` elements: a plain tensor [B, L, mla_cache_dim]
passed in and returned (`forward`, the dense path), or the engine's paged pool
(`forward_paged`, through k3_paged.py). Attention runs in the weight-absorbed form over
that cache, so per-head keys and values are never materialized.

Tensor parallelism (optional `tp: TPContext`, target.py's; default one rank = the plain model):
  - K3MLP (dense MLP, shared experts): gate/up split by rows, down by columns, output
    all-reduced inside the module;
  - LatentMoE: rank r owns the contiguous experts [r·E/tp, (r+1)·E/tp) (global names); the
    router and the latent down/norm/up projections are replicated; the routed partial sums are
    all-reduced BEFORE the latent norm (a norm of the sum, not a sum of norms);
  - K3MLA: heads split (q_b_proj / q_proj, kv_b_proj, g_proj rows by head; o_proj columns,
    output all-reduced); q_a / kv_a and their norms replicated, so the latent cache is the same
    on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.models.k3_config import K3Config
from serve_app.models.kv_cache import PagedBatch
from serve_app.models.layers import MLAProjections, RMSNorm, noaux_tc_topk
from serve_app.models.target import TPContext

__all__ = [
    "K3MLA",
    "K3MLP",
    "K3MoEGate",
    "K3RoutedExpert",
    "LatentMoE",
    "situ",
    "situ_gate",
    "softclip",
]


# --- SiTU --------------------------------------------------------------------------------------


def situ_gate(g: torch.Tensor, beta: float) -> torch.Tensor:
    """SiTU(g) = β·tanh(g/β)·σ(g), in fp32, returned in fp32. It is SiLU near 0 (tanh(g/β) ≈
    g/β) and saturates at β for large g: the bound is what distinguishes it from SiLU."""
    g = g.float()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)


def softclip(u: torch.Tensor, linear_beta: float | None) -> torch.Tensor:
    """βₗ·tanh(u/βₗ) in fp32: the up branch soft-clipped to ±βₗ. None = no clip (SGLang's
    `SituAndMul(linear_beta=None)`)."""
    u = u.float()
    return u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)


def situ(x: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """The GLU activation of every K3 FFN (SGLang's `SituAndMul`): x [..., 2I] = [gate | up]
    (gate = first half) -> SiTU(gate) · softclip(up) [..., I], computed in fp32 and returned in
    x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return (situ_gate(gate, beta) * softclip(up, linear_beta)).to(x.dtype)


def _activation(config: K3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`hidden_act` on separate gate/up halves: SiTU (with the config's two betas) or SiLU."""
    if config.hidden_act == "situ":
        # SGLang builds SituAndMul(beta=activation_situ_beta or 1.0, linear_beta=...); the config
        # reader already refuses "situ" without both betas.
        beta = config.activation_situ_beta or 1.0
        act = situ_gate(gate, beta) * softclip(up, config.activation_situ_linear_beta)
        return act.to(gate.dtype)
    return F.silu(gate) * up


# --- dense MLP / shared experts / routed expert ------------------------------------------------


class K3MLP(nn.Module):
    """The dense MLP (layers < first_k_dense_replace, width `intermediate_size`) and the shared
    experts (ONE MLP of width `shared_intermediate_size`, on the full hidden size).

    x: [..., H] -> [..., H]. Names: gate_proj [I, H], up_proj [I, H], down_proj [H, I]."""

    def __init__(
        self, config: K3Config, intermediate: int, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        self.config, self.tp = config, tp or TPContext()
        if intermediate % self.tp.size:
            raise ValueError(f"MLP width {intermediate} not divisible by tp {self.tp.size}")
        h, intermediate = config.hidden_size, intermediate // self.tp.size
        self.gate_proj = nn.Linear(h, intermediate, bias=False)
        self.up_proj = nn.Linear(h, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(_activation(self.config, self.gate_proj(x), self.up_proj(x)))
        return self.tp.all_reduce(y)


class K3RoutedExpert(nn.Module):
    """One routed expert, in the latent space (`expert_input_size` = routed_expert_hidden_size,
    or H without latent MoE). ℓ: [N, Hℓ] -> [N, Hℓ].

    Names as the checkpoint's: w1 (gate) [I, Hℓ], w3 (up) [I, Hℓ], w2 (down) [Hℓ, I]."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.config = config
        d, i = config.expert_input_size, config.moe_intermediate_size
        self.w1 = nn.Linear(d, i, bias=False)
        self.w3 = nn.Linear(d, i, bias=False)
        self.w2 = nn.Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_activation(self.config, self.w1(x), self.w3(x)))


# --- router and latent MoE ---------------------------------------------------------------------


class K3MoEGate(nn.Module):
    """Router on the FULL hidden size: `weight` [E, H] and the noaux_tc `e_score_correction_bias`
    [E] (fp32: in bf16 its spread collapses and reorders the top-k)."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (weights [N, k] fp32, expert ids [N, k] int64).

        SGLang's `biased_grouped_topk_impl` (it always builds K3's TopK with use_grouped_topk):
        the bias steers only the choice; the weights are the unbiased scores of the chosen
        experts, renormalized if `moe_renormalize`, then times `routed_scaling_factor`."""
        c = self.config
        # Routing in fp32 (SGLang's K3 gate emits fp32 logits on CUDA).
        logits = F.linear(x.float(), self.weight.float())
        if c.moe_router_activation_func != "sigmoid":  # the config reader admits only sigmoid
            raise ValueError(f"router activation {c.moe_router_activation_func!r}")
        scores = logits.sigmoid()
        # SGLang applies the scaling factor either to these weights or to the experts' combined
        # output (the weighted sum): the same number, and in both cases before the latent norm.
        return noaux_tc_topk(scores, self.e_score_correction_bias, c.num_expert_group,
                             c.topk_group, c.num_experts_per_token, c.moe_renormalize,
                             c.routed_scaling_factor)


# A forward of a few tokens that between them make at least E/4 expert choices (one decode token
# of the mini K3: top-4 of 16; a verify window: 8 x 4) runs the routed experts as two matmuls
# over ALL of this rank's experts, with the routing weights (zero for the experts a token did
# not choose), instead of one small batch per chosen expert: each such batch pays the SiTU
# activation's and the indexing's fixed costs. On the mini K3 (1 thread) one decode token's
# experts took 0.33 ms a layer that way against 1.1 ms looped (a decode forward 17.8 vs
# 19.5 ms), an 8-token window 0.6 against 3.8 ms. K3 itself (8 of 384) stays looped: the dense
# form reads every expert's weights. Up to DENSE_EXPERT_TOKENS tokens, only without gradients
# (serving), and only while the stacked copy stays small (_DENSE_EXPERTS_MAX_BYTES): the
# mini K3's 7 MoE layers (1 thread, column-major weights) took 25 vs 35 ms dense vs looped at
# 96 tokens, 35 vs 43 at 128, and the same at 160 and 192 (verify windows of 16 requests).
DENSE_EXPERT_TOKENS = 128
_DENSE_EXPERTS_MAX_BYTES = 256 * 2**20


class LatentMoE(nn.Module):
    """K3's MoE block (layers >= first_k_dense_replace): routed experts in the latent space
    between `routed_expert_down_proj` and `routed_expert_up_proj`, plus the shared experts on
    the full hidden size. Without `routed_expert_hidden_size` the experts run on H directly and
    the down/up projections do not exist (`is_latent_moe` False).

    x: [..., H] -> [..., H]. Parameters are registered in `k3_layer_tensors`' order: gate,
    experts.{e}, shared_experts, routed_expert_down_proj, routed_expert_norm, up_proj."""

    def __init__(self, config: K3Config, tp: TPContext | None = None) -> None:
        super().__init__()
        self.config, self.tp = config, tp or TPContext()
        h, lat = config.hidden_size, config.expert_input_size
        if config.num_experts % self.tp.size:
            raise ValueError(f"num_experts {config.num_experts} not divisible by tp {self.tp.size}")
        per_rank = config.num_experts // self.tp.size
        self.expert_range = range(self.tp.rank * per_rank, (self.tp.rank + 1) * per_rank)
        self.gate = K3MoEGate(config)
        # Keyed by the GLOBAL expert id, so the names are the checkpoint's on every rank.
        self.experts = nn.ModuleDict({str(e): K3RoutedExpert(config) for e in self.expert_range})
        self.shared_experts = (
            K3MLP(config, config.shared_intermediate_size, self.tp)
            if config.num_shared_experts else None
        )
        self.routed_expert_down_proj: nn.Linear | None = None
        self.routed_expert_norm: RMSNorm | None = None
        self.routed_expert_up_proj: nn.Linear | None = None
        if config.is_latent_moe:
            self.routed_expert_down_proj = nn.Linear(h, lat, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(lat, config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(lat, h, bias=False)
        # (weights' (data_ptr, version) key, w1|w3 stacked [E·2I, Hℓ], w2 stacked [E·I, Hℓ]).
        self._stacked: tuple[tuple[tuple[int, int], ...], torch.Tensor, torch.Tensor] | None = None

    def _stacked_experts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's experts as two matrices for `_experts_dense`, rebuilt whenever a weight
        is replaced or changed in place; None when that copy would be too large."""
        # Read through the modules' own dicts: nn.Module attribute lookups of 3 x 16 weights
        # took ~0.2 ms of every forward (a fifth of a decode token's MoE layer).
        weights = [ex._modules[name]._parameters["weight"]
                   for ex in self.experts._modules.values() for name in ("w1", "w3", "w2")]
        if sum(p.nbytes for p in weights) > _DENSE_EXPERTS_MAX_BYTES:  # type: ignore[union-attr]
            return None
        key = tuple((p.data_ptr(), p._version) for p in weights)  # type: ignore[union-attr]
        if self._stacked is None or self._stacked[0] != key:
            # From the same list the key was made of: (w1, w3, w2) per expert, in expert order.
            # Both read as x @ [in, out] contiguous (w13 column-major for F.linear), the
            # layout CPU GEMMs of a few rows are fastest with (layers.column_major_linears).
            w13 = torch.cat([w for i in range(0, len(weights), 3) for w in weights[i:i + 2]])
            w2 = torch.cat([w.t() for w in weights[2::3]])  # type: ignore[union-attr]
            self._stacked = (key, w13.detach().t().contiguous().t(), w2.detach().contiguous())
        return self._stacked[1], self._stacked[2]

    def _experts_dense(self, lat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       stacked: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Σ_k weight_k · expert_k(ℓ) for every token, through every local expert: lat [N, Hℓ],
        weights / ids [N, k] -> [N, Hℓ] fp32."""
        w13, w2 = stacked
        n, e, i = lat.shape[0], len(self.expert_range), self.config.moe_intermediate_size
        dense = torch.zeros(n, self.config.num_experts, dtype=torch.float32, device=lat.device)
        dense.scatter_(1, ids, weights.float())  # a token's top-k ids are distinct
        dense = dense[:, self.expert_range.start:self.expert_range.stop]
        gate, up = F.linear(lat, w13).view(n, e, 2, i).unbind(2)
        act = _activation(self.config, gate, up) * dense[..., None].to(lat.dtype)
        return (act.reshape(n, e * i) @ w2).float()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (weights [N, k] fp32, ids [N, k]); the router sees the full hidden x."""
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        # Routing first, then the latent compression (SGLang: "compress after routing").
        lat = x if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x)
        choices = ids.numel()
        dense = (4 * choices >= self.config.num_experts and x.shape[0] <= DENSE_EXPERT_TOKENS
                 and not torch.is_grad_enabled())
        stacked = self._stacked_experts() if dense else None
        if stacked is not None:
            y = self._experts_dense(lat, weights, ids, stacked)
        else:
            y = self._experts_looped(lat, weights, ids)
        y = self.tp.all_reduce(y).to(x.dtype)  # this rank's experts' partial sums, in fp32
        # The latent norm acts on the weighted SUM (SGLang reduces the TP partial sums first:
        # sum(norm(x_i)) != norm(sum(x_i))), so it also undoes most of routed_scaling_factor.
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.routed_expert_up_proj is not None:
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)  # on the ORIGINAL x, full width
        return y.reshape(shape)

    def _experts_looped(self, lat: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
        """As `_experts_dense`, one batch per chosen expert (prefill, training)."""
        # Per-expert batches: each expert runs once over the tokens that chose it.
        y = torch.zeros(lat.shape, dtype=torch.float32, device=lat.device)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.flatten()[order]
        start = 0
        for e, count in enumerate(counts):
            if count and e in self.expert_range:
                rows = token_of[start : start + count]
                expert = self.experts[str(e)]
                out = expert(lat[rows]).float() * weight_of[start : start + count, None]
                y.index_add_(0, rows, out)
            start += count
        return y


# --- MLA, NoPE, output gate --------------------------------------------------------------------


class K3MLA(MLAProjections):
    """K3's full-attention layer: MLA with no rotary anywhere and a sigmoid output gate.

    The `qk_rope_head_dim` part of q and k is kept (per-head q_pe against the single shared
    k_pe) but is position-free: SGLang builds K3's MLA with skip_rope=True. Order therefore
    comes only from the causal mask (and, in the full model, from KDA layers).

    Names: q_a_proj [rq, H], q_a_layernorm [rq], q_b_proj [n(dn+dr), rq] (or q_proj
    [n(dn+dr), H] when q_lora_rank is null), kv_a_proj_with_mqa [rkv+dr, H], kv_a_layernorm
    [rkv], kv_b_proj [n(dn+dv), rkv], o_proj [H, n·dv], g_proj [n·dv, H] (if the output gate)."""

    def __init__(self, config: K3Config, tp: TPContext | None = None) -> None:
        tp = tp or TPContext()
        n = config.num_attention_heads
        if n % tp.size:
            raise ValueError(f"num_attention_heads {n} not divisible by tp {tp.size}")
        # softmax_scale: (dn + dr)^-1/2, the dr part counts too.
        super().__init__(config.hidden_size, n // tp.size, config.q_lora_rank,
                         config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                         config.v_head_dim, config.softmax_scale, config.rms_norm_eps)
        self.config, self.tp = config, tp
        self.g_proj = (
            nn.Linear(config.hidden_size, self.num_heads * self.v_dim, bias=False)
            if config.mla_use_output_gate else None
        )

    def empty_cache(
        self, batch: int, device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """A cache with no tokens yet: [B, 0, kv_lora_rank + qk_rope_head_dim]."""
        return torch.zeros(batch, 0, self.config.mla_cache_dim, device=device, dtype=dtype)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> cache entries [..., kv_lora_rank + dr]: the normalized latent c and
        the raw shared key k_pe (no norm, no rotary)."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, H], the T new tokens of each request, which follow the L tokens already in
        `cache` [B, L, rkv + dr] (None: L = 0; every request of the batch has the same L).

        Returns (out [B, T, H], cache [B, L + T, rkv + dr]): the input cache with the new
        entries appended, in the cache's dtype (x's when no cache is given). Decoding one token
        at a time from a prefill's cache gives what one full forward over the whole sequence
        gives, up to float rounding."""
        b, t, _ = x.shape
        if cache is None:
            cache = self.empty_cache(b, x.device, x.dtype)
        past = cache.shape[1]
        q_nope, q_pe = self.query(x).split([self.nope, self.rope], dim=-1)
        # Round the new entries through the cache dtype, so a token's key is the same whether
        # it is attended in the pass that computed it or read back from the cache later.
        cache = torch.cat([cache, self.latent(x).to(cache.dtype)], dim=1)
        # Row h·T + i is new token i, at absolute position L + i.
        pos = past + torch.arange(t, device=x.device).repeat(self.num_heads)
        mask = torch.arange(past + t, device=x.device)[None, :] <= pos[:, None]
        o = self.attend(q_nope, q_pe, cache.to(x.dtype), mask)  # [B, T, n·dv]
        return self._output(o, x), cache

    def forward_paged(self, x: torch.Tensor, batch: PagedBatch, pool: torch.Tensor) -> torch.Tensor:
        """The engine's form: x, the new tokens of right-padded rows in the batch's layout
        (`PagedBatch.pack`), of requests whose entries live in this layer's paged pool
        [slots, rkv + dr] (the valid new entries are written in place, at `batch.slots`).
        The projections run on x's tokens; the attention on the rows."""
        q_nope, q_pe = batch.unpack(self.query(x)).split([self.nope, self.rope], dim=-1)
        new = self.latent(x).to(pool.dtype)
        pool[batch.slots] = new[0] if batch.packed is not None else new[batch.valid]
        keys = torch.cat([pool[batch.context_index], batch.unpack(new)], dim=1).to(x.dtype)
        return self._output(batch.pack(self.attend(q_nope, q_pe, keys, batch.mask)), x)

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [B, T, n·dv] -> [B, T, H]: the output gate (from the attention's own
        input x, multiplied in head space right before o_proj; σ, not SiTU), then o_proj."""
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.tp.all_reduce(self.o_proj(o))
