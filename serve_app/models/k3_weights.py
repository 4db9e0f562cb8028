"""Kimi K3 text-model checkpoints: loading / saving a K3ForCausalLM as a safetensors folder.

Names and shapes are SGLang's after its loader's renames (`model.layers.N....`, exactly
`k3_tensor_shapes`); config.json is the published `kimi_k3` wrapper
holding `text_config`. Loading is strict: every missing, unexpected and misshaped tensor is named
in ONE CheckpointError (serve_app.models.checkpoint's reader), and the tensors are memory-mapped.

dtypes: the tensors SGLang keeps fp32 whatever the model dtype (KDA `A_log`, `dt_bias`, the
`*_conv1d` weights, and the router's `e_score_correction_bias`) are loaded fp32; everything else
in the requested dtype. Quantized checkpoints: FP8 block quantization (`quant_method: fp8` with
`weight_block_size`, F8_E4M3 weights + F32 `weight_scale_inv`, the DeepSeek V3 / K2 format) is
dequantized at load with checkpoint.py's codec; any other scheme (the K3 release's
compressed-tensors MXFP4 experts) is refused with an UnsupportedQuantizationError, as there is
no codec for it here. No pickle: safetensors only.

Tensor parallelism: `load_k3(..., tp=TPContext(rank, size, group))` builds this rank's modules
(k3.py) and reads only its shard of the full checkpoint: a tensor whose module shape differs
from the checkpoint's in one dimension is sliced there, rank r taking the r-th of `size` equal
parts (the head / width split the modules define); routed experts of other ranks are not read.
`save_k3` needs the full (one-rank) model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from serve_app.models.checkpoint import (
    FP8_SCALE_SUFFIX,
    INDEX_FILE,
    SINGLE_FILE,
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
from serve_app.models.k3 import K3ForCausalLM
from serve_app.models.k3_config import K3Config, K3ConfigError, k3_tensor_shapes
from serve_app.models.target import TPContext

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "Fp8Block",
    "UnsupportedQuantizationError",
    "is_fp32_tensor",
    "k3_checkpoint_specs",
    "k3_config_dict",
    "load_k3",
    "save_k3",
]

DEFAULT_SHARD_BYTES = 5 * 1024**3
_ALIGN = 64  # bytes: what the CPU allocator gives fresh tensors
_FP32_SUFFIXES = (".A_log", ".dt_bias", "_conv1d.weight", ".e_score_correction_bias")


class UnsupportedQuantizationError(CheckpointError):
    """A checkpoint quantized in a scheme this loader has no codec for."""


Fp8Block = tuple[int, int]


def is_fp32_tensor(name: str) -> bool:
    """The tensors SGLang keeps fp32 in any model dtype: KDA A_log, dt_bias and the depthwise
    conv weights, and the noaux_tc router bias."""
    return name.endswith(_FP32_SUFFIXES)


def _is_fp8_weight(config: K3Config, name: str) -> bool:
    """A weight stored FP8 (with `weight_scale_inv`) in an FP8 block checkpoint: every 2-D
    linear projection in the decoder layers (including the routed experts' w1/w2/w3), except the
    router (`mlp.gate`), the 1-row AttnRes pseudo-queries and `ignore`d modules."""
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight")
    if module.endswith("_res_proj") or is_fp32_tensor(name):
        return False
    last = module.rsplit(".", 1)[-1]
    if not (last.endswith(("_proj", "_proj_with_mqa")) or last in ("w1", "w2", "w3")):
        return False
    q = config.quantization_config
    return not (q is not None and q.ignores(module))


def _quant_block(folder: str | os.PathLike[str], config: K3Config) -> Fp8Block | None:
    """The FP8 block size the folder's config.json declares, None when unquantized; any other
    quantization is refused by name."""
    q = config.quantization_config
    if q is None:
        return None
    raw = json.loads(Path(folder, "config.json").read_text())
    qraw: dict[str, Any] = raw.get("text_config", raw).get("quantization_config") or {}
    block = qraw.get("weight_block_size")
    if q.quant_method == "fp8" and isinstance(block, list) and len(block) == 2:
        return int(block[0]), int(block[1])
    raise UnsupportedQuantizationError(folder, [
        f"quantization_config quant_method={q.quant_method!r} format={q.format!r} "
        f"weight_block_size={block!r} is not supported: only FP8 block quantization "
        "(quant_method 'fp8' with a 2-entry weight_block_size) has a codec in "
        "serve_app.models.checkpoint; dequantize the checkpoint to BF16 first"])


def sglang_name(stored: str) -> str | None:
    """A published K3 checkpoint's tensor name as SGLang 0.5.23's loader reads it
    (kimi_k3.py:3476-3483 and 3839-3874): `language_model.layers.` becomes
    `language_model.model.layers.`, `block_sparse_moe` becomes `mlp`, `language_model.` is
    dropped; the vision tower and projector are not the text model's (None: skipped)."""
    if "vision_tower" in stored or "mm_projector" in stored:
        return None
    if stored.startswith("language_model.layers."):
        stored = "language_model.model." + stored.removeprefix("language_model.")
    return stored.replace("block_sparse_moe", "mlp").replace("language_model.", "")


def _a_log_shapes(heads: int) -> Callable[[tuple[int, ...]], bool]:
    # SGLang's A_log loader (kimi_k3.py:1733-1756) takes [h], the K3 checkpoint's 1-D
    # [head_dim] (>= h: the first h are the heads') and the older [1, 1, h, 1].
    return lambda shape: (len(shape) == 1 and shape[0] >= heads) or shape == (1, 1, heads, 1)


def _as_a_log(t: torch.Tensor, heads: int) -> torch.Tensor:
    return (t.view(t.shape[2]) if t.dim() == 4 else t)[:heads]


def k3_checkpoint_specs(config: K3Config, block: Fp8Block | None = None) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of this config holds (with FP8 weights and their F32 scales
    when `block` is given)."""
    specs: dict[str, TensorSpec] = {}
    for name, shape in k3_tensor_shapes(config):
        if name.endswith(".A_log"):
            specs[name] = TensorSpec(shape, accepts=_a_log_shapes(shape[0]))
        elif block is not None and _is_fp8_weight(config, name):
            specs[name] = TensorSpec(shape, frozenset({"F8_E4M3"}))
            specs[name + FP8_SCALE_SUFFIX] = TensorSpec(
                fp8_scale_shape(shape, block), frozenset({"F32"})
            )
        else:
            specs[name] = TensorSpec(shape)
    return specs


def _mtp_specs(folder: str | os.PathLike[str], config: K3Config) -> dict[str, TensorSpec]:
    """`num_nextn_predict_layers` MTP layers after the decoder are accepted as stored, not
    loaded."""
    if not config.num_nextn_predict_layers:
        return {}
    first = config.num_hidden_layers
    extra = tuple(f"model.layers.{first + i}." for i in range(config.num_nextn_predict_layers))
    return {name: TensorSpec(info.shape, frozenset({info.dtype}))
            for stored, info in read_index(folder).items()
            if (name := sglang_name(stored)) is not None and name.startswith(extra)}


def _shard_region(
    full: tuple[int, ...], local: tuple[int, ...], tp: TPContext
) -> tuple[slice, ...] | None:
    """The index of this rank's part of a full tensor whose module holds `local` (None: the
    whole tensor). At most one dimension is split, into tp.size equal contiguous parts."""
    if full == local:
        return None
    split = [d for d, (f, n) in enumerate(zip(full, local, strict=True)) if f != n]
    d = split[0]
    if len(split) != 1 or local[d] * tp.size != full[d]:
        raise ValueError(f"no TP-{tp.size} shard of {list(full)} has shape {list(local)}")
    index = [slice(None)] * len(full)
    index[d] = slice(tp.rank * local[d], (tp.rank + 1) * local[d])
    return tuple(index)


def load_k3(
    folder: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    tp: TPContext | None = None,
) -> K3ForCausalLM:
    """Load a K3 checkpoint folder strictly (every problem in one CheckpointError),
    memory-mapped. Tensors are cast to `dtype` (default: the config's `dtype`) except the fp32
    ones (`is_fp32_tensor`); FP8 block weights are dequantized to `dtype`. With `tp`, only this
    rank's shard is read and copied (see the module docstring)."""
    tp = tp or TPContext()
    try:
        config = K3Config.from_file(folder)
    except K3ConfigError as exc:
        raise CheckpointError(folder, [f"config.json: {exc}"]) from None
    dtype = dtype or TORCH_DTYPES[config.dtype]
    block = _quant_block(folder, config)
    with uninitialised():
        model = K3ForCausalLM(config, tp)
    expected = {**k3_checkpoint_specs(config, block), **_mtp_specs(folder, config)}
    # Zero-copy views of the mapped files, by the model's names (SGLang's renames applied).
    views = load_tensors(folder, expected, prefixes=(), rename=sglang_name)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        target = torch.float32 if is_fp32_tensor(name) else dtype
        src = views[name]
        if name.endswith(".A_log"):
            src = _as_a_log(src, config.kda_num_heads)
        region = _shard_region(tuple(src.shape), tuple(param.shape), tp)
        if block is not None and _is_fp8_weight(config, name):
            rows, cols = region or (slice(None), slice(None))
            t = dequantize_fp8_block(src, views[name + FP8_SCALE_SUFFIX], block, rows, cols,
                                     device=device, dtype=target)
        else:
            # Slice the mapped view first, so only the shard's bytes are read and copied.
            t = (src if region is None else src[region]).to(device=device, dtype=target)
            if region is not None:
                t = t.contiguous()
            if t.data_ptr() % _ALIGN:
                # A view at an odd offset of the mapped file: CPU kernels take other (differently
                # rounded) paths for unaligned data, so copy it to make results bit-identical to
                # the saved model's. Aligned views stay zero-copy.
                t = t.clone()
        state[name] = t
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def k3_config_dict(config: K3Config, dtype: torch.dtype,
                   quantization: dict[str, Any] | None = None) -> dict[str, Any]:
    """The published config.json: the `kimi_k3` wrapper around `text_config`."""
    text = config.model_dump(mode="json", exclude_none=True)
    text.pop("quantization_config", None)
    name = TORCH_DTYPE_NAMES[dtype]
    text = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **text,
            "dtype": name}
    if quantization is not None:
        text["quantization_config"] = quantization
    wrapper: dict[str, Any] = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "dtype": name,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, key) is not None:
            wrapper[key] = getattr(config, key)
    wrapper["text_config"] = text
    return wrapper


