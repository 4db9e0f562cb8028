"""serve_app.models.k3_blocks against naive implementations written here from SGLang
0.5.23's formulas (kimi_k3.py: MLA, FFN / MoE; activation.py: SiTU). Nothing but the weights
is shared with the module: fp32, CPU, the mini-K3 config (or variants of it), seeded weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from serve_app.models.k3_blocks import K3MLA, K3MLP, LatentMoE, situ
from serve_app.models.k3_config import K3Config, k3_layer_tensors
from serve_app.models.layers import column_major_linears

MINI = Path(__file__).parent / "data" / "mini-k3-config.json"
MLA_LAYER, MOE_LAYER, DENSE_LAYER = 3, 3, 0  # mini-K3: layer 3 is MLA + MoE, layer 0 dense


def mini(**overrides: object) -> K3Config:
    raw = json.loads(MINI.read_text())
    raw["text_config"].update(overrides)
    return K3Config.from_dict(raw)


def randomize(module: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def close(got: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> bool:
    """Max abs error within tol of the reference's scale (fp32 sums in different orders)."""
    return bool((got - ref).abs().max() <= tol * ref.abs().max().clamp_min(1.0))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_act(c: K3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiTU written out: SiTU(g) = β tanh(g/β) σ(g); softclip(u) = βₗ tanh(u/βₗ)."""
    b, bl = c.activation_situ_beta, c.activation_situ_linear_beta
    return b * torch.tanh(gate / b) / (1 + torch.exp(-gate)) * (bl * torch.tanh(up / bl))


def ref_mlp(c: K3Config, w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    return ref_act(c, x @ w[f"{p}gate_proj.weight"].T, x @ w[f"{p}up_proj.weight"].T) @ w[
        f"{p}down_proj.weight"
    ].T


# --- SiTU --------------------------------------------------------------------------------------


def test_situ_matches_definition_on_scalars() -> None:
    beta, lb = 4.0, 25.0
    for g, u in [(0.0, 1.0), (0.3, -2.0), (-3.0, 7.0), (12.0, 40.0), (-40.0, -90.0), (2.5, 0.1)]:
        expect = beta * math.tanh(g / beta) * (1 / (1 + math.exp(-g))) * lb * math.tanh(u / lb)
        got = situ(torch.tensor([g, u], dtype=torch.float64), beta, lb)
        # computed in fp32 whatever the input dtype, as SGLang's forward_native does
        assert got.item() == pytest.approx(expect, rel=1e-6, abs=1e-7)


def test_situ_shapes_saturation_and_silu_limits() -> None:
    g = torch.Generator().manual_seed(1)
    gate, up = 6 * torch.randn(5, 7, generator=g), 30 * torch.randn(5, 7, generator=g)
    out = situ(torch.cat([gate, up], -1), 4.0, 25.0)
    assert out.shape == (5, 7) and out.dtype == torch.float32
    # Saturation: SiTU(gate) -> β for large gate, 0 for very negative; up clipped to ±βₗ.
    big = situ(torch.tensor([60.0, 1e4]), 4.0, 25.0)
    assert big.item() == pytest.approx(4.0 * 25.0, rel=1e-6)
    assert situ(torch.tensor([-60.0, 1.0]), 4.0, 25.0).abs().item() < 1e-20
    # SiTU -> SiLU: near 0, and in the limit β, βₗ -> ∞ (βₗ = None: no clip at all).
    small = 0.01 * gate
    silu = torch.nn.functional.silu(small) * up
    # relative error of 4·tanh(g/4) vs g is ~g²/48 (|g| < 0.2 here)
    assert torch.allclose(situ(torch.cat([small, up], -1), 4.0, None), silu, rtol=1e-3)
    silu = torch.nn.functional.silu(gate) * up
    assert torch.allclose(situ(torch.cat([gate, up], -1), 1e6, 1e7), silu, rtol=1e-4, atol=1e-5)
    assert torch.allclose(
        situ(torch.cat([gate, up], -1), 1e6, None), silu, rtol=1e-4, atol=1e-5
    )


def test_situ_in_bf16_computes_in_fp32() -> None:
    x = torch.randn(3, 16)
    assert situ(x.bfloat16(), 4.0, 25.0).dtype == torch.bfloat16
    ref = situ(x.bfloat16().float(), 4.0, 25.0)
    assert torch.allclose(situ(x.bfloat16(), 4.0, 25.0).float(), ref, rtol=1e-2, atol=1e-2)


def test_dense_mlp_matches_reference() -> None:
    c = mini()
    mlp = K3MLP(c, c.intermediate_size)
    randomize(mlp, seed=2, scale=3.0)  # large enough that both betas matter
    w = dict(mlp.state_dict())
    x = torch.randn(2, 5, c.hidden_size, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(mlp(x), ref_mlp(c, w, "", x), rtol=1e-5, atol=1e-5)


def test_silu_hidden_act() -> None:
    c = mini(hidden_act="silu")
    mlp = K3MLP(c, 32)
    x = torch.randn(4, c.hidden_size)
    ref = (torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)) @ mlp.down_proj.weight.T
    assert torch.allclose(mlp(x), ref, atol=1e-6)


# --- LatentMoE ---------------------------------------------------------------------------------


def ref_route(c: K3Config, w: dict[str, torch.Tensor], xt: torch.Tensor) -> dict[int, float]:
    """One token's {expert: weight}, with SGLang's grouped top-k, by hand."""
    e = c.num_experts
    s = [1 / (1 + math.exp(-float(v))) for v in w["gate.weight"] @ xt]
    choice = [s[i] + float(w["gate.e_score_correction_bias"][i]) for i in range(e)]
    per = e // c.num_expert_group
    groups = [list(range(gi * per, (gi + 1) * per)) for gi in range(c.num_expert_group)]
    gscore = [sum(sorted((choice[i] for i in grp), reverse=True)[:2]) for grp in groups]
    kept = sorted(range(len(groups)), key=lambda gi: -gscore[gi])[: c.topk_group]
    cand = [i for gi in kept for i in groups[gi]]
    idx = sorted(cand, key=lambda i: -choice[i])[: c.num_experts_per_token]
    weights = {i: s[i] for i in idx}  # unbiased
    if c.moe_renormalize:
        total = sum(weights.values())
        weights = {i: v / (total + 1e-20) for i, v in weights.items()}
    return {i: v * c.routed_scaling_factor for i, v in weights.items()}


def ref_moe(c: K3Config, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xt = x[t]
        lat = w["routed_expert_down_proj.weight"] @ xt if c.is_latent_moe else xt
        y = torch.zeros_like(lat)
        for i, wt in ref_route(c, w, xt).items():
            p = f"experts.{i}."
            h = ref_act(c, w[p + "w1.weight"] @ lat, w[p + "w3.weight"] @ lat)
            y = y + wt * (w[p + "w2.weight"] @ h)
        if c.latent_moe_use_norm:
            y = rms(y, w["routed_expert_norm.weight"], c.rms_norm_eps)
        if c.is_latent_moe:
            y = w["routed_expert_up_proj.weight"] @ y
        if c.num_shared_experts:
            y = y + ref_mlp(c, w, "shared_experts.", xt)
        out[t] = y
    return out


MOE_VARIANTS = {
    "mini": {},
    "grouped": {"num_expert_group": 4, "topk_group": 2},
    "no-renorm-scaled-no-norm": {
        "moe_renormalize": False, "routed_scaling_factor": 2.5, "latent_moe_use_norm": False
    },
    "hidden-space-no-shared": {
        "routed_expert_hidden_size": None, "latent_moe_use_norm": False, "num_shared_experts": 0
    },
}


@torch.no_grad()
def test_moe_in_the_engines_layout_matches_naive_loop() -> None:
    """The engine's form on CPU: no grad (the dense path through the stacked experts) and every
    linear column-major (layers.column_major_linears, values unchanged): the naive loop's
    output."""
    c = mini()
    moe = LatentMoE(c)
    randomize(moe, seed=4, scale=2.0)
    w = {name: p.clone() for name, p in moe.state_dict().items()}
    column_major_linears(moe)
    linears = [m for m in moe.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() for m in linears)
    assert all(torch.equal(p, w[name]) for name, p in moe.state_dict().items())
    x = torch.randn(3, 4, c.hidden_size, generator=torch.Generator().manual_seed(5))
    got = moe(x)
    assert moe._stacked is not None  # the dense path ran
    ref = ref_moe(c, w, x.reshape(-1, c.hidden_size)).reshape(x.shape)
    assert close(got, ref), (got - ref).abs().max()

@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_moe_matches_naive_loop(variant: str) -> None:
    c = mini(**MOE_VARIANTS[variant])
    moe = LatentMoE(c)
    randomize(moe, seed=4, scale=2.0)
    w = dict(moe.state_dict())
    x = torch.randn(3, 4, c.hidden_size, generator=torch.Generator().manual_seed(5))
    got = moe(x)
    assert got.shape == x.shape
    ref = ref_moe(c, w, x.reshape(-1, c.hidden_size)).reshape(x.shape)
    assert close(got, ref), (got - ref).abs().max()


def test_grouped_topk_restricts_to_kept_groups() -> None:
    c = mini(num_expert_group=4, topk_group=2)
    moe = LatentMoE(c)
    randomize(moe, seed=6, scale=2.0)
    x = torch.randn(16, c.hidden_size, generator=torch.Generator().manual_seed(7))
    _, ids = moe.route(x)
    groups = ids // (c.num_experts // c.num_expert_group)
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_correction_bias_changes_selection_not_weights() -> None:
    c = mini()
    moe = LatentMoE(c)
    randomize(moe, seed=8, scale=2.0)
    x = torch.randn(1, c.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
    _, ids0 = moe.route(x)
    scores = torch.sigmoid(x @ moe.gate.weight.T)[0]
    outsider = next(i for i in scores.argsort().tolist() if i not in ids0[0].tolist())
    with torch.no_grad():
        moe.gate.e_score_correction_bias[outsider] = 10.0  # forces the weakest expert in
    weights, ids = moe.route(x)
    assert outsider in ids[0].tolist() and set(ids[0].tolist()) != set(ids0[0].tolist())
    # The weights are the UNBIASED sigmoid scores of the chosen set, renormalized.
    chosen = scores[ids[0]]
    assert torch.allclose(weights[0], chosen / chosen.sum(), atol=1e-6)
    ref = ref_route(c, dict(moe.state_dict()), x[0])
    assert set(ref) == set(ids[0].tolist())
    assert sorted(ref.values()) == pytest.approx(sorted(weights[0].tolist()), rel=1e-5)
    # ... and the block output agrees with the naive loop under that bias.
    w = dict(moe.state_dict())
    assert torch.allclose(moe(x), ref_moe(c, w, x), rtol=1e-4, atol=1e-5)


def test_latent_norm_absorbs_routed_scaling_factor() -> None:
    """The norm sits after the weighted sum: scaling the weights is (almost) a
    no-op with the norm on, and linear without it."""
    outs = {}
    for norm in (True, False):
        for rsf in (1.0, 3.0):
            c = mini(latent_moe_use_norm=norm, routed_scaling_factor=rsf, num_shared_experts=0)
            moe = LatentMoE(c)
            randomize(moe, seed=10, scale=2.0)
            x = torch.randn(5, c.hidden_size, generator=torch.Generator().manual_seed(11))
            outs[norm, rsf] = moe(x)
    assert torch.allclose(outs[True, 1.0], outs[True, 3.0], rtol=1e-4, atol=1e-5)
    assert torch.allclose(3.0 * outs[False, 1.0], outs[False, 3.0], rtol=1e-4, atol=1e-5)


# --- K3MLA -------------------------------------------------------------------------------------


def ref_mla(c: K3Config, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Non-absorbed MLA, per request and head: explicit K and V, causal mask, no positions."""
    n, dn, dr, dv, r = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                        c.v_head_dim, c.kv_lora_rank)
    eps = c.rms_norm_eps
    outs = []
    for xb in x:  # [T, H]
        t = xb.shape[0]
        if c.q_lora_rank is None:
            q = xb @ w["q_proj.weight"].T
        else:
            cq = rms(xb @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], eps)
            q = cq @ w["q_b_proj.weight"].T
        q = q.view(t, n, dn + dr)
        kv_a = xb @ w["kv_a_proj_with_mqa.weight"].T
        ckv = rms(kv_a[:, :r], w["kv_a_layernorm.weight"], eps)
        k_pe = kv_a[:, r:]  # shared by every head, unrotated
        kv = (ckv @ w["kv_b_proj.weight"].T).view(t, n, dn + dv)
        heads = []
        for h in range(n):
            k = torch.cat([kv[:, h, :dn], k_pe], dim=-1)  # [T, dn + dr]
            v = kv[:, h, dn:]
            s = q[:, h] @ k.T / math.sqrt(dn + dr)
            s = s.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
            heads.append(torch.softmax(s, dim=-1) @ v)
        o = torch.cat(heads, dim=-1)  # [T, n·dv], head-major
        if c.mla_use_output_gate:
            o = o * torch.sigmoid(xb @ w["g_proj.weight"].T)
        outs.append(o @ w["o_proj.weight"].T)
    return torch.stack(outs)


