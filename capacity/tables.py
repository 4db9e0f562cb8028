"""GPU specifications and on-demand prices, loaded from CSV tables with sources and dates."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from datetime import date
from importlib import resources
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from capacity.errors import CapacityError

T = TypeVar("T", bound=BaseModel)

GIB = 1024**3
GB = 1000**3


class GpuSpec(BaseModel):
    """One row of gpus.csv: dense (non-sparse) peaks per GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str = Field(min_length=1)
    vendor: str
    memory: float = Field(gt=0)
    memory_unit: Literal["GB", "GiB"]
    hbm_tbps: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    fp8_tflops: float | None = Field(default=None, gt=0)
    fp4_tflops: float | None = Field(default=None, gt=0)
    native_fp4: bool
    scale_up_gbps: float = Field(gt=0, description="per GPU, per direction")
    scale_up_note: str = ""
    scale_out_gbps: float = Field(gt=0, description="per GPU NIC bandwidth")
    gpus_per_node: int = Field(gt=0)
    scale_up_domain: int = Field(gt=0, description="GPUs that reach each other at scale-up speed")
    source: str = Field(min_length=1)
    as_of: date
    # Host (CPU) RAM of one node of this GPU, where a published system lists it: what SGLang's
    # HiCache host tier can use (capacity.memory.hicache_host). None: not known here, so the
    # planner does not plan a host tier.
    host_ram_gb: float | None = Field(default=None, gt=0, description="per node, GB")
    host_ram_source: str = ""

    @field_validator("fp8_tflops", "fp4_tflops", "host_ram_gb", mode="before")
    @classmethod
    def _blank_is_none(cls, value: object) -> object:
        return None if value in ("", "-") else value

    @property
    def host_ram_bytes(self) -> int | None:
        return None if self.host_ram_gb is None else int(self.host_ram_gb * GB)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory * (GIB if self.memory_unit == "GiB" else GB))

    @property
    def memory_label(self) -> str:
        return f"{self.memory:g} {self.memory_unit}"


class PriceRow(BaseModel):
    """One row of prices.csv: an on-demand price for one GPU from one provider."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: str = Field(min_length=1)
    gpu: str = Field(min_length=1)
    usd_per_gpu_hour: float = Field(gt=0)
    date_read: str = Field(description="YYYY-MM-DD or YYYY-MM as published")
    source: str = Field(min_length=1)
    note: str = ""

    @field_validator("date_read")
    @classmethod
    def _date_parses(cls, value: str) -> str:
        _parse_loose_date(value)
        return value

    @property
    def read_on(self) -> date:
        return _parse_loose_date(self.date_read)

    def age_days(self, today: date | None = None) -> int:
        return ((today or date.today()) - self.read_on).days


class SglangK3Path(BaseModel):
    """One row of sglang_k3_paths.csv: what SGLang 0.5.23 runs K3's MXFP4 checkpoint with on
    one GPU type, read from its source (`decided_by`: file:line in the wheel's sglang/)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str = Field(min_length=1)
    arch: str = Field(min_length=1)
    runnable: bool
    experts_in_memory: Literal["mxfp4", "bf16", "none"]
    label: str = Field(min_length=1, description="short name for plan rows")
    moe_runner: str
    flags: str = ""
    path: str = Field(min_length=1)
    decided_by: str = Field(min_length=1)
    note: str = ""
    env: str = Field(default="", description=(
        "NAME=VALUE pairs (space-separated) SGLang's processes need for this path; emit writes "
        "them into the Serve file's runtime_env"))

    @field_validator("env")
    @classmethod
    def _env_pairs(cls, value: str) -> str:
        for pair in value.split():
            name, sep, _ = pair.partition("=")
            if not sep or not name:
                raise ValueError(f"env {pair!r} is not NAME=VALUE")
        return value

    def env_vars(self) -> dict[str, str]:
        return dict(pair.split("=", 1) for pair in self.env.split())


def _parse_loose_date(value: str) -> date:
    text = value.strip()
    try:
        if len(text) == 7:  # a month-only date is taken as the first of that month
            return date.fromisoformat(text + "-01")
        return date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"date {value!r} is not YYYY-MM-DD or YYYY-MM") from None


