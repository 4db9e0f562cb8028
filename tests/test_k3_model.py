"""serve_app.models.k3 (the full K3 text model) on the mini-K3 config, fp32 CPU, seeded random
weights: parameter names and counts, prefill + decode through K3State == one full forward, the
Block Attention Residual against a naive loop written here from SGLang's AttnRes
formulas, the DSpark taps (`_dspark_capture_stream`), and the plain residual without AttnRes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from serve_app.models.k3 import K3ForCausalLM, K3State
from serve_app.models.k3_config import K3Config, k3_parameter_count, k3_tensor_shapes

MINI = Path(__file__).parent / "data" / "mini-k3-config.json"
REAL = Path(__file__).parent.parent / "capacity" / "data" / "kimi-k3-config.json"


def mini(**overrides: object) -> K3Config:
    raw = json.loads(MINI.read_text())
    raw["text_config"].update(overrides)
    if "tie_word_embeddings" in overrides:
        raw["tie_word_embeddings"] = overrides["tie_word_embeddings"]
    return K3Config.from_dict(raw)


def build(config: K3Config, seed: int = 0) -> K3ForCausalLM:
    """A mini model with small seeded normal weights; norm weights near 1 and AttnRes
    pseudo-queries large enough that the softmax mixtures are far from uniform."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # the KDA layer's own (seeded) placeholder init
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("_res_proj.weight"):
                p.copy_(3.0 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def tokens(config: K3Config, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=g)


# --- a naive model, written from the formulas ---------------------------------------------------


def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_mix(rows: list[torch.Tensor], norm: nn.Module, proj: nn.Linear) -> torch.Tensor:
    """One read: s_j = w · RMSNorm_γ(r_j); α = softmax_j(s_j); mix = Σ_j α_j r_j."""
    scores = torch.stack(
        [(ref_rms(r, norm.weight, norm.eps) * proj.weight[0]).sum(-1) for r in rows], dim=-1
    )
    alpha = torch.softmax(scores, dim=-1)
    out = torch.zeros_like(rows[0])
    for j, r in enumerate(rows):
        out = out + alpha[..., j : j + 1] * r
    return out


def run_attn(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A layer's self_attn over a whole sequence from an empty state."""
    attn = layer.self_attn
    if layer.is_kda:
        return attn(x, attn.new_state(x.shape[0]))[0]
    return attn(x)[0]


def ref_rows(s: int, n_layers: int, x0: torch.Tensor, outs: list, nvb: int) -> list:
    """The rows a read with nvb bank rows mixes, from the sublayer outputs so far (a list of
    (layer, output)), without a running bank: [x0, b_1..b_{nvb-1}, p] with b_k = Σ outputs of
    layers (k-1)S..kS-1 and p = Σ outputs of layers >= (nvb-1)S (AttnRes bookkeeping); nvb = 0
    (layer 0's attention read): [x0] alone."""

    def block_sum(lo: int, hi: int) -> torch.Tensor:
        return sum((o for layer, o in outs if lo <= layer < hi), torch.zeros_like(x0))

    if nvb == 0:
        return [x0]
    bank = [x0] + [block_sum((k - 1) * s, k * s) for k in range(1, nvb)]
    return [*bank, block_sum((nvb - 1) * s, n_layers)]


def naive_attn_res(
    model: K3ForCausalLM, ids: torch.Tensor, recorded: list | None = None
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Block AttnRes as a naive loop: every read recomputed by `ref_rows` + `ref_mix`.

    `recorded` (the model's own sublayer outputs, (layer, output) in order) makes each read
    use them instead of the loop's own, so each read is checked in isolation.
    Returns (logits, every pre-norm read in order: attn_0, ffn_0, attn_1, ..., output)."""
    c, m = model.config, model.model
    s, n_layers = c.attn_res_block_size, c.num_hidden_layers
    x0 = m.embed_tokens(ids)
    outs: list[tuple[int, torch.Tensor]] = []

    def sublayer(i: int, out: torch.Tensor) -> None:
        outs.append(recorded[len(outs)] if recorded is not None else (i, out))

    reads = []
    for i, layer in enumerate(m.layers):
        a = ref_mix(ref_rows(s, n_layers, x0, outs, math.ceil(i / s)),
                    layer.self_attention_res_norm, layer.self_attention_res_proj)
        reads.append(a)
        sublayer(i, run_attn(layer, layer.input_layernorm(a)))
        f = ref_mix(ref_rows(s, n_layers, x0, outs, math.ceil((i + 1) / s)),
                    layer.mlp_res_norm, layer.mlp_res_proj)
        reads.append(f)
        sublayer(i, layer.mlp(layer.post_attention_layernorm(f)))
    out = ref_mix(ref_rows(s, n_layers, x0, outs, math.ceil(n_layers / s)),
                  m.output_attn_res_norm, m.output_attn_res_proj)
    reads.append(out)
    return (m.norm(out) @ model.lm_head.weight.T).float(), reads, out


def naive_plain(model: K3ForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The plain residual: h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h));
    logits = lm_head(norm(h)). Returns (logits, h after every layer)."""
    m = model.model
    h = m.embed_tokens(ids)
    after = []
    for layer in m.layers:
        h = h + run_attn(layer, layer.input_layernorm(h))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        after.append(h)
    return (m.norm(h) @ model.lm_head.weight.T).float(), after


def close(got: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> bool:
    return bool((got - ref).abs().max() <= tol * ref.abs().max().clamp_min(1.0))


# --- 1. names, shapes, parameter count -----------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"attn_res_block_size": None}, {"q_lora_rank": None}],
)
def test_names_and_shapes_are_k3_tensor_shapes(overrides: dict) -> None:
    c = mini(**overrides)
    model = K3ForCausalLM(c)
    got = {name: tuple(p.shape) for name, p in model.named_parameters()}
    want = dict(k3_tensor_shapes(c))
    assert got == want
    assert sum(p.numel() for p in model.parameters()) == k3_parameter_count(c)


def test_real_config_layers_have_the_real_shapes_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    """The published config's first five layers, at their real sizes: the dense first layer,
    KDA and MLA MoE layers (every kind of layer; the rest repeat them). The whole model's count
    is k3_parameter_count's, checked against the published total in test_k3_config.py."""
    import json

    raw = json.loads(REAL.read_text())
    text = raw["text_config"]
    text["num_hidden_layers"] = 5
    text["linear_attn_config"] = {**text["linear_attn_config"], "kda_layers": [1, 2, 3, 5],
                                  "full_attn_layers": [4]}
    c = K3Config.from_dict(raw, "the published config's first 5 layers")
    assert c.first_k_dense_replace == 1 and c.kda_layers and c.mla_layers
    # Only the shapes matter on meta: skip nn.Linear's kaiming init (half the build time).
    monkeypatch.setattr(nn.Linear, "reset_parameters", lambda self: None)
    with torch.device("meta"):
        model = K3ForCausalLM(c)
    got = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert got == dict(k3_tensor_shapes(c))
    assert sum(p.numel() for p in model.parameters()) == k3_parameter_count(c)
    assert model.model.layers[3].self_attn.__class__.__name__ == "K3MLA"
    assert model.model.layers[0].self_attn.__class__.__name__ == "KimiDeltaAttention"


# --- 2. prefill + decode through the state == one full forward ---------------------------------


@pytest.mark.parametrize("block", [3, None])
def test_prefill_then_decode_equals_full_forward(block: int | None) -> None:
    c = mini(attn_res_block_size=block)
    assert c.kda_layers and c.mla_layers  # both kinds of attention are exercised
    model = build(c)
    ids = tokens(c, batch=2, length=11)
    with torch.no_grad():
        full, full_state = model(ids)
        assert full.shape == (2, 11, c.vocab_size) and full.dtype == torch.float32
        assert full.std() > 0.1  # the random weights give non-degenerate logits
        logits, state = model(ids[:, :6])
        prefill_state = state.clone()
        pieces = [logits]
        # an extend of 2 tokens, then token-by-token decode
        for lo, hi in [(6, 8), (8, 9), (9, 10), (10, 11)]:
            logits, state = model(ids[:, lo:hi], state)
            pieces.append(logits)
    got = torch.cat(pieces, dim=1)
    assert torch.allclose(got, full, atol=1e-4), (got - full).abs().max()
    assert state.length == 11
    assert set(state.kda) == set(c.kda_layers) and set(state.mla) == set(c.mla_layers)
    for i in c.mla_layers:
        assert state.mla[i].shape == (2, 11, c.mla_cache_dim)
        assert close(state.mla[i], full_state.mla[i], tol=1e-4)
    for i in c.kda_layers:
        assert close(state.kda[i].ssm, full_state.kda[i].ssm, tol=1e-4)
    # the state passed in is not modified
    with torch.no_grad():
        again, _ = model(ids[:, 6:8], prefill_state)
    assert torch.allclose(again, pieces[1], atol=1e-6)
    for i in c.mla_layers:
        assert prefill_state.mla[i].shape[1] == 6


def test_batch_rows_are_independent() -> None:
    c = mini()
    model = build(c)
    ids = tokens(c, batch=3, length=7)
    with torch.no_grad():
        batched, _ = model(ids)
        one, _ = model(ids[1:2], K3State())
    # Only fp32 summation order differs (a batch of 3 and of 1 pick different matmul blockings):
    # measured up to 3.4e-5 of the logits' scale over batches 2-8, rows, 1 and 2 threads.
    err = (batched[1:2] - one).abs().max() / one.abs().max()
    assert err <= 2e-4, err


# --- 3. the Attention Residual against the naive loop ------------------------------------------


def attn_read_hooks(model: K3ForCausalLM) -> tuple[list[torch.Tensor], list]:
    """Forward pre-hooks recording the input of every layer's input_layernorm and of the final
    norm (the pre-norm mixtures the model actually formed)."""
    seen: list[torch.Tensor] = []
    mods = [layer.input_layernorm for layer in model.model.layers] + [model.model.norm]
    handles = [mod.register_forward_pre_hook(lambda _m, a: seen.append(a[0])) for mod in mods]
    return seen, handles


def all_read_hooks(model: K3ForCausalLM) -> tuple[list, list, list]:
    """Hooks recording every pre-norm read (attention, FFN, output, in order) and every
    sublayer output ((layer, output), in order)."""
    reads: list[torch.Tensor] = []
    outs: list[tuple[int, torch.Tensor]] = []
    handles = []
    for i, layer in enumerate(model.model.layers):
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            handles.append(norm.register_forward_pre_hook(lambda _m, a: reads.append(a[0])))
        handles.append(layer.self_attn.register_forward_hook(
            lambda _m, _a, o, i=i: outs.append((i, o[0]))))
        handles.append(layer.mlp.register_forward_hook(
            lambda _m, _a, o, i=i: outs.append((i, o))))
    handles.append(
        model.model.norm.register_forward_pre_hook(lambda _m, a: reads.append(a[0])))
    return reads, outs, handles


@pytest.mark.parametrize("block", [1, 3, 4, 8])
def test_attn_res_matches_naive_loop(block: int) -> None:
    c = mini(attn_res_block_size=block)
    model = build(c, seed=2)
    ids = tokens(c, batch=2, length=9, seed=3)
    reads, outs, handles = all_read_hooks(model)
    with torch.no_grad():
        logits, _ = model(ids)
        for h in handles:
            h.remove()
        # each read from the model's own stored sublayer outputs: tight
        _, ref_reads, _ = naive_attn_res(model, ids, recorded=outs)
        # the whole loop on its own: fp32 rounding differences grow with depth
        ref_logits, loop_reads, _ = naive_attn_res(model, ids)
    assert len(reads) == len(ref_reads) == 2 * c.num_hidden_layers + 1
    assert len(outs) == 2 * c.num_hidden_layers
    for k, (got, ref) in enumerate(zip(reads, ref_reads, strict=True)):
        assert close(got, ref, tol=1e-6), f"read {k}: {(got - ref).abs().max()}"
    for k, (got, ref) in enumerate(zip(reads, loop_reads, strict=True)):
        assert close(got, ref, tol=1e-3), f"read {k}: {(got - ref).abs().max()}"
    assert close(logits, ref_logits, tol=1e-3)
    assert torch.equal(reads[0], model.model.embed_tokens(ids))  # layer 0 reads x0 alone


def test_attn_res_weights_matter() -> None:
    """Changing one FFN-read pseudo-query changes the output: the mixture is really used."""
    c = mini()
    model = build(c)
    ids = tokens(c, batch=1, length=5)
    with torch.no_grad():
        before, _ = model(ids)
        model.model.layers[4].mlp_res_proj.weight.mul_(-1.0)
        after, _ = model(ids)
    assert not close(before, after, tol=1e-3)


# --- 4. DSpark taps ------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [3, None])
def test_taps_are_the_next_attention_read(block: int | None) -> None:
    c = mini(attn_res_block_size=block)
    model = build(c, seed=4)
    ids = tokens(c, batch=2, length=6, seed=5)
    layer_ids = [3, 0, 5, 7]  # any order; 7 is the last layer (the output read's mixture)
    seen, handles = attn_read_hooks(model)
    with torch.no_grad():
        logits, state, taps = model.capture_layers(ids, layer_ids)
    for h in handles:
        h.remove()
    h_size = c.hidden_size
    assert taps.shape == (2, 6, len(layer_ids) * h_size)
    # seen[i + 1]: the (pre-norm) input the next layer's attention normalizes; seen[-1] is the
    # final norm's input after the last layer.
    for k, i in enumerate(layer_ids):
        assert torch.allclose(taps[..., k * h_size : (k + 1) * h_size], seen[i + 1], atol=1e-6)
    with torch.no_grad():
        plain_logits, _ = model(ids)
    assert torch.allclose(logits, plain_logits)
    assert state.length == 6
    if block is not None:  # and against the naive loop
        with torch.no_grad():
            _, ref_reads, ref_out = naive_attn_res(model, ids)
        assert close(taps[..., :h_size], ref_reads[2 * 4], tol=1e-4)  # layer 4's attn read
        assert close(taps[..., -h_size:], ref_out, tol=1e-4)


def test_taps_during_decode_use_the_state() -> None:
    c = mini()
    model = build(c)
    ids = tokens(c, batch=1, length=7)
    with torch.no_grad():
        _, _, full = model.capture_layers(ids, [3, 7])
        _, state = model(ids[:, :5])
        _, _, tail = model.capture_layers(ids[:, 5:], [3, 7], state)
    assert torch.allclose(tail, full[:, 5:], atol=1e-4)


def test_capture_rejects_unknown_layers() -> None:
    c = mini()
    model = build(c)
    with pytest.raises(ValueError, match="outside"):
        model.capture_layers(tokens(c, 1, 2), [8])


# --- 5. no AttnRes: the plain residual stack -----------------------------------------------------


def test_plain_residual_without_attn_res() -> None:
    c = mini(attn_res_block_size=None)
    model = build(c, seed=6)
    names = [name for name, _ in model.named_parameters()]
    assert not any("attn_res" in n or "_res_" in n for n in names)
    ids = tokens(c, batch=2, length=8, seed=7)
    seen, handles = attn_read_hooks(model)
    with torch.no_grad():
        logits, _ = model(ids)
        for h in handles:
            h.remove()
        ref_logits, after = naive_plain(model, ids)
    assert close(logits, ref_logits)
    for i, ref in enumerate(after):
        assert close(seen[i + 1], ref), f"layer {i}"


# --- verify window -------------------------------------------------------------------------------


def test_verify_window_and_commit() -> None:
    c = mini()
    model = build(c, seed=8)
    ids = tokens(c, batch=2, length=10, seed=9)
    with torch.no_grad():
        full, _, full_taps = model.capture_layers(ids, [3, 7])
        _, state = model(ids[:, :5])
        logits, windows, taps = model.verify(ids[:, 5:9], state, [3, 7])
        # Equivalent fp32 paths (the window's all-positions KDA form, the chunked prefill's,
        # token by token; dense or looped experts) differ by up to 2e-4 on these logits
        # (|logit| <= 2.2): this random model amplifies rounding. A wrong state is O(1) off.
        assert torch.allclose(logits, full[:, 5:9], atol=5e-4)
        assert torch.allclose(taps, full_taps[:, 5:9], atol=5e-4)
        for accepted in (0, 1, 3):
            committed = windows.at(accepted)
            keep = 5 + accepted + 1
            assert committed.length == keep
            nxt, _ = model(ids[:, keep : keep + 1], committed)
            assert torch.allclose(nxt, full[:, keep : keep + 1], atol=5e-4)
    assert all(cache.shape[1] == 5 for cache in state.mla.values())  # input state untouched
