"""SGLang 0.5.23's K3 memory levers: where each runs, and the planner's choice of each for a
layout with its reason. One home for the rules `plan` (layout search), `plan --disagg` and
`emit` (the generated headers) share. Line numbers are in the sglang 0.5.23 wheel's
`sglang/srt/`.

- mamba_radix_cache_strategy extra_buffer_lazy: 4 KDA state slots per running request instead
  of 5 (capacity.memory.mamba_slots_per_request); refused under PD disaggregation
  (arg_groups/mamba_hook.py:123-128) and without the overlap scheduler
  (kv_cache_configurator.py:3073-3076).
- decode context parallelism (dcp_size): each rank of a DCP group holds 1/dcp of the MLA KV
  (capacity.memory.dcp_kv_tokens). K3 runs it only on the cutedsl_mla decode backend
  (FlashInfer >= 0.6.17, Blackwell) or aiter's gluon MLA kernel (ROCm), and with DSPARK only
  with the static verify (arg_groups/model_overrides/kimi_k3.py:51-120).
- HiCache (enable_hierarchical_cache, hicache_ratio): a host pool of ratio x each device pool
  (capacity.memory.hicache_ratio / hicache_host); host RAM per node from the GPU table.
- EPLB (ep_num_redundant_experts): modelled in the memory (capacity.memory._stage_weights), but
  SGLang 0.5.23's K3 builds its MoE with n_routed_experts only (models/kimi_k3.py:503-504),
  unlike models that add the redundant experts (models/glm4_moe.py:536): not chosen for K3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capacity.tables import GpuSpec

# GPUs with a K3 DCP decode kernel in SGLang 0.5.23 (kimi_k3.py:84-112): cutedsl_mla, which
# needs FlashInfer's trtllm MLA decode with enable_dcp (SM100 Blackwell), and aiter's gluon
# MLA on ROCm. aiter's gluon kernel is assumed to run on gfx950 (MI355X) only: the ROCm K3
# kernels are gfx950-validated (sgl-project/sglang#35770, ROCm/aiter#4479) and nothing
# published shows it on gfx942 (MI300X/MI325X).
DCP_DECODE_BACKENDS: dict[str, str] = {
    "B200": "cutedsl_mla", "B300": "cutedsl_mla", "GB200": "cutedsl_mla",
    "GB300": "cutedsl_mla", "MI355X": "aiter",
}
# Redundant experts EPLB would add per layer; off for K3 (see the module docstring).
K3_EPLB_WIRED = False
EPLB_OFF_REASON = ("SGLang 0.5.23's Kimi K3 model builds its MoE layers with n_routed_experts "
                   "only (models/kimi_k3.py:503-504; glm4_moe.py:536 adds "
                   "ep_num_redundant_experts), so redundant experts would not be placed; the "
                   "planner's memory model prices them (--redundant-experts) for when it is")


def dcp_backend(gpu: GpuSpec | str) -> str | None:
    """The decode attention backend K3's DCP runs on for this GPU, or None: no DCP here."""
    name = gpu if isinstance(gpu, str) else gpu.gpu
    return DCP_DECODE_BACKENDS.get(name.upper())


def dcp_sizes(gpu: GpuSpec, attention_tp: int) -> list[int]:
    """DCP sizes the layout search tries: powers of two above 1 dividing the attention TP, on
    GPUs with a K3 DCP kernel."""
    if dcp_backend(gpu) is None:
        return []
    return [d for d in (2, 4, 8, 16, 32, 64) if d <= attention_tp and attention_tp % d == 0]


@dataclass(frozen=True)
class Lever:
    """One lever's choice for a deployment: its SGLang settings (engine.sglang field -> value,
    empty when off) and why, for the generated file's header."""

    name: str
    on: bool
    settings: dict[str, Any]
    reason: str

    def header_line(self) -> str:
        return f"{self.name}: {'on' if self.on else 'off'} because {self.reason}."
