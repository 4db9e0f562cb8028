"""The DSpark draft: published shapes, checkpoint round trips, cache semantics, heads."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from serve_app.cli import inspect_checkpoint
from serve_app.models.checkpoint import DTYPE_NAMES, CheckpointError, read_index
from serve_app.models.dspark import (
    DSparkDraft,
    expected_tensors,
    load_dspark,
    save_dspark,
    survival_draft_count,
)
from serve_app.models.dspark_config import DSparkConfig
from serve_app.models.kv_cache import PagedKVCache
from serve_app.models.layers import apply_rotary, rope_inv_freq

PUBLISHED_CONFIG = Path(__file__).resolve().parents[1] / "serve_app/assets/kimi-k3-dspark-config.json"

# RadixArk/Kimi-K3-DSpark's tensors: name -> shape for the published config.
PUBLISHED_SHAPES: dict[str, list[int]] = {
    "fc.weight": [7168, 35840],
    "hidden_norm.weight": [7168],
    "norm.weight": [7168],
    "markov_head.markov_w1.weight": [163840, 256],
    "markov_head.markov_w2.weight": [163840, 256],
    "confidence_head.proj.weight": [1, 7424],
    "confidence_head.proj.bias": [1],
}
for _i in range(5):
    _p = f"layers.{_i}."
    PUBLISHED_SHAPES |= {
        _p + "self_attn.q_proj.weight": [4096, 7168],
        _p + "self_attn.k_proj.weight": [1024, 7168],
        _p + "self_attn.v_proj.weight": [1024, 7168],
        _p + "self_attn.o_proj.weight": [7168, 4096],
        _p + "self_attn.q_norm.weight": [64],
        _p + "self_attn.k_norm.weight": [64],
        _p + "mlp.gate_proj.weight": [14336, 7168],
        _p + "mlp.up_proj.weight": [14336, 7168],
        _p + "mlp.down_proj.weight": [7168, 14336],
        _p + "input_layernorm.weight": [7168],
        _p + "post_attention_layernorm.weight": [7168],
    }


def tiny_config(**overrides: object) -> DSparkConfig:
    raw: dict[str, object] = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 97,
        "max_position_embeddings": 4096, "block_size": 5, "num_target_layers": 6,
        "rms_norm_eps": 1e-5, "dtype": "float32",
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 256},
        "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 96, "markov_rank": 6,
                          "markov_head_type": "vanilla", "enable_confidence_head": True,
                          "confidence_head_with_markov": True},
    }
    raw.update(overrides)
    return DSparkConfig.from_dict(raw, "tiny")


def make_draft(seed: int = 0, **overrides: object) -> DSparkDraft:
    torch.manual_seed(seed)
    draft = DSparkDraft(tiny_config(**overrides)).eval()
    # Norm weights start at 1; perturb them so a wrong norm placement changes the outputs.
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return draft


def shared_weights(draft: DSparkDraft, g: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random embedding and LM head the draft shares with its target, and a tap row's width."""
    cfg = draft.config
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    return embed, lm_head, len(cfg.target_layer_ids) * cfg.target_hidden_size


# --- the published checkpoint ------------------------------------------------------------------


def test_published_config_parameter_count_and_tensor_names() -> None:
    config = DSparkConfig.from_file(PUBLISHED_CONFIG)
    expected = expected_tensors(config)
    assert {k: list(v.shape) for k, v in expected.items()} == PUBLISHED_SHAPES
    assert len(expected) == 62
    assert sum(math.prod(v.shape) for v in expected.values()) == 2_249_289_601
    assert config.target_layer_ids == (7, 23, 51, 67, 83)
    assert config.block_size == 7 and config.mask_token_id == 163824 and config.markov_rank == 256


