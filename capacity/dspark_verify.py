"""SGLang 0.5.23's adaptive DSpark verify (its ragged-verify scheduler), as this project
deploys it: the switch, the cost table it plans with, and how that table is made.

What SGLang does (srt/speculative/ragged_verify.py, dspark_components/dspark_planner.py,
dspark_sps.py; read for this project in docs/speculation.md):

- The switch is not a server argument but the scheduler's environment:
  SGLANG_RAGGED_VERIFY_MODE = static (the default: every request verifies gamma + 1 tokens,
  the confidence head is not even built) | cap-accept (widths are planned and acceptance capped
  to them, but the target still runs the whole window: a measurement mode) | compact (only the
  planned tokens run through the target: a ragged verify).
- Each step it picks one verify-token budget for the batch, the argmax of expected committed
  tokens x steps per second from the SPS cost table (`--speculative-dspark-sps-table-path`),
  from the draft's confidence two steps back; then it gives the budget out by a global top-K
  over each request's current confidence survival (each request a prefix, 1..gamma + 1
  tokens). A budget of 0 verifies only the bonus token: speculation steps aside.
- The table is read once at start (a missing file fails the start); without one the table is
  flat and the plan verifies everything (no gain). SGLang never writes it: it is profiled
  offline against a running server (`SPS_PROFILE_STEPS`), once per GPU type and layout.
- `--speculative-dspark-confidence-sts-path`: optional per-position temperatures that
  calibrate the confidence head (sglang.benchmark.dspark_sts_fit).
- The widths depend on draft-side information only: lossless by construction.

The reference engine's own adaptive budget (serve_app/engines/reference/spec_budget.py) plans
per request from the same inputs plus measured acceptance, and fits its cost table online.
"""

from __future__ import annotations

import json
import math
from itertools import pairwise
from pathlib import Path
from typing import Any

from capacity.config import Layout
from capacity.tables import gpu_vendor

RAGGED_VERIFY_ENV = "SGLANG_RAGGED_VERIFY_MODE"
RAGGED_VERIFY_MODES = ("static", "cap-accept", "compact")
# What `kimi-capacity emit` deploys a DSpark draft with.
DEFAULT_RAGGED_VERIFY_MODE = "compact"


def sps_table_name(label: str) -> str:
    """The table's file name for a layout label (capacity.config.Layout.label()): one table per
    GPU type and layout, since it is that machine's step time."""
    slug = "".join(c if c.isalnum() else "-" for c in label.lower())
    return "dspark-sps-" + "-".join(filter(None, slug.split("-"))) + ".json"


def default_sps_table(draft_ref: str, label: str) -> str:
    """Where an emitted deployment expects its table: beside the draft checkpoint (the GPU
    nodes' model storage), under `sps/`."""
    return f"{draft_ref.rstrip('/')}/sps/{sps_table_name(label)}"


# How a table is made for a deployment (dspark_sps_profiler.py's own requirements: a running
# server verifying everything, its per-step records on, one token accepted per step, CUDA
# graphs on and captured up to the sweep's batch size). ~20 rounds of >= 10 s each.
SPS_PROFILE_STEPS = (
    "start the deployment once with engine.sglang.ragged_verify_mode: static and, in "
    "runtime_env.env_vars, SGLANG_DSPARK_ENABLE_SPS_RECORD=1 and SGLANG_SIMULATE_ACC_LEN=1.0",
    "python -m sglang.benchmark.dspark_sps_profiler all --base-url http://<head>:8000 "
    "--out {table}",
    "put {table} on every GPU node (the draft's model storage) and deploy this file",
)


def sps_profile_recipe(table: str) -> list[str]:
    return [step.format(table=table) for step in SPS_PROFILE_STEPS]


def _numbers(data: dict[str, Any], key: str, kind: type) -> list[Any]:
    values = data.get(key)
    if not isinstance(values, list) or not values:
        raise ValueError(f"{key} must be a non-empty list")
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{key} must hold {kind.__name__}s")
    if kind is float and not all(math.isfinite(v) for v in values):
        raise ValueError(f"{key} must be finite")
    return values


