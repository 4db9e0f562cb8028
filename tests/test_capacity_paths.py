"""What SGLang 0.5.23 runs K3 with on each GPU (capacity/data/sglang_k3_paths.csv), what the
planner prices from it, and the workload acceptance table with its batch falloff."""

from __future__ import annotations

import json
import math
import re
from itertools import pairwise

import pytest
from typer.testing import CliRunner

from capacity.acceptance import (
    acceptance_table,
    adaptive_acceptance,
    per_position_acceptance,
    verify_width,
    workload_acceptance,
)
from capacity.cli import app
from capacity.config import Layout, Speculation
from capacity.errors import CapacityError
from capacity.families import describe_model
from capacity.formats import WeightFormat
from capacity.planner import plan
from capacity.tables import load_gpus, load_k3_paths, load_prices
from capacity.timing import decode_step

SOURCE_LINE = re.compile(r"srt/[\w/]+\.py:\d+")


@pytest.fixture(scope="module")
def env():
    return (describe_model("kimi-k3"), describe_model("kimi-k3-dspark"), load_gpus(),
            load_prices())


def test_every_gpu_has_a_path_decided_by_source_lines():
    paths = load_k3_paths()
    assert set(paths) == set(load_gpus())
    for gpu, path in paths.items():
        assert SOURCE_LINE.search(path.decided_by), gpu


def test_gfx942_has_no_native_mxfp4_path():
    """MI300X and MI325X: SGLang 0.5.23 does not refuse AITER there, but AITER's MXFP4 SiTU
    MoE is gfx95x-only, so what runs is the BF16 upcast at load (mxfp4.py:1115-1135)."""
    paths = load_k3_paths()
    for gpu in ("MI300X", "MI325X"):
        path = paths[gpu]
        assert path.arch == "gfx942" and path.experts_in_memory == "bf16"
        assert "mxfp4.py:1115-1135" in path.decided_by and "gfx95" in path.path
    assert paths["MI355X"].experts_in_memory == "mxfp4" and "aiter" in paths["MI355X"].moe_runner
    assert paths["H200"].moe_runner == "marlin"
    assert paths["B300"].moe_runner.startswith("flashinfer_mxfp4")


def test_mi300x_is_priced_with_the_bf16_experts_it_runs(env):
    k3, draft, gpus, prices = env
    result = plan(k3, gpus, prices, 131_072, draft, allowed_gpus=["MI300X"])
    assert result.rows
    assert all(r.layout.weight_format is WeightFormat.BF16 for r in result.rows)
    assert all(r.sglang_path and r.sglang_path.experts_in_memory == "bf16" for r in result.rows)
    # BF16 experts are about 3.8x the MXFP4 checkpoint: 1.45 TB of experts no longer fit in
    # 2 x 8 MI300X (3.07 TB at 192 GB).
    assert min(r.layout.total_gpus for r in result.rows) > 16
    row = result.rows[0].as_dict()
    assert row["weights"] == "bf16" and "1115-1135" in row["sglang_path_source"]
    assert row["k3_anchor"] is False


def test_an_unrunnable_path_is_not_priced_and_says_why(env):
    k3, draft, gpus, prices = env
    paths = dict(load_k3_paths())
    paths["MI355X"] = paths["MI355X"].model_copy(update={
        "runnable": False, "experts_in_memory": "none", "path": "no kernel for this test"})
    result = plan(k3, gpus, prices, 131_072, draft, allowed_gpus=["MI355X", "B300"],
                  k3_paths=paths)
    assert {r.layout.gpu for r in result.rows} == {"B300"}
    assert result.rejected["MI355X"].startswith("not servable by SGLang 0.5.23: no kernel")
    del paths["MI355X"]
    result = plan(k3, gpus, prices, 131_072, draft, allowed_gpus=["MI355X"], k3_paths=paths)
    assert not result.rows and "no SGLang 0.5.23 path" in result.rejected["MI355X"]


def test_the_path_table_covers_k3_only(env):
    _, _, gpus, prices = env
    result = plan(describe_model("kimi-k2"), gpus, prices, 32_768, allowed_gpus=["MI300X"])
    assert result.rows and all(r.sglang_path is None for r in result.rows)


def test_workload_acceptance_is_the_published_table():
    table = acceptance_table()
    assert {"chat", "code", "agent", "reasoning"} <= set(table)
    assert workload_acceptance("code").acceptance_length == 4.73
    assert workload_acceptance("creative").acceptance_length == 2.61
    assert workload_acceptance("mean").acceptance_length == 3.45
    assert all(re.match(r"\d{4}-\d{2}", r.date) and r.source for r in table.values())
    with pytest.raises(CapacityError, match="unknown workload"):
        workload_acceptance("poetry-slam")


