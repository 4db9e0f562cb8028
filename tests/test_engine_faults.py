"""Hostile input to the reference engine: sampling that cannot fail (no NaN, inf or exception)
on any parameter SamplingParams accepts, and stays exact.

Engine-only: no Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import write_tiny_pair

from serve_app.engines.reference.builder import (
    ReferenceEngineConfig,
    SpeculationConfig,
    build_engine,
    build_runner,
)
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.sampling import (
    SamplingParams,
    sample_token,
    target_probs,
    verify_drafts,
)
from serve_app.engines.types import RequestOutput

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

HOSTILE_TEMPERATURES = [1e-38, 5e-324, 1e-300, 1e-6, 1e-5, 2.0]
HOSTILE_TOP_P = [1e-300, 5e-324, 1e-6, 1.0]
HOSTILE_TOP_K = [0, 1, 3, 10**18]
HOSTILE_SEEDS = [-(2**63), 2**63 - 1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_pair(tmp_path_factory.mktemp("pair"))


def detok(ids: list[int]) -> str:
    return "".join(chr(48 + i) for i in ids)


def engine_from(pair: tuple[Path, Path], speculative: bool = True,
                **kwargs: Any) -> EngineCore:
    cfg = ReferenceEngineConfig(kv_capacity_tokens=4096,
                                speculation=SpeculationConfig(enabled=speculative))
    runner = build_runner(pair[0], pair[1] if speculative else None, cfg)
    return build_engine(runner, cfg, **kwargs)


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, RequestOutput]:
    """Run to completion; the final output of each request, with all its tokens."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    final: dict[str, RequestOutput] = {}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                out.token_ids = tokens[out.request_id]
                final[out.request_id] = out
    return final


def assert_client_safe(message: str) -> None:
    """No reprs, paths or addresses: the message is shown to clients."""
    for leak in ("Error(", "Exception", "Traceback", "/", "\\", "0x", "<", "'"):
        assert leak not in message, (leak, message)


# --- sampling that cannot fail -----------------------------------------------------------------


def hostile_logits(rows: int, seed: int) -> torch.Tensor:
    """Wide-ranged logits (a tiny temperature multiplies them by up to 1e38) with ties."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 30
    logits[:, 5] = logits[:, 7] = logits.amax(-1) + 1  # a tie for the maximum
    return logits


@pytest.mark.parametrize("temperature", HOSTILE_TEMPERATURES)
@pytest.mark.parametrize("top_p", HOSTILE_TOP_P)
def test_hostile_params_give_valid_tokens(temperature: float, top_p: float) -> None:
    logits = hostile_logits(4, seed=0)
    drafts = [5, 7, 11]
    q_rows = {
        "one-hot": None,
        "softmax": torch.softmax(torch.randn(3, VOCAB), -1),
        "nan": torch.full((3, VOCAB), float("nan")),
        "negative": -torch.softmax(torch.randn(3, VOCAB), -1),
    }
    for top_k in HOSTILE_TOP_K:
        for seed in HOSTILE_SEEDS:
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=seed)
            g = torch.Generator().manual_seed(seed)
            if not params.greedy:
                p = target_probs(logits, params)
                assert bool(torch.isfinite(p).all())
                assert torch.allclose(p.sum(-1), torch.ones(4))
                # A most likely token (5 and 7 tie) keeps its probability.
                top = logits == logits.amax(-1, keepdim=True)
                assert bool(((p * top).sum(-1) > 0).all())
            for row in logits:
                assert 0 <= sample_token(row, params, g) < VOCAB
            for q in q_rows.values():
                verdict = verify_drafts(logits, drafts, q, params, g)
                assert 0 <= verdict.accepted <= len(drafts)
                assert len(verdict.tokens) == verdict.accepted + 1
                assert all(0 <= t < VOCAB for t in verdict.tokens)


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-300, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy
    assert not SamplingParams(temperature=1e-5).greedy  # the epsilon itself samples
    logits = hostile_logits(8, seed=1)
    g = torch.Generator().manual_seed(1)
    assert [sample_token(r, params, g) for r in logits] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45])
def test_a_tiny_top_p_keeps_exactly_the_top_token(top_p: float) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


def test_a_nan_draft_row_is_a_rejection_and_stays_exact() -> None:
    """q = NaN: the draft is rejected and the token drawn from p alone, distributed as p."""
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0)
    p = target_probs(logits, params)[0]
    q = torch.full((1, 8), float("nan"))
    n = 4000
    samples = []
    for seed in range(n):
        verdict = verify_drafts(logits, [int(p.argmax())], q, params,
                                torch.Generator().manual_seed(seed))
        assert verdict.accepted == 0
        samples.append(verdict.tokens[0])
    observed = torch.bincount(torch.tensor(samples), minlength=8).double()
    expected = p.double() * n
    keep = expected >= 5
    obs = [*observed[keep].tolist(), float(observed[~keep].sum())]
    exp = [*expected[keep].tolist(), float(expected[~keep].sum())]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    scale = sum(obs) / sum(exp)
    assert chisquare(obs, [e * scale for e in exp]).pvalue > 1e-3


def test_the_engine_serves_hostile_params(pair: tuple[Path, Path]) -> None:
    prompt = [3, 1, 4, 1, 5]
    greedy = run(engine_from(pair), {"g": (prompt, GREEDY)})["g"].token_ids
    requests = {}
    for i, (t, top_p, top_k, seed) in enumerate([
        (1e-38, 1.0, 0, HOSTILE_SEEDS[0]),
        (5e-324, 1e-300, 10**18, HOSTILE_SEEDS[1]),
        (1e-300, 1e-6, 0, None),
        (1.0, 1e-300, 0, HOSTILE_SEEDS[0]),  # top-p keeps only the argmax: greedy output
        (2.0, 5e-324, 10**18, HOSTILE_SEEDS[1]),
        (2.0, 1.0, 10**18, 2**64 - 1),
    ]):
        requests[f"h{i}"] = (prompt, SamplingParams(temperature=t, top_p=top_p, top_k=top_k,
                                                    seed=seed, max_tokens=12, ignore_eos=True))
    for speculative in (True, False):
        outs = run(engine_from(pair, speculative), requests)
        for rid, out in outs.items():
            assert out.finish_reason == "length", rid
            assert all(0 <= t < VOCAB for t in out.token_ids)
        for rid in ("h0", "h1", "h2", "h3", "h4"):
            assert outs[rid].token_ids == greedy, rid
