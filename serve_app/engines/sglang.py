"""The SGLang 0.5.23 backend: K3 + DSPARK on SGLang's Ray engine, behind the engine interface.

Everything above `SGLangEngine` is pure Python and importable without SGLang (CI has no GPU and
never installs it): the one mapping from the config tree to SGLang's server arguments
(`sglang_server_args`), its check against SGLang's own field definitions (vendored as
`sglang_flags_0_5_23.json`, extracted from the wheel by `tools/extract_sglang_flags.py`), the
start-up checks (`sglang_problems`), the rank layout RayEngine uses (`rank_plan`) and the
translation of SGLang's streamed dicts into `RequestOutput`s. `sglang` itself is imported only
inside `SGLangEngine.start`, on GPU nodes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capacity.ray_env import NOSET_CUDA_ENV as NOSET_CUDA_ENV
from capacity.ray_env import NOSET_HIP_ENV as NOSET_HIP_ENV
from capacity.ray_env import sglang_ray_env
from serve_app.engines.spec_stats import EngineTotals, SpecStats, sglang_request_spec
from serve_app.engines.types import (
    EngineUnavailable,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
)
from serve_app.observability.metrics import (
    app_metrics,
    record_finished_request,
    replica_name,
    tags,
)

if TYPE_CHECKING:
    from serve_app.config import AppConfig

logger = logging.getLogger("serve_app.sglang")

SGLANG_VERSION = "0.5.23"
FLAGS_FILE = Path(__file__).with_name("sglang_flags_0_5_23.json")
# SGLang's Ray engine reads the GPU Ray assigned to each scheduler actor and selects it itself;
# Ray must leave every GPU visible: the per-vendor variables are one table in capacity.ray_env,
# shared with `kimi-capacity emit` (NOSET_CUDA_ENV / NOSET_HIP_ENV re-exported from there).
# `sglang.srt.sampling.sampling_params`: top_k -1 means the whole vocabulary.
SGLANG_TOP_K_OFF = -1
# 0.5.23 `_handle_dspark`: "DSpark speculative decoding only supports CUDA, NPU or XPU device."
DSPARK_DEVICES = ("cuda", "npu", "xpu")
# Keys that come from elsewhere in the config tree; `extra_server_args` may not override them,
# or two places would hold one value.
_MANAGED = frozenset({
    "model_path", "tokenizer_path", "served_model_name", "trust_remote_code", "device",
    "tp_size", "ep_size", "attn_dp_size", "nnodes", "pp_size", "context_length",
    "mem_fraction_static", "kv_cache_dtype", "chunked_prefill_size", "max_running_requests",
    "speculative_algorithm", "speculative_draft_model_path", "speculative_dspark_block_size",
    "speculative_draft_attention_backend", "moe_runner_backend", "decode_attention_backend",
    "enable_metrics", "incremental_streaming_output", "enable_dp_lm_head",
})
# The planner's KV element types for SGLang's kv_cache_dtype values.
_KV_DTYPE = {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8",
             "fp8_e5m2": "fp8"}


# --- server arguments ---------------------------------------------------------------------------


def _path_arg(value: str) -> str:
    # `embedded:` assets resolve to a folder in this package; real checkpoints stay as written
    # (they name paths on the GPU nodes, not on the machine that runs `serve run`).
    if value.startswith("embedded:"):
        from serve_app.config import resolve_path

        return str(resolve_path(value))
    return value


def sglang_server_args(config: AppConfig) -> dict[str, Any]:
    """The keyword arguments of `sglang.srt.ray.engine.RayEngine(**args)` (= ServerArgs fields),
    built from the config tree. The single source of SGLang server arguments."""
    s, p, m = config.engine.sglang, config.parallelism, config.models
    args: dict[str, Any] = {
        "model_path": _path_arg(m.target),
        "tokenizer_path": _path_arg(m.tokenizer or m.target),
        "served_model_name": m.served_model_name,
        "trust_remote_code": s.trust_remote_code,
        # Explicit, so the DSPARK device check cannot depend on platform auto-detection.
        "device": "cuda",
        "tp_size": p.tp,
        "ep_size": p.ep,
        # 0.5.23 spelling; --enable-dp-attention/--dp-size is deprecated in its favour.
        "attn_dp_size": p.attention_dp,
        "nnodes": p.nodes,
        "context_length": s.context_length,
        "mem_fraction_static": s.mem_fraction_static,
        "kv_cache_dtype": s.kv_cache_dtype,
        "chunked_prefill_size": s.chunked_prefill_size,
        "max_running_requests": s.max_running_requests,
    }
    if p.attention_dp > 1:
        # 0.5.23 refuses DSpark with attention DP unless the LM head is DP too.
        args["enable_dp_lm_head"] = True
    if s.speculative_algorithm is not None:
        args["speculative_algorithm"] = s.speculative_algorithm
        args["speculative_draft_model_path"] = _path_arg(m.draft) if m.draft else None
        args["speculative_dspark_block_size"] = s.speculative_dspark_block_size
        if s.speculative_draft_attention_backend is not None:
            args["speculative_draft_attention_backend"] = s.speculative_draft_attention_backend
    if s.moe_runner_backend is not None:
        args["moe_runner_backend"] = s.moe_runner_backend
    if s.decode_attention_backend is not None:
        args["decode_attention_backend"] = s.decode_attention_backend
    args["enable_metrics"] = s.enable_metrics
    # Each streamed chunk is then a delta (ids and text), not the whole output so far.
    args["incremental_streaming_output"] = True
    clash = sorted(set(s.extra_server_args) & _MANAGED)
    if clash:
        raise ValueError(f"engine.sglang.extra_server_args may not set {', '.join(clash)}: "
                         "they come from models/parallelism/engine.sglang fields")
    args.update(s.extra_server_args)
    return args


def runtime_env_vars(config: AppConfig) -> dict[str, str]:
    """Environment the application's runtime_env must carry for this backend (inherited by
    the replica and, through it, by SGLang's scheduler actors)."""
    return sglang_ray_env(config.placement.gpu_type)


