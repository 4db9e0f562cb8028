"""Model families: Hugging Face config.json -> ModelDescriptor.

Three families are recognised: Kimi K3 (hybrid KDA + MLA, latent MoE), DeepSeek-V3 / Kimi K2
(MLA + MoE) and DSpark drafts (Qwen3-style GQA with fc, Markov and confidence heads). The
descriptor arithmetic itself (parameters, bytes, KV and state sizes) is capacity.model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from capacity.dspark_keys import dspark_settings
from capacity.errors import CapacityError
from capacity.formats import WeightFormat
from capacity.model import (
    Component,
    DraftInfo,
    Family,
    GqaShape,
    KdaShape,
    LayerKind,
    MlaShape,
    ModelDescriptor,
    MoeShape,
    TensorGroup,
)
from capacity.vision import load_media_limits, vision_from_config

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
    return descriptor_from_config(config, name=str(name), source=str(path), folder=path.parent)


def descriptor_from_config(config: dict[str, Any], name: str, source: str,
                           folder: Path | None = None) -> ModelDescriptor:
    """`folder` is where a preprocessor_config.json would sit (None: the packaged K3 one)."""
    text = config.get("text_config")
    if isinstance(text, dict) and "linear_attn_config" in text:
        model = _kimi_k3(text, name, source)
        vision = config.get("vision_config")
        if vision is None:
            return model
        if not isinstance(vision, dict):
            raise CapacityError(f"{source}: vision_config must be a JSON object")
        return dataclasses.replace(model, vision=vision_from_config(vision, source),
                                   media=load_media_limits(folder), _bytes_cache={})
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


def _moe_groups(
    m: str, h: int, experts: int, routed: list[TensorGroup], shared_inter: int
) -> list[TensorGroup]:
    """A MoE block: the router (kept unquantized), the routed experts, the shared experts."""
    groups = [
        TensorGroup(f"{m}.gate", Component.ROUTER, experts, h, quantizable=False),
        TensorGroup(f"{m}.gate.e_score_correction_bias", Component.ROUTER, experts,
                    quantizable=False),
        *routed,
    ]
    if shared_inter:
        groups += _mlp_groups(f"{m}.shared_experts", Component.SHARED_EXPERTS, shared_inter, h)
    return groups


def _outer_groups(
    c: Mapping[str, Any], model: str, lm_head: str, norm_vectors: int = 1
) -> list[TensorGroup]:
    """Embeddings, the final norm and (unless tied to the embeddings) the LM head."""
    vocab, h = c["vocab_size"], c["hidden_size"]
    groups = [
        TensorGroup(f"{model}.embed_tokens", Component.EMBEDDINGS, vocab, h, quantizable=False),
        TensorGroup(f"{model}.norm", Component.NORMS, h, count=norm_vectors, quantizable=False),
    ]
    if not c.get("tie_word_embeddings"):
        groups.append(TensorGroup(lm_head, Component.LM_HEAD, vocab, h, quantizable=False))
    return groups


def _mla_shape(c: Mapping[str, Any]) -> MlaShape:
    return MlaShape(c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"],
                    c["qk_nope_head_dim"], c["v_head_dim"])


def _common_fields(c: Mapping[str, Any], name: str, source: str) -> dict[str, Any]:
    """The descriptor fields every family reads alike: identity, sizes, weight format."""
    quant = c.get("quantization_config")
    return {"name": name, "source": source, "hidden_size": c["hidden_size"],
            "vocab_size": c["vocab_size"], "native_format": _native_format(quant, source),
            "ignore_patterns": _ignore_patterns(quant)}


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
            g += _moe_groups(m, h, experts, [
                TensorGroup(f"{m}.experts.w1", Component.ROUTED_EXPERTS, expert_inter, latent,
                            count=2 * experts),  # w1 (gate) and w3 (up)
                TensorGroup(f"{m}.experts.w2", Component.ROUTED_EXPERTS, latent, expert_inter,
                            count=experts),
            ], expert_inter * shared)
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

    global_groups = _outer_groups(c, "language_model.model", "language_model.lm_head",
                                  norm_vectors=1 + (2 if res_vectors else 0))
    return ModelDescriptor(
        **_common_fields(c, name, source),
        family=Family.KIMI_K3,
        max_context=c["max_position_embeddings"],
        layers=tuple(layers),
        layer_groups=groups,
        global_groups=tuple(global_groups),
        mla=_mla_shape(c),
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
            g += _moe_groups(m, h, experts, [
                TensorGroup(f"{m}.experts.gate_proj", Component.ROUTED_EXPERTS, expert_inter, h,
                            count=2 * experts),
                TensorGroup(f"{m}.experts.down_proj", Component.ROUTED_EXPERTS, h, expert_inter,
                            count=experts),
            ], expert_inter * shared)
        else:
            g += _mlp_groups(f"{p}.mlp", Component.DENSE_MLP, c["intermediate_size"], h)
        groups[kind] = tuple(g)
    return ModelDescriptor(
        **_common_fields(c, name, source),
        family=Family.DEEPSEEK_V3,
        max_context=c["max_position_embeddings"],
        layers=tuple(layers),
        layer_groups=groups,
        global_groups=tuple(_outer_groups(c, "model", "lm_head")),
        mla=_mla_shape(c),
        moe=MoeShape(experts, c["num_experts_per_tok"], h, expert_inter),
    )


def _dspark(c: dict[str, Any], name: str, source: str) -> ModelDescriptor:
    settings = dspark_settings(c, source)
    keys = [
        "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size",
    ]
    _require(c, keys, "DSpark draft (Qwen3-style GQA)", source)
    h = c["hidden_size"]
    heads, kv_heads, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    taps = tuple(int(i) for i in settings.get("target_layer_ids", []))
    if not taps:
        raise CapacityError(f"{source}: DSpark config is missing dflash_config.target_layer_ids")
    markov_rank = int(settings.get("markov_rank", 0))
    confidence = bool(settings.get("enable_confidence_head", False))
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
    return ModelDescriptor(
        **_common_fields(c, name, source),
        family=Family.DSPARK_DRAFT,
        max_context=c.get("max_position_embeddings") or 0,
        layers=(kind,) * c["num_hidden_layers"],
        layer_groups={kind: tuple(layer)},
        global_groups=tuple(global_groups),
        gqa=GqaShape(heads, kv_heads, hd),
        draft=DraftInfo(int(settings.get("block_size", 7)), taps,
                        markov_rank, confidence),
    )
