"""The adaptive verify budget (engines/reference/spec_budget.py): its cost model, its plans
against brute force, its persistence, and where it sits in the engine's step."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from spec_helpers import engine_from, random_prompts
from tiny_models import write_tiny_pair

from serve_app.engines.reference import spec_budget
from serve_app.engines.reference.sampling import SamplingParams
from serve_app.engines.reference.spec_budget import (
    FEATURES,
    AcceptanceModel,
    StepCostModel,
    StepShape,
    VerifyBudget,
    load_cost_model,
    nonnegative_solve,
    plan_windows,
    save_cost_model,
)

# Seconds per feature of a made-up machine: fixed, per row, per token, per padded token, per
# drafted row, per drafted row not greedy, and once when the draft runs.
TRUE = torch.tensor([0.010, 0.002, 0.0008, 0.0004, 0.003, 0.001, 0.004], dtype=torch.float64)


def _seconds(shape: StepShape) -> float:
    return float(torch.tensor(shape.features(), dtype=torch.float64) @ TRUE)


def _shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows = rng.randint(1, 32)
        drafted = rng.randint(0, rows) if rng.random() < 0.8 else 0
        ks = [rng.randint(0, 7) if i < drafted else 0 for i in range(rows)]
        out.append(StepShape(rows, rows + sum(ks), 1 + max(ks), drafted, rng.randint(0, drafted)))
    return out


def test_the_cost_model_learns_a_machine_from_its_steps() -> None:
    model = StepCostModel()
    for shape in _shapes(400):
        model.observe(shape, _seconds(shape))
    # The pull toward the prior is small: new steps' times come out within 5% (measured: at
    # most 1.9%, median 0.15%; with a diagonal pull alone, 28% and 0.5%).
    errors = [abs(model.predict(s) - _seconds(s)) / _seconds(s) for s in _shapes(50, seed=1)]
    assert max(errors) < 0.05, max(errors)
    assert sorted(errors)[25] < 0.01
    # Its own record of errors (each made before the step was seen) falls as it learns.
    assert sum(model.errors[-50:]) < sum(model.errors[:50])
    # A cold model has no error on record for its first guess (relative units, not seconds).
    assert len(model.errors) == 399


def test_the_cost_table_persists_and_a_restart_plans_from_it(tmp_path: Path) -> None:
    model = StepCostModel()
    for shape in _shapes(200):
        model.observe(shape, _seconds(shape))
    table = tmp_path / "deployment" / "step_cost.json"
    save_cost_model(model, table)
    restarted = load_cost_model(table)
    assert np.allclose(restarted.weights, model.weights)
    shape = StepShape(8, 40, 6, 8)
    assert restarted.predict(shape) == pytest.approx(model.predict(shape))
    # No table yet, or one another version measured (other features): the cold prior.
    # Negative seconds, or not a table: refused, naming the file.
    assert load_cost_model(tmp_path / "none.json").observed == 0
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"features": ["step"], "seconds_per_feature": [1]}))
    assert load_cost_model(old).weights.tolist() == StepCostModel().weights.tolist()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"features": list(FEATURES),
                               "seconds_per_feature": [-1] * len(FEATURES)}))
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_cost_model(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_cost_model(bad)


def _objective(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> float:
    return float(w @ a @ w - 2 * b @ w)


@pytest.mark.parametrize("seed", range(4))
def test_the_fit_is_the_best_non_negative_one(seed: int) -> None:
    # Against every choice of which weights are 0 (the best feasible one is the optimum), on
    # systems whose free solution has negative weights.
    gen = torch.Generator().manual_seed(seed)
    negatives = 0
    for _ in range(25):
        x = torch.randn(30, 6, generator=gen, dtype=torch.float64)
        a = x.T @ x + 1e-3 * torch.eye(6, dtype=torch.float64)
        b = x.T @ torch.randn(30, generator=gen, dtype=torch.float64)
        negatives += bool((torch.linalg.solve(a, b) < 0).any())
        best = float("inf")
        for free in itertools.product((False, True), repeat=6):
            idx = torch.tensor([i for i, f in enumerate(free) if f], dtype=torch.long)
            w = torch.zeros(6, dtype=torch.float64)
            if len(idx):
                w[idx] = torch.linalg.solve(a[idx][:, idx], b[idx])
            if bool((w >= 0).all()):
                best = min(best, _objective(a, b, w))
        w = torch.from_numpy(nonnegative_solve(a.numpy(), b.numpy()))
        assert bool((w >= 0).all())
        assert _objective(a, b, w) <= best + 1e-9 * abs(best)
    assert negatives >= 20


def test_a_feature_the_steps_price_below_zero_leaves_the_others_fitted() -> None:
    # Steps whose times make a padded token cost less than nothing (as a noisy machine's can):
    # clamping the free fit's negative weight to 0 left the other weights fitted for it, and
    # priced these speculative steps 24-27% over what they took (the budget then steps aside
    # where drafting pays); the non-negative fit prices plain and speculative steps within
    # 0.6% of what they took (three seeds).
    truth = torch.tensor([0.016, 0.002, 0.0008, 0.0, 0.003, 0.0, 0.005], dtype=torch.float64)
    rng = random.Random(0)
    model = StepCostModel()
    steps = []
    for i in range(300):
        rows = rng.randint(2, 6)
        ks = [rng.randint(0, 7) for _ in range(rows)] if i % 3 else [0] * rows
        shape = StepShape(rows, rows + sum(ks), max(ks) + 1, rows if i % 3 else 0)
        x = torch.tensor(shape.features(), dtype=torch.float64)
        seconds = float(x @ truth) - 0.0006 * float(x[3] - x[2]) + rng.gauss(0, 0.001)
        model.observe(shape, seconds)
        steps.append((shape, seconds))
    assert model.weights.min() >= 0
    for speculative in (False, True):
        shown = [(s, t) for s, t in steps[-150:] if (s.drafted > 0) == speculative]
        predicted = sum(model.predict(s) for s, _ in shown)
        assert abs(predicted / sum(t for _, t in shown) - 1) < 0.02


def _survival(accept: torch.Tensor) -> list[list[float]]:
    return torch.cumprod(accept.double(), dim=1).tolist()


def _brute_force(surv: list[list[float]], caps: list[int], cost: StepCostModel,
                 drafted: list[bool] | None, costly: list[bool]) -> float:
    b = len(surv)
    best = 0.0
    for ks in itertools.product(*[range(c + 1) for c in caps]):
        tokens = b + sum(sum(surv[i][:k]) for i, k in enumerate(ks))
        ran = drafted if drafted is not None else [k > 0 for k in ks]
        shape = StepShape(b, b + sum(ks), 1 + max(ks), sum(ran),
                          sum(r and c for r, c in zip(ran, costly, strict=True)))
        best = max(best, tokens / cost.predict(shape))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("before_draft", [False, True])
def test_a_plan_is_as_good_as_every_window_tried(seed: int, before_draft: bool) -> None:
    """Against every combination of windows for 3 requests: the plan's expected tokens per
    predicted second is the best one (within 2%: the plan searches prefixes of one order).
    Before the draft, a request's first draft also pays for drafting it."""
    gen = torch.Generator().manual_seed(seed)
    surv = _survival(torch.rand(3, 4, generator=gen) * 0.9 + 0.05)
    caps = [4, 2, 3]
    cost = StepCostModel(prior=(TRUE * torch.rand(len(FEATURES), generator=gen) * 3).tolist())
    drafted = None if before_draft else [True, True, True]
    costly = [bool(seed % 2), True, False]
    plan = plan_windows(surv, caps, cost, drafted, costly)
    assert all(0 <= k <= c for k, c in zip(plan.drafts, caps, strict=True))
    got = plan.expected_tokens / plan.predicted_seconds
    assert got == pytest.approx(
        (3 + sum(sum(surv[i][:k]) for i, k in enumerate(plan.drafts)))
        / cost.predict(plan.shape))
    assert got >= 0.98 * _brute_force(surv, caps, cost, drafted, costly)


