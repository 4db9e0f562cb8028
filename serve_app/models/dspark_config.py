"""The DSpark draft's `config.json`, parsed once into a validated pydantic model.

DSpark settings may live in three places (SGLang reads all of them): the nested `dflash_config`,
top-level `markov_*` keys, and `dspark_*`-prefixed top-level keys. A value given in two places
must agree; otherwise the error names both places.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from capacity.dspark_keys import DSPARK_KEYS, dspark_settings
from capacity.errors import CapacityError
from serve_app.models.config_files import read_config_json, validate_fields

if TYPE_CHECKING:
    from serve_app.models.k3_config import K3Config
    from serve_app.models.kimi_config import KimiConfig


# Settings that may appear in dflash_config / markov_* / dspark_* (besides the Qwen3 body).
class DSparkConfigError(ValueError):
    """A DSpark config.json that is missing fields or contradicts itself."""


class DSparkConfig(BaseModel):
    """Architecture of a DSpark draft: N Qwen3-style layers over fc-projected target taps."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    max_position_embeddings: int = Field(gt=0)
    rope_parameters: dict[str, Any] = Field(default_factory=lambda: {"rope_theta": 10000.0})
    hidden_act: Literal["silu"] = "silu"
    attention_bias: Literal[False] = False

    block_size: int = Field(gt=0, le=64)
    num_target_layers: int = Field(gt=0)
    target_layer_ids: tuple[int, ...] = Field(min_length=1)
    target_hidden_size: int = Field(gt=0)
    mask_token_id: int = Field(ge=0)
    markov_rank: int = Field(default=0, ge=0)
    markov_head_type: Literal["vanilla", "none"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_head_alpha: float = 1.0
    projector_type: Literal["dspark"] = "dspark"
    attention_mode: Literal["gqa"] = "gqa"

    eos_token_id: int | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    @property
    def has_markov(self) -> bool:
        return self.markov_head_type == "vanilla" and self.markov_rank > 0

    @property
    def gamma(self) -> int:
        """Drafts per step (SGLang's `speculative_dspark_block_size`)."""
        return self.block_size

    @model_validator(mode="after")
    def _consistent(self) -> DSparkConfig:
        problems: list[str] = []
        bad_layers = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad_layers:
            problems.append(
                f"target_layer_ids {list(bad_layers)} must be in [0, num_target_layers="
                f"{self.num_target_layers})"
            )
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} has duplicates")
        if self.mask_token_id >= self.vocab_size:
            problems.append(
                f"mask_token_id={self.mask_token_id} must be < vocab_size={self.vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even (rotary embedding)")
        if self.markov_head_type == "vanilla" and self.markov_rank == 0:
            problems.append("markov_head_type='vanilla' needs markov_rank > 0")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def validate_tp(self, tp_size: int) -> None:
        """Every size tensor parallelism splits must split evenly (when there are more ranks
        than KV heads, each rank keeps one KV head, so one of the two must divide the other);
        all problems at once."""
        problems = []
        if self.num_attention_heads % tp_size:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible "
                            f"by tp_size={tp_size}")
        if self.num_key_value_heads % tp_size and tp_size % self.num_key_value_heads:
            problems.append(f"num_key_value_heads={self.num_key_value_heads} and "
                            f"tp_size={tp_size}: one must divide the other")
        if self.intermediate_size % tp_size:
            problems.append(f"intermediate_size={self.intermediate_size} is not divisible by "
                            f"tp_size={tp_size}")
        if problems:
            raise DSparkConfigError("tensor parallelism: " + "; ".join(problems))

    # --- parsing ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> DSparkConfig:
        flat = _resolve_dspark_keys(raw, source)
        return validate_fields(cls, flat, source, "DSpark", DSparkConfigError)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> DSparkConfig:
        return cls.from_dict(*read_config_json(path, DSparkConfigError))

    def to_dict(self) -> dict[str, Any]:
        """The published layout: Qwen3 body at top level, DSpark settings in `dflash_config`."""
        data = self.model_dump(mode="json")
        top_level = ("block_size", "num_target_layers")
        dflash = {k: data.pop(k) for k in DSPARK_KEYS if k not in top_level}
        return {"architectures": ["DSparkDraftModel"], "model_type": "qwen3", **data,
                "dflash_config": dflash}


def _resolve_dspark_keys(raw: dict[str, Any], source: str) -> dict[str, Any]:
    flat = {k: v for k, v in raw.items() if k != "dflash_config" and not k.startswith("dspark_")}
    try:
        flat.update(dspark_settings(raw, source))
    except CapacityError as exc:
        raise DSparkConfigError(str(exc)) from None
    if "head_dim" not in flat and "hidden_size" in flat and "num_attention_heads" in flat:
        flat["head_dim"] = flat["hidden_size"] // flat["num_attention_heads"]
    if "target_hidden_size" not in flat and "hidden_size" in flat:
        flat["target_hidden_size"] = flat["hidden_size"]
    if "rope_parameters" not in flat:
        # Older Qwen3 configs: rope_theta + rope_scaling instead of rope_parameters.
        rope = dict(flat.get("rope_scaling") or {})
        rope["rope_theta"] = flat.get("rope_theta", 10000.0)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        flat["rope_parameters"] = rope
    if "dtype" not in flat and "torch_dtype" in flat:
        flat["dtype"] = flat["torch_dtype"]
    return flat


def check_pair(t: KimiConfig | K3Config, d: DSparkConfig, gamma: int | None = None) -> None:
    """The draft must fit the target it runs beside; every mismatch is named."""
    problems = []
    bad = [i for i in d.target_layer_ids if i >= t.num_hidden_layers]
    if bad:
        problems.append(f"draft target_layer_ids {bad} do not exist in the target "
                        f"(num_hidden_layers={t.num_hidden_layers})")
    if d.num_target_layers != t.num_hidden_layers:
        problems.append(f"draft num_target_layers={d.num_target_layers} != target "
                        f"num_hidden_layers={t.num_hidden_layers}")
    if d.vocab_size != t.vocab_size:
        problems.append(f"draft vocab_size={d.vocab_size} != target vocab_size={t.vocab_size}")
    if d.target_hidden_size != t.hidden_size:
        problems.append(f"draft target_hidden_size={d.target_hidden_size} != target "
                        f"hidden_size={t.hidden_size}")
    if d.hidden_size != t.hidden_size:
        problems.append(f"draft hidden_size={d.hidden_size} != target hidden_size="
                        f"{t.hidden_size} (the draft embeds with the target's embedding)")
    if gamma is not None and gamma > d.block_size:
        problems.append(f"engine.reference.speculation.gamma={gamma} exceeds the draft's "
                        f"block_size={d.block_size}")
    if problems:
        raise ValueError("draft and target do not match: " + "; ".join(problems))


def pair_context(t: KimiConfig | K3Config, d: DSparkConfig | None, drafting: bool) -> int:
    """The longest context the pair serves: the target's, and the draft's too while it drafts
    (with speculation off the draft sees no token). The one rule for the config's context
    length, the deployment check and the engine's own limit."""
    if d is None or not drafting:
        return t.max_position_embeddings
    return min(t.max_position_embeddings, d.max_position_embeddings)
