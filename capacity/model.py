"""Model descriptors: every weight tensor of a model as groups of identical matrices, so
parameter counts, bytes per weight format, KV bytes per token and recurrent-state sizes are exact
sums rather than rules of thumb.

Descriptors are built from Hugging Face config.json files by capacity.families (one parser per
model family).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any

from capacity.errors import CapacityError
from capacity.formats import KV_DTYPE_BYTES, KvDtype, WeightFormat, matrix_bytes

KDA_STATE_BYTES = 4  # the KDA recurrent state is kept in FP32 by the Kimi Linear kernels
CONV_STATE_BYTES = 2  # the short-conv state is kept in the model dtype (BF16)


class Component(StrEnum):
    ATTENTION = "attention"
    KDA = "kda"
    DENSE_MLP = "dense_mlp"
    ROUTED_EXPERTS = "routed_experts"
    SHARED_EXPERTS = "shared_experts"
    LATENT_PROJECTION = "latent_projection"
    ROUTER = "router"
    EMBEDDINGS = "embeddings"
    LM_HEAD = "lm_head"
    NORMS = "norms"
    DRAFT_FC = "draft_fc"
    DRAFT_HEADS = "draft_heads"
    VISION_TOWER = "vision_tower"
    MM_PROJECTOR = "mm_projector"


class Sharding(StrEnum):
    """How a tensor is divided across the GPUs of one pipeline stage."""

    ATTENTION = "attention"  # by attention TP; replicated across attention-DP ranks
    DENSE = "dense"  # by the whole stage (SGLang's dense/shared/vocab TP group)
    EXPERT = "expert"  # by expert parallelism (and MoE TP inside an EP group)
    REPLICATED = "replicated"  # norms and other vectors: every GPU holds a copy


COMPONENT_SHARDING: dict[Component, Sharding] = {
    Component.ATTENTION: Sharding.ATTENTION,
    Component.KDA: Sharding.ATTENTION,
    Component.DENSE_MLP: Sharding.DENSE,
    Component.ROUTED_EXPERTS: Sharding.EXPERT,
    Component.SHARED_EXPERTS: Sharding.DENSE,
    Component.LATENT_PROJECTION: Sharding.DENSE,
    Component.ROUTER: Sharding.REPLICATED,
    Component.EMBEDDINGS: Sharding.DENSE,
    Component.LM_HEAD: Sharding.DENSE,
    Component.NORMS: Sharding.REPLICATED,
    Component.DRAFT_FC: Sharding.ATTENTION,
    Component.DRAFT_HEADS: Sharding.ATTENTION,
    # SGLang builds K3's tower and projector whole on every rank (capacity.vision).
    Component.VISION_TOWER: Sharding.REPLICATED,
    Component.MM_PROJECTOR: Sharding.REPLICATED,
}


class Family(StrEnum):
    KIMI_K3 = "kimi_k3"
    DEEPSEEK_V3 = "deepseek_v3"
    DSPARK_DRAFT = "dspark_draft"


@dataclass(frozen=True)
class TensorGroup:
    """`count` identical [rows, cols] weights; cols is the input (quantization) axis.

    `quantizable` is False for tensors no checkpoint format quantizes: vectors, embeddings,
    routers, and the lm_head (kept in 16-bit by DeepSeek FP8 and compressed-tensors alike).
    """

    module: str
    component: Component
    rows: int
    cols: int = 1
    count: int = 1
    quantizable: bool = True

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class LayerKind:
    attention: str  # "mla", "kda" or "gqa"
    ffn: str  # "dense" or "moe"


@dataclass(frozen=True)
class MlaShape:
    heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class KdaShape:
    heads: int
    head_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    expert_input: int  # hidden size, or the latent width for K3's latent MoE
    expert_intermediate: int


@dataclass(frozen=True)
class GqaShape:
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class DraftInfo:
    block_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    # SGLang's adaptive (ragged) verify schedules from it and refuses a draft without one.
    confidence_head: bool = False


# The vision tower and the image limits a descriptor carries; capacity/vision.py sizes
# images and the tower's work from them.
VISION_WEIGHT_BYTES = 2  # BF16, the checkpoint dtype (config.json "dtype": "bfloat16")
MEDIA_KEYS = ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side")


@dataclass(frozen=True)
class MediaLimits:
    """`media_proc_cfg`'s image keys: what an image becomes before the tower."""

    patch_size: int
    merge_kernel_size: int
    in_patch_limit: int
    patch_limit_on_one_side: int
    fixed_output_tokens: int | None
    source: str

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str) -> MediaLimits:
        bad = [k for k in MEDIA_KEYS
               if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool) or cfg[k] <= 0]
        if bad:
            raise CapacityError(f"{source}: media_proc_cfg needs positive integers for: "
                                f"{', '.join(bad)}")
        fixed = cfg.get("fixed_output_tokens")
        if fixed is not None and (not isinstance(fixed, int) or fixed <= 0):
            raise CapacityError(f"{source}: media_proc_cfg.fixed_output_tokens must be null or a "
                                f"positive integer, got {fixed!r}")
        return cls(cfg["patch_size"], cfg["merge_kernel_size"], cfg["in_patch_limit"],
                   cfg["patch_limit_on_one_side"], fixed, source)


