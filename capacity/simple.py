"""The seed's sizing rule: weights at a precision plus 20% for runtime and a short context.

Kept exactly as the seed documents state it (decimal GB, one decimal, nominal 16/8/4 bits per
parameter with no scales), so its table can be reproduced digit for digit and compared with the
full memory model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from capacity.errors import CapacityError
from capacity.model import ModelDescriptor
from capacity.tables import GpuSpec, PriceRow, cheapest_prices

SEED_OVERHEAD = 0.20
SEED_PRECISIONS = (16, 8, 4)
# The seed priced setups from the SAVRN Index rows only.
SEED_PRICE_SOURCE = "SAVRN"


@dataclass(frozen=True)
class Setup:
    gpu: GpuSpec
    count: int
    price: PriceRow

    @property
    def usd_per_hour(self) -> float:
        return self.count * self.price.usd_per_gpu_hour


@dataclass(frozen=True)
class PrecisionRow:
    bits: int
    weights_gb: float
    needed_gb: float
    setups: tuple[Setup, ...]  # cheapest first


@dataclass(frozen=True)
class SimpleResult:
    model: str
    params: int
    rows: tuple[PrecisionRow, ...]

    def summary(self) -> str:
        """The seed's sentence, e.g. 'Kimi-K3-DSpark, 2.2B params: 16-bit 4.5 GB weights /
        5.4 GB needed; 8-bit 2.2 / 2.7; 4-bit 1.1 / 1.3. Cheapest setup at every precision: ...'"""
        sizes = []
        for i, row in enumerate(self.rows):
            if i == 0:
                sizes.append(f"{row.bits}-bit {row.weights_gb:.1f} GB weights / "
                             f"{row.needed_gb:.1f} GB needed")
            else:
                sizes.append(f"{row.bits}-bit {row.weights_gb:.1f} / {row.needed_gb:.1f}")
        head = f"{self.model}, {_billions(self.params)} params: " + "; ".join(sizes) + "."
        choices = {_setup_key(r.setups) for r in self.rows if r.setups}
        if not any(r.setups for r in self.rows):
            return head + " No priced GPU setup fits."
        if len(choices) == 1 and all(r.setups for r in self.rows):
            return head + " Cheapest setup at every precision: " + _describe(self.rows[0].setups)
        parts = [
            f"{r.bits}-bit: " + (_describe(r.setups) if r.setups else "nothing fits")
            for r in self.rows
        ]
        return head + " Cheapest setup: " + " ".join(parts)


def _billions(params: int) -> str:
    return f"{params / 1e9:.1f}B" if params < 1e12 else f"{params / 1e12:.2f}T"


def _setup_key(setups: Sequence[Setup]) -> tuple[tuple[str, int, str], ...]:
    return tuple((s.gpu.gpu, s.count, s.price.provider) for s in setups)


def _describe(setups: Sequence[Setup]) -> str:
    best, others = setups[0], setups[1:]
    text = (f"{best.count}x {best.gpu.gpu} ({best.gpu.memory_label}) {best.price.provider} "
            f"${best.usd_per_hour:.2f}/h")
    if others:
        text += "; also fits: " + ", ".join(
            f"{s.count}x {s.gpu.gpu} ${s.usd_per_hour:.2f}" for s in others
        )
    return text + "."


def simple_table(
    model: ModelDescriptor,
    gpus: dict[str, GpuSpec],
    prices: Iterable[PriceRow],
    precisions: Sequence[int] = SEED_PRECISIONS,
    price_source: str | None = SEED_PRICE_SOURCE,
) -> SimpleResult:
    """Weights at each precision, +20%, and the cheapest count of each priced GPU that holds it."""
    if not precisions or any(bits <= 0 for bits in precisions):
        raise CapacityError(f"precisions must be positive bit widths, got {list(precisions)}")
    best = cheapest_prices(prices, source_contains=price_source)
    if not best:
        raise CapacityError(f"no price rows match source {price_source!r}")
    params = model.total_params
    rows = []
    for bits in precisions:
        weights = params * bits / 8
        needed = weights * (1 + SEED_OVERHEAD)
        setups = []
        for key, price in best.items():
            gpu = gpus.get(key)
            if gpu is None:
                continue
            count = math.ceil(needed / gpu.memory_bytes)
            setups.append(Setup(gpu, count, price))
        setups.sort(key=lambda s: (s.usd_per_hour, s.count, s.gpu.gpu))
        rows.append(PrecisionRow(bits, round(weights / 1e9, 1), round(needed / 1e9, 1),
                                 tuple(setups)))
    return SimpleResult(model.name, params, tuple(rows))
