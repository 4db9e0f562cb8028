"""The Kimi K3 text model in plain PyTorch: decoder layers with Block Attention Residuals,
the causal-LM head, a per-request state, and the DSpark taps.

One readable module (gpt-fast style) for what SGLang 0.5.23 computes in `srt/models/kimi_k3.py`,
`srt/layers/attn_residual.py` and `srt/layers/layer_boundary/residual/attn_bank.py`. The blocks
come from `kda.py` (KDA) and `k3_blocks.py` (MLA, dense MLP / latent MoE).

Block AttnRes (arXiv 2603.15031; S = attn_res_block_size). Per token the forward keeps a bank
B = [b_0, ...] of frozen block sums and a partial sum p. A read mixes R = [b_0..b_{n-1}, p]:

    s_j = w · RMSNorm_γ(r_j)        α = softmax_j(s_j) (fp32)        mix = Σ_j α_j r_j

with (w, γ) = (`*_res_proj.weight`, `*_res_norm.weight`) of that read. Layer l:

    p = x0 if l == 0 (p already holds the previous layer's p + ffn_out otherwise)
    a_in = input_layernorm(mix(B + [p]; self_attention_res_*))
    if l % S == 0: B.append(p); p = ∅                 (write layer)
    p = p + self_attn(a_in)                           (∅ + y = y)
    m_in = post_attention_layernorm(mix(B + [p]; mlp_res_*))
    p = p + mlp(m_in)
    ...after the last layer: h_final = norm(mix(B + [p]; output_attn_res_*))

So b_0 is the embedding alone and b_k (k >= 1) the plain sum of the 2S sublayer outputs of
layers (k-1)S .. kS-1. With attn_res_block_size null the layer is the plain pre-norm residual
h = h + attn(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h)); norm(h) at the end.

State (`K3State`): per KDA layer a `KDAState`, per MLA layer the latent cache [B, L, rkv + dr].
The AttnRes bank needs nothing across calls: every read mixes rows of the same token position
(the bank is allocated fresh per forward in SGLang, attn_residual.py), so only the
attention layers carry information between tokens.

DSpark taps (`_dspark_capture_stream`): layer id i (0-based, no +1 shift) captures the pre-norm
mixture layer i+1's attention read forms, mix(B + [p]; layer i+1's self_attention_res_*), before
its input_layernorm (the output read's parameters when i is the last layer). Without a bank it is
the residual stream h after layer i (the next layer's input, pre-norm).

Verify (`K3ForCausalLM.verify`): a T-token window returns a `K3WindowStates` (each KDA
layer's state after every position, the MLA caches over the whole window); `at(accepted)`
commits accepted + 1 tokens (KDA: that position's state; MLA: the cache truncated).

Batching: [B, T] with every request at the same length (the same number of cached tokens); a
ragged batch is run one request at a time (KDA has no padding masks, see kda.py).

Tensor parallelism (optional `tp`, target.py's TPContext; default one rank = the plain model):
KDA and MLA heads, the dense MLP / shared-expert widths and the routed experts are split across
ranks as kda.py and k3_blocks.py describe, each block all-reducing its own output. The
embedding, every norm, the AttnRes reads, the final norm and lm_head are replicated (the
simplest layout: every rank holds the full residual stream and returns the full logits). A
rank's K3State holds its own heads' KDA states and the (replicated) latent MLA caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.models.k3_blocks import K3MLA, K3MLP, LatentMoE
from serve_app.models.k3_config import K3Config
from serve_app.models.kda import KDASizes, KDAState, KDAWindowStates, KimiDeltaAttention
from serve_app.models.layers import RMSNorm
from serve_app.models.target import TPContext

__all__ = [
    "DenseStates",
    "K3DecoderLayer",
    "K3ForCausalLM",
    "K3Model",
    "K3State",
    "K3WindowStates",
    "LayerStates",
    "attn_res_mix",
    "kda_sizes",
]


def kda_sizes(config: K3Config) -> KDASizes:
    """KDASizes of the config's KDA layers (forget/low-rank gate rank = head_dim, as in K3).
    The gated o_norm keeps KDASizes' 1e-5 eps rather than rms_norm_eps: SGLang 0.5.23 builds
    KimiK3DeltaAttention without passing rms_norm_eps (kimi_k3.py:2534-2546; its default,
    1e-5, at :1509)."""
    lin = config.linear_attn_config
    return KDASizes(
        hidden_size=config.hidden_size,
        num_heads=config.kda_num_heads,
        head_dim=config.kda_head_dim,
        short_conv_kernel_size=config.kda_conv_kernel,
        gate_lower_bound=config.kda_gate_lower_bound,
        use_full_rank_gate=lin.use_full_rank_gate,
    )


# --- Attention Residual read --------------------------------------------------------------------


def attn_res_mix(
    rows: Sequence[torch.Tensor], norm: RMSNorm, proj: nn.Linear
) -> torch.Tensor:
    """rows: R tensors [..., H] (bank rows then p) -> Σ_j softmax_j(w · RMSNorm_γ(r_j)) r_j,
    scores, softmax and the weighted sum in fp32, cast back to the rows' dtype."""
    if len(rows) == 1:  # nothing banked yet (layer 0's attention read): the row itself
        return rows[0]
    r = torch.stack(list(rows), dim=-2)  # [..., R, H]
    r32 = r.float()
    normed = r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + norm.eps)
    cw = norm.weight.float() * proj.weight.float()[0]  # γ ⊙ w (SGLang's cached `cw`)
    alpha = torch.softmax(normed @ cw, dim=-1)  # [..., R]
    return (alpha.unsqueeze(-1) * r32).sum(-2).to(r.dtype)