def test_adaptive_acceptance_falls_with_batch_to_the_published_points():
    # Flat through batch 8, then the LMSYS batch-256 points exactly: 2.7 -> 2.2, 5.0 -> 4.3.
    assert adaptive_acceptance(2.7, 1) == adaptive_acceptance(2.7, 8) == 2.7
    assert adaptive_acceptance(2.7, 256) == pytest.approx(2.2)
    assert adaptive_acceptance(5.0, 256) == pytest.approx(4.3)
    # Halfway in log2 between 8 and 256 (batch 8 x 2^2.5), half the drop.
    assert adaptive_acceptance(2.7, 8 * 2**2.5) == pytest.approx(2.45)
    for base in (2.61, 3.45, 3.84, 4.73):
        values = [adaptive_acceptance(base, b) for b in (1, 8, 16, 32, 64, 128, 256, 512)]
        assert all(a >= b for a, b in pairwise(values))
        assert values[0] > values[-1]


def test_verify_width_falls_with_batch_under_the_geometric_model():
    r = per_position_acceptance(2.7, 8)
    assert sum(r**k for k in range(8)) == pytest.approx(2.7)
    assert verify_width(2.7, 2.7, 8) == 8.0
    # The width whose 1 + r + ... + r^(w-1) is 2.2, by hand.
    w = math.log(1 - 2.2 * (1 - r)) / math.log(r)
    assert verify_width(2.7, 2.2, 8) == pytest.approx(w)
    widths = [verify_width(3.84, adaptive_acceptance(3.84, b), 8) for b in (8, 16, 64, 256)]
    assert widths[0] == 8.0 and all(a > b for a, b in pairwise(widths))


def test_adaptive_verify_makes_large_batches_cheaper_not_small_ones(env):
    k3, draft, gpus, _ = env
    layout = Layout(gpu="B300", nodes=1, tp=8, ep=8)
    static = Speculation(acceptance_length=3.84)
    adaptive = Speculation(acceptance_length=3.84, adaptive_verify=True)
    for batch in (1, 8):
        a = decode_step(k3, layout, gpus["B300"], batch, 8192, draft, adaptive)
        s = decode_step(k3, layout, gpus["B300"], batch, 8192, draft, static)
        assert a == s
    a = decode_step(k3, layout, gpus["B300"], 48, 8192, draft, adaptive)
    s = decode_step(k3, layout, gpus["B300"], 48, 8192, draft, static)
    assert a.tokens_per_step < s.tokens_per_step and a.step_s < s.step_s
    # ROCm deployments verify statically (emit's default), so the trim does not apply there.
    mi = Layout(gpu="MI355X", nodes=1, tp=8, ep=8)
    assert (decode_step(k3, mi, gpus["MI355X"], 48, 8192, draft, adaptive)
            == decode_step(k3, mi, gpus["MI355X"], 48, 8192, draft, static))


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})


def test_plan_says_what_runs_on_mi300x_with_the_source_line():
    result = invoke("plan", "--context", "1M", "--workload", "agent", "--draft",
                    "kimi-k3-dspark", "--gpus", "H200,B300,GB300,MI300X,MI355X", "--per-gpu", "1")
    assert result.exit_code == 0, result.output
    assert re.search(r"MI300X: SGLang 0\.5\.23 runs K3 as bf16 experts .*mxfp4\.py:1115-1135",
                     result.output)
    assert "workload agent" in result.output and "3.84" in result.output
    assert "\u2020 no published K3 measurement" in result.output


def test_every_planned_gpu_gets_its_path_line_shown_or_not():
    """The issue's command as written: MI300X has no row among those shown, and its SGLang path
    is still named with its source lines."""
    result = invoke("plan", "--context", "1M", "--workload", "agent", "--gpus",
                    "H200,B300,GB300,MI300X,MI355X")
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("MI300X: "))
    assert "bf16 experts" in line and "mxfp4.py:1115-1135" in line
    assert "none of its rows is shown" in line
    assert "DCP" in result.output and "HiCache" in result.output


def test_workload_and_acceptance_flags():
    data = json.loads(invoke("plan", "--context", "128K", "--gpus", "B300", "--draft",
                             "kimi-k3-dspark", "--workload", "code", "--json").output)
    assert data["speculation"]["acceptance_length"] == 4.73
    assert data["speculation"]["adaptive_verify"] is True
    assert data["speculation"]["workload"]["source"]
    pinned = json.loads(invoke("plan", "--context", "128K", "--gpus", "B300", "--draft",
                               "kimi-k3-dspark", "--workload", "code", "--acceptance", "2.0",
                               "--json").output)
    assert pinned["speculation"] == {"gamma": 7, "acceptance_length": 2.0,
                                     "adaptive_verify": False, "workload": None}
    # Higher acceptance, more tokens per user.
    assert (data["rows"][0]["tokens_s_per_user"] > pinned["rows"][0]["tokens_s_per_user"])
    bad = invoke("plan", "--workload", "poetry", "--draft", "kimi-k3-dspark")
    assert bad.exit_code == 2 and "unknown workload" in bad.output
    plain = invoke("plan", "--workload", "chat", "--gpus", "B300")
    assert plain.exit_code == 0 and "no --draft, so plain decode" in plain.output
    explain = invoke("explain", "--gpu", "B300", "--draft", "kimi-k3-dspark", "--workload",
                     "chat", "--json")
    assert explain.exit_code == 0, explain.output