def write_sparse_checkpoint(folder: Path, shapes: dict[str, list[int]], dtype: str = "BF16",
                            config: Path | None = None, prefix: str = "") -> Path:
    """A real safetensors file with the given names and shapes whose data is a sparse hole:
    full-size on paper, a few KB on disk."""
    folder.mkdir(parents=True, exist_ok=True)
    itemsize = 2 if dtype in ("BF16", "F16") else 4
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * itemsize
        header[prefix + name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = folder / "model.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    if config is not None:
        (folder / "config.json").write_text(config.read_text())
    return path


def test_inspect_reports_published_checkpoint_from_headers(tmp_path: Path) -> None:
    write_sparse_checkpoint(tmp_path, PUBLISHED_SHAPES, config=PUBLISHED_CONFIG, prefix="model.")
    report = inspect_checkpoint(tmp_path)
    assert report["parameters"] == 2_249_289_601
    assert report["tensors"] == 62
    assert report["dtype"] == "BF16"
    assert report["target_layer_ids"] == [7, 23, 51, 67, 83]
    assert report["block_size"] == 7 and report["verify_width"] == 8
    assert report["markov_rank"] == 256
    assert report["memory_bytes"]["16-bit"] == 2 * 2_249_289_601
    assert report["memory_bytes"]["4-bit"] == math.ceil(2_249_289_601 / 2)


def test_inspect_cli_lists_every_bad_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from serve_app.cli import main

    shapes = dict(PUBLISHED_SHAPES)
    del shapes["norm.weight"]
    shapes["fc.weight"] = [7168, 28672]
    shapes["extra.weight"] = [3]
    write_sparse_checkpoint(tmp_path, shapes, config=PUBLISHED_CONFIG)
    assert main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "3 problems" in err
    assert "missing tensor 'norm.weight'" in err
    assert "'fc.weight': expected shape [7168, 35840], found [7168, 28672]" in err
    assert "unexpected tensor 'extra.weight'" in err
    assert "Traceback" not in err


# --- round trips -------------------------------------------------------------------------------


def _draft_once(draft: DSparkDraft, seed: int = 1) -> torch.Tensor:
    cfg = draft.config
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    cache = draft.new_cache(256)
    for rid, n in (("a", 9), ("b", 4)):
        cache.add(rid)
        taps = torch.randn(n, len(cfg.target_layer_ids) * cfg.target_hidden_size, generator=g)
        draft.append_context(cache, [rid], [taps])
    out = draft.draft(cache, ["a", "b"], torch.tensor([3, 5]), embed, lm_head)
    return torch.cat([out.logits.flatten(), out.confidence.flatten()])  # type: ignore[union-attr]


@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_save_load_gives_identical_outputs(tmp_path: Path, max_shard_bytes: int | None) -> None:
    draft = make_draft()
    save_dspark(draft, tmp_path, max_shard_bytes=max_shard_bytes)
    if max_shard_bytes:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = load_dspark(tmp_path)
    assert loaded.config == draft.config
    original, restored = draft.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original)
    # Bit-identical weights; the outputs may differ in the last ulp only because the mapped
    # tensors are not 64-byte aligned and BLAS picks another kernel for them.
    torch.testing.assert_close(_draft_once(draft), _draft_once(loaded), rtol=1e-6, atol=1e-6)


