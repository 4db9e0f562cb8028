"""Safetensors checkpoint folders: strict, memory-mapped loading and saving, and the FP8 block
quantization that quantized checkpoints store.

A checkpoint folder holds `model.safetensors`, or shards listed by `model.safetensors.index.json`.
Headers are parsed here (not by the safetensors library) so that every problem in a folder -
truncation, missing/unexpected tensors, wrong shapes or dtypes - is reported in ONE error that
names each tensor, and so that tensors can be zero-copy views of a private file mapping: loading a
BF16 checkpoint into a BF16 model costs about the file size in memory, not twice that.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from serve_app.protocol.problems import ProblemsError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})
_ITEMSIZE = {name: torch.empty(0, dtype=dt).element_size() for name, dt in DTYPES.items()}
# A config.json's `torch_dtype` / `dtype` names.
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TORCH_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_SCALE_SUFFIX = "_scale_inv"  # "weight" -> "weight_scale_inv"


class CheckpointError(ProblemsError):
    """A checkpoint folder or file that cannot be loaded; the message lists every problem."""

    label = "checkpoint "


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives, read from a safetensors header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in `file`
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TensorSpec:
    """What a model expects of one tensor."""

    shape: tuple[int, ...]
    dtypes: frozenset[str] = FLOAT_DTYPES
    # Other stored shapes the model's loader takes (it reshapes or narrows them itself).
    accepts: Callable[[tuple[int, ...]], bool] | None = None


class _SkipFills(TorchFunctionMode):
    """Random in-place fills (module initialisation) return their tensor untouched."""

    # By name: a tensor method arrives as TensorBase's, nn.init's functions as themselves.
    FILLS = frozenset({"uniform_", "normal_", "random_", "exponential_", "bernoulli_",
                       "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                       "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_"})

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", None) in self.FILLS:
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


@contextmanager
def uninitialised() -> Iterator[None]:
    """Build modules without initialising them, for a loader that assigns every tensor: their
    tensors are `torch.empty` (pages untouched until assigned over) and random fills are
    skipped. Not the meta device: a meta tensor's random fill or elementwise op (`.log()` in an
    init) runs through torch._refs, whose first call imports torch._dynamo, 1.5-2 s of CPU in
    every process that loads a model (Serve replicas, rank workers, TP test workers)."""
    with _SkipFills():
        yield


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Parse one safetensors header, checking it against the file size (truncation)."""
    path = Path(path)
    size = path.stat().st_size
    problems: list[str] = []
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(path, [f"file is {size} bytes: too short to be safetensors"])
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(
                path,
                [f"header length {header_len} exceeds the file ({size} bytes): truncated or not "
                 "a safetensors file"],
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, [f"header is not valid JSON ({exc})"]) from None
    if not isinstance(header, dict):
        raise CheckpointError(path, ["header is not a JSON object"])
    data_start = 8 + header_len
    data_size = size - data_start
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"tensor {name!r}: malformed header entry {entry!r}")
            continue
        if dtype not in DTYPES:
            problems.append(f"tensor {name!r}: unknown dtype {dtype!r}")
            continue
        info = TensorInfo(name, dtype, shape, path, data_start + begin, data_start + end)
        if end - begin != info.numel * _ITEMSIZE[dtype]:
            problems.append(
                f"tensor {name!r}: {end - begin} bytes in the file, but shape {list(shape)} "
                f"{dtype} needs {info.numel * _ITEMSIZE[dtype]}"
            )
        elif end > data_size:
            problems.append(
                f"tensor {name!r}: data ends at byte {end} but the file holds {data_size} bytes "
                "of data (truncated file)"
            )
        infos[name] = info
    if problems:
        raise CheckpointError(path, problems)
    return infos


def checkpoint_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint folder (or a single file path)."""
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        raise CheckpointError(folder, ["no such file or folder"])
    index_path = folder / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(index_path, [f"not a valid safetensors index ({exc!r})"]) from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f"shard {f.name} listed in {INDEX_FILE} does not exist" for f in files
                   if not f.exists()]
        if missing:
            raise CheckpointError(folder, missing)
        return files
    if (folder / SINGLE_FILE).exists():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(folder, ["no model.safetensors, index file or *.safetensors found"])
    return files


def read_index(folder: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint, from headers alone (no weights are read)."""
    infos: dict[str, TensorInfo] = {}
    problems: list[str] = []
    for file in checkpoint_files(folder):
        for name, info in read_header(file).items():
            if name in infos:
                problems.append(f"tensor {name!r} appears in both {infos[name].file.name} "
                                f"and {file.name}")
            infos[name] = info
    if problems:
        raise CheckpointError(folder, problems)
    return infos


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# A checkpoint's own spelling of a tensor name -> the model's (None: not the model's tensor,
# skipped rather than unexpected).
Rename = Callable[[str], str | None]


def match_names(
    stored: Iterable[str], expected: Mapping[str, TensorSpec], prefixes: Iterable[str] = ("model.",),
    rename: Rename | None = None,
) -> tuple[dict[str, str], list[str]]:
    """Map stored tensor names to expected ones, allowing an optional prefix. Returns
    ({expected name: stored name}, [unexpected stored names])."""
    mapping: dict[str, str] = {}
    unexpected: list[str] = []
    prefixes = tuple(prefixes)
    for stored_name in stored:
        name = rename(stored_name) if rename is not None else stored_name
        if name is None:
            continue
        target = name if name in expected else None
        if target is None:
            for p in prefixes:
                if name.startswith(p) and name[len(p):] in expected:
                    target = name[len(p):]
                    break
        if target is None or target in mapping:
            unexpected.append(stored_name)
        else:
            mapping[target] = stored_name
    return mapping, unexpected


