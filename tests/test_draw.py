"""models/draw.py: the token sampler of the draft block and the target's verify."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from serve_app.models import draw as draw_module
from serve_app.models.draw import draw, draw_rows


def test_draws_follow_the_distribution_and_never_a_zero() -> None:
    probs = torch.tensor([0.0, 0.1, 0.0, 0.45, 0.3, 0.15, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=7)
    assert counts[probs == 0].sum() == 0
    mass = probs > 0
    # Seeded: this p-value is fixed (0.054 when written); a wrong sampler is far below 1e-3.
    assert chisquare(counts[mass].numpy(), (probs[mass] * n).numpy()).pvalue > 1e-3


def test_unnormalised_rows_and_one_generator_per_row() -> None:
    probs = torch.tensor([[2.0, 0.0, 2.0], [0.0, 0.0, 5.0]])
    a = draw_rows(probs, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    b = draw_rows(probs, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    assert a.tolist() == b.tolist() and a[1] == 2 and a[0] in (0, 2)


def test_a_uniform_that_rounds_up_to_the_total_takes_the_last_token_with_mass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # u * total can round to total itself; searchsorted then points past the vocabulary.
    monkeypatch.setattr(draw_module.torch, "rand",
                        lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    probs = torch.tensor([[0.2, 0.5, 0.3, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    assert draw_rows(probs, [None, None]).tolist() == [2, 0]
