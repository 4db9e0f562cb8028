"""Model descriptors read from Hugging Face config.json files.

A descriptor lists every weight tensor of a model as groups of identical matrices, so parameter
counts and bytes per weight format are exact sums rather than rules of thumb. Three families are
recognised: Kimi K3 (hybrid KDA + MLA, latent MoE), DeepSeek-V3 / Kimi K2 (MLA + MoE) and
DSpark drafts (Qwen3-style GQA with fc, Markov and confidence heads).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from importlib import resources
from pathlib import Path
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

    def kda_state_bytes(self) -> int:
        """Recurrent KDA state of one request across all KDA layers, before TP: constant in
        context length."""
        if self.kda is None:
            return 0
        channels = self.kda.heads * self.kda.head_dim
        recurrent = self.kda.heads * self.kda.head_dim * self.kda.head_dim * KDA_STATE_BYTES
        conv = 3 * channels * (self.kda.conv_kernel - 1) * CONV_STATE_BYTES  # q, k and v convs
        return (recurrent + conv) * self.kda_layers

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


# ---- packaged models ---------------------------------------------------------------------
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "kimi-k3": ("kimi-k3-config.json", "Kimi-K3"),
    "kimi-k2": ("kimi-k2-instruct-config.json", "Kimi-K2-Instruct"),
    "kimi-k2-instruct": ("kimi-k2-instruct-config.json", "Kimi-K2-Instruct"),
    "kimi-k3-dspark": ("kimi-k3-dspark-config.json", "Kimi-K3-DSpark"),
    "dspark": ("kimi-k3-dspark-config.json", "Kimi-K3-DSpark"),
}


def describe_model(path_or_name: str | Path) -> ModelDescriptor:
    """Reads a config.json (a path, a folder holding one, or a packaged name such as
    `kimi-k3`, `kimi-k2`, `kimi-k3-dspark`) and returns its descriptor."""
    text_key = str(path_or_name)
    packaged = PACKAGED_MODELS.get(text_key.lower())
    if packaged is not None:
        file_name, display = packaged
        raw = resources.files("capacity.data").joinpath(file_name).read_text()
        return descriptor_from_config(json.loads(raw), name=display, source=f"packaged:{file_name}")
    path = Path(path_or_name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(sorted(PACKAGED_MODELS))
        raise CapacityError(f"model {text_key!r} is neither a config.json path nor one of: {names}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CapacityError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise CapacityError(f"{path}: config.json must hold a JSON object")
    name = config.get("_name_or_path") or path.parent.name or path.stem
    return descriptor_from_config(config, name=str(name), source=str(path))


def descriptor_from_config(config: dict[str, Any], name: str, source: str) -> ModelDescriptor:
    text = config.get("text_config")
    if isinstance(text, dict) and "linear_attn_config" in text:
        return _kimi_k3(text, name, source)
    if "linear_attn_config" in config:
        return _kimi_k3(config, name, source)
    if "kv_lora_rank" in config and "n_routed_experts" in config:
        return _deepseek_v3(config, name, source)
    if "dflash_config" in config or any("DSpark" in a for a in config.get("architectures", [])):
        return _dspark(config, name, source)
    arch = ", ".join(config.get("architectures", [])) or "none"
    raise CapacityError(
        f"{source}: unsupported architecture ({arch}, model_type {config.get('model_type')!r}); "
        "recognised: Kimi K3 (text_config.linear_attn_config + kv_lora_rank), DeepSeek-V3/Kimi K2 "
        "(kv_lora_rank + n_routed_experts), DSpark draft (dflash_config + num_key_value_heads)"
    )


def _require(config: Mapping[str, Any], keys: Iterable[str], family: str, source: str) -> None:
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise CapacityError(f"{source}: {family} config is missing fields: {', '.join(missing)}")
    for key in keys:
        value = config[key]
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise CapacityError(f"{source}: {family} field {key} must be positive, got {value}")


def _native_format(quant: Mapping[str, Any] | None, source: str) -> WeightFormat:
    if not quant:
        return WeightFormat.BF16
    method = quant.get("quant_method")
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block not in (None, [128, 128]):
            raise CapacityError(f"{source}: FP8 weight_block_size {block} unsupported; need 128x128")
        return WeightFormat.FP8
    if method == "compressed-tensors":
        fmt = str(quant.get("format", ""))
        if "mxfp4" in fmt:
            return WeightFormat.MXFP4
        if "nvfp4" in fmt:
            return WeightFormat.NVFP4
        if fmt in ("pack-quantized", "int-quantized"):
            return WeightFormat.INT4
        if fmt == "float-quantized":
            return WeightFormat.FP8
        raise CapacityError(
            f"{source}: quantization_config.format {fmt!r} unsupported; known: mxfp4-pack-quantized, "
            "nvfp4-pack-quantized, pack-quantized, float-quantized"
        )
    raise CapacityError(
        f"{source}: quantization_config.quant_method {method!r} unsupported; known: fp8, "
        "compressed-tensors"
    )


def _ignore_patterns(quant: Mapping[str, Any] | None) -> tuple[str, ...]:
    if not quant:
        return ()
    patterns = list(quant.get("ignore") or []) + list(quant.get("modules_to_not_convert") or [])
    return tuple(str(p) for p in patterns)


def _mla_groups(prefix: str, c: Mapping[str, Any], output_gate: bool) -> list[TensorGroup]:
    h = c["hidden_size"]
    heads = c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    a = f"{prefix}.self_attn"
    groups: list[TensorGroup] = []
    q_lora = c.get("q_lora_rank")
    if q_lora:
        groups += [
            TensorGroup(f"{a}.q_a_proj", Component.ATTENTION, q_lora, h),
            TensorGroup(f"{a}.q_a_layernorm", Component.ATTENTION, q_lora, quantizable=False),
            TensorGroup(f"{a}.q_b_proj", Component.ATTENTION, heads * qk, q_lora),
        ]
    else:
        groups.append(TensorGroup(f"{a}.q_proj", Component.ATTENTION, heads * qk, h))
    kv_lora = c["kv_lora_rank"]
    groups += [
        TensorGroup(
            f"{a}.kv_a_proj_with_mqa", Component.ATTENTION, kv_lora + c["qk_rope_head_dim"], h
        ),
        TensorGroup(f"{a}.kv_a_layernorm", Component.ATTENTION, kv_lora, quantizable=False),
        TensorGroup(
            f"{a}.kv_b_proj",
            Component.ATTENTION,
            heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
            kv_lora,
        ),
        TensorGroup(f"{a}.o_proj", Component.ATTENTION, h, heads * c["v_head_dim"]),
    ]
    if output_gate:
        groups.append(TensorGroup(f"{a}.g_proj", Component.ATTENTION, heads * c["v_head_dim"], h))
    return groups


def _mlp_groups(prefix: str, component: Component, inter: int, h: int) -> list[TensorGroup]:
    return [
        TensorGroup(f"{prefix}.gate_proj", component, inter, h),
        TensorGroup(f"{prefix}.up_proj", component, inter, h),
        TensorGroup(f"{prefix}.down_proj", component, h, inter),
    ]


def _layer_norms(prefix: str, h: int, extra_vectors: int = 0) -> list[TensorGroup]:
    return [
        TensorGroup(
            f"{prefix}.input_layernorm", Component.NORMS, h, count=2 + extra_vectors,
            quantizable=False,
        )
    ]


def _kimi_k3(c: dict[str, Any], name: str, source: str) -> ModelDescriptor:
    keys = [
        "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
        "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_experts",
        "num_experts_per_token", "moe_intermediate_size", "intermediate_size",
        "first_k_dense_replace", "linear_attn_config", "max_position_embeddings",
    ]
    _require(c, keys, "Kimi K3 (KimiLinear text_config)", source)
    lin = c["linear_attn_config"]
    _require(
        lin, ["num_heads", "head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers"],
        "Kimi K3 linear_attn_config", source,
    )
    n_layers = c["num_hidden_layers"]
    # The layer lists are 1-based in KimiLinear configs and must cover every layer once.
    kda_set = {int(i) for i in lin["kda_layers"]}
    mla_set = {int(i) for i in lin["full_attn_layers"]}
    if kda_set & mla_set or (kda_set | mla_set) != set(range(1, n_layers + 1)):
        raise CapacityError(
            f"{source}: linear_attn_config.kda_layers and full_attn_layers must together list "
            f"layers 1..{n_layers} exactly once (1-based)"
        )
    h = c["hidden_size"]
    first_dense = c["first_k_dense_replace"]
    latent = c.get("routed_expert_hidden_size") or h
    experts = c["num_experts"]
    expert_inter = c["moe_intermediate_size"]
    shared = c.get("num_shared_experts") or 0
    kda = KdaShape(lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"])
    di = kda.heads * kda.head_dim
    # Attention-residual blocks add a norm and a 1 x H query per sub-layer (4 vectors a layer).
    res_vectors = 4 if c.get("attn_res_block_size") else 0

    layers: list[LayerKind] = []
    groups: dict[LayerKind, tuple[TensorGroup, ...]] = {}
    for index in range(n_layers):
        kind = LayerKind(
            "kda" if (index + 1) in kda_set else "mla", "dense" if index < first_dense else "moe"
        )
        layers.append(kind)
        if kind in groups:
            continue
        p = f"language_model.model.layers.{index}"
        g: list[TensorGroup] = _layer_norms(p, h, res_vectors)
        if kind.attention == "mla":
            g += _mla_groups(p, c, bool(c.get("mla_use_output_gate")))
        else:
            a = f"{p}.self_attn"
            g += [
                TensorGroup(f"{a}.q_proj", Component.KDA, di, h, count=3),  # q, k, v
                TensorGroup(f"{a}.q_conv1d", Component.KDA, di * 3, kda.conv_kernel,
                            quantizable=False),
                TensorGroup(f"{a}.f_a_proj", Component.KDA, kda.head_dim, h),
                TensorGroup(f"{a}.f_b_proj", Component.KDA, di, kda.head_dim),
                TensorGroup(f"{a}.b_proj", Component.KDA, kda.heads, h),
                TensorGroup(f"{a}.dt_bias", Component.KDA, di + kda.heads + kda.head_dim,
                            quantizable=False),  # dt_bias, A_log, o_norm
                TensorGroup(f"{a}.o_proj", Component.KDA, h, di),
            ]
            if lin.get("use_full_rank_gate"):
                g.append(TensorGroup(f"{a}.g_proj", Component.KDA, di, h))
            else:
                g += [
                    TensorGroup(f"{a}.g_a_proj", Component.KDA, kda.head_dim, h),
                    TensorGroup(f"{a}.g_b_proj", Component.KDA, di, kda.head_dim),
                ]
        if kind.ffn == "dense":
            g += _mlp_groups(f"{p}.mlp", Component.DENSE_MLP, c["intermediate_size"], h)
        else:
            m = f"{p}.block_sparse_moe"
            g += [
                TensorGroup(f"{m}.gate", Component.ROUTER, experts, h, quantizable=False),
                TensorGroup(f"{m}.gate.e_score_correction_bias", Component.ROUTER, experts,
                            quantizable=False),
                TensorGroup(f"{m}.experts.w1", Component.ROUTED_EXPERTS, expert_inter, latent,
                            count=2 * experts),  # w1 (gate) and w3 (up)
                TensorGroup(f"{m}.experts.w2", Component.ROUTED_EXPERTS, latent, expert_inter,
                            count=experts),
            ]
            if shared:
                g += _mlp_groups(
                    f"{m}.shared_experts", Component.SHARED_EXPERTS, expert_inter * shared, h
                )
            if latent != h:
                # The published MXFP4 checkpoint stores these projections unquantized.
                g += [
                    TensorGroup(f"{m}.routed_expert_down_proj", Component.LATENT_PROJECTION,
                                latent, h, quantizable=False),
                    TensorGroup(f"{m}.routed_expert_up_proj", Component.LATENT_PROJECTION,
                                h, latent, quantizable=False),
                ]
                if c.get("latent_moe_use_norm"):
                    g.append(TensorGroup(f"{m}.routed_expert_norm", Component.NORMS, latent,
                                         quantizable=False))
        groups[kind] = tuple(g)

    vocab = c["vocab_size"]
    global_groups = [
        TensorGroup("language_model.model.embed_tokens", Component.EMBEDDINGS, vocab, h,
                    quantizable=False),
        TensorGroup("language_model.model.norm", Component.NORMS, h, count=1 + (2 if res_vectors
                    else 0), quantizable=False),
    ]
    if not c.get("tie_word_embeddings"):
        global_groups.append(
            TensorGroup("language_model.lm_head", Component.LM_HEAD, vocab, h, quantizable=False)
        )
    quant = c.get("quantization_config")
    return ModelDescriptor(
        name=name,
        family=Family.KIMI_K3,
        source=source,
        hidden_size=h,
        vocab_size=vocab,
        max_context=c["max_position_embeddings"],
        layers=tuple(layers),
        layer_groups=groups,
        global_groups=tuple(global_groups),
        native_format=_native_format(quant, source),
        ignore_patterns=_ignore_patterns(quant),
        mla=MlaShape(c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"],
                     c["qk_nope_head_dim"], c["v_head_dim"]),
        kda=kda,
        moe=MoeShape(experts, c["num_experts_per_token"], latent, expert_inter),
    )


def _deepseek_v3(c: dict[str, Any], name: str, source: str) -> ModelDescriptor:
    keys = [
        "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
        "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
        "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
        "max_position_embeddings",
    ]
    _require(c, keys, "DeepSeek-V3/Kimi K2", source)
    h = c["hidden_size"]
    experts = c["n_routed_experts"]
    expert_inter = c["moe_intermediate_size"]
    first_dense = c.get("first_k_dense_replace") or 0
    freq = c.get("moe_layer_freq") or 1
    shared = c.get("n_shared_experts") or 0
    layers: list[LayerKind] = []
    groups: dict[LayerKind, tuple[TensorGroup, ...]] = {}
    for index in range(c["num_hidden_layers"]):
        is_moe = index >= first_dense and index % freq == 0
        kind = LayerKind("mla", "moe" if is_moe else "dense")
        layers.append(kind)
        if kind in groups:
            continue
        p = f"model.layers.{index}"
        g = _layer_norms(p, h) + _mla_groups(p, c, output_gate=False)
        if is_moe:
            m = f"{p}.mlp"
            g += [
                TensorGroup(f"{m}.gate", Component.ROUTER, experts, h, quantizable=False),
                TensorGroup(f"{m}.gate.e_score_correction_bias", Component.ROUTER, experts,
                            quantizable=False),
                TensorGroup(f"{m}.experts.gate_proj", Component.ROUTED_EXPERTS, expert_inter, h,
                            count=2 * experts),
                TensorGroup(f"{m}.experts.down_proj", Component.ROUTED_EXPERTS, h, expert_inter,
                            count=experts),
            ]
            if shared:
                g += _mlp_groups(
                    f"{m}.shared_experts", Component.SHARED_EXPERTS, expert_inter * shared, h
                )
        else:
            g += _mlp_groups(f"{p}.mlp", Component.DENSE_MLP, c["intermediate_size"], h)
        groups[kind] = tuple(g)
    vocab = c["vocab_size"]
    global_groups = [
        TensorGroup("model.embed_tokens", Component.EMBEDDINGS, vocab, h, quantizable=False),
        TensorGroup("model.norm", Component.NORMS, h, quantizable=False),
    ]
    if not c.get("tie_word_embeddings"):
        global_groups.append(TensorGroup("lm_head", Component.LM_HEAD, vocab, h,
                                         quantizable=False))
    quant = c.get("quantization_config")
    return ModelDescriptor(
        name=name,
        family=Family.DEEPSEEK_V3,
        source=source,
        hidden_size=h,
        vocab_size=vocab,
        max_context=c["max_position_embeddings"],
        layers=tuple(layers),
        layer_groups=groups,
        global_groups=tuple(global_groups),
        native_format=_native_format(quant, source),
        ignore_patterns=_ignore_patterns(quant),
        mla=MlaShape(c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"],
                     c["qk_nope_head_dim"], c["v_head_dim"]),
        moe=MoeShape(experts, c["num_experts_per_tok"], h, expert_inter),
    )


def _dspark_setting(c: Mapping[str, Any], key: str, default: Any) -> Any:
    """DSpark settings live in dflash_config; SGLang also accepts top-level `markov_*` and
    `dspark_*`-prefixed keys, so all three places are consulted."""
    nested = c.get("dflash_config") or {}
    for candidate in (nested.get(key), c.get(key), c.get(f"dspark_{key}")):
        if candidate is not None:
            return candidate
    return default


def _dspark(c: dict[str, Any], name: str, source: str) -> ModelDescriptor:
    keys = [
        "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size",
    ]
    _require(c, keys, "DSpark draft (Qwen3-style GQA)", source)
    h = c["hidden_size"]
    heads, kv_heads, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    taps = tuple(int(i) for i in _dspark_setting(c, "target_layer_ids", []))
    if not taps:
        raise CapacityError(f"{source}: DSpark config is missing dflash_config.target_layer_ids")
    markov_rank = int(_dspark_setting(c, "markov_rank", 0))
    confidence = bool(_dspark_setting(c, "enable_confidence_head", False))
    kind = LayerKind("gqa", "dense")
    p = "layers.0"
    a = f"{p}.self_attn"
    layer = [
        *_layer_norms(p, h),
        TensorGroup(f"{a}.q_proj", Component.ATTENTION, heads * hd, h),
        TensorGroup(f"{a}.k_proj", Component.ATTENTION, kv_heads * hd, h, count=2),  # k and v
        TensorGroup(f"{a}.o_proj", Component.ATTENTION, h, heads * hd),
        TensorGroup(f"{a}.q_norm", Component.ATTENTION, hd, count=2, quantizable=False),
        *_mlp_groups(f"{p}.mlp", Component.DENSE_MLP, c["intermediate_size"], h),
    ]
    vocab = c["vocab_size"]
    global_groups = [
        TensorGroup("fc", Component.DRAFT_FC, h, h * len(taps)),
        TensorGroup("hidden_norm", Component.NORMS, h, count=2, quantizable=False),  # + norm
    ]
    if markov_rank:
        global_groups += [
            TensorGroup("markov_head.markov_w1", Component.DRAFT_HEADS, vocab, markov_rank,
                        quantizable=False),  # an embedding table
            TensorGroup("markov_head.markov_w2", Component.DRAFT_HEADS, vocab, markov_rank),
        ]
    if confidence:
        global_groups += [
            TensorGroup("confidence_head.proj", Component.DRAFT_HEADS, 1, h + markov_rank,
                        quantizable=False),
            TensorGroup("confidence_head.proj.bias", Component.DRAFT_HEADS, 1, quantizable=False),
        ]
    quant = c.get("quantization_config")
    return ModelDescriptor(
        name=name,
        family=Family.DSPARK_DRAFT,
        source=source,
        hidden_size=h,
        vocab_size=vocab,
        max_context=c.get("max_position_embeddings") or 0,
        layers=(kind,) * c["num_hidden_layers"],
        layer_groups={kind: tuple(layer)},
        global_groups=tuple(global_groups),
        native_format=_native_format(quant, source),
        ignore_patterns=_ignore_patterns(quant),
        gqa=GqaShape(heads, kv_heads, hd),
        draft=DraftInfo(int(_dspark_setting(c, "block_size", c.get("block_size") or 7)), taps,
                        markov_rank),
    )
