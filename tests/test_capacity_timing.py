"""Time model properties and calibration against the published anchors."""

from __future__ import annotations

import pytest

from capacity import Layout, describe_model, load_gpus
from capacity.calibration import anchors, evaluate
from capacity.timing import _distinct_experts, decode_rate, prefill_seconds


@pytest.fixture(scope="module")
def setup():
    return describe_model("kimi-k3"), describe_model("kimi-k3-dspark"), load_gpus()


B300 = Layout(gpu="B300", tp=8, ep=8)


def test_distinct_experts_formula():
    assert _distinct_experts(896, 16, 1) == pytest.approx(16)
    assert _distinct_experts(896, 16, 8) == pytest.approx(896 * (1 - (1 - 16 / 896) ** 8))
    assert _distinct_experts(896, 16, 10_000) == pytest.approx(896, rel=1e-6)


def test_verify_reads_more_experts_than_plain_decode(setup):
    k3, draft, gpus = setup
    plain = decode_rate(k3, B300, gpus["B300"], 1, 8192)
    spec = decode_rate(k3, B300, gpus["B300"], 1, 8192, draft)
    assert spec.step.bytes_per_gpu > plain.step.bytes_per_gpu * 1.2
    assert spec.step.tokens_per_step == pytest.approx(3.45)
    assert spec.per_user_tokens_s > 2 * plain.per_user_tokens_s


def test_more_users_more_total_less_each(setup):
    k3, _, gpus = setup
    one = decode_rate(k3, B300, gpus["B300"], 1, 8192)
    many = decode_rate(k3, B300, gpus["B300"], 32, 8192)
    assert many.total_tokens_s > 5 * one.total_tokens_s
    assert many.per_user_tokens_s < one.per_user_tokens_s


def test_long_context_attention_is_quadratic(setup):
    k3, _, gpus = setup
    short = prefill_seconds(k3, B300, gpus["B300"], 131_072)
    long = prefill_seconds(k3, B300, gpus["B300"], 1_048_576)
    # 8x the tokens costs far more than 8x the time once MLA's L^2 term dominates,
    # and a 1M-token prompt takes minutes without context parallelism.
    assert long > 20 * short
    assert long > 60


def test_every_modeled_k3_anchor_within_25_percent():
    results = evaluate()
    modeled = [r for r in results
               if r.error is not None and r.anchor.model == "K3" and r.anchor.fitted]
    assert len(modeled) >= 15
    worst = max(modeled, key=lambda r: abs(r.error))
    assert abs(worst.error) < 0.25, worst.anchor.name


def test_unmodeled_anchor_says_why():
    skipped = [a for a in anchors() if a.predict is None]
    assert skipped and all("not modeled" in a.assumption for a in skipped)
