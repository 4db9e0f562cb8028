"""The Kimi K2 / DeepseekV3 target: config parsing, absorbed MLA against a direct reference,
latent-cache decoding, MoE routing, FP8 checkpoints, strict loading, tensor parallelism."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from spec_helpers import run_ranks

from serve_app.engines.reference.builder import release_tensor_parallel
from serve_app.models.checkpoint import (
    CheckpointError,
    dequantize_fp8_block,
    expected_from_module,
    quantize_fp8_block,
    read_index,
)
from serve_app.models.kimi import KimiForCausalLM, KimiMoE
from serve_app.models.kimi_config import KimiConfig, KimiConfigError
from serve_app.models.kimi_weights import checkpoint_specs, load_kimi, save_kimi
from serve_app.models.kv_capacity import KVCapacityError
from serve_app.models.layers import rope_inv_freq
from serve_app.netutil import free_port

K2_CONFIG = Path(__file__).resolve().parents[1] / "capacity/data/kimi-k2-instruct-config.json"

TINY: dict[str, object] = {
    "hidden_size": 64, "intermediate_size": 192, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1,
    "rms_norm_eps": 1e-6, "vocab_size": 256, "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    # Short original context and mscale != mscale_all_dim: YaRN's ramp, cos/sin factor and
    # softmax factor all differ from 1 within the test sequences.
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7},
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def tiny_config(**overrides: object) -> KimiConfig:
    return KimiConfig.from_dict({**TINY, **overrides})


def make_model(seed: int = 0, **overrides: object) -> KimiForCausalLM:
    torch.manual_seed(seed)
    model = KimiForCausalLM(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # norms must visibly matter
            elif name.endswith(("gate.weight", "e_score_correction_bias")):
                p.normal_(0.0, 0.2)  # both the router scores and the bias steer routing
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("lm_head.weight"):
                p.normal_(0.0, 0.3)
    return model.eval()


# --- an independent, direct (non-absorbed) reference ------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _rope_hf(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF modeling_deepseek: de-interleave (pairs -> halves), then rotate-half."""
    d = t.shape[-1]
    t = t.unflatten(-1, (d // 2, 2)).transpose(-1, -2).flatten(-2)
    half1, half2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-half2, half1), dim=-1) * sin


def route_reference(cfg: KimiConfig, gate_w: torch.Tensor, bias: torch.Tensor,
                    h: torch.Tensor) -> list[tuple[list[int], list[float]]]:
    """The DeepseekV3 noaux_tc rule token by token, in plain Python."""
    out = []
    per_group = cfg.n_routed_experts // cfg.n_group
    for tok in h:
        scores = torch.sigmoid(gate_w @ tok).tolist()
        biased = [s + b for s, b in zip(scores, bias.tolist(), strict=True)]
        group_score = [sum(sorted(biased[g * per_group:(g + 1) * per_group], reverse=True)[:2])
                       for g in range(cfg.n_group)]
        groups = sorted(range(cfg.n_group), key=lambda g: -group_score[g])[:cfg.topk_group]
        candidates = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(candidates, key=lambda e: -biased[e])[:cfg.num_experts_per_tok]
        w = [scores[e] for e in chosen]
        total = sum(w) if cfg.norm_topk_prob else 1.0
        out.append((chosen, [x / total * cfg.routed_scaling_factor for x in w]))
    return out


