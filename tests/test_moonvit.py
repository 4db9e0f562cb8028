"""Kimi K3's vision tower + projector (serve_app/models/moonvit.py) against SGLang 0.5.23's own
KimiK3VisionTower / KimiK3MultiModalProjector.

The fixture (`tests/data/vision/moonvit-tiny/`, made by `tools/make_moonvit_fixture.py`, which
runs a saved copy of SGLang's kimi_k3_vl.py) is a tiny random tower with K3's structure (qkv
width 96 != hidden 64, 2 heads, 3 blocks, 8x8 position table) in the checkpoint's names, plus
the reference's outputs for grids equal to, smaller and larger than the table, non-square, and
several images packed in one call. The reference ran in float64 and float32 from the same
weights; the largest difference between the two (the `spread`, 3.6e-6 on outputs of magnitude
up to 4) is the float32 rounding any faithful float32 implementation shows, so ours (float32)
must be within TOL_FACTOR x spread of the float64 output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from serve_app.models import moonvit
from serve_app.models.checkpoint import INDEX_FILE, CheckpointError, save_tensors
from serve_app.models.moonvit import (
    K3Vision,
    VisionConfig,
    VisionConfigError,
    load_k3_vision,
    merged_tokens,
    save_k3_vision,
    vision_flops_per_image,
    vision_params,
)

FIXTURE = Path(__file__).parent / "data" / "vision" / "moonvit-tiny"
K3_CONFIG = Path(__file__).parent.parent / "capacity" / "data" / "kimi-k3-config.json"
# Headroom over the measured float32-vs-float64 spread for another CPU's kernels (ours matches
# the reference's float32 output bit for bit on the machine that made the fixture).
TOL_FACTOR = 4


def _cases() -> tuple[dict[str, list[tuple[int, int, int]]], dict[str, torch.Tensor], float]:
    with safe_open(str(FIXTURE / "cases.safetensors"), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    grids = {k: [tuple(g) for g in v] for k, v in json.loads(meta["grids"]).items()}
    return grids, tensors, float(meta["spread_ref32_ref64"])


GRIDS, CASES, SPREAD = _cases()
TOL = TOL_FACTOR * SPREAD


def _pixels(name: str) -> torch.Tensor:
    # K3's normalisation, (x/255 - 0.5)/0.5, as the generator applied it.
    return (CASES[f"pixels.{name}"].float() / 255.0 - 0.5) / 0.5


@pytest.fixture(scope="module")
def model() -> K3Vision:
    m = load_k3_vision(FIXTURE)
    assert m is not None
    return m


def _max_err(out: torch.Tensor, name: str) -> float:
    return (out.double() - CASES[f"ref64.{name}"]).abs().max().item()


def test_spread_is_float32_rounding() -> None:
    # The tolerance is only meaningful if the reference agreed with itself across dtypes.
    assert 0 < SPREAD < 1e-4


@pytest.mark.parametrize("name", list(GRIDS))
def test_matches_reference(model: K3Vision, name: str) -> None:
    grids = GRIDS[name]
    with torch.no_grad():
        out = model(_pixels(name), grids)
    assert out.shape == (sum(merged_tokens(model.config, g) for g in grids), 80)
    assert _max_err(out, name) <= TOL


def test_packed_equals_one_by_one(model: K3Vision) -> None:
    grids = GRIDS["packed"]
    pixels = _pixels("packed")
    with torch.no_grad():
        packed = model(pixels, grids)
        singles, start = [], 0
        for g in grids:
            n = g[0] * g[1] * g[2]
            singles.append(model(pixels[start:start + n], [g]))
            start += n
    torch.testing.assert_close(packed, torch.cat(singles), atol=TOL, rtol=0)


def test_no_attention_across_images(model: K3Vision) -> None:
    grids = GRIDS["packed"]
    pixels = _pixels("packed")
    first = grids[0][1] * grids[0][2]
    other = pixels.clone()
    other[first:] = -other[first:]  # change every later image, keep the first
    n0 = merged_tokens(model.config, grids[0])
    with torch.no_grad():
        a, b = model(pixels, grids), model(other, grids)
    torch.testing.assert_close(a[:n0], b[:n0], atol=TOL, rtol=0)
    assert (a[n0:] - b[n0:]).abs().max() > 1000 * TOL


def test_equal_sized_images_batched_stay_apart(model: K3Vision) -> None:
    """Consecutive images of one size share a batched attention call (a different size between
    them starts another): each image still equals itself alone, and changing one image changes
    no other's features."""
    grids = [(1, 4, 4), (1, 4, 4), (1, 2, 4), (1, 4, 4), (1, 4, 4)]
    sizes = [t * h * w for t, h, w in grids]
    pixels = torch.randn(sum(sizes), 3, 14, 14, generator=torch.Generator().manual_seed(0))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    with torch.no_grad():
        packed = model(pixels, grids)
        singles = [model(pixels[s:s + n], [g]) for s, n, g in zip(starts, sizes, grids,
                                                                  strict=True)]
        other = pixels.clone()
        other[starts[1]:starts[1] + sizes[1]] *= -1  # the second image only
        changed = model(other, grids)
    torch.testing.assert_close(packed, torch.cat(singles), atol=TOL, rtol=0)
    tokens = [merged_tokens(model.config, g) for g in grids]
    ends = [sum(tokens[:i + 1]) for i in range(len(tokens))]
    second = slice(ends[0], ends[1])
    assert (packed[second] - changed[second]).abs().max() > 1000 * TOL
    keep = torch.ones(packed.shape[0], dtype=torch.bool)
    keep[second] = False
    torch.testing.assert_close(packed[keep], changed[keep], atol=TOL, rtol=0)