@functools.cache
def sglang_fields() -> dict[str, dict[str, Any]]:
    """SGLang 0.5.23's ServerArgs fields (name -> type, default, flag, choices, help)."""
    data = json.loads(FLAGS_FILE.read_text())
    if data["sglang_version"] != SGLANG_VERSION:
        raise RuntimeError(f"{FLAGS_FILE.name} is for SGLang {data['sglang_version']}, "
                           f"expected {SGLANG_VERSION}")
    return data["fields"]


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


@functools.cache
def draft_attention_backends() -> list[str]:
    return json.loads(FLAGS_FILE.read_text())["draft_attention_backend_choices"]


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


def server_args_cli(args: dict[str, Any]) -> list[str]:
    """The same arguments as an `sglang serve` command line (for the runbook and logs)."""
    fields = sglang_fields()
    argv: list[str] = []
    for name, value in args.items():
        flag = fields[name]["flag"] or f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


# --- start-up checks ----------------------------------------------------------------------------


def _local_config(path: str | None) -> Path | None:
    if path is None:
        return None
    from serve_app.config import resolve_path

    candidate = resolve_path(path) / "config.json"
    return candidate if candidate.is_file() else None


def sglang_problems(config: AppConfig) -> list[str]:
    """Cross-checks for backend 'sglang', each naming the field; empty when the deployment is
    valid. Model facts come from the checkpoints' config.json when they are on this machine,
    otherwise from the capacity planner's packaged descriptors (logged)."""
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
    if p.pp != 1:
        problems.append(f"parallelism.pp={p.pp}: DSPARK needs pp_size 1 outside PD prefill")
    if p.tp != p.nodes * p.devices_per_node:
        problems.append(f"parallelism.tp={p.tp} must equal parallelism.nodes ({p.nodes}) x "
                        f"parallelism.devices_per_node ({p.devices_per_node})")
    if p.tp % p.ep:
        problems.append(f"parallelism.ep={p.ep} must divide parallelism.tp={p.tp}")
    if p.tp % p.attention_dp:
        problems.append(f"parallelism.attention_dp={p.attention_dp} must divide "
                        f"parallelism.tp={p.tp}")
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
            problems.append(f"parallelism.devices_per_node={p.devices_per_node} exceeds the "
                            f"{gpu.gpus_per_node} GPUs of a {gpu.gpu} node")
        try:
            layout = capacity.Layout(
                gpu=gpu.gpu, gpus_per_node=p.devices_per_node, nodes=p.nodes,
                attention_tp=p.tp // p.attention_dp, attention_dp=p.attention_dp,
                expert_parallel=p.ep, kv_dtype=_KV_DTYPE[s.kv_cache_dtype],
                mem_fraction=s.mem_fraction_static)
            check_layout(model, layout)
            short = capacity.Workload(context_length=min(s.context_length, 8192),
                                      prefill_chunk_tokens=max(1, s.chunked_prefill_size))
            report = capacity.memory_per_gpu(model, layout, short, gpu, draft=draft)
            if not report.fits:
                problems.append(f"{model.name} on {layout.label()}: " + "; ".join(report.reasons))
            else:
                full = capacity.memory_per_gpu(
                    model, layout, short.model_copy(update={"context_length": s.context_length}),
                    gpu, draft=draft)
                if not full.fits:
                    # SGLang starts and serves; only a request near the full context waits for
                    # (or is refused) KV it can never get. Worth a line, not a refusal.
                    logger.warning("%s on %s: %s", model.name, layout.label(),
                                   "; ".join(full.reasons))
        except (CapacityError, ValidationError) as exc:
            problems.append(f"layout: {exc}")
    try:
        problems += [f"engine.sglang: {x}" for x in check_server_args(sglang_server_args(config))]
    except ValueError as exc:
        problems.append(str(exc))
    return problems


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