MLA_VARIANTS = {
    "mini": {},
    "q-proj-no-gate": {"q_lora_rank": None, "mla_use_output_gate": False},
}


def make_mla(variant: str, seed: int = 12) -> tuple[K3Config, K3MLA]:
    c = mini(**MLA_VARIANTS[variant])
    mla = K3MLA(c)
    randomize(mla, seed=seed, scale=1.5)
    return c, mla


@pytest.mark.parametrize("variant", list(MLA_VARIANTS))
def test_mla_matches_naive_attention(variant: str) -> None:
    c, mla = make_mla(variant)
    x = torch.randn(2, 9, c.hidden_size, generator=torch.Generator().manual_seed(13))
    out, cache = mla(x)
    assert out.shape == x.shape
    assert cache.shape == (2, 9, c.kv_lora_rank + c.qk_rope_head_dim) == (2, 9, c.mla_cache_dim)
    ref = ref_mla(c, dict(mla.state_dict()), x)
    assert close(out, ref), (out - ref).abs().max()


def test_mla_is_position_free() -> None:
    """NoPE: the same tokens after an unrelated prefix see the same keys (the cached entries of
    a token do not depend on where it sits)."""
    c, mla = make_mla("mini")
    g = torch.Generator().manual_seed(14)
    x, prefix = torch.randn(1, 4, c.hidden_size, generator=g), torch.randn(1, 3, c.hidden_size,
                                                                           generator=g)
    _, cache_a = mla(x)
    _, cache_b = mla(torch.cat([prefix, x], dim=1))
    assert torch.allclose(cache_a, cache_b[:, 3:], atol=1e-6)
    # No positions anywhere: the last token's output is a function of the SET of tokens it
    # sees, so permuting the tokens before it changes nothing.
    seq = torch.cat([prefix, x], dim=1)
    perm = torch.tensor([4, 0, 5, 2, 1, 3, 6])
    last, _ = mla(seq)
    last_perm, _ = mla(seq[:, perm])
    assert torch.allclose(last[:, -1], last_perm[:, -1], atol=1e-5)


