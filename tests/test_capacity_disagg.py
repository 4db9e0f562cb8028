"""Aggregated vs prefill/decode-disaggregated fleets (capacity/disagg.py): every row meets the
targets it was asked for, a disaggregated decode runs without the prefill stalls an aggregated
replica pays, the hand-over bytes are what the reference engine moves, the replica mix is the
smallest within the slack of the best, and `plan --disagg` shows both modes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from capacity import describe_model, load_gpus, load_prices
from capacity.cli import app
from capacity.disagg import MIX_SLACK, Targets, _mix, _Side, compare, handoff_bytes
from capacity.formats import KvDtype


@pytest.fixture(scope="module")
def env():
    return (describe_model("kimi-k3"), describe_model("kimi-k3-dspark"), load_gpus(),
            load_prices())


TARGETS = Targets(input_tokens=32_768, output_tokens=2_048, ttft_s=5.0, itl_s=0.03)


@pytest.fixture(scope="module")
def rows(env):
    k3, draft, gpus, prices = env
    return compare(k3, gpus, prices, TARGETS, draft, allowed_gpus=["H200", "MI355X"],
                   kv_dtypes=[KvDtype.FP8], max_nodes=3)


def test_every_row_meets_the_targets_and_rows_rank_by_cost(rows) -> None:
    assert {r.mode for r in rows} == {"agg", "disagg"}
    for r in rows:
        assert r.ttft_s <= TARGETS.ttft_s and r.itl_s <= TARGETS.itl_s
        assert r.requests_s > 0 and r.gpus > 0
    costs = [r.usd_per_million_tokens for r in rows if r.usd_per_million_tokens is not None]
    assert costs == sorted(costs) and len(costs) > 10


def test_a_disaggregated_decode_pays_no_prefill_stall(rows, env) -> None:
    """The same layout decodes with a shorter gap between tokens when it never prefills, and a
    disaggregated TTFT is its prefill plus the transfer of the hand-over over one NIC."""
    agg = {r.decode: r for r in rows if r.mode == "agg"}
    compared = 0
    for r in rows:
        if r.mode == "disagg" and r.decode in agg and r.decode_concurrency >= agg[
                r.decode].decode_concurrency:
            assert r.itl_s < agg[r.decode].itl_s
            compared += 1
        if r.mode == "disagg":
            nic = env[2][r.decode.gpu].scale_out_gbps * 1e9 / 8
            assert r.transfer_s == pytest.approx(r.handoff_bytes / nic)
            assert r.ttft_s > r.transfer_s
    assert compared > 0


def test_tighter_targets_keep_fewer_fleets(env) -> None:
    k3, draft, gpus, prices = env
    loose = compare(k3, gpus, prices, Targets(32_768, 2_048), draft, allowed_gpus=["H200"],
                    max_nodes=2)
    # compare() adds prefill replicas to meet a TTFT, so a bound only removes the fleets that
    # cannot reach it at all: 3.5 s / 15 ms keeps 4 of the 18 H200 fleets (at the constants of
    # the 20-anchor fit).
    tight = compare(k3, gpus, prices, Targets(32_768, 2_048, 3.5, 0.015), draft,
                    allowed_gpus=["H200"], max_nodes=2)
    assert 0 < len(tight) < len(loose)
    assert all(r.itl_s <= 0.015 and r.ttft_s <= 3.5 for r in tight)
    assert compare(k3, gpus, prices, Targets(32_768, 2_048, 0.001, None), draft,
                   allowed_gpus=["H200"], max_nodes=2) == []


def test_the_hand_over_bytes_are_what_the_engine_moves(tmp_path) -> None:
    """The planner's per-request hand-over (MLA latents per prompt token, one KDA state, the
    draft's context rows) against the reference engine's export of the same mini K3, which
    keeps every cache in fp32 (the planner's bf16 is half of it per token; SGLang's bf16
    conv / fp32 SSM state is the engine's with conv_bytes 4)."""
    from spec_helpers import engine_from, prefill_for_handoff
    from tiny_models import tiny_k3_config, write_random_k3_pair

    from capacity.families import descriptor_from_config
    from serve_app.engines.reference.sampling import SamplingParams

    target, draft = write_random_k3_pair(tmp_path, tiny_k3_config(256))
    model = descriptor_from_config(json.loads((target / "config.json").read_text()), "mini", "t")
    draft_model = descriptor_from_config(json.loads((draft / "config.json").read_text()),
                                         "mini-dspark", "t")
    engine = engine_from((target, draft))
    moved = {}
    for n in (20, 52):
        rid = prefill_for_handoff(engine, list(range(1, n + 1)),
                                  SamplingParams(temperature=0.0, max_tokens=4))
        moved[n] = engine.export(rid).nbytes
    per_token = (moved[52] - moved[20]) / 32
    planned = handoff_bytes(model, draft_model, 1, KvDtype.BF16) - model.kda_state_bytes()
    assert per_token == 2 * planned
    assert moved[20] - 20 * per_token == model.kda_state_bytes(conv_bytes=4, ssm_bytes=4)


def test_the_mix_is_the_smallest_fleet_near_the_best() -> None:
    from capacity.config import Layout

    layout = Layout(gpu="H200", nodes=1, tp=8, ep=8)
    prefill, decode = _Side(layout, 1, 10.0, 0.1), _Side(layout, 8, 0.02, 0.35)
    n_p, n_d, served = _mix(prefill, decode)
    assert served == pytest.approx(min(n_p * 0.1, n_d * 0.35))
    best = max(min(p * 0.1, d * 0.35) / (p + d) for p in range(1, 65) for d in range(1, 65))
    assert served / (n_p + n_d) >= (1 - MIX_SLACK) * best
    # 3 prefills : 1 decode serve 0.075 requests/s per replica, 96% of the best mix (63 : 18).
    assert (n_p, n_d) == (3, 1)
    assert _mix(_Side(layout, 1, 1000.0, 0.001), decode) is None  # > 64 prefills per decode


def test_plan_disagg_shows_both_modes() -> None:
    result = CliRunner().invoke(app, [
        "plan", "--draft", "kimi-k3-dspark", "--context", "32K", "--gpus", "H200",
        "--max-nodes", "2", "--disagg", "--output-tokens", "2048", "--ttft", "5",
        "--itl", "30", "--json", "--top", "4"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    modes = [r["mode"] for r in data["rows"]]
    assert "agg" in modes and "disagg" in modes and len(modes) == 4
    assert data["targets"]["input_tokens"] == 32 * 1024 - 2048
    bad = CliRunner().invoke(app, ["plan", "--context", "4K", "--disagg",
                                   "--output-tokens", "8192"])
    assert bad.exit_code != 0 and "leaves no prompt" in bad.output


def test_dspark_pipeline_stages_only_on_a_pd_prefill_side(env) -> None:
    """SGLang 0.5.23 runs DSpark with pipeline stages only on a PD prefill server: with the
    draft, no aggregated or decode layout has PP, while prefill sides may (the 1M flagship's
    comparison offers one); without a draft, PP is offered everywhere. The app's start-up
    check asks the same rule."""
    from capacity.sglang_recipe import pipeline_problem

    k3, draft, gpus, prices = env
    targets = Targets(1_040_384, 8192, ttft_s=1200.0, itl_s=0.05)
    with_draft = compare(k3, gpus, prices, targets, draft, allowed_gpus=["H200"], max_nodes=2,
                         kv_dtypes=(KvDtype.FP8,))
    assert with_draft and all(r.decode.pp == 1 for r in with_draft)
    assert any(r.mode == "disagg" and r.prefill.pp > 1 for r in with_draft)
    plain = compare(k3, gpus, prices, targets, None, allowed_gpus=["H200"], max_nodes=2,
                    kv_dtypes=(KvDtype.FP8,))
    assert any(r.decode.pp > 1 for r in plain)
    assert pipeline_problem(2, True, "prefill") is None
    assert "PD prefill" in pipeline_problem(2, True, "decode")
    assert pipeline_problem(2, False, "both") is None and pipeline_problem(1, True) is None
