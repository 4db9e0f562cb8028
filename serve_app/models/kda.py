"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi K3, in plain PyTorch.

One readable module for the math SGLang 0.5.23 computes (`srt/models/kimi_k3.py`, the KDA backend
and its fla-style kernels). Per token t, head h:

    q, k, v = conv_silu(q_proj x), conv_silu(k_proj x), conv_silu(v_proj x)   short causal conv
    q̂ = l2norm(q) · D^-1/2,  k̂ = l2norm(k)                                    over the head dim
    g  = L · sigmoid(exp(A_log[h]) · (f_b_proj(f_a_proj x) + dt_bias))       log-decay per K row
    β  = sigmoid(b_proj x)
    S  ← diag(exp g) S;  u = β (v − Sᵀ k̂);  S ← S + k̂ uᵀ;  o = Sᵀ q̂          gated delta rule
    out = o_proj( RMSNorm_{o_norm}(o) ⊙ sigmoid(g_proj x) )

Parameter names are the K3 checkpoint's as SGLang's loader expects them:
q_proj / k_proj / v_proj / g_proj (full-rank output gate; g_a_proj / g_b_proj when
`use_full_rank_gate` is false), f_a_proj / f_b_proj, b_proj, q_conv1d / k_conv1d / v_conv1d
(`.weight [P, 1, 4]`, fp32), A_log [h], dt_bias [P], o_norm.weight [D], o_proj. A state dict
of one `model.layers.{l}.self_attn.` prefix therefore loads by name (A_log as 1-D [h]; the
loader is what accepts the checkpoint's other A_log shapes).

The per-request state is a `KDAState`: the last K−1 raw (pre-conv) q|k|v projection rows,
oldest first, and S in fp32 in the FLA/HF layout [h, K, V] (SGLang stores Sᵀ, [h, V, K]).

Two algorithms compute the same recurrence:
  - `recurrent`: token by token, as the decode kernel does;
  - `chunked`: C tokens at a time with the exact chunkwise (WY / UT-transform) form, as
    prefill's `chunk_kda` does; equal to `recurrent` up to float rounding.
`forward_window` runs a speculative verify window of T = γ+1 tokens and returns the state after
every position (`KDAWindowStates`), never touching the input state, so the engine keeps the
state of the accepted prefix (SGLang's default: one full state per verified position).

Batching: every entry point takes [B, T, H] with one state row per request, all B requests the
same length T. A ragged batch (different prompt lengths) is run one request at a time (B = 1
calls); the layer has no padding masks, because a padded token would still decay and write S.
All recurrence math is fp32, whatever the activation dtype: q̂ and k̂ stay fp32 (as in SGLang's
decode/verify kernels; its prefill stores them back in the activation dtype).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.models.target import TPContext

if TYPE_CHECKING:
    from serve_app.models.kv_cache import PagedBatch

__all__ = [
    "GatedRMSNorm",
    "KDASizes",
    "KDAState",
    "KDAWindowStates",
    "KimiDeltaAttention",
    "causal_conv_silu",
    "chunked_gated_delta_rule",
    "kda_gate",
    "recurrent_gated_delta_rule",
]

Algorithm = Literal["chunked", "recurrent"]


@dataclass(frozen=True)
class KDASizes:
    """The sizes of one KDA layer, named as in K3's `text_config` / `linear_attn_config`."""

    hidden_size: int
    num_heads: int
    head_dim: int
    short_conv_kernel_size: int = 4
    # The "safe gate" L (K3: −5.0): g = L·sigmoid(·) ∈ (L, 0). None gives plain Kimi-Linear's
    # g = −exp(A_log)·softplus(·), which is unbounded below.
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True
    # o_norm's eps. SGLang builds K3's KDA o_norm with the constructor default 1e-5.
    rms_norm_eps: float = 1e-5
    # The forget gate (and the low-rank output gate) is H → rank → P; K3 uses rank = head_dim.
    gate_rank: int | None = None

    @property
    def projection_size(self) -> int:
        """P = num_heads · head_dim."""
        return self.num_heads * self.head_dim

    @property
    def rank(self) -> int:
        return self.head_dim if self.gate_rank is None else self.gate_rank

    @classmethod
    def from_text_config(cls, text_config: Mapping[str, Any]) -> KDASizes:
        """From a K3 `text_config` dict (its `linear_attn_config` holds the KDA fields)."""
        lin = text_config["linear_attn_config"]
        return cls(
            hidden_size=text_config["hidden_size"],
            num_heads=lin["num_heads"],
            head_dim=lin["head_dim"],
            short_conv_kernel_size=lin.get("short_conv_kernel_size", 4),
            gate_lower_bound=lin.get("gate_lower_bound"),
            use_full_rank_gate=lin.get("use_full_rank_gate", False),
        )


# --- state -------------------------------------------------------------------------------------


@dataclass
class KDAState:
    """A batch of requests' KDA state for one layer.

    conv: [B, K−1, 3P], activation dtype: the last K−1 raw q|k|v projection rows, oldest first
          (SGLang's [window, channel] layout). Zeros before a sequence's first token.
    ssm:  [B, h, D, D] fp32, S in the [K, V] layout.
    """

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def zeros(
        cls,
        sizes: KDASizes,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> KDAState:
        k, p = sizes.short_conv_kernel_size, sizes.projection_size
        h, d = sizes.num_heads, sizes.head_dim
        return cls(
            conv=torch.zeros(batch, k - 1, 3 * p, device=device, dtype=dtype),
            ssm=torch.zeros(batch, h, d, d, device=device, dtype=torch.float32),
        )

    def clone(self) -> KDAState:
        return KDAState(self.conv.clone(), self.ssm.clone())

    def rows(self, index: torch.Tensor | slice | list[int]) -> KDAState:
        """The states of a subset of requests (e.g. one request of a batch: `rows([i])`)."""
        return KDAState(self.conv[index], self.ssm[index])


@dataclass
class KDAWindowStates:
    """The state after every position of a T-token verify window.

    conv: [B, T, K−1, 3P]; ssm: [B, T, h, D, D] fp32. Position t's entry is the state after
    tokens 0..t of the window, i.e. what the request's state becomes when t+1 tokens (the
    previous bonus token plus t drafts) are accepted.
    """

    conv: torch.Tensor
    ssm: torch.Tensor

    def at(self, step: int | torch.Tensor) -> KDAState:
        """The committed state for `last_correct_step` = step: an int for the whole batch, or a
        [B] tensor with one step per request (SGLang's scatter after verify)."""
        if isinstance(step, int):
            return KDAState(self.conv[:, step].clone(), self.ssm[:, step].clone())
        rows = torch.arange(self.conv.shape[0], device=self.conv.device)
        step = step.to(self.conv.device)
        return KDAState(self.conv[rows, step], self.ssm[rows, step])


@dataclass
class KDAWindowLog:
    """What a lazily verified window keeps instead of its states (SGLang's ReplaySSM keeps the
    recurrence inputs; this keeps them solved): the committed state plus these give the state
    after any position t of the window in one product,
        S_t = diag(e^{G_t}) S0 + Σ_{s≤t} diag(e^{G_t−G_s}) k_s u_sᵀ.

    k: [B, h, T, K] (l2-normalised), G: [B, h, T, K] the cumulative log-decay, U: [B, h, T, V]
    the delta-rule corrections the window's output was computed with (they depend on S0, which
    stays in the slot until the commit), all fp32; rows: [B, K−1+T, 3P] the raw q|k|v rows
    (the committed conv window, then the T tokens'), from which any position's conv window is
    a slice.
    """

    k: torch.Tensor
    G: torch.Tensor
    U: torch.Tensor
    rows: torch.Tensor

    def replay(self, rows: torch.Tensor, ssm: torch.Tensor, steps: torch.Tensor) -> KDAState:
        """The states after window tokens 0..steps[i] (accepting steps[i] + 1 tokens) of the
        requests at `rows` [n] of the window, from their committed recurrent states ssm
        [n, h, D, D]: only those states are formed, never the other positions'."""
        k, G, U = self.k[rows], self.G[rows], self.U[rows]
        T = k.shape[2]
        at = steps.to(k.device)
        G_t = G[torch.arange(len(rows), device=k.device), :, at]          # [n, h, K]
        upto = (torch.arange(T, device=k.device)[None, :] <= at[:, None])  # [n, T]
        # e^{G_t − G_s} ⊙ k_s for s ≤ t (never > 1: G decreases along the window), 0 after t.
        weight = (G_t[:, :, None] - G).exp() * k * upto[:, None, :, None]
        state = G_t.exp()[..., None] * ssm.float() + weight.transpose(-1, -2) @ U
        kernel_rows = self.rows.shape[1] - T  # K − 1
        window = at[:, None] + 1 + torch.arange(kernel_rows, device=at.device)
        return KDAState(conv=self.rows[rows[:, None], window], ssm=state)


def replay_layers(logs: Sequence[KDAWindowLog], rows: torch.Tensor, ssm: torch.Tensor,
                  steps: torch.Tensor) -> KDAState:
    """`KDAWindowLog.replay` of several layers' windows (same shapes) in one pass: ssm
    [layers, n, h, D, D] the committed states -> KDAState of [layers, n, ...]. One replay's
    ~20 operations instead of ~20 per layer (a commit's KDA part was ~1.5 ms of a 16 ms
    decode forward at one request, nearly all of it per-operation overhead)."""
    n_layers, batch = len(logs), logs[0].k.shape[0]
    flat = KDAWindowLog(*(torch.cat([getattr(log, f) for log in logs])
                          for f in ("k", "G", "U", "rows")))
    offsets = torch.arange(n_layers, device=rows.device)[:, None] * batch
    state = flat.replay((offsets + rows).flatten(), ssm.flatten(0, 1), steps.repeat(n_layers))
    return KDAState(state.conv.unflatten(0, (n_layers, -1)),
                    state.ssm.unflatten(0, (n_layers, -1)))


# --- the pieces, as plain functions ------------------------------------------------------------


def causal_conv_silu(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Short causal depthwise conv + SiLU, continuing from a conv window.

    x: [B, T, C] raw projections; window: [B, K−1, C] the previous K−1 raw rows, oldest first;
    weight: [C, K] (the checkpoint's [C, 1, K] squeezed). Returns (SiLU(conv) [B, T, C],
    all K−1+T raw rows [B, K−1+T, C], from which callers cut the next window(s)).

    y_t = Σ_j weight[:, j] · row_{t−(K−1)+j}: weight[:, K−1] multiplies the current token, the
    cross-correlation of F.conv1d(padding=K−1)[..., :T]. SGLang always uses SiLU here.
    """
    kernel = weight.shape[-1]
    rows = torch.cat([window.to(x.dtype), x], dim=1)
    # unfold: [B, T, C, K], the K consecutive rows ending at each token.
    taps = rows.float().unfold(1, kernel, 1)
    y = (taps * weight.float()).sum(-1)
    return F.silu(y).to(x.dtype), rows


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """The per-head, per-K-channel log-decay g, fp32.

    f: [..., h, D] forget-gate pre-activation; A_log: [h]; dt_bias: [h, D].
    With the safe gate g = L·sigmoid(exp(A_log)·(f + dt_bias)) ∈ [L, 0], so the decay exp(g) is
    never below exp(L); without it g = −exp(A_log)·softplus(f + dt_bias) (threshold 20).
    """
    a = A_log.float().exp()[:, None]
    x = f.float() + dt_bias.float()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x, beta=1.0, threshold=20.0)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # fp32, eps inside the sqrt as in the fused kernels (1e-6).
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep_all_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, fp32.

    q, k: [B, T, h, K] (already normalised and, for q, scaled); v: [B, T, h, V];
    g: [B, T, h, K] log-decay; beta: [B, T, h]; state: [B, h, K, V] (not modified).
    Returns (o [B, T, h, V], final state [B, h, K, V] or, with keep_all_states, the state after
    every token [B, T, h, K, V]). T ≥ 1.
    """
    S = state.float().clone()
    outs, states = [], []
    for t in range(q.shape[1]):
        S = delta_rule_step(S, k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
        if keep_all_states:
            states.append(S)
    o = torch.stack(outs, dim=1)
    return o, (torch.stack(states, dim=1) if keep_all_states else S)


def delta_rule_step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule: S [B, h, K, V] fp32 -> the state after the token
    with k [B, h, K], v [B, h, V], log-decay g [B, h, K], beta [B, h] (decode's step)."""
    S = S * g.exp()[..., None]                        # decay each K row
    pred = torch.einsum("bhkv,bhk->bhv", S, k)        # Sᵀk: what S recalls for k
    u = beta[..., None] * (v - pred)                  # the delta-rule correction
    return S + k[..., None] * u[..., None, :]


def window_states(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> torch.Tensor:
    """The state after every position of a short window, all at once: the chunkwise form below
    for ONE chunk of T tokens, keeping every S_t instead of only the last,
        S_t = diag(e^{G_t}) S0 + Σ_{s≤t} diag(e^{G_t−G_s}) k_s u_sᵀ,
    with U from the same unit lower-triangular solve. A verify window (T = γ + 1) then costs
    about ten batched operations a layer instead of T recurrence steps of six each.

    k: [B, T, h, K]; v: [B, T, h, V]; g: [B, T, h, K]; beta: [B, T, h]; state: [B, h, K, V]
    (not modified) -> [B, T, h, K, V] fp32. The pairwise decays come from differences
    ([B, h, T, T, K]: small for a window). Every row of the batch is computed on its own, so a
    subset of rows gives the same bits. The scratch rollback keeps these states; the lazy one
    (`window_solve`) never forms them.
    """
    k, G, eG, U, _ = _window_corrections(k, v, g, beta, state)
    T = k.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()
    diff = G[:, :, :, None, :] - G[:, :, None, :, :]                 # [B, h, t, s, K]
    decay = diff.masked_fill(~causal[:, :, None], float("-inf")).exp()
    S0 = state.float()
    states = eG[..., None] * S0[:, :, None] + torch.einsum("bhtsk,bhsk,bhsv->bhtkv", decay, k, U)
    return states.transpose(1, 2)


def _window_corrections(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, q: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, ...]:
    """What a window's two forms share (`window_states`, `window_solve`): k, the cumulative
    log-decay G, e^G (all [B, h, T, ·] fp32), the delta-rule corrections U from the unit
    lower-triangular solve and, given q, the output's intra-window scores (else None)."""
    S0 = state.float()
    k, v, g = (t.float().transpose(1, 2) for t in (k, v, g))         # [B, h, T, ·]
    beta = beta.float().transpose(1, 2)                               # [B, h, T]
    G = g.cumsum(dim=2)
    q = None if q is None else q.float().transpose(1, 2)
    A, Aqk = intra_chunk_scores(k, G, q)
    eG = G.exp()
    rhs = beta[..., None] * (v - (eG * k) @ S0)                       # diag(β)(V − (e^G ⊙ K) S0)
    # (I + diag(β) A) U = rhs: the solve takes the unit diagonal as given (A's is 0).
    U = torch.linalg.solve_triangular(beta[..., None] * A, rhs, upper=False, unitriangular=True)
    return k, G, eG, U, Aqk


def window_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify window: (o [B, T, h, V], the state after every position [B, T, h, K, V]), the
    same recurrence as `recurrent_gated_delta_rule(..., keep_all_states=True)`; o_t = S_tᵀ q_t."""
    states = window_states(k, v, g, beta, state)
    return torch.einsum("bthkv,bthk->bthv", states, q.float()), states


def window_solve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, state: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify window's outputs without its per-position states: the chunk form for one
    chunk of T tokens (see `chunked_gated_delta_rule`),
        o_t = S0ᵀ(e^{G_t} ⊙ q_t) + Σ_{s≤t} (Σ_c q_t,c k_s,c e^{G_t,c−G_s,c}) u_s,
    with U from the same solve as `window_states`. Costs O(T²K + TKV) per head instead of the
    O(T²KV) of forming every S_t. Returns (o [B, T, h, V], U [B, h, T, V], G [B, h, T, K]);
    `KDAWindowLog.replay` forms the state at the accepted position from U and G."""
    k, G, eG, U, Aqk = _window_corrections(k, v, g, beta, state, q)
    q = q.float().transpose(1, 2)                                     # [B, h, T, K]
    o = (eG * q) @ state.float() + Aqk @ U
    return o.transpose(1, 2), U, G


# Tokens per chunk of the chunked algorithm. FLA's kernels use 64 (split into 16-token sub-blocks).
# Here every chunk's intra-chunk matrices are formed at once; at 16, K3's bounded gate (g >= -5
# per token) keeps a chunk's log-decay span under 80, so its decays are always factorised.
KDA_CHUNK = 16
# The largest within-chunk log-decay span |G_C| (any K channel) for which the pairwise decays are
# factorised as e^{G_t - r} · e^{r - G_s} (r: the chunk's middle position): each factor is at most
# e^{80} ~ 5.5e34, inside fp32, and the s > t products that may overflow are masked with
# `where` (never multiplied by 0). Beyond it, the exact pairwise differences are formed.
FACTORISED_MAX_SPAN = 80.0


@functools.cache
def _causal_masks(c: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, C] s <= t and s < t (made once per size: a verify window's KDA layers ask for the
    same ones every step)."""
    causal = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    return causal, causal.clone().fill_diagonal_(False)


def intra_chunk_scores(k: torch.Tensor, G: torch.Tensor, q: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's decayed scores, over its last two dims (k, G, q: [..., C, K] fp32, G the
    chunk's cumulative log-decay): A_ts = Σ_c k_t,c k_s,c e^{G_t,c−G_s,c} for s < t and, given
    q, Aqk_ts = Σ_c q_t,c k_s,c e^{G_t,c−G_s,c} for s ≤ t; 0 elsewhere. The decays are
    factorised around the chunk's middle when its span allows (`FACTORISED_MAX_SPAN`; always
    for K3's bounded gate: two products instead of a [..., C, C, K] tensor, which took ~40% of a
    verify window's KDA solve), else formed from pairwise differences."""
    c = G.shape[-2]
    causal, strict = _causal_masks(c, G.device)
    if float(-G[..., -1, :].detach().min()) <= FACTORISED_MAX_SPAN:
        r = G[..., c // 2:c // 2 + 1, :]
        k_in = (k * (r - G).exp()).transpose(-1, -2)                # k_s e^{r − G_s}
        to_r = (G - r).exp()
        zero = k.new_zeros(())
        A = torch.where(strict, (k * to_r) @ k_in, zero)
        Aqk = None if q is None else torch.where(causal, (q * to_r) @ k_in, zero)
        return A, Aqk
    diff = G[..., :, None, :] - G[..., None, :, :]                 # [..., t, s, K]
    decay = diff.masked_fill(~causal[:, :, None], float("-inf")).exp()
    A = torch.einsum("...tk,...sk,...tsk->...ts", k, k, decay) * strict
    Aqk = None if q is None else torch.einsum("...tk,...sk,...tsk->...ts", q, k, decay)
    return A, Aqk


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = KDA_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, C tokens at a time (the exact chunkwise / UT-transform form).

    Shapes as `recurrent_gated_delta_rule` (T ≥ 1); returns (o [B, T, h, V], final state
    [B, h, K, V]).

    Within a chunk, with S0 its start state and G_t = Σ_{s≤t} g_s (cumulative log-decay, per K
    channel), unrolling the recurrence gives
        S_t = diag(e^{G_t}) S0 + Σ_{s≤t} diag(e^{G_t−G_s}) k_s u_sᵀ,
        u_t = β_t (v_t − S0ᵀ(e^{G_t} ⊙ k_t) − Σ_{s<t} A_ts u_s),
        A_ts = Σ_c k_t,c k_s,c e^{G_t,c − G_s,c},
    a unit lower-triangular system (I + diag(β) A) U = diag(β)(V − (e^G ⊙ K) S0). It is linear in
    S0, so U = Ũ − W S0 with Ũ, W solving it for V and for e^G ⊙ K (FLA's WY form): those, A and
    the output's intra-chunk scores depend on no state and are formed for every chunk at once.
    Only the chain over chunks is sequential:
        U = Ũ − W S0,  o_t = S0ᵀ(e^{G_t} ⊙ q_t) + Σ_{s≤t} (Σ_c q_t,c k_s,c e^{G_t,c−G_s,c}) u_s,
        S_C = diag(e^{G_C}) S0 + Σ_s (e^{G_C−G_s} ⊙ k_s) u_sᵀ.
    The pairwise decays e^{G_t−G_s} are factorised around the chunk's middle when the chunk's
    span allows it (`FACTORISED_MAX_SPAN`; always for K3's bounded gate), else formed from
    differences ([B, h, N, C, C, K]: never e^{G_t}·e^{−G_s} unbounded, which overflows fp32).
    """
    T = q.shape[1]
    c = chunk_size
    n = -(-T // c)
    pad = n * c - T

    def chunks(t: torch.Tensor) -> torch.Tensor:
        # [B, T, h, ·] -> [B, h, N, C, ·], zero-padded: a padded position has k = v = q = 0,
        # β = 0 and g = 0 (no decay), so it changes neither the outputs nor the state.
        t = t.float().transpose(1, 2)
        if pad:
            t = F.pad(t, (0, 0, 0, pad) if t.ndim == 4 else (0, pad))
        return t.unflatten(2, (n, c))

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = chunks(beta)                                             # [B, h, N, C]
    G = g.cumsum(dim=3)                                             # [B, h, N, C, K]
    A, Aqk = intra_chunk_scores(k, G, q)
    eG = G.exp()
    V = v.shape[-1]
    # (I + diag(β) A) X = ...: the solve takes the unit diagonal as given (A's is 0).
    solved = torch.linalg.solve_triangular(
        beta[..., None] * A, beta[..., None] * torch.cat([v, eG * k], dim=-1), upper=False,
        unitriangular=True)
    U_v, W = solved[..., :V], solved[..., V:]                       # Ũ, W
    q_dec = eG * q
    to_end = (G[:, :, :, -1:] - G).exp() * k                        # e^{G_C − G_s} ⊙ k_s
    last = eG[:, :, :, -1, :, None]                                 # [B, h, N, K, 1]
    S = state.float().clone()
    outs = []
    for i in range(n):
        U = U_v[:, :, i] - W[:, :, i] @ S
        outs.append(q_dec[:, :, i] @ S + Aqk[:, :, i] @ U)         # [B, h, C, V]
        S = last[:, :, i] * S + to_end[:, :, i].transpose(-1, -2) @ U
    o = torch.cat(outs, dim=2)[:, :, :T]
    return o.transpose(1, 2), S


# --- the layer ---------------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """`o_norm`: RMSNorm over the head dim, times sigmoid(gate) (SGLang's FusedRMSNormGated with
    activation="sigmoid"). All in fp32, cast once at the end."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (x32 * torch.sigmoid(gate.float())).to(gate.dtype)


class KimiDeltaAttention(nn.Module):
    """One K3 KDA layer (`model.layers.{l}.self_attn`). x: [B, T, H] → [B, T, H].

    Tensor parallelism (`tp`, default one rank): each rank owns num_heads / tp.size contiguous
    heads. q/k/v/g(_b)/f_b/b projections are split by output rows of its heads, with their conv
    channels, A_log, dt_bias; f_a / g_a (rank r) and o_norm (per head, shared weight) are
    replicated; o_proj is split by input columns and its output all-reduced. The KDA state of a
    rank holds only its heads (`local_sizes`)."""

    def __init__(self, sizes: KDASizes, tp: TPContext | None = None) -> None:
        super().__init__()
        tp = tp or TPContext()
        if sizes.num_heads % tp.size:
            raise ValueError(f"KDA num_heads {sizes.num_heads} not divisible by tp {tp.size}")
        self.sizes, self.tp = sizes, tp
        self.local_sizes = replace(sizes, num_heads=sizes.num_heads // tp.size)
        H, D = sizes.hidden_size, sizes.head_dim
        h, P = self.local_sizes.num_heads, self.local_sizes.projection_size
        K, r = sizes.short_conv_kernel_size, sizes.rank
        self.num_heads, self.head_dim, self.conv_kernel = h, D, K
        self.q_proj = nn.Linear(H, P, bias=False)
        self.k_proj = nn.Linear(H, P, bias=False)
        self.v_proj = nn.Linear(H, P, bias=False)
        # Output gate: full rank in K3 (use_full_rank_gate), else H → r → P.
        if sizes.use_full_rank_gate:
            self.g_proj = nn.Linear(H, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(H, r, bias=False)
            self.g_b_proj = nn.Linear(r, P, bias=False)
        # Forget gate: low rank in both cases.
        self.f_a_proj = nn.Linear(H, r, bias=False)
        self.f_b_proj = nn.Linear(r, P, bias=False)
        self.b_proj = nn.Linear(H, h, bias=False)
        # Depthwise conv weights [P, 1, K], created fp32 like SGLang's (params_dtype=float32; a
        # model-wide .to(bf16) would round them, so a loader should keep them, A_log and dt_bias
        # fp32). The conv itself is `causal_conv_silu`, not these modules' forward.
        self.q_conv1d = nn.Conv1d(P, P, K, groups=P, bias=False, dtype=torch.float32)
        self.k_conv1d = nn.Conv1d(P, P, K, groups=P, bias=False, dtype=torch.float32)
        self.v_conv1d = nn.Conv1d(P, P, K, groups=P, bias=False, dtype=torch.float32)
        # Placeholder initialisation in the Mamba style (A ∈ [1, 16]; dt_bias = softplus⁻¹ of a
        # log-uniform dt in [1e-3, 0.1]); a checkpoint overwrites both.
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32).uniform_(1, 16).log())
        dt = torch.empty(P).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        self.o_norm = GatedRMSNorm(D, eps=sizes.rms_norm_eps)
        self.o_proj = nn.Linear(P, H, bias=False)

    def new_state(self, batch: int, device: torch.device | str | None = None) -> KDAState:
        return KDAState.zeros(
            self.local_sizes, batch, device=device, dtype=self.q_proj.weight.dtype
        )

    # -- pieces ---------------------------------------------------------------------------------

    def conv_weight(self) -> torch.Tensor:
        """[3P, K] fp32: the q|k|v depthwise conv weights stacked in the state's channel order."""
        return torch.cat(
            [m.weight.squeeze(1) for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        ).float()

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] → log-decay g [B, T, h, D] fp32, within [gate_lower_bound, 0]."""
        f = self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (self.num_heads, self.head_dim))
        dt_bias = self.dt_bias.view(self.num_heads, self.head_dim)
        return kda_gate(f, self.A_log, dt_bias, self.sizes.gate_lower_bound)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if self.sizes.use_full_rank_gate:
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def _inputs(self, x: torch.Tensor, state: KDAState, batch: PagedBatch | None = None
                ) -> tuple[torch.Tensor, ...]:
        """Everything before the recurrence: (q̂, k̂, v, g, β) fp32 per head, and the raw
        q|k|v rows [B, K−1+T, 3P] (previous window + this call's tokens). With `batch`, x is
        in its layout (`PagedBatch.pack`): the projections run on x's tokens, the rest on the
        rows."""
        unpack = (lambda t: t) if batch is None else batch.unpack
        raw = unpack(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1))
        qkv, rows = causal_conv_silu(raw, state.conv, self.conv_weight())
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)) for t in qkv.chunk(3, dim=-1))
        q = _l2norm(q) * self.head_dim**-0.5
        k = _l2norm(k)
        g = unpack(self.forget_gate(x))
        beta = unpack(torch.sigmoid(self.b_proj(x).float()))
        return q, k, v.float(), g, beta, rows

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [B, T, h, V] fp32 → o_proj(o_norm(o) ⊙ sigmoid(gate)) [B, T, H]."""
        gate = self.output_gate(x).unflatten(-1, (self.num_heads, self.head_dim))
        y = self.o_norm(o, gate)
        return self.tp.all_reduce(self.o_proj(y.flatten(-2)))

    # -- entry points ---------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        state: KDAState,
        algorithm: Algorithm = "chunked",
        chunk_size: int = KDA_CHUNK,
    ) -> tuple[torch.Tensor, KDAState]:
        """Run T new tokens per request from `state` (not modified).

        x: [B, T, H]; state: B requests' states. `chunked` for prefill/extend, `recurrent` for
        decode (T = 1, or any T token by token). Returns (out [B, T, H], the state after the T
        tokens).
        """
        q, k, v, g, beta, rows = self._inputs(x, state)
        if algorithm == "chunked":
            o, S = chunked_gated_delta_rule(q, k, v, g, beta, state.ssm, chunk_size)
        elif algorithm == "recurrent":
            o, S = recurrent_gated_delta_rule(q, k, v, g, beta, state.ssm)
        else:
            raise ValueError(f"unknown KDA algorithm {algorithm!r}")
        conv = rows[:, rows.shape[1] - (self.conv_kernel - 1):].clone()
        return self._output(o, x), KDAState(conv=conv, ssm=S)

    def forward_window(
        self, x: torch.Tensor, state: KDAState, batch: PagedBatch | None = None
    ) -> tuple[torch.Tensor, KDAWindowStates]:
        """A speculative verify window: x [B, T, H] (T = γ+1: the bonus token and γ drafts),
        or with `batch` right-padded windows in its layout (`PagedBatch.pack`), as the output.

        Returns (out, the state after each of the T positions). `state` (the committed
        state) is not modified; committing `accepted + 1` tokens is `states.at(accepted)`.
        """
        q, k, v, g, beta, rows = self._inputs(x, state, batch)
        o, all_S = window_gated_delta_rule(q, k, v, g, beta, state.ssm)
        # The conv window after position t is raw rows t+1 .. t+K−1 of `rows` (which starts with
        # the K−1 rows of the committed window): [B, T, 3P, K−1] → [B, T, K−1, 3P].
        windows = rows[:, 1:].unfold(1, self.conv_kernel - 1, 1).transpose(-1, -2).contiguous()
        o = o if batch is None else batch.pack(o)
        return self._output(o, x), KDAWindowStates(conv=windows, ssm=all_S)

    def forward_logged(
        self, x: torch.Tensor, state: KDAState, batch: PagedBatch | None = None
    ) -> tuple[torch.Tensor, KDAWindowLog]:
        """A verify window computed lazily: the outputs from the chunk form (`window_solve`),
        no per-position state formed; commit with `log.replay`, which forms only the accepted
        position's. `state` is not modified; x and the output as `forward_window`'s."""
        q, k, v, g, beta, rows = self._inputs(x, state, batch)
        o, U, G = window_solve(q, k, v, g, beta, state.ssm)
        o = o if batch is None else batch.pack(o)
        return self._output(o, x), KDAWindowLog(k=k.float().transpose(1, 2), G=G, U=U,
                                                rows=rows)