# --- SGLang's outputs -> RequestOutput ----------------------------------------------------------


def sampling_params(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams -> SGLang's `sampling_params` dict."""
    # The same meaning as the reference sampler for values SGLang's float32 kernels cannot
    # represent usefully: a temperature below 1e-5 is greedy (SamplingParams.greedy), and a
    # top_p too small to keep anything but the top token is top_k 1.
    top_k = params.top_k if params.top_k > 0 else SGLANG_TOP_K_OFF
    if params.top_p < 1e-6:
        top_k = 1
    out: dict[str, Any] = {
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": max(params.top_p, 1e-6),
        "top_k": top_k,
        "max_new_tokens": params.max_tokens,
        "ignore_eos": params.ignore_eos,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


class RequestAborted(ValueError):
    """SGLang finished the request with an abort (too long, or refused by the scheduler)."""


@dataclass
class OutputTracker:
    """Turns one request's stream of SGLang dicts into RequestOutput deltas. Handles both
    streaming modes: incremental (each chunk a delta) and cumulative (SGLang's default)."""

    request_id: str
    prompt_tokens: int
    speculative: bool
    incremental: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""

    def update(self, chunk: dict[str, Any]) -> RequestOutput:
        meta = chunk.get("meta_info") or {}
        ids = list(chunk.get("output_ids") or [])
        text = chunk.get("text") or ""
        if self.incremental:
            new_ids, new_text = ids, text
        else:
            new_ids, new_text = ids[len(self.token_ids):], text[len(self.text):]
        self.token_ids += new_ids
        self.text += new_text
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind == "abort":
            raise RequestAborted(f"SGLang aborted request {self.request_id}: "
                                 f"{reason.get('message') if isinstance(reason, dict) else ''}")
        finished = kind is not None
        return RequestOutput(
            request_id=self.request_id,
            token_ids=new_ids,
            text=new_text,
            finished=finished,
            finish_reason=kind,
            prompt_tokens=int(meta.get("prompt_tokens", self.prompt_tokens)),
            completion_tokens=int(meta.get("completion_tokens", len(self.token_ids))),
            spec=sglang_request_spec(meta, self.speculative) if finished else None,
        )


# --- the engine ---------------------------------------------------------------------------------


class SGLangEngine:
    """One SGLang RayEngine (one target replica) behind the engine interface."""

    def __init__(self, engine: Any, config: AppConfig, server_args: dict[str, Any]) -> None:
        self.engine = engine
        self.config = config
        self.server_args = server_args
        self.speculative = server_args.get("speculative_algorithm") is not None
        self.incremental = bool(server_args.get("incremental_streaming_output"))
        info = engine._scheduler_init_result.scheduler_infos[0]
        # The KV pool SGLang sized after loading the weights (Scheduler.get_init_info).
        self.kv_tokens_total = int(info["max_total_num_tokens"])
        self.max_req_input_len = int(info.get("max_req_input_len") or 0)
        self._active: dict[str, OutputTracker] = {}
        self._totals = EngineTotals()
        self._metric_tags = tags(replica=replica_name())
        metrics = app_metrics()
        if metrics is not None:
            metrics.kv_tokens_capacity.set(self.kv_tokens_total, tags=self._metric_tags)
        self._stopped = False

    @classmethod
    def start(cls, config: AppConfig) -> SGLangEngine:
        """Start SGLang's Ray engine in the current placement group (the replica's). Blocks
        until every scheduler actor has loaded its shards."""
        missing = [k for k, v in runtime_env_vars(config).items() if os.environ.get(k) != v]
        if missing:
            raise EngineUnavailable(
                f"{', '.join(f'{k}=1' for k in missing)} must be set in the application's "
                "runtime_env.env_vars: SGLang's scheduler actors select their GPU themselves")
        from ray.util.placement_group import get_current_placement_group

        if get_current_placement_group() is None:
            raise EngineUnavailable("the SGLang backend must run inside the replica's placement "
                                    "group (placement_group_bundles in the deployment)")
        from sglang.srt.ray.engine import RayEngine  # GPU nodes only: the `sglang` extra

        args = sglang_server_args(config)
        logger.info("starting SGLang RayEngine: %s", " ".join(server_args_cli(args)))
        # placement_group=None: RayEngine takes the current group and puts rank 0's node first.
        engine = RayEngine(**args)
        return cls(engine, config, args)

    def _check_alive(self) -> None:
        if self._stopped:
            raise EngineUnavailable("engine is shut down")

    def problem(self) -> str | None:
        """Cheap liveness for GET /health. SGLang's own scheduler watchdog
        (`--watchdog-timeout`) kills a stuck scheduler, which ends its Ray actor; a dead
        scheduler actor fails the real health generation of `check_health`."""
        return "the engine is shut down" if self._stopped else None

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.tokenizer_manager.abort_request(rid=request_id)
        except Exception:  # the engine is already gone; nothing left to free
            logger.exception("abort of %s failed", request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        rid = request.request_id
        if rid in self._active:
            raise ValueError(f"request id {rid!r} is already in use")
        tracker = OutputTracker(rid, len(request.prompt_ids), self.speculative, self.incremental)
        self._active[rid] = tracker
        finished = False
        try:
            # The ingress tokenized already: pass ids, SGLang detokenizes the output.
            stream = await self.engine.async_generate(
                input_ids=list(request.prompt_ids), sampling_params=sampling_params(
                    request.params), stream=True, rid=rid)
            async for chunk in stream:
                out = tracker.update(chunk)
                finished = out.finished
                if finished:
                    self._totals.add_finished(out.prompt_tokens, out.completion_tokens,
                                              SpecStats.from_dict(out.spec) if out.spec else None)
                    # The same per-replica metrics as the reference engine, from meta_info.
                    record_finished_request(out.spec or {}, self._metric_tags)
                yield out
                if finished:
                    return
        finally:
            self._active.pop(rid, None)
            # Client gone (generator closed/cancelled) or an error: free the KV at once.
            if not finished:
                self._abort(rid)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    async def health(self, timeout_s: float) -> None:
        """A real 1-token generation through every TP rank (a dead rank stalls the collective,
        so this times out)."""
        self._check_alive()
        rid = f"health-{uuid.uuid4().hex[:12]}"

        async def one_token() -> None:
            out = await self.engine.async_generate(
                input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0,
                                                "ignore_eos": True}, stream=False, rid=rid)
            meta = out.get("meta_info", {})
            if meta.get("completion_tokens") != 1:
                raise EngineUnavailable(f"health generation returned {meta}")

        try:
            await asyncio.wait_for(one_token(), timeout_s)
        except TimeoutError:
            self._abort(rid)
            raise EngineUnavailable(f"health generation took longer than {timeout_s} s") from None

    def stats(self) -> dict[str, Any]:
        t = self._totals
        stats: dict[str, Any] = {
            "requests_finished": t.requests_finished,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "running": len(self._active),
            "speculative": self.speculative,
            "backend": "sglang",
        }
        if self.speculative:
            stats |= t.spec_dict()
        return stats

    def capacity(self) -> dict[str, int]:
        """KV tokens: the pool SGLang reported after start-up; 'used' counts the tokens of the
        requests this replica has in flight (prompt + generated so far), an upper bound on
        what they hold, since SGLang's prefix cache shares pages."""
        used = sum(t.prompt_tokens + len(t.token_ids) for t in self._active.values())
        used = min(used, self.kv_tokens_total)
        return {
            "kv_tokens_total": self.kv_tokens_total,
            "kv_tokens_used": used,
            "kv_tokens_free": self.kv_tokens_total - used,
            "max_req_input_len": self.max_req_input_len,
        }

    async def shutdown(self) -> None:
        self._stopped = True
        for rid in list(self._active):
            self._abort(rid)
        # Kills the scheduler actors and frees the GPUs.
        await asyncio.to_thread(self.engine.shutdown)
