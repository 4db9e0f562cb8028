"""Capacity planner for Kimi K3 (+ DSpark draft): pure numbers from config.json files and data
tables. This package never imports `serve_app`; Ray is imported only inside `emit`."""

from capacity.config import Layout, Speculation, Workload
from capacity.errors import CapacityError
from capacity.families import describe_model
from capacity.formats import KvDtype, WeightFormat
from capacity.memory import (
    KdaRollbackCosts,
    MemoryReport,
    RunningFit,
    kda_rollback_costs,
    memory_per_gpu,
    running_fit,
)
from capacity.model import ModelDescriptor
from capacity.planner import PlanResult, PlanRow, plan
from capacity.tables import GpuSpec, PriceRow, load_gpus, load_prices
from capacity.timing import DEFAULT_CONSTANTS, TimeConstants, decode_rate, prefill_seconds

__all__ = [
    "DEFAULT_CONSTANTS",
    "CapacityError",
    "GpuSpec",
    "KdaRollbackCosts",
    "KvDtype",
    "Layout",
    "MemoryReport",
    "ModelDescriptor",
    "PlanResult",
    "PlanRow",
    "PriceRow",
    "RunningFit",
    "Speculation",
    "TimeConstants",
    "WeightFormat",
    "Workload",
    "decode_rate",
    "describe_model",
    "kda_rollback_costs",
    "load_gpus",
    "load_prices",
    "memory_per_gpu",
    "plan",
    "prefill_seconds",
    "running_fit",
]