def test_load_casts_dtype_and_is_memory_mapped(tmp_path: Path) -> None:
    save_dspark(make_draft(), tmp_path)
    loaded = load_dspark(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    same = load_dspark(tmp_path)
    # fp32 file loaded as fp32: parameters are views of the file mapping, not copies.
    size = (tmp_path / "model.safetensors").stat().st_size
    assert same.fc.weight.untyped_storage().nbytes() == size


# --- the draft KV cache: incremental equals recompute from scratch ------------------------------


def reference_draft_logits(draft: DSparkDraft, taps: torch.Tensor, anchor: int,
                           embed: torch.Tensor, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, everything recomputed from its full tap history with explicit ops.
    Returns (base logits [gamma, V], final hidden [gamma, H])."""
    cfg = draft.config
    n, gamma = taps.shape[0], cfg.block_size
    ctx = draft.hidden_norm(taps @ draft.fc.weight.T)
    ids = torch.tensor([anchor] + [cfg.mask_token_id] * (gamma - 1))
    x = embed[ids]
    cos_c, sin_c = draft.rotary(torch.arange(n))
    cos_b, sin_b = draft.rotary(torch.arange(n, n + gamma))
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    for layer in draft.layers:
        at = layer.self_attn
        h = layer.input_layernorm(x)
        q = at.q_norm((h @ at.q_proj.weight.T).view(gamma, -1, cfg.head_dim))
        q = apply_rotary(q, cos_b[:, None], sin_b[:, None])

        def kv(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, at=at) -> tuple[torch.Tensor, torch.Tensor]:
            k = at.k_norm((rows @ at.k_proj.weight.T).view(rows.shape[0], -1, cfg.head_dim))
            return apply_rotary(k, cos[:, None], sin[:, None]), (rows @ at.v_proj.weight.T).view(rows.shape[0], -1, cfg.head_dim)

        kc, vc = kv(ctx, cos_c, sin_c)
        kb, vb = kv(h, cos_b, sin_b)
        k = torch.cat([kc, kb]).repeat_interleave(rep, dim=1)
        v = torch.cat([vc, vb]).repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(gamma, -1)
        x = x + attn @ at.o_proj.weight.T
        h = layer.post_attention_layernorm(x)
        m = layer.mlp
        x = x + (F.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    hidden = draft.norm(x)
    return hidden @ lm_head.T, hidden


def test_cached_drafting_equals_recompute_from_scratch() -> None:
    draft = make_draft(seed=3)
    cfg = draft.config
    g = torch.Generator().manual_seed(7)
    embed, lm_head, tap_dim = shared_weights(draft, g)
    rids = ["r0", "r1", "r2"]
    history = {r: torch.randn(n, tap_dim, generator=g) for r, n in zip(rids, (5, 17, 33), strict=True)}
    cache = draft.new_cache(capacity_tokens=512, page_size=4)
    for r in rids:
        cache.add(r)
    draft.append_context(cache, rids, [history[r] for r in rids])
    anchors = {r: int(torch.randint(0, cfg.vocab_size - 1, (1,), generator=g)) for r in rids}
    # Several verify/commit cycles with different accepted counts per request (0..gamma).
    accepted_schedule = [(0, 3, 5), (5, 0, 2), (1, 4, 0)]
    for accepted in accepted_schedule:
        out = draft.draft(cache, rids, torch.tensor([anchors[r] for r in rids]), embed, lm_head)
        for b, r in enumerate(rids):
            base, _ = reference_draft_logits(draft, history[r], anchors[r], embed, lm_head)
            torch.testing.assert_close(out.logits[b] - _markov(draft, anchors[r], out.tokens[b]), base,
                                       rtol=1e-4, atol=1e-4)
        # Commit anchor + accepted drafts: accepted+1 new target rows per request.
        new_rows = [torch.randn(a + 1, tap_dim, generator=g) for a in accepted]
        draft.append_context(cache, rids, new_rows)
        for b, r in enumerate(rids):
            history[r] = torch.cat([history[r], new_rows[b]])
            anchors[r] = int(torch.randint(0, cfg.vocab_size - 1, (1,), generator=g))
            assert cache.length(r) == history[r].shape[0]
    # Batch composition must not matter: one request alone gives the same drafts.
    solo = draft.draft(cache, ["r1"], torch.tensor([anchors["r1"]]), embed, lm_head)
    both = draft.draft(cache, rids, torch.tensor([anchors[r] for r in rids]), embed, lm_head)
    torch.testing.assert_close(solo.logits[0], both.logits[1], rtol=1e-5, atol=1e-5)


def _output_heads(cfg: DSparkConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Random stand-ins for the target's embedding table and LM head."""
    return torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size)


def _draft_with_cache(
    seed: int, rids: list[str]
) -> tuple[DSparkDraft, torch.Tensor, torch.Tensor, PagedKVCache]:
    """make_draft(seed), the output heads, and a 64-token cache holding `rids` (no context)."""
    draft = make_draft(seed=seed)
    embed, lm_head = _output_heads(draft.config)
    cache = draft.new_cache(64)
    for r in rids:
        cache.add(r)
    return draft, embed, lm_head, cache


def _taps(cfg: DSparkConfig, n: int) -> torch.Tensor:
    return torch.randn(n, len(cfg.target_layer_ids) * cfg.target_hidden_size)


def _markov(draft: DSparkDraft, anchor: int, tokens: torch.Tensor) -> torch.Tensor:
    prev = torch.cat([torch.tensor([anchor]), tokens[:-1]])
    mh = draft.markov_head
    assert mh is not None
    return mh.markov_w1.weight[prev] @ mh.markov_w2.weight.T


def test_truncate_then_append_matches_fresh_cache() -> None:
    draft = make_draft(seed=5)
    cfg = draft.config
    tap_dim = len(cfg.target_layer_ids) * cfg.target_hidden_size
    rows = torch.randn(20, tap_dim)
    other = torch.randn(6, tap_dim)
    cache = draft.new_cache(128, page_size=4)
    cache.add("x")
    draft.append_context(cache, ["x"], [torch.cat([rows[:14], other])])
    cache.truncate("x", 14)
    draft.append_context(cache, ["x"], [rows[14:]])
    fresh = draft.new_cache(128, page_size=4)
    fresh.add("x")
    draft.append_context(fresh, ["x"], [rows])
    embed, lm_head = _output_heads(cfg)
    a = draft.draft(cache, ["x"], torch.tensor([1]), embed, lm_head)
    b = draft.draft(fresh, ["x"], torch.tensor([1]), embed, lm_head)
    torch.testing.assert_close(a.logits, b.logits)
    assert cache.allocator.used_tokens == fresh.allocator.used_tokens == 20


# --- heads ---------------------------------------------------------------------------------------


def test_markov_and_confidence_follow_the_formulas() -> None:
    draft, embed, lm_head, cache = _draft_with_cache(11, ["q"])
    cfg = draft.config
    taps = _taps(cfg, 7)
    draft.append_context(cache, ["q"], [taps])
    out = draft.draft(cache, ["q"], torch.tensor([42]), embed, lm_head)
    base, hidden = reference_draft_logits(draft, taps, 42, embed, lm_head)
    w1 = draft.markov_head.markov_w1.weight  # type: ignore[union-attr]
    w2 = draft.markov_head.markov_w2.weight  # type: ignore[union-attr]
    proj = draft.confidence_head.proj  # type: ignore[union-attr]
    prev = 42
    for k in range(cfg.block_size):
        logits = base[k] + w2 @ w1[prev]
        tok = int(logits.argmax())
        conf = torch.sigmoid(proj.weight[0] @ torch.cat([hidden[k], w1[prev]]) + proj.bias[0])
        assert int(out.tokens[0, k]) == tok
        torch.testing.assert_close(out.logits[0, k], logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.confidence[0, k], conf, rtol=1e-4, atol=1e-5)  # type: ignore[index]
        prev = tok


def test_sampled_drafts_return_their_distribution() -> None:
    draft, embed, lm_head, cache = _draft_with_cache(2, ["g", "s"])
    cfg = draft.config
    taps = _taps(cfg, 5)
    draft.append_context(cache, ["g", "s"], [taps, taps])
    temps = torch.tensor([0.0, 0.7])
    gen = torch.Generator().manual_seed(0)
    out = draft.draft(cache, ["g", "s"], torch.tensor([4, 4]), embed, lm_head, temps, gen)
    assert out.probs is not None
    # Greedy row: one-hot q at the argmax of the corrected logits.
    assert torch.equal(out.probs[0].argmax(-1), out.tokens[0])
    assert torch.equal(out.probs[0].sum(-1), torch.ones(cfg.block_size))
    # Sampled row: q = softmax(corrected logits / T), and drafts are drawn from it.
    torch.testing.assert_close(out.probs[1], torch.softmax(out.logits[1] / 0.7, -1))
    assert bool((out.probs[1].gather(-1, out.tokens[1, :, None]) > 0).all())
    # The Markov chain follows the sampled tokens: row k's correction uses token k-1.
    torch.testing.assert_close(out.logits[1] - _markov(draft, 4, out.tokens[1]),
                               out.logits[0] - _markov(draft, 4, out.tokens[0]), rtol=1e-4, atol=1e-4)


def test_all_greedy_batches_skip_the_draft_distributions() -> None:
    draft, embed, lm_head, cache = _draft_with_cache(2, ["g"])
    cfg = draft.config
    draft.append_context(cache, ["g"], [_taps(cfg, 5)])
    out = draft.draft(cache, ["g"], torch.tensor([4]), embed, lm_head, 0.0)
    assert out.probs is None and out.tokens.shape == (1, cfg.block_size)


def test_survival_draft_count() -> None:
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.1], [0.5, 0.9, 0.9, 0.9], [0.99, 0.99, 0.99, 0.99]])
    # survival: [.9 .81 .729 .07], [.5 .45 ...], [.99 .98 .97 .96]
    assert survival_draft_count(conf, 0.7).tolist() == [3, 1, 4]
    assert survival_draft_count(conf, 0.0).tolist() == [4, 4, 4]