def save_k3(
    model: K3ForCausalLM,
    folder: str | os.PathLike[str],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    fp8: bool = False,
    block: Fp8Block = (128, 128),
) -> list[Path]:
    """Write config.json (the published wrapper) + `model-0000i-of-0000n.safetensors` shards
    + `model.safetensors.index.json` (always, even for one shard), in the model's dtype (the
    fp32 tensors stay as they are). With fp8=True every quantizable weight is stored F8_E4M3
    with an F32 `weight_scale_inv` and config.json declares the FP8 block quantization."""
    if model.tp.size != 1:
        raise ValueError("save_k3 needs the full model (one rank), not a TP shard")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    dtype = model.model.embed_tokens.weight.dtype
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if fp8 and _is_fp8_weight(config, name):
            tensors[name], tensors[name + FP8_SCALE_SUFFIX] = quantize_fp8_block(t, block)
        else:
            tensors[name] = t
    quant = ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(block)} if fp8 else None)
    paths = save_tensors(folder, tensors, max_shard_bytes=max_shard_bytes)
    if paths == [folder / SINGLE_FILE]:  # one shard: still the sharded layout with an index
        shard = folder / "model-00001-of-00001.safetensors"
        paths[0].replace(shard)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (folder / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(tensors, shard.name)},
            indent=2))
        paths = [shard]
    (folder / "config.json").write_text(
        json.dumps(k3_config_dict(config, dtype, quant), indent=2) + "\n")
    return paths
