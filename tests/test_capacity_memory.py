"""Each memory term on a tiny hand-checked hybrid model (3 KDA + 1 MLA layer)."""

from __future__ import annotations

from datetime import date

import pytest

from capacity import CapacityError, GpuSpec, Layout, Speculation, Workload, memory_per_gpu
from capacity.families import descriptor_from_config
from capacity.memory import NCCL_BYTES, RUNTIME_OTHER_BYTES

TINY = {
    "hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 4, "num_attention_heads": 4,
    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "q_lora_rank": 32, "num_experts": 8, "num_experts_per_token": 2,
    "moe_intermediate_size": 16, "intermediate_size": 128, "first_k_dense_replace": 1,
    "max_position_embeddings": 4096, "routed_expert_hidden_size": 32, "num_shared_experts": 1,
    "mla_use_output_gate": True,
    "linear_attn_config": {"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 3], "full_attn_layers": [4],
                           "use_full_rank_gate": True},
}
TINY_DRAFT = {
    "architectures": ["DSparkDraftModel"], "hidden_size": 64, "vocab_size": 100,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 32, "block_size": 3,
    "dflash_config": {"target_layer_ids": [1, 2], "markov_rank": 4,
                      "enable_confidence_head": True},
}
GPU = GpuSpec(
    gpu="TOY", vendor="test", memory=100, memory_unit="GB", hbm_tbps=1, bf16_tflops=100,
    native_fp4=False, scale_up_gbps=100, scale_out_gbps=10, gpus_per_node=8, scale_up_domain=8,
    source="test", as_of=date(2026, 1, 1),
)


@pytest.fixture(scope="module")
def tiny():
    return descriptor_from_config(TINY, name="tiny", source="test")


@pytest.fixture(scope="module")
def tiny_draft():
    return descriptor_from_config(TINY_DRAFT, name="tiny-draft", source="test")


def layout(tp: int, dp: int = 1, ep: int | None = None, mem_fraction: float = 0.5) -> Layout:
    return Layout(gpu="TOY", tp=tp * dp, attention_dp=dp, ep=ep or tp * dp,
                  mem_fraction=mem_fraction)


def run(model, lay, context=1000, draft=None, spec=None):
    return memory_per_gpu(model, lay, Workload(context_length=context), GPU, draft, spec)


def test_mla_attention_weights_split_by_attention_tp(tiny):
    # q_a 32x64 + q_a_norm 32 + q_b 64x32 + kv_a 24x64 + kv_a_norm 16 + kv_b 64x16 + o 64x32
    # + output gate 32x64 = 10,800 BF16 params.
    assert run(tiny, layout(1)).stages[0].weights["attention"] == 21_600
    assert run(tiny, layout(4)).stages[0].weights["attention"] == 5_400
    # Attention DP replicates attention weights: TP2 x DP2 holds half, not a quarter.
    assert run(tiny, layout(2, dp=2)).stages[0].weights["attention"] == 10_800


def test_routed_experts_split_by_ep(tiny):
    # 3 MoE layers x 8 experts x (2 x 16x32 + 32x16) x 2 B = 73,728 B in BF16.
    assert run(tiny, layout(1)).stages[0].weights["routed_experts"] == 73_728
    assert run(tiny, layout(4)).stages[0].weights["routed_experts"] == 18_432
    # EP2 inside a 4-GPU stage: 4 experts per EP rank, each split by MoE TP 2.
    assert run(tiny, layout(4, ep=2)).stages[0].weights["routed_experts"] == 18_432
    # 8 experts over EP3: the busiest rank holds 3, split by MoE TP 2.
    assert run(tiny, layout(2, dp=3, ep=3)).stages[0].weights["routed_experts"] == 13_824


def test_mla_kv_replicated_on_every_tp_rank(tiny):
    # ceil((1000 + 1) / 64) = 16 pages of 64 tokens x (16 + 8) latent x 2 B x 1 MLA layer.
    for tp in (1, 2, 4):
        assert run(tiny, layout(tp)).stages[0].per_request["mla_kv"] == 1024 * 24 * 2


def test_attention_dp_splits_requests(tiny):
    single = run(tiny, layout(4))
    split = run(tiny, layout(1, dp=4))
    per_rank = split.stages[0].max_requests_per_rank
    assert split.max_concurrent == 4 * per_rank
    assert split.stages[0].per_request["mla_kv"] == single.stages[0].per_request["mla_kv"]


