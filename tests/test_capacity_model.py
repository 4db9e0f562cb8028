"""Parameter counts, bytes per format and cache sizes against numbers worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capacity import CapacityError, KvDtype, WeightFormat, describe_model
from capacity.formats import matrix_bytes
from capacity.model import Component


@pytest.fixture(scope="module")
def k3():
    return describe_model("kimi-k3")


@pytest.fixture(scope="module")
def k2():
    return describe_model("kimi-k2")


@pytest.fixture(scope="module")
def draft():
    return describe_model("kimi-k3-dspark")


def test_draft_params_exact(draft):
    assert draft.total_params == 2_249_289_601
    by = draft.params_by_component
    # The published draft's arithmetic: 5 layers x 381,696,128; fc; Markov head; confidence head.
    layer_total = by[Component.ATTENTION] + by[Component.DENSE_MLP] + 5 * 2 * 7168
    assert layer_total == 5 * 381_696_128
    assert by[Component.DRAFT_FC] == 256_901_120
    assert by[Component.DRAFT_HEADS] == 83_886_080 + 7_425
    assert draft.bytes_by_component()[Component.DRAFT_FC] == 2 * 256_901_120


def test_k3_params_and_bytes(k3):
    assert k3.total_params == pytest.approx(2.78e12, rel=0.005)
    assert k3.active_params == pytest.approx(105e9, rel=0.02)
    assert (k3.mla_layers, k3.kda_layers, k3.moe_layers) == (24, 69, 92)
    native = k3.bytes_by_component()
    experts = native[Component.ROUTED_EXPERTS]
    assert k3.native_format is WeightFormat.MXFP4
    # MXFP4 with an E8M0 scale per 32 = 4.25 bits per routed-expert parameter.
    assert experts == k3.params_by_component[Component.ROUTED_EXPERTS] * 17 // 32
    assert experts / 1e12 == pytest.approx(1.45, abs=0.01)
    assert (sum(native.values()) - experts) / 1e12 == pytest.approx(0.11, abs=0.01)


def test_k3_ignore_list_keeps_attention_and_shared_in_bf16(k3):
    for fmt in (WeightFormat.MXFP4, WeightFormat.FP8, WeightFormat.INT4):
        by = k3.bytes_by_component(fmt)
        params = k3.params_by_component
        for comp in (Component.ATTENTION, Component.KDA, Component.SHARED_EXPERTS,
                     Component.DENSE_MLP, Component.LM_HEAD):
            assert by[comp] == 2 * params[comp], (fmt, comp)
        assert by[Component.ROUTED_EXPERTS] < params[Component.ROUTED_EXPERTS] * 1.01


def test_k2_fp8_counts(k2):
    assert k2.total_params == pytest.approx(1.03e12, rel=0.01)
    assert k2.native_format is WeightFormat.FP8
    # No ignore list: attention is FP8 too (1 byte + a 4-byte scale per 128x128 block).
    attention = k2.bytes_by_component()[Component.ATTENTION]
    params = k2.params_by_component[Component.ATTENTION]
    assert params < attention < params * 1.01
    assert k2.bytes_by_component()[Component.LM_HEAD] == 2 * k2.params_by_component[
        Component.LM_HEAD]


def test_kv_bytes_per_token(k3, k2, draft):
    assert k3.kv_bytes_per_token() == 27_648
    assert k3.kv_bytes_per_token(KvDtype.FP8) == 13_824
    assert k3.kv_bytes_per_token() * 1_048_576 / 1e9 == pytest.approx(29.0, abs=0.05)
    assert k2.kv_bytes_per_token() == 70_272
    assert draft.gqa_kv_bytes_per_token() == 20_480
    assert draft.gqa_kv_heads_per_rank(8) == 2
    assert draft.gqa_kv_heads_per_rank(16) == 1
    assert draft.gqa_kv_heads_per_rank(32) == 1  # replicated once TP exceeds the KV heads


def test_kda_state(k3):
    # 69 layers x (96 x 128 x 128 FP32 + 3 convs x 12288 x 3 BF16)
    assert k3.kda_state_bytes() == 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2)
    assert k3.kda_state_bytes() / 1e9 == pytest.approx(0.45, abs=0.01)


@pytest.mark.parametrize(
    ("tp", "conv", "ssm", "total_mb", "bf16_ssm_mb"),
    # SGLang 0.5.23's KDA state shapes by hand (conv BF16, SSM FP32, 69 KDA layers).
    [(1, 221_184, 6_291_456, 449.4, 232.3), (8, 27_648, 786_432, 56.2, 29.0),
     (16, 13_824, 393_216, 28.1, 14.5)],
)
def test_kda_state_per_attention_tp_rank(k3, tp, conv, ssm, total_mb, bf16_ssm_mb):
    assert k3.kda_layer_conv_bytes(attention_tp=tp) == conv
    assert k3.kda_layer_ssm_bytes(attention_tp=tp) == ssm
    assert k3.kda_layer_state_bytes(attention_tp=tp) == conv + ssm
    assert k3.kda_state_bytes(attention_tp=tp) == 69 * (conv + ssm)
    assert round(k3.kda_state_bytes(attention_tp=tp) / 1e6, 1) == total_mb
    assert round(k3.kda_state_bytes(ssm_bytes=2, attention_tp=tp) / 1e6, 1) == bf16_ssm_mb


def test_kda_state_element_sizes(k3, k2):
    # The CPU reference engine keeps its conv state in FP32: twice the conv bytes.
    assert k3.kda_state_bytes(conv_bytes=4) == 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 4)
    assert k3.kda_state_bytes(4, 4, 8) == k3.kda_state_bytes(conv_bytes=4) // 8
    # The defaults are the unchanged SGLang dtypes.
    assert k3.kda_state_bytes() == k3.kda_state_bytes(2, 4, 1)
    with pytest.raises(CapacityError, match="attention_tp \\(5\\) must divide Kimi-K3's 96 KDA"):
        k3.kda_state_bytes(attention_tp=5)
    with pytest.raises(CapacityError, match="attention_tp \\(0\\)"):
        k3.kda_layer_state_bytes(attention_tp=0)
    assert k2.kda_state_bytes(attention_tp=5) == 0 == k2.kda_layer_state_bytes()


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        (WeightFormat.BF16, 2 * 256 * 64),
        (WeightFormat.FP8, 256 * 64 + 2 * 1 * 4),  # 2 x 1 blocks of 128 x 128
        (WeightFormat.MXFP4, 256 * 32 + 256 * 2),  # packed nibbles + one E8M0 per 32
        (WeightFormat.INT4, 256 * 32 + 256 * 2 * 2),  # + one BF16 scale per 32
        (WeightFormat.NVFP4, 256 * 32 + 256 * 4 + 4),  # + FP8 scale per 16 + FP32 global
    ],
)
def test_matrix_bytes(fmt, expected):
    assert matrix_bytes(fmt, 256, 64) == expected


def test_unknown_architecture_names_fields(tmp_path: Path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(CapacityError, match=r"unsupported architecture.*LlamaForCausalLM"):
        describe_model(path)


def test_missing_fields_are_listed(tmp_path: Path):
    config = json.loads((Path(__file__).parents[1] / "capacity/data/kimi-k2-instruct-config.json")
                        .read_text())
    del config["hidden_size"], config["moe_intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CapacityError, match="missing fields: hidden_size, moe_intermediate_size"):
        describe_model(tmp_path)


def test_unknown_name_lists_packaged_models():
    with pytest.raises(CapacityError, match="kimi-k3-dspark"):
        describe_model("no-such-model")


def test_dspark_settings_read_alike_by_the_planner_and_the_app() -> None:
    """One reader of where a DSpark config keeps its settings (capacity/dspark_keys.py): the
    planner's descriptor and the app's DSparkConfig see the same values wherever a setting is
    written, and both refuse one written twice with different values."""
    from capacity.families import descriptor_from_config
    from serve_app.models.dspark_config import DSparkConfig, DSparkConfigError

    path = Path(__file__).parents[1] / "capacity/data/kimi-k3-dspark-config.json"
    raw = json.loads(path.read_text())
    moved = {k: v for k, v in raw.items() if k != "block_size"}
    moved["dflash_config"] = {**raw["dflash_config"]}
    layers = moved["dflash_config"].pop("target_layer_ids")
    moved["dspark_target_layer_ids"] = layers  # SGLang's prefixed spelling
    moved["dflash_config"]["block_size"] = raw["block_size"]
    desc = descriptor_from_config(moved, "k3-dspark", "moved")
    app = DSparkConfig.from_dict(moved, "moved")
    assert desc.draft is not None
    assert desc.draft.block_size == app.block_size == raw["block_size"]
    assert list(desc.draft.target_layer_ids) == list(app.target_layer_ids) == layers

    contradicting = {**moved, "block_size": raw["block_size"] + 1}
    with pytest.raises(CapacityError, match=r"block_size=8 vs dflash_config.block_size=7"):
        descriptor_from_config(contradicting, "k3-dspark", "bad")
    with pytest.raises(DSparkConfigError, match=r"block_size=8 vs dflash_config.block_size=7"):
        DSparkConfig.from_dict(contradicting, "bad")
