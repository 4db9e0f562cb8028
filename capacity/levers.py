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
- unified memory (enable_unified_memory): one buffer split at run time between the MLA KV and
  KDA state pools (arg_groups/kv_cache_hook.py:528-700); not chosen: the planner's static
  split is what it sizes and checks (see choose_levers).
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
EPLB_OFF_REASON = ("SGLang 0.5.23's Kimi K3 model builds its MoE layers with n_routed_experts "
                   "only (models/kimi_k3.py:503-504; glm4_moe.py:536 adds "
                   "ep_num_redundant_experts), so redundant experts would not be placed; the "
                   "planner's memory model prices them ((E + R) / EP experts per rank, "
                   "`kimi-capacity explain --redundant-experts R`) for when it is")


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


# --- the choice for one deployment --------------------------------------------------------


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f}"


@dataclass(frozen=True)
class LeverPlan:
    """A layout with its levers chosen, and each lever's choice with its reason."""

    layout: Any  # capacity.config.Layout
    levers: tuple[Lever, ...]

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for lever in self.levers:
            out.update(lever.settings)
        return out

    def notes(self) -> tuple[str, ...]:
        return tuple(lever.header_line() for lever in self.levers)


def choose_levers(model: Any, layout: Any, gpu: GpuSpec, context_length: int,
                  draft: Any = None, speculation: Any = None, role: str = "both",
                  search_dcp: bool = True, kda_rollback: str = "scratch",
                  ring_len: int = 16) -> LeverPlan:
    """SGLang 0.5.23's K3 levers for one deployment, each from the planner's numbers:

    - extra_buffer_lazy for an aggregated server (more running requests in the same state
      pool), extra_buffer on a PD side (SGLang refuses lazy there);
    - DCP: the size (among `dcp_sizes`, 1 included) whose full-context running requests decode
      the most tokens/s in all, on a GPU with K3's DCP kernel and not on a PD prefill server;
      a `layout` that already has dcp > 1 keeps it (so `emit --dcp N` reproduces a plan row);
    - HiCache: on where the node's host RAM is known, at the ratio SGLang's auto-sizing gives
      the host budget (capacity.memory.hicache_ratio); not on a PD decode server;
    - EPLB: off for K3 (EPLB_OFF_REASON).
    `role`: "both" (aggregated), "prefill" or "decode"."""
    from capacity.memory import (
        hicache_ratio,
        mamba_slots_per_request,
        running_fit,
    )
    from capacity.timing import decode_rate

    levers: list[Lever] = []

    def fit(candidate: Any) -> Any:
        return running_fit(model, candidate, gpu, context_length, draft, speculation,
                           kda_rollback=kda_rollback, ring_len=ring_len)

    # 1. The KDA state slots per running request (its reason is written once the DCP size is
    # chosen, on the final layout).
    lazy_on = role == "both"
    layout = layout.model_copy(update={
        "mamba_strategy": "extra_buffer_lazy" if lazy_on else "extra_buffer"})

    # 2. Decode context parallelism.
    backend = dcp_backend(gpu)
    if backend is None:
        layout = layout.model_copy(update={"dcp": 1})
        levers.append(Lever("dcp_size (decode context parallelism)", False, {},
                            f"SGLang 0.5.23 has no K3 DCP decode kernel on {gpu.gpu}: it runs K3 "
                            "DCP on cutedsl_mla (Blackwell) or aiter's gluon MLA (ROCm gfx950) "
                            "only (arg_groups/model_overrides/kimi_k3.py:84-112)"))
    elif role == "prefill":
        layout = layout.model_copy(update={"dcp": 1})
        levers.append(Lever("dcp_size (decode context parallelism)", False, {},
                            "DCP splits decode attention; on a PD prefill server it only adds "
                            "communication (arg_groups/pd_disaggregation_hook.py:57-62)"))
    else:
        def decode_total(candidate: Any) -> tuple[float, Any]:
            f = fit(candidate)
            if not f.fits:
                return 0.0, f
            rate = decode_rate(model, candidate, gpu, max(1, f.max_running_requests),
                               context_length, draft, speculation)
            return rate.total_tokens_s, f

        base = layout.model_copy(update={"dcp": 1})
        base_tps, base_fit = decode_total(base)
        if layout.dcp > 1 or not search_dcp:
            chosen = layout
        else:
            options = [base] + [layout.model_copy(update={"dcp": d})
                                for d in dcp_sizes(gpu, layout.attention_tp)]
            chosen = max(options, key=lambda c: (decode_total(c)[0], -c.dcp))
        tps, chosen_fit = decode_total(chosen)
        layout = chosen
        if chosen.dcp > 1:
            levers.append(Lever(
                f"dcp_size {chosen.dcp} (decode context parallelism)", True,
                {"decode_attention_backend": backend},
                f"each of {chosen.dcp} ranks holds 1/{chosen.dcp} of every request's MLA KV "
                f"(pages of 64 x {chosen.dcp} tokens, arg_groups/overrides.py:216-219): "
                f"{_gb(chosen_fit.full_request_kv_bytes)} GB per GPU per full-context request "
                f"instead of {_gb(base_fit.full_request_kv_bytes)}, max_running_requests "
                f"{chosen_fit.max_running_requests} instead of "
                f"{base_fit.max_running_requests}, {tps:.0f} instead of {base_tps:.0f} tokens/s "
                f"decoded in all at {context_length:,} tokens (planner); K3's DCP needs the "
                f"{backend} decode backend and, with DSPARK, the static verify "
                "(kimi_k3.py:63-112)"))
        else:
            levers.append(Lever(
                "dcp_size (decode context parallelism)", False, {},
                f"no DCP size decodes more here: DCP1 {base_tps:.0f} tokens/s in all at "
                f"{context_length:,} tokens (planner)"))

    if lazy_on:
        before = fit(layout.model_copy(update={"mamba_strategy": "extra_buffer"}))
        after = fit(layout)
        levers.insert(0, Lever(
            "mamba_radix_cache_strategy extra_buffer_lazy", True,
            {"mamba_radix_cache_strategy": "extra_buffer_lazy"},
            f"it keeps {mamba_slots_per_request('extra_buffer_lazy')} KDA state slots per "
            f"running request instead of {mamba_slots_per_request('extra_buffer')} (3 + 1 "
            "tracking slot, the second taken only when needed: mem_cache/allocation_sizing.py:"
            f"11-19, kv_cache_configurator.py:3062-3092): max_running_requests "
            f"{after.max_running_requests} instead of {before.max_running_requests}, "
            f"{after.full_context_requests} full-context requests beside them instead of "
            f"{before.full_context_requests} (the verify scratch per request is unchanged)"))
    else:
        levers.insert(0, Lever(
            "mamba_radix_cache_strategy extra_buffer_lazy", False,
            {"mamba_radix_cache_strategy": "extra_buffer"},
            "SGLang 0.5.23 refuses it under PD disaggregation (arg_groups/mamba_hook.py:"
            "123-128); extra_buffer keeps 5 slots per running request"))

    # 3. HiCache, the host tier.
    stage_free = fit(layout).free_bytes
    ratio = hicache_ratio(gpu, layout.gpus_per_node, stage_free)
    if role == "decode":
        levers.append(Lever("enable_hierarchical_cache (HiCache host tier)", False, {},
                            "a PD decode server gets its prompts' KV from the prefill side; "
                            "the host prefix tier belongs there"))
    elif gpu.host_ram_gb is None:
        levers.append(Lever("enable_hierarchical_cache (HiCache host tier)", False, {},
                            f"no published {gpu.gpu} system's host RAM is in capacity/data/"
                            "gpus.csv, so the host tier cannot be sized"))
    elif ratio <= 0:
        levers.append(Lever("enable_hierarchical_cache (HiCache host tier)", False, {},
                            f"{gpu.host_ram_gb:g} GB of host RAM per node leaves no host budget "
                            f"for {layout.gpus_per_node} ranks"))
    else:
        layout = layout.model_copy(update={"hicache_ratio": ratio})
        host_per_gpu = ratio * stage_free
        levers.append(Lever(
            "enable_hierarchical_cache (HiCache host tier)", True,
            {"enable_hierarchical_cache": True, "hicache_ratio": ratio},
            f"a host pool of {ratio:g} x the {_gb(stage_free)} GB of device KV + KDA state "
            f"pools per GPU ({_gb(host_per_gpu)} GB per GPU, "
            f"{_gb(host_per_gpu * layout.gpus_per_node)} GB of the node's {gpu.host_ram_gb:g} "
            f"GB host RAM; {gpu.host_ram_source}) keeps agents' prefixes (MLA KV and KDA "
            "state) for their next turns instead of re-prefilling them; the ratio is SGLang's "
            "default 2.0 cut to (host RAM - 10 GiB) / ranks x 0.8 with 5% slack "
            "(mem_cache/pool_host/base.py:28-108, hicache_auto_size.py:33-97)"))

    # 4. EPLB's redundant experts.
    levers.append(Lever("ep_num_redundant_experts (EPLB)", False, {}, EPLB_OFF_REASON))

    # 5. Unified memory (one buffer for the MLA KV and KDA state pools, split at run time).
    why = ("the planner sizes the KDA state pool statically (max_mamba_cache_size = slots x "
           "max_running_requests beside one full-context request's KV, what the start-up check "
           "verifies); enable_unified_memory would split one buffer at run time instead, a gain "
           "that depends on the mix of context lengths, which the planner does not model")
    if backend == "aiter" or gpu.vendor.upper() == "AMD":
        why += ("; on ROCm SGLang 0.5.23 also refuses it with DSPARK on the aiter backend "
                "(spec-verify-audited backends only, arg_groups/kv_cache_hook.py:479-488, "
                "641-646)")
    levers.append(Lever("enable_unified_memory", False, {}, why))
    return LeverPlan(layout, tuple(levers))
