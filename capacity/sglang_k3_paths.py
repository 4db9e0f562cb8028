"""What SGLang 0.5.23 runs K3's MXFP4 checkpoint with on each GPU type
(capacity/data/sglang_k3_paths.csv, each row with the wheel's deciding file:lines), and what
that means for the bytes in HBM: the one rule `plan`, `plan --disagg`, `explain` and `emit`
share. A GPU without a runnable path is not servable; on one whose path upcasts the MXFP4
experts to BF16 at load (gfx942 MI300X/MI325X and A100: srt/layers/quantization/
mxfp4.py:1115-1135) the native checkpoint is sized and timed as BF16 weights, since that is
what SGLang holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from capacity.config import Layout
from capacity.errors import CapacityError
from capacity.formats import WeightFormat
from capacity.model import Family, ModelDescriptor
from capacity.tables import SglangK3Path, load_k3_paths


class NotServable(CapacityError):
    """SGLang 0.5.23 has no path for the model on this GPU; `reason` says why (with the
    deciding source lines where the table has them)."""

    def __init__(self, model: str, gpu: str, reason: str) -> None:
        super().__init__(f"{model} on {gpu}: {reason}")
        self.gpu = gpu
        self.reason = reason


def k3_paths_for(model: ModelDescriptor, paths: dict[str, SglangK3Path] | None = None
                 ) -> dict[str, SglangK3Path] | None:
    """The runnable-path table for K3's MXFP4 checkpoint (`paths`, default the packaged one);
    None for other models, which the table does not cover."""
    if model.family is not Family.KIMI_K3 or model.native_format is not WeightFormat.MXFP4:
        return None
    return paths if paths is not None else packaged_paths()


@cache
def packaged_paths() -> dict[str, SglangK3Path]:
    """capacity/data/sglang_k3_paths.csv, read once (the planner asks per layout)."""
    return load_k3_paths()


def not_servable_reason(gpu: str, path: SglangK3Path | None) -> str:
    if path is None:
        return (f"not servable: no SGLang 0.5.23 path for K3 is recorded for {gpu} "
                "(capacity/data/sglang_k3_paths.csv has no row for it)")
    return f"not servable by SGLang 0.5.23: {path.path} ({path.decided_by})"


def runnable_path(model: ModelDescriptor, gpu: str,
                  paths: dict[str, SglangK3Path] | None = None) -> SglangK3Path | None:
    """SGLang 0.5.23's path for `model` on `gpu`; None when the table does not cover the model.
    Raises NotServable for a GPU without a runnable path."""
    table = k3_paths_for(model, paths)
    if table is None:
        return None
    path = table.get(gpu.upper())
    if path is None or not path.runnable:
        raise NotServable(model.name, gpu, not_servable_reason(gpu, path))
    return path


def held_format(model: ModelDescriptor, fmt: WeightFormat | None,
                path: SglangK3Path | None) -> WeightFormat | None:
    """The weight format SGLang holds in HBM for a layout asking `fmt` (None: the
    checkpoint's native one): BF16 where the path upcasts the native MXFP4 experts at load."""
    if path is not None and path.experts_in_memory == "bf16" and fmt in (None,
                                                                         model.native_format):
        return WeightFormat.BF16
    return fmt


def held_formats(model: ModelDescriptor, formats: Sequence[WeightFormat | None],
                 path: SglangK3Path | None) -> tuple[WeightFormat | None, ...]:
    """`held_format` of each, duplicates dropped (native and BF16 are one layout there)."""
    return tuple(dict.fromkeys(held_format(model, f, path) for f in formats))


def held_layout(model: ModelDescriptor, layout: Layout,
                paths: dict[str, SglangK3Path] | None = None) -> Layout:
    """`layout` with the weight format SGLang 0.5.23 holds on its GPU; unchanged where the
    table has no runnable path (refusing those is `runnable_path`'s job)."""
    table = k3_paths_for(model, paths)
    path = table.get(layout.gpu.upper()) if table is not None else None
    fmt = held_format(model, layout.weight_format, path if path and path.runnable else None)
    if fmt == layout.weight_format:
        return layout
    return layout.model_copy(update={"weight_format": fmt})


def served_layout(model: ModelDescriptor, layout: Layout,
                  paths: dict[str, SglangK3Path] | None = None
                  ) -> tuple[Layout, SglangK3Path | None]:
    """`layout` with the weight format SGLang 0.5.23 really holds on its GPU, and the path
    (None where the table does not cover the model). Raises NotServable."""
    path = runnable_path(model, layout.gpu, paths)
    return held_layout(model, layout, paths), path


def path_note(path: SglangK3Path, layout: Layout) -> str:
    """A generated file's header line: the path SGLang runs K3 with here and its source, and,
    where it upcasts the experts, that the (held) `layout` is sized for that."""
    upcast = path.experts_in_memory == "bf16" and layout.weight_format is WeightFormat.BF16
    note = f"SGLang 0.5.23 runs K3 on {path.gpu} as {path.label} ({path.decided_by})"
    if path.flags:
        note += f"; needs {path.flags}"
    if path.env:
        note += f"; the runtime_env sets {path.env} (srt/layers/quantization/mxfp4.py:200)"
    if upcast:
        note += ("; the MXFP4 experts are upcast to BF16 at load, so this file is sized with "
                 "BF16 experts")
    return note + "."