# --- per-request state ---------------------------------------------------------------------------


@dataclass
class K3State:
    """B requests' state (all at the same length): a KDAState per KDA layer, the latent MLA
    cache [B, L, kv_lora_rank + qk_rope_head_dim] per MLA layer, and L = `length`."""

    kda: dict[int, KDAState] = field(default_factory=dict)
    mla: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0

    def clone(self) -> K3State:
        return K3State(
            {i: s.clone() for i, s in self.kda.items()},
            {i: c.clone() for i, c in self.mla.items()},
            self.length,
        )


@dataclass
class K3WindowStates:
    """The states after every position of a T-token verify window, from a state of
    `start` tokens: a KDAWindowStates per KDA layer and the MLA caches over the whole window
    (an MLA cache rolls back by truncation). `at(step)` is the state after window tokens
    0..step, i.e. after accepting step + 1 tokens; one step for the whole batch."""

    kda: dict[int, KDAWindowStates] = field(default_factory=dict)
    mla: dict[int, torch.Tensor] = field(default_factory=dict)
    start: int = 0

    def at(self, step: int) -> K3State:
        keep = self.start + step + 1
        return K3State(
            {i: w.at(step) for i, w in self.kda.items()},
            {i: c[:, :keep].clone() for i, c in self.mla.items()},
            keep,
        )