def sps_table_problem(path: str | Path) -> str | None:
    """What SGLang 0.5.23's loader would refuse in the table at `path` (dspark_sps.py: the
    1-D {sample_batch_tokens, sample_steps_per_sec, max_batch_tokens} or the additive 2-D
    {bias_seconds, bs_probes, alpha_seconds, m_probes, theta_seconds}), or a table it would
    take as flat (one probe: verify-all, no gain); None when it is a usable table."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if "bias_seconds" in data:
            bias = data["bias_seconds"]
            if not isinstance(bias, (int, float)) or not bias > 0:
                raise ValueError("bias_seconds must be > 0")
            for probes, values in (("bs_probes", "alpha_seconds"), ("m_probes", "theta_seconds")):
                p = _numbers(data, probes, int)
                v = _numbers(data, values, (int, float))  # type: ignore[arg-type]
                if len(p) != len(v):
                    raise ValueError(f"{probes} and {values} differ in length")
                if any(b <= a for a, b in pairwise(p)):
                    raise ValueError(f"{probes} must increase strictly")
            return None
        tokens = _numbers(data, "sample_batch_tokens", int)
        sps = _numbers(data, "sample_steps_per_sec", (int, float))  # type: ignore[arg-type]
        if len(tokens) != len(sps):
            raise ValueError("sample_batch_tokens and sample_steps_per_sec differ in length")
        if any(b <= a for a, b in pairwise(tokens)):
            raise ValueError("sample_batch_tokens must increase strictly")
        if not all(v > 0 for v in sps):
            raise ValueError("sample_steps_per_sec must be > 0")
        if not isinstance(data.get("max_batch_tokens"), int) or data["max_batch_tokens"] < tokens[-1]:
            raise ValueError("max_batch_tokens must be an int >= the last probe")
        if len(tokens) <= 1:
            return (f"{path}: one probe is a flat table; SGLang then verifies every draft "
                    "(no adaptive gain)")
        return None
    except (OSError, ValueError, TypeError) as exc:
        return f"{path}: not an SGLang 0.5.23 DSpark SPS table ({exc})"


# Why a GPU's default DSpark verify is static: SGLang 0.5.23 runs a compact (ragged) verify
# in a CUDA graph only on attention backends that declare supports_ragged_verify_graph (fa3,
# trtllm_mha / trtllm_mla, flashinfer_mla and flashmla, the KDA backend); the ROCm ones it
# picks for K3 (aiter, triton) inherit False (base_attn_backend.py:65), so there every
# adaptive step would run eagerly.
STATIC_VERIFY_REASON = {
    "AMD": "SGLang 0.5.23's ROCm attention backends (aiter, triton) have no ragged-verify CUDA "
           "graph (base_attn_backend.py:65), so a compact verify would run eagerly here",
}


_DP_REASON = ("SGLang 0.5.23 refuses a dense DSpark draft's compact verify under attention DP "
              "with CUDA graphs (dspark_worker_v2.py:336-347)")


_DCP_REASON = ("SGLang 0.5.23 runs K3's decode context parallelism with DSPARK only under "
               "SGLANG_RAGGED_VERIFY_MODE=static (arg_groups/model_overrides/kimi_k3.py:63-75)")


def dp_static_reason() -> str:
    return _DP_REASON


def dcp_static_reason() -> str:
    return _DCP_REASON


def static_verify_reason(layout: Layout) -> str | None:
    """Why `kimi-capacity emit` deploys this layout with the static DSpark verify; None: it
    deploys the adaptive (compact) one."""
    if layout.attention_dp > 1:
        return _DP_REASON
    if layout.dcp > 1:
        return _DCP_REASON
    return STATIC_VERIFY_REASON.get(gpu_vendor(layout.gpu))