def test_no_draft_where_it_cannot_pay() -> None:
    """Low survival, or a draft that costs more than a decode: draft for nobody. High survival
    and a cheap draft: draft for every request."""
    cost = StepCostModel(prior=TRUE.tolist())
    low = [[0.05 ** j for j in range(1, 8)]] * 16
    high = [[0.9 ** j for j in range(1, 8)]] * 16
    assert plan_windows(low, [7] * 16, cost).drafts == [0] * 16
    assert all(k > 0 for k in plan_windows(high, [7] * 16, cost).drafts)
    dear = StepCostModel(prior=[0.01, 0.001, 0.001, 0.001, 0.05, 0.0, 0.01])
    assert plan_windows(high, [7] * 16, dear).drafts == [0] * 16


def test_acceptance_is_calibrated_by_class_and_request() -> None:
    """Verdicts move the estimate of their class and request only."""
    model = AcceptanceModel(gamma=4)
    conf = [[0.5] * 4] * 3
    before = model.estimate(["greedy", "sampled", "greedy"], ["a", "b", "new"], conf)
    for _ in range(50):
        model.proposed(["greedy", "sampled"], conf[:2])  # as a plan records them
        model.observe("greedy", "a", conf[0], drafted=4, accepted=4)
        model.observe("sampled", "b", conf[0], drafted=4, accepted=0)
    after = model.estimate(["greedy", "sampled", "greedy"], ["a", "b", "new"], conf)
    assert all(x > y for x, y in zip(after[0], before[0], strict=True))
    assert all(x < y for x, y in zip(after[1], before[1], strict=True))
    # A new greedy request starts from its class, not from request "a"'s own record.
    assert all(y < x <= z for x, y, z in zip(after[2], before[2], after[0], strict=True))
    # Before the draft runs, a block like those proposed: all accepted -> near certain.
    assert model.expected(["greedy"], ["new"])[0][3] > 0.8  # 50 blocks against a prior of 8
    assert model.expected(["sampled"], ["new"])[0][0] < 0.2


