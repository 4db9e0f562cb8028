"""Every benchmark in bench/ run end to end at a tiny size, so that a change which breaks one
fails here. Each runs as its own process (`python bench/<name>.py ... --json <tmp>`), as its
README row does; the test checks that it exits 0 and that its report holds the variants and
the numbers it promises. Speed is the benches' to measure: nothing here bounds a time.

The benches that start a Ray cluster of their own (autoscaling, disaggregation, prefix_cache,
serve_overhead) run while this process holds none (`no_ray_here`); conftest.py keeps the
module with the own-cluster ones, on the xdist worker that never holds the shared cluster.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Four of the benches start a Ray cluster of their own.
pytestmark = pytest.mark.ray_cluster("own")

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str) -> str:
    """Run `script` (a path under the repository root) with `args`; its stdout. The timeout
    only keeps a hung bench from hanging the suite."""
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (f"{script} exited {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc.stdout


def json_line(stdout: str) -> dict[str, Any]:
    """The report a bench prints as its last JSON line."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in:\n{stdout[-2000:]}"
    return json.loads(lines[-1])


def same(a: Any, b: Any) -> bool:
    """Equal reports (NaN equal to NaN: a tiny run may have none of some kind of sample)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def line_and_file(stdout: str, path: Path) -> dict[str, Any]:
    """The printed JSON line, checked equal to the --json file."""
    report = json_line(stdout)
    assert same(report, json.loads(path.read_text()))
    return report


@pytest.fixture
def no_ray_here() -> None:
    """The bench starts its own cluster: this process must hold none meanwhile (the shared one
    is started again by the next module that wants it)."""
    from tiny_models import stop_ray

    stop_ray()


def test_planner_sweep() -> None:
    report = json_line(run_bench("bench/planner_sweep.py", "--repeats", "1"))
    assert report["bench"] == "planner_sweep"
    assert report["layouts_evaluated"] > report["feasible"] > 0
    per_context = report["feasible_per_context"]
    assert set(per_context) == {"8192", "131072", "1048576"}
    assert sum(per_context.values()) == report["feasible"]
    assert len(report["seconds_all"]) == 1 and positive(report["seconds_best"])


def test_prefix_cache_scaling(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    report = line_and_file(run_bench("bench/prefix_cache_scaling.py", "--repeats", "2",
                                     "--nodes", "10", "100", "--json", str(out)), out)
    rows = {(r["variant"], r["nodes"]): r for r in report["rows"]}
    assert set(rows) == {(v, n) for v in ("kept", "walk") for n in (10, 100)}
    for r in rows.values():
        assert all(positive(r[k]) for k in ("admit_us", "stats_us", "evict_us")), r
    assert set(report["kept_growth_10_to_100"]) == {"admit_us", "stats_us", "evict_us"}


def test_k3_model(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    report = line_and_file(run_bench("bench/k3_model.py", "--prompt", "16", "--repeats", "1",
                                     "--json", str(out)), out)
    assert report["prompt_tokens"] == 16 and report["repeats"] == 1
    assert set(report["prefill_tok_s"]) == {"k3_chunked", "k3_recurrent", "k2"}
    for key in ("prefill_tok_s", "decode_ms", "verify_ms"):
        assert all(positive(v) for v in report[key].values()), report[key]
    assert set(report["decode_ms"]) == set(report["verify_ms"]) == {"k3", "k2"}
    assert all(len(v) == 1 for v in report["times_s"].values())
    # The K2-shaped target is sized to land near the mini K3's parameter count.
    assert report["params"]["k2"] == pytest.approx(report["params"]["k3"], rel=0.1)
    state = report["state"]
    assert state["k3_kda_layers"] + state["k3_mla_layers"] == state["k2_layers"]
    assert 0 < state["k3_kv_bytes_per_token"] < state["k2_kv_bytes_per_token"]


def test_vision_prefill(tmp_path: Path) -> None:
    """The embedded target's tower on two image sizes, beside text prefill of as many tokens."""
    out = tmp_path / "out.json"
    report = line_and_file(run_bench("bench/vision_prefill.py", "--sizes", "56x56,112x84",
                                     "--repeats", "1", "--json", str(out)), out)
    rows = report["rows"]
    assert [r["size"] for r in rows] == ["56x56", "112x84"]
    # K3's resize leaves multiples of 28 as they are: 4 and 12 tokens (2x2 patches each).
    assert [(r["grid_thw"], r["tokens"]) for r in rows] == [([1, 4, 4], 4), ([1, 6, 8], 12)]
    for r in rows:
        assert all(positive(r[k]) for k in ("preprocess_ms", "tower_ms", "text_prefill_ms",
                                            "image_prefill_ms", "tower_vs_text")), r


