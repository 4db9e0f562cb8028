"""DSpark acceptance by workload, and how SGLang's adaptive verify changes it with batch size.

The table (capacity/data/dspark_acceptance.csv) holds published K3 + DSpark acceptance lengths
(bonus token included, gamma 7) per task, each with its source and date. Under SGLang's
confidence-scheduled verify (`SGLANG_RAGGED_VERIFY_MODE=compact`) the planner trims each
request's window once the batch makes verify tokens expensive, so both the accepted run and
the verified width fall with batch. The one published curve (LMSYS, K3 day-0 blog,
2026-07-27) gives two points: break-even through batch 8, and at batch 256 acceptance 2.7 ->
2.2 on a chat panel and 5.0 -> 4.3 on a few-shot math panel. `adaptive_acceptance` holds the
acceptance flat to batch 8, then lowers it linearly in log2(batch) to the published batch-256
fraction (interpolated in the base acceptance between the two panels), and holds it past 256
(no data there). The verified width follows from a geometric per-position acceptance
(assumption): a window of w positions accepts 1 + r + ... + r^(w-1), so the width that
yields the trimmed acceptance is w = log(1 - a (1 - r)) / log(r), with r from the full window.
"""

from __future__ import annotations

import math
from functools import cache

from pydantic import BaseModel, ConfigDict, Field

from capacity.errors import CapacityError
from capacity.tables import read_table

# LMSYS K3 day-0 blog (2026-07-27): trimming is break-even through batch 8; at batch 256 the
# chat panel's acceptance eases from 2.7 to 2.2 and the few-shot math panel's from 5.0 to 4.3.
TRIM_START_BATCH = 8
TRIM_END_BATCH = 256
PUBLISHED_FALLOFF = ((2.7, 2.2), (5.0, 4.3))  # (verify-all acceptance, at batch 256)
DEFAULT_WORKLOAD = "mean"


class AcceptanceRow(BaseModel):
    """One published acceptance length (gamma 7, bonus included)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str = Field(min_length=1)
    task: str = Field(min_length=1)
    temperature: str
    acceptance_length: float = Field(ge=1.0, le=8.0)
    draft: str
    engine: str
    source: str = Field(min_length=1)
    date: str = Field(pattern=r"^\d{4}-\d{2}(-\d{2})?$")
    note: str = ""


@cache
def acceptance_table() -> dict[str, AcceptanceRow]:
    rows = read_table(AcceptanceRow, "dspark_acceptance.csv", ("workload",))
    table = {r.workload: r for r in rows}
    if len(table) != len(rows):
        raise CapacityError("dspark_acceptance.csv: a workload is listed twice")
    return table


def workload_acceptance(workload: str) -> AcceptanceRow:
    """The published acceptance for a workload name (chat, code, agent, reasoning, ...)."""
    table = acceptance_table()
    row = table.get(workload.strip().lower())
    if row is None:
        raise CapacityError(f"unknown workload {workload!r}; allowed: {', '.join(table)}")
    return row


def _falloff_at_256(base: float) -> float:
    """The fraction of its verify-all acceptance a workload keeps at batch 256, interpolated
    in the base acceptance between the two published panels (clamped outside them)."""
    (a0, a1), (b0, b1) = PUBLISHED_FALLOFF
    low, high = a1 / a0, b1 / b0
    t = min(1.0, max(0.0, (base - a0) / (b0 - a0)))
    return low + (high - low) * t


def adaptive_acceptance(base: float, batch: float) -> float:
    """Acceptance length under the confidence-scheduled trim at this many running requests."""
    if batch <= TRIM_START_BATCH:
        return base
    span = math.log2(TRIM_END_BATCH / TRIM_START_BATCH)
    x = min(1.0, math.log2(batch / TRIM_START_BATCH) / span)
    return max(1.0, base * (1.0 - (1.0 - _falloff_at_256(base)) * x))


def per_position_acceptance(base: float, window: int) -> float:
    """r with 1 + r + ... + r^(window - 1) = base (bisection; 0 < r < 1 for 1 < base < window)."""
    if not 1.0 <= base <= window:
        raise CapacityError(f"acceptance {base} outside [1, {window}]")
    if base >= window:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        r = (low + high) / 2
        if sum(r**k for k in range(window)) < base:
            low = r
        else:
            high = r
    return (low + high) / 2


def verify_width(base: float, accepted: float, window: int) -> float:
    """Positions verified per request (bonus included) that give `accepted` when the full
    window of `window` positions gives `base`, under a geometric per-position acceptance."""
    if accepted >= base:
        return float(window)
    r = per_position_acceptance(base, window)
    if r <= 0.0:
        return 1.0
    if r >= 1.0:
        return min(float(window), accepted)
    return min(float(window), max(1.0, math.log(1.0 - accepted * (1.0 - r)) / math.log(r)))
