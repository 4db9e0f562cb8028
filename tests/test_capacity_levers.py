"""SGLang 0.5.23's K3 levers in the planner: each lever's memory against a hand computation from
SGLang's own formulas (file:line in the sglang 0.5.23 wheel's `sglang/srt/`), the default
latency targets and the Pareto marking of `plan`, and the levers' account in the emitted
production files' headers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from capacity.config import Layout, Workload
from capacity.errors import CapacityError
from capacity.families import describe_model
from capacity.model import Component
from capacity.tables import load_gpus, load_prices

ROOT = Path(__file__).resolve().parent.parent
K3 = describe_model("kimi-k3")
DRAFT = describe_model("kimi-k3-dspark")
GPUS = load_gpus()
MIB_1M = 1_048_576
# One KDA state slot per GPU at attention TP 8, by hand from K3's config (69 KDA layers, 96
# heads x 128, conv kernel 4 over q, k, v): SSM 96/8 x 128 x 128 x 4 B (float32) = 786,432 B and
# conv (4 - 1) x 3 x 96 x 128 / 8 x 2 B (BF16) = 27,648 B per layer.
SLOT_TP8 = (96 // 8 * 128 * 128 * 4 + 3 * 3 * 96 * 128 // 8 * 2) * 69
# MLA latent per token over the 24 MLA layers, BF16: (512 + 64) x 2 B x 24.
MLA_TOKEN_BF16 = (512 + 64) * 2 * 24


def test_extra_buffer_lazy_slots_and_running_requests() -> None:
    """extra_buffer_lazy: SGLang's `_calculate_mamba_ratio` (mem_cache/kv_cache_configurator.py:
    3062-3092) = MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO 3 (:227) + get_mamba_tracking_slots
    (mem_cache/allocation_sizing.py:11-19): 2 for extra_buffer under the overlap scheduler, 1
    for extra_buffer_lazy. max_mamba_cache_size = ratio x max_running_requests (the cap check,
    kv_cache_configurator.py:3134-3150). With DSPARK's scratch verify (D = 8 states per
    request, :3360-3374) one running request holds (ratio + D) slots; the pools' padding is one
    slot + one verify row (D slots). Hand: on 1 x 8 B300 TP8, BF16 KV, 1M tokens,
    R = min(48, floor((free - padding - kv) / ((ratio + 8) x slot)))."""
    from capacity.memory import mamba_slots_per_request, running_fit

    assert mamba_slots_per_request("extra_buffer") == 5
    assert mamba_slots_per_request("extra_buffer_lazy") == 4
    with pytest.raises(CapacityError, match="no_buffer"):
        mamba_slots_per_request("no_buffer")
    base = Layout(gpu="B300", nodes=1, tp=8, ep=8)
    fits = {}
    for strategy, ratio in (("extra_buffer", 5), ("extra_buffer_lazy", 4)):
        fit = running_fit(K3, base.model_copy(update={"mamba_strategy": strategy}),
                          GPUS["B300"], MIB_1M, DRAFT)
        assert fit.rollback is not None and fit.rollback.state_slot_bytes == SLOT_TP8
        assert fit.state_bytes_per_request == (ratio + 8) * SLOT_TP8
        assert fit.state_padding_bytes == (1 + 8) * SLOT_TP8
        by_hand = min(48, (fit.free_bytes - 9 * SLOT_TP8 - fit.full_request_kv_bytes)
                      // ((ratio + 8) * SLOT_TP8))
        assert fit.max_running_requests == by_hand
        assert fit.mamba_cache_slots == ratio * by_hand
        fits[strategy] = fit
    # 674 MB per running request instead of 730: one more request in the same memory here.
    assert fits["extra_buffer_lazy"].state_bytes_per_request == 674_058_240
    assert (fits["extra_buffer_lazy"].max_running_requests
            == fits["extra_buffer"].max_running_requests + 1 == 22)


def test_hicache_host_tier_by_hand() -> None:
    """HiCache: a rank's host budget is (host RAM - 10 GiB, HICACHE_HOST_MEMORY_RESERVE_BYTES,
    mem_cache/pool_host/base.py:28) // ranks on the host (base.py:104-108) x
    --hicache-host-memory-fraction 0.8; the default ratio 2.0 (arg_groups/hicache_hook.py:
    119-122) is cut to budget x (1 - 0.05) / device pool bytes (hicache_auto_size.py:33,
    94-97); each device pool gets ratio x its size on the host
    (hybrid_cache/hybrid_pool_assembler.py:1319-1356)."""
    from capacity.memory import hicache_budget_per_rank, hicache_host, hicache_ratio

    h200 = GPUS["H200"]
    assert h200.host_ram_gb == 2000
    budget = int((2000 * 10**9 - 10 * 1024**3) // 8 * 0.8)
    assert hicache_budget_per_rank(h200, 8) == budget == 198_926_258_176
    assert hicache_ratio(h200, 8, 20 * 10**9) == 2.0  # 2 TB holds the default ratio
    small = h200.model_copy(update={"host_ram_gb": 200.0})
    small_budget = (200 * 10**9 - 10 * 1024**3) // 8 * 0.8
    ratio = math.floor(small_budget * 0.95 / (20 * 10**9) * 100) / 100
    assert ratio == 0.89
    assert hicache_ratio(small, 8, 20 * 10**9) == ratio
    tier = hicache_host(Layout(gpu="H200", nodes=2, tp=16, ep=16, hicache_ratio=ratio), small,
                        20 * 10**9)
    assert tier is not None and tier.fits
    assert tier.host_bytes_per_rank == int(0.89 * 20 * 10**9)
    over = hicache_host(Layout(gpu="H200", nodes=2, tp=16, ep=16, hicache_ratio=2.0), small,
                        20 * 10**9)
    assert over is not None and not over.fits
    # Unknown host RAM (B300: no published system in gpus.csv): no tier is planned.
    assert GPUS["B300"].host_ram_gb is None
    assert hicache_ratio(GPUS["B300"], 8, 20 * 10**9) == 0.0


def test_dcp_splits_the_mla_kv_by_hand() -> None:
    """Decode context parallelism: the radix tree pages at page_size x dcp
    (arg_groups/overrides.py:216-219, mem_cache/allocation_sizing.py:24-25) and each rank of
    the DCP group stores page_size rows of every logical page, a pool of N rows per rank
    holding N x dcp request tokens (mem_cache/kv_cache_configurator.py:403-415). With FlashMLA's
    64-token page, a request of L + D tokens (D = 8 verified positions) holds
    ceil((L + D) / (64 x dcp)) x 64 rows per rank, each 27,648 B (BF16, 24 MLA layers). The
    draft's KV is not split (a replicated draft, kv_cache_configurator.py:517-526)."""
    from capacity.memory import dcp_kv_tokens, memory_per_gpu

    tokens = MIB_1M + 8
    assert dcp_kv_tokens(tokens, 8) == math.ceil(tokens / 512) * 64 == 131_136
    assert dcp_kv_tokens(tokens, 1) == math.ceil(tokens / 64) * 64
    reports = {}
    for dcp in (1, 8):
        layout = Layout(gpu="B300", nodes=1, tp=8, ep=8, dcp=dcp)
        reports[dcp] = memory_per_gpu(K3, layout, Workload(context_length=MIB_1M,
                                                          kda_state_slots=4),
                                      GPUS["B300"], DRAFT).stages[0].per_request
    assert reports[8]["mla_kv"] == 131_136 * MLA_TOKEN_BF16 == 3_625_648_128
    assert reports[1]["mla_kv"] == 1_048_640 * MLA_TOKEN_BF16
    assert reports[8]["draft_kv"] == reports[1]["draft_kv"]
    assert reports[8]["kda_state"] == reports[1]["kda_state"] == 4 * SLOT_TP8
    # SGLang's groups are consecutive ranks of a TP group: dcp divides the attention TP.
    with pytest.raises(ValueError, match="dcp"):
        Layout(gpu="B300", nodes=1, tp=8, ep=8, attention_dp=4, dcp=4)


