"""serve_app.models.k3_weights on the mini-K3 config: save -> load round trips (fp32 logits
identical, bf16 keeps SGLang's fp32 tensors fp32, FP8 block dequantized), and strict loading
(every missing, unexpected and misshaped tensor in ONE error; unsupported quantization named)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import random_k3

from serve_app.models.checkpoint import INDEX_FILE, CheckpointError
from serve_app.models.k3 import K3ForCausalLM
from serve_app.models.k3_config import K3Config, k3_tensor_shapes
from serve_app.models.k3_weights import (
    UnsupportedQuantizationError,
    is_fp32_tensor,
    load_k3,
    save_k3,
)

MINI = Path(__file__).parent / "data" / "mini-k3-config.json"


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    return random_k3(K3Config.from_file(MINI))


@pytest.fixture(scope="module")
def saved(model: K3ForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("k3") / "ckpt"
    save_k3(model, folder, max_shard_bytes=8 * 1024 * 1024)  # several shards
    return folder


def ids(n: int = 12) -> torch.Tensor:
    return torch.randint(0, 4096, (1, n), generator=torch.Generator().manual_seed(3))


def test_round_trip_fp32_identical_logits(model: K3ForCausalLM, saved: Path) -> None:
    index = json.loads((saved / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == {n for n, _ in k3_tensor_shapes(model.config)}
    cfg = json.loads((saved / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and "text_config" in cfg
    loaded = load_k3(saved, dtype=torch.float32)
    assert loaded.config == model.config.model_copy(update={"dtype": "float32"})
    with torch.no_grad():
        want, _ = model(ids())
        got, _ = loaded(ids())
    assert torch.equal(got, want)


def test_bf16_load_keeps_fp32_tensors(saved: Path) -> None:
    loaded = load_k3(saved, dtype=torch.bfloat16)
    kept = {n: p.dtype for n, p in loaded.state_dict().items() if is_fp32_tensor(n)}
    assert {n.rsplit(".", 1)[-1] for n in kept} >= {"A_log", "dt_bias", "e_score_correction_bias"}
    assert any(n.endswith("q_conv1d.weight") for n in kept)
    assert set(kept.values()) == {torch.float32}
    others = {p.dtype for n, p in loaded.state_dict().items() if not is_fp32_tensor(n)}
    assert others == {torch.bfloat16}
    with torch.no_grad():
        logits, _ = loaded(ids(8))
    assert torch.isfinite(logits).all()


def test_default_dtype_is_the_configs(saved: Path) -> None:
    # save_k3 writes the model's dtype (fp32 here) into config.json
    assert load_k3(saved).model.embed_tokens.weight.dtype == torch.float32


def test_fp8_block_round_trip(model: K3ForCausalLM, tmp_path: Path) -> None:
    save_k3(model, tmp_path, fp8=True, block=(32, 32))
    stored = load_file(str(next(tmp_path.glob("model-*.safetensors"))))
    name = "model.layers.1.mlp.experts.0.w1.weight"
    assert stored[name].dtype == torch.float8_e4m3fn and name + "_scale_inv" in stored
    assert stored["model.layers.0.self_attn.A_log"].dtype == torch.float32
    loaded = load_k3(tmp_path, dtype=torch.float32)
    w = dict(model.named_parameters())
    got = dict(loaded.named_parameters())
    for n in ("model.layers.0.self_attn.q_proj.weight", name):
        assert torch.allclose(got[n], w[n], rtol=0.07, atol=1e-4)
    assert torch.equal(got["model.embed_tokens.weight"], w["model.embed_tokens.weight"])


def test_one_error_names_missing_unexpected_and_misshaped(saved: Path, tmp_path: Path) -> None:
    index = json.loads((saved / INDEX_FILE).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(saved / shard)))
    missing = "model.layers.2.self_attn.dt_bias"
    misshaped = "model.layers.3.self_attn.kv_b_proj.weight"
    extra = "model.layers.0.self_attn.fused_qkvg_proj.weight"
    del tensors[missing]
    tensors[misshaped] = tensors[misshaped].t().contiguous()
    tensors[extra] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    with pytest.raises(CheckpointError) as err:
        load_k3(tmp_path)
    msg = str(err.value)
    assert len(err.value.problems) == 3, msg
    for name in (missing, misshaped, extra):
        assert name in msg
    assert "missing tensor" in msg and "unexpected tensor" in msg and "expected shape" in msg


def _published(name: str) -> str:
    """Our name as a published (vision-language) K3 checkpoint spells it."""
    if name.startswith("model.layers."):
        name = "language_model.layers." + name.removeprefix("model.layers.")
    else:
        name = "language_model." + name
    return name.replace(".mlp.experts.", ".block_sparse_moe.experts.")


def test_published_checkpoint_names_load_as_sglang_reads_them(model: K3ForCausalLM, saved: Path,
                                                               tmp_path: Path) -> None:
    """SGLang 0.5.23's K3 loader rules: `language_model.` prefixes, `block_sparse_moe`,
    vision tensors skipped, A_log stored as [head_dim] (>= heads) or [1, 1, heads, 1]."""
    index = json.loads((saved / INDEX_FILE).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(saved / shard)))
    a_logs = sorted(n for n in tensors if n.endswith(".A_log"))
    assert len(a_logs) >= 2
    heads = tensors[a_logs[0]].shape[0]
    raw = {_published(n): t for n, t in tensors.items()}
    raw[_published(a_logs[0])] = torch.cat([tensors[a_logs[0]], torch.zeros(3)])  # [>= h]
    raw[_published(a_logs[1])] = tensors[a_logs[1]].view(1, 1, heads, 1)
    raw["vision_tower.patch_embed.weight"] = torch.zeros(2, 2)
    raw["mm_projector.proj.weight"] = torch.zeros(2, 2)
    assert any(".block_sparse_moe." in n for n in raw)
    save_file(raw, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    loaded = load_k3(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        want, _ = model(ids())
        got, _ = loaded(ids())
    assert torch.equal(got, want)
    # An A_log shorter than the heads is still refused, by name.
    raw[_published(a_logs[0])] = torch.zeros(heads - 1)
    save_file(raw, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="A_log"):
        load_k3(tmp_path)


def test_unsupported_quantization_is_refused_by_name(saved: Path, tmp_path: Path) -> None:
    for f in saved.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    cfg = json.loads((saved / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantizationError, match="compressed-tensors"):
        load_k3(tmp_path)
