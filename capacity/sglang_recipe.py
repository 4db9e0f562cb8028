"""The SGLang 0.5.23 server settings this project serves K3 + DSpark with: the published recipe
on 2 x 8 H200, where it chooses a value, and SGLang's own default, read from the vendored flag
table (capacity/sglang_flags.py), where it does not.

One writer for both readers: the app's config tree takes its `engine.sglang` defaults from
`SGLANG_SECTION` (serve_app.config.SGLangSettings) and the planner writes it in full into every
Serve file it emits (capacity/emit.py), so that a file shows every server value.
"""

from __future__ import annotations

from typing import Any

from capacity.sglang_flags import sglang_fields


def sglang_default(name: str) -> Any:
    """SGLang 0.5.23's own default of ServerArgs field `name`."""
    return sglang_fields()[name]["default"]


# In the app's field order (SGLangSettings). The ReplaySSM verify fields
# (enable_linear_replayssm_spec, linear_replayssm_cache_len) and the KV events fields are
# written only when they differ from their defaults (SGLANG_OPTIONAL), so that the files
# generated for the default stay as they are.
SGLANG_SECTION: dict[str, Any] = {
    "context_length": 1_048_576,  # K3's advertised 1M context
    "mem_fraction_static": 0.85,  # the recipe's --mem-fraction-static
    "kv_cache_dtype": sglang_default("kv_cache_dtype"),  # auto: the checkpoint's BF16
    "chunked_prefill_size": 8192,  # the recipe's --chunked-prefill-size
    # Always written: with DSPARK, SGLang silently sets 48 when this is left unset; the planner
    # sizes it (capacity.memory.running_fit).
    "max_running_requests": 48,
    "max_mamba_cache_size": sglang_default("max_mamba_cache_size"),  # the planner sets it
    # K3's config.json names no SSM dtype, so SGLang reads float32; explicit, so that the file
    # says what the planner sized.
    "mamba_ssm_dtype": "float32",
    # `auto` resolves to extra_buffer for K3 under the overlap scheduler; explicit, as sized.
    "mamba_radix_cache_strategy": "extra_buffer",
    "speculative_algorithm": "DSPARK",
    "speculative_dspark_block_size": 7,  # the DSpark draft's block_size (gamma)
    "speculative_draft_attention_backend": sglang_default("speculative_draft_attention_backend"),
    # None: unset, SGLang's own pick ("auto" for the MoE runner); a GPU's known-right kernels
    # are set per GPU (capacity/emit.py SGLANG_BACKENDS).
    "moe_runner_backend": None,
    "decode_attention_backend": sglang_default("decode_attention_backend"),
    # K3 is built into SGLang 0.5.23: no remote code is needed or run.
    "trust_remote_code": sglang_default("trust_remote_code"),
    "enable_metrics": True,  # SGLang's default is off; the app exports its metrics
    "planner_model": "kimi-k3",  # the app's packaged planner descriptors (not SGLang's)
    "planner_draft": "kimi-k3-dspark",
    "extra_server_args": {},
}
SGLANG_OPTIONAL: dict[str, Any] = {
    # The HiCache host tier (capacity.levers.choose_levers sizes it from the node's host RAM).
    "enable_hierarchical_cache": sglang_default("enable_hierarchical_cache"),
    "hicache_ratio": sglang_default("hicache_ratio"),
    "enable_linear_replayssm_spec": sglang_default("enable_linear_replayssm_spec"),
    "linear_replayssm_cache_len": sglang_default("linear_replayssm_cache_len"),
    # The adaptive DSpark verify (capacity/dspark_verify.py): SGLang's default is off.
    "ragged_verify_mode": "static",
    "speculative_dspark_sps_table_path": sglang_default("speculative_dspark_sps_table_path"),
    "speculative_dspark_confidence_sts_path": sglang_default(
        "speculative_dspark_confidence_sts_path"),
    "speculative_dspark_align_verify_tokens_to_graph_tier": sglang_default(
        "speculative_dspark_align_verify_tokens_to_graph_tier"),
    "kv_events": True,
    "kv_events_port": 0,
}
# Constrained decoding (serve_app/engines/sglang/grammar.py), written by the planner into every
# file's extra_server_args (capacity/emit.py; SGLangSettings has no fields for them, so the app's
# own defaults stay SGLang's): xgrammar, the backend SGLang's K3 structural tags are written for
# (kimik3_structural_tag.py imports it), named although 0.5.23 resolves an unset backend to it
# (arg_groups/serving_hook.py:239-244); and JSON without whitespace freedom on the json_schema
# path (base_grammar_backend.py:408; off by default), as K3's response_format contract asks
# (no newlines or tabs in the answer).
SGLANG_GRAMMAR_ARGS: dict[str, Any] = {
    "grammar_backend": "xgrammar",
    "constrained_json_disable_any_whitespace": True,
}

# SGLang 0.5.23's KV transfer backends this project deploys (--disaggregation-transfer-backend),
# each with the module SGLang imports for it (srt/disaggregation/mooncake, .../nixl) and the pip
# package that installs it on the GPU nodes (not part of the `sglang` extra).
TRANSFER_BACKENDS: dict[str, tuple[str, str]] = {
    "mooncake": ("mooncake", "mooncake-transfer-engine"),
    "nixl": ("nixl", "nixl"),
}


def pipeline_problem(pp: int, speculative: bool, role: str = "both") -> str | None:
    """Why SGLang 0.5.23 refuses `pp` pipeline stages for a server of `role` ("both": an
    aggregated server; "prefill" / "decode": a PD side), or None. DSpark runs pipeline
    parallelism only on a PD prefill server (srt/arg_groups/speculative_hook.py: "DSpark
    pipeline parallelism requires PD prefill; decode and non-disaggregated serving require
    pp_size == 1"). The planner, the disaggregated planner and the app's start-up checks ask
    this one rule."""
    if pp == 1 or not speculative or role == "prefill":
        return None
    return (f"pp={pp}: SGLang 0.5.23 runs DSpark with pipeline parallelism only on a PD "
            "prefill server (decode and aggregated servers need pp 1)")