def check_against(
    infos: Mapping[str, TensorInfo],
    expected: Mapping[str, TensorSpec],
    prefixes: Iterable[str] = ("model.",),
    rename: Rename | None = None,
) -> tuple[dict[str, str], list[str]]:
    """Compare a checkpoint's headers with what the model expects; every problem is listed."""
    mapping, unexpected = match_names(infos, expected, prefixes, rename)
    problems: list[str] = []
    for name, spec in expected.items():
        if name not in mapping:
            problems.append(f"missing tensor {name!r}: expected shape {_fmt(spec.shape)} "
                            f"({'/'.join(sorted(spec.dtypes))})")
            continue
        info = infos[mapping[name]]
        if info.shape != spec.shape and not (spec.accepts and spec.accepts(info.shape)):
            problems.append(f"tensor {info.name!r}: expected shape {_fmt(spec.shape)}, "
                            f"found {_fmt(info.shape)}")
        if info.dtype not in spec.dtypes:
            problems.append(f"tensor {info.name!r}: expected dtype "
                            f"{'/'.join(sorted(spec.dtypes))}, found {info.dtype}")
    problems += [f"unexpected tensor {n!r} (shape {_fmt(infos[n].shape)})" for n in unexpected]
    return mapping, problems


def _mapped_storage(file: Path) -> torch.UntypedStorage:
    # A private (copy-on-write) mapping: pages are read lazily and never written back.
    return torch.UntypedStorage.from_file(str(file), shared=False, nbytes=file.stat().st_size)


def _view(storage: torch.UntypedStorage, info: TensorInfo) -> torch.Tensor:
    dtype = DTYPES[info.dtype]
    itemsize = _ITEMSIZE[info.dtype]
    if info.start % itemsize == 0:
        t = torch.empty(0, dtype=dtype)
        t.set_(storage, info.start // itemsize, info.shape)  # type: ignore[call-overload]
        return t
    # Unaligned data (allowed by the format): one copy for this tensor only.
    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(storage, info.start, (info.end - info.start,))  # type: ignore[call-overload]
    return raw.clone().view(dtype).reshape(info.shape)


def load_tensors(
    folder: str | os.PathLike[str],
    expected: Mapping[str, TensorSpec],
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    prefixes: Iterable[str] = ("model.",),
    keep_dtype: Iterable[str] = (),
    rename: Rename | None = None,
) -> dict[str, torch.Tensor]:
    """Load exactly the expected tensors, strictly (by the model's names). Floating tensors are
    cast to `dtype` unless named in `keep_dtype` (e.g. FP8 weights and their scales, dequantized
    by the caller)."""
    infos = read_index(folder)
    mapping, problems = check_against(infos, expected, prefixes, rename)
    if problems:
        raise CheckpointError(folder, problems)
    keep = set(keep_dtype)
    storages: dict[Path, torch.UntypedStorage] = {}
    out: dict[str, torch.Tensor] = {}
    for name, stored in mapping.items():
        info = infos[stored]
        if info.file not in storages:
            storages[info.file] = _mapped_storage(info.file)
        t = _view(storages[info.file], info)
        if dtype is not None and name not in keep and info.dtype in FLOAT_DTYPES:
            t = t.to(dtype)
        out[name] = t.to(device)
    return out


def save_tensors(
    folder: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write tensors as `model.safetensors`, or as shards plus an index when they exceed
    `max_shard_bytes`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    items = [(k, v.detach().contiguous().cpu()) for k, v in tensors.items()]
    total = sum(v.numel() * v.element_size() for _, v in items)
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(dict(items), str(folder / SINGLE_FILE), metadata=meta)
        return [folder / SINGLE_FILE]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in items:
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=meta)
        paths.append(folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    (folder / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return paths


def expected_from_module(module: torch.nn.Module) -> dict[str, TensorSpec]:
    """The tensors a module's state dict holds (meta-device modules work: no memory is used)."""
    return {k: TensorSpec(tuple(v.shape)) for k, v in module.state_dict().items()}


# --- FP8 block quantization (DeepSeek V3 / Kimi K2 release format) ---------------------------


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of the F32 scale_inv of a 2-D weight quantized in [bn, bk] blocks."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek block FP8: per [bn, bk] block, scale = amax / 448; returns (F8_E4M3 weight,
    F32 scale_inv [ceil(out/bn), ceil(in/bk)]) with weight ~= fp8 * scale_inv per block."""
    out_f, in_f = weight.shape
    bn, bk = block
    sr, sc = fp8_scale_shape(weight.shape, block)
    w = F.pad(weight.float(), (0, sc * bk - in_f, 0, sr * bn - out_f))
    blocks = w.view(sr, bn, sc, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / _FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(sr * bn, sc * bk)[:out_f, :in_f].contiguous(), scale.contiguous()


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    rows: slice = slice(None),
    cols: slice = slice(None),
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """weight[rows, cols] dequantized; only the blocks that cover the region are read (a TP
    shard of a memory-mapped tensor costs its own size, not the full tensor's)."""
    bn, bk = block
    r0, r1, _ = rows.indices(weight.shape[0])
    c0, c1, _ = cols.indices(weight.shape[1])
    br0, br1 = r0 // bn, -(-r1 // bn)
    bc0, bc1 = c0 // bk, -(-c1 // bk)
    sub = weight[br0 * bn : br1 * bn, bc0 * bk : bc1 * bk].to(device).float()
    s = scale_inv[br0:br1, bc0:bc1].to(device).float()
    s = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: sub.shape[0], : sub.shape[1]]
    return (sub * s)[r0 - br0 * bn : r1 - br0 * bn, c0 - bc0 * bk : c1 - bc0 * bk].to(dtype)
