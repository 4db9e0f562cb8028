"""Every benchmark in bench/ run end to end at a tiny size, so that a change which breaks one
fails here. Each runs as its own process (`python bench/<name>.py ... --json <tmp>`, through
tests/bench_runner.py), as its README row does; the test checks that it exits 0 and that its
report holds the variants and the numbers it promises. Speed is the benches' to measure:
nothing here bounds a time.

This module holds the benches that start no Ray cluster; those that start one of their own are
in tests/test_benches_ray.py, and those that drive a running server are run against the
server of the module that starts one (tests/test_fuzz_api.py, tests/test_grammar_serve.py).
`test_every_bench_script_runs_in_the_suite` keeps it that way for every new script.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
from bench_runner import ROOT, json_line, line_and_file, positive, run_bench, same


def test_every_bench_script_runs_in_the_suite() -> None:
    """Each script in bench/ (a file that runs as __main__; bench/router_simulator.py is the
    simulator the others import) is run by some test, through run_bench."""
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")
               if 'if __name__ == "__main__":' in p.read_text()}
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    smoked = set(re.findall(r'run_bench\(\s*"bench/(\w+\.py)"', tests))
    assert "spec_decode.py" in scripts and "router_simulator.py" not in scripts
    assert scripts - smoked == set(), "bench scripts no test runs"


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


def test_grammar(tmp_path: Path) -> None:
    """Compile times over the first walle schemas in the three sets, then the mask cost on the
    embedded pair: every mode and grammar, speculation lossless under each."""
    out = tmp_path / "out.json"
    report = line_and_file(run_bench("bench/grammar.py", "--schemas", "6", "--prompts", "2",
                                      "--chat-prompts", "1", "--max-tokens", "6", "--batch",
                                      "2", "--repeats", "1", "--json", str(out)), out)
    assert report["bench"] == "grammar"
    compiled = report["compile"]
    assert set(compiled) == {"k3-tool", "plain", "plain-k3vocab"}
    for name, row in compiled.items():
        assert row["schemas"] == 6 and row["grammar_errors"] == 0, (name, row)
        assert positive(row["p50_ms"]) and row["max_ms"] >= row["p50_ms"], (name, row)
    assert compiled["plain"]["vocab"] == 4096 and compiled["k3-tool"]["vocab"] == 163_840
    mask = report["mask"]
    assert set(mask["modes"]) == {"spec_off", "spec_on", "close_off", "close_on"}
    assert mask["lossless_all"] is True and len(mask["lossless"]) == 10
    for mode in mask["modes"].values():
        assert mode["free"]["masks_per_step"] == 0
        assert all(positive(row["step_ms"]) for row in mode.values()), mode
    for per_vocab in mask["mask_ms_per_mask_by_vocab"].values():
        assert set(per_vocab) == {"4096", "163840"} and all(map(positive, per_vocab.values()))


def test_collectives(tmp_path: Path) -> None:
    """gloo and the shared-memory group, each operation and a TP-2 engine's decode."""
    out = tmp_path / "out.json"
    report = line_and_file(run_bench("bench/collectives.py", "--world", "2", "--ops", "50",
                                     "--rounds", "1", "--requests", "1", "--tokens", "4",
                                     "--json", str(out)), out)
    assert report["world"] == 2 and set(report["variants"]) == {"gloo", "shared memory"}
    for name, v in report["variants"].items():
        assert set(v["ops"]) == {"all_reduce 64 floats", "all_reduce 1M floats",
                                 "step broadcast"}, name
        assert all(positive(op["wall_us"]) for op in v["ops"].values()), (name, v)
        assert v["decode_tp2"]["tokens"] == 4 and positive(v["decode_tp2"]["ms_per_token"])
    assert positive(report["decode_speedup"])
