"""The benches that start a Ray cluster of their own (autoscaling, disaggregation,
prefix_cache, serve_overhead), end to end at a tiny size, as tests/test_benches.py runs the
others. Each runs while this process holds no cluster (`no_ray_here`); conftest.py keeps the
module with the own-cluster ones, on the xdist worker that never holds the shared cluster.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from bench_runner import line_and_file, positive, run_bench

pytestmark = pytest.mark.ray_cluster("own")


@pytest.fixture
def no_ray_here() -> None:
    """The bench starts its own cluster: this process must hold none meanwhile (the shared one
    is started again by the next module that wants it)."""
    from tiny_models import stop_ray

    stop_ray()


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
    does not count the room it holds for them meanwhile, and the prefill pool comes back to
    one after the step."""
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
    # The prefill pool's decision (its new replica may still be starting as the step ends),
    # and its way back to one replica placed, after the second (measured: 5.4 s after the
    # step; the new replica served from 0.5 s after it).
    assert positive(prefill["time_to_scale_up_s"]), prefill
    timeline = prefill["timeline"]  # (when, serving, placed) at each change
    assert max(p for _, _, p in timeline) == 2 and timeline[-1][1:] == [1, 1], prefill
    assert positive(prefill["time_back_to_one_s"]), prefill
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
