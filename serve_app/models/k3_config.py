"""Kimi K3's `config.json` (as published: a `kimi_k3` wrapper holding `text_config`), parsed once.

Field names are exactly the published ones (a copy: `capacity/data/kimi-k3-config.json`), so a
real checkpoint folder is read unchanged; the vision tower is not read.

Layer indices: the published `linear_attn_config.kda_layers` / `full_attn_layers` are **1-based**
(KimiLinear convention). They are kept 1-based on `K3LinearAttnConfig` exactly as published, and
every derived layer property of `K3Config` (`kda_layers`, `mla_layers`, `moe_layers`, `is_kda`,
the Attention Residual bookkeeping, ...) is **0-based**, as SGLang's layer ids are:
`is_kda(i) := (i + 1) in linear_attn_config.kda_layers`.

`k3_tensor_shapes` lists the text model's tensors (SGLang K3 names after its loader's renames,
`srt/models/kimi_k3.py`) and `k3_parameter_count` sums them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.models.config_files import read_config_json, token_id_problems, validate_fields


class K3ConfigError(ValueError):
    """A Kimi K3 config.json that is missing fields or contradicts itself."""


def _layer_list_problems(name: str, layers: tuple[int, ...]) -> list[str]:
    problems = []
    dup = sorted({i for i in layers if layers.count(i) > 1})
    if dup:
        problems.append(f"linear_attn_config.{name} lists layers {dup} more than once")
    low = sorted(i for i in layers if i < 1)
    if low:
        problems.append(f"linear_attn_config.{name} has {low}: the lists are 1-based (>= 1)")
    return problems


class K3LinearAttnConfig(BaseModel):
    """`text_config.linear_attn_config`: the KDA (Kimi Delta Attention) sizes and the layer split.

    `kda_layers` / `full_attn_layers` are 1-based, as published."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    short_conv_kernel_size: int = Field(gt=0)
    # The "safe gate": g = L * sigmoid(...) in (L, 0). Absent = plain KimiLinear softplus gate.
    gate_lower_bound: float | None = None
    # Full-rank KDA output gate `g_proj [P,H]`; False = low-rank `g_a_proj [D,H]`/`g_b_proj [P,D]`.
    use_full_rank_gate: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> K3LinearAttnConfig:
        problems = [*_layer_list_problems("kda_layers", self.kda_layers),
                    *_layer_list_problems("full_attn_layers", self.full_attn_layers)]
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            problems.append(f"gate_lower_bound={self.gate_lower_bound} must be < 0 "
                            "(the decay exp(g) with g in (gate_lower_bound, 0))")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class K3QuantConfig(BaseModel):
    """`text_config.quantization_config` (compressed-tensors; K3 ships MXFP4 routed experts).
    Absent in the miniature and in any unquantized checkpoint."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    quant_method: str
    format: str | None = None
    ignore: tuple[str, ...] = ()

    def ignores(self, module: str) -> bool:
        """Whether `module` stays unquantized: `re:` entries are regexes (full match), others
        exact module names."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return True
            elif module == pattern:
                return True
        return False