def test_explain_names_the_path_and_warns_when_native_understates_it():
    result = invoke("explain", "--gpu", "MI300X", "--nodes", "2")
    assert result.exit_code == 0, result.output
    assert "SGLang 0.5.23 runs K3 on MI300X as bf16 experts" in result.output
    assert "rerun with --weights bf16" in result.output
    b300 = invoke("explain", "--gpu", "B300")
    assert "runs K3 on B300 as MXFP4 W4A8" in b300.output and "rerun" not in b300.output


def test_the_path_tables_source_lines_say_what_the_table_claims():
    """Against the 0.5.23 wheel (skipped where it is not unpacked): every cited file:line
    range exists, and the lines behind the gfx942 verdict say what the table reads from them."""
    from sglang_source import sglang_file

    cited = re.compile(r"(srt/[\w/]+\.py):(\d+)(?:-(\d+))?")
    for path in load_k3_paths().values():
        for rel, first, last in cited.findall(path.decided_by):
            lines = sglang_file(rel).read_text().splitlines()
            assert int(last or first) <= len(lines), (path.gpu, rel, first, last)

    def line(rel: str, number: int) -> str:
        return sglang_file(rel).read_text().splitlines()[number - 1]

    mxfp4 = "srt/layers/quantization/mxfp4.py"
    assert "Mxfp4Config(is_checkpoint_mxfp4_serialized=True)" in line("srt/models/kimi_k3.py", 499)
    assert "not support mxfp4 computation" in line(mxfp4, 332)  # from_config's gfx95 refusal
    assert "upcast_from_mxfp" in line(mxfp4, 1116)
    assert "MoeRunnerBackend.TRITON" in line(mxfp4, 1450)
    assert "SGLANG_USE_AITER" in line(mxfp4, 200)
    assert "MXFP4 Marlin requires SM90+" in line(mxfp4, 655)
    assert "flashinfer_mxfp4" in line("srt/arg_groups/model_overrides/kimi_k3.py", 190)
    assert '"situ"' in line("srt/layers/moe/moe_runner/triton_utils/fused_moe.py", 825)


# --- the emitted files use the same table (capacity/sglang_k3_paths.py) ----------------------

MIB_1M = 1_048_576


def _describe(gpu: str, nodes: int, dp: int = 1):
    from capacity import emit

    gpus = load_gpus()
    return emit.describe_layout(
        describe_model("kimi-k3"), "/models/Kimi-K3",
        emit.plain_layout(gpus[gpu], nodes, attention_dp=dp), MIB_1M, gpus[gpu],
        draft=describe_model("kimi-k3-dspark"), draft_ref="/models/Kimi-K3-DSpark",
        planner_refs=("kimi-k3", "kimi-k3-dspark"), levers=True)


def test_emit_sizes_mi300x_with_the_bf16_experts_sglang_holds(env):
    """describe_layout sizes a native-format MI300X layout as SGLang 0.5.23 holds it (BF16
    experts, mxfp4.py:1115-1135): its running requests are running_fit's on the BF16 layout,
    not the native one's; the header names the path and its source lines; 2 x 8 no longer
    holds the weights."""
    from capacity.config import Workload
    from capacity.emit import plain_layout
    from capacity.memory import memory_per_gpu, running_fit

    k3, draft, gpus, _ = env
    desc = _describe("MI300X", 6, dp=4)
    header = " ".join(" ".join(desc.notes).split())
    assert "SGLang 0.5.23 runs K3 on MI300X as bf16 experts / Triton" in header
    assert "mxfp4.py:1115-1135" in header and "sized with BF16 experts" in header
    assert "--weights bf16" in desc.command
    # Without AITER (mxfp4.py:200) SGLang takes the Triton path the file is sized for.
    assert desc.env_vars == {"SGLANG_USE_AITER": "0"}
    native = plain_layout(gpus["MI300X"], 6, attention_dp=4).model_copy(update={
        "mamba_strategy": "extra_buffer_lazy"})
    held = native.model_copy(update={"weight_format": WeightFormat.BF16})
    fit_held = running_fit(k3, held, gpus["MI300X"], MIB_1M, draft)
    # running_fit (what the app's start-up check calls) sizes the native layout as held too,
    # while memory_per_gpu prices the layout literally: MXFP4 experts leave more HBM free.
    assert running_fit(k3, native, gpus["MI300X"], MIB_1M, draft) == fit_held
    literal = [memory_per_gpu(k3, lay, Workload(context_length=MIB_1M), gpus["MI300X"], draft)
               .worst_stage.free_for_requests for lay in (native, held)]
    assert literal[0] > literal[1]
    assert desc.sglang["max_mamba_cache_size"] == fit_held.mamba_cache_slots
    assert f"{fit_held.free_bytes / 1e9:.1f} GB free after weights" in header
    with pytest.raises(CapacityError, match="cannot serve one 1,048,576-token request"):
        _describe("MI300X", 2)
    # A GPU whose path keeps the MXFP4 experts is sized natively and says so without the upcast.
    b300 = " ".join(" ".join(_describe("B300", 1).notes).split())
    assert "runs K3 on B300 as MXFP4 W4A8 / trtllm-gen" in b300 and "upcast" not in b300