def test_yarn_rope_matches_sglang_parameters() -> None:
    config = DSparkConfig.from_file(PUBLISHED_CONFIG)
    inv_freq, scale = rope_inv_freq(config.head_dim, config.rope_parameters)
    assert scale == pytest.approx(0.1 * math.log(16.0) + 1.0)
    pos_freqs = 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    # Frequencies below the ramp keep their value, above it are divided by the factor (16).
    torch.testing.assert_close(inv_freq[:20], (1 / pos_freqs[:20]).float())
    torch.testing.assert_close(inv_freq[33:], (1 / (16 * pos_freqs[33:])).float())
    assert bool(((inv_freq[20:33] < 1 / pos_freqs[20:33]) & (inv_freq[20:33] > 1 / (16 * pos_freqs[20:33]))).all())


# --- corrupt inputs ------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    save_dspark(make_draft(), tmp_path)
    return tmp_path


def _rewrite(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for k, v in change.items():
        if v is None:
            del tensors[k]
        else:
            tensors[k] = v
    save_file(tensors, folder / "model.safetensors")


def test_truncated_file_is_named(saved: Path) -> None:
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated") as exc:
        load_dspark(saved)
    assert "'norm.weight'" in str(exc.value) or "tensor '" in str(exc.value)


def test_missing_tensor_is_named(saved: Path) -> None:
    _rewrite(saved, {"layers.1.mlp.up_proj.weight": None})
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.mlp\.up_proj\.weight': expected shape \[64, 32\]"):
        load_dspark(saved)


def test_wrong_shape_is_named(saved: Path) -> None:
    _rewrite(saved, {"hidden_norm.weight": torch.ones(31)})
    with pytest.raises(CheckpointError, match=r"'hidden_norm\.weight': expected shape \[32\], found \[31\]"):
        load_dspark(saved)


def test_wrong_dtype_is_named(saved: Path) -> None:
    _rewrite(saved, {"norm.weight": torch.ones(32, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match=r"'norm\.weight': expected dtype BF16/F16/F32, found I32"):
        load_dspark(saved)


def test_all_problems_in_one_error(saved: Path) -> None:
    _rewrite(saved, {"norm.weight": None, "fc.weight": torch.ones(3, 3), "junk": torch.ones(1)})
    with pytest.raises(CheckpointError) as exc:
        load_dspark(saved)
    assert len(exc.value.problems) == 3
    assert "'norm.weight'" in str(exc.value) and "'fc.weight'" in str(exc.value) and "'junk'" in str(exc.value)


def test_garbage_header_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_index(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        read_index(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dflash_config": {"target_layer_ids": [1, 6], "mask_token_id": 96, "markov_rank": 6}},
         r"target_layer_ids \[6\] must be in \[0, num_target_layers=6\)"),
        ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": 97, "markov_rank": 6}},
         r"mask_token_id=97 must be < vocab_size=97"),
        ({"markov_rank": 8}, r"dflash_config\.markov_rank=6 vs markov_rank=8|markov_rank=8 vs dflash_config\.markov_rank=6"),
        ({"hidden_size": None, "block_size": None}, r"hidden_size: missing[\s\S]*block_size: missing"),
        ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": 5, "markov_rank": 6,
                            "markov_head_type": "gated"}}, r"markov_head_type: Input should be 'vanilla' or 'none'"),
    ],
)
def test_bad_configs_name_their_fields(change: dict[str, object], message: str) -> None:
    from serve_app.models.dspark_config import DSparkConfigError

    raw = tiny_config().to_dict()
    for k, v in change.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    with pytest.raises(DSparkConfigError, match=message):
        DSparkConfig.from_dict(raw)


