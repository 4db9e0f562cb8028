"""Kimi K2 / DeepseekV3 checkpoints: the Hugging Face tensor names and shapes of a config, which
slice of each tensor a tensor-parallel rank holds, and loading / saving a KimiForCausalLM
(BF16, or FP8 block-quantized with F32 `weight_scale_inv`, the K2 release format).

The model itself is serve_app.models.kimi; the safetensors folder format and the FP8 block codec
are serve_app.models.checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from serve_app.models.checkpoint import (
    FP8_SCALE_SUFFIX,
    TORCH_DTYPE_NAMES,
    TORCH_DTYPES,
    CheckpointError,
    TensorSpec,
    dequantize_fp8_block,
    fp8_scale_shape,
    load_tensors,
    quantize_fp8_block,
    read_index,
    save_tensors,
    uninitialised,
)
from serve_app.models.kimi import KimiForCausalLM
from serve_app.models.kimi_config import Fp8QuantConfig, KimiConfig
from serve_app.models.target import Collectives, TPContext

__all__ = ["checkpoint_specs", "load_kimi", "save_kimi"]


def _param_shapes(config: KimiConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Full (unsharded) names and shapes of a checkpoint, in module order. Computed directly:
    building K2's 70k expert modules even on the meta device takes seconds."""
    c = config
    h = c.hidden_size
    yield "model.embed_tokens.weight", (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q_out = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            yield p + "self_attn.q_proj.weight", (q_out, h)
        else:
            yield p + "self_attn.q_a_proj.weight", (c.q_lora_rank, h)
            yield p + "self_attn.q_a_layernorm.weight", (c.q_lora_rank,)
            yield p + "self_attn.q_b_proj.weight", (q_out, c.q_lora_rank)
        yield p + "self_attn.kv_a_proj_with_mqa.weight", (c.latent_dim, h)
        yield p + "self_attn.kv_a_layernorm.weight", (c.kv_lora_rank,)
        yield p + "self_attn.kv_b_proj.weight", (
            c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
            c.kv_lora_rank,
        )
        yield p + "self_attn.o_proj.weight", (h, c.num_attention_heads * c.v_head_dim)
        mlps: list[tuple[str, int]]
        if c.is_moe_layer(i):
            yield p + "mlp.gate.weight", (c.n_routed_experts, h)
            yield p + "mlp.gate.e_score_correction_bias", (c.n_routed_experts,)
            mlps = [(f"mlp.experts.{e}.", c.moe_intermediate_size)
                    for e in range(c.n_routed_experts)]
            if c.n_shared_experts:
                mlps.append(("mlp.shared_experts.", c.shared_intermediate_size))
        else:
            mlps = [("mlp.", c.intermediate_size)]
        for name, inter in mlps:
            yield p + name + "gate_proj.weight", (inter, h)
            yield p + name + "up_proj.weight", (inter, h)
            yield p + name + "down_proj.weight", (h, inter)
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (c.vocab_size, h)


def checkpoint_specs(config: KimiConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of this config must hold (FP8 weights with their scales when
    the config says the checkpoint is quantized)."""
    specs: dict[str, TensorSpec] = {}
    q = config.quantization_config
    for name, shape in _param_shapes(config):
        if q is not None and config.is_fp8_weight(name):
            specs[name] = TensorSpec(shape, frozenset({"F8_E4M3"}))
            specs[name + FP8_SCALE_SUFFIX] = TensorSpec(
                fp8_scale_shape(shape, q.weight_block_size), frozenset({"F32"})
            )
        else:
            specs[name] = TensorSpec(shape)
    return specs


def _shard_region(name: str, shape: tuple[int, ...], tp: TPContext) -> tuple[slice, slice] | None:
    """(rows, cols) of a full checkpoint tensor that this rank holds, or None if replicated.
    Routed experts are never split (a rank holds its own experts whole)."""
    if tp.size == 1 or ".mlp.experts." in name or len(shape) != 2:
        return None
    row_split = (
        "self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
    )
    col_split = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight")
    if name.endswith(row_split):
        n = shape[0] // tp.size
        return slice(tp.rank * n, (tp.rank + 1) * n), slice(None)
    if name.endswith(col_split):
        n = shape[1] // tp.size
        return slice(None), slice(tp.rank * n, (tp.rank + 1) * n)
    return None


def _mtp_specs(folder: str | os.PathLike[str], config: KimiConfig) -> dict[str, TensorSpec]:
    """DeepSeek V3 checkpoints append `num_nextn_predict_layers` MTP layers after the decoder;
    they are accepted (whatever their shapes) and not loaded."""
    if not config.num_nextn_predict_layers:
        return {}
    first = config.num_hidden_layers
    extra = {f"model.layers.{first + i}." for i in range(config.num_nextn_predict_layers)}
    return {
        name: TensorSpec(info.shape, frozenset({info.dtype}))
        for name, info in read_index(folder).items()
        if any(name.startswith(p) for p in extra)
    }


def load_kimi(
    folder: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    group: Collectives | None = None,
) -> KimiForCausalLM:
    """Load a Hugging Face DeepseekV3 / Kimi K2 checkpoint folder strictly (every problem in one
    CheckpointError), memory-mapped, keeping only this rank's shard; FP8 block-quantized weights
    are dequantized to `dtype` (default: the config's torch_dtype)."""
    config = KimiConfig.from_file(folder)
    dtype = dtype or TORCH_DTYPES[config.torch_dtype]
    with uninitialised():
        model = KimiForCausalLM(config, tp_rank, tp_size, group)
    expected = {**checkpoint_specs(config), **_mtp_specs(folder, config)}
    # dtype=None and CPU: every tensor stays a zero-copy view of the mapped files until sliced.
    views = load_tensors(folder, expected, prefixes=())
    q: Fp8QuantConfig | None = config.quantization_config
    state: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        src = views[name]
        region = _shard_region(name, tuple(src.shape), model.tp)
        rows, cols = region or (slice(None), slice(None))
        # The router bias decides top-k among near-equal scores: keep it fp32 in any model dtype.
        target = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        if q is not None and config.is_fp8_weight(name):
            t = dequantize_fp8_block(
                src, views[name + FP8_SCALE_SUFFIX], q.weight_block_size, rows, cols, device, target
            )
        elif region:
            # Slice the mapped view first, so only the shard's bytes are read and copied.
            t = src[rows, cols].to(device=device, dtype=target).contiguous()
        else:
            t = src.to(device=device, dtype=target)
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(folder, [f"tensor {name!r}: shard {list(t.shape)} does not "
                                           f"match the module's {list(param.shape)}"])
        state[name] = t
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def save_kimi(
    model: KimiForCausalLM,
    folder: str | os.PathLike[str],
    fp8: bool = False,
    block: tuple[int, int] = (128, 128),
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json + safetensors in the Hugging Face layout; with fp8=True, every
    quantizable weight is stored F8_E4M3 with an F32 `weight_scale_inv` (the K2 release format)."""
    if model.tp.size != 1:
        raise ValueError("save_kimi needs the full model (tp_size=1), not a TP shard")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = model.model.embed_tokens.weight.dtype
    quant = Fp8QuantConfig(quant_method="fp8", weight_block_size=block) if fp8 else None
    config = model.config.model_copy(
        update={"quantization_config": quant, "torch_dtype": TORCH_DTYPE_NAMES[dtype]}
    )
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if fp8 and config.is_fp8_weight(name):
            tensors[name], tensors[name + FP8_SCALE_SUFFIX] = quantize_fp8_block(t, block)
        else:
            tensors[name] = t
    (folder / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    save_tensors(folder, tensors, max_shard_bytes=max_shard_bytes)
