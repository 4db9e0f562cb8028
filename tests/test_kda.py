"""KDA (Kimi Delta Attention) layer: the chunked and recurrent algorithms agree, prefill/decode and
verify-window states compose, rollback to an accepted prefix is exact, the module matches a
naive per-token reference written here from SGLang's KDA formulas, and the
safe gate's lower bound holds. All fp32 on CPU, tiny sizes with distinct widths."""

from __future__ import annotations

import math

import pytest
import torch

from serve_app.models.kda import KDASizes, KDAState, KimiDeltaAttention

# H=40, h=2, D=12 → P=24, 3P=72, conv window 3: every width differs, so a transposed weight fails.
SIZES = KDASizes(hidden_size=40, num_heads=2, head_dim=12)
B = 3
ATOL = 1e-5


def make_layer(seed: int = 0, sizes: KDASizes = SIZES) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(sizes)
    with torch.no_grad():
        # A spread of decays: dt_bias from −8 (decay ≈ 1) to 0 (decay ≈ e^{L/2}), so a starting
        # state stays visible for many tokens on some channels and fades fast on others.
        layer.A_log.copy_(torch.empty(sizes.num_heads).uniform_(-1.0, 1.0))
        layer.dt_bias.uniform_(-8.0, 0.0)
        layer.o_norm.weight.copy_(1 + 0.2 * torch.randn(sizes.head_dim))
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            conv.weight.normal_(0.0, 0.5)
    return layer.eval()


def random_state(layer: KimiDeltaAttention, batch: int, seed: int = 1) -> KDAState:
    g = torch.Generator().manual_seed(seed)
    s = layer.new_state(batch)
    return KDAState(
        conv=torch.randn(s.conv.shape, generator=g),
        ssm=0.5 * torch.randn(s.ssm.shape, generator=g),
    )


def tokens(batch: int, length: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, SIZES.hidden_size, generator=g)


def assert_state_close(a: KDAState, b: KDAState, atol: float = ATOL) -> None:
    torch.testing.assert_close(a.conv, b.conv, atol=atol, rtol=0)
    torch.testing.assert_close(a.ssm, b.ssm, atol=atol, rtol=0)


def decode(layer: KimiDeltaAttention, x: torch.Tensor, state: KDAState):
    """Token-by-token recurrent decode: one forward call per token."""
    outs = []
    for t in range(x.shape[1]):
        out, state = layer(x[:, t : t + 1], state, algorithm="recurrent")
        outs.append(out)
    return torch.cat(outs, dim=1), state


# --- 1. chunked == recurrent -------------------------------------------------------------------


@pytest.mark.parametrize("start", ["zero", "random"])
@pytest.mark.parametrize(("length", "chunk"), [(23, 8), (17, 5), (6, 64)])
@torch.no_grad()
def test_chunked_equals_recurrent(start: str, length: int, chunk: int) -> None:
    layer = make_layer()
    state = layer.new_state(B) if start == "zero" else random_state(layer, B)
    x = tokens(B, length)
    out_c, st_c = layer(x, state, algorithm="chunked", chunk_size=chunk)
    out_r, st_r = layer(x, state, algorithm="recurrent")
    torch.testing.assert_close(out_c, out_r, atol=ATOL, rtol=0)
    assert_state_close(st_c, st_r)
    assert st_c.ssm.dtype == torch.float32 and st_c.ssm.shape == (B, 2, 12, 12)
    assert st_c.conv.shape == (B, 3, 72)


@torch.no_grad()
def test_input_state_is_not_modified() -> None:
    layer = make_layer()
    state = random_state(layer, B)
    before = state.clone()
    layer(tokens(B, 9), state, algorithm="chunked", chunk_size=4)
    layer(tokens(B, 9), state, algorithm="recurrent")
    layer.forward_window(tokens(B, 4), state)
    assert torch.equal(state.conv, before.conv) and torch.equal(state.ssm, before.ssm)


# --- 2. prefill then decode == one full prefill -------------------------------------------------