@dataclass(frozen=True)
class VisionTower:
    """MoonViT-V2 + patchmergerv2, every tensor as TensorGroups (counted from vision_config)."""

    hidden: int  # D, vt_hidden_size
    layers: int
    heads: int
    qkv_hidden: int  # attention width (heads x head dim), 1536 for K3: not D
    intermediate: int
    patch_size: int
    merge_area: int  # merge_kernel_size h x w
    projector_in: int  # mm_hidden_size x merge area
    text_hidden: int
    tower_groups: tuple[TensorGroup, ...]
    projector_groups: tuple[TensorGroup, ...]

    @property
    def tower_params(self) -> int:
        return sum(g.params for g in self.tower_groups)

    @property
    def projector_params(self) -> int:
        return sum(g.params for g in self.projector_groups)

    @property
    def params(self) -> int:
        return self.tower_params + self.projector_params

    @property
    def tower_bytes(self) -> int:
        return self.tower_params * VISION_WEIGHT_BYTES

    @property
    def projector_bytes(self) -> int:
        return self.projector_params * VISION_WEIGHT_BYTES

    def tower_flops(self, patches: int) -> float:
        """One image of `patches` patches through the tower (attention is per image, full,
        non-causal): patch embedding, then per layer qkv + wo + fc0 + fc1 and QK^T + AV."""
        embed = 2 * patches * 3 * self.patch_size**2 * self.hidden
        linear = 2 * patches * self.hidden * (4 * self.qkv_hidden + 2 * self.intermediate)
        attention = 4 * float(patches) ** 2 * self.qkv_hidden
        return embed + self.layers * (linear + attention)

    def projector_flops(self, tokens: int) -> float:
        """proj.0 (4D -> 4D) and proj.2 (4D -> text hidden) over the merged tokens."""
        return 2 * tokens * self.projector_in * (self.projector_in + self.text_hidden)

    def activation_bytes(self, patches: int) -> int:
        """Peak live activations of one tower call over `patches` patches (an estimate, like
        the text model's workspace; BF16 unless said): the pixels (3 p^2) and the position
        embeddings (D) beside the busiest layer phase, attention: residual + normed input (2D),
        qkv (3 x qkv), q and k rotated in FP32 (2 x qkv at twice the width) and the attention
        output (qkv). The flash / triton varlen kernels SGLang picks hold no P x P scores. The
        projector phase (4D in, 4D hidden and GELU, text-hidden out and norm, per token = per
        merge-area patches) is smaller for K3 but taken if larger."""
        pixels = 3 * self.patch_size**2
        attention = 2 * self.hidden + 3 * self.qkv_hidden + 4 * self.qkv_hidden + self.qkv_hidden
        mlp = 2 * self.hidden + 2 * self.intermediate
        tower = patches * (pixels + self.hidden + max(attention, mlp))
        projector = patches // self.merge_area * (3 * self.projector_in + 2 * self.text_hidden)
        return max(tower, projector) * VISION_WEIGHT_BYTES


