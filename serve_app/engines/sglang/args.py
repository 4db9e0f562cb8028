"""The one mapping from the config tree to SGLang 0.5.23: the keyword arguments of
`sglang.srt.ray.engine.RayEngine` (= ServerArgs fields), their `sglang serve` spelling, the
per-request `sampling_params` dict, and the environment the application's runtime_env must
carry. Pure Python: importable without SGLang."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from capacity.ray_env import sglang_ray_env
from capacity.sglang_flags import sglang_fields
from serve_app.engines.sglang.grammar import sglang_constraint
from serve_app.protocol.generation import Role, SamplingParams

if TYPE_CHECKING:
    from serve_app.config import AppConfig

# `sglang.srt.sampling.sampling_params`: top_k -1 means the whole vocabulary.
SGLANG_TOP_K_OFF = -1
# Keys that come from elsewhere in the config tree; `extra_server_args` may not override them,
# or two places would hold one value.
_MANAGED = frozenset({
    "model_path", "tokenizer_path", "served_model_name", "trust_remote_code", "device",
    "tp_size", "ep_size", "attn_dp_size", "nnodes", "pp_size", "context_length",
    "mem_fraction_static", "kv_cache_dtype", "chunked_prefill_size", "max_running_requests",
    "max_mamba_cache_size", "mamba_ssm_dtype", "mamba_radix_cache_strategy", "dcp_size",
    "enable_hierarchical_cache", "hicache_ratio",
    "speculative_algorithm", "speculative_draft_model_path", "speculative_dspark_block_size",
    "speculative_draft_attention_backend", "enable_linear_replayssm_spec",
    "linear_replayssm_cache_len", "speculative_dspark_sps_table_path",
    "speculative_dspark_confidence_sts_path",
    "speculative_dspark_align_verify_tokens_to_graph_tier", "moe_runner_backend", "decode_attention_backend",
    "enable_metrics", "incremental_streaming_output", "enable_dp_lm_head", "kv_events_config",
    "disaggregation_mode", "disaggregation_transfer_backend", "disaggregation_bootstrap_port",
    "disaggregation_ib_device", "limit_mm_data_per_request",
})
# A PD prefill server's bootstrap port when disaggregation.bootstrap_port is 0 and no port was
# picked yet (each prefill replica picks a free one at start); SGLang's own default.
BOOTSTRAP_DEFAULT_PORT = 8998
# The publisher's port when engine.sglang.kv_events_port is 0 and no port was picked yet (the
# replica picks free ones at start: SGLangEngine.start); SGLang's own default.
KV_EVENTS_DEFAULT_PORT = 5557


def kv_events_config(port: int) -> str:
    """`--kv-events-config`: a ZMQ PUB bound on loopback at `port` (attention-DP rank r binds
    port + r: SGLang's `offset_endpoint_port`) by each KV publisher rank (pp/attn-TP/attn-CP
    rank 0); rank 0's scheduler runs on the replica's node (RayEngine co-locates it), which
    subscribes (serve_app/engines/sglang/kv_events.py)."""
    return json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
                       "bind": True, "topic": ""}, separators=(",", ":"))


def _path_arg(value: str) -> str:
    # `embedded:` assets resolve to a folder in this package; real checkpoints stay as written
    # (they name paths on the GPU nodes, not on the machine that runs `serve run`).
    if value.startswith("embedded:"):
        from serve_app.config import resolve_path

        return str(resolve_path(value))
    return value


def sglang_server_args(config: AppConfig, kv_events_port: int | None = None,
                       role: Role = "both", bootstrap_port: int | None = None
                       ) -> dict[str, Any]:
    """The keyword arguments of `sglang.srt.ray.engine.RayEngine(**args)` (= ServerArgs fields),
    built from the config tree (a disaggregated app's side: that side's config, and its
    `role`). The single source of SGLang server arguments.
    `kv_events_port`: the KV event publisher's port the replica picked (engine.sglang.
    kv_events_port when set, else a placeholder: `KV_EVENTS_DEFAULT_PORT`); `bootstrap_port`:
    a prefill replica's bootstrap port, likewise (`BOOTSTRAP_DEFAULT_PORT`)."""
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
        # K3's KDA layers: the state pool's size and dtype and its radix-cache strategy.
        "mamba_radix_cache_strategy": s.mamba_radix_cache_strategy,
    }
    if p.pp > 1:  # SGLang's default is 1
        args["pp_size"] = p.pp
    if p.dcp > 1:  # decode context parallelism (SGLang's default is 1)
        args["dcp_size"] = p.dcp
    if s.max_mamba_cache_size is not None:
        args["max_mamba_cache_size"] = s.max_mamba_cache_size
    if s.enable_hierarchical_cache:
        args["enable_hierarchical_cache"] = True
        if s.hicache_ratio is not None:
            args["hicache_ratio"] = s.hicache_ratio
    if s.mamba_ssm_dtype is not None:
        args["mamba_ssm_dtype"] = s.mamba_ssm_dtype
    if p.attention_dp > 1:
        # 0.5.23 refuses DSpark with attention DP unless the LM head is DP too.
        args["enable_dp_lm_head"] = True
    if s.speculative_algorithm is not None:
        args["speculative_algorithm"] = s.speculative_algorithm
        args["speculative_draft_model_path"] = _path_arg(m.draft) if m.draft else None
        args["speculative_dspark_block_size"] = s.speculative_dspark_block_size
        if s.speculative_draft_attention_backend is not None:
            args["speculative_draft_attention_backend"] = s.speculative_draft_attention_backend
        if s.ragged_verify_mode != "static" and role != "prefill":
            # The adaptive verify's table and options (its switch is the environment:
            # runtime_env_vars); a PD prefill server never verifies.
            args["speculative_dspark_sps_table_path"] = s.speculative_dspark_sps_table_path
            if s.speculative_dspark_confidence_sts_path is not None:
                args["speculative_dspark_confidence_sts_path"] = (
                    s.speculative_dspark_confidence_sts_path)
            if s.speculative_dspark_align_verify_tokens_to_graph_tier:
                args["speculative_dspark_align_verify_tokens_to_graph_tier"] = True
    if s.enable_linear_replayssm_spec and role != "prefill":
        # The KDA verify's rollback by replay (SGLangSettings checks SGLang's rules on it);
        # off, SGLang's default per-position state scratch, and neither argument is passed.
        # A PD prefill server never verifies: only its decode servers get it.
        args["enable_linear_replayssm_spec"] = True
        args["linear_replayssm_cache_len"] = s.linear_replayssm_cache_len
    if s.moe_runner_backend is not None:
        args["moe_runner_backend"] = s.moe_runner_backend
    if s.decode_attention_backend is not None:
        args["decode_attention_backend"] = s.decode_attention_backend
    args["enable_metrics"] = s.enable_metrics
    # Each streamed chunk is then a delta (ids and text), not the whole output so far.
    args["incremental_streaming_output"] = True
    if s.kv_events:
        args["kv_events_config"] = kv_events_config(
            s.kv_events_port or kv_events_port or KV_EVENTS_DEFAULT_PORT)
    if role != "both":
        args |= disaggregation_args(config, role, bootstrap_port)
    args |= image_args(config)
    clash = sorted(set(s.extra_server_args) & _MANAGED)
    if clash:
        raise ValueError(f"engine.sglang.extra_server_args may not set {', '.join(clash)}: "
                         "they come from models/parallelism/engine.sglang fields")
    args.update(s.extra_server_args)
    return args