def test_the_expectation_before_the_draft_is_not_the_verified_positions_rate() -> None:
    """A plan verifies deep positions where the draft is confident, so the survival measured
    there is the confident blocks'. Before the draft, a block's expected survival must be the
    mean over every block the draft proposes: here half are confident (0.9 a position) and
    verified whole, half are not (0.3) and verified one deep."""
    model = AcceptanceModel(gamma=4)
    rng = random.Random(7)
    for step in range(3000):
        p = 0.9 if step % 2 else 0.3
        conf = [p] * 4
        model.proposed(["sampled"], [conf])
        drafted = 4 if p == 0.9 else 1
        accepted = 0
        while accepted < drafted and rng.random() < p:
            accepted += 1
        model.observe("sampled", "r", conf, drafted, accepted)
    expected = model.expected(["sampled"], ["new"])[0]
    true = [0.5 * (0.9 ** j + 0.3 ** j) for j in range(1, 5)]
    # The verified positions' own rate at 3: 0.73 (the confident half only); this: 0.38.
    # Over seeds 0-9 of this simulation: at most 0.015 from the truth.
    for got, want in zip(expected, true, strict=True):
        assert abs(got - want) < 0.05


def test_the_calibration_carries_from_shallow_verdicts_to_deep_positions() -> None:
    """An under-confident head (survival 1.5 x its running product, at every position),
    verified only two deep: a deep position whose product is one the shallow verdicts saw is
    calibrated as they were. A per-position calibration would keep its prior there (1.0)."""
    model = AcceptanceModel(gamma=6)
    rng = random.Random(3)
    for _ in range(4000):
        p = rng.uniform(0.15, 0.6)
        conf = [p] * 6
        model.proposed(["sampled"], [conf])
        accepted = 0
        while accepted < 2 and rng.random() < min(1.0, 1.5 * p ** (accepted + 1)) / (
                min(1.0, 1.5 * p ** accepted) if accepted else 1.0):
            accepted += 1
        model.observe("sampled", "r", conf, 2, accepted)
    # Position 5 of a block at 0.75 a position: product 0.237, which position 1 and 2 saw.
    deep = model.estimate(["sampled"], ["new"], [[0.75] * 6])[0][4]
    # True 0.356; seeds 0-9 of this simulation: 0.334-0.397 (a per-position calibration: ~0.24).
    assert abs(deep - 1.5 * 0.75 ** 5) < 0.07, deep