class LayerStates(Protocol):
    """Where one forward's attention layers read and write their per-request state: the dense
    K3State of this module's API (DenseStates), or the engine's paged MLA KV and KDA state
    slots (k3_paged.py). Each call runs the layer's block on x -> y in the layout the states
    keep the residual stream in: [B, T, H] here; the paged states of right-padded rows keep
    their real tokens only, packed [1, N, H], so that every position-wise part of a layer
    (norms, AttnRes reads, MLP or MoE, the head) skips the padding."""

    def kda(self, layer: int, attn: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor: ...

    def mla(self, layer: int, attn: K3MLA, x: torch.Tensor) -> torch.Tensor: ...


class DenseStates:
    """LayerStates over a K3State (read, not modified) into `new_state` (a K3State, or a
    K3WindowStates that gets every position's KDA state)."""

    def __init__(self, state: K3State, new_state: K3State | K3WindowStates) -> None:
        self.state, self.new_state = state, new_state

    def kda(self, layer: int, attn: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
        state = self.state.kda.get(layer)
        if state is None:
            state = attn.new_state(x.shape[0], x.device)
        if isinstance(self.new_state, K3WindowStates):
            y, self.new_state.kda[layer] = attn.forward_window(x, state)
        else:
            algorithm = "recurrent" if x.shape[1] == 1 else "chunked"
            y, self.new_state.kda[layer] = attn(x, state, algorithm=algorithm)
        return y

    def mla(self, layer: int, attn: K3MLA, x: torch.Tensor) -> torch.Tensor:
        y, self.new_state.mla[layer] = attn(x, self.state.mla.get(layer))
        return y


# --- decoder layer -------------------------------------------------------------------------------


class K3DecoderLayer(nn.Module):
    """`model.layers.{l}`: norms, KDA or MLA, dense MLP or latent MoE, and (if
    attn_res_block_size) the two AttnRes reads, in `k3_layer_tensors` names."""

    def __init__(self, config: K3Config, layer: int, tp: TPContext | None = None) -> None:
        super().__init__()
        tp = tp or TPContext()
        self.config, self.layer_id = config, layer
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_kda = config.is_kda(layer)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        block = config.attn_res_block_size
        if block is not None:
            self.self_attention_res_norm = RMSNorm(h, eps)
            self.self_attention_res_proj = nn.Linear(h, 1, bias=False)
            self.mlp_res_norm = RMSNorm(h, eps)
            self.mlp_res_proj = nn.Linear(h, 1, bias=False)
            self.is_write = layer % block == 0
        self.self_attn: KimiDeltaAttention | K3MLA = (
            KimiDeltaAttention(kda_sizes(config), tp) if self.is_kda else K3MLA(config, tp)
        )
        self.mlp: K3MLP | LatentMoE = (
            LatentMoE(config, tp) if config.is_moe(layer)
            else K3MLP(config, config.intermediate_size, tp)
        )

    def attention(self, x: torch.Tensor, states: LayerStates) -> torch.Tensor:
        """self_attn on its normed input x [B, T, H]; `states` holds what it reads and writes."""
        if self.is_kda:
            assert isinstance(self.self_attn, KimiDeltaAttention)
            return states.kda(self.layer_id, self.self_attn, x)
        assert isinstance(self.self_attn, K3MLA)
        return states.mla(self.layer_id, self.self_attn, x)

    def attn_read(self, bank: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
        """The pre-norm mixture this layer's attention reads (also the previous layer's tap)."""
        return attn_res_mix([*bank, p], self.self_attention_res_norm, self.self_attention_res_proj)

    def forward_attn_res(
        self,
        bank: list[torch.Tensor],
        p: torch.Tensor,
        states: LayerStates,
        read: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer with the Block AttnRes. `bank` (appended to in place at a write layer) and
        p (x0 at layer 0, else the previous layer's partial sum) -> the new partial sum. `read`:
        this layer's `attn_read(bank, p)` when the caller already formed it (a DSpark tap)."""
        a_in = self.input_layernorm(self.attn_read(bank, p) if read is None else read)
        pending: torch.Tensor | None = p
        if self.is_write:  # snapshot the finished block, restart the partial sum
            bank.append(p)
            pending = None
        y = self.attention(a_in, states)
        p = y if pending is None else pending + y
        m_in = self.post_attention_layernorm(
            attn_res_mix([*bank, p], self.mlp_res_norm, self.mlp_res_proj)
        )
        return p + self.mlp(m_in)

    def forward_plain(self, h: torch.Tensor, states: LayerStates) -> torch.Tensor:
        """The plain pre-norm residual layer (attn_res_block_size null)."""
        h = h + self.attention(self.input_layernorm(h), states)
        return h + self.mlp(self.post_attention_layernorm(h))


# --- model ---------------------------------------------------------------------------------------


class K3Model(nn.Module):
    """`model.`: embed_tokens, layers, norm, and the output AttnRes read."""

    def __init__(self, config: K3Config, tp: TPContext | None = None) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.layers = nn.ModuleList(
            K3DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if config.uses_attn_res:
            self.output_attn_res_norm = RMSNorm(h, config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(h, 1, bias=False)

    def output_read(self, bank: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
        return attn_res_mix([*bank, p], self.output_attn_res_norm, self.output_attn_res_proj)

    def forward(
        self,
        input_ids: torch.Tensor,
        state: K3State,
        capture_layers: Sequence[int] = (),
        window: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, K3State | K3WindowStates, dict[int, torch.Tensor]]:
        """input_ids [B, T] -> (h_final [B, T, H] after the final norm, the new state (with
        `window`, the states after every position), taps {layer id: [B, T, H]} for
        `capture_layers`). `inputs_embeds` [B, T, H], when given, is the layers' input instead
        of input_ids' embeddings (an image prompt: its pad positions hold the image's features)."""
        new_state: K3State | K3WindowStates = (
            K3WindowStates(start=state.length) if window
            else K3State(length=state.length + input_ids.shape[1])
        )
        h, taps = self.run(input_ids, DenseStates(state, new_state), capture_layers,
                           inputs_embeds)
        return h, new_state, taps

    def run(
        self, input_ids: torch.Tensor, states: LayerStates, capture_layers: Sequence[int] = (),
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over input_ids [B, T] (or `inputs_embeds` [B, T, H]) with the attention
        state in `states` -> (h_final [B, T, H], taps {layer id: [B, T, H]})."""
        n = len(self.layers)
        wanted = set(capture_layers)
        bad = sorted(i for i in wanted if not 0 <= i < n)
        if bad:
            raise ValueError(f"capture layer ids {bad} outside 0..{n - 1}")
        taps: dict[int, torch.Tensor] = {}
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if not self.config.uses_attn_res:
            for i, layer in enumerate(self.layers):
                h = layer.forward_plain(h, states)
                if i in wanted:
                    taps[i] = h  # the next layer's (pre-norm) input
            return self.norm(h), taps
        bank: list[torch.Tensor] = []
        p = h
        read: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            p = layer.forward_attn_res(bank, p, states, read)
            read = None
            if i in wanted:
                # The tap is the read the next layer (or the output) forms: formed once.
                nxt = self.layers[i + 1] if i + 1 < n else None
                read = nxt.attn_read(bank, p) if nxt is not None else self.output_read(bank, p)
                taps[i] = read
        return self.norm(self.output_read(bank, p) if read is None else read), taps


class K3ForCausalLM(nn.Module):
    """The K3 text model with its LM head (`lm_head`, or the embedding when tied). Parameter
    names and shapes are `k3_tensor_shapes(config)`'s (with `tp`, this rank's shard of them)."""

    def __init__(self, config: K3Config, tp: TPContext | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPContext()
        config.validate_tp(self.tp.size)
        self.model = K3Model(config, self.tp)
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def new_state(self) -> K3State:
        """An empty state (no tokens yet); each layer creates its entry on first use."""
        return K3State()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    def forward(
        self, input_ids: torch.Tensor, state: K3State | None = None
    ) -> tuple[torch.Tensor, K3State]:
        """input_ids [B, T], the next T tokens of B equal-length requests after `state` (None:
        a fresh request; not modified) -> (logits [B, T, V] fp32, the state after them)."""
        h, new_state, _ = self.model(input_ids, state or K3State())
        assert isinstance(new_state, K3State)
        return self.logits(h), new_state

    def capture_layers(
        self, input_ids: torch.Tensor, layer_ids: Sequence[int], state: K3State | None = None
    ) -> tuple[torch.Tensor, K3State, torch.Tensor]:
        """`forward` plus the DSpark taps: [B, T, len(layer_ids)·H], the taps of `layer_ids`
        (in that order) concatenated on the last dim, as SGLang hands them to the draft."""
        h, new_state, taps = self.model(input_ids, state or K3State(), layer_ids)
        assert isinstance(new_state, K3State)
        return self.logits(h), new_state, torch.cat([taps[i] for i in layer_ids], dim=-1)

    def verify(
        self, input_ids: torch.Tensor, state: K3State, layer_ids: Sequence[int] = ()
    ) -> tuple[torch.Tensor, K3WindowStates, torch.Tensor | None]:
        """A speculative verify window: input_ids [B, T] (the bonus token and T-1 drafts)
        after `state` (not modified) -> (logits [B, T, V] fp32, the states after every
        position, the DSpark taps of `layer_ids` as in `capture_layers`, or None). Commit
        `accepted + 1` tokens with `windows.at(accepted)`."""
        h, windows, taps = self.model(input_ids, state, layer_ids, window=True)
        assert isinstance(windows, K3WindowStates)
        cat = torch.cat([taps[i] for i in layer_ids], dim=-1) if layer_ids else None
        return self.logits(h), windows, cat