def image_args(config: AppConfig) -> dict[str, Any]:
    """K3 images through SGLang 0.5.23. Its K3 processor and tower are on by default for
    KimiK3ForConditionalGeneration (configs/model_config.py:690-717: `enable_multimodal`
    None -> True; `language_model_only` false), with its own K3 defaults kept: GPU
    preprocessing in the tokenizer manager's process when it sees a GPU, else the
    checkpoint's CPU processor (kimi_k3.py:207-212; `image_processor_backend` plays no part in
    K3's path), and a 256 MiB content-addressed preprocessing cache (kimi_k3.py:387). Set
    here: the deployment's images-per-request bound as SGLang's own limit
    (`limit_mm_data_per_request`, checked by tokenizer_manager.py:1470-1483), a second line
    behind the ingress's 400."""
    return {"limit_mm_data_per_request": {"image": config.images.max_images_per_request}}


def disaggregation_args(config: AppConfig, role: Role, bootstrap_port: int | None
                        ) -> dict[str, Any]:
    """A PD side's SGLang 0.5.23 arguments (srt/arg_groups/fields/disagg.py,
    pd_disaggregation_hook.py): its mode and the KV transfer backend on both sides; the
    bootstrap server's port on the prefill side, where it runs (in the tokenizer manager's
    process: this replica's). A decode server learns each request's prefill server from the
    request (bootstrap_host / port / room, SGLangEngine.adopt), so it takes no address here.
    The decode server keeps SGLang's PD default of no radix cache (the prefill side caches)."""
    pd = config.disaggregation
    args: dict[str, Any] = {"disaggregation_mode": role,
                            "disaggregation_transfer_backend": pd.transfer_backend}
    if role == "prefill":
        args["disaggregation_bootstrap_port"] = (pd.bootstrap_port or bootstrap_port
                                                 or BOOTSTRAP_DEFAULT_PORT)
    if pd.ib_device is not None:
        args["disaggregation_ib_device"] = pd.ib_device
    return args


def runtime_env_vars(config: AppConfig) -> dict[str, str]:
    """Environment the application's runtime_env must carry for this backend (inherited by
    the replica and, through it, by SGLang's scheduler actors): Ray's GPU visibility, and the
    adaptive DSpark verify's switch."""
    return sglang_ray_env(config.placement.gpu_type, config.engine.sglang.ragged_verify_mode)



def server_args_cli(args: dict[str, Any]) -> list[str]:
    """The same arguments as an `sglang serve` command line (for the runbook and logs)."""
    fields = sglang_fields()
    argv: list[str] = []
    for name, value in args.items():
        flag = fields[name]["flag"] or f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, dict):  # SGLang parses these flags with json.loads
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        elif value is not None:
            argv += [flag, str(value)]
    return argv



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
    # The output constraint: `json_schema` or `structural_tag` (grammar.py), none when free.
    out.update(sglang_constraint(params.grammar))
    return out