def _mlp_ref(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T


def reference_forward(model: KimiForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits [S, V] and every layer's output [S, hidden] for one sequence, computed the
    textbook way: per-head K/V expanded from kv_b_proj, causal softmax attention."""
    c = model.config
    eps = c.rms_norm_eps
    s = ids.shape[0]
    nope, rope, vd, heads = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.num_attention_heads
    rs = c.rope_scaling
    assert rs is not None
    factor = float(rs["factor"])
    inv_freq, _ = rope_inv_freq(rope, {**rs, "rope_theta": c.rope_theta, "rope_type": "yarn"})
    freqs = torch.arange(s, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    attn_factor = _mscale(factor, rs["mscale"]) / _mscale(factor, rs["mscale_all_dim"])
    cos, sin = emb.cos() * attn_factor, emb.sin() * attn_factor
    scale = (nope + rope) ** -0.5 * _mscale(factor, rs["mscale_all_dim"]) ** 2
    causal = torch.ones(s, s, dtype=torch.bool).tril()

    x = model.model.embed_tokens.weight[ids]
    outputs = []
    for layer in model.model.layers:
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, eps)
        q = _rms(h @ a.q_a_proj.weight.T, a.q_a_layernorm.weight, eps) @ a.q_b_proj.weight.T
        q = q.view(s, heads, nope + rope).transpose(0, 1)  # [H, S, qk]
        kv = h @ a.kv_a_proj_with_mqa.weight.T
        ckv, k_pe = kv[:, : c.kv_lora_rank], kv[:, c.kv_lora_rank :]
        kvb = (_rms(ckv, a.kv_a_layernorm.weight, eps) @ a.kv_b_proj.weight.T)
        kvb = kvb.view(s, heads, nope + vd).transpose(0, 1)  # [H, S, nope + v]
        k_nope, v = kvb[..., :nope], kvb[..., nope:]
        q = torch.cat([q[..., :nope], _rope_hf(q[..., nope:], cos, sin)], dim=-1)
        k = torch.cat([k_nope, _rope_hf(k_pe, cos, sin).expand(heads, s, rope)], dim=-1)
        att = (q @ k.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(s, heads * vd)
        x = x + o @ a.o_proj.weight.T
        h = _rms(x, layer.post_attention_layernorm.weight, eps)
        if isinstance(layer.mlp, KimiMoE):
            moe = layer.mlp
            routes = route_reference(c, moe.gate.weight, moe.gate.e_score_correction_bias, h)
            rows = []
            for t, (chosen, w) in enumerate(routes):
                row = _mlp_ref(moe.shared_experts, h[t])
                for e, we in zip(chosen, w, strict=True):
                    row = row + we * _mlp_ref(moe.experts[str(e)], h[t])
                rows.append(row)
            x = x + torch.stack(rows)
        else:
            x = x + _mlp_ref(layer.mlp, h)
        outputs.append(x)
    logits = _rms(x, model.model.norm.weight, eps) @ model.lm_head.weight.T
    return logits, outputs


# --- helpers ----------------------------------------------------------------------------------


def full_forward(model: KimiForCausalLM, seq: torch.Tensor, capture: tuple[int, ...] = ()):
    """The whole sequence in one forward on a fresh cache."""
    cache = model.new_cache(256, page_size=4)
    cache.add("r")
    return model(seq[None], cache, ["r"], torch.tensor([len(seq)]), capture_layers=capture)


# Steps of a batched incremental run over 3 requests: new tokens per request per step
# (0 = the request idles in the batch); chunked prefill, then single tokens and blocks.
SCHEDULE = [[5, 3, 7], [6, 0, 2], [1, 1, 1], [3, 1, 2], [1, 4, 1], [2, 2, 1]]
PAD = 255


def run_schedule(model: KimiForCausalLM, seqs: list[torch.Tensor], capture: tuple[int, ...] = ()):
    """Feed `seqs` step by step, right-padded into one batch; returns, per step and request,
    (start, logits of the new tokens, taps of the new tokens) and the cache."""
    cache = model.new_cache(512, page_size=4)
    rids = ["a", "b", "c"]
    for r in rids:
        cache.add(r)
    pos = [0, 0, 0]
    results = []
    for counts in SCHEDULE:
        t = max(counts)
        ids = torch.full((3, t), PAD, dtype=torch.long)
        for b, n in enumerate(counts):
            ids[b, :n] = seqs[b][pos[b]:pos[b] + n]
        out = model(ids, cache, rids, torch.tensor(counts), capture_layers=capture)
        step = []
        for b, n in enumerate(counts):
            taps = out.taps[b, :n] if out.taps is not None else None
            step.append((pos[b], out.logits[b, :n], taps))
            pos[b] += n
        results.append(step)
    assert [cache.length(r) for r in rids] == pos
    return results, cache


def random_seqs(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    totals = [sum(step[b] for step in SCHEDULE) for b in range(3)]
    return [torch.randint(0, PAD, (n,), generator=g) for n in totals]


# --- config -----------------------------------------------------------------------------------


def test_k2_config_parses_and_round_trips() -> None:
    raw = json.loads(K2_CONFIG.read_text())
    cfg = KimiConfig.from_file(K2_CONFIG)
    for key in ("hidden_size", "kv_lora_rank", "q_lora_rank", "n_routed_experts",
                "num_experts_per_tok", "routed_scaling_factor", "first_k_dense_replace"):
        assert getattr(cfg, key) == raw[key]
    assert cfg.quantization_config is not None
    assert list(cfg.quantization_config.weight_block_size) == raw["quantization_config"]["weight_block_size"]
    assert KimiConfig.from_dict(cfg.to_dict()) == cfg
    assert KimiConfig.from_dict(tiny_config().to_dict()) == tiny_config()
    # softmax scale follows qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2
    rs = raw["rope_scaling"]
    expect = (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]) ** -0.5 * _mscale(
        rs["factor"], rs["mscale_all_dim"]) ** 2
    assert cfg.softmax_scale == pytest.approx(expect)
    assert cfg.latent_dim == raw["kv_lora_rank"] + raw["qk_rope_head_dim"]

    specs = checkpoint_specs(cfg)
    bn, bk = raw["quantization_config"]["weight_block_size"]
    w = specs["model.layers.1.mlp.experts.383.down_proj.weight"]
    assert w.dtypes == {"F8_E4M3"}
    assert specs["model.layers.1.mlp.experts.383.down_proj.weight_scale_inv"].shape == (
        -(-w.shape[0] // bn), -(-w.shape[1] // bk))
    assert "model.layers.5.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in specs
    for high_precision in ("model.layers.1.mlp.gate.weight", "model.embed_tokens.weight",
                           "lm_head.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"):
        assert "F8_E4M3" not in specs[high_precision].dtypes
        assert high_precision + "_scale_inv" not in specs


def test_config_errors_name_every_field() -> None:
    raw = {k: v for k, v in TINY.items() if k not in ("hidden_size", "kv_lora_rank")}
    with pytest.raises(KimiConfigError) as err:
        KimiConfig.from_dict({**raw, "tie_word_embeddings": True, "scoring_func": "relu"})
    msg = str(err.value)
    for field in ("hidden_size", "kv_lora_rank", "tie_word_embeddings", "scoring_func"):
        assert field in msg
    with pytest.raises(KimiConfigError, match="n_group"):
        tiny_config(n_group=3)
    with pytest.raises(KimiConfigError, match="rope_scaling"):
        tiny_config(rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(KimiConfigError) as err:
        tiny_config().validate_tp(3)
    assert "num_attention_heads" in str(err.value) and "n_routed_experts" in str(err.value)


def test_transformers5_rope_parameters_are_read() -> None:
    """transformers 5 saves `rope_parameters` (theta + YaRN fields) instead of `rope_theta` /
    `rope_scaling`: it is read where the legacy fields are absent, a contradiction is an error."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}
    v5 = {k: v for k, v in TINY.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 50_000.0, **yarn}
    cfg = KimiConfig.from_dict(v5)
    assert cfg.rope_theta == 50_000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 4.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 16
    assert cfg.rope_scaling["mscale_all_dim"] == 0.7
    assert cfg.rope_attention_factor != 1.0 and cfg.softmax_scale == tiny_config().softmax_scale
    torch.manual_seed(0)
    new = KimiForCausalLM(cfg).rotary.inv_freq
    old = KimiForCausalLM(tiny_config(rope_theta=10_000.0)).rotary.inv_freq
    expect, _ = rope_inv_freq(cfg.qk_rope_head_dim, {**yarn, "rope_theta": 50_000.0})
    assert torch.equal(new, expect) and not torch.allclose(new, old)
    # The legacy fields, where present and in agreement, are fine; the same config round-trips.
    assert KimiConfig.from_dict({**v5, "rope_theta": 50_000.0}) == cfg
    assert KimiConfig.from_dict(cfg.to_dict()) == cfg
    # A default-type rope_parameters is just a theta.
    plain = KimiConfig.from_dict({**v5, "rope_parameters": {"rope_type": "default",
                                                            "rope_theta": 50_000.0}})
    assert plain.rope_theta == 50_000.0 and plain.rope_scaling is None
    # Both present and disagreeing: one error naming both fields (and every other problem).
    with pytest.raises(KimiConfigError) as err:
        KimiConfig.from_dict({**v5, "rope_theta": 10_000.0})
    assert "rope_theta" in str(err.value) and "rope_parameters.rope_theta" in str(err.value)
    with pytest.raises(KimiConfigError) as err:
        KimiConfig.from_dict({**v5, "rope_scaling": {**yarn, "factor": 8.0}, "hidden_size": 0})
    msg = str(err.value)
    assert "rope_scaling" in msg and "rope_parameters" in msg and "hidden_size" in msg
    with pytest.raises(KimiConfigError, match="rope_parameters"):
        KimiConfig.from_dict({**v5, "rope_scaling": None})


def test_checkpoint_specs_match_module_names() -> None:
    for overrides in ({}, {"q_lora_rank": None, "n_shared_experts": 0, "moe_layer_freq": 2}):
        cfg = tiny_config(**overrides)
        with torch.device("meta"):
            module = expected_from_module(KimiForCausalLM(cfg))
        specs = checkpoint_specs(cfg)
        assert {k: v.shape for k, v in specs.items()} == {k: v.shape for k, v in module.items()}
    # q_lora_rank null -> q_proj; moe_layer_freq=2 after one dense layer -> only layer 2 is MoE.
    assert "model.layers.2.self_attn.q_proj.weight" in specs
    assert "model.layers.2.self_attn.q_a_proj.weight" not in specs
    assert "model.layers.2.mlp.experts.0.up_proj.weight" in specs
    assert "model.layers.2.mlp.shared_experts.up_proj.weight" not in specs
    assert "model.layers.2.mlp.gate_proj.weight" not in specs
    assert "model.layers.1.mlp.gate_proj.weight" in specs
    assert "model.layers.3.mlp.gate_proj.weight" in specs


# --- numerics ---------------------------------------------------------------------------------


def test_absorbed_mla_matches_direct_reference_and_taps() -> None:
    model = make_model()
    seq = random_seqs()[0]
    ref_logits, ref_layers = reference_forward(model, seq)
    out = full_forward(model, seq, capture=(2, 0, 3))
    assert out.logits.dtype == torch.float32
    assert out.logits.shape == (1, len(seq), model.config.vocab_size)
    torch.testing.assert_close(out.logits[0], ref_logits, rtol=1e-4, atol=1e-4)
    expected_taps = torch.cat([ref_layers[2], ref_layers[0], ref_layers[3]], dim=-1)
    torch.testing.assert_close(out.taps[0], expected_taps, rtol=1e-4, atol=1e-4)
    assert full_forward(model, seq).taps is None
    # Guard against a vacuous reference: different weights give different logits.
    other = make_model(seed=5)
    assert not torch.allclose(full_forward(other, seq).logits[0], ref_logits, atol=1e-2)


def test_incremental_decoding_with_padding_matches_full_recompute() -> None:
    model = make_model()
    seqs = random_seqs()
    capture = (1, 3)
    results, cache = run_schedule(model, seqs, capture)
    fulls = [full_forward(model, s, capture) for s in seqs]
    checked = 0
    for step in results:
        for b, (start, logits, taps) in enumerate(step):
            n = logits.shape[0]
            torch.testing.assert_close(logits, fulls[b].logits[0, start:start + n], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(taps, fulls[b].taps[0, start:start + n], rtol=1e-4, atol=1e-4)
            checked += n
    assert checked == sum(len(s) for s in seqs)

    # Roll back request "a" and feed different tokens; request "b" decodes in the same batch.
    keep = 9
    cache.truncate("a", keep)
    g = torch.Generator().manual_seed(7)
    fresh = torch.randint(0, PAD, (4,), generator=g)
    ids = torch.full((2, 4), PAD, dtype=torch.long)
    ids[0] = fresh
    ids[1, 0] = 3
    out = model(ids, cache, ["a", "b"], torch.tensor([4, 1]))
    expect_a = full_forward(model, torch.cat([seqs[0][:keep], fresh])).logits[0, keep:]
    expect_b = full_forward(model, torch.cat([seqs[1], torch.tensor([3])])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], expect_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logits[1, 0], expect_b, rtol=1e-4, atol=1e-4)
    assert cache.length("a") == keep + 4
    # The pre-rollback continuation really differed (rollback was not a no-op).
    assert not torch.allclose(expect_a, fulls[0].logits[0, keep:keep + 4], atol=1e-3)


def test_capacity_error_leaves_cache_untouched() -> None:
    model = make_model()
    cache = model.new_cache(16, page_size=4)
    cache.add("x")
    cache.add("y")
    model(torch.ones(2, 6, dtype=torch.long), cache, ["x", "y"], torch.tensor([6, 6]))
    with pytest.raises(KVCapacityError):
        model(torch.ones(2, 4, dtype=torch.long), cache, ["x", "y"], torch.tensor([1, 4]))
    assert (cache.length("x"), cache.length("y")) == (6, 6)


def test_moe_routing_matches_formulas() -> None:
    model = make_model()
    cfg = model.config
    moe = model.model.layers[1].mlp
    assert isinstance(moe, KimiMoE)
    h = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, ids = moe.gate(h)
    expected = route_reference(cfg, moe.gate.weight, moe.gate.e_score_correction_bias, h)
    unbiased = route_reference(cfg, moe.gate.weight, torch.zeros(cfg.n_routed_experts), h)
    per_group = cfg.n_routed_experts // cfg.n_group
    for t, (chosen, w) in enumerate(expected):
        got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        assert sorted(got) == sorted(chosen)
        for e, we in zip(chosen, w, strict=True):
            assert got[e] == pytest.approx(we, rel=1e-5)
        assert sum(got.values()) == pytest.approx(cfg.routed_scaling_factor, rel=1e-5)
        assert len({e // per_group for e in chosen}) == 1  # topk_group=1: one group only
    # The test is only meaningful if the correction bias changes some choices.
    assert any(sorted(a[0]) != sorted(b[0]) for a, b in zip(expected, unbiased, strict=True))
    # The block output: shared expert + weighted chosen experts.
    y = moe(h)
    for t, (chosen, w) in enumerate(expected):
        row = _mlp_ref(moe.shared_experts, h[t]) + sum(
            we * _mlp_ref(moe.experts[str(e)], h[t]) for e, we in zip(chosen, w, strict=True))
        torch.testing.assert_close(y[t], row, rtol=1e-4, atol=1e-5)


def test_bf16_incremental_close_to_full() -> None:
    model = make_model().to(torch.bfloat16)
    seqs = random_seqs()
    results, cache = run_schedule(model, seqs)
    assert cache.buffers["latent"].dtype == torch.bfloat16
    full = full_forward(model, seqs[2]).logits[0]
    ref = full_forward(make_model(), seqs[2]).logits[0]
    inc = torch.cat([step[2][1] for step in results])
    assert torch.isfinite(inc).all()
    assert (inc - full).abs().max() < 0.1 * ref.abs().max()
    assert (full - ref).abs().max() < 0.1 * ref.abs().max()


# --- checkpoints ------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = make_model()
    save_kimi(model, tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_kimi(tmp_path)
    assert loaded.model.embed_tokens.weight.dtype == torch.float32
    saved = model.state_dict()
    assert all(torch.equal(t, saved[k]) for k, t in loaded.state_dict().items())
    assert loaded.state_dict().keys() == saved.keys()
    # Same weights bit for bit; logits equal up to BLAS rounding (mapped tensors may sit at
    # differently aligned addresses, which changes the kernels' summation order).
    seq = random_seqs()[1]
    torch.testing.assert_close(full_forward(loaded, seq).logits, full_forward(model, seq).logits,
                               rtol=0, atol=1e-5)
    bf16 = load_kimi(tmp_path, dtype=torch.bfloat16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_fp8_checkpoint_dequantizes_blockwise(tmp_path: Path) -> None:
    model = make_model()
    name = "model.layers.0.mlp.gate_proj.weight"  # [192, 64]: two row blocks of 128
    with torch.no_grad():
        model.get_parameter(name)[128:] *= 40.0  # blocks with very different scales
    save_kimi(model, tmp_path, fp8=True)
    infos = read_index(tmp_path)
    assert infos[name].dtype == "F8_E4M3"
    assert infos[name + "_scale_inv"].dtype == "F32"
    assert infos[name + "_scale_inv"].shape == (2, 1)
    assert infos["model.layers.1.mlp.gate.weight"].dtype == "F32"
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in infos
    assert infos["model.layers.2.mlp.experts.5.down_proj.weight"].dtype == "F8_E4M3"

    loaded = load_kimi(tmp_path, dtype=torch.float32)
    original = dict(model.state_dict())
    for key, deq in loaded.state_dict().items():
        if key + "_scale_inv" in infos:
            w = original[key]
            amax = F.max_pool2d(w.abs()[None], 128, ceil_mode=True)[0]
            bound = amax.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
            assert ((deq - w).abs() <= 0.04 * bound + 1e-12).all(), key
        else:
            assert torch.equal(deq, original[key]), key
    seq = random_seqs()[0]
    ref = full_forward(model, seq).logits
    got = full_forward(loaded, seq).logits
    assert (got - ref).norm() / ref.norm() < 0.1

    # Dequantizing a region reads only its blocks and equals the full dequantization sliced.
    q, s = quantize_fp8_block(original[name], (128, 128))
    full = dequantize_fp8_block(q, s, (128, 128))
    part = dequantize_fp8_block(q, s, (128, 128), slice(96, 192), slice(8, 40))
    assert torch.equal(part, full[96:192, 8:40])

    # A missing scale is named.
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.3.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.o_proj\.weight_scale_inv"):
        load_kimi(tmp_path)


def test_strict_load_names_every_problem(tmp_path: Path) -> None:
    save_kimi(make_model(), tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    missing = "model.layers.1.mlp.experts.3.up_proj.weight"
    reshaped = "model.layers.0.self_attn.kv_b_proj.weight"
    extra = "model.layers.0.self_attn.bonus_proj.weight"
    del tensors[missing]
    tensors[reshaped] = tensors[reshaped][:-1].contiguous()
    tensors[extra] = torch.zeros(3, 3)
    save_file(tensors, file)
    with pytest.raises(CheckpointError) as err:
        load_kimi(tmp_path)
    assert len(err.value.problems) == 3
    for name in (missing, reshaped, extra):
        assert name in str(err.value)


# --- tensor parallelism -----------------------------------------------------------------------



def _tp_worker(rank: int, world: int, port: int, folders: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        seqs = random_seqs()
        for i, folder in enumerate(folders):
            model = load_kimi(folder, tp_rank=rank, tp_size=world)
            results, _ = run_schedule(model, seqs, capture=(2,))
            moe = model.model.layers[1].mlp
            torch.save({
                "logits": [[r[1] for r in step] for step in results],
                "taps": [[r[2] for r in step] for step in results],
                "experts": sorted(int(e) for e in moe.experts),
                "q_b_rows": model.model.layers[0].self_attn.q_b_proj.weight.shape[0],
            }, os.path.join(out_dir, f"rank{rank}_{i}.pt"))
            del model, moe
    finally:
        release_tensor_parallel()


def test_tensor_parallel_2_matches_single_rank(tmp_path: Path) -> None:
    model = make_model()
    folders = [tmp_path / "fp32", tmp_path / "fp8"]
    save_kimi(model, folders[0])
    save_kimi(model, folders[1], fp8=True)
    run_ranks(_tp_worker, (2, free_port(), [str(f) for f in folders], str(tmp_path)))
    seqs = random_seqs()
    cfg = model.config
    for i, folder in enumerate(folders):
        single, _ = run_schedule(load_kimi(folder), seqs, capture=(2,))
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}_{i}.pt")
            per_rank = cfg.n_routed_experts // 2
            assert got["experts"] == list(range(rank * per_rank, (rank + 1) * per_rank))
            assert got["q_b_rows"] == cfg.num_attention_heads // 2 * cfg.qk_head_dim
            for s, step in enumerate(single):
                for b, (_, logits, taps) in enumerate(step):
                    torch.testing.assert_close(got["logits"][s][b], logits, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(got["taps"][s][b], taps, rtol=1e-4, atol=1e-4)


def test_mtp_layers_after_the_decoder_are_skipped(tmp_path: Path) -> None:
    model = make_model(num_nextn_predict_layers=1)
    save_kimi(model, tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    mtp = "model.layers.4.eh_proj.weight"  # DeepSeek V3's MTP layer sits after the last layer
    tensors[mtp] = torch.zeros(4, 8)
    save_file(tensors, file)
    seq = random_seqs()[2]
    torch.testing.assert_close(full_forward(load_kimi(tmp_path), seq).logits,
                               full_forward(model, seq).logits, rtol=0, atol=1e-5)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=mtp):
        load_kimi(tmp_path)
