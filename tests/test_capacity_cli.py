"""The `kimi-capacity` commands end to end (in-process), including the seed table and emit."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from capacity.cli import app
from capacity.emit import onprem_config, validate_cluster_config, validate_serve_config

runner = CliRunner()

# The seed's own sizing rule and table, as it states them.
SEED = (
    "Kimi-K3-DSpark, 2.2B params: 16-bit 4.5 GB weights / 5.4 GB needed; 8-bit 2.2 / 2.7; "
    "4-bit 1.1 / 1.3. Cheapest setup at every precision: 1x MI300X (192 GB) Vultr $1.85/h; "
    "also fits: 1x H100 $1.99, 1x MI325X $2.00."
)


def invoke(*args: str):
    return runner.invoke(app, list(args))


def assert_user_error(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert fragment in result.output


def test_simple_reproduces_seed_table():
    result = invoke("simple", "--model", "kimi-k3-dspark")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == SEED
    assert "days old" in result.output


def test_model_breakdown_json():
    result = invoke("model", "kimi-k3-dspark", "--json")
    data = json.loads(result.output)
    assert data["total_params"] == 2_249_289_601
    assert data["gqa_kv_bytes_per_token_bf16"] == 20_480
    assert data["bytes"]["bf16"]["draft_fc"] == 2 * 256_901_120


def test_plan_json_and_csv(tmp_path: Path):
    csv_path = tmp_path / "rows.csv"
    result = invoke("plan", "--draft", "kimi-k3-dspark", "--context", "128K", "--gpus",
                    "MI300X,H200", "--max-nodes", "3", "--json", "--csv", str(csv_path),
                    "--top", "3")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["context_length"] == 131_072 and len(data["rows"]) == 3
    assert "days old" in data["prices"]
    row = data["rows"][0]
    assert row["gpu"] in ("MI300X", "H200") and row["usd_per_million_tokens"] > 0
    assert row["price_age_days"] >= 0 and row["max_concurrent_per_replica"] >= 1
    assert len(csv_path.read_text().splitlines()) > 4


def test_plan_plot_writes_png(tmp_path: Path):
    png = tmp_path / "pareto.png"
    result = invoke("plan", "--draft", "kimi-k3-dspark", "--gpus", "MI300X,H200",
                    "--max-nodes", "2", "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_infeasible_context_explains():
    result = invoke("plan", "--draft", "kimi-k3-dspark", "--context", "1M", "--gpus", "H100",
                    "--max-nodes", "2")
    assert_user_error(result, "H100")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("plan", "--gpus", "TPU9"), "unknown GPU 'TPU9'"),
        (("plan", "--context", "0"), "must be positive"),
        (("plan", "--context", "-128K"), "must be positive"),
        (("plan", "--context", "2M"), "exceeds Kimi-K3's maximum 1,048,576"),
        (("plan", "--weights", "fp3"), "unknown weight format 'fp3'; allowed: bf16"),
        (("explain", "--gpu", "H200", "--nodes", "2", "--tp", "5"),
         "tp (5) x pp (1) = 5 ranks must split evenly over nodes (2)"),
        (("explain", "--gpu", "H200", "--nodes", "1", "--tp", "4"),
         "uses 4 GPUs per node; a H200 node has 8"),
        (("model", "/no/such/config.json"), "neither a config.json path"),
    ],
)
def test_bad_input_is_one_line(args, fragment):
    assert_user_error(invoke(*args), fragment)


def test_malformed_price_table_names_the_row(tmp_path: Path):
    prices = tmp_path / "prices.csv"
    prices.write_text(
        "provider,gpu,usd_per_gpu_hour,date_read,source,note\n"
        "Acme,H100,2.10,2026-10-01,test,\n"
        "Broken,H200,-1,2026-10-01,test,\n"
    )
    result = invoke("plan", "--prices", str(prices))
    assert_user_error(result, "line 3 (provider='Broken', gpu='H200')")
    prices.write_text("provider,gpu,usd_per_gpu_hour,date_read,source\n"
                      "Acme,H100,2.10,yesterday,test\n")
    assert_user_error(invoke("plan", "--prices", str(prices)), "date_read")


def test_user_price_table_is_used(tmp_path: Path):
    prices = tmp_path / "prices.csv"
    prices.write_text("provider,gpu,usd_per_gpu_hour,date_read,source\n"
                      "Acme,H200,1.00,2026-10-01,my quote\n")
    result = invoke("plan", "--draft", "kimi-k3-dspark", "--gpus", "H200", "--max-nodes", "2",
                    "--prices", str(prices), "--json", "--top", "1")
    row = json.loads(result.output)["rows"][0]
    assert row["provider"] == "Acme" and row["usd_per_hour"] == pytest.approx(row["gpus"] * 1.0)


def test_explain_json_breakdown():
    result = invoke("explain", "--gpu", "H200", "--nodes", "2", "--draft", "kimi-k3-dspark",
                    "--context", "128K", "--json")
    data = json.loads(result.output)
    stage = data["stages"][0]
    assert data["fits"] and data["max_concurrent"] >= 1
    assert stage["per_request_gb"]["mla_kv"] == pytest.approx(27_648 * 131_136 / 1e9, rel=1e-6)
    assert stage["weights_gb"]["routed_experts"] == pytest.approx(1446.46 / 16, rel=0.01)
    assert data["time"]["step_ms"] > 0


@pytest.mark.parametrize(
    ("strategy", "line"),
    [
        ("scratch", "KDA rollback scratch (SGLang's default, 8 states per request): 224.7 MB per "
                    "running request, 11.01 GB per GPU at 48 running (+ padding); KDA states in "
                    "all 17.78 GB, leaving 2.28 GB of KV: 1 full-context (131,072-token) requests"),
        ("replay", "KDA rollback replay (--enable-linear-replayssm-spec, ring of 16): 7.6 MB of "
                   "conv windows per running request + a 10.2 MB ring on each of its 5 state "
                   "slots, 2.83 GB per GPU at 48 running (+ padding); KDA states in all 9.60 GB, "
                   "leaving 10.46 GB of KV: 5 full-context (131,072-token) requests"),
    ],
)
def test_explain_prints_the_kda_rollback_line(strategy: str, line: str):
    """K3 + DSpark on 2 x 8 H200 (TP16), FP8 KV, 48 running at 128K (memory.running_fit)."""
    args = ("explain", "--gpu", "H200", "--nodes", "2", "--draft", "kimi-k3-dspark", "--context",
            "128K", "--kv", "fp8", "--concurrency", "48", "--kda-rollback", strategy)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert line in result.output
    data = json.loads(invoke(*args, "--json").output)
    rollback = data["kda_rollback"]
    assert rollback["strategy"] == strategy and rollback["running_per_gpu"] == 48
    assert rollback["ring_len"] == (16 if strategy == "replay" else None)
    per_request = data["stages"][0]["per_request_gb"]
    assert ("kda_replay_ring" in per_request) == (strategy == "replay")
    assert ("kda_verify_states" in per_request) == (strategy == "scratch")


def test_explain_defaults_to_scratch_and_plan_takes_the_option():
    base = ("explain", "--gpu", "H200", "--nodes", "2", "--draft", "kimi-k3-dspark", "--json")
    assert (json.loads(invoke(*base).output)
            == json.loads(invoke(*base, "--kda-rollback", "scratch").output))
    # Without a draft there is no verify to roll back: no line.
    plain = invoke("explain", "--gpu", "H200", "--nodes", "2")
    assert plain.exit_code == 0 and "KDA rollback" not in plain.output
    result = invoke("plan", "--draft", "kimi-k3-dspark", "--context", "1M", "--gpus", "H200",
                    "--kv", "fp8", "--max-nodes", "2", "--top", "1", "--kda-rollback", "replay")
    assert result.exit_code == 0, result.output
    # The line sizes the top row's layout at its running requests.
    assert re.search(r"#1 2x8 H200 [^:]+: KDA rollback replay \(--enable-linear-replayssm-spec, "
                     r"ring of 16\)", result.output), result.output


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--kda-rollback", "undo"), "--kda-rollback must be one of scratch, replay, got 'undo'"),
        (("--kda-rollback", "replay", "--replay-ring-len", "24"), "power of two, got 24"),
        (("--kda-rollback", "replay", "--replay-ring-len", "8"), "below 2 x 8 draft tokens"),
    ],
)
def test_bad_kda_rollback_is_one_line(args, fragment):
    for command in (("explain", "--gpu", "H200", "--nodes", "2"), ("plan",)):
        assert_user_error(invoke(*command, "--draft", "kimi-k3-dspark", *args), fragment)
    assert_user_error(invoke("plan", "--kda-rollback", "replay"), "it needs --draft")


def test_calibrate_lists_every_anchor():
    result = invoke("calibrate", "--json")
    data = json.loads(result.output)
    assert len(data["anchors"]) >= 11
    assert all("error" in a and "source" in a for a in data["anchors"])


def test_emit_writes_valid_configs(tmp_path: Path):
    # MI300X holds K3's experts as BF16 in SGLang 0.5.23: 6 nodes is its smallest fleet.
    result = invoke("emit", "--gpu", "MI300X", "--nodes", "6", "--draft", "kimi-k3-dspark",
                    "--model-ref", "/models/Kimi-K3", "--out-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    serve = yaml.safe_load((tmp_path / "serve-mi300x-6x8.yaml").read_text())
    cluster = yaml.safe_load((tmp_path / "cluster-mi300x-6x8.yaml").read_text())
    validate_serve_config(serve)
    validate_cluster_config(cluster)
    app_cfg = serve["applications"][0]
    assert app_cfg["import_path"] == "serve_app.app:build_app"
    assert app_cfg["args"]["parallelism"] == {
        "tp": 48, "ep": 48, "attention_dp": 1, "nodes": 6,
    }
    # The args are the Serve app's own config tree: its model accepts them, and the placement
    # it derives is the plan's (one 8-GPU bundle per node, spread over the nodes).
    from serve_app.config import AppConfig
    from serve_app.engines.sglang.args import sglang_server_args

    app = AppConfig.model_validate(app_cfg["args"])
    # One CPU per rank (capacity.emit.CPUS_PER_RANK, as the shipped files).
    assert app.bundles() == [{"CPU": 8.0, "GPU": 8.0}] * 6
    assert app.strategy == "STRICT_SPREAD"
    assert (app.engine.sglang.planner_model, app.engine.sglang.planner_draft) == (
        "kimi-k3", "kimi-k3-dspark")
    server_args = sglang_server_args(app)
    assert server_args["speculative_algorithm"] == "DSPARK"
    assert server_args["tp_size"] == 48 and server_args["nnodes"] == 6
    assert "--num-gpus=0" in cluster["head_start_ray_commands"][1]
    assert all("RAY_AUTH_MODE=token" in c for c in cluster["worker_start_ray_commands"][1:])


@pytest.mark.parametrize(("gpu", "vendor_env"), [
    # AMD: the static DSpark verify (no ragged-verify CUDA graph there), no mode variable.
    ("MI300X", {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
                "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"}),
    ("H200", {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "SGLANG_RAGGED_VERIFY_MODE"}),
])
def test_emitted_files_start_a_replica(tmp_path: Path, gpu: str, vendor_env: set[str]):
    """An emitted Serve file carries every variable the SGLang backend's start-up check requires
    for its GPU vendor and DSpark verify, and the emitted cluster installs the project (with
    the sglang extra on the GPU workers), as deployments/generate.py's files do."""
    from serve_app.config import AppConfig
    from serve_app.engines.sglang.args import runtime_env_vars

    nodes = 6 if gpu == "MI300X" else 2  # MI300X holds K3's experts as BF16 (6 nodes)
    result = invoke("emit", "--gpu", gpu, "--nodes", str(nodes), "--draft", "kimi-k3-dspark",
                    "--model-ref", "/models/Kimi-K3", "--out-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    stem = f"{gpu.lower()}-{nodes}x8"
    serve = yaml.safe_load((tmp_path / f"serve-{stem}.yaml").read_text())
    cluster = yaml.safe_load((tmp_path / f"cluster-{stem}.yaml").read_text())
    app_cfg = serve["applications"][0]
    config = AppConfig.model_validate(app_cfg["args"])
    env = app_cfg["runtime_env"]["env_vars"]
    required = runtime_env_vars(config)
    assert set(required) == vendor_env
    assert required.items() <= env.items()
    # The project (the app the Serve file imports) on every node: with SGLang on the workers
    # only, from the checkout that `ray up` syncs.
    workers = " && ".join(cluster["worker_setup_commands"])
    head = " && ".join(cluster["head_setup_commands"])
    assert "pip install -e '.[sglang]'" in workers
    assert "pip install -e '.'" in head and "sglang" not in head
    assert "." in cluster["file_mounts"].values()
    validate_cluster_config(cluster)


def test_emit_replay_rollback_runs_its_own_header_command(tmp_path: Path):
    """`emit --kda-rollback replay` writes SGLang's ReplaySSM settings, sizes more running
    requests than the default scratch (less verify memory), and the header's command is one
    this CLI accepts."""
    args = ["emit", "--gpu", "H200", "--nodes", "2", "--draft", "kimi-k3-dspark", "--kv", "fp8",
            "--context", "1M", "--model-ref", "/models/Kimi-K3"]
    runs = {}
    for mode in ("scratch", "replay"):
        out = tmp_path / mode
        result = invoke(*args, "--kda-rollback", mode, "--out-dir", str(out))
        assert result.exit_code == 0, result.output
        text = (out / "serve-h200-2x8.yaml").read_text()
        runs[mode] = (text, yaml.safe_load(text)["applications"][0]["args"]["engine"]["sglang"])
    (_, scratch), (replay_text, replay) = runs["scratch"], runs["replay"]
    assert "enable_linear_replayssm_spec" not in scratch
    assert replay["enable_linear_replayssm_spec"] is True
    assert replay["max_running_requests"] > scratch["max_running_requests"]
    header = next(line for line in replay_text.splitlines() if "kimi-capacity emit" in line)
    again = tmp_path / "again"
    rerun = invoke(*header.split("kimi-capacity ")[1].split(), "--out-dir", str(again))
    assert rerun.exit_code == 0, rerun.output
    assert (again / "serve-h200-2x8.yaml").read_text() == replay_text


def test_emit_validation_rejects_broken_configs():
    from capacity import CapacityError

    broken = onprem_config("kimi-k3", 1)
    broken["provider"]["type"] = 7
    with pytest.raises(CapacityError, match="cluster config is invalid"):
        validate_cluster_config(broken)
    with pytest.raises(CapacityError, match="Serve config is invalid"):
        validate_serve_config({"applications": [{"import_path": 3}]})


def test_emit_refuses_layout_that_does_not_fit(tmp_path: Path):
    assert_user_error(invoke("emit", "--gpu", "H200", "--nodes", "1", "--out-dir",
                             str(tmp_path)), "does not fit")


# Every GPU vendor the shipped files name (NVIDIA H100/H200/B300, AMD MI300X/MI355X) on 1, 2
# and 4 nodes, at K3's full context; what the planner emits, with BF16 KV where one
# full-context request fits and FP8 otherwise. The rest it must refuse: MI300X on all three,
# since SGLang 0.5.23 holds K3's experts there as BF16 (capacity/sglang_k3_paths.py).
FLEET_GPUS = ("H100", "H200", "B300", "MI300X", "MI355X")
FLEET_NODES = (1, 2, 4)
EMITTED_FLEETS = {
    ("H100", 4): "fp8", ("H200", 2): "fp8", ("H200", 4): "bf16", ("B300", 1): "bf16",
    ("B300", 2): "bf16", ("B300", 4): "bf16",
    ("MI355X", 1): "bf16", ("MI355X", 2): "bf16", ("MI355X", 4): "bf16",
}


def _emit(tmp_path: Path, gpu: str, nodes: int, kv: str) -> Any:
    return invoke("emit", "--gpu", gpu, "--nodes", str(nodes), "--kv", kv, "--context", "1M",
                  "--draft", "kimi-k3-dspark", "--model-ref", "/models/Kimi-K3",
                  "--draft-ref", "/models/Kimi-K3-DSpark", "--out-dir", str(tmp_path))


@pytest.mark.parametrize("gpu", FLEET_GPUS)
@pytest.mark.parametrize("nodes", FLEET_NODES)
def test_every_emitted_fleet_passes_the_apps_startup_checks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu: str, nodes: int):
    """Each (GPU x nodes) fleet for K3 + DSpark at the full 1M context: the planner emits it
    (BF16 KV, else FP8) or refuses it with a reason; an emitted Serve file is the app's config
    tree and passes the very checks SGLangEngine.start makes before launching SGLang
    (checks.startup_problems: the model/GPU/context checks, the server arguments against
    SGLang 0.5.23's flag table, the runtime_env NOSET variables), after which start() stops
    only for want of a placement group."""
    from capacity.ray_env import NOSET_CUDA_ENV, NOSET_HIP_ENV
    from serve_app.config import AppConfig
    from serve_app.engines.sglang.checks import startup_problems
    from serve_app.engines.sglang.engine import SGLangEngine
    from serve_app.protocol.generation import EngineUnavailable

    tried = {}
    for kv in ("bf16", "fp8"):
        result = _emit(tmp_path / kv, gpu, nodes, kv)
        tried[kv] = result
        if result.exit_code == 0:
            break
    expected = EMITTED_FLEETS.get((gpu, nodes))
    if expected is None:
        for result in tried.values():
            assert result.exit_code == 2, result.output
            assert "does not fit" in result.output or "cannot serve one" in result.output
        return
    assert kv == expected and tried[kv].exit_code == 0, tried[kv].output
    (serve_file,) = (tmp_path / kv).glob("serve-*.yaml")
    data = yaml.safe_load(serve_file.read_text())
    validate_serve_config(data)
    app_cfg = data["applications"][0]
    config = AppConfig.model_validate(app_cfg["args"])
    assert config.engine.sglang.context_length == 1_048_576
    env = app_cfg["runtime_env"]["env_vars"]
    assert startup_problems(config, env) == []
    # Without the file's runtime_env the same check refuses, naming the variables.
    missing = "\n".join(startup_problems(config, {}))
    assert NOSET_CUDA_ENV in missing and (NOSET_HIP_ENV in missing) == gpu.startswith("MI")
    # The replica's environment is the file's runtime_env: start() runs the same checks.
    for name in (NOSET_CUDA_ENV, NOSET_HIP_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(EngineUnavailable, match="placement group"):
        SGLangEngine.start(config)
    monkeypatch.delenv(NOSET_CUDA_ENV)
    with pytest.raises(EngineUnavailable, match="start-up checks failed"):
        SGLangEngine.start(config)


def test_an_emitted_disaggregated_fleet_passes_each_sides_startup_checks(tmp_path: Path) -> None:
    """`emit --pd 1:2` writes one app whose prefill and decode sides run the 2 x 8 H200
    layout as SGLang PD servers: the app's config checks pass on both sides, each side's
    server arguments carry its --disaggregation-mode and the transfer backend (the
    bootstrap port on the prefill side only; the KDA replay rollback only where SGLang
    verifies, on the decode side), every argument is in SGLang 0.5.23's flag table, and the
    cluster holds both sides' nodes. The one start-up problem left on a machine without the
    transfer backend installed is that one, by name."""
    from serve_app.app import validate
    from serve_app.config import AppConfig
    from serve_app.engines.sglang.args import server_args_cli, sglang_server_args
    from serve_app.engines.sglang.checks import startup_problems, transfer_backend_problems

    result = invoke("emit", "--gpu", "H200", "--nodes", "2", "--kv", "fp8", "--context", "1M",
                    "--draft", "kimi-k3-dspark", "--kda-rollback", "replay", "--pd", "1:2",
                    "--out-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    serve_file = tmp_path / "serve-h200-2x8-pd1p2d.yaml"
    assert "--pd 1:2" in serve_file.read_text().splitlines()[1]  # the command that writes it
    app_cfg = yaml.safe_load(serve_file.read_text())["applications"][0]
    config = AppConfig.model_validate(app_cfg["args"])
    validate(config)  # both sides, each named by its role on failure
    for role, replicas in (("prefill", 1), ("decode", 2)):
        side = config.side(role)
        assert side.placement.replicas == replicas
        args = sglang_server_args(side, role=role)
        assert args["disaggregation_mode"] == role
        assert args["disaggregation_transfer_backend"] == "mooncake"
        assert ("disaggregation_bootstrap_port" in args) == (role == "prefill")
        assert bool(args.get("enable_linear_replayssm_spec")) == (role == "decode")
        assert f"--disaggregation-mode {role}" in " ".join(server_args_cli(args))
        # Nothing else: what is left is whether mooncake is installed here (not in CI).
        assert startup_problems(side, app_cfg["runtime_env"]["env_vars"], role) == \
            transfer_backend_problems("mooncake")
    assert transfer_backend_problems("mooncake", lambda _: object()) == []
    # The app's config accepts exactly the backends the planner's table knows.
    from typing import get_args

    from capacity.sglang_recipe import TRANSFER_BACKENDS
    from serve_app.config import DisaggregationConfig

    field = DisaggregationConfig.model_fields["transfer_backend"].annotation
    assert set(get_args(field)) == set(TRANSFER_BACKENDS)
    assert transfer_backend_problems("nixl", lambda _: None) == [
        "disaggregation.transfer_backend='nixl': the 'nixl' module is not installed on this "
        "node (pip install nixl)"]
    cluster = yaml.safe_load((tmp_path / "cluster-h200-2x8-pd1p2d.yaml").read_text())
    assert cluster["max_workers"] == 3 * 2  # three replicas of two nodes
    bad = invoke("emit", "--gpu", "H200", "--nodes", "2", "--kv", "fp8", "--context", "1M",
                 "--pd", "0:2", "--out-dir", str(tmp_path / "bad"))
    assert bad.exit_code == 2 and "--pd '0:2'" in bad.output


def test_each_side_of_an_emitted_disaggregated_fleet_gets_its_own_layout(tmp_path: Path) -> None:
    """`emit --pd 1:2 --prefill-nodes 3`: the decode replicas on 2 x 8 H200, the prefill one
    on 3 x 8 (TP24), each side's SGLang servers sized by the planner on its own GPUs (the
    running requests and KDA state pool: more on the prefill side, whose 24 GPUs leave more
    memory per GPU after the weights), both sides passing the app's checks, and the cluster
    holding 1 x 3 + 2 x 2 worker nodes."""
    from capacity.cli import describe_model
    from capacity.config import Layout, Speculation
    from capacity.formats import KvDtype
    from capacity.memory import running_fit
    from capacity.tables import gpu_spec, load_gpus
    from serve_app.app import validate
    from serve_app.config import AppConfig
    from serve_app.engines.sglang.args import sglang_server_args
    from serve_app.engines.sglang.checks import startup_problems, transfer_backend_problems

    result = invoke("emit", "--gpu", "H200", "--nodes", "2", "--kv", "fp8", "--context", "1M",
                    "--draft", "kimi-k3-dspark", "--pd", "1:2", "--prefill-nodes", "3",
                    "--out-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    serve_file = tmp_path / "serve-h200-2x8-pd1p2d-prefill3x8.yaml"
    assert "--pd 1:2 --prefill-nodes 3" in serve_file.read_text().splitlines()[1]
    app_cfg = yaml.safe_load(serve_file.read_text())["applications"][0]
    config = AppConfig.model_validate(app_cfg["args"])
    validate(config)
    target, draft = describe_model("kimi-k3"), describe_model("kimi-k3-dspark")
    h200 = gpu_spec(load_gpus(), "H200")
    running = {}
    for role, nodes, replicas in (("prefill", 3, 1), ("decode", 2, 2)):
        side = config.side(role)
        assert (side.placement.replicas, side.parallelism.nodes, side.parallelism.tp) == (
            replicas, nodes, 8 * nodes)
        args = sglang_server_args(side, role=role)
        assert (args["tp_size"], args["nnodes"], args["disaggregation_mode"]) == (
            8 * nodes, nodes, role)
        fit = running_fit(target, Layout(gpu="H200", nodes=nodes, tp=8 * nodes, ep=8 * nodes,
                                         kv_dtype=KvDtype.FP8), h200, 1 << 20, draft,
                          Speculation.for_draft(draft))
        assert (args["max_running_requests"], args["max_mamba_cache_size"]) == (
            fit.max_running_requests, fit.mamba_cache_slots)
        running[role] = fit.max_running_requests
        assert startup_problems(side, app_cfg["runtime_env"]["env_vars"], role) == \
            transfer_backend_problems("mooncake")
    assert running["prefill"] > running["decode"]
    cluster = yaml.safe_load((tmp_path / "cluster-h200-2x8-pd1p2d-prefill3x8.yaml").read_text())
    assert cluster["max_workers"] == 1 * 3 + 2 * 2
    alone = invoke("emit", "--gpu", "H200", "--nodes", "2", "--prefill-nodes", "3",
                   "--out-dir", str(tmp_path / "alone"))
    assert alone.exit_code == 2 and "--pd PREFILL:DECODE" in alone.output
    small = invoke("emit", "--gpu", "H200", "--nodes", "2", "--kv", "fp8", "--context", "1M",
                   "--pd", "1:2", "--prefill-nodes", "1", "--out-dir", str(tmp_path / "small"))
    assert small.exit_code == 2 and "1x8 H200 TP8 EP8 does not fit" in small.output
    # A side's server arguments are engine.sglang's fields, checked as those are, by name.
    for sglang, engine, error in (
            ({"max_running_requests": 0}, "sglang",
             "disaggregation.prefill.sglang.max_running_requests: Input should be greater than 0"),
            ({"max_runing_requests": 8}, "sglang",
             "disaggregation.prefill.sglang.max_runing_requests: Extra inputs are not permitted"),
            ({"max_running_requests": 8}, "reference",
             "disaggregation.prefill.sglang: SGLang server arguments, for engine.backend sglang "
             "only")):
        tree = copy.deepcopy(app_cfg["args"])
        tree["engine"]["backend"] = engine
        tree["disaggregation"]["prefill"]["sglang"] = sglang
        with pytest.raises(ValueError, match=re.escape(error)):
            AppConfig.model_validate(tree)


def test_every_fleet_plan_disagg_lists_is_emitted_by_its_command(tmp_path: Path) -> None:
    """`plan --disagg` prints, for each fleet, the `kimi-capacity emit` command that writes
    it; run, each writes the fleet's replica counts and each side's layout (as the plan's
    labels say: pipeline stages included, which reach SGLang as pp_size), and both sides pass
    the start-up checks. (Before, the planner offered prefill layouts the emitted app's checks
    refused: sized for the prompt alone, and with pp_size in extra_server_args.)"""
    import shlex

    from capacity.config import Layout
    from serve_app.app import validate
    from serve_app.config import AppConfig
    from serve_app.engines.sglang.args import sglang_server_args
    from serve_app.engines.sglang.checks import startup_problems, transfer_backend_problems

    rows = []
    for extra in (["--context", "1M", "--gpus", "H200,MI300X", "--per-gpu", "2", "--top", "5"],
                  # the flagship: its cheapest prefill side pipelines (PP2)
                  ["--context", "1M", "--gpus", "H200", "--max-nodes", "2",
                   "--output-tokens", "8192"],
                  # MI325X: K3's checkpoint as SGLang 0.5.23 holds it there (BF16 experts),
                  # the format the app's start-up check sizes a deployment with.
                  ["--context", "34K", "--gpus", "MI325X", "--output-tokens", "2048",
                   "--ttft", "30", "--itl", "30", "--top", "4"]):
        plan = invoke("plan", "--disagg", "--ttft", "1500", "--itl", "50", "--draft",
                      "kimi-k3-dspark", "--kv", "fp8", *extra, "--json")
        assert plan.exit_code == 0, plan.output
        rows += json.loads(plan.output)["rows"]
    assert {r["mode"] for r in rows} == {"agg", "disagg"}
    assert any("--prefill-pp 2" in r["emit"] for r in rows)
    assert any("--prefill-dp" in r["emit"] for r in rows)
    for i, row in enumerate(rows):
        argv = shlex.split(row["emit"])
        assert argv[:2] == ["kimi-capacity", "emit"]
        out = tmp_path / str(i)
        result = invoke(*argv[1:], "--out-dir", str(out))
        assert result.exit_code == 0, (row["emit"], result.output)
        [serve_file] = out.glob("serve-*.yaml")
        app_cfg = yaml.safe_load(serve_file.read_text())["applications"][0]
        config = AppConfig.model_validate(app_cfg["args"])
        validate(config)
        sides = {"decode": (row["decode"], row["decode_replicas"])}
        if row["mode"] == "disagg":
            sides["prefill"] = (row["prefill"], row["prefill_replicas"])
        for role, (label, replicas) in sides.items():
            side = config.side(role) if row["mode"] == "disagg" else config
            p = side.parallelism
            layout = Layout(gpu=row["gpu"], nodes=p.nodes, tp=p.tp, ep=p.ep, pp=p.pp,
                            attention_dp=p.attention_dp)
            assert (layout.label(), side.placement.replicas) == (label, replicas)
            assert sglang_server_args(side, role=role if row["mode"] == "disagg" else "both"
                                      ).get("pp_size", 1) == p.pp
            problems = startup_problems(side, app_cfg["runtime_env"]["env_vars"],
                                        role if row["mode"] == "disagg" else "both")
            assert problems == (transfer_backend_problems("mooncake")
                                if row["mode"] == "disagg" else []), (row["emit"], role)


def test_emit_chooses_the_dspark_verify_and_its_table(tmp_path: Path) -> None:
    """NVIDIA: SGLang's adaptive (compact) DSpark verify, its switch in the runtime_env, the
    SPS table beside the draft (or --sps-table), and the header saying how to make it; the
    header's command writes the same file. --verify static: none of it. Compact where SGLang
    refuses it (attention DP): refused, naming why."""
    base = ["emit", "--gpu", "H200", "--nodes", "2", "--context", "1M", "--kv", "fp8",
            "--draft", "kimi-k3-dspark", "--draft-ref", "/models/Kimi-K3-DSpark"]

    def emitted(*extra: str) -> tuple[str, dict]:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        result = invoke(*base, *extra, "--out-dir", str(out))
        assert result.exit_code == 0, result.output
        (path,) = out.glob("serve-*.yaml")
        text = path.read_text()
        return text, yaml.safe_load(text)["applications"][0]

    text, app = emitted()
    sglang = app["args"]["engine"]["sglang"]
    assert sglang["ragged_verify_mode"] == "compact"
    table = sglang["speculative_dspark_sps_table_path"]
    assert table == "/models/Kimi-K3-DSpark/sps/dspark-sps-2x8-h200-tp16-ep16.json"
    assert app["runtime_env"]["env_vars"]["SGLANG_RAGGED_VERIFY_MODE"] == "compact"
    assert "dspark_sps_profiler all" in text and f"--out {table}" in text
    text, app = emitted("--sps-table", "/tables/h200.json")
    assert app["args"]["engine"]["sglang"]["speculative_dspark_sps_table_path"] == \
        "/tables/h200.json"
    command = text.splitlines()[1].removeprefix("#   ")
    assert "--sps-table /tables/h200.json" in command
    _, static = emitted("--verify", "static")
    assert "ragged_verify_mode" not in static["args"]["engine"]["sglang"]
    assert "SGLANG_RAGGED_VERIFY_MODE" not in static["runtime_env"]["env_vars"]
    refused = invoke(*base, "--verify", "compact", "--dp", "2", "--context", "128K",
                     "--out-dir", str(tmp_path))
    assert refused.exit_code == 2 and "attention DP" in refused.output
    refused = invoke(*base, "--verify", "static", "--sps-table", "/t.json",
                     "--out-dir", str(tmp_path))
    assert refused.exit_code == 2 and "static does not read it" in refused.output


def test_emit_autoscales_from_the_planners_targets_and_its_header_command_rewrites_it(
        tmp_path: Path) -> None:
    """`--max-replicas` (aggregated) and `--pd-max` (each pool): the app's
    placement.autoscaling from --replicas / --pd up to the maximum, the TTFT bound the context
    class's planner target (the prefill pool's alone when disaggregated: a decode pool's first
    token is the prefill pool's), the cluster's GPU workers from the minimum's nodes up to the
    maximum's, and a header command that writes the same file again."""
    from capacity.targets import default_targets
    from serve_app.config import AppConfig

    ttft = default_targets(128 * 1024).ttft_s
    base = ["emit", "--gpu", "H200", "--nodes", "2", "--draft", "kimi-k3-dspark",
            "--context", "128K", "--model-ref", "/models/Kimi-K3"]
    cases = [(["--max-replicas", "3"], "serve-h200-2x8.yaml", "cluster-h200-2x8.yaml"),
             (["--pd", "1:2", "--pd-max", "2:4"], "serve-h200-2x8-pd1p2d.yaml",
              "cluster-h200-2x8-pd1p2d.yaml")]
    for flags, serve_name, cluster_name in cases:
        out = tmp_path / flags[0].strip("-")
        result = invoke(*base, *flags, "--out-dir", str(out))
        assert result.exit_code == 0, result.output
        text = (out / serve_name).read_text()
        args = yaml.safe_load(text)["applications"][0]["args"]
        app = AppConfig.model_validate(args)
        cluster = yaml.safe_load((out / cluster_name).read_text())
        if "--max-replicas" in flags:
            auto = app.placement.autoscaling
            assert (auto.min_replicas, auto.max_replicas, auto.ttft_slo_s) == (1, 3, ttft)
            assert (cluster["min_workers"], cluster["max_workers"]) == (2, 6)
        else:
            prefill, decode = app.autoscaling("prefill"), app.autoscaling("decode")
            assert (prefill.min_replicas, prefill.max_replicas, prefill.ttft_slo_s) == (1, 2, ttft)
            assert (decode.min_replicas, decode.max_replicas, decode.ttft_slo_s) == (2, 4, None)
            assert (cluster["min_workers"], cluster["max_workers"]) == (2 + 4, 4 + 8)
        assert "autoscaling:" in text.split("proxy_location")[0]  # said in the header
        header = next(line for line in text.splitlines() if "kimi-capacity emit" in line)
        again = out / "again"
        rerun = invoke(*header.split("kimi-capacity ")[1].split(), "--out-dir", str(again))
        assert rerun.exit_code == 0, rerun.output
        assert (again / serve_name).read_text() == text
    refused = invoke(*base, "--replicas", "3", "--max-replicas", "2", "--out-dir",
                     str(tmp_path / "bad"))
    assert refused.exit_code != 0 and "--max-replicas N >= --replicas" in refused.output