def test_eplb_redundant_experts_by_hand() -> None:
    """EPLB: E + R physical experts (eplb/expert_location.py:233-237), split evenly over the
    EP ranks, (E + R) / EP each (the assert at expert_location.py:256); each copy holds a whole
    expert. K3 (E = 896) on EP8 with R = 32: 116 experts per rank instead of 112."""
    from capacity.memory import memory_per_gpu

    routed = K3.bytes_by_component()[Component.ROUTED_EXPERTS]
    weights = {}
    for redundant in (0, 32):
        layout = Layout(gpu="B300", nodes=1, tp=8, ep=8, redundant_experts=redundant)
        weights[redundant] = memory_per_gpu(K3, layout, Workload(context_length=8192),
                                            GPUS["B300"], DRAFT).stages[0].weights
    assert weights[0]["routed_experts"] == math.ceil(routed * 112 / 896)
    assert weights[32]["routed_experts"] == math.ceil(routed * 116 / 896)
    assert weights[32]["attention"] == weights[0]["attention"]


def test_default_targets_per_context_class() -> None:
    from capacity.targets import default_targets, with_overrides

    long = default_targets(MIB_1M)
    assert (long.ttft_s, long.min_user_tokens_s) == (120.0, 20.0)
    assert default_targets(131_072).ttft_s == 20.0
    assert default_targets(8192).ttft_s == 2.0
    assert long.met(119.0, 20.0) and not long.met(121.0, 50.0) and not long.met(10.0, 19.9)
    mine = with_overrides(long, 300.0, None)
    assert (mine.ttft_s, mine.min_user_tokens_s, mine.context_class) == (300.0, 20.0, "custom")


