"""Shared by the SGLang backend tests: the generated deployment files and their configs, and
the rank layout SGLang's RayEngine uses (test support: the app never computes it)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from serve_app.config import AppConfig

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden"


def generator() -> ModuleType:
    """deployments/generate.py (a script, not a package module)."""
    name = "deployments_generate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "deployments" / "generate.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def serve_files() -> list[str]:
    return [v.file for v in generator().VARIANTS]


def load_serve(rel: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / rel).read_text())


def app_config(rel: str, **overrides: dict[str, Any]) -> AppConfig:
    """The AppConfig a Serve file's builder receives, with sections merged over it."""
    args = load_serve(rel)["applications"][0]["args"]
    for key, value in overrides.items():
        section = dict(args.get(key, {}))
        for k, v in value.items():
            if isinstance(v, dict) and isinstance(section.get(k), dict):
                section[k] = {**section[k], **v}
            else:
                section[k] = v
        args[key] = section
    return AppConfig.model_validate(args)


# --- RayEngine's rank layout --------------------------------------------------------------------


@dataclass(frozen=True)
class RankSlot:
    tp_rank: int
    pp_rank: int
    bundle_index: int
    gpu_id: int  # the index RayEngine passes (Ray's assigned GPU wins when there is one)


def rank_plan(nnodes: int, tp_size: int, pp_size: int = 1, engine_bundle: int = 0
              ) -> list[RankSlot]:
    """Where `RayEngine._launch_scheduler_processes` (0.5.23, auto placement-group mode, no DP)
    puts each scheduler actor: node i's ranks go to bundle `bundle_for_node[i]`, where node 0
    is the bundle on the engine's own node, with `_calculate_rank_ranges` per node."""
    bundle_for_node = [engine_bundle] + [i for i in range(nnodes) if i != engine_bundle]
    pp_per_node = max(pp_size // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp_size, 1)
    tp_per_node = tp_size // nnodes_per_pp_rank
    slots = []
    for node in range(nnodes):
        pp_start = pp_per_node * (node // nnodes_per_pp_rank)
        tp_start = tp_per_node * (node % nnodes_per_pp_rank)
        for pp_rank in range(pp_start, pp_start + pp_per_node):
            for tp_rank in range(tp_start, tp_start + tp_per_node):
                gpu = (pp_rank % pp_per_node) * tp_per_node + (tp_rank % tp_per_node)
                slots.append(RankSlot(tp_rank, pp_rank, bundle_for_node[node], gpu))
    return slots