@dataclass(frozen=True, eq=False)
class ModelDescriptor:
    """Every number the planner needs about one model, derived from its config.json."""

    name: str
    family: Family
    source: str
    hidden_size: int
    vocab_size: int
    max_context: int
    layers: tuple[LayerKind, ...]
    layer_groups: Mapping[LayerKind, tuple[TensorGroup, ...]]
    global_groups: tuple[TensorGroup, ...]
    native_format: WeightFormat
    ignore_patterns: tuple[str, ...]
    mla: MlaShape | None = None
    kda: KdaShape | None = None
    moe: MoeShape | None = None
    gqa: GqaShape | None = None
    draft: DraftInfo | None = None
    # K3's image path (config.json's vision_config, preprocessor_config.json's limits): kept
    # apart from the text model's tensor groups, which the decode-time model streams.
    vision: VisionTower | None = None
    media: MediaLimits | None = None
    _bytes_cache: dict[tuple[str, Any], Any] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    # ---- parameter counts -------------------------------------------------------------
    @cached_property
    def layer_counts(self) -> dict[LayerKind, int]:
        counts: dict[LayerKind, int] = {}
        for kind in self.layers:
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def _all_groups(self) -> Iterable[tuple[TensorGroup, int]]:
        for kind, n_layers in self.layer_counts.items():
            for group in self.layer_groups[kind]:
                yield group, n_layers
        for group in self.global_groups:
            yield group, 1

    @cached_property
    def params_by_component(self) -> dict[Component, int]:
        totals: dict[Component, int] = {}
        for group, multiplier in self._all_groups():
            totals[group.component] = totals.get(group.component, 0) + group.params * multiplier
        return totals

    @property
    def total_params(self) -> int:
        return sum(self.params_by_component.values())

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies through: top-k of the routed experts, no embedding."""
        by_component = self.params_by_component
        routed = by_component.get(Component.ROUTED_EXPERTS, 0)
        active_routed = routed * self.moe.top_k // self.moe.experts if self.moe else 0
        return (
            self.total_params - routed + active_routed - by_component.get(Component.EMBEDDINGS, 0)
        )

    @cached_property
    def moe_layers(self) -> int:
        return sum(1 for kind in self.layers if kind.ffn == "moe")

    @cached_property
    def mla_layers(self) -> int:
        return sum(1 for kind in self.layers if kind.attention == "mla")

    @cached_property
    def kda_layers(self) -> int:
        return sum(1 for kind in self.layers if kind.attention == "kda")

    @property
    def is_draft(self) -> bool:
        return self.family is Family.DSPARK_DRAFT

    # ---- bytes --------------------------------------------------------------------------
    def is_quantized(self, group: TensorGroup, fmt: WeightFormat) -> bool:
        if fmt is WeightFormat.BF16 or not group.quantizable:
            return False
        return not any(_pattern_matches(p, group.module) for p in self.ignore_patterns)

    def group_bytes(self, group: TensorGroup, fmt: WeightFormat | None = None) -> int:
        fmt = fmt or self.native_format
        stored = fmt if self.is_quantized(group, fmt) else WeightFormat.BF16
        return matrix_bytes(stored, group.rows, group.cols) * group.count

    def bytes_by_component(self, fmt: WeightFormat | None = None) -> dict[Component, int]:
        fmt = fmt or self.native_format
        key = ("components", fmt)
        if key not in self._bytes_cache:
            totals: dict[Component, int] = {}
            for group, multiplier in self._all_groups():
                size = self.group_bytes(group, fmt) * multiplier
                totals[group.component] = totals.get(group.component, 0) + size
            self._bytes_cache[key] = totals
        return dict(self._bytes_cache[key])

    def total_bytes(self, fmt: WeightFormat | None = None) -> int:
        return sum(self.bytes_by_component(fmt).values())

    def layer_component_bytes(
        self, kind: LayerKind, fmt: WeightFormat | None = None
    ) -> dict[Component, int]:
        """Bytes of one layer of this kind, per component."""
        fmt = fmt or self.native_format
        key = ("layer", (kind, fmt))
        if key not in self._bytes_cache:
            self._bytes_cache[key] = _component_bytes(self, self.layer_groups[kind], fmt)
        return self._bytes_cache[key]

    def global_component_bytes(self, fmt: WeightFormat | None = None) -> dict[Component, int]:
        """Bytes of the model-level tensors (embeddings, lm_head, final norms, draft heads)."""
        fmt = fmt or self.native_format
        key = ("global", fmt)
        if key not in self._bytes_cache:
            self._bytes_cache[key] = _component_bytes(self, self.global_groups, fmt)
        return self._bytes_cache[key]

    def expert_bytes(self, fmt: WeightFormat | None = None) -> int:
        """Bytes of one routed expert in one layer (the unit of MoE weight traffic)."""
        if self.moe is None:
            return 0
        fmt = fmt or self.native_format
        for kind, groups in self.layer_groups.items():
            if kind.ffn == "moe":
                routed = [g for g in groups if g.component is Component.ROUTED_EXPERTS]
                return sum(self.group_bytes(g, fmt) for g in routed) // self.moe.experts
        return 0

    # ---- caches -------------------------------------------------------------------------
    def kv_bytes_per_token(self, kv_dtype: KvDtype = KvDtype.BF16) -> int:
        """MLA latent cache for all MLA layers (what one attention-TP rank holds per token)."""
        if self.mla is None:
            return 0
        per_layer = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return per_layer * self.mla_layers * KV_DTYPE_BYTES[kv_dtype]

    def _kda_heads_per_rank(self, attention_tp: int) -> int:
        assert self.kda is not None
        if attention_tp <= 0 or self.kda.heads % attention_tp:
            raise CapacityError(
                f"attention_tp ({attention_tp}) must divide {self.name}'s {self.kda.heads} KDA "
                "heads"
            )
        return self.kda.heads // attention_tp

    def kda_layer_conv_bytes(self, conv_bytes: int = CONV_STATE_BYTES,
                             attention_tp: int = 1) -> int:
        """Short-conv state of one KDA layer on one attention-TP rank: the last K - 1 raw
        q|k|v projection rows, [K - 1, 3 x heads x head_dim / tp] (SGLang's
        KimiLinearStateShape.create, configs/mamba_utils.py)."""
        if self.kda is None:
            return 0
        channels = 3 * self._kda_heads_per_rank(attention_tp) * self.kda.head_dim  # q, k, v
        return (self.kda.conv_kernel - 1) * channels * conv_bytes

    def kda_layer_ssm_bytes(self, ssm_bytes: int = KDA_STATE_BYTES, attention_tp: int = 1) -> int:
        """Recurrent (SSM) state of one KDA layer on one attention-TP rank:
        [heads / tp, head_dim, head_dim]."""
        if self.kda is None:
            return 0
        return (self._kda_heads_per_rank(attention_tp) * self.kda.head_dim * self.kda.head_dim
                * ssm_bytes)

    def kda_layer_state_bytes(self, conv_bytes: int = CONV_STATE_BYTES,
                              ssm_bytes: int = KDA_STATE_BYTES, attention_tp: int = 1) -> int:
        """Complete state (conv + SSM) of one KDA layer for one request on one attention-TP
        rank."""
        return (self.kda_layer_conv_bytes(conv_bytes, attention_tp)
                + self.kda_layer_ssm_bytes(ssm_bytes, attention_tp))

    def kda_state_bytes(self, conv_bytes: int = CONV_STATE_BYTES,
                        ssm_bytes: int = KDA_STATE_BYTES, attention_tp: int = 1) -> int:
        """Recurrent KDA state of one request across all KDA layers on one attention-TP rank
        (the whole state with the default attention_tp = 1): constant in context length. The
        defaults are SGLang's dtypes (conv BF16, SSM FP32); an engine keeping FP32 conv state
        passes conv_bytes=4. Raises CapacityError when attention_tp does not divide the heads."""
        return self.kda_layer_state_bytes(conv_bytes, ssm_bytes, attention_tp) * self.kda_layers

    def gqa_kv_bytes_per_token(self, kv_dtype: KvDtype = KvDtype.BF16) -> int:
        """K and V for every GQA layer and KV head (the whole group, before any TP split)."""
        if self.gqa is None:
            return 0
        gqa_layers = sum(1 for kind in self.layers if kind.attention == "gqa")
        return gqa_layers * 2 * self.gqa.kv_heads * self.gqa.head_dim * KV_DTYPE_BYTES[kv_dtype]

    def gqa_kv_heads_per_rank(self, attention_tp: int) -> int:
        """KV heads each TP rank stores: heads split by TP, replicated once TP exceeds them."""
        if self.gqa is None:
            return 0
        return max(1, -(-self.gqa.kv_heads // attention_tp))


def _component_bytes(
    model: ModelDescriptor, groups: Iterable[TensorGroup], fmt: WeightFormat
) -> dict[Component, int]:
    totals: dict[Component, int] = {}
    for group in groups:
        totals[group.component] = totals.get(group.component, 0) + model.group_bytes(group, fmt)
    return totals


def _pattern_matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)
