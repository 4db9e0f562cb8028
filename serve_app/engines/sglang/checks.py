"""Start-up checks of a deployment for the SGLang backend, each problem naming its field:
the config tree against the model and the GPUs (`sglang_problems`), the mapped server
arguments against SGLang 0.5.23's own field definitions (`check_server_args`). Pure Python:
importable without SGLang."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capacity.sglang_flags import SGLANG_VERSION, draft_attention_backends, sglang_fields
from capacity.sglang_recipe import TRANSFER_BACKENDS, pipeline_problem
from serve_app.engines.sglang.args import runtime_env_vars, sglang_server_args
from serve_app.protocol.generation import Role

if TYPE_CHECKING:
    from serve_app.config import AppConfig

logger = logging.getLogger("serve_app.sglang")

# 0.5.23 `_handle_dspark`: "DSpark speculative decoding only supports CUDA, NPU or XPU device."
DSPARK_DEVICES = ("cuda", "npu", "xpu")
# The planner's KV element types for SGLang's kv_cache_dtype values.
_KV_DTYPE = {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8",
             "fp8_e5m2": "fp8"}


_SCALARS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (float, int), "bool": (bool,),
                                         "str": (str,)}


def _type_ok(type_src: str, value: Any) -> bool:
    optional = type_src.startswith("Optional[") or type_src.endswith("| None")
    base = type_src.removeprefix("Optional[").removesuffix("]") if type_src.startswith(
        "Optional[") else type_src.removesuffix(" | None")
    if value is None:
        return optional
    kinds = _SCALARS.get(base)
    if kinds is None:  # lists, dicts, literals, records: not checked here
        return True
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


def check_server_args(args: dict[str, Any]) -> list[str]:
    """Each argument against SGLang 0.5.23's definition: the field exists, the value has its
    type, and lies among its choices where it declares some."""
    fields = sglang_fields()
    problems = []
    draft_backend = args.get("speculative_draft_attention_backend")
    if draft_backend is not None and draft_backend not in draft_attention_backends():
        # SGLang would not refuse it: it logs and falls back, so the file would lie.
        problems.append(f"speculative_draft_attention_backend={draft_backend!r} is not one of "
                        f"SGLang's draft backends {draft_attention_backends()}")
    for name, value in args.items():
        spec = fields.get(name)
        if spec is None:
            problems.append(f"{name!r} is not an SGLang {SGLANG_VERSION} server argument")
            continue
        if not _type_ok(spec["type"], value):
            problems.append(f"{name}={value!r} does not match SGLang's type {spec['type']}")
        elif spec["choices"] is not None and value is not None and value not in spec["choices"]:
            problems.append(f"{name}={value!r} is not one of SGLang's choices {spec['choices']}")
    return problems



def _local_config(path: str | None) -> Path | None:
    if path is None:
        return None
    from serve_app.config import resolve_path

    candidate = resolve_path(path) / "config.json"
    return candidate if candidate.is_file() else None


def planner_layout(config: AppConfig) -> Any:
    """The capacity planner's Layout of a deployment (raises pydantic's ValidationError when
    the config's layout is not one the planner knows)."""
    import capacity

    p, s = config.parallelism, config.engine.sglang
    gpu = capacity.load_gpus()[config.placement.gpu_type or ""]
    # `auto` resolves to extra_buffer for K3 (capacity.memory.mamba_slots_per_request).
    strategy = ("extra_buffer_lazy" if s.mamba_radix_cache_strategy == "extra_buffer_lazy"
                else "extra_buffer")
    return capacity.Layout(
        gpu=gpu.gpu, **p.model_dump(), kv_dtype=_KV_DTYPE[s.kv_cache_dtype],
        mem_fraction=s.mem_fraction_static, mamba_strategy=strategy,
        hicache_ratio=(s.hicache_ratio or 0.0) if s.enable_hierarchical_cache else 0.0)


def kda_rollback(s: Any, draft: Any) -> dict[str, Any]:
    """The planner's KDA verify rollback options (capacity.memory.running_fit,
    memory_per_gpu) for engine.sglang: SGLang's ReplaySSM verify when it is on, else its
    default per-position state scratch. Without a draft descriptor the planner sizes no
    verify, so there is nothing to roll back (scratch of 0 positions)."""
    replay = s.enable_linear_replayssm_spec and draft is not None
    return {"kda_rollback": "replay" if replay else "scratch",
            "ring_len": s.linear_replayssm_cache_len}