@torch.no_grad()
def test_prefill_then_decode_equals_full_prefill() -> None:
    layer = make_layer()
    x = tokens(B, 21)
    n = 13
    out_full, st_full = layer(x, layer.new_state(B), algorithm="chunked", chunk_size=5)
    out_pre, st = layer(x[:, :n], layer.new_state(B), algorithm="chunked", chunk_size=5)
    out_dec, st = decode(layer, x[:, n:], st)
    torch.testing.assert_close(torch.cat([out_pre, out_dec], dim=1), out_full, atol=ATOL, rtol=0)
    assert_state_close(st, st_full)


@torch.no_grad()
def test_two_chunked_extends_equal_one() -> None:
    # A prefix-cache hit: extend from a cached state (conv window included) == the whole prompt.
    layer = make_layer()
    x = tokens(B, 19)
    out_full, st_full = layer(x, layer.new_state(B), chunk_size=4)
    out_a, st = layer(x[:, :7], layer.new_state(B), chunk_size=4)
    out_b, st = layer(x[:, 7:], st, chunk_size=4)
    torch.testing.assert_close(torch.cat([out_a, out_b], dim=1), out_full, atol=ATOL, rtol=0)
    assert_state_close(st, st_full)


# --- 3. verify window: per-position states ------------------------------------------------------


@torch.no_grad()
def test_window_states_equal_stepwise_decode() -> None:
    layer = make_layer()
    _, committed = layer(tokens(B, 10, seed=3), random_state(layer, B), chunk_size=4)
    window = tokens(B, 8, seed=4)  # γ + 1 = 8, as DSpark with γ = 7
    out_w, states = layer.forward_window(window, committed)
    assert states.conv.shape == (B, 8, 3, 72) and states.ssm.shape == (B, 8, 2, 12, 12)
    st = committed
    for t in range(window.shape[1]):
        out_t, st = layer(window[:, t : t + 1], st, algorithm="recurrent")
        torch.testing.assert_close(out_w[:, t : t + 1], out_t, atol=ATOL, rtol=0)
        assert_state_close(states.at(t), st)
    # The window's outputs are also what a chunked prefill of the same tokens gives.
    out_c, st_c = layer(window, committed, chunk_size=3)
    torch.testing.assert_close(out_w, out_c, atol=ATOL, rtol=0)
    assert_state_close(states.at(window.shape[1] - 1), st_c)


# --- 4. rollback to an accepted prefix ----------------------------------------------------------


@torch.no_grad()
def test_rollback_to_accepted_prefix() -> None:
    layer = make_layer()
    _, committed = layer(tokens(B, 11, seed=5), layer.new_state(B), chunk_size=4)
    window = tokens(B, 6, seed=6)
    continuation = tokens(B, 4, seed=7)
    _, states = layer.forward_window(window, committed)
    accepted = torch.tensor([0, 3, 5])  # last_correct_step per request: different for each
    out_rb, st_rb = decode(layer, continuation, states.at(accepted))
    for i, j in enumerate(accepted.tolist()):
        # Uninterrupted: the first j+1 window tokens, then the same continuation.
        seq = torch.cat([window[i : i + 1, : j + 1], continuation[i : i + 1]], dim=1)
        out_ref, st_ref = decode(layer, seq, committed.rows([i]))
        torch.testing.assert_close(out_rb[i : i + 1], out_ref[:, j + 1 :], atol=ATOL, rtol=0)
        assert_state_close(st_rb.rows([i]), st_ref)


# --- 5. an independent naive reference ----------------------------------------------------------