@pytest.fixture(scope="module")
def plan_1m():
    from capacity.planner import plan
    from capacity.targets import default_targets

    return plan(K3, GPUS, load_prices(), MIB_1M, allowed_gpus=["H200", "B300", "GB300",
                                                                "MI300X", "MI355X"],
                targets=default_targets(MIB_1M), levers=True)


def test_plan_1m_top_row_meets_the_default_targets(plan_1m) -> None:
    """`kimi-capacity plan --context 1M` with no targets given: its first table's top row meets
    TTFT <= 120 s and 20 tok/s per user; the rows that miss them are kept, apart."""
    meeting, missing = plan_1m.meeting(), plan_1m.missing()
    assert meeting and missing
    assert len(meeting) + len(missing) == len(plan_1m.rows)
    top = meeting[0]
    assert top.prefill_s <= 120 and top.per_user_tokens_s >= 20
    assert all(not r.meets_targets and r.missed() for r in missing)
    # The cheapest row overall misses them (a minutes-long TTFT): it is not the top row.
    assert plan_1m.rows[0] in missing and plan_1m.rows[0].prefill_s > 120
    # The search ranks DCP layouts and HiCache layouts (where the node's host RAM is known).
    assert any(r.layout.dcp > 1 for r in plan_1m.rows)
    assert any(r.layout.hicache_ratio > 0 and r.host_sessions > 0 for r in plan_1m.rows)
    assert not any(r.layout.dcp > 1 for r in plan_1m.rows if r.layout.gpu in ("H200",
                                                                              "MI300X"))


def test_pareto_front_is_exactly_the_undominated_rows(plan_1m) -> None:
    rows = [r for r in plan_1m.rows if r.usd_per_million_tokens is not None]
    front = plan_1m.latency_front()

    def point(r):
        return (r.usd_per_million_tokens, r.prefill_s, -r.per_user_tokens_s)

    points = [point(r) for r in rows]
    for i, r in enumerate(plan_1m.rows):
        if r.usd_per_million_tokens is None:
            assert i not in front
            continue
        p = point(r)
        dominated = any(all(o <= x for o, x in zip(q, p, strict=True)) and q != p
                        for q in points)
        assert (i in front) == (not dominated)
    assert front


PRODUCTION = ("deployments/kimi_dspark.yaml", "deployments/variants/kimi_dspark_b300.yaml",
              "deployments/variants/kimi_dspark_mi355x.yaml",
              "deployments/variants/kimi_dspark_mi300x.yaml")


@pytest.mark.parametrize("rel", PRODUCTION)
def test_production_headers_name_each_lever_and_why(rel: str) -> None:
    """Each production file's header names every lever, on or off, with its reason, and the
    file's settings are the ones the header says."""
    import yaml

    text = (ROOT / rel).read_text()
    header = "\n".join(line.removeprefix("# ").removeprefix("#   ")
                       for line in text.split("\nproxy_location")[0].splitlines())
    flat = " ".join(header.split())
    for lever in ("mamba_radix_cache_strategy extra_buffer_lazy:",
                  "(decode context parallelism):", "enable_hierarchical_cache (HiCache host "
                  "tier):", "ep_num_redundant_experts (EPLB): off because",
                  "enable_unified_memory: off because"):
        assert lever in flat, (rel, lever)
    args = yaml.safe_load(text)["applications"][0]["args"]
    s, p = args["engine"]["sglang"], args["parallelism"]
    assert "extra_buffer_lazy: on because" in flat and s["mamba_radix_cache_strategy"] == \
        "extra_buffer_lazy"
    dcp = p.get("dcp", 1)
    assert (f"dcp_size {dcp} (decode context parallelism): on because" in flat) == (dcp > 1)
    hicache = s.get("enable_hierarchical_cache", False)
    assert ("(HiCache host tier): on because" in flat) == hicache
    if rel.endswith("b300.yaml") or rel.endswith("mi355x.yaml"):
        assert dcp == 8 and s["decode_attention_backend"] in ("cutedsl_mla", "aiter")
    if rel.endswith("mi355x.yaml"):
        assert (s["mem_fraction_static"], s["chunked_prefill_size"]) == (0.8, 4096)
        assert "sgl-project/sglang#39029" in flat
    if rel.endswith("b300.yaml"):
        assert not hicache and "no published B300 system's host RAM" in flat


