"""Weight and KV-cache storage formats and the exact bytes a tensor takes in each."""

from __future__ import annotations

from enum import StrEnum
from math import ceil
from typing import TypeVar

from capacity.errors import CapacityError


class WeightFormat(StrEnum):
    """How the quantizable Linear weights of a model are stored.

    Each format's bytes include its scales, because scales are real HBM:
    - BF16: 2 bytes per parameter.
    - FP8: E4M3 values with one FP32 scale per 128 x 128 block (DeepSeek-V3 / Kimi K2 layout).
    - MXFP4: E2M1 values, one E8M0 (uint8) scale per 32 inputs (OCP MX spec; K3's experts).
    - INT4: symmetric 4-bit integers, one BF16 scale per 32 inputs, no zero point
      (compressed-tensors pack-quantized, group 32).
    - NVFP4: E2M1 values, one FP8 E4M3 scale per 16 inputs plus one FP32 scale per tensor.
    """

    BF16 = "bf16"
    FP8 = "fp8"
    MXFP4 = "mxfp4"
    INT4 = "int4"
    NVFP4 = "nvfp4"


class KvDtype(StrEnum):
    """Element type of the KV cache (MLA latent and draft GQA caches)."""

    BF16 = "bf16"
    FP8 = "fp8"


KV_DTYPE_BYTES: dict[KvDtype, int] = {KvDtype.BF16: 2, KvDtype.FP8: 1}

FP8_BLOCK = 128
MX_GROUP = 32
INT4_GROUP = 32
NVFP4_GROUP = 16
FP32_BYTES = 4
BF16_BYTES = 2

# Nominal bits per weight used by the seed's simple rule and by the format tables in the docs.
NOMINAL_BITS: dict[WeightFormat, float] = {
    WeightFormat.BF16: 16.0,
    WeightFormat.FP8: 8.0 + 32.0 / (FP8_BLOCK * FP8_BLOCK),
    WeightFormat.MXFP4: 4.0 + 8.0 / MX_GROUP,
    WeightFormat.INT4: 4.0 + 16.0 / INT4_GROUP,
    WeightFormat.NVFP4: 4.0 + 8.0 / NVFP4_GROUP,
}

FOUR_BIT_FORMATS = frozenset({WeightFormat.MXFP4, WeightFormat.INT4, WeightFormat.NVFP4})


E = TypeVar("E", bound=StrEnum)


def _parse(kind: type[E], what: str, value: str) -> E:
    try:
        return kind(value.lower())
    except ValueError:
        allowed = ", ".join(f.value for f in kind)
        raise CapacityError(f"unknown {what} {value!r}; allowed: {allowed}") from None


def parse_weight_format(value: str) -> WeightFormat:
    return _parse(WeightFormat, "weight format", value)


def parse_kv_dtype(value: str) -> KvDtype:
    return _parse(KvDtype, "KV dtype", value)


def matrix_bytes(fmt: WeightFormat, rows: int, cols: int) -> int:
    """Bytes of one [rows, cols] weight (cols = input features, the quantization axis)."""
    if fmt is WeightFormat.BF16:
        return BF16_BYTES * rows * cols
    if fmt is WeightFormat.FP8:
        return rows * cols + ceil(rows / FP8_BLOCK) * ceil(cols / FP8_BLOCK) * FP32_BYTES
    packed = rows * ceil(cols / 2)
    if fmt is WeightFormat.MXFP4:
        return packed + rows * ceil(cols / MX_GROUP)
    if fmt is WeightFormat.INT4:
        return packed + rows * ceil(cols / INT4_GROUP) * BF16_BYTES
    return packed + rows * ceil(cols / NVFP4_GROUP) + FP32_BYTES