def test_emit_refuses_a_gpu_without_a_path(monkeypatch):
    """No runnable path: describe_layout refuses with a CapacityError naming the GPU, the
    reason and the source lines (the planner's own reason string)."""
    import capacity.sglang_k3_paths as k3_paths
    from capacity.sglang_k3_paths import NotServable

    paths = dict(load_k3_paths())
    paths["MI355X"] = paths["MI355X"].model_copy(update={
        "runnable": False, "experts_in_memory": "none", "path": "no kernel for this test"})
    del paths["B300"]
    monkeypatch.setattr(k3_paths, "packaged_paths", lambda: paths)
    with pytest.raises(NotServable) as refused:
        _describe("MI355X", 1)
    message = str(refused.value)
    assert isinstance(refused.value, CapacityError)
    assert message.startswith("Kimi-K3 on MI355X: not servable by SGLang 0.5.23: no kernel")
    assert SOURCE_LINE.search(message)
    with pytest.raises(NotServable, match=r"B300: not servable: no SGLang 0\.5\.23 path"):
        _describe("B300", 1)
    # The CLI says the same and writes nothing.
    result = CliRunner().invoke(app, ["emit", "--gpu", "B300", "--nodes", "1", "--context",
                                      "1M", "--out-dir", "/nonexistent/never"])
    assert result.exit_code == 2 and "not servable" in result.output


def test_the_mi300x_variant_is_the_planners_smallest_mi300x_fleet(env):
    """deployments/variants/kimi_dspark_mi300x.yaml: no MI300X layout of fewer nodes holds K3's
    BF16 experts + DSpark + one 1M-token request (5 nodes: no TP over 40 GPUs divides 96
    heads), and the variant is the cheapest 6-node row the planner ranks."""
    from sglang_helpers import ROOT, generator

    from capacity.targets import default_targets

    k3, draft, gpus, prices = env
    result = plan(k3, gpus, prices, MIB_1M, draft, allowed_gpus=["MI300X"],
                  targets=default_targets(MIB_1M), levers=True)
    smallest = min(r.layout.nodes for r in result.rows)
    assert smallest == 6
    cheapest = next(r for r in result.rows if r.layout.nodes == smallest)
    variant = generator().MI300X
    desc = variant.description
    assert (desc.nodes, desc.tp, desc.attention_dp, desc.ep) == (
        cheapest.layout.nodes, cheapest.layout.tp, cheapest.layout.attention_dp,
        cheapest.layout.ep)
    assert desc.sglang["max_running_requests"] >= 1
    text = (ROOT / variant.file).read_text()
    assert "bf16 experts / Triton" in text and "--weights bf16" in text


def test_shipped_amd_files_set_the_aiter_switch_their_path_needs():
    """SGLANG_USE_AITER decides the ROCm path (srt/layers/quantization/mxfp4.py:200,
    1443-1446): on for MI355X's MXFP4 AITER MoE, off for MI300X's BF16 Triton one; the Serve
    file's runtime_env carries it, the NVIDIA files carry nothing of it."""
    import yaml
    from sglang_helpers import ROOT

    def env(rel: str) -> dict[str, str]:
        data = yaml.safe_load((ROOT / rel).read_text())
        return data["applications"][0]["runtime_env"]["env_vars"]

    assert env("deployments/variants/kimi_dspark_mi355x.yaml")["SGLANG_USE_AITER"] == "1"
    assert env("deployments/variants/kimi_dspark_mi300x.yaml")["SGLANG_USE_AITER"] == "0"
    for rel in ("deployments/kimi_dspark.yaml", "deployments/variants/kimi_dspark_b300.yaml"):
        assert "SGLANG_USE_AITER" not in env(rel)
    assert load_k3_paths()["MI355X"].env_vars() == {"SGLANG_USE_AITER": "1"}