def test_dspark_load(tmp_path: Path) -> None:
    """The full-size run's steps (write, strict memory-mapped load, one draft step) on the
    mini draft's config instead of the 4.5 GB published one."""
    from serve_app.models.dspark import expected_tensors
    from serve_app.models.dspark_config import DSparkConfig

    config = ROOT / "serve_app/assets/kimi-k3-mini-dspark/config.json"
    out = tmp_path / "out.json"
    report = line_and_file(run_bench("bench/dspark_load.py", "--config", str(config),
                                     "--contexts", "64", "--repeats", "1", "--json", str(out)),
                           out)
    load = report["load"]
    bf16_bytes = 2 * sum(math.prod(spec.shape)
                         for spec in expected_tensors(DSparkConfig.from_file(config)).values())
    assert bf16_bytes <= load["file_bytes"] < bf16_bytes + 1_000_000  # + the header
    assert positive(load["load_s"]) and math.isfinite(load["checksum"])
    assert load["peak_rss_bytes"] >= load["baseline_rss_bytes"] > 0
    assert set(report["draft_step"]) == {"64"}
    assert positive(report["draft_step"]["64"]["median_s"])


def test_spec_decode_embedded(tmp_path: Path) -> None:
    """Target-only vs speculative on the embedded pair: greedy (outputs identical), at K3's
    thinking parameters, and two requests together (the three concurrency variants)."""
    out = tmp_path / "out.json"
    run_bench("bench/spec_decode.py", "--max-tokens", "4", "--repeats", "1",
              "--completion-prompts", "1", "--chat-prompts", "1",
              "--k3-sampling", "k3-thinking", "--concurrency", "1", "2", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["pair"] == "embedded" and report["prompts"] == 2
    results = {r["sampling"]: r for r in report["results"]}
    assert set(results) == {"greedy", "k3-thinking"}
    assert results["greedy"]["lossless_identical"] is True
    assert all(p["identical"] for p in results["greedy"]["per_prompt"])
    for r in results.values():
        for mode in ("target_only_tok_s", "speculative_tok_s"):
            assert positive(r[mode]["median"]) and positive(r[mode]["aggregate"]), r[mode]
        assert r["spec_accept_length"]["macro"] >= 1
        assert {"verify_forward", "draft_propose", "commit"} <= set(
            r["call_times"]["speculative"])
    rows = report["concurrency"]["rows"]
    # One request at a time still runs both prompts (the levels below 8 run 8 requests or
    # every prompt there is, c at a time).
    assert [(row["sampling"], row["concurrency"], row["requests"]) for row in rows] == [
        ("greedy", 1, 2), ("greedy", 2, 2), ("k3-thinking", 1, 2), ("k3-thinking", 2, 2)]
    for row in rows:
        assert all(positive(row[k])
                   for k in ("target_only_tok_s", "always_on_tok_s", "adaptive_tok_s"))
        low, high = row["adaptive_speedup_range"]
        assert low <= high and positive(low)
        # A planned step gives each running request a window (one or two: the requests can
        # finish a step apart).
        steps = row["adaptive_speculative_steps"]
        assert steps <= sum(row["adaptive_draft_histogram"]) <= 2 * steps
        assert row["adaptive_speculative_steps"] + row["adaptive_plain_steps"] > 0
    # The model cards quote this report (`python -m serve_app.training cards --bench-json`).
    from serve_app.training.cards import bench_lines

    card = "\n".join(bench_lines(report))
    assert "| k3-thinking | 2 | 2 |" in card and "| greedy (T 0.0, top_p 1.0) |" in card


def test_spec_decode_random_k3(tmp_path: Path) -> None:
    """The K3 hybrid's two KDA rollback strategies beside target-only: both lossless."""
    out = tmp_path / "out.json"
    stdout = run_bench("bench/spec_decode.py", "--pair", "random-k3", "--max-tokens", "8",
                       "--repeats", "1", "--k3-prompts", "1", "--prompt-min", "16",
                       "--prompt-max", "16", "--json", str(out))
    report = line_and_file(stdout, out)
    (result,) = report["results"]
    variants = result["variants"]
    assert set(variants) == {"target_only", "scratch", "replay"}
    for name, v in variants.items():
        assert positive(v["tok_s"]["aggregate"]), name
        if name != "target_only":
            assert v["lossless_identical"] is True, name
            assert v["spec_accept_length"] >= 1 and v["spec_verify_ct"] > 0
    assert set(report["planner"]["strategies"]) == {"scratch", "replay"}


def test_router_simulator(tmp_path: Path) -> None:
    """bench/router_simulator.py, the simulator bench/router_sim.py (and bench/prefix_cache.py)
    run: the bench's table at one rate, and its kv_aware row equal to the simulator's own for
    the same fleet and workload (the simulator is deterministic)."""
    out = tmp_path / "out.json"
    run_bench("bench/router_sim.py", "--rates", "1", "--duration", "60", "--replicas", "2",
              "--no-plots", "--json", str(out))
    report = json.loads(out.read_text())
    rows = {r["policy"]: r for r in report["rows"]}
    assert set(rows) == {"round_robin", "power_of_two", "cache_aware", "kv_aware"}
    assert all(r["rate"] == 1 and r["goodput_rps"] >= 0 for r in rows.values())
    (ratio,) = report["vs_best_baseline"]
    assert positive(ratio["goodput_ratio"])

    # Imported by path, as the bench imports it from beside itself (bench/ is no package).
    spec = importlib.util.spec_from_file_location("bench_router_simulator",
                                                  ROOT / "bench/router_simulator.py")
    assert spec is not None and spec.loader is not None
    sim = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sim  # its dataclasses look their module up while defined
    spec.loader.exec_module(sim)
    from serve_app.routing.policy import RouterSettings

    (row,), _ = sim.run_policies(["kv_aware"], [1.0], sim.FleetSpec(replicas=2),
                                 sim.WorkloadSpec(duration_s=60.0, seed=0),
                                 RouterSettings(share_prefix=True), sim.SLO())
    assert same(row, rows["kv_aware"])


@pytest.mark.slow
def test_disaggregation(tmp_path: Path, no_ray_here: None) -> None:
    """Aggregated and disaggregated apps, one stream and one ~400-token prompt, one round."""
    out = tmp_path / "out.json"
    report = line_and_file(run_bench("bench/disaggregation.py", "--streams", "1",
                                     "--long-chars", "1500", "--quiet-s", "2.5", "--rounds", "1",
                                     "--json", str(out)), out)
    assert report["rounds"] == 1 and report["long_prompt_tokens"] > 0
    for variant in ("aggregated", "disaggregated"):
        r = report[variant]
        [[quiet, during]] = r["gaps_per_round"]
        # The stream decoded before the long prompt arrived and while it was prefilled.
        assert quiet > 0 and during > 0, (variant, r)
        assert positive(r["long_ttft_s"]), (variant, r)
        assert all(positive(r[k]) for k in ("quiet_p50_ms", "quiet_p99_ms", "during_p50_ms",
                                            "during_p99_ms", "p99_ratio")), (variant, r)


@pytest.mark.slow
def test_prefix_cache(tmp_path: Path, no_ray_here: None) -> None:
    """The four apps (cache off / on, 2 replicas under kv_aware and power_of_two), two
    questions about a document long enough that the second hits a checkpoint of the first."""
    out = tmp_path / "out.json"
    report = line_and_file(run_bench("bench/prefix_cache.py", "--questions", "2",
                                     "--doc-tokens", "300", "--max-tokens", "4",
                                     "--sim-seeds", "2", "--json", str(out)), out)
    variants = report["variants"]
    assert set(variants) == {"a", "b", "c", "d"}
    for name, v in variants.items():
        assert v["ttft"]["n"] == 2 and positive(v["ttft"]["p50_ms"]), name
        assert v["prompt_tokens"] > 0, name
        assert sum(v["requests_per_replica"].values()) == 2, name
    assert variants["a"]["cached_tokens"] == 0
    assert variants["b"]["cached_tokens"] > 0 and 0 < variants["b"]["hit_rate"] < 1
    assert all(positive(x) for x in report["ratios"].values())
    for policy in ("kv_aware", "power_of_two"):
        assert 0 <= report["simulator"][policy]["hit_rate"] <= 1
    assert isinstance(report["agreement"]["agree"], bool)


@pytest.mark.slow
def test_autoscaling(tmp_path: Path, no_ray_here: None) -> None:
    """A short load step under both policies: the ledger policy scales the embedded
    deployment up for the step's KV demand and back to one after it, no request fails under
    either, and the request-count policy sees too few requests to scale (the step's demand
    waits in the router's queue, where it does not count them). Disaggregated, a step of
    long prompts grows the prefill pool alone: they wait in its queue, and the decode pool
    does not count the room it holds for them meanwhile."""
    out = tmp_path / "out.json"
    report = line_and_file(run_bench(
        "bench/autoscaling.py", "--step-clients", "10", "--base-s", "2", "--step-s", "8",
        "--tail-s", "30", "--max-tokens", "160", "--max-replicas", "2",
        "--downscale-delay-s", "2", "--long-clients", "6", "--long-prompt-tokens", "512",
        "--variants", "ledger,ray_requests,pd_long_prompts", "--json", str(out)), out)
    variants = report["variants"]
    ledger, requests = variants["ledger"]["target"], variants["ray_requests"]["target"]
    prefill, decode = variants["pd_long_prompts"]["prefill"], variants["pd_long_prompts"]["decode"]
    assert ledger["replicas_max"] == 2 and positive(ledger["time_to_scale_up_s"])
    assert ledger["time_back_to_one_s"] is not None
    assert requests["replicas_max"] == 1 and requests["time_to_scale_up_s"] is None
    # The prefill pool's decision (its new replica may still be starting as the step ends).
    assert positive(prefill["time_to_scale_up_s"]), prefill
    assert decode["replicas_max"] == 1 and decode["time_to_scale_up_s"] is None, decode
    for v in (ledger, requests, prefill):
        assert v["failed"] == 0 and v["completed"] >= v["step_requests"] > 0, v
        assert positive(v["step_ttft_p99_s"]) and v["step_ttft_p99_s"] >= v["step_ttft_p50_s"]


@pytest.mark.slow
def test_serve_overhead(tmp_path: Path, no_ray_here: None) -> None:
    """Engine, echo floor, the HTTP path, stand-in floor and stub, streaming, tracing on and
    off: two requests each."""
    out = tmp_path / "out.json"
    report = line_and_file(run_bench("bench/serve_overhead.py", "--requests", "2",
                                     "--stream-tokens", "2", "--stub-ms", "1",
                                     "--json", str(out)), out)
    summaries = [report[k] for k in ("engine", "echo", "http", "work_floor", "stub")]
    summaries += [report["tracing"]["off"], report["tracing"]["on"]]
    for s in summaries:
        assert s["n"] == 2 and positive(s["p50_ms"]) and s["p99_ms"] >= s["p50_ms"], s
    stream = report["stream"]
    assert stream["engine"]["chunks"] == 2 and stream["http"]["chunks"] >= 2
    assert positive(stream["http"]["ttft_ms"]) and positive(stream["engine"]["ttft_ms"])
    assert math.isfinite(report["ingress_code_p50_ms"])
    assert positive(report["tracing"]["p50_ratio"])