def test_without_a_confidence_head_survival_is_learned_by_position() -> None:
    model = AcceptanceModel(gamma=4)
    rng = random.Random(11)
    accept = [0.9, 0.6, 0.5, 0.2]  # P(draft j accepted | drafts before it were)
    for _ in range(3000):
        model.proposed(["greedy"], [None])
        accepted = 0
        while accepted < 4 and rng.random() < accept[accepted]:
            accepted += 1
        model.observe("greedy", "r", None, 4, accepted)
    true = [0.9, 0.54, 0.27, 0.054]
    for got in (model.estimate(["greedy"], ["new"], None)[0],
                model.expected(["greedy"], ["new"])[0]):
        assert all(abs(g - t) < 0.05 for g, t in zip(got, true, strict=True)), got


def test_a_request_left_undrafted_returns_to_its_class() -> None:
    """A request's own record fades with the steps, drafted for or not: a few unlucky verdicts
    must not keep the budget from drafting for it for the rest of its answer. One verdict
    moves it little (a sampled draft is close to a coin flip); a run of them, more."""
    model = AcceptanceModel(gamma=4)
    model.tick()
    model.observe("sampled", "r", [0.8] * 4, drafted=4, accepted=0)
    assert model.request_ratio("r") > 0.85
    for _ in range(9):
        model.tick()
        model.observe("sampled", "r", [0.8] * 4, drafted=4, accepted=0)
    assert model.request_ratio("r") < 0.75
    for _ in range(40):  # plain steps: no verdict
        model.tick()
    assert model.request_ratio("r") > 0.9


def test_the_expectation_follows_the_recent_blocks() -> None:
    """Before the draft, a class expects what its recent blocks offered: after a run of
    unsure blocks, a run of sure ones moves it within ~100 blocks."""
    model = AcceptanceModel(gamma=4)
    rng = random.Random(5)
    for p, n in ((0.3, 2000), (0.9, 100)):
        for _ in range(n):
            model.proposed(["greedy"], [[p] * 4])
            accepted = 0
            while accepted < 4 and rng.random() < p:
                accepted += 1
            model.observe("greedy", "r", [p] * 4, 4, accepted)
    # 0.3 over 2,000 blocks, then 0.9 over 100: measured 0.78 (a mean over the last ~1,000
    # blocks would say 0.36).
    first = model.expected(["greedy"], ["new"])[0][0]
    assert first > 0.7, first


def test_a_plain_step_reuses_the_plan_until_what_it_read_moves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    budget = VerifyBudget(gamma=4)
    budget.speculative_steps = 10 ** 6  # past the warm-up
    calls = []
    real = spec_budget.plan_windows

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(spec_budget, "plan_windows", counted)
    args = (["greedy"] * 2, ["a", "b"], [4, 4], [False, False])
    first = budget.to_draft(*args)
    assert budget.to_draft(*args) == first and len(calls) == 1
    budget.acceptance.observe("greedy", "a", [0.5] * 4, 2, 1)  # a verdict: planned again
    budget.to_draft(*args)
    assert len(calls) == 2
    budget.to_draft(["greedy"] * 2, ["a", "c"], [4, 4], [False, False])  # another request
    assert len(calls) == 3