class K3Config(BaseModel):
    """Architecture of the Kimi K3 text model (`text_config`): KDA + NoPE-MLA hybrid attention,
    latent MoE with SiTU, and Block Attention Residuals."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    # FFN: dense layers [0, first_k_dense_replace), MoE after (SGLang K3's rule).
    intermediate_size: int = Field(gt=0)
    first_k_dense_replace: int = Field(ge=0)
    # SGLang's K3 ignores it and HF KimiLinear ignores it: only 1 has one meaning.
    moe_layer_freq: Literal[1] = 1
    hidden_act: Literal["situ", "silu"]
    activation_situ_beta: float | None = Field(default=None, gt=0)
    activation_situ_linear_beta: float | None = Field(default=None, gt=0)
    # KDA sizes and the 1-based layer lists.
    linear_attn_config: K3LinearAttnConfig
    # MLA (NoPE: the qk_rope_head_dim part of q/k is position-free).
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int | None = Field(default=None, gt=0)
    q_lora_rank: int | None = Field(default=None, gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(ge=0)
    v_head_dim: int = Field(gt=0)
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    # MoE.
    num_experts: int = Field(gt=0)
    num_experts_per_token: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    routed_expert_hidden_size: int | None = Field(default=None, gt=0)  # None: hidden-space experts
    latent_moe_use_norm: bool = False
    num_shared_experts: int = Field(default=0, ge=0)
    moe_router_activation_func: Literal["sigmoid"] = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = Field(gt=0)
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    # Block Attention Residual; None = plain pre-norm residual.
    attn_res_block_size: int | None = Field(default=None, gt=0)
    num_nextn_predict_layers: int = Field(default=0, ge=0)  # MTP layers: not part of this model
    quantization_config: K3QuantConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    @model_validator(mode="after")
    def _consistent(self) -> K3Config:
        problems: list[str] = []
        lin = self.linear_attn_config
        n = self.num_hidden_layers
        kda, full = set(lin.kda_layers), set(lin.full_attn_layers)
        overlap = sorted(kda & full)
        if overlap:
            problems.append(f"linear_attn_config.kda_layers and full_attn_layers overlap at "
                            f"(1-based) layers {overlap}")
        outside = sorted(i for i in kda | full if i > n)
        if outside:
            problems.append(f"linear_attn_config layer lists name {outside}, beyond "
                            f"num_hidden_layers={n} (1-based: 1..{n})")
        uncovered = sorted(set(range(1, n + 1)) - kda - full)
        if uncovered:
            problems.append(f"linear_attn_config.kda_layers and full_attn_layers together miss "
                            f"(1-based) layers {uncovered}")
        if self.first_k_dense_replace > n:
            problems.append(f"first_k_dense_replace={self.first_k_dense_replace} exceeds "
                            f"num_hidden_layers={n}")
        if self.hidden_act == "situ":
            missing = [k for k in ("activation_situ_beta", "activation_situ_linear_beta")
                       if getattr(self, k) is None]
            if missing:
                problems.append(f"hidden_act='situ' needs {', '.join(missing)}")
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            problems.append(f"num_key_value_heads={self.num_key_value_heads} must equal "
                            f"num_attention_heads={self.num_attention_heads} (MLA expands the "
                            "latent to every head)")
        e, g = self.num_experts, self.num_expert_group
        if e % g:
            problems.append(f"num_experts={e} must be a multiple of num_expert_group={g}")
        if self.topk_group > g:
            problems.append(f"topk_group={self.topk_group} must be <= num_expert_group={g}")
        elif self.num_experts_per_token > self.topk_group * (e // g):
            problems.append(f"num_experts_per_token={self.num_experts_per_token} exceeds the "
                            f"{self.topk_group * (e // g)} selectable experts (topk_group="
                            f"{self.topk_group} of num_expert_group={g} groups of "
                            f"num_experts={e})")
        if self.latent_moe_use_norm and self.routed_expert_hidden_size is None:
            problems.append("latent_moe_use_norm needs routed_expert_hidden_size")
        problems += token_id_problems(self.vocab_size, self.bos_token_id, self.pad_token_id,
                                      self.eos_token_id)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # --- layers (all 0-based) -----------------------------------------------------------------

    def is_kda(self, layer: int) -> bool:
        """SGLang's `is_kda_layer`: the 1-based `kda_layers` list holds layer + 1. Every other
        layer is MLA (`full_attn_layers` is checked here but never consulted by SGLang)."""
        if not 0 <= layer < self.num_hidden_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_hidden_layers - 1}")
        return (layer + 1) in self.linear_attn_config.kda_layers

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-based ids of the KDA layers."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_kda(i))

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-based ids of the full-attention (MLA) layers."""
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_kda(i))

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(range(min(self.first_k_dense_replace, self.num_hidden_layers)))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.num_hidden_layers))

    # --- KDA ----------------------------------------------------------------------------------

    @property
    def kda_num_heads(self) -> int:
        return self.linear_attn_config.num_heads

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config.head_dim

    @property
    def kda_proj_size(self) -> int:
        """P = heads x head_dim: the width of q, k, v, the output gate and the forget gate."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def kda_conv_kernel(self) -> int:
        return self.linear_attn_config.short_conv_kernel_size

    @property
    def kda_gate_lower_bound(self) -> float | None:
        return self.linear_attn_config.gate_lower_bound

    @property
    def kda_full_rank_gate(self) -> bool:
        return self.linear_attn_config.use_full_rank_gate

    # --- MLA ----------------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        """nope + the position-free `qk_rope_head_dim` part (no rotary in K3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def mla_cache_dim(self) -> int:
        """Elements cached per token per MLA layer: normalized latent + the shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # --- MoE ----------------------------------------------------------------------------------

    @property
    def expert_input_size(self) -> int:
        """The routed experts' input/output width: the latent size, or hidden_size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def is_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def shared_intermediate_size(self) -> int:
        """The shared experts form ONE MLP of this width (moe_intermediate_size x count)."""
        return self.moe_intermediate_size * self.num_shared_experts

    def validate_tp(self, tp_size: int) -> None:
        """Every size tensor parallelism splits (heads of KDA and MLA, the dense MLP and the
        shared experts' width, the routed experts) must divide evenly; all problems at once."""
        if tp_size < 1:
            raise K3ConfigError(f"tp_size={tp_size} must be >= 1")
        checks = {
            "linear_attn_config.num_heads": self.kda_num_heads,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
            "moe_intermediate_size * num_shared_experts": self.shared_intermediate_size,
        }
        bad = [f"{k}={v} is not divisible by tp_size={tp_size}" for k, v in checks.items()
               if v % tp_size]
        if bad:
            raise K3ConfigError("tensor parallelism: " + "; ".join(bad))

    @property
    def has_e_score_correction_bias(self) -> bool:
        """`mlp.gate.e_score_correction_bias [E]` exists under noaux_tc routing."""
        return self.topk_method == "noaux_tc"

    # --- Attention Residual (0-based layers; S = attn_res_block_size) -------------------------

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    def _block(self) -> int:
        if self.attn_res_block_size is None:
            raise ValueError("attn_res_block_size is null: the model uses the plain residual")
        return self.attn_res_block_size

    @property
    def attn_res_write_layers(self) -> tuple[int, ...]:
        """Layers whose attention read snapshots the finished block into the bank (l % S == 0)."""
        return tuple(range(0, self.num_hidden_layers, self._block()))

    @property
    def attn_res_blocks(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) layer ranges of the blocks; the last one is the partial sum `p` that
        the output read mixes (it may be shorter than S)."""
        s, n = self._block(), self.num_hidden_layers
        return tuple((a, min(a + s, n)) for a in range(0, n, s))

    @property
    def attn_res_bank_size(self) -> int:
        """Bank rows at the output read: b_0 (the embedding) + the full blocks = cdiv(L, S)."""
        return math.ceil(self.num_hidden_layers / self._block())

    def attn_res_attn_blocks(self, layer: int) -> int:
        """Bank rows mixed by layer `layer`'s attention read (plus `p`): cdiv(l, S)."""
        return math.ceil(layer / self._block())

    def attn_res_mlp_blocks(self, layer: int) -> int:
        """Bank rows mixed by layer `layer`'s FFN read (plus `p`): cdiv(l + 1, S)."""
        return math.ceil((layer + 1) / self._block())

    # --- parsing ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> K3Config:
        """The published wrapper (`model_type` kimi_k3 + `text_config`) or a bare text_config."""
        if "text_config" in raw:
            wrapper = validate_fields(_K3Wrapper, dict(raw), source, "Kimi K3", K3ConfigError)
            return wrapper.text_config
        return validate_fields(cls, dict(raw), source, "Kimi K3 text_config", K3ConfigError)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> K3Config:
        return cls.from_dict(*read_config_json(path, K3ConfigError))


class _K3Wrapper(BaseModel):
    """The multimodal wrapper around text_config; only the text model is read."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: Literal["kimi_k3"]
    text_config: K3Config
    tie_word_embeddings: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> _K3Wrapper:
        tied = self.tie_word_embeddings
        if tied is not None and tied != self.text_config.tie_word_embeddings:
            raise ValueError(f"tie_word_embeddings={tied} disagrees with text_config."
                             f"tie_word_embeddings={self.text_config.tie_word_embeddings}")
        return self


# --- tensors and parameter count ----------------------------------------------------------------

Shape = tuple[int, ...]


def _kda_tensors(c: K3Config, a: str) -> Iterator[tuple[str, Shape]]:
    h, heads, d, p = c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.kda_proj_size
    for name in ("q_proj", "k_proj", "v_proj"):
        yield f"{a}.{name}.weight", (p, h)
    if c.kda_full_rank_gate:
        yield f"{a}.g_proj.weight", (p, h)
    else:
        yield f"{a}.g_a_proj.weight", (d, h)
        yield f"{a}.g_b_proj.weight", (p, d)
    yield f"{a}.b_proj.weight", (heads, h)
    yield f"{a}.f_a_proj.weight", (d, h)
    yield f"{a}.f_b_proj.weight", (p, d)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        yield f"{a}.{name}.weight", (p, 1, c.kda_conv_kernel)
    yield f"{a}.A_log", (heads,)
    yield f"{a}.dt_bias", (p,)
    yield f"{a}.o_norm.weight", (d,)
    yield f"{a}.o_proj.weight", (h, p)


def _mla_tensors(c: K3Config, a: str) -> Iterator[tuple[str, Shape]]:
    h, n = c.hidden_size, c.num_attention_heads
    if c.q_lora_rank is not None:
        yield f"{a}.q_a_proj.weight", (c.q_lora_rank, h)
        yield f"{a}.q_a_layernorm.weight", (c.q_lora_rank,)
        yield f"{a}.q_b_proj.weight", (n * c.qk_head_dim, c.q_lora_rank)
    else:
        yield f"{a}.q_proj.weight", (n * c.qk_head_dim, h)
    yield f"{a}.kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h)
    yield f"{a}.kv_a_layernorm.weight", (c.kv_lora_rank,)
    yield f"{a}.kv_b_proj.weight", (n * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    yield f"{a}.o_proj.weight", (h, n * c.v_head_dim)
    if c.mla_use_output_gate:
        yield f"{a}.g_proj.weight", (n * c.v_head_dim, h)


def _mlp_tensors(m: str, inter: int, h: int) -> Iterator[tuple[str, Shape]]:
    yield f"{m}.gate_proj.weight", (inter, h)
    yield f"{m}.up_proj.weight", (inter, h)
    yield f"{m}.down_proj.weight", (h, inter)


def _moe_tensors(c: K3Config, m: str) -> Iterator[tuple[str, Shape]]:
    h, e, inter, lat = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.expert_input_size
    yield f"{m}.gate.weight", (e, h)
    if c.has_e_score_correction_bias:
        yield f"{m}.gate.e_score_correction_bias", (e,)
    for i in range(e):
        yield f"{m}.experts.{i}.w1.weight", (inter, lat)
        yield f"{m}.experts.{i}.w3.weight", (inter, lat)
        yield f"{m}.experts.{i}.w2.weight", (lat, inter)
    if c.num_shared_experts:
        yield from _mlp_tensors(f"{m}.shared_experts", c.shared_intermediate_size, h)
    if c.is_latent_moe:
        yield f"{m}.routed_expert_down_proj.weight", (lat, h)
        if c.latent_moe_use_norm:
            yield f"{m}.routed_expert_norm.weight", (lat,)
        yield f"{m}.routed_expert_up_proj.weight", (h, lat)


def k3_layer_tensors(c: K3Config, layer: int) -> Iterator[tuple[str, Shape]]:
    """(name, shape) of every tensor of decoder layer `layer` (0-based), SGLang K3 names."""
    h, p = c.hidden_size, f"model.layers.{layer}"
    yield f"{p}.input_layernorm.weight", (h,)
    yield f"{p}.post_attention_layernorm.weight", (h,)
    if c.uses_attn_res:
        for sub in ("self_attention_res", "mlp_res"):
            yield f"{p}.{sub}_norm.weight", (h,)
            yield f"{p}.{sub}_proj.weight", (1, h)
    attn = _kda_tensors if c.is_kda(layer) else _mla_tensors
    yield from attn(c, f"{p}.self_attn")
    if c.is_moe(layer):
        yield from _moe_tensors(c, f"{p}.mlp")
    else:
        yield from _mlp_tensors(f"{p}.mlp", c.intermediate_size, h)


def k3_tensor_shapes(c: K3Config) -> Iterator[tuple[str, Shape]]:
    """(name, shape) of every tensor of the text model, in checkpoint order (embedding, layers,
    final norms, lm_head unless tied). MTP layers (`num_nextn_predict_layers`) are excluded."""
    h = c.hidden_size
    yield "model.embed_tokens.weight", (c.vocab_size, h)
    for layer in range(c.num_hidden_layers):
        yield from k3_layer_tensors(c, layer)
    yield "model.norm.weight", (h,)
    if c.uses_attn_res:
        yield "model.output_attn_res_norm.weight", (h,)
        yield "model.output_attn_res_proj.weight", (1, h)
    if not c.tie_word_embeddings:
        yield "lm_head.weight", (c.vocab_size, h)


def k3_parameter_count(c: K3Config) -> int:
    """Total parameters of the text model, summed over `k3_tensor_shapes`."""
    return sum(math.prod(shape) for _, shape in k3_tensor_shapes(c))