@pytest.mark.parametrize("variant", list(MLA_VARIANTS))
def test_mla_prefill_then_decode_equals_full_forward(variant: str) -> None:
    c, mla = make_mla(variant)
    x = torch.randn(2, 10, c.hidden_size, generator=torch.Generator().manual_seed(15))
    full, full_cache = mla(x)
    out, cache = mla(x[:, :4])
    pieces = [out]
    out, cache = mla(x[:, 4:7], cache=cache)  # a chunked-prefill step over a cache
    pieces.append(out)
    for t in range(7, 10):
        out, cache = mla(x[:, t : t + 1], cache=cache)
        pieces.append(out)
    assert cache.shape == full_cache.shape
    # Chunked and full paths sum in different orders (matmuls over 10, 4, 3 or 1 rows): measured
    # up to 3.5e-6 on outputs of scale 5.7 (6e-7 relative; seeds 15-24, 1 and 2 threads).
    assert close(cache, full_cache, 1e-5)
    assert close(torch.cat(pieces, dim=1), full, 1e-5)


def test_mla_bf16_cache_round_trip() -> None:
    """New entries are rounded through the cache dtype before they are attended."""
    c, mla = make_mla("mini")
    x = torch.randn(1, 5, c.hidden_size, generator=torch.Generator().manual_seed(16))
    _, cache = mla(x[:, :3], cache=mla.empty_cache(1, dtype=torch.bfloat16))
    assert cache.dtype == torch.bfloat16
    out, cache = mla(x[:, 3:], cache=cache)
    assert cache.shape == (1, 5, c.mla_cache_dim) and out.dtype == torch.float32


