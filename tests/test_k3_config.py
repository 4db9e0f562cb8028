"""The Kimi K3 config reader (serve_app/models/k3_config.py) on the published K3 config.json and
on the miniature in tests/data/mini-k3-config.json."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from capacity.families import describe_model
from serve_app.models.k3_config import (
    K3Config,
    K3ConfigError,
    k3_layer_tensors,
    k3_parameter_count,
    k3_tensor_shapes,
)

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "capacity" / "data" / "kimi-k3-config.json"
MINI = Path(__file__).resolve().parent / "data" / "mini-k3-config.json"


@pytest.fixture(scope="module")
def real_raw() -> dict:
    return json.loads(REAL.read_text())


@pytest.fixture(scope="module")
def real(real_raw: dict) -> K3Config:
    return K3Config.from_dict(real_raw, str(REAL))


@pytest.fixture(scope="module")
def mini() -> K3Config:
    return K3Config.from_file(MINI)


def test_real_config_headline_numbers(real: K3Config) -> None:
    assert real.num_hidden_layers == 93
    assert real.hidden_size == 7168 and real.vocab_size == 163840
    assert len(real.kda_layers) == 69 and len(real.mla_layers) == 24
    # Every 4th layer is MLA, plus the last two.
    assert real.mla_layers == (*range(3, 91, 4), 91, 92)
    assert real.kda_proj_size == 96 * 128 and real.kda_conv_kernel == 4
    assert real.kda_gate_lower_bound == -5.0 and real.kda_full_rank_gate
    assert (real.num_attention_heads, real.q_lora_rank, real.kv_lora_rank) == (96, 1536, 512)
    assert (real.qk_nope_head_dim, real.qk_rope_head_dim, real.v_head_dim) == (128, 64, 128)
    assert real.mla_cache_dim == 576 and real.softmax_scale == 192**-0.5
    assert real.mla_use_output_gate and real.mla_use_nope
    assert (real.num_experts, real.num_experts_per_token) == (896, 16)
    assert (real.moe_intermediate_size, real.routed_expert_hidden_size) == (3072, 3584)
    assert real.is_latent_moe and real.latent_moe_use_norm and real.expert_input_size == 3584
    assert real.shared_intermediate_size == 6144 and real.has_e_score_correction_bias
    assert real.routed_scaling_factor == 1.0 and real.topk_method == "noaux_tc"
    assert real.dense_layers == (0,) and real.moe_layers == tuple(range(1, 93))
    assert (real.activation_situ_beta, real.activation_situ_linear_beta) == (4.0, 25.0)
    assert real.rms_norm_eps == 1e-5 and not real.tie_word_embeddings
    assert real.max_position_embeddings == 1_048_576
    assert real.quantization_config is not None
    assert real.quantization_config.ignores("model.layers.3.self_attn.q_a_proj")
    assert not real.quantization_config.ignores("model.layers.3.mlp.experts.0.w1")


def test_real_config_attn_res_blocks(real: K3Config) -> None:
    assert real.attn_res_block_size == 12
    assert real.attn_res_write_layers == tuple(range(0, 85, 12))
    assert all(real.is_kda(w) for w in real.attn_res_write_layers)
    assert real.attn_res_bank_size == 8
    assert real.attn_res_blocks[0] == (0, 12) and real.attn_res_blocks[-1] == (84, 93)
    assert real.attn_res_attn_blocks(0) == 0 and real.attn_res_mlp_blocks(0) == 1
    assert real.attn_res_attn_blocks(12) == 1 and real.attn_res_mlp_blocks(12) == 2


def test_layer_lists_are_converted_from_one_based(real: K3Config, real_raw: dict) -> None:
    lin = real_raw["text_config"]["linear_attn_config"]
    assert real.linear_attn_config.kda_layers == tuple(lin["kda_layers"])  # kept as published
    assert real.kda_layers == tuple(i - 1 for i in lin["kda_layers"])
    assert real.mla_layers == tuple(i - 1 for i in lin["full_attn_layers"])
    assert lin["full_attn_layers"][0] == 4 and real.mla_layers[0] == 3
    assert not real.is_kda(3) and real.is_kda(0) and not real.is_kda(92)
    with pytest.raises(IndexError):
        real.is_kda(93)


def test_parameter_count_matches_capacity_planner(real: K3Config) -> None:
    count = k3_parameter_count(real)
    assert count == describe_model(str(REAL)).total_params == 2_779_484_476_000


def test_bare_text_config_reads_the_same(real: K3Config, real_raw: dict) -> None:
    assert K3Config.from_dict(real_raw["text_config"]) == real


def test_mini_config(mini: K3Config) -> None:
    assert mini.kda_layers == (0, 1, 2, 4, 5, 6) and mini.mla_layers == (3, 7)
    assert mini.dense_layers == (0,) and mini.moe_layers == tuple(range(1, 8))
    assert mini.kda_proj_size == 384 and mini.quantization_config is None
    assert mini.attn_res_write_layers == (0, 3, 6) and mini.attn_res_bank_size == 3
    assert [mini.attn_res_attn_blocks(i) for i in range(8)] == [0, 1, 1, 1, 2, 2, 2, 3]
    assert [mini.attn_res_mlp_blocks(i) for i in range(8)] == [1, 1, 1, 2, 2, 2, 3, 3]
    # Counted by hand: total 12.0M; per KDA layer 539k, MLA 213k, MoE 807k, dense 590k.
    count = k3_parameter_count(mini)
    assert count == 12_010_260 == describe_model(str(MINI)).total_params
    assert round(count / 1e6, 1) == 12.0

    def size(layer: int, part: str) -> int:
        return sum(math.prod(s) for n, s in k3_layer_tensors(mini, layer) if f".{part}." in n)

    assert round(size(0, "self_attn"), -3) == 539_000
    assert round(size(3, "self_attn"), -3) == 213_000
    assert round(size(1, "mlp"), -3) == 807_000
    assert round(size(0, "mlp"), -3) == 590_000


def test_mini_widths_are_distinct(mini: K3Config) -> None:
    """A transposed 2-D weight has a different shape (except the square ones, which it has none
    of), so loading one fails loudly."""
    shapes = [s for _, s in k3_tensor_shapes(mini) if len(s) == 2 and s[0] != 1]
    assert shapes and all(a != b for a, b in shapes)


def _edited(raw: dict, **text_edits: object) -> dict:
    data = copy.deepcopy(raw)
    for key, value in text_edits.items():
        target = data["text_config"]
        *path, last = key.split("__")
        for part in path:
            target = target[part]
        if value is None:
            del target[last]
        else:
            target[last] = value
    return data


def test_missing_fields_are_named_in_one_error(real_raw: dict) -> None:
    raw = _edited(real_raw, kv_lora_rank=None, linear_attn_config__head_dim=None)
    with pytest.raises(K3ConfigError) as exc:
        K3Config.from_dict(raw, "k3.json")
    msg = str(exc.value)
    assert msg.startswith("k3.json: invalid Kimi K3 config")
    assert "text_config.kv_lora_rank: missing" in msg
    assert "text_config.linear_attn_config.head_dim: missing" in msg


def test_overlapping_layer_lists_are_named(real_raw: dict) -> None:
    kda = real_raw["text_config"]["linear_attn_config"]["kda_layers"]
    raw = _edited(real_raw, linear_attn_config__kda_layers=[*kda, 4],
                  num_experts_per_token=1000)
    with pytest.raises(K3ConfigError) as exc:
        K3Config.from_dict(raw)
    msg = str(exc.value)
    assert "kda_layers and full_attn_layers overlap at (1-based) layers [4]" in msg
    assert "num_experts_per_token=1000 exceeds" in msg  # both problems, one error


def test_layer_list_gaps_and_range(real_raw: dict) -> None:
    kda = real_raw["text_config"]["linear_attn_config"]["kda_layers"]
    raw = _edited(real_raw, linear_attn_config__kda_layers=[*kda[1:], 94])
    with pytest.raises(K3ConfigError) as exc:
        K3Config.from_dict(raw)
    msg = str(exc.value)
    assert "miss (1-based) layers [1]" in msg and "[94], beyond num_hidden_layers=93" in msg
    zero = _edited(real_raw, linear_attn_config__kda_layers=[0, *kda])
    with pytest.raises(K3ConfigError, match="1-based"):
        K3Config.from_dict(zero)


def test_other_inconsistencies(real_raw: dict) -> None:
    raw = _edited(real_raw, activation_situ_beta=None, num_key_value_heads=8,
                  first_k_dense_replace=100, linear_attn_config__gate_lower_bound=1.0)
    with pytest.raises(K3ConfigError) as exc:
        K3Config.from_dict(raw)
    assert "gate_lower_bound=1.0 must be < 0" in str(exc.value)
    raw = _edited(real_raw, activation_situ_beta=None, num_key_value_heads=8,
                  first_k_dense_replace=100)
    with pytest.raises(K3ConfigError) as exc:
        K3Config.from_dict(raw)
    msg = str(exc.value)
    assert "needs activation_situ_beta" in msg and "num_key_value_heads=8" in msg
    assert "first_k_dense_replace=100" in msg
    wrapper = copy.deepcopy(real_raw)
    wrapper["tie_word_embeddings"] = True
    with pytest.raises(K3ConfigError, match="tie_word_embeddings"):
        K3Config.from_dict(wrapper)


def test_special_token_ids_outside_the_vocabulary_are_named(real_raw: dict) -> None:
    vocab = real_raw["text_config"]["vocab_size"]
    raw = _edited(real_raw, eos_token_id=[vocab + 1], pad_token_id=-1)
    with pytest.raises(K3ConfigError) as exc:
        K3Config.from_dict(raw)
    msg = str(exc.value)
    assert f"eos_token_id [{vocab + 1}] must be in [0, vocab_size={vocab})" in msg
    assert "pad_token_id=-1 must be in" in msg


def test_absent_quantization_and_tied_embeddings(real_raw: dict, real: K3Config) -> None:
    raw = _edited(real_raw, quantization_config=None, tie_word_embeddings=True)
    del raw["tie_word_embeddings"]
    tied = K3Config.from_dict(raw)
    assert tied.quantization_config is None
    names = {n for n, _ in k3_tensor_shapes(tied)}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert k3_parameter_count(real) - k3_parameter_count(tied) == 163840 * 7168


def test_low_rank_gate_and_no_attn_res(mini: K3Config) -> None:
    raw = json.loads(MINI.read_text())
    raw = _edited(raw, attn_res_block_size=None, linear_attn_config__use_full_rank_gate=False,
                  routed_expert_hidden_size=None, latent_moe_use_norm=False)
    plain = K3Config.from_dict(raw)
    names = dict(k3_tensor_shapes(plain))
    assert names["model.layers.0.self_attn.g_a_proj.weight"] == (64, 256)
    assert names["model.layers.0.self_attn.g_b_proj.weight"] == (384, 64)
    assert "model.layers.0.self_attn.g_proj.weight" not in names
    assert not any("attn_res" in n or "routed_expert" in n for n in names)
    assert names["model.layers.1.mlp.experts.0.w1.weight"] == (96, 256)
    assert k3_parameter_count(plain) == describe_model_count(raw)
    with pytest.raises(ValueError, match="plain residual"):
        _ = plain.attn_res_write_layers


def describe_model_count(raw: dict) -> int:
    from capacity.families import descriptor_from_config

    return descriptor_from_config(raw, name="mini", source="mini").total_params