def _full_context_problems(model: Any, layout: Any, gpu: Any, draft: Any, s: Any) -> list[str]:
    """The advertised context must be servable: the KV of one full-context request beside the
    KDA states of max_running_requests running requests (SGLang's pools, as the capacity
    planner sizes them), and a state pool that does not cap the running requests lower."""
    from capacity.memory import hicache_host, mamba_slots_per_request, running_fit

    problems = []
    fit = running_fit(model, layout, gpu, s.context_length, draft,
                      running=s.max_running_requests, **kda_rollback(s, draft))
    if not fit.fits:
        states = fit.state_bytes_per_request * max(1, s.max_running_requests
                                                   // layout.attention_dp)
        problems.append(
            f"engine.sglang.context_length={s.context_length:,} is not servable on "
            f"{layout.label()} with kv_cache_dtype={s.kv_cache_dtype!r} and "
            f"max_running_requests={s.max_running_requests}: one full-context request's KV needs "
            f"{fit.full_request_kv_bytes / 1e9:.1f} GB per GPU beside {states / 1e9:.1f} GB of "
            f"KDA state ({fit.kda_rollback} rollback), {fit.free_bytes / 1e9:.1f} GB are free "
            "after weights (use "
            "kimi-capacity emit: it sizes max_running_requests, or FP8 KV, or a larger layout)")
    slots = mamba_slots_per_request(layout.mamba_strategy)
    needed = s.max_running_requests * slots
    if s.max_mamba_cache_size is None:
        # SGLang then gives the KDA states about half the memory after the weights.
        logger.warning("engine.sglang.max_mamba_cache_size is unset: SGLang sizes the KDA state "
                       "pool by mamba_full_memory_ratio, taking KV memory the planner counted")
    elif (s.mamba_radix_cache_strategy in ("auto", "extra_buffer", "extra_buffer_lazy")
          and s.max_mamba_cache_size < needed):
        problems.append(
            f"engine.sglang.max_mamba_cache_size={s.max_mamba_cache_size} holds the states of "
            f"only {s.max_mamba_cache_size // slots} running requests "
            f"({slots} slots each with {layout.mamba_strategy}); "
            f"max_running_requests={s.max_running_requests} needs {needed}")
    if s.enable_hierarchical_cache and s.hicache_ratio is not None:
        # The host tier must fit the node's host RAM as SGLang budgets it (with an explicit
        # ratio SGLang does not shrink it: the allocation fails at start instead).
        tier = hicache_host(layout, gpu, fit.free_bytes)
        if tier is not None and not tier.fits:
            problems.append(
                f"engine.sglang.hicache_ratio={s.hicache_ratio}: {tier.host_bytes_per_rank / 1e9:.0f}"
                f" GB of host pool per GPU exceeds the {tier.budget_bytes / 1e9:.0f} GB SGLang "
                f"lets each of {layout.gpus_per_node} ranks take of a {gpu.gpu} node's "
                f"{gpu.host_ram_gb:g} GB host RAM ((RAM - 10 GiB) / ranks x 0.8)")
    return problems


def dcp_problems(config: AppConfig) -> list[str]:
    """SGLang 0.5.23's rules for K3's decode context parallelism (arg_groups/model_overrides/
    kimi_k3.py:51-120): a decode kernel with DCP on this GPU (cutedsl_mla on Blackwell, aiter
    on ROCm gfx950: capacity.levers.DCP_DECODE_BACKENDS), that kernel when one is named, and
    the static DSpark verify."""
    from capacity.levers import dcp_backend

    p, s = config.parallelism, config.engine.sglang
    if p.dcp == 1:
        return []
    problems = []
    backend = dcp_backend(config.placement.gpu_type or "")
    if backend is None:
        problems.append(f"parallelism.dcp={p.dcp}: SGLang 0.5.23 has no K3 DCP decode kernel on "
                        f"{config.placement.gpu_type} (cutedsl_mla on Blackwell, aiter on "
                        "ROCm gfx950: arg_groups/model_overrides/kimi_k3.py:84-112)")
    elif s.decode_attention_backend not in (None, backend):
        problems.append(f"engine.sglang.decode_attention_backend="
                        f"{s.decode_attention_backend!r}: K3's DCP decodes on {backend!r} "
                        "here (kimi_k3.py:84-112)")
    if s.speculative_algorithm == "DSPARK" and s.ragged_verify_mode != "static":
        problems.append(f"engine.sglang.ragged_verify_mode={s.ragged_verify_mode!r} with "
                        f"parallelism.dcp={p.dcp}: SGLang 0.5.23 runs K3 DCP with DSPARK only "
                        "under the static verify (kimi_k3.py:63-75)")
    return problems


# extra_server_args that would leave images to fail per request: SGLang would not load K3's
# processor and tower (tokenizer_manager.py:612, 1150-1154), or would preprocess with other
# settings than the ingress's (the prompt's token counts come from preprocessor_config.json).
_IMAGE_BREAKERS = {
    "enable_multimodal": (False, "SGLang would not load K3's image processor and tower"),
    "language_model_only": (True, "SGLang would not load K3's vision tower and refuses "
                                  "image requests"),
}


def image_problems(args: Mapping[str, Any]) -> list[str]:
    """Server arguments that break image requests the deployment accepts (its
    `limit_mm_data_per_request` image bound, when set, is above 0)."""
    limit = (args.get("limit_mm_data_per_request") or {}).get("image")
    if limit == 0:
        return []
    problems = [f"engine.sglang.extra_server_args.{name}={value!r}: {why}; images are "
                "accepted (images.max_images_per_request)"
                for name, (value, why) in _IMAGE_BREAKERS.items() if args.get(name) is value]
    if args.get("mm_process_config"):
        problems.append("engine.sglang.extra_server_args.mm_process_config: SGLang would "
                        "preprocess images with other settings than the checkpoint's "
                        "preprocessor_config.json, which the ingress counts the prompt's image "
                        "tokens from")
    return problems


def sglang_problems(config: AppConfig, role: Role = "both") -> list[str]:
    """Cross-checks for backend 'sglang', each naming the field; empty when the deployment is
    valid (a disaggregated app's side: that side's config and `role`). Model facts come from
    the checkpoints' config.json when they are on this machine, otherwise from the capacity
    planner's packaged descriptors (logged)."""
    from pydantic import ValidationError

    import capacity
    from capacity.errors import CapacityError
    from capacity.memory import check_layout

    s, p, pl = config.engine.sglang, config.parallelism, config.placement
    problems: list[str] = []
    dspark = s.speculative_algorithm == "DSPARK"
    if pl.accelerator != "GPU":
        problems.append(
            f"placement.accelerator={pl.accelerator!r}: the SGLang backend needs CUDA-class GPUs"
            + (" (SGLang 0.5.23 refuses DSPARK off CUDA/NPU/XPU: 'DSpark speculative decoding "
               "only supports CUDA, NPU or XPU device')" if dspark else ""))
    pipeline = pipeline_problem(p.pp, dspark, role)
    if pipeline is not None:
        problems.append(f"parallelism.{pipeline}")
    if dspark and config.models.draft is None:
        problems.append("engine.sglang.speculative_algorithm=DSPARK needs models.draft")

    target_file = _local_config(config.models.target)
    if target_file is not None:
        model = capacity.describe_model(target_file)
    else:
        logger.info("models.target %s is not on this machine: checking against the packaged "
                    "%r descriptor", config.models.target, s.planner_model)
        model = capacity.describe_model(s.planner_model)
    draft = None
    if dspark:
        draft_file = _local_config(config.models.draft)
        if draft_file is not None:
            draft = capacity.describe_model(draft_file)
        elif s.planner_draft is not None:
            logger.info("models.draft %s is not on this machine: block size checked against the "
                        "packaged %r descriptor", config.models.draft, s.planner_draft)
            draft = capacity.describe_model(s.planner_draft)
        else:
            logger.info("models.draft is not on this machine and engine.sglang.planner_draft is "
                        "null: block-size check skipped")
        if role != "prefill":
            problems += ragged_verify_problems(config, draft, draft_file is not None)
        if draft is not None and draft.draft is not None and (
                draft.draft.block_size != s.speculative_dspark_block_size):
            problems.append(
                f"engine.sglang.speculative_dspark_block_size={s.speculative_dspark_block_size} "
                f"does not match the draft's block_size={draft.draft.block_size} ({draft.source})")
    if model.max_context and s.context_length > model.max_context:
        problems.append(f"engine.sglang.context_length={s.context_length:,} exceeds "
                        f"{model.name}'s maximum {model.max_context:,} ({model.source})")

    gpus = capacity.load_gpus()
    if pl.gpu_type is None:
        problems.append("placement.gpu_type is required for the SGLang backend (the weights are "
                        f"checked against it); one of {', '.join(gpus)}")
    elif pl.gpu_type not in gpus:
        problems.append(f"placement.gpu_type={pl.gpu_type!r} unknown; one of {', '.join(gpus)}")
    elif not problems:
        gpu = gpus[pl.gpu_type]
        if p.devices_per_node > gpu.gpus_per_node:
            problems.append(f"parallelism.tp / parallelism.nodes = {p.devices_per_node} GPUs per "
                            f"node exceeds the "
                            f"{gpu.gpus_per_node} GPUs of a {gpu.gpu} node")
        try:
            layout = planner_layout(config)
            check_layout(model, layout)
            short = capacity.Workload(context_length=min(s.context_length, 8192),
                                      prefill_chunk_tokens=max(1, s.chunked_prefill_size))
            report = capacity.memory_per_gpu(model, layout, short, gpu, draft=draft,
                                             **kda_rollback(s, draft))
            if not report.fits:
                problems.append(f"{model.name} on {layout.label()}: " + "; ".join(report.reasons))
            else:
                problems += _full_context_problems(model, layout, gpu, draft, s)
        except (CapacityError, ValidationError) as exc:
            problems.append(f"layout: {exc}")
    problems += dcp_problems(config)
    if role != "both" and s.mamba_radix_cache_strategy == "extra_buffer_lazy":
        problems.append("engine.sglang.mamba_radix_cache_strategy='extra_buffer_lazy' on a PD "
                        f"{role} server: SGLang 0.5.23 refuses it under PD disaggregation "
                        "(arg_groups/mamba_hook.py:123-128); use extra_buffer")
    try:
        args = sglang_server_args(config, role=role)
        problems += [f"engine.sglang: {x}" for x in check_server_args(args)]
        problems += image_problems(args)
    except ValueError as exc:
        problems.append(str(exc))
    return problems


def ragged_verify_problems(config: AppConfig, draft: Any, models_here: bool) -> list[str]:
    """SGLang 0.5.23's adaptive DSpark verify (capacity/dspark_verify.py) against the draft,
    the layout and its cost table. `draft`: the draft's descriptor (None: unknown here);
    `models_here`: the checkpoints are on this machine, so the table, which lives beside them,
    must be too (SGLang fails its start without it); elsewhere a missing table is logged."""
    from capacity.dspark_verify import sps_profile_recipe, sps_table_problem

    s = config.engine.sglang
    mode, table = s.ragged_verify_mode, s.speculative_dspark_sps_table_path
    if mode == "static" or table is None:
        return []
    field = "engine.sglang.ragged_verify_mode"
    problems = []
    if draft is not None and draft.draft is not None and not draft.draft.confidence_head:
        problems.append(f"{field}={mode!r} plans from the draft's confidence head, which "
                        f"{draft.source} does not have (SGLang 0.5.23 refuses to start: "
                        "dspark_planner.py); use static")
    if (mode == "compact" and config.parallelism.attention_dp > 1
            and not s.extra_server_args.get("disable_cuda_graph")):
        problems.append(f"{field}='compact' with parallelism.attention_dp "
                        f"{config.parallelism.attention_dp}: SGLang 0.5.23 refuses a dense "
                        "DSpark draft's compact verify under attention DP with CUDA graphs "
                        "(dspark_worker_v2.py:336-347); use cap-accept or static")
    path = Path(table)
    if path.is_file():
        problem = sps_table_problem(path)
        if problem is not None:
            problems.append(f"engine.sglang.speculative_dspark_sps_table_path: {problem}")
    elif models_here:
        problems.append(f"engine.sglang.speculative_dspark_sps_table_path: {table} is not on "
                        "this node and SGLang reads it at start; make it: "
                        + "; then ".join(sps_profile_recipe(table)))
    else:
        logger.info("the DSpark SPS table %s is not on this machine (it lives with the "
                    "checkpoints on the GPU nodes): not checked here", table)
    sts = s.speculative_dspark_confidence_sts_path
    if sts is not None and models_here and not Path(sts).is_file():
        problems.append(f"engine.sglang.speculative_dspark_confidence_sts_path: {sts} is not on "
                        "this node (SGLang reads it at start)")
    return problems


def transfer_backend_problems(backend: str,
                              find_spec: Callable[[str], Any] | None = None) -> list[str]:
    """A PD server's transfer backend must be importable where SGLang runs (SGLang fails
    only when the first request is handed over otherwise). `find_spec`: importlib's."""
    module, package = TRANSFER_BACKENDS[backend]
    if (find_spec or importlib.util.find_spec)(module) is None:
        return [f"disaggregation.transfer_backend={backend!r}: the {module!r} module is not "
                f"installed on this node (pip install {package})"]
    return []


def startup_problems(config: AppConfig, environ: Mapping[str, str] | None = None,
                     role: Role = "both") -> list[str]:
    """Everything `SGLangEngine.start` checks before it launches SGLang, in one list: the
    deployment against the model, the GPUs and the advertised context (`sglang_problems`,
    which includes the server arguments against SGLang 0.5.23's flag table), and the
    replica's environment (`environ`, default os.environ) against the runtime_env SGLang's Ray
    backend needs on this GPU vendor."""
    env = os.environ if environ is None else environ
    problems = sglang_problems(config, role)
    if role != "both":
        problems += transfer_backend_problems(config.disaggregation.transfer_backend)
    missing = [k for k, v in runtime_env_vars(config).items() if env.get(k) != v]
    if missing:
        problems.append(f"{', '.join(f'{k}=1' for k in missing)} must be set in the "
                        "application's runtime_env.env_vars: SGLang's scheduler actors select "
                        "their GPU themselves")
    return problems
