"""The target model's `config.json` (Hugging Face DeepseekV3 / Kimi K2 layout), parsed once.

Field names are exactly the Hugging Face ones so a real checkpoint folder is read as published.
Everything the model derives from the config (YaRN factors, which layers are MoE, which weights
are FP8, the tensor-parallel split) is computed here, in one place, from these fields.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.models.config_files import read_config_json, token_id_problems, validate_fields


class KimiConfigError(ValueError):
    """A Kimi/DeepseekV3 config.json that is missing fields or contradicts itself."""


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude correction (SGLang `yarn_get_mscale`, HF `yarn_get_mscale`)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _rope_kind(scaling: Any) -> Any:
    """A rope scaling dict's type ('deepseek_yarn' is YaRN), None for no scaling."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        return scaling
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default") and not set(scaling) - {"rope_type", "type"}:
        return None
    return "yarn" if kind == "deepseek_yarn" else kind


def _same(a: Any, b: Any) -> bool:
    """Equal, with 50000 and 50000.0 the same number."""
    if all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b)):
        return float(a) == float(b)
    return a == b


def _merge_rope_parameters(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    """transformers 5 writes `rope_parameters` (`rope_theta` plus the scaling fields) instead
    of `rope_theta` / `rope_scaling`. Fills the legacy fields from it where they are absent (in
    `data`, in place); where both are present they must agree. Returns (the disagreements, the
    legacy fields filled from rope_parameters)."""
    if "rope_parameters" not in data:
        return [], []
    params = data.pop("rope_parameters")
    if params is None:
        return [], []
    if not isinstance(params, dict):
        return [f"rope_parameters: must be an object, got {params!r}"], []
    problems: list[str] = []
    filled: list[str] = []
    if "rope_theta" in params:
        if "rope_theta" not in data:
            data["rope_theta"] = params["rope_theta"]
            filled.append("rope_theta")
        elif not _same(data["rope_theta"], params["rope_theta"]):
            problems.append(f"rope_theta={data['rope_theta']!r} and rope_parameters.rope_theta="
                            f"{params['rope_theta']!r} disagree")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if _rope_kind(scaling) is None:
        scaling = None
    if "rope_scaling" not in data:
        data["rope_scaling"] = scaling
        filled.append("rope_scaling")
        return problems, filled
    legacy = data["rope_scaling"]
    legacy_kind, kind = _rope_kind(legacy), _rope_kind(scaling)
    if legacy_kind != kind:
        problems.append(f"rope_scaling (type {legacy_kind!r}) and rope_parameters (type "
                        f"{kind!r}) disagree")
    elif isinstance(legacy, dict) and isinstance(scaling, dict):
        differ = [f"{k} {legacy[k]!r} vs {scaling[k]!r}"
                  for k in sorted(set(legacy) & set(scaling) - {"rope_type", "type"})
                  if not _same(legacy[k], scaling[k])]
        if differ:
            problems.append("rope_scaling and rope_parameters disagree: " + ", ".join(differ))
    return problems, filled


class Fp8QuantConfig(BaseModel):
    """DeepSeek-style FP8 block quantization: `*.weight` in F8_E4M3 plus an F32
    `*.weight_scale_inv` of shape [ceil(out/bn), ceil(in/bk)] that multiplies each block back."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    quant_method: Literal["fp8"]
    fmt: Literal["e4m3"] = "e4m3"
    activation_scheme: Literal["dynamic"] = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)
    # SGLang reads `ignored_layers`; transformers' FineGrainedFP8 writes `modules_to_not_convert`.
    ignored_layers: tuple[str, ...] = ()
    modules_to_not_convert: tuple[str, ...] = ()

    @field_validator("weight_block_size")
    @classmethod
    def _positive_blocks(cls, v: tuple[int, int]) -> tuple[int, int]:
        if min(v) <= 0:
            raise ValueError(f"weight_block_size {list(v)} must be two positive integers")
        return v

    def ignores(self, module: str) -> bool:
        names = (*self.ignored_layers, *self.modules_to_not_convert)
        return any(module == n or module.startswith(n + ".") for n in names)


class KimiConfig(BaseModel):
    """Architecture of a DeepseekV3-style decoder (Kimi K2): MLA attention + sigmoid-routed MoE."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    q_lora_rank: int | None = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    n_routed_experts: int = Field(gt=0)
    n_shared_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int = Field(gt=0)
    first_k_dense_replace: int = Field(default=0, ge=0)
    moe_layer_freq: int = Field(default=1, gt=0)
    norm_topk_prob: bool
    routed_scaling_factor: float = Field(gt=0)
    scoring_func: Literal["sigmoid", "softmax"] = "sigmoid"
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    n_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: Literal[False] = False
    quantization_config: Fp8QuantConfig | None = None
    # Multi-token-prediction layers stored after the decoder layers (DeepSeek V3); not run here.
    num_nextn_predict_layers: int = Field(default=0, ge=0)
    hidden_act: Literal["silu"] = "silu"
    attention_bias: Literal[False] = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    @field_validator("rope_scaling")
    @classmethod
    def _rope_scaling(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return None
        kind = v.get("rope_type", v.get("type"))
        if kind == "default":
            return None
        if kind not in ("yarn", "deepseek_yarn"):
            raise ValueError(f"type {kind!r} is not supported; allowed: 'yarn' or null")
        missing = [k for k in ("factor", "original_max_position_embeddings") if k not in v]
        if missing:
            raise ValueError(f"yarn needs {', '.join(missing)}")
        if float(v["factor"]) <= 0:
            raise ValueError(f"factor={v['factor']} must be > 0")
        return dict(v)

    @model_validator(mode="after")
    def _consistent(self) -> KimiConfig:
        problems: list[str] = []
        if self.n_routed_experts % self.n_group:
            problems.append(
                f"n_routed_experts={self.n_routed_experts} must be a multiple of "
                f"n_group={self.n_group}"
            )
        elif self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            problems.append("grouped top-k scores each group by its top-2 experts: need >= 2 "
                            "experts per group (n_routed_experts / n_group)")
        if self.topk_group > self.n_group:
            problems.append(f"topk_group={self.topk_group} must be <= n_group={self.n_group}")
        elif self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            problems.append(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in "
                f"topk_group={self.topk_group} groups"
            )
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary)")
        if self.first_k_dense_replace > self.num_hidden_layers:
            problems.append(
                f"first_k_dense_replace={self.first_k_dense_replace} exceeds "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        problems += token_id_problems(self.vocab_size, self.bos_token_id, self.pad_token_id,
                                      self.eos_token_id)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # --- derived quantities -------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Elements cached per token per layer: normalized latent + rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        # HF DeepseekV3DecoderLayer's rule, verbatim.
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The `layers.rope_inv_freq` argument (only its inverse frequencies are used: the
        magnitude factors follow DeepSeek's defaults, see `rope_attention_factor`)."""
        if self.rope_scaling is None:
            return {"rope_theta": self.rope_theta, "rope_type": "default"}
        return {**self.rope_scaling, "rope_theta": self.rope_theta, "rope_type": "yarn"}

    @property
    def rope_attention_factor(self) -> float:
        """cos/sin scale: mscale(factor, mscale) / mscale(factor, mscale_all_dim), with SGLang's
        DeepseekScalingRotaryEmbedding defaults (mscale 1, mscale_all_dim 0, attn_factor 1)."""
        rs = self.rope_scaling
        if rs is None:
            return 1.0
        factor = float(rs["factor"])
        return (
            yarn_mscale(factor, float(rs.get("mscale", 1.0)))
            / yarn_mscale(factor, float(rs.get("mscale_all_dim") or 0.0))
            * float(rs.get("attn_factor", 1.0))
        )

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (SGLang
        `compute_mla_mscale_scaling`, HF DeepseekV3Attention)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is None or not rs.get("apply_yarn_scaling", True):
            return scale
        m = yarn_mscale(float(rs["factor"]), float(rs.get("mscale_all_dim") or 0.0))
        return scale * m * m

    def is_fp8_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor is stored FP8 with a `_scale_inv` beside it: every linear
        projection inside the decoder layers, except the router (`mlp.gate`) and ignored modules;
        norms, embeddings and lm_head stay high precision (DeepSeek V3 / Kimi K2 convention)."""
        q = self.quantization_config
        if q is None or not name.startswith("model.layers.") or not name.endswith(".weight"):
            return False
        module = name.removesuffix(".weight")
        if not module.endswith(("_proj", "_proj_with_mqa")):
            return False
        return not q.ignores(module)

    def validate_tp(self, tp_size: int) -> None:
        """Every size that tensor parallelism divides must divide evenly; all problems at once."""
        if tp_size < 1:
            raise KimiConfigError(f"tp_size={tp_size} must be >= 1")
        checks = {
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "n_routed_experts": self.n_routed_experts,
            "moe_intermediate_size * n_shared_experts": self.shared_intermediate_size,
        }
        bad = [f"{k}={v} is not divisible by tp_size={tp_size}" for k, v in checks.items()
               if v % tp_size]
        if bad:
            raise KimiConfigError("tensor parallelism: " + "; ".join(bad))

    # --- parsing ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> KimiConfig:
        data = dict(raw)
        # transformers v5 writes `dtype` instead of `torch_dtype`.
        if "torch_dtype" not in data and "dtype" in data:
            data["torch_dtype"] = data["dtype"]
        rope_problems, from_parameters = _merge_rope_parameters(data)
        try:
            config = validate_fields(cls, data, source, "Kimi/DeepseekV3", KimiConfigError)
        except KimiConfigError as exc:
            msg = str(exc)
            for name in from_parameters:  # a value that came from rope_parameters is named so
                msg = msg.replace(f"\n  - {name}:", f"\n  - rope_parameters ({name}):")
            raise KimiConfigError("".join([msg, *(f"\n  - {p}" for p in rope_problems)])) from None
        if rope_problems:
            raise KimiConfigError(f"{source}: invalid Kimi/DeepseekV3 config:\n  - "
                                  + "\n  - ".join(rope_problems))
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KimiConfig:
        return cls.from_dict(*read_config_json(path, KimiConfigError))

    def to_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude_none=False)
        if data["quantization_config"] is None:
            del data["quantization_config"]
        else:
            q = data["quantization_config"]
            for key in ("ignored_layers", "modules_to_not_convert"):
                if not q[key]:
                    del q[key]
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", **data}