def test_mla_output_gate() -> None:
    c, mla = make_mla("mini")
    x = torch.randn(2, 6, c.hidden_size, generator=torch.Generator().manual_seed(17))
    ungated_cfg = mini(mla_use_output_gate=False)
    ungated = K3MLA(ungated_cfg)
    ungated.load_state_dict(
        {k: v for k, v in mla.state_dict().items() if not k.startswith("g_proj")}
    )
    plain, _ = ungated(x)
    # Gate forced to 0 (σ(-1e4) = 0): the output is o_proj(0) = 0 (o_proj has no bias).
    handle = mla.g_proj.register_forward_hook(lambda m, i, o: torch.full_like(o, -1e4))
    closed, _ = mla(x)
    handle.remove()
    assert torch.equal(closed, mla.o_proj(torch.zeros(2, 6, c.num_attention_heads * c.v_head_dim)))
    # Gate forced open (σ(1e4) = 1): the ungated attention.
    handle = mla.g_proj.register_forward_hook(lambda m, i, o: torch.full_like(o, 1e4))
    opened, _ = mla(x)
    handle.remove()
    assert torch.allclose(opened, plain, atol=1e-6)
    # g_proj = 0: σ(0) = 1/2 on every element, halving the (linear) o_proj output.
    with torch.no_grad():
        mla.g_proj.weight.zero_()
    half, _ = mla(x)
    assert torch.allclose(half, 0.5 * plain, atol=1e-6)
    # The gate acts per element of [T, n·dv] before o_proj: gating one head's slice only.
    with torch.no_grad():
        mla.g_proj.weight.zero_()
    dv = c.v_head_dim
    mask = torch.zeros(c.num_attention_heads * dv)
    mask[dv : 2 * dv] = 1.0
    handle = mla.g_proj.register_forward_hook(
        lambda m, i, o: torch.where(mask.bool(), torch.full_like(o, 1e4), torch.full_like(o, -1e4))
    )
    one_head, _ = mla(x)
    handle.remove()
    only = K3MLA(ungated_cfg)
    only.load_state_dict(ungated.state_dict())
    with torch.no_grad():
        only.o_proj.weight.mul_(mask)  # zero every other head's o_proj columns
    assert torch.allclose(one_head, only(x)[0], atol=1e-6)