def _read_rows(
    model: type[T], text: str, label: str, key_fields: Sequence[str]
) -> list[T]:
    reader = csv.DictReader(io.StringIO(text))
    expected = set(model.model_fields)
    header = set(reader.fieldnames or [])
    required = {n for n, f in model.model_fields.items() if f.is_required()}
    if not required <= header:
        missing = ", ".join(sorted(required - header))
        raise CapacityError(f"{label}: header is missing columns: {missing}")
    unknown = header - expected
    if unknown:
        raise CapacityError(
            f"{label}: unknown columns {', '.join(sorted(unknown))}; allowed: "
            f"{', '.join(model.model_fields)}"
        )
    rows: list[T] = []
    for line_no, raw in enumerate(reader, start=2):
        if not any((v or "").strip() for v in raw.values()):
            continue
        cleaned = {k: (v or "").strip() for k, v in raw.items() if k is not None}
        try:
            rows.append(model.model_validate(cleaned))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"]) or "row"
            ident = ", ".join(f"{k}={cleaned.get(k, '')!r}" for k in key_fields)
            raise CapacityError(
                f"{label} line {line_no} ({ident}): {where}: {error['msg']}"
            ) from None
    if not rows:
        raise CapacityError(f"{label}: no data rows")
    return rows


def _table_text(path: str | Path | None, packaged_name: str) -> tuple[str, str]:
    if path is None:
        return resources.files("capacity.data").joinpath(packaged_name).read_text(), packaged_name
    file = Path(path)
    if not file.is_file():
        raise CapacityError(f"table file {str(file)!r} does not exist")
    return file.read_text(), str(file)


def read_table(model: type[T], packaged_name: str, key_fields: Sequence[str],
               path: str | Path | None = None) -> list[T]:
    """Rows of a CSV table in capacity/data/ (or `path`), validated into `model`; bad rows fail
    with the file, line and column."""
    text, label = _table_text(path, packaged_name)
    return _read_rows(model, text, label, key_fields)


def load_gpus(path: str | Path | None = None) -> dict[str, GpuSpec]:
    """GPU specs keyed by upper-case name; the packaged table unless a path is given."""
    text, label = _table_text(path, "gpus.csv")
    rows = _read_rows(GpuSpec, text, label, ("gpu",))
    table: dict[str, GpuSpec] = {}
    for row in rows:
        key = row.gpu.upper()
        if key in table:
            raise CapacityError(f"{label}: GPU {row.gpu!r} is listed twice")
        table[key] = row
    return table


def load_prices(path: str | Path | None = None) -> list[PriceRow]:
    """All price rows; the packaged table unless a path is given."""
    text, label = _table_text(path, "prices.csv")
    return _read_rows(PriceRow, text, label, ("provider", "gpu"))


def load_k3_paths(path: str | Path | None = None) -> dict[str, SglangK3Path]:
    """SGLang 0.5.23's K3 path per GPU type (upper-case name); the packaged table unless a
    path is given."""
    text, label = _table_text(path, "sglang_k3_paths.csv")
    rows = _read_rows(SglangK3Path, text, label, ("gpu",))
    table: dict[str, SglangK3Path] = {}
    for row in rows:
        if row.gpu.upper() in table:
            raise CapacityError(f"{label}: GPU {row.gpu!r} is listed twice")
        if row.runnable == (row.experts_in_memory == "none"):
            raise CapacityError(f"{label}: GPU {row.gpu!r}: a runnable path keeps its experts "
                                "as mxfp4 or bf16, an unrunnable one as none")
        table[row.gpu.upper()] = row
    return table


def gpu_spec(gpus: dict[str, GpuSpec], name: str) -> GpuSpec:
    spec = gpus.get(name.upper())
    if spec is None:
        raise CapacityError(f"unknown GPU {name!r}; allowed: {', '.join(g.gpu for g in gpus.values())}")
    return spec


def cheapest_prices(
    prices: Iterable[PriceRow], source_contains: str | None = None,
    provider_contains: str | None = None,
) -> dict[str, PriceRow]:
    """The cheapest row per GPU (upper-case key), optionally filtered by source or provider."""
    best: dict[str, PriceRow] = {}
    for row in prices:
        if source_contains and source_contains.lower() not in row.source.lower():
            continue
        if provider_contains and provider_contains.lower() not in row.provider.lower():
            continue
        key = row.gpu.upper()
        if key not in best or row.usd_per_gpu_hour < best[key].usd_per_gpu_hour:
            best[key] = row
    return best


def check_price_gpus(prices: Iterable[PriceRow], gpus: dict[str, GpuSpec], label: str) -> None:
    for index, row in enumerate(prices, start=2):
        if row.gpu.upper() not in gpus:
            raise CapacityError(
                f"{label} line {index} (provider={row.provider!r}): unknown GPU {row.gpu!r}; "
                f"allowed: {', '.join(g.gpu for g in gpus.values())}"
            )


def gpu_vendor(gpu: str | None) -> str:
    """The vendor of a GPU name: the planner's GPU table's `vendor` column; a name the table
    does not list is AMD when it is an Instinct part (MI...), else NVIDIA, as is no name."""
    if not gpu:
        return "NVIDIA"
    spec = load_gpus().get(gpu.upper())
    if spec is not None:
        return spec.vendor.upper()
    return "AMD" if gpu.upper().startswith("MI") else "NVIDIA"