def test_startup_checks_refuse_what_sglang_refuses_of_the_levers() -> None:
    """The app's start-up checks (serve_app.engines.sglang.checks.sglang_problems) on the
    shipped B300 (DCP8) and H200 files, changed the ways SGLang 0.5.23 refuses."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from sglang_helpers import app_config

    from serve_app.engines.sglang.checks import sglang_problems

    b300 = "deployments/variants/kimi_dspark_b300.yaml"
    h200 = "deployments/kimi_dspark.yaml"
    assert sglang_problems(app_config(b300)) == []
    assert sglang_problems(app_config(h200)) == []
    # DCP on Hopper: no K3 DCP kernel (kimi_k3.py:84-112).
    text = "\n".join(sglang_problems(app_config(h200, parallelism={"dcp": 8})))
    assert "no K3 DCP decode kernel on H200" in text
    # DCP with a decode backend other than its kernel.
    text = "\n".join(sglang_problems(app_config(
        b300, engine={"sglang": {"decode_attention_backend": "trtllm_mla"}})))
    assert "K3's DCP decodes on 'cutedsl_mla'" in text
    # DCP with the adaptive verify (kimi_k3.py:63-75).
    text = "\n".join(sglang_problems(app_config(b300, engine={"sglang": {
        "ragged_verify_mode": "compact",
        "speculative_dspark_sps_table_path": "/models/none.json"}})))
    assert "only under the static verify" in text
    # The state pool sized for extra_buffer_lazy is too small for extra_buffer's 5 slots.
    text = "\n".join(sglang_problems(app_config(
        b300, engine={"sglang": {"mamba_radix_cache_strategy": "extra_buffer"}})))
    assert "max_mamba_cache_size=192 holds the states of only 38 running requests" in text
    # extra_buffer_lazy on a PD side (mamba_hook.py:123-128).
    assert any("refuses it under PD disaggregation" in p
               for p in sglang_problems(app_config(b300), role="decode"))
    # A host tier larger than the node's host RAM allows.
    text = "\n".join(sglang_problems(app_config(h200, engine={"sglang": {"hicache_ratio": 12.0}})))
    assert "engine.sglang.hicache_ratio=12.0" in text and "exceeds" in text


def test_pp_prefill_pipelines_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """PP prefill (SGLang's chunked pipeline parallelism): `passes` chunks over pp balanced
    stages take (passes + pp - 1) stage-steps of sequential / (pp x passes), at LMSYS's
    measured 82.8% strong-scaling efficiency (PP4 TP8, "Pipeline Parallelism in SGLang",
    lmsys.org/blog/2026-01-15-chunked-pipeline). The sequential time is what the model gives
    with the pipelining disabled (an efficiency so low that min() keeps it)."""
    import capacity.timing as timing

    layout = Layout(gpu="MI300X", nodes=4, tp=8, ep=8, pp=4)
    pipelined = timing.prefill_seconds(K3, layout, GPUS["MI300X"], MIB_1M)
    monkeypatch.setattr(timing, "PP_PREFILL_EFFICIENCY", 1e-9)
    sequential = timing.prefill_seconds(K3, layout, GPUS["MI300X"], MIB_1M)
    passes = math.ceil(MIB_1M / 8192)  # one request: one attention-DP rank, 8K chunks
    assert pipelined == pytest.approx(sequential * (passes + 3) / (passes * 4) / 0.828)
    assert pipelined < sequential / 3  # about 3.3x at PP4 for a 128-chunk prompt
