"""SGLang server arguments from the deployment files: golden files, SGLang 0.5.23's own field
definitions, refusals, and the translation of SGLang's outputs. CPU only; SGLang not installed.

Regenerate the golden files after an intended change: UPDATE_GOLDEN=1 pytest tests/test_sglang_args.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from sglang_helpers import GOLDEN, ROOT, app_config, rank_plan, serve_files
from sglang_source import SGLANG_SRC, sglang_file

from capacity.sglang_flags import FLAGS_FILE, sglang_fields
from serve_app.app import ConfigError, validate
from serve_app.engines.sglang.args import (
    runtime_env_vars,
    sampling_params,
    server_args_cli,
    sglang_server_args,
)
from serve_app.engines.sglang.checks import (
    check_server_args,
    planner_layout,
    sglang_problems,
    startup_problems,
)
from serve_app.engines.sglang.output import OutputTracker, RequestAborted
from serve_app.engines.spec_stats import SpecStats
from serve_app.protocol.generation import SamplingParams

PRODUCTION = "deployments/kimi_dspark.yaml"


def _golden_name(rel: str) -> Path:
    return GOLDEN / f"sglang_args_{Path(rel).stem}.json"


@pytest.mark.parametrize("rel", serve_files())
def test_server_args_match_golden_and_sglang(rel: str) -> None:
    config = app_config(rel)
    validate(config)  # the deployment passes the start-up checks
    args = sglang_server_args(config)
    golden = _golden_name(rel)
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(json.dumps(args, indent=1) + "\n")
    assert args == json.loads(golden.read_text())
    assert check_server_args(args) == []
    fields = sglang_fields()
    # Always explicit: DSPARK silently forces 48 when unset; DSPARK with its draft and gamma.
    assert args["max_running_requests"] == config.engine.sglang.max_running_requests
    assert args["speculative_algorithm"] == "DSPARK"
    assert args["speculative_dspark_block_size"] == 7
    assert args["context_length"] == 1_048_576
    assert args["tp_size"] == args["ep_size"] == config.parallelism.world_size
    assert args["nnodes"] == config.parallelism.nodes
    assert args["enable_metrics"] is True
    # The CLI spelling uses SGLang's own flags.
    argv = server_args_cli(args)
    for name in args:
        if fields[name]["flag"] and args[name] not in (False, None):
            assert fields[name]["flag"] in argv


def test_h200_recipe_values() -> None:
    args = sglang_server_args(app_config(PRODUCTION))
    assert {k: args[k] for k in ("tp_size", "ep_size", "nnodes", "moe_runner_backend",
                                 "decode_attention_backend", "mem_fraction_static")} == {
        "tp_size": 16, "ep_size": 16, "nnodes": 2, "moe_runner_backend": "marlin",
        "decode_attention_backend": "flashmla", "mem_fraction_static": 0.85}
    assert args["model_path"] == "/models/Kimi-K3"
    assert args["speculative_draft_model_path"] == "/models/Kimi-K3-DSpark"


def test_vendored_flags_match_the_wheel_source() -> None:
    sglang_file("srt/server_args.py")
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract", ROOT / "tools" /
                                                  "extract_sglang_flags.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.extract(SGLANG_SRC) == json.loads(FLAGS_FILE.read_text())


def test_flag_definitions_have_the_meanings_relied_on() -> None:
    f = sglang_fields()
    assert f["speculative_dspark_block_size"]["help"].startswith("DSPARK only. Draft block size")
    assert "DSPARK" in f["speculative_algorithm"]["help"]
    assert f["ep_size"]["flag"] == "--ep-size" and "--ep" in f["ep_size"]["aliases"]
    assert f["attn_dp_size"]["type"] == "int"
    assert f["enable_dp_attention"]["flag"] is None  # deprecated: no CLI, resolved from attn_dp
    assert f["max_running_requests"]["default"] is None  # hence always set
    assert "flashmla" in f["decode_attention_backend"]["choices"]
    assert "marlin" in f["moe_runner_backend"]["choices"]
    # K3's hybrid settings (arg_groups/fields/exec_.py ExecMamba, schedule.py Schedule).
    assert f["mamba_ssm_dtype"]["flag"] == "--mamba-ssm-dtype"
    assert f["mamba_ssm_dtype"]["choices"] == ["float32", "bfloat16", "float16"]
    assert f["mamba_radix_cache_strategy"]["choices"] == ["auto", "no_buffer", "extra_buffer",
                                                          "extra_buffer_lazy"]
    assert f["max_mamba_cache_size"]["type"] == "Optional[int]"
    assert "fp8_e4m3" in f["kv_cache_dtype"]["choices"]


# --- refusals -----------------------------------------------------------------------------------


def _problems(**overrides: dict) -> str:
    return "\n".join(sglang_problems(app_config(PRODUCTION, **overrides)))


def test_dspark_without_cuda_is_refused() -> None:
    config = app_config(PRODUCTION, placement={"accelerator": "CPU"})
    with pytest.raises(ConfigError, match=r"placement.accelerator='CPU'.*DSpark speculative "
                                          r"decoding only supports CUDA"):
        validate(config)


def test_tp_not_dividing_the_gpus_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"parallelism.tp \(15\).*must split evenly over "
                                              r"parallelism.nodes \(2\)"):
        app_config(PRODUCTION, parallelism={"tp": 15, "ep": 15})
    # The one expert-parallel rule (capacity.config.expert_parallel_problem), at validation.
    with pytest.raises(ValidationError, match=r"parallelism.ep \(5\) must divide "
                                              r"parallelism.tp, the ranks of a stage \(16\)"):
        app_config(PRODUCTION, parallelism={"ep": 5})


# An SGLang 0.5.23 1-D SPS table (dspark_sps.py SpsCostTable), as its profiler writes one.
SPS_TABLE = {"sample_batch_tokens": [8, 64, 256], "sample_steps_per_sec": [80.0, 60.0, 30.0],
             "max_batch_tokens": 384}


def _local_draft(tmp_path: Path, **settings: object) -> tuple[Path, Path]:
    """The K3 DSpark config.json in a folder (a draft 'on this machine'), and a valid SPS
    table beside it."""
    draft = tmp_path / "draft"
    draft.mkdir(parents=True)
    config = json.loads((ROOT / "capacity" / "data" / "kimi-k3-dspark-config.json").read_text())
    config["dflash_config"].update(settings)
    (draft / "config.json").write_text(json.dumps(config))
    table = tmp_path / "sps.json"
    table.write_text(json.dumps(SPS_TABLE))
    return draft, table


def test_block_size_must_match_a_local_draft_config(tmp_path: Path) -> None:
    draft, table = _local_draft(tmp_path)
    sps = {"speculative_dspark_sps_table_path": str(table)}
    problems = _problems(models={"draft": str(draft)}, engine={"sglang": {
        "speculative_dspark_block_size": 6, **sps}})
    assert "speculative_dspark_block_size=6 does not match the draft's block_size=7" in problems
    assert str(draft) in problems  # names the local file it read
    assert _problems(models={"draft": str(draft)}, engine={"sglang": sps}) == ""


def test_the_adaptive_verify_is_checked_against_its_table_and_the_draft(tmp_path: Path) -> None:
    """SGLang's compact verify (the production files' choice on NVIDIA) plans from the draft's
    confidence head and its SPS table: each is checked where the checkpoints are, naming the
    field; a table missing there says how to make it."""
    draft, table = _local_draft(tmp_path)
    sps = {"speculative_dspark_sps_table_path": str(table)}
    missing = _problems(models={"draft": str(draft)}, engine={"sglang": {
        "speculative_dspark_sps_table_path": str(tmp_path / "none.json")}})
    assert "speculative_dspark_sps_table_path" in missing and "dspark_sps_profiler" in missing
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**SPS_TABLE, "sample_steps_per_sec": [80.0]}))
    assert "differ in length" in _problems(models={"draft": str(draft)}, engine={"sglang": {
        "speculative_dspark_sps_table_path": str(bad)}})
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"sample_batch_tokens": [8], "sample_steps_per_sec": [50.0],
                                "max_batch_tokens": 8}))
    assert "flat table" in _problems(models={"draft": str(draft)}, engine={"sglang": {
        "speculative_dspark_sps_table_path": str(flat)}})
    headless, _ = _local_draft(tmp_path / "headless", enable_confidence_head=False)
    assert "confidence head" in _problems(models={"draft": str(headless)},
                                          engine={"sglang": sps})
    assert "attention DP" in _problems(models={"draft": str(draft)}, parallelism={
        "attention_dp": 2}, engine={"sglang": sps})
    # Static ignores a table (refused by the config), and needs none.
    assert _problems(models={"draft": str(draft)}, engine={"sglang": {
        "ragged_verify_mode": "static", "speculative_dspark_sps_table_path": None}}) == ""
    with pytest.raises(ValidationError, match="ragged_verify_mode static ignores it"):
        app_config(PRODUCTION, engine={"sglang": {"ragged_verify_mode": "static"}})
    with pytest.raises(ValidationError, match=r"needs engine\.sglang\.speculative_dspark_sps"):
        app_config(PRODUCTION, engine={"sglang": {"speculative_dspark_sps_table_path": None}})


def test_context_above_the_model_maximum_is_refused() -> None:
    assert ("engine.sglang.context_length=2,097,152 exceeds Kimi-K3's maximum 1,048,576"
            in _problems(engine={"sglang": {"context_length": 2_097_152}}))


def test_k3_on_8_h200_is_refused_with_numbers() -> None:
    config = app_config(PRODUCTION, parallelism={"tp": 8, "ep": 8, "nodes": 1})
    with pytest.raises(ConfigError) as err:
        validate(config)
    message = str(err.value)
    assert "Kimi-K3 on 1x8 H200 TP8 EP8" in message
    assert "weights need 197.5 GB per GPU" in message
    assert "static pool is 119.8 GB (0.85 x 141 GB H200)" in message


def test_k3_on_8_mi300x_is_refused_but_16_fit() -> None:
    rel = "deployments/variants/kimi_dspark_mi300x.yaml"
    assert _problems() == ""
    problems = "\n".join(sglang_problems(app_config(
        rel, parallelism={"tp": 8, "ep": 8, "nodes": 1})))
    assert "static pool is 163.2 GB (0.85 x 192 GB MI300X)" in problems


def test_a_context_that_does_not_fit_is_refused() -> None:
    # BF16 KV on 2 x 8 H200: one 1M-token request's KV does not fit beside the weights.
    problems = _problems(engine={"sglang": {"kv_cache_dtype": "auto"}})
    assert "engine.sglang.context_length=1,048,576 is not servable on 2x8 H200 TP16 EP16" in (
        problems)
    assert "30.3 GB per GPU" in problems and "20.1 GB are free" in problems
    # Too many running requests: their KDA states leave no room for one full-context request.
    assert "is not servable" in _problems(engine={"sglang": {"max_running_requests": 48,
                                                             "max_mamba_cache_size": 240}})
    assert "holds the states of only 2 running requests" in _problems(
        engine={"sglang": {"max_mamba_cache_size": 10}})
    assert "not one of SGLang's choices" in _problems(engine={"sglang": {"extra_server_args": {
        "linear_attn_backend": "nope"}}})


def test_bad_server_args_are_refused() -> None:
    assert "'not_a_flag' is not an SGLang 0.5.23 server argument" in _problems(
        engine={"sglang": {"extra_server_args": {"not_a_flag": 1}}})
    assert "may not set tp_size" in _problems(engine={"sglang": {"extra_server_args": {
        "tp_size": 8}}})
    assert "moe_runner_backend='nope' is not one of SGLang's choices" in _problems(
        engine={"sglang": {"moe_runner_backend": "nope"}})
    assert "stream_interval='2' does not match SGLang's type int" in _problems(
        engine={"sglang": {"extra_server_args": {"stream_interval": "2"}}})
    assert "placement.gpu_type is required" in _problems(placement={"gpu_type": None})
    assert "speculative_draft_attention_backend='flashmla' is not one of SGLang's draft" in (
        _problems(engine={"sglang": {"speculative_draft_attention_backend": "flashmla"}}))


def test_attention_dp_turns_on_the_dp_lm_head() -> None:
    config = app_config(PRODUCTION, parallelism={"attention_dp": 2})
    args = sglang_server_args(config)
    assert args["attn_dp_size"] == 2 and args["enable_dp_lm_head"] is True
    assert "enable_dp_attention" not in args  # deprecated in 0.5.23


# --- the KDA verify's rollback: SGLang's ReplaySSM (--enable-linear-replayssm-spec) ----------


def _replay(**sglang: object) -> dict:
    return {"sglang": {"enable_linear_replayssm_spec": True, **sglang}}


def test_replayssm_flags_reach_sglang_only_when_enabled() -> None:
    default = app_config(PRODUCTION)
    args = sglang_server_args(default)
    assert "enable_linear_replayssm_spec" not in args
    assert "linear_replayssm_cache_len" not in args
    # Off, the config tree does not write them either (the shipped files stay as they are).
    assert "enable_linear_replayssm_spec" not in default.engine.sglang.model_dump()

    config = app_config(PRODUCTION, engine=_replay(linear_replayssm_cache_len=32))
    args = sglang_server_args(config)
    assert args["enable_linear_replayssm_spec"] is True
    assert args["linear_replayssm_cache_len"] == 32
    assert check_server_args(args) == []
    argv = server_args_cli(args)
    assert "--enable-linear-replayssm-spec" in argv
    assert argv[argv.index("--linear-replayssm-cache-len") + 1] == "32"
    # On, both are written and read back.
    dumped = config.engine.sglang.model_dump(mode="json")
    assert dumped["enable_linear_replayssm_spec"] is True
    assert dumped["linear_replayssm_cache_len"] == 32
    assert type(config.engine.sglang).model_validate(dumped) == config.engine.sglang
    f = sglang_fields()
    assert f["enable_linear_replayssm_spec"]["flag"] == "--enable-linear-replayssm-spec"
    assert f["linear_replayssm_cache_len"]["default"] == 16


@pytest.mark.parametrize(("sglang", "message"), [
    (_replay(linear_replayssm_cache_len=24), r"linear_replayssm_cache_len=24 must be a power of "
                                             r"two"),
    (_replay(linear_replayssm_cache_len=8), r"linear_replayssm_cache_len=8 must be >= 2 x "
                                            r"speculative_num_draft_tokens = 16"),
    (_replay(speculative_dspark_block_size=8), r"linear_replayssm_cache_len=16 must be >= 2 x "
                                               r"speculative_num_draft_tokens = 18"),
    (_replay(speculative_algorithm=None), r"enable_linear_replayssm_spec: true is the "
                                          r"speculative verify's rollback: it needs "
                                          r"engine.sglang.speculative_algorithm"),
    ({"sglang": {"linear_replayssm_cache_len": 32}}, r"linear_replayssm_cache_len=32 is used "
                                                     r"only with .*enable_linear_replayssm_spec"),
    (_replay(extra_server_args={"linear_attn_decode_backend": "cutedsl"}),
     r"needs the triton or flashinfer linear-attn decode backend"),
    (_replay(extra_server_args={"enable_linear_replayssm": True}), r"mutually exclusive"),
    (_replay(linear_replayssm_cache_len=0), r"engine.sglang.linear_replayssm_cache_len\n.*"
                                            r"greater than or equal to 1"),
])
def test_a_bad_replayssm_setting_is_refused_naming_the_field(sglang: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        app_config(PRODUCTION, engine=sglang)


def test_extra_server_args_may_not_set_the_replayssm_fields() -> None:
    for name, value in (("enable_linear_replayssm_spec", True), ("linear_replayssm_cache_len", 32)):
        assert f"may not set {name}" in _problems(engine={"sglang": {"extra_server_args": {
            name: value}}})


def test_replayssm_rules_are_sglangs_own() -> None:
    """The rules SGLangSettings applies are in the 0.5.23 source (line numbers as cited)."""
    hook = sglang_file("srt/arg_groups/attention_hook.py")
    pool = (SGLANG_SRC / "srt" / "mem_cache" / "memory_pool.py").read_text()
    assert "if L & (L - 1) != 0:" in pool
    assert "and L < 2 * speculative_num_draft_tokens" in pool
    rules = hook.read_text()
    for text in ("if cfg.linear_replayssm_cache_len < 1:",
                 "--enable-linear-replayssm-spec requires a linear draft chain",
                 'if decode not in ("triton", "flashinfer"):',
                 "--enable-linear-replayssm-spec and --enable-linear-replayssm are "):
        assert text in rules
    fields = (SGLANG_SRC / "srt" / "arg_groups" / "fields" / "exec_.py").read_text()
    assert "enable_linear_replayssm_spec: A[" in fields
    speculative = (SGLANG_SRC / "srt" / "arg_groups" / "speculative_hook.py").read_text()
    assert "verify_window = int(gamma) + 1" in speculative  # DSPARK's draft tokens


def test_replay_lets_more_requests_run_than_scratch_at_start_up() -> None:
    """The start-up check sizes the deployment for the rollback it runs: the planner's most
    running requests under replay start with replay and are refused with scratch."""
    import capacity
    from capacity.memory import MAMBA_SLOTS_PER_RUNNING_REQUEST, running_fit

    base = app_config(PRODUCTION)
    s = base.engine.sglang
    fits = {strategy: running_fit(
        capacity.describe_model(s.planner_model), planner_layout(base),
        capacity.load_gpus()["H200"], s.context_length, capacity.describe_model(s.planner_draft),
        kda_rollback=strategy, ring_len=16) for strategy in ("scratch", "replay")}
    scratch, replay = fits["scratch"].max_running_requests, fits["replay"].max_running_requests
    assert scratch == s.max_running_requests  # the shipped file is sized for scratch
    assert replay > scratch
    running = {"max_running_requests": replay,
               "max_mamba_cache_size": replay * MAMBA_SLOTS_PER_RUNNING_REQUEST}
    env = runtime_env_vars(base)
    assert startup_problems(app_config(PRODUCTION, engine=_replay(**running)), env) == []
    refused = "\n".join(startup_problems(app_config(PRODUCTION, engine={"sglang": running}),
                                         env))
    assert (f"max_running_requests={replay}: one full-context request's KV needs" in refused
            and "(scratch rollback)" in refused)
    # One more than replay's fit is refused under replay too.
    more = {"max_running_requests": replay + 1,
            "max_mamba_cache_size": (replay + 1) * MAMBA_SLOTS_PER_RUNNING_REQUEST}
    assert "(replay rollback)" in "\n".join(startup_problems(
        app_config(PRODUCTION, engine=_replay(**more)), env))


# --- RayEngine's rank layout and SGLang's outputs -----------------------------------------------


def test_rank_plan_is_rayengine_auto_mode() -> None:
    plan = rank_plan(nnodes=2, tp_size=16, engine_bundle=1)
    assert [s.tp_rank for s in plan] == list(range(16))
    assert {s.bundle_index for s in plan[:8]} == {1}  # node 0 = the engine's bundle
    assert {s.bundle_index for s in plan[8:]} == {0}
    assert [s.gpu_id for s in plan] == list(range(8)) * 2


def test_sampling_params_mapping() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.9, top_k=0, max_tokens=5, stop=("\n\n",),
                       stop_token_ids=(7,), ignore_eos=True, seed=3)
    assert sampling_params(p) == {"temperature": 0.0, "top_p": 0.9, "top_k": -1,
                                  "max_new_tokens": 5, "ignore_eos": True, "stop": ["\n\n"],
                                  "stop_token_ids": [7], "sampling_seed": 3}
    assert sampling_params(SamplingParams(top_k=20))["top_k"] == 20
    # Hostile values map to what they mean, never to a float32 zero or subnormal.
    tiny = sampling_params(SamplingParams(temperature=1e-38, top_p=1e-300))
    assert tiny["temperature"] == 0.0 and tiny["top_k"] == 1 and tiny["top_p"] == 1e-6


def _meta(finish: dict | None, completion: int, **spec: object) -> dict:
    return {"id": "r", "finish_reason": finish, "prompt_tokens": 4,
            "completion_tokens": completion, **spec}


def test_output_tracker_streams_deltas_and_spec_stats() -> None:
    # The dict shapes of TokenizerManager._handle_batch_output with incremental streaming.
    spec = {"spec_verify_ct": 2, "spec_accept_length": 2.5, "spec_accept_rate": 0.25,
            "spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 12,
            "spec_correct_drafts_histogram": [0, 1, 1]}
    t = OutputTracker("r", 4, speculative=True, incremental=True)
    a = t.update({"text": "Hel", "output_ids": [1, 2], "meta_info": _meta(None, 2)})
    b = t.update({"text": "lo!", "output_ids": [3, 4, 5],
                  "meta_info": _meta({"type": "stop", "matched": 5}, 5, cached_tokens=3,
                                     **spec)})
    assert (a.token_ids, a.text, a.finished, a.spec) == ([1, 2], "Hel", False, None)
    assert (b.token_ids, b.text, b.finished, b.finish_reason) == ([3, 4, 5], "lo!", True, "stop")
    assert b.completion_tokens == 5 and b.prompt_tokens == 4
    assert (a.cached_tokens, b.cached_tokens) == (0, 3)  # SGLang's radix-cache hit
    # Same names as the reference backend, so the API's usage extension is identical.
    assert set(b.spec) == set(SpecStats().as_dict(1))
    assert b.spec["spec_accept_length"] == 2.5 and b.spec["spec_verify_ct"] == 2
    assert b.spec["spec_correct_drafts_histogram"] == [0, 1, 1]
    assert b.spec["spec_accepted_drafts"] == 3 and b.spec["spec_proposed_drafts"] == 12


def test_output_tracker_cumulative_mode_and_abort() -> None:
    t = OutputTracker("r", 4, speculative=False, incremental=False)
    t.update({"text": "ab", "output_ids": [1, 2], "meta_info": _meta(None, 2)})
    out = t.update({"text": "abcd", "output_ids": [1, 2, 3, 4],
                    "meta_info": _meta({"type": "length", "length": 4}, 4)})
    assert (out.token_ids, out.text, out.finish_reason, out.spec) == ([3, 4], "cd", "length", None)
    with pytest.raises(RequestAborted, match="too long"):
        OutputTracker("x", 1, True).update({"text": "", "output_ids": [], "meta_info": _meta(
            {"type": "abort", "message": "too long"}, 0)})


# --- SGLang's KV events (--kv-events-config, managed; serve_app/engines/sglang/kv_events.py) --


def test_kv_events_config_is_passed_and_managed() -> None:
    from serve_app.engines.sglang.args import KV_EVENTS_DEFAULT_PORT, kv_events_config

    default = app_config(PRODUCTION)
    args = sglang_server_args(default)
    # On by default: a loopback PUB the rank-0 scheduler binds (on the replica's node).
    assert json.loads(args["kv_events_config"]) == {
        "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{KV_EVENTS_DEFAULT_PORT}",
        "bind": True, "topic": ""}
    assert check_server_args(args) == []
    argv = server_args_cli(args)
    assert argv[argv.index("--kv-events-config") + 1] == args["kv_events_config"]
    # The port the replica picked when it starts, unless the config names one.
    picked = sglang_server_args(default, kv_events_port=40123)
    assert picked["kv_events_config"] == kv_events_config(40123)
    assert "tcp://127.0.0.1:40123" in picked["kv_events_config"]
    fixed = app_config(PRODUCTION, engine={"sglang": {"kv_events_port": 6000}})
    assert "tcp://127.0.0.1:6000" in sglang_server_args(fixed, kv_events_port=40123)[
        "kv_events_config"]
    assert fixed.engine.sglang.model_dump()["kv_events_port"] == 6000
    # At the default, the config tree does not write the fields (the shipped files stay).
    dumped = default.engine.sglang.model_dump()
    assert "kv_events" not in dumped and "kv_events_port" not in dumped
    off = app_config(PRODUCTION, engine={"sglang": {"kv_events": False}})
    assert "kv_events_config" not in sglang_server_args(off)
    assert off.engine.sglang.model_dump()["kv_events"] is False
    assert type(off.engine.sglang).model_validate(off.engine.sglang.model_dump()) == \
        off.engine.sglang
    assert "may not set kv_events_config" in _problems(engine={"sglang": {"extra_server_args": {
        "kv_events_config": "{}"}}})
    f = sglang_fields()
    assert f["kv_events_config"]["flag"] == "--kv-events-config"


def test_kv_events_config_is_one_sglang_parses() -> None:
    """The JSON is a valid 0.5.23 KVEventsConfig and binds where the replica connects."""
    source = sglang_file("srt/disaggregation/kv_events.py")
    text = source.read_text()
    config = json.loads(sglang_server_args(app_config(PRODUCTION))["kv_events_config"])
    for name in config:  # every key a KVEventsConfig field
        assert f"\n    {name}: " in text.split("class KVEventsConfig")[1].split("\nclass ")[0]
    assert "def offset_endpoint_port" in text and "base_port + data_parallel_rank" in text
    # The Structs this project mirrors, with their tags and fields in 0.5.23's order.
    stored = text.split("class BlockStored(KVCacheEvent):")[1].split("\nclass ")[0]
    fields = [line.split(":")[0].strip() for line in stored.splitlines()
              if line.startswith("    ") and ":" in line and not line.strip().startswith("#")]
    assert fields == ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                      "medium", "cache_salt", "session_id", "lora_name"]
    assert "tag=True" in text.split("class KVCacheEvent(")[1].split("\nclass ")[0]
    assert "array_like=True" in text.split("class EventBatch(")[1].split("\nclass ")[0]


def test_the_pd_request_fields_are_sglangs_own() -> None:
    """What the PD path sends SGLang, against 0.5.23's source: the bootstrap fields are
    parameters of `Engine.async_generate`, the health probe's fake host is SGLang's
    FAKE_BOOTSTRAP_HOST, and each transfer backend's package is the module SGLang imports."""
    engine = sglang_file("srt/entrypoints/engine.py")
    import ast

    from capacity.sglang_recipe import TRANSFER_BACKENDS
    from serve_app.engines.sglang.engine import FAKE_BOOTSTRAP_HOST, SGLangHandoff, _bootstrap

    tree = ast.parse(engine.read_text())
    [generate] = [f for f in ast.walk(tree) if isinstance(f, ast.AsyncFunctionDef)
                  and f.name == "async_generate"]
    params = {a.arg for a in generate.args.args + generate.args.kwonlyargs}
    handoff = SGLangHandoff("r", [1], SamplingParams(), "10.0.0.1", 8998, 7)
    assert set(_bootstrap(handoff)) <= params
    utils = (SGLANG_SRC / "srt" / "disaggregation" / "utils.py").read_text()
    assert f'FAKE_BOOTSTRAP_HOST = "{FAKE_BOOTSTRAP_HOST}"' in utils
    for backend, (module, _) in TRANSFER_BACKENDS.items():
        sources = " ".join(p.read_text() for p in
                           (SGLANG_SRC / "srt" / "disaggregation" / backend).glob("*.py"))
        assert f"from {module}" in sources or f"import {module}" in sources, backend