def test_probes_back_off_while_the_plan_stays_plain_and_reset_when_it_drafts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget whose plans say plain drafts for one request in turn, after 8 x rows plain
    steps, then after twice as many each time, up to PROBE_BACKOFF_MAX times (at most rows
    times: one request's probe is an ordinary speculative step); a plan that drafts starts the
    schedule again."""
    budget = VerifyBudget(gamma=4)
    budget.speculative_steps = 10 ** 6  # past the warm-up
    pays = [False]
    real = spec_budget.plan_windows

    def plan(*args, **kwargs):
        out = real(*args, **kwargs)
        if pays[0]:  # a plan that drafts, whatever the models say
            out.drafts = [2] * len(out.drafts)
            out.expected_tokens = 10 * out.base_rate * out.predicted_seconds
        else:
            out.drafts = [0] * len(out.drafts)
            out.expected_tokens = out.base_rate * out.predicted_seconds
        return out

    monkeypatch.setattr(spec_budget, "plan_windows", plan)
    rows = 8
    args = (["sampled"] * rows, list(range(rows)), [4] * rows, [False] * rows)

    def probes(steps: int, args=args) -> list[tuple[int, list[int]]]:
        out = []
        for step in range(1, steps + 1):
            budget.acceptance.version += 1  # something moved: planned again every step
            chosen = budget.to_draft(*args)
            if chosen:
                out.append((step, chosen))
        return out

    every = 8 * rows
    assert spec_budget.PROBE_BACKOFF_MAX == 8
    expected = [64, 192, 448, 960, 1472, 1984]  # gaps 64, 128, 256, 512, 512, 512
    got = probes(expected[-1])
    assert [step for step, _ in got] == expected
    assert [chosen for _, chosen in got] == [[b] for b in range(6)]  # one request, in turn
    assert budget.probe_steps == 6
    pays[0] = True
    budget.acceptance.version += 1
    assert budget.to_draft(*args) == list(range(rows))
    pays[0] = False
    assert [step for step, _ in probes(3 * every)] == [every, 3 * every]
    # One request: every 8 plain steps, however many probes found the plan plain.
    alone = (["sampled"], ["z"], [4], [False])
    assert [step for step, _ in probes(40, alone)] == [8, 16, 24, 32, 40]


def test_a_probe_and_one_request_in_turn_verify_their_whole_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After the draft the plan's windows stand, except: the request of this step's probe
    verifies its whole block, and so does one drafted request in turn when that adds at most
    EXPLORE_COST to the step's predicted time (so that the calibration also sees the blocks
    the plans price low); where widening one window widens the whole batch's, it does not."""
    cuts: list[bool] = [True]
    real = spec_budget.plan_windows

    def plan(survival, caps, cost, drafted=None, costly=None):  # every window cut to one draft
        out = real(survival, caps, cost, drafted, costly)
        out.drafts = [1 if drafted is not None else (0 if cuts[0] else 1)] * len(caps)
        if drafted is None and cuts[0]:
            out.expected_tokens = out.base_rate * out.predicted_seconds  # plain pays best
        return out

    monkeypatch.setattr(spec_budget, "plan_windows", plan)

    def budget(weights: list[float]) -> VerifyBudget:
        b = VerifyBudget(gamma=4)
        b.cost = StepCostModel(prior=weights)
        b.speculative_steps = 10 ** 6  # past the warm-up
        return b

    def windows(b: VerifyBudget, rows: int) -> list[int]:
        return b.plan(["greedy"] * rows, list(range(rows)), [[0.9] * 4] * rows, [4] * rows,
                      [True] * rows, [False] * rows).drafts

    machine = [0.010, 0.002, 0.0002, 0.0001, 0.003, 0.0, 0.004]
    cheap = budget(machine)  # a whole block for one of two: 1.2 ms more of a 26 ms step
    assert [windows(cheap, 2) for _ in range(3)] == [[4, 1], [1, 4], [4, 1]]
    assert windows(budget(TRUE.tolist()), 2) == [1, 1]  # 4.8 ms of 29: over EXPLORE_COST
    padded = [*machine[:3], 0.01, *machine[4:]]  # a padded token 10 ms: one widens all 8
    assert windows(budget(padded), 8) == [1] * 8
    # A probe (the plan before the draft says plain for 8 steps, one request) verifies its
    # whole block, here with the turns off.
    monkeypatch.setattr(spec_budget, "EXPLORE_COST", -1.0)
    assert windows(cheap, 1) == [1]
    probing = budget(machine)
    args = (["greedy"], [0], [4], [False])
    drafted = [probing.to_draft(*args) for _ in range(spec_budget.PROBE_EVERY_MIN)]
    assert drafted[-1] == [0] and not any(drafted[:-1])
    assert windows(probing, 1) == [4]


def test_windows_are_chosen_before_the_target_speaks(tmp_path: Path) -> None:
    """In every speculative step the plan is made after the draft and before the verify
    forward: the target's verdict on a step cannot reach its windows. The engine's fitted
    table is what the next engine on the same file starts from."""
    pair = write_tiny_pair(tmp_path / "pair")
    table = tmp_path / "step_cost.json"
    engine = engine_from(pair, cost_table=str(table))
    budget = engine.budget
    assert budget is not None
    events: list[str] = []
    runner = engine.runner
    forward, propose, plan = runner.forward, runner.propose, budget.plan

    def spy(name: str, fn):
        def call(*args, **kwargs):
            verify = kwargs.get("verify", False)
            events.append(name + (":verify" if verify else ""))
            return fn(*args, **kwargs)
        return call

    runner.forward = spy("forward", forward)  # type: ignore[method-assign]
    runner.propose = spy("propose", propose)  # type: ignore[method-assign]
    budget.plan = spy("plan", plan)  # type: ignore[method-assign]
    engine.generate(random_prompts(3, 64, seed=4),
                    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    verifies = [i for i, e in enumerate(events) if e == "forward:verify"]
    assert verifies
    for i in verifies:
        assert events[i - 2:i] == ["propose", "plan"]
    assert events.count("plan") == len(verifies)
    budget.save()
    assert load_cost_model(table).weights.tolist() == pytest.approx(
        budget.cost.weights.tolist())
    again = engine_from(pair, cost_table=str(table))
    assert again.budget is not None
    assert again.budget.cost.weights.tolist() == pytest.approx(budget.cost.weights.tolist())


@pytest.mark.parametrize("plan_drafts", [True, False])
@pytest.mark.parametrize("speedup", [0.7, 0.9, 1.1, 1.5])
def test_the_budget_steps_the_way_measured_to_do_more_per_second(
        monkeypatch: pytest.MonkeyPatch, speedup: float, plan_drafts: bool) -> None:
    """A plan that always drafts, or never (its cost model wrong), on steps that take the time
    that makes drafting `speedup` x as many tokens per second as a plain step (the tokens its
    windows are expected to commit): below 1x the budget steps plainly, drafting now and then to
    see whether it pays again; above, it drafts, stepping plainly now and then, so that the
    comparison stays measured: a recheck once its step's loss is GOODPUT_RECHECK_COST of the
    time since the last. Where the plan names no one, drafting verifies whole blocks. The way
    never measured is taken after a few steps the other way."""
    real = spec_budget.plan_windows

    def plan(survival, caps, cost, drafted=None, costly=None):
        out = real(survival, caps, cost, drafted, costly)
        if drafted is None and not plan_drafts:
            out.drafts = [0] * len(out.drafts)
            out.expected_tokens = out.base_rate * out.predicted_seconds
        else:
            out.drafts = [2] * len(out.drafts)
            out.expected_tokens = 10 * out.base_rate * out.predicted_seconds
        return out

    monkeypatch.setattr(spec_budget, "plan_windows", plan)
    budget = VerifyBudget(gamma=4)
    budget.speculative_steps = 10 ** 6  # past the warm-up
    rows, plain_seconds = 8, 0.040
    classes, rids, caps, fixed = ["sampled"] * rows, list(range(rows)), [4] * rows, [False] * rows
    drafted, drafted_seconds = [], []
    for _ in range(1200):
        probes = budget.probe_steps
        chosen = budget.to_draft(classes, rids, caps, fixed)
        # A probe (one request, while the budget is plain) keeps acceptance measured: not a way.
        drafted.append(bool(chosen) and budget.probe_steps == probes)
        if chosen:
            windows = budget.plan(classes, rids, [[0.8] * 4] * rows, caps, [True] * rows, fixed)
            assert windows.expected_tokens > rows
            if drafted[-1]:
                assert windows.drafts == ([2] * rows if plan_drafts else caps)
            seconds = windows.expected_tokens / rows * plain_seconds / speedup
            drafted_seconds.append(seconds)
            budget.step_time(StepShape(rows, rows + sum(windows.drafts), 3, rows, rows), seconds)
        else:
            budget.step_time(StepShape(rows, rows, 1, 0), plain_seconds)
    late = drafted[400:]
    spec_seconds = statistics.median(drafted_seconds[-50:])
    lost, per_step = ((1 - speedup) * spec_seconds, plain_seconds) if speedup < 1 else (
        (1 - 1 / speedup) * plain_seconds, spec_seconds)
    every = math.ceil(min(max(lost / (spec_budget.GOODPUT_RECHECK_COST * per_step),
                              spec_budget.GOODPUT_RECHECK_MIN), spec_budget.GOODPUT_RECHECK_MAX))
    assert late.count(speedup < 1) == pytest.approx(len(late) / every, abs=2)
    first = spec_budget.GOODPUT_FIRST
    assert drafted[: first + 1] == [plan_drafts] * first + [not plan_drafts]