def test_rope_column_row_rule_is_pinned(model: K3Vision, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture tells the rule apart: with pair 2i rotated by the row and 2i+1 by the column
    (the checkpoint docstring's reading), the outputs no longer match."""
    right = moonvit.rope_2d_table

    def swapped(head_dim: int, h: int, w: int, device: torch.device | None = None
                ) -> torch.Tensor:
        # The table of the transposed (w x h) grid, read at (x, y): pair 2i then holds the
        # row y and pair 2i+1 the column x.
        t = right(head_dim, w, h, device).view(w, h, head_dim // 2)
        return t.transpose(0, 1).reshape(h * w, head_dim // 2)

    # sanity: `swapped` is the same table with the roles exchanged, not noise
    t = right(8, 2, 3).view(2, 3, 2, 2)
    s = swapped(8, 2, 3).view(2, 3, 2, 2)
    torch.testing.assert_close(s[1, 2, :, 0], t[1, 2, :, 1])  # pair 2i: the row y=1
    torch.testing.assert_close(s[1, 2, :, 1], t[1, 2, :, 0])  # pair 2i+1: the column x=2
    monkeypatch.setattr(moonvit, "rope_2d_table", swapped)
    with torch.no_grad():
        out = model(_pixels("larger_wide"), GRIDS["larger_wide"])
    assert _max_err(out, "larger_wide") > 1000 * TOL


def test_interpolation_mode_is_pinned(model: K3Vision) -> None:
    # The peers' module default is bicubic; the config's bilinear is what the fixture matches.
    bicubic = K3Vision(dataclasses.replace(model.config, pos_emb_interpolation_mode="bicubic"))
    bicubic.load_state_dict(model.state_dict())
    with torch.no_grad():
        out = bicubic(_pixels("larger_wide"), GRIDS["larger_wide"])
    assert _max_err(out, "larger_wide") > 1000 * TOL


def _copy_fixture(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(FIXTURE / "config.json", folder / "config.json")
    return folder


def test_bad_tensors_named_in_one_error(tmp_path: Path) -> None:
    folder = _copy_fixture(tmp_path)
    weights = load_file(str(FIXTURE / "model.safetensors"))
    weights["vision_tower.encoder.blocks.1.wq.weight"] = weights.pop(
        "vision_tower.encoder.blocks.1.wqkv.weight")
    weights["mm_projector.proj.2.weight"] = weights["mm_projector.proj.2.weight"][:, :-1].clone()
    weights["mm_projector.pre_norm.weight"] = torch.ones(256)
    # a text-model tensor in the same folder is not the vision loader's business
    weights["language_model.model.embed_tokens.weight"] = torch.zeros(4, 80)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_k3_vision(folder)
    message = str(err.value)
    assert "4 problems" in message
    assert "missing tensor 'vision_tower.encoder.blocks.1.wqkv.weight'" in message
    assert "unexpected tensor 'vision_tower.encoder.blocks.1.wq.weight'" in message
    assert "unexpected tensor 'mm_projector.pre_norm.weight'" in message
    assert "'mm_projector.proj.2.weight': expected shape [80, 256], found [80, 255]" in message
    assert "language_model" not in message


def test_no_vision_config_is_none(tmp_path: Path) -> None:
    folder = tmp_path / "text-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "kimi_k3",
                                                    "text_config": {"hidden_size": 80}}))
    assert load_k3_vision(folder) is None


def test_text_hidden_size_must_agree(tmp_path: Path) -> None:
    folder = _copy_fixture(tmp_path)
    shutil.copy(FIXTURE / "model.safetensors", folder / "model.safetensors")
    raw = json.loads((folder / "config.json").read_text())
    raw["text_config"]["hidden_size"] = 96
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="text_hidden_size=80 differs"):
        load_k3_vision(folder)


def test_save_beside_text_shards_round_trips(model: K3Vision, tmp_path: Path) -> None:
    folder = tmp_path / "k3"
    text = {"language_model.model.embed_tokens.weight": torch.randn(4, 80)}
    save_tensors(folder, text, max_shard_bytes=1)  # sharded text checkpoint with an index
    (folder / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 80}}))
    save_k3_vision(model, folder)
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    assert weight_map["language_model.model.embed_tokens.weight"].startswith("model-0000")
    assert weight_map["vision_tower.encoder.blocks.0.wqkv.weight"] == moonvit.VISION_SHARD
    loaded = load_k3_vision(folder)
    assert loaded is not None and loaded.config == model.config
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_config_names_every_bad_key() -> None:
    raw = json.loads(K3_CONFIG.read_text())["vision_config"]
    assert VisionConfig.from_dict(raw).head_dim == 128
    bad = {**raw, "attn_bias": True, "norm_type": "layernorm", "merge_kernel_size": [2],
           "vt_num_attention_heads": "12"}
    del bad["qkv_hidden_size"]
    with pytest.raises(VisionConfigError) as err:
        VisionConfig.from_dict(bad)
    for key in ("attn_bias", "norm_type", "merge_kernel_size", "vt_num_attention_heads",
                "qkv_hidden_size: missing"):
        assert key in str(err.value)
    with pytest.raises(VisionConfigError, match="multiple of 4"):
        VisionConfig.from_dict({**raw, "qkv_hidden_size": 1512})  # head dim 126
    assert VisionConfig.from_dict(VisionConfig.from_dict(raw).to_dict()) == \
        VisionConfig.from_dict(raw)