def test_config_keys_resolve_from_all_three_places() -> None:
    raw = tiny_config().to_dict()
    nested = raw.pop("dflash_config")
    raw["markov_rank"] = nested.pop("markov_rank")
    raw["dspark_target_layer_ids"] = nested.pop("target_layer_ids")
    raw["dspark_noise_token_id"] = nested.pop("mask_token_id")
    raw["dflash_config"] = nested
    config = DSparkConfig.from_dict(raw)
    assert config == tiny_config()


def test_cli_config_error_has_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from serve_app.cli import main

    raw = json.loads(PUBLISHED_CONFIG.read_text())
    raw["dflash_config"]["mask_token_id"] = 200000
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "mask_token_id=200000 must be < vocab_size=163840" in err
    assert "Traceback" not in err


def test_dtype_names_cover_torch_floats() -> None:
    assert DTYPE_NAMES[torch.bfloat16] == "BF16" and DTYPE_NAMES[torch.float32] == "F32"


def test_the_proposer_writes_held_context_rows_when_it_next_drafts() -> None:
    """A plain step only holds the draft's taps (DSparkProposer.append); the rows are written
    when the request is next drafted for, exported or shared, as if written every step."""
    from types import SimpleNamespace

    from serve_app.engines.reference.proposer import HOLD_TOKENS, DSparkProposer
    from serve_app.engines.reference.sampling import SamplingParams
    from serve_app.models.kv_cache import PagedAllocator

    draft = make_draft(seed=5)
    g = torch.Generator().manual_seed(11)
    embed, lm_head, tap_dim = shared_weights(draft, g)
    holding, writing = (DSparkProposer(draft, embed, lm_head, PagedAllocator(2048, 4))
                        for _ in range(2))
    rids = ["a", "b"]
    for p in (holding, writing):
        for rid in rids:
            p.add(rid)
    written = 0
    for n in (9, 1, 3, 1, 1):  # a prefill chunk, then decode and verify steps
        rows = [torch.randn(n, tap_dim, generator=g) for _ in rids]
        written += n
        for p in (holding, writing):
            for rid in rids:  # the target's forward took the pages
                p.cache.allocator.reserve(rid, written)
            p.append(rids, rows)
        writing.settle(rids)
        assert holding.cache.length("a") == 0 and writing.cache.length("a") == written
    greedy = SamplingParams(temperature=0.0)
    seq = SimpleNamespace(request_id="a", anchor=3, params=greedy, generator=None)
    torch.testing.assert_close(holding.propose([seq]).logits, writing.propose([seq]).logits)
    assert holding.cache.length("a") == 15 and holding.cache.length("b") == 0
    for name, rows in holding.export("b").items():  # an export writes what it held
        torch.testing.assert_close(rows, writing.export("b")[name])
    # A request never drafted for holds at most HOLD_TOKENS tokens of rows.
    for n in (HOLD_TOKENS - 1, 1):
        holding.cache.allocator.reserve("a", holding.cache.allocator.length("a") + n)
        holding.append(["a"], [torch.randn(n, tap_dim, generator=g)])
        assert holding.cache.length("a") == (15 if n > 1 else 15 + HOLD_TOKENS)
    assert not holding.held.get("a")