def test_kda_state_per_request_split_by_tp_and_slots(tiny):
    # Per KDA layer: 4 heads x 8 x 8 FP32 = 1,024 B + conv 3 x 32 channels x 3 x 2 B = 576 B.
    assert run(tiny, layout(1)).stages[0].per_request["kda_state"] == 3 * 1600
    assert run(tiny, layout(2)).stages[0].per_request["kda_state"] == 3 * 1600 // 2
    slots = memory_per_gpu(tiny, layout(2), Workload(context_length=1000, kda_state_slots=3), GPU)
    assert slots.stages[0].per_request["kda_state"] == 3 * 3 * 1600 // 2
    # Constant in context length.
    assert run(tiny, layout(1), context=4000).stages[0].per_request["kda_state"] == 3 * 1600


def test_draft_weights_and_gqa_kv(tiny, tiny_draft):
    spec = Speculation(gamma=3, acceptance_length=2.0)
    report = run(tiny, layout(2), draft=tiny_draft, spec=spec)
    stage = report.stages[0]
    assert stage.weights["draft"] == -(-tiny_draft.total_bytes() // 2)
    # ceil((1000 + 4) / 64) = 16 pages; 2 layers x (K, V) x 1 head per rank x 8 x 2 B.
    assert stage.per_request["draft_kv"] == 1024 * 2 * 2 * 1 * 8 * 2
    alone = run(tiny, layout(1), draft=tiny_draft, spec=spec).stages[0]
    assert alone.per_request["draft_kv"] == 1024 * 2 * 2 * 2 * 8 * 2
    # TP4 > 2 KV heads: each rank keeps one (replicated) head, not half of one.
    wide = run(tiny, layout(4), draft=tiny_draft, spec=spec).stages[0]
    assert wide.per_request["draft_kv"] == 1024 * 2 * 2 * 1 * 8 * 2
    # Rolling back a rejected draft needs a KDA state per verified position.
    assert stage.per_request["kda_verify_states"] == 4 * 3 * 1600 // 2


def test_fraction_reserve_and_max_concurrent(tiny):
    report = run(tiny, layout(1))
    stage = report.stages[0]
    assert stage.budget == 50_000_000_000
    assert stage.outside_pool["runtime_reserve"] == RUNTIME_OTHER_BYTES + NCCL_BYTES
    # 8192 prefill tokens x 64 hidden x 2 B x 16 buffers + FP32 logits of 1024 rows x 100.
    assert stage.outside_pool["activation_workspace"] == 8192 * 64 * 2 * 16 + 1024 * 100 * 4
    expected = (stage.budget - stage.weight_bytes) // stage.request_bytes
    assert report.fits and report.max_concurrent == expected
    greedy = memory_per_gpu(tiny, layout(1, mem_fraction=0.98), Workload(context_length=10), GPU)
    assert not greedy.fits and "outside the static pool" in greedy.reasons[0]


def test_context_and_heads_are_checked(tiny):
    with pytest.raises(CapacityError, match="exceeds tiny's maximum 4,096"):
        run(tiny, layout(1), context=5000)
    with pytest.raises(CapacityError, match="attention_tp \\(3\\) must divide"):
        run(tiny, Layout(gpu="TOY", tp=3, ep=3))


def test_pipeline_stages_split_layers(tiny):
    report = run(tiny, Layout(gpu="TOY", tp=1, pp=2, ep=1, mem_fraction=0.5))
    first, last = report.stages
    assert (first.first_layer, first.last_layer, last.first_layer, last.last_layer) == (0, 1, 2, 3)
    assert "embeddings" in first.weights and "embeddings" not in last.weights
    assert "lm_head" in last.weights and "lm_head" not in first.weights
    assert first.per_request["mla_kv"] == 0 and last.per_request["mla_kv"] > 0


def test_running_fit_counts_sglangs_kda_state_pools() -> None:
    """K3 + DSpark on 2 x 8 H200 at 1M: BF16 KV leaves no room for one request; FP8 KV holds
    one full-context request beside the states of 12 running requests, each holding 5
    radix-cache slots + 8 verify states (gamma 7 + 1). (15 before the vision tower's 0.895 GB
    per GPU was counted.)"""
    from capacity import describe_model, load_gpus
    from capacity.formats import KvDtype
    from capacity.memory import MAMBA_SLOTS_PER_RUNNING_REQUEST, running_fit

    k3, draft, h200 = describe_model("kimi-k3"), describe_model("kimi-k3-dspark"), load_gpus()["H200"]
    lay = Layout(gpu="H200", nodes=2, tp=16, ep=16)
    bf16 = running_fit(k3, lay, h200, 1_048_576, draft)
    assert (bf16.max_running_requests, bf16.full_context_requests, bf16.fits) == (0, 0, False)
    assert round(bf16.one_request_bytes / 1e9, 1) == 31.0 and round(bf16.free_bytes / 1e9) == 20
    fp8 = running_fit(k3, lay.model_copy(update={"kv_dtype": KvDtype.FP8}), h200, 1_048_576,
                      draft)
    assert (fp8.max_running_requests, fp8.full_context_requests) == (12, 1)
    slot = memory_per_gpu(k3, lay, Workload(context_length=1_048_576), h200, draft
                          ).stages[0].per_request["kda_state"]
    assert fp8.state_bytes_per_request == slot * (MAMBA_SLOTS_PER_RUNNING_REQUEST + 8)
    assert fp8.mamba_cache_slots == 60
    # A fixed running count: how many of them may be at full context.
    assert running_fit(k3, lay.model_copy(update={"kv_dtype": KvDtype.FP8}), h200, 1_048_576,
                       draft, running=48).full_context_requests == 0
    # Short contexts: the cap (48 with DSPARK) binds.
    assert running_fit(k3, lay, h200, 8192, draft).max_running_requests == 48


def test_kda_rollback_costs_follow_sglangs_formulas() -> None:
    """From SGLang 0.5.23's formulas (docs/capacity.md cites them): the default scratch
    keeps D = 8 full states per request (intermediate_ssm + intermediate_conv_window); ReplaySSM
    keeps the conv windows and a ring of L = 16 positions on every mamba slot instead."""
    from capacity import describe_model
    from capacity.memory import MAMBA_SLOTS_PER_RUNNING_REQUEST, kda_rollback_costs

    k3 = describe_model("kimi-k3")
    scratch = kda_rollback_costs(k3, 8, 8)
    assert scratch.strategy == "scratch" and scratch.per_slot_ring_bytes == 0
    assert scratch.state_slot_bytes == k3.kda_state_bytes(attention_tp=8) == 56_171_520
    assert scratch.per_request_ssm_bytes == 69 * 8 * 12 * 128 * 128 * 4  # 434.1 MB
    assert scratch.per_request_conv_bytes == 69 * 8 * 3 * 3 * 12 * 128 * 2  # 15.3 MB
    assert round(scratch.per_request_ssm_bytes / 1e6, 1) == 434.1
    assert round(scratch.per_request_conv_bytes / 1e6, 1) == 15.3
    assert scratch.per_request_bytes == 8 * scratch.state_slot_bytes  # 8x the committed state
    assert round(scratch.per_request_bytes / 1e6) == 449
    # x 49 (R = 48 + the padding row): 22.0 GB per GPU; 11.4 GB with BF16 SSM; 11.0 GB at TP16.
    assert scratch.rollback_bytes(48) == 49 * scratch.per_request_bytes
    assert round(scratch.rollback_bytes(48) / 1e9, 1) == 22.0
    assert round(kda_rollback_costs(k3, 8, 8, ssm_bytes=2).rollback_bytes(48) / 1e9, 1) == 11.4
    assert round(kda_rollback_costs(k3, 8, 16).rollback_bytes(48) / 1e9, 1) == 11.0

    replay = kda_rollback_costs(k3, 8, 8, "replay", 16)
    # mamba_utils.py:127-157, KDA: raw v, raw k, d, k (BF16), per-K gate g, beta (FP32);
    # 12 heads per rank, V = K = 128.
    per_layer = 12 * 16 * 128 * (2 + 2 + 2 + 2 + 4) + 12 * 16 * 4
    assert replay.per_slot_ring_bytes == 69 * per_layer == 20_401_920  # about 20.4 MB
    assert replay.per_request_ssm_bytes == 0  # no intermediate_ssm
    assert replay.per_request_conv_bytes == scratch.per_request_conv_bytes  # the windows stay
    # The ring rides on every mamba slot: 5 per running request and the padding slot.
    assert replay.rollback_bytes(48) == (
        49 * replay.per_request_conv_bytes
        + (48 * MAMBA_SLOTS_PER_RUNNING_REQUEST + 1) * replay.per_slot_ring_bytes)
    assert round(replay.rollback_bytes(48) / 1e9, 2) == 5.66
    assert round(kda_rollback_costs(k3, 8, 16, "replay").rollback_bytes(48) / 1e9, 2) == 2.83
    assert replay.state_bytes(48) == (
        (48 * MAMBA_SLOTS_PER_RUNNING_REQUEST + 1) * (replay.state_slot_bytes
                                                      + replay.per_slot_ring_bytes)
        + 49 * replay.per_request_conv_bytes)
    # The ring scales with L.
    assert kda_rollback_costs(k3, 8, 8, "replay", 32).per_slot_ring_bytes == 2 * 20_401_920


def test_kda_rollback_is_checked_as_sglang_does(tiny) -> None:
    from capacity.memory import kda_rollback_costs

    with pytest.raises(CapacityError, match="one of scratch, replay"):
        kda_rollback_costs(tiny, 4, strategy="undo")
    with pytest.raises(CapacityError, match="power of two, got 12"):
        kda_rollback_costs(tiny, 4, strategy="replay", ring_len=12)
    with pytest.raises(CapacityError, match="8 is below 2 x 8 draft tokens"):
        kda_rollback_costs(tiny, 8, strategy="replay", ring_len=8)
    with pytest.raises(CapacityError, match="needs a draft"):
        kda_rollback_costs(tiny, 0, strategy="replay")
    with pytest.raises(CapacityError, match="attention_tp \\(3\\) must divide"):
        kda_rollback_costs(tiny, 4, 3)
    with pytest.raises(CapacityError, match="needs a draft"):
        memory_per_gpu(tiny, layout(1), Workload(context_length=1000), GPU, kda_rollback="replay")
    # Without speculation the default costs nothing beyond the slots.
    none = kda_rollback_costs(tiny, 0)
    assert none.rollback_bytes(10) == 0 and none.state_padding_bytes == none.state_slot_bytes


def test_replay_rollback_per_request_terms(tiny, tiny_draft):
    """Tiny hybrid (3 KDA layers, 4 heads x 8): at TP2 the ring of one slot is
    (4 x 16 x 8 x 2 B x 4 rings + 4 x 16 x 8 x 4 B gate + 4 x 16 x 4 B beta) / 2 per layer."""
    spec = Speculation(gamma=3, acceptance_length=2.0)
    scratch = run(tiny, layout(2), draft=tiny_draft, spec=spec).stages[0]
    replay = memory_per_gpu(tiny, layout(2), Workload(context_length=1000, kda_state_slots=5),
                            GPU, tiny_draft, spec, kda_rollback="replay").stages[0]
    assert "kda_verify_states" not in replay.per_request
    # Four conv windows (gamma + 1) of 3 x 32 channels x 2 B per layer, split by TP.
    assert replay.per_request["kda_verify_conv_windows"] == 3 * 4 * 576 // 2
    assert replay.per_request["kda_replay_ring"] == 5 * 3 * (4096 + 2048 + 256) // 2
    assert replay.per_request["kda_state"] == 5 * 3 * 1600 // 2
    for key in ("mla_kv", "draft_kv"):
        assert replay.per_request[key] == scratch.per_request[key]
    assert replay.weights == scratch.weights
    # The default is unchanged by the option.
    same = memory_per_gpu(tiny, layout(2), Workload(context_length=1000), GPU, tiny_draft, spec,
                          kda_rollback="scratch").stages[0]
    assert dict(same.per_request) == dict(scratch.per_request)


def test_running_fit_honours_the_kda_rollback() -> None:
    """K3 + DSpark on 2 x 8 H200 (TP16), FP8 KV at 1M: the scratch default runs 12 requests;
    replay's smaller verify memory lets 24 run beside one full-context request, and at 48
    running it leaves 10.5 GB of KV per GPU where the scratch leaves 2.3 GB (the vision
    tower's 0.895 GB per GPU counted)."""
    from capacity import describe_model, load_gpus
    from capacity.formats import KvDtype
    from capacity.memory import kda_rollback_costs, running_fit

    k3, draft, h200 = describe_model("kimi-k3"), describe_model("kimi-k3-dspark"), load_gpus()["H200"]
    lay = Layout(gpu="H200", nodes=2, tp=16, ep=16, kv_dtype=KvDtype.FP8)
    default = running_fit(k3, lay, h200, 1_048_576, draft)
    scratch = running_fit(k3, lay, h200, 1_048_576, draft, kda_rollback="scratch")
    assert default == scratch and default.kda_rollback == "scratch"
    assert default.rollback == kda_rollback_costs(k3, 8, 16)
    slot = memory_per_gpu(k3, lay, Workload(context_length=1_048_576), h200, draft
                          ).stages[0].per_request["kda_state"]
    assert default.rollback.state_slot_bytes == slot
    replay = running_fit(k3, lay, h200, 1_048_576, draft, kda_rollback="replay")
    assert (replay.max_running_requests, replay.full_context_requests) == (24, 1)
    assert replay.rollback == kda_rollback_costs(k3, 8, 16, "replay")
    assert replay.state_bytes_per_request == replay.rollback.state_bytes_per_request
    for strategy, room, full in (("scratch", 2.28, 0), ("replay", 10.46, 0)):
        at48 = running_fit(k3, lay, h200, 1_048_576, draft, running=48, kda_rollback=strategy)
        assert at48.state_bytes == at48.rollback.state_bytes(48)
        assert at48.kv_room_bytes == at48.free_bytes - at48.state_bytes
        assert (round(at48.kv_room_bytes / 1e9, 2), at48.full_context_requests) == (room, full)
    # At 128K, 48 running requests leave room for 1 (scratch) or 5 (replay) full-context ones.
    assert [running_fit(k3, lay, h200, 131_072, draft, running=48, kda_rollback=s
                        ).full_context_requests for s in ("scratch", "replay")] == [1, 5]