def test_refuses_video_and_bad_grids(model: K3Vision) -> None:
    pixels = _pixels("table")
    with pytest.raises(ValueError, match="only still images"):
        model(pixels, [(2, 4, 8)])
    with pytest.raises(ValueError, match="cover 60 patches but pixel_values holds 64"):
        model(pixels, [(1, 6, 10)])
    with pytest.raises(ValueError, match="multiples of merge_kernel_size"):
        model(pixels, [(1, 1, 64)])


def test_parameter_count_and_flops() -> None:
    c = VisionConfig.from_dict(json.loads(K3_CONFIG.read_text())["vision_config"])
    d, q, i, layers = 1024, 1536, 4096, 27
    tower = 3 * 14 * 14 * d + 64 * 64 * d + layers * (2 * d + d * 3 * q + q * d + 2 * d * i) + d
    projector = 4 * d * 4 * d + 4 * d * 7168 + 7168
    assert vision_params(c) == tower + projector
    assert round(tower / 1e6) == 401  # the reference page's "~401M parameters" (tower)
    # A 28x28-pixel image: 4 patches, 1 token. Linears + attention + embed + projector, x2.
    p = 4
    expected = 2 * (p * 3 * 196 * d + layers * (p * (d * 3 * q + q * d + 2 * d * i)
                                               + 2 * p * p * q)
                    + 1 * 4 * d * (4 * d + 7168))
    assert vision_flops_per_image(c, (1, 2, 2)) == expected
    big = vision_flops_per_image(c, (1, 64, 64))
    assert math.isclose(big / 1e12, 6.13, rel_tol=0.01)