def naive_kda(
    w: dict[str, torch.Tensor],
    x: torch.Tensor,
    conv0: torch.Tensor,
    S0: torch.Tensor,
    heads: int,
    dim: int,
    lower_bound: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, straight from the KDA formulas, one token and one head at a time.

    x: [T, H]; conv0: [3, 3P] the previous raw q|k|v rows (oldest first); S0: [heads, K, V].
    """
    P = heads * dim
    hist = [conv0[i] for i in range(conv0.shape[0])]  # raw q|k|v rows, oldest first
    conv_w = torch.cat([w["q_conv1d.weight"], w["k_conv1d.weight"], w["v_conv1d.weight"]])[:, 0]
    S = [S0[i].clone() for i in range(heads)]
    outs = []
    for t in range(x.shape[0]):
        xt = x[t]
        raw = torch.cat([w["q_proj.weight"] @ xt, w["k_proj.weight"] @ xt, w["v_proj.weight"] @ xt])
        hist.append(raw)
        # c'_t = SiLU(Σ_j W[:, j] · c_{t−3+j}): W[:, 3] multiplies the current token.
        c = sum(conv_w[:, j] * hist[-4 + j] for j in range(4))
        c = c * torch.sigmoid(c)
        q_all, k_all, v_all = c[:P], c[P : 2 * P], c[2 * P :]
        f = w["f_b_proj.weight"] @ (w["f_a_proj.weight"] @ xt)
        b = w["b_proj.weight"] @ xt
        gate_out = w["g_proj.weight"] @ xt
        y = []
        for h in range(heads):
            sl = slice(h * dim, (h + 1) * dim)
            q = q_all[sl] / torch.sqrt((q_all[sl] ** 2).sum() + 1e-6) / math.sqrt(dim)
            k = k_all[sl] / torch.sqrt((k_all[sl] ** 2).sum() + 1e-6)
            v = v_all[sl]
            g = lower_bound * torch.sigmoid(torch.exp(w["A_log"][h]) * (f[sl] + w["dt_bias"][sl]))
            beta = torch.sigmoid(b[h])
            S[h] = torch.diag(torch.exp(g)) @ S[h]
            u = beta * (v - S[h].T @ k)
            S[h] = S[h] + torch.outer(k, u)
            o = S[h].T @ q
            o = o / torch.sqrt((o**2).mean() + eps) * w["o_norm.weight"]
            y.append(o * torch.sigmoid(gate_out[sl]))
        outs.append(w["o_proj.weight"] @ torch.cat(y))
    return torch.stack(outs), torch.stack(S)


@pytest.mark.parametrize("algorithm", ["chunked", "recurrent"])
@torch.no_grad()
def test_matches_naive_reference(algorithm: str) -> None:
    layer = make_layer(seed=11)
    state = random_state(layer, B, seed=12)
    x = tokens(B, 9, seed=13)
    out, st = layer(x, state, algorithm=algorithm, chunk_size=4)
    w = dict(layer.state_dict())
    for i in range(B):
        ref_out, ref_S = naive_kda(
            w, x[i], state.conv[i], state.ssm[i], SIZES.num_heads, SIZES.head_dim,
            SIZES.gate_lower_bound, SIZES.rms_norm_eps,
        )
        torch.testing.assert_close(out[i], ref_out, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(st.ssm[i], ref_S, atol=ATOL, rtol=1e-5)


# --- 6. the safe gate's lower bound -------------------------------------------------------------


@torch.no_grad()
def test_gate_lower_bound_is_applied() -> None:
    layer = make_layer()
    L = SIZES.gate_lower_bound
    with torch.no_grad():
        # Positive inputs and weights of one sign make every pre-activation huge (±1e4).
        layer.f_a_proj.weight.fill_(1.0)
        layer.b_proj.weight.fill_(-100.0)  # β = sigmoid(−huge) = 0: S only decays
    x = tokens(1, 4).abs() + 0.1
    for sign in (1.0, -1.0):
        layer.f_b_proj.weight.fill_(sign * 100.0)
        g = layer.forget_gate(x)
        assert torch.isfinite(g).all()
        assert g.min().item() >= L and g.max().item() <= 0.0
        # The plain Kimi-Linear gate on the same pre-activations is far below L (so the bound
        # is what keeps it there), and at +huge the safe gate sits exactly at L.
        f = layer.f_b_proj(layer.f_a_proj(x))
        plain = -layer.A_log.exp()[:, None] * torch.nn.functional.softplus(
            f.unflatten(-1, (2, 12)) + layer.dt_bias.view(2, 12))
        if sign > 0:
            assert plain.max().item() < 10 * L
            torch.testing.assert_close(g, torch.full_like(g, L))
    # End to end: with β = 0 each step multiplies S by exp(g) ≥ exp(L) per K row.
    layer.f_b_proj.weight.fill_(100.0)
    state = random_state(layer, 1)
    _, st = layer(x[:, :1], state, algorithm="recurrent")
    ratio = st.ssm / state.ssm
    torch.testing.assert_close(ratio, torch.full_like(ratio, math.exp(L)), atol=1e-6, rtol=1e-5)
    _, st_c = layer(x, state, algorithm="chunked", chunk_size=3)
    torch.testing.assert_close(st_c.ssm, state.ssm * math.exp(4 * L), atol=1e-9, rtol=1e-4)


def test_plain_kimi_linear_gate_is_unbounded() -> None:
    # gate_lower_bound None: g = −exp(A_log)·softplus(f + dt_bias), no floor.
    layer = make_layer(sizes=KDASizes(hidden_size=40, num_heads=2, head_dim=12,
                                      gate_lower_bound=None))
    with torch.no_grad():
        layer.f_a_proj.weight.fill_(1.0)
        layer.f_b_proj.weight.fill_(100.0)
        g = layer.forget_gate(tokens(1, 2).abs() + 0.1)
    assert g.max().item() < -100.0


# --- names and sizes ----------------------------------------------------------------------------


def test_parameter_names_and_shapes_follow_the_k3_checkpoint() -> None:
    layer = make_layer()
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    H, h, D, P = 40, 2, 12, 24
    assert shapes == {
        "q_proj.weight": (P, H), "k_proj.weight": (P, H), "v_proj.weight": (P, H),
        "g_proj.weight": (P, H), "f_a_proj.weight": (D, H), "f_b_proj.weight": (P, D),
        "b_proj.weight": (h, H), "q_conv1d.weight": (P, 1, 4), "k_conv1d.weight": (P, 1, 4),
        "v_conv1d.weight": (P, 1, 4), "A_log": (h,), "dt_bias": (P,), "o_norm.weight": (D,),
        "o_proj.weight": (H, P),
    }
    low_rank = KimiDeltaAttention(KDASizes(hidden_size=40, num_heads=2, head_dim=12,
                                           use_full_rank_gate=False))
    names = set(low_rank.state_dict())
    assert "g_proj.weight" not in names and {"g_a_proj.weight", "g_b_proj.weight"} <= names
    for name in ("q_conv1d.weight", "A_log", "dt_bias"):
        assert layer.state_dict()[name].dtype == torch.float32


def test_sizes_from_mini_k3_text_config() -> None:
    text_config = {
        "hidden_size": 256,
        "rms_norm_eps": 1e-5,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 6,
            "head_dim": 64, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
    }
    sizes = KDASizes.from_text_config(text_config)
    assert sizes == KDASizes(hidden_size=256, num_heads=6, head_dim=64)
    state = KDAState.zeros(sizes, 2)
    assert state.conv.shape == (2, 3, 1152) and state.ssm.shape == (2, 6, 64, 64)


@torch.no_grad()
def test_bf16_activations_keep_an_fp32_state() -> None:
    ref = make_layer()
    layer = make_layer().to(torch.bfloat16)
    x = tokens(B, 7)
    out_ref, st_ref = ref(x, ref.new_state(B), chunk_size=4)
    out, st = layer(x.bfloat16(), layer.new_state(B), chunk_size=4)
    assert out.dtype == torch.bfloat16 and st.conv.dtype == torch.bfloat16
    assert st.ssm.dtype == torch.float32
    torch.testing.assert_close(out.float(), out_ref, atol=0.1, rtol=0.1)
    torch.testing.assert_close(st.ssm, st_ref.ssm, atol=0.1, rtol=0.1)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunked_and_window_forms_equal_the_recurrence(lower_bound: float | None) -> None:
    """Both decay forms of the chunked algorithm (factorised for K3's bounded gate, pairwise
    differences once a chunk's decay span passes FACTORISED_MAX_SPAN) and the verify window's
    all-positions and lazy forms compute the token-by-token recurrence."""
    from serve_app.models.kda import (
        FACTORISED_MAX_SPAN,
        KDAWindowLog,
        chunked_gated_delta_rule,
        kda_gate,
        recurrent_gated_delta_rule,
        window_gated_delta_rule,
        window_solve,
    )

    g_ = torch.Generator().manual_seed(4)
    b, t, h, d = 2, 40, 3, 8
    q = torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=g_), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=g_), dim=-1)
    v = torch.randn(b, t, h, d, generator=g_)
    g = kda_gate(3 * torch.randn(b, t, h, d, generator=g_), torch.ones(h), torch.zeros(h, d),
                 lower_bound)
    beta = torch.rand(b, t, h, generator=g_)
    s0 = torch.randn(b, h, d, d, generator=g_)
    span = float(-g[:, :16].sum(1).min())
    assert (span <= FACTORISED_MAX_SPAN) == (lower_bound is not None)  # both branches run
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=16)
    torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=1e-5)
    # A 16-token window spans the same decays as the first chunk: both branches here too.
    w = (q[:, :16], k[:, :16], v[:, :16], g[:, :16], beta[:, :16])
    o_w, s_w = window_gated_delta_rule(*w, s0)
    o_rw, s_rw = recurrent_gated_delta_rule(*w, s0, keep_all_states=True)
    torch.testing.assert_close(o_w, o_rw, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_w, s_rw, atol=1e-5, rtol=1e-5)
    # The lazy window: the same outputs, and a replay forms the accepted position's state.
    o_l, U, G = window_solve(*w, s0)
    torch.testing.assert_close(o_l, o_rw, atol=1e-5, rtol=1e-5)
    log = KDAWindowLog(k=w[1].transpose(1, 2), G=G, U=U, rows=torch.zeros(b, 3 + 16, 1))
    steps = torch.tensor([3, 15])
    replayed = log.replay(torch.arange(b), s0, steps).ssm
    torch.testing.assert_close(replayed, s_rw[torch.arange(b), steps], atol=1e-5, rtol=1e-5)


def test_replay_of_several_layers_at_once_equals_each_layers_replay() -> None:
    """A commit replays every KDA layer's window in one pass (`replay_layers`): each layer's
    state is what its own log's replay forms, for any subset of the window's rows."""
    from serve_app.models.kda import KDAWindowLog, replay_layers, window_solve

    g_ = torch.Generator().manual_seed(7)
    b, t, h, d, layers = 3, 8, 2, 6, 4
    logs, committed = [], []
    for _ in range(layers):
        q = torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=g_), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=g_), dim=-1)
        v = torch.randn(b, t, h, d, generator=g_)
        g = -torch.rand(b, t, h, d, generator=g_)
        beta = torch.rand(b, t, h, generator=g_)
        s0 = torch.randn(b, h, d, d, generator=g_)
        _, U, G = window_solve(q, k, v, g, beta, s0)
        logs.append(KDAWindowLog(k=k.transpose(1, 2), G=G, U=U,
                                 rows=torch.randn(b, 3 + t, 5, generator=g_)))
        committed.append(s0)
    rows, steps = torch.tensor([2, 0]), torch.tensor([5, 1])
    ssm = torch.stack([s[rows] for s in committed])
    together = replay_layers(logs, rows, ssm, steps)
    assert together.ssm.shape == (layers, 2, h, d, d) and together.conv.shape == (layers, 2, 3, 5)
    for i, log in enumerate(logs):
        alone = log.replay(rows, committed[i][rows], steps)
        torch.testing.assert_close(together.ssm[i], alone.ssm, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(together.conv[i], alone.conv, atol=0, rtol=0)