# --- checkpoint names and shapes ---------------------------------------------------------------


def layer_names(c: K3Config, layer: int, sub: str) -> list[tuple[str, tuple[int, ...]]]:
    prefix = f"model.layers.{layer}.{sub}."
    return [(n[len(prefix):], s) for n, s in k3_layer_tensors(c, layer) if n.startswith(prefix)]


def module_names(m: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(t.shape)) for n, t in m.state_dict().items()]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"q_lora_rank": None, "mla_use_output_gate": False, "latent_moe_use_norm": False},
     {"routed_expert_hidden_size": None, "latent_moe_use_norm": False, "num_shared_experts": 0}],
)
def test_parameter_names_and_shapes_match_k3_layer_tensors(overrides: dict) -> None:
    c = mini(**overrides)
    assert c.is_kda(MLA_LAYER) is False and c.is_moe(MOE_LAYER) and not c.is_moe(DENSE_LAYER)
    assert module_names(K3MLA(c)) == layer_names(c, MLA_LAYER, "self_attn")
    assert module_names(LatentMoE(c)) == layer_names(c, MOE_LAYER, "mlp")
    assert module_names(K3MLP(c, c.intermediate_size)) == layer_names(c, DENSE_LAYER, "mlp")


def test_mini_layer_state_dict_loads_by_name() -> None:
    c = mini()
    g = torch.Generator().manual_seed(18)
    tensors = {n: torch.randn(s, generator=g) for n, s in k3_layer_tensors(c, MLA_LAYER)}
    for sub, module in (("self_attn", K3MLA(c)), ("mlp", LatentMoE(c))):
        prefix = f"model.layers.{MLA_LAYER}.{sub}."
        part = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
        module.load_state_dict(part, strict=True)
        for name, t in module.state_dict().items():
            assert torch.equal(t, part[name])
