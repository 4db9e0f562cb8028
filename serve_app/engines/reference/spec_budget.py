"""The adaptive verify budget: how many of its drafts each request verifies this step.

Every decode step with a draft chooses, per running request, a window of k in 0..gamma drafts
(0: a plain decode row inside the same verify forward) to maximise the tokens the step is
expected to commit per second of step time. The choice uses what is known before the target
runs:

- the draft's confidence for each block position (its confidence head: P(draft j accepted |
  draft j-1 accepted));
- measured acceptance by predicted survival, per request class (greedy, sampled, grammar) and
  per request, which calibrates that confidence (the head was trained for one sampling regime);
- the engine's own step-cost model (`StepCostModel`), fitted online to the measured time of
  every decode step and persisted, so a restart does not start cold.

Exactness: nothing here reads the target's logits for the step being planned. A plan is a
function of the draft's proposal and of verdicts of earlier steps, and verification of any
window is exact (sampling.py), so the output distribution is the target's whatever k is chosen
(the same argument as for a fixed k: the rejection rule is exact for each position given the
prefix, and the decision to stop verifying is made before the target speaks).

Before drafting, the same plan made from expected survival alone (no confidence yet) says which
requests are worth drafting for at all: the draft runs for those only, the others decode plainly
in the same verify forward, and a step where none is worth it skips the draft's forward (one
step in `PROBE_EVERY_PER_ROW` x rows drafts for one request anyway, so that what it decides on stays
measured, less often each time the plan stays plain, `PROBE_BACKOFF_MAX`; every request is
drafted for during the first `WARMUP_STEPS` speculative steps).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# What a step is, as the cost model sees it: decode rows, tokens in the target forward (rows +
# drafts), the padded forward's rows x width (the longest window; attention runs on it), the
# requests the draft ran for, and whether it ran at all (its forward and a verify's bookkeeping
# cost a step a fixed part whatever the rows: on the embedded pair ~3 ms of a 12 ms decode
# forward; without this feature the per-row weight, fitted where many rows draft, priced a
# speculative step of a few rows ~25% under what it took). Of the drafted requests, those not
# greedy (`costly_rows`) cost more again: the draft samples their block and the verify walks the
# rejection rule (or a grammar's masks) row by row; at 16 requests a K3-instant step's sampling
# took 12 ms where a greedy one's took 0.8 ms, and a fit without this feature, carried over from
# greedy traffic, priced the sampled steps 15% under what they took (the budget drafted and lost).
FEATURES = ("step", "rows", "tokens", "padded_tokens", "drafted_rows", "costly_rows", "drafted")

# Relative costs assumed before any step is measured (a decode forward of one row = 1.3):
# only ratios matter to a plan, and the first measured steps rescale them (`StepCostModel`).
_COLD_PRIOR = (1.0, 0.1, 0.1, 0.1, 0.1, 0.05, 0.2)
# How many steps' worth of evidence the prior counts for against measurements.
_PRIOR_STEPS = 4.0
# The diagonal's share of the prior's pull (`StepCostModel._solve`).
_THIN_RIDGE = 0.05
# Older measurements fade: a weight of 0.5 after ~350 steps, so a changed machine (another
# batch mix, a noisy neighbour) is followed within minutes.
_DECAY = 0.998
# The largest acceptance probability a position is believed to have: a plan never counts a
# draft as certain.
MAX_ACCEPT = 0.98
# Shrinkage of a request's own acceptance ratio toward its class (in expected drafts). At 4, a
# sampled request's few unlucky verdicts (at T 1 a draft is close to a coin flip) turned its
# plans plain: K3 thinking at batch 1 (19 prompts x 64 tokens, 4 repeats, one run) 1.09x
# target-only with 1,818 of 3,267 steps plain, at 16 1.29x with 194 (every draft verified:
# 1.24x); at T 0.6 and greedy the two were even (1.52x / 1.52x, 1.76x / 1.77x).
_REQUEST_PRIOR = 16.0
# A request's own evidence fades by this per decode step, drafted for or not, read in whole
# periods of _REQUEST_FADE_EVERY steps (so that a plan between plain steps can stand). Fading
# per verdict alone locked a request out: a few unlucky sampled verdicts halved its ratio, the
# budget stopped drafting for it, and with no verdict its ratio never recovered (K3 thinking,
# batch 1, 19 prompts: 657 of 917 steps plain, 1.10x, against 1.42x with no request ratio).
_REQUEST_DECAY = 0.9
_REQUEST_FADE_EVERY = 8
# A class's acceptance follows the traffic (a new mix of prompts) over ~700 verdicts.
_CLASS_DECAY = 0.999
# The plans read weights refitted every REFIT_EVERY observed steps (every step for the first
# 4 x REFIT_EVERY): solving the ridge system after every step cost ~0.4 ms, 0.5% of a plain step
# at 32 requests on this CPU, while a step moves the fit by its decay's 0.2%.
REFIT_EVERY = 8
# When no request is worth drafting for, one step in PROBE_EVERY_PER_ROW x rows (at least
# PROBE_EVERY_MIN) drafts for one request anyway, to keep acceptance and the cost of a
# speculative step measured: without them a budget that once turned speculation off would never
# see it pay again (measured: a cold engine at one greedy request locked itself into plain steps,
# 0.91x, where verifying every draft ran 1.73x). A probe's price grows with the batch: this
# engine pads a verify batch to its longest window, so one request's window widens every row
# (a probe in a 16-request batch cost two to three plain steps).
PROBE_EVERY_PER_ROW = 8
PROBE_EVERY_MIN = 8
# Each probe after which the plan still says plain doubles the interval to the next, up to this
# factor (and at most the batch's rows); a plan that drafts again resets it. Probes are the
# price of stepping aside, and a budget whose plans keep saying plain learns less from each
# one: at 4 K3-thinking requests (64 tokens, 10 repeats, process time, one run each way, the
# factor then up to 8 there) a probe every 32 plain steps left the budget at 0.97x
# target-only, backed off at 0.99x (40 -> 13 probes).
PROBE_BACKOFF_MAX = 8
# Until this many speculative steps are measured, every request is drafted for: the cost model
# and the acceptance counts start from priors, and a plan must see what drafting costs.
WARMUP_STEPS = 16
# Drafting must beat a plain step by this much in the plan before the draft runs: what the plan
# does not price (the draft's bookkeeping, a verify's sampling) makes a marginal gain a loss.
DRAFT_MARGIN = 0.05
# Each speculative step, one drafted request (in turn) verifies its whole block when that adds
# at most this share to the step's predicted time (a probe's request always does). A plan
# verifies a draft only where its calibrated survival pays, so without this the calibration
# never sees the blocks it prices low, and keeps pricing them low: the confidence head is
# under-confident there (greedy, on the embedded pair: 0.05 measured where 0.01 is predicted),
# and at one greedy request the plan's windows (mostly 2-5 drafts) ran 1.79x target-only where
# verifying all 7 ran 2.00x.
EXPLORE_COST = 0.1
# The plan proposes, the measured goodput disposes: per batch size (in powers of two), the
# ratio of the tokens per measured second per row of a drafted step (the tokens its windows
# were expected to commit) to a plain step's next to it (`Goodput`; exponentially weighted,
# GOODPUT_DECAY per pair). Once measured the budget steps the way that does more per second,
# whatever the plan says (the plan still chooses whom to draft for and the windows, and where
# it names no one everyone verifies the whole block: its windows are priced by the cost model
# the measurement overrules); now and then it takes the other way once, which makes the next
# pair, as often as that costs GOODPUT_RECHECK_COST of the time since the last (at least
# GOODPUT_RECHECK_MIN steps apart, at most GOODPUT_RECHECK_MAX): the nearer the two ways, the
# less a recheck costs and the sooner the lead may turn. The cost model's error is what this
# catches: at 16 K3-instant requests after greedy
# traffic the plans expected the tokens the steps then committed (1,996 vs 1,995) but priced the
# steps 11-17% under what they took, and drafting every step ran 0.89-0.94x target-only; at 16
# and 32 greedy requests the plans stayed plain where verifying every draft ran 1.05-1.08x.
# Rates measured apart rather than in pairs took this machine's drift for a difference: at 16
# sampled requests the budget then drafted in 70% of the steps and ran 0.91x target-only.
GOODPUT_DECAY = 0.8
GOODPUT_RECHECK_COST = 0.005
GOODPUT_RECHECK_MIN = 8
GOODPUT_RECHECK_MAX = 512
GOODPUT_FIRST = 4
# Two steps at most this many decode steps apart make a pair (a recheck follows the last step).
GOODPUT_ADJACENT = 2


@dataclass(frozen=True)
class StepShape:
    rows: int
    tokens: int
    width: int
    drafted: int  # requests whose draft ran
    costly: int = 0  # of them, those not greedy (sampled or constrained: `request_class`)

    def features(self) -> list[float]:
        return [1.0, float(self.rows), float(self.tokens), float(self.rows * self.width),
                float(self.drafted), float(self.costly), float(self.drafted > 0)]


class StepCostModel:
    """Seconds of a decode step, linear in FEATURES, fitted by exponentially weighted ridge
    regression toward a prior (the persisted fit, or the cold relative prior rescaled to the
    first measurements). The fit is the best non-negative one (`nonnegative_solve`): no part of
    a step makes it faster."""

    def __init__(self, prior: Sequence[float] | None = None, prior_steps: float = _PRIOR_STEPS,
                 decay: float = _DECAY) -> None:
        n = len(FEATURES)
        self._prior = np.array(prior if prior is not None else _COLD_PRIOR, dtype=np.float64)
        self._prior_absolute = prior is not None
        self._prior_steps = prior_steps
        self._decay = decay
        self._xtx = np.zeros((n, n))
        self._xty = np.zeros(n)
        self._weight_sum = 0.0
        self._y_sum = 0.0
        self._p_sum = 0.0  # the cold prior's predictions of the same steps, for its scale
        self.observed = 0
        self._weights: np.ndarray | None = None  # the fit as of the last observed step
        self._weights_list: list[float] | None = None  # what predict() and the plans read
        self._since_refit = 0
        self.version = 0  # counts the refits: a plan made with the same version stands
        # |predicted - measured| / measured of each observed step, predicted before it ran.
        self.errors: list[float] = []

    @property
    def weights(self) -> np.ndarray:
        if self._weights is None:
            self._weights = self._solve()
        return self._weights

    def _scaled_prior(self) -> np.ndarray:
        if self._prior_absolute or self._p_sum <= 0:
            return self._prior
        return self._prior * (self._y_sum / self._p_sum)

    def _solve(self) -> np.ndarray:
        prior = self._scaled_prior()
        if self._weight_sum == 0:
            return prior
        # Toward the prior as `prior_steps` steps shaped like the measured ones would pull (the
        # features' mean second moments), plus a thin diagonal so that a feature no step has
        # varied yet (the draft's, before it ever runs) keeps its prior. A diagonal alone
        # pulled each weight apart, and the features move together (rows, tokens, drafted
        # rows): the fit traded one weight for another (a made-up machine's fixed draft cost
        # came out 0, and small steps 28% off).
        moments = self._xtx / self._weight_sum
        diagonal = np.diag(np.maximum(np.diagonal(moments), 1e-12))
        ridge = self._prior_steps * (moments + _THIN_RIDGE * diagonal)
        return nonnegative_solve(self._xtx + ridge, self._xty + ridge @ prior)

    def predict(self, shape: StepShape) -> float:
        return sum(x * w for x, w in zip(shape.features(), self.weights_list(), strict=True))

    def weights_list(self) -> list[float]:
        """The weights predict() and the plans use: the fit at most REFIT_EVERY steps old."""
        if self._weights_list is None:
            self._weights_list = self.weights.tolist()
        return self._weights_list

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not seconds > 0:
            return
        # The cold prior's first guess is in relative units: not an error.
        if self.observed or self._prior_absolute:
            predicted = self.predict(shape)
            self.errors.append(abs(predicted - seconds) / seconds)
            del self.errors[:-4096]
        x = np.array(shape.features())
        self._xtx = self._decay * self._xtx + np.outer(x, x)
        self._xty = self._decay * self._xty + x * seconds
        self._weight_sum = self._decay * self._weight_sum + 1.0
        self._y_sum = self._decay * self._y_sum + seconds
        self._p_sum = self._decay * self._p_sum + float(x @ self._prior)
        self.observed += 1
        self._weights = None
        self._since_refit += 1
        if self._since_refit >= REFIT_EVERY or self.observed <= 4 * REFIT_EVERY:
            self._weights_list = None
            self._since_refit = 0
            self.version += 1

    def to_dict(self) -> dict[str, Any]:
        return {"features": list(FEATURES), "seconds_per_feature": self.weights.tolist(),
                "observed_steps": self.observed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCostModel:
        if list(data.get("features", ())) != list(FEATURES):
            raise ValueError(f"a step-cost table for features {data.get('features')}, not "
                             f"{list(FEATURES)}")
        weights = [float(w) for w in data["seconds_per_feature"]]
        if len(weights) != len(FEATURES) or not all(w >= 0 and w < 1e3 for w in weights):
            raise ValueError("a step-cost table's weights must be finite, non-negative seconds")
        return cls(prior=weights)


def nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin over w >= 0 of wᵀ a w − 2 bᵀ w (a symmetric positive definite): Lawson and
    Hanson's active set on the normal equations. Solving freely and clamping the negative
    weights to 0 left the others fitted for weights that were no longer there: at 4 sampled
    requests a fit whose padded-token weight came out −0.4 ms priced a whole-block step 69 ms,
    12 ms over its own unclamped fit and ~20 ms over what such steps took, and the budget
    stepped aside where verifying everything paid 1.05-1.25x."""
    n = b.shape[0]
    w = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(float(np.abs(b).max()), 1e-30)
    for _ in range(3 * n):
        gradient = b - a @ w
        gradient[free] = -np.inf
        j = int(gradient.argmax())
        if free.all() or float(gradient[j]) <= tol:
            break
        free[j] = True
        while free.any():
            s = np.zeros(n)
            idx = free.nonzero()[0]
            s[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if (s[idx] > 0).all():
                w = s
                break
            # Step from w toward s until the first free weight reaches 0; free it no longer.
            blocked = idx[s[idx] <= 0]
            alpha = float((w[blocked] / np.maximum(w[blocked] - s[blocked], 1e-300)).min())
            w = w + alpha * (s - w)
            free &= w > tol
            w[~free] = 0.0
    return w


def load_cost_model(path: str | os.PathLike[str] | None) -> StepCostModel:
    """The persisted step-cost table at `path` as the prior, or the cold prior when there is
    none yet (a first start) or the table measured another version's features (it is
    replaced at the next save). A table that cannot be read raises, naming the file."""
    if path is None or not Path(path).exists():
        return StepCostModel()
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError("a step-cost table is a JSON object")
        features = data.get("features")
        if (isinstance(features, list) and features != list(FEATURES)
                and all(isinstance(f, str) for f in features)):
            log.warning("speculation.cost_table %s measured features %s, not %s: starting "
                        "cold", path, features, list(FEATURES))
            return StepCostModel()
        return StepCostModel.from_dict(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"speculation.cost_table {path}: {exc}") from None


def save_cost_model(model: StepCostModel, path: str | os.PathLike[str]) -> None:
    """Atomically (a reader never sees half a table)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(model.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)


# The calibration's bins of predicted survival (the running product of the draft's
# confidence), shared by every block position: a bin holds every verdict whose prediction fell
# in it. Calibrated by value rather than by position because the head is under-confident where
# the product is small (whole blocks on the embedded pair: 0.12 predicted vs 0.19 measured at
# draft 7, 0.27 vs 0.32 at draft 4, 0.71 vs 0.76 at draft 1), and a plan verifies a deep
# position only where the product is high: a per-position ratio was measured on confident
# blocks and applied, before the draft, to every block (positions 4-7 kept their prior).
CALIBRATION_EDGES = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# What a bin believes before its verdicts: calibrated, worth this many verdicts.
_BIN_PRIOR = 4.0
# The mean confidence expected of the next block follows the last ~50 proposed blocks: the
# draft's confidence moves along an answer (0.18 at draft 4 in the first blocks of the
# embedded pair's answers, 0.32 later), and a slow mean kept the first blocks' figure.
_DRAWN_DECAY = 0.98


def _bin(value: float) -> int:
    return bisect.bisect_right(CALIBRATION_EDGES, value)


_BIN_CENTRES = [(lo + hi) / 2 for lo, hi in
                zip((0.0, *CALIBRATION_EDGES), (*CALIBRATION_EDGES, 1.0), strict=True)]


@dataclass
class _Counts:
    """A class's decayed sums. Per calibration bin, over the verdicts whose predicted survival
    fell in it: how often the drafts up to that position were all accepted (`survived`) and
    what was predicted (`predicted`). Per block position and bin, over the blocks the draft
    proposed (verified that far or not): the predicted survival (`drawn`), and how many blocks
    (`blocks`)."""

    survived: list[float]
    predicted: list[float]
    drawn: list[list[float]]
    blocks: float

    def fade(self, factor: float) -> None:
        """A verdict ages the calibration's counts (not the proposed blocks: `proposed`)."""
        for values in (self.survived, self.predicted):
            values[:] = [v * factor for v in values]


def _running_product(values: Sequence[float]) -> list[float]:
    out, acc = [], 1.0
    for v in values:
        acc *= v
        out.append(acc)
    return out


class AcceptanceModel:
    """Calibrated survival: the probability that drafts 1..j of a request are all accepted.

    After the draft: the running product of its confidence, times its class's measured
    survived / predicted ratio in that product's calibration bin, times the request's own ratio
    (its survived drafts over what its class's calibration expected, shrunk toward 1 by
    `_REQUEST_PRIOR`). The survival is calibrated as a whole rather than position by position:
    acceptances within a block are correlated (a block that starts right tends to stay right),
    and a product of per-position calibrations underestimated deep positions by ~25% on the
    embedded pair.
    Before the draft (no confidence yet): the same calibration applied to the recent blocks the
    draft proposed (`proposed`), position by position, times the request's ratio. Not the
    survival of the verified positions: a plan verifies a deep position mostly where the
    confidence is high, so their rate is the confident blocks' (at 32 sampled requests it
    promised 622 tok/s where the windows chosen after the draft delivered ~505, and drafting
    lost to plain steps). Both plans read one calibration, so what the draft is expected to
    offer before it runs is what the plan after it would make of the blocks it proposed."""

    def __init__(self, gamma: int, prior_accept: float = 0.6, prior_blocks: float = 8.0) -> None:
        self.gamma = gamma
        self._prior_drawn = [prior_accept ** j for j in range(1, gamma + 1)]
        self._prior_blocks = prior_blocks
        self._classes: dict[str, _Counts] = {}
        # A request's decayed accepted drafts, what its class expected of them, and the step.
        self._requests: dict[Hashable, tuple[float, float, int]] = {}
        self.step = 0  # decode steps seen (`tick`)
        self.version = 0  # counts the changes: an estimate made with the same version stands

    def _class(self, name: str) -> _Counts:
        if name not in self._classes:
            drawn = [[0.0] * len(_BIN_CENTRES) for _ in range(self.gamma)]
            for j, p in enumerate(self._prior_drawn):
                drawn[j][_bin(p)] = p * self._prior_blocks
            self._classes[name] = _Counts([c * _BIN_PRIOR for c in _BIN_CENTRES],
                                          [c * _BIN_PRIOR for c in _BIN_CENTRES],
                                          drawn, self._prior_blocks)
        return self._classes[name]

    def class_ratio(self, name: str) -> list[float]:
        """Per calibration bin: measured survival over predicted."""
        c = self._class(name)
        return [a / max(p, 1e-12) for a, p in zip(c.survived, c.predicted, strict=True)]

    def class_rate(self, name: str) -> list[float]:
        """The class's survival by position expected of a block before it is drafted: its
        calibration applied to the recent blocks it proposed."""
        c = self._class(name)
        ratio = self.class_ratio(name)
        blocks = max(c.blocks, 1e-12)
        return [sum(r * d for r, d in zip(ratio, row, strict=True)) / blocks
                for row in c.drawn]

    def request_ratio(self, rid: Hashable) -> float:
        acc, pred = self._record(rid, self.step - self.step % _REQUEST_FADE_EVERY)
        return (acc + _REQUEST_PRIOR) / (pred + _REQUEST_PRIOR)

    def _record(self, rid: Hashable, now: int) -> tuple[float, float]:
        """The request's accepted drafts and what its class expected of them, faded to step
        `now`."""
        acc, pred, at = self._requests.get(rid, (0.0, 0.0, now))
        fade = _REQUEST_DECAY ** max(0, now - at)
        return fade * acc, fade * pred

    def tick(self) -> None:
        """A decode step began. Every _REQUEST_FADE_EVERY steps the requests' own evidence is
        read faded (a new version)."""
        self.step += 1
        if self.step % _REQUEST_FADE_EVERY == 0:
            self.version += 1

    @staticmethod
    def _bounded(values: list[float]) -> list[float]:
        # A survival never rises along the block, and no draft is counted as certain.
        out, last = [], MAX_ACCEPT
        for v in values:
            last = min(last, max(v, 0.0))
            out.append(last)
        return out

    def expected(self, classes: Sequence[str], rids: Sequence[Hashable]) -> list[list[float]]:
        """[B][gamma] survival expected before the draft has run."""
        rates = {c: self.class_rate(c) for c in set(classes)}
        out = []
        for c, rid in zip(classes, rids, strict=True):
            ratio = self.request_ratio(rid)
            out.append(self._bounded([r * ratio for r in rates[c]]))
        return out

    def _raw(self, confidence: Sequence[float] | None) -> list[float]:
        # Without a confidence head every block is predicted the prior's geometric falloff:
        # each position then has a bin of its own (up to ~7 deep), so the calibration learns
        # survival by position, as it must with nothing else to go on.
        return _running_product(confidence[: self.gamma]) if confidence is not None \
            else self._prior_drawn

    @staticmethod
    def _calibrated(raw: Sequence[float], ratio: Sequence[float]) -> list[float]:
        return [s * ratio[_bin(s)] for s in raw]

    def estimate(self, classes: Sequence[str], rids: Sequence[Hashable],
                 confidence: Sequence[Sequence[float]] | None) -> list[list[float]]:
        """[B][gamma] survival of each request's drafts: P(drafts 1..j all accepted)."""
        ratios = {c: self.class_ratio(c) for c in set(classes)}
        out = []
        for b, (c, rid) in enumerate(zip(classes, rids, strict=True)):
            raw = self._raw(confidence[b] if confidence is not None else None)
            own = self.request_ratio(rid)
            out.append(self._bounded([s * own for s in self._calibrated(raw, ratios[c])]))
        return out

    def proposed(self, classes: Sequence[str],
                 confidence: Sequence[Sequence[float] | None]) -> None:
        """The blocks the draft proposed this step, one confidence row per class (None: no
        head), whatever the plan then verifies of them."""
        self.version += 1
        rows: dict[str, list[Sequence[float] | None]] = {}
        for cls, row in zip(classes, confidence, strict=True):
            rows.setdefault(cls, []).append(row)
        for cls, new in rows.items():
            # A step's blocks fade the older ones together (as one block after another would).
            counts, fade = self._class(cls), _DRAWN_DECAY ** len(new)
            counts.blocks = fade * counts.blocks + len(new)
            for drawn in counts.drawn:
                drawn[:] = [fade * d for d in drawn]
            for row in new:
                for j, s in enumerate(self._raw(row)):
                    counts.drawn[j][_bin(s)] += s

    def observe(self, cls: str, rid: Hashable, confidence: Sequence[float] | None,
                drafted: int, accepted: int) -> None:
        """A verdict: `drafted` drafts verified, the first `accepted` kept; `confidence`: the
        draft's confidence row the plan used (None: no head). Positions 1..drafted are seen:
        drafts 1..j all accepted for j <= accepted, not for j > accepted."""
        if drafted <= 0:
            return
        self.version += 1
        raw = self._raw(confidence)[:drafted]
        counts = self._class(cls)
        # The request is compared with its class's calibrated expectation, before this verdict
        # moves the class.
        expected = sum(self._calibrated(raw, self.class_ratio(cls)))
        counts.fade(_CLASS_DECAY)
        for j, s in enumerate(raw):
            k = _bin(s)
            counts.survived[k] += 1.0 if j < accepted else 0.0
            counts.predicted[k] += s
        acc, pred = self._record(rid, self.step)
        self._requests[rid] = (acc + float(accepted), pred + expected, self.step)

    def forget(self, rid: Hashable) -> None:
        if self._requests.pop(rid, None) is not None:
            self.version += 1


@dataclass
class Plan:
    """One step's windows: `drafts[b]` drafts for request b (before the draft runs: the
    requests worth drafting for are those with drafts > 0), the tokens the step is expected to
    commit, its predicted seconds, and why (for the bench and the logs)."""

    drafts: list[int]
    expected_tokens: float
    predicted_seconds: float
    reason: str
    shape: StepShape = field(default_factory=lambda: StepShape(0, 0, 1, 0))
    base_rate: float = 0.0  # tokens per predicted second verifying no draft


def plan_windows(survival: Sequence[Sequence[float]], caps: Sequence[int],
                 cost: StepCostModel, drafted: Sequence[bool] | None = None,
                 costly: Sequence[bool] | None = None) -> Plan:
    """The windows that maximise expected tokens per predicted second. `survival[b][j-1]`: the
    probability that drafts 1..j of request b are all accepted (non-increasing in j);
    `caps[b]`: the most drafts request b may verify. `drafted[b]`: whether request b's draft
    has run (its cost is part of the step whatever is verified); None: before the draft, so a
    request's first verified draft also pays for drafting it. `costly[b]`: request b is not
    greedy (None: none is), and drafting it costs the `costly_rows` weight too.

    Each extra draft verified adds its survival to the expected tokens (the bonus token makes
    every row worth 1). Candidates go in order of survival, each request's positions in order,
    and the best prefix of that order is taken: the cost is linear in tokens, in the padded
    width and in drafted requests."""
    b = len(survival)
    if b == 0:
        return Plan([], 0.0, 0.0, "empty")
    w_step, w_rows, w_tokens, w_padded, w_drafted, w_costly, w_draft = cost.weights_list()
    costly = costly if costly is not None else [False] * b
    # What drafting request r costs the step (its first draft pays it, before the draft).
    per_request = [w_drafted + (w_costly if costly[r] else 0.0) for r in range(b)]
    sunk = sum(map(bool, drafted)) if drafted is not None else 0
    sunk_costly = (sum(bool(d) and c for d, c in zip(drafted, costly, strict=True))
                   if drafted is not None else 0)
    seconds = max(w_step + (w_rows + w_tokens + w_padded) * b + w_drafted * sunk
                  + w_costly * sunk_costly + (w_draft if sunk else 0.0), 1e-12)
    base_rate = b / seconds
    candidates = sorted(((s, j, r) for r in range(b)
                         for j, s in enumerate(survival[r][: max(caps[r], 0)], 1) if s > 0),
                        key=lambda c: (-c[0], c[1], c[2]))
    tokens, width, rows_drafted, costly_drafted = float(b), 1, sunk, sunk_costly
    best = (tokens / seconds, 0, tokens, seconds, width, rows_drafted, costly_drafted)
    for n, (s, j, r) in enumerate(candidates, 1):
        tokens += s
        seconds += w_tokens
        if j + 1 > width:
            seconds += w_padded * b * (j + 1 - width)
            width = j + 1
        if drafted is None and j == 1:
            seconds += per_request[r] + (w_draft if rows_drafted == 0 else 0.0)
            rows_drafted += 1
            costly_drafted += costly[r]
        rate = tokens / seconds
        if rate > best[0]:
            best = (rate, n, tokens, seconds, width, rows_drafted, costly_drafted)
    rate, n, tokens, seconds, width, rows_drafted, costly_drafted = best
    drafts = [0] * b
    for _, _, r in candidates[:n]:
        drafts[r] += 1
    reason = ("verify nothing: no draft is worth its cost" if n == 0 else
              f"verify {n} of {len(candidates)} drafts: {rate:.1f} tok/s predicted vs "
              f"{base_rate:.1f} with none")
    return Plan(drafts, tokens, seconds, reason,
                StepShape(b, b + n, width, rows_drafted, costly_drafted), base_rate)


def request_class(greedy: bool, constrained: bool) -> str:
    """Acceptance is measured apart for these: a grammar's masks raise it, sampling lowers it."""
    return "grammar" if constrained else "greedy" if greedy else "sampled"


def costly_class(cls: str) -> bool:
    """Whether drafting a request of this class costs the step the `costly_rows` weight."""
    return cls != "greedy"


class Goodput:
    """Drafting against plain steps, by batch size (its bit length): tokens per measured second
    per row of a drafted step over those of a plain step next to it (a pair of adjacent steps:
    this machine's speed drifts by ±15% over seconds, and rates measured apart took that drift
    for a difference, as whole bench runs did), exponentially weighted over the pairs. Steps
    are passed in: this holds no clock."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[str, float, int]] = {}  # bucket -> (way, rate, step)
        self.log_ratio: dict[int, float] = {}  # bucket -> log(drafted rate / plain rate)
        self.at: dict[tuple[int, str], int] = {}  # (bucket, way) -> step last measured
        self.count: dict[tuple[int, str], int] = {}
        self.seconds: dict[tuple[int, str], float] = {}  # (bucket, way) -> a step's seconds

    @staticmethod
    def bucket(rows: int) -> int:
        return rows.bit_length()

    def observe(self, rows: int, way: str, tokens: float, seconds: float, step: int) -> None:
        if rows <= 0 or not seconds > 0 or not tokens > 0:
            return
        b, rate = self.bucket(rows), tokens / seconds / rows
        last = self.last.get(b)
        if last is not None and last[0] != way and step - last[2] <= GOODPUT_ADJACENT:
            spec, plain = (rate, last[1]) if way == "speculative" else (last[1], rate)
            pair = math.log(spec / plain)
            old = self.log_ratio.get(b)
            self.log_ratio[b] = pair if old is None else (
                GOODPUT_DECAY * old + (1 - GOODPUT_DECAY) * pair)
        self.last[b] = (way, rate, step)
        old_seconds = self.seconds.get((b, way))
        self.seconds[(b, way)] = seconds if old_seconds is None else (
            GOODPUT_DECAY * old_seconds + (1 - GOODPUT_DECAY) * seconds)
        self.at[(b, way)] = step
        self.count[(b, way)] = self.count.get((b, way), 0) + 1

    def measured(self, rows: int, step: int) -> tuple[bool, str] | None:
        """Whether to draft this step, from the pairs measured at this batch size, and why;
        None before the first pair (`unmeasured` decides)."""
        b = self.bucket(rows)
        if b not in self.log_ratio:
            return None
        ratio = math.exp(self.log_ratio[b])
        best = ratio >= 1.0
        drafted, plain = self.seconds[(b, "speculative")], self.seconds[(b, "plain")]
        # A recheck comes once what its step loses against the way ahead (seconds) is at most
        # GOODPUT_RECHECK_COST of the time spent the way ahead since the last one.
        lost, per_step = ((1 - 1 / ratio) * plain, drafted) if best else (
            (1 - ratio) * drafted, plain)
        every = min(max(lost / (GOODPUT_RECHECK_COST * per_step), GOODPUT_RECHECK_MIN),
                    GOODPUT_RECHECK_MAX)
        since_other = step - self.at[(b, "plain" if best else "speculative")]
        if since_other >= every:
            return not best, f"recheck: drafting measured {ratio:.2f}x plain"
        return best, f"measured: drafting {ratio:.2f}x plain"

    def unmeasured(self, rows: int, drafting: bool, step: int) -> tuple[bool, str]:
        """Before the first pair at this batch size: as the plan says (`drafting`), but after
        a few steps one way, the other once (next to the last), which makes the pair."""
        b = self.bucket(rows)
        way = "speculative" if drafting else "plain"
        if self.count.get((b, way), 0) >= GOODPUT_FIRST and (
                self.last.get(b, ("", 0.0, -10**9))[2] >= step - GOODPUT_ADJACENT):
            return not drafting, "recheck: no pair of steps measured"
        return drafting, ""


class VerifyBudget:
    """The engine's adaptive speculation policy: its acceptance and cost models, the plans it
    made and how they went (`stats`), and where the cost table persists."""

    def __init__(self, gamma: int, cost_table: str | os.PathLike[str] | None = None,
                 save_every: int = 512) -> None:
        self.gamma = gamma
        self.cost_table = Path(cost_table).expanduser() if cost_table is not None else None
        self.cost = load_cost_model(self.cost_table)
        self.acceptance = AcceptanceModel(gamma)
        self._save_every = save_every
        self._since_draft = 0
        self._probe = 0
        self._probe_backoff = 1  # the probe interval's factor (PROBE_BACKOFF_MAX)
        self._probe_rid: Hashable | None = None  # this step's probe, which verifies its block
        self._whole_batch = False  # this step drafts where the plan says no one: whole blocks
        self._explore = 0  # whose turn it is to verify its whole block (EXPLORE_COST)
        self._pre_draft: tuple[tuple[Any, ...], Plan, bool] | None = None
        self.goodput = Goodput()
        self._way: str | None = None  # how this step goes, as `goodput` counts it
        self._expected = 0.0  # the tokens this step's windows are expected to commit
        self.draft_histogram = [0] * (gamma + 1)  # requests' windows: how many drafts
        self.plain_steps = 0
        self.probe_steps = 0
        self.speculative_steps = 0
        self.last_reason = ""

    def to_draft(self, classes: Sequence[str], rids: Sequence[Hashable], caps: Sequence[int],
                 fixed: Sequence[bool]) -> list[int]:
        """Before the draft: the requests (indices) worth drafting for this step, from expected
        survival alone, and every `fixed` one (its whole block every step: a seeded sampled
        request, reproducible), once drafting beats a plain step by DRAFT_MARGIN. None: a
        plain step, except a probe now and then (PROBE_EVERY_PER_ROW, backing off while the
        plans stay plain), which drafts for one request (in turn) so that what this decides on
        stays measured. Everyone is drafted for in the first WARMUP_STEPS speculative
        steps. Once drafted and plain steps of this batch size are measured in pairs
        (`Goodput`), the way that did more per second is taken whatever the plan says (where
        the plan names no one, everyone is drafted for and verifies the whole block)."""
        self.acceptance.tick()
        self._probe_rid = None
        self._whole_batch = False
        self._way = None
        able = [b for b, c in enumerate(caps) if c > 0]
        if self.speculative_steps < WARMUP_STEPS:
            chosen = able
            self._way = "speculative"
            self.last_reason = "warm-up: every request drafted for"
        else:
            # Once this batch size's pairs are measured, a plain step needs no plan (0.25 ms
            # of a 37 ms plain step at 16 requests): only the requests it drafts for read one.
            seeded = any(fixed)  # always drafted for: neither way is measured there
            measured = None if seeded else self.goodput.measured(len(rids),
                                                                 self.acceptance.step)
            plan, pays, drafting = None, False, False
            if measured is None or measured[0]:
                plan, pays = self._pre_draft_plan(classes, rids, caps)
                drafting = pays and any(plan.drafts[b] > 0 for b in able)
            if measured is not None:
                go, why = measured
            elif seeded:
                go, why = drafting, ""
            else:
                go, why = self.goodput.unmeasured(len(rids), drafting, self.acceptance.step)
            # Drafting where the plan says none pays (what was measured says it does): for
            # everyone, each verifying its whole block. The plan's windows are priced by the
            # cost model the measurement overrules: at 16 greedy requests a fit made from plain
            # steps and narrow windows priced a verified token at 1.3 ms where it cost ~0.6, its
            # windows (2-3 drafts) ran 0.8x a plain step, and whole blocks 1.33x.
            self._whole_batch = go and plan is not None and not drafting
            chosen = [b for b in able if (go and plan is not None
                                          and (plan.drafts[b] > 0 or not drafting))
                      or fixed[b]]
            said = "plain: as measured" if plan is None else (
                plan.reason if pays else f"plain: {plan.reason}")
            self.last_reason = (why + ": " if why else "") + said
            if go:
                self._probe_backoff = 1
                self._way = "speculative" if not seeded else None
            # A probe's price grows with the batch (at one request it is a speculative step
            # like any other, and pays about what it costs), so the backoff does too.
            probe_every = min(self._probe_backoff, len(rids)) * max(
                PROBE_EVERY_MIN, PROBE_EVERY_PER_ROW * len(rids))
            if not chosen and able and self._since_draft + 1 >= probe_every:
                chosen = [able[self._probe % len(able)]]
                self._probe_rid = rids[chosen[0]]
                self._probe += 1
                self._probe_backoff = min(2 * self._probe_backoff, PROBE_BACKOFF_MAX)
                self.probe_steps += 1
                plan = self._pre_draft_plan(classes, rids, caps)[0]
                self.last_reason = "probe: " + plan.reason
        if not chosen:
            self._way = "plain"
        self._since_draft = 0 if chosen else self._since_draft + 1
        self.plain_steps += not chosen
        return chosen

    def _pre_draft_plan(self, classes: Sequence[str], rids: Sequence[Hashable],
                        caps: Sequence[int]) -> tuple[Plan, bool]:
        """The plan before the draft, and whether it beats a plain step by DRAFT_MARGIN.
        Between plain steps nothing it reads moves (no verdict, no refit, no new period of the
        request fade) unless a request joins, leaves or nears its end: the last plan stands."""
        key = (self.acceptance.version, self.cost.version, tuple(classes), tuple(rids),
               tuple(caps))
        if self._pre_draft is None or self._pre_draft[0] != key:
            plan = plan_windows(self.acceptance.expected(classes, rids), caps, self.cost,
                                costly=[costly_class(c) for c in classes])
            rate = plan.expected_tokens / plan.predicted_seconds
            self._pre_draft = (key, plan, rate > (1 + DRAFT_MARGIN) * plan.base_rate)
        return self._pre_draft[1], self._pre_draft[2]

    def plan(self, classes: Sequence[str], rids: Sequence[Hashable],
             confidence: Sequence[Sequence[float]] | None, caps: Sequence[int],
             drafted: Sequence[bool], fixed: Sequence[bool]) -> Plan:
        """After the draft ran for the `drafted` requests: their windows (the others' caps are
        0: a plain row each; a `fixed` one, this step's probe, and one request in turn where
        that is cheap (EXPLORE_COST) verify their whole cap)."""
        self.acceptance.proposed(
            [c for c, d in zip(classes, drafted, strict=True) if d],
            [confidence[b] if confidence is not None else None
             for b, d in enumerate(drafted) if d])
        costly = [costly_class(c) for c in classes]
        survival = self.acceptance.estimate(classes, rids, confidence)
        plan = plan_windows(survival, caps, self.cost, drafted, costly)
        whole = [f or rid == self._probe_rid or self._whole_batch
                 for f, rid in zip(fixed, rids, strict=True)]
        short = [b for b, (k, c) in enumerate(zip(plan.drafts, caps, strict=True))
                 if drafted[b] and k < c and not whole[b]]
        if short:
            b = short[self._explore % len(short)]
            self._explore += 1
            now = self._step_seconds(self._windows(plan.drafts, caps, whole), drafted, costly)
            whole[b] = True
            then = self._step_seconds(self._windows(plan.drafts, caps, whole), drafted, costly)
            whole[b] = then - now <= EXPLORE_COST * now
        plan.drafts = self._windows(plan.drafts, caps, whole)
        # What the windows, widened or not, are expected to commit (the calibrated survival).
        plan.expected_tokens = len(rids) + sum(sum(s[:k]) for s, k in zip(survival, plan.drafts,
                                                                           strict=True))
        self._expected = plan.expected_tokens
        self.speculative_steps += 1
        for k in plan.drafts:
            self.draft_histogram[k] += 1
        self.last_reason = plan.reason
        return plan

    @staticmethod
    def _windows(drafts: Sequence[int], caps: Sequence[int], whole: Sequence[bool]) -> list[int]:
        return [c if w else k for k, c, w in zip(drafts, caps, whole, strict=True)]

    def _step_seconds(self, drafts: Sequence[int], drafted: Sequence[bool],
                      costly: Sequence[bool]) -> float:
        return self.cost.predict(StepShape(
            len(drafts), len(drafts) + sum(drafts), max(drafts) + 1, sum(map(bool, drafted)),
            sum(d and c for d, c in zip(drafted, costly, strict=True))))

    def verdict(self, cls: str, rid: Hashable, confidence: Sequence[float] | None,
                drafted: int, accepted: int) -> None:
        self.acceptance.observe(cls, rid, confidence, drafted, accepted)

    def step_time(self, shape: StepShape, seconds: float) -> None:
        self.cost.observe(shape, seconds)
        if self._way is not None:
            # A drafted step counts the tokens its windows were expected to commit (the
            # calibrated acceptance, which matched what such steps committed), not what it
            # did: at one sampled request a step commits 1 token or 8, and the luck of a
            # few steps turned the budget plain where drafting paid 1.3-1.5x.
            tokens = self._expected if self._way == "speculative" else shape.rows
            self.goodput.observe(shape.rows, self._way, tokens, seconds, self.acceptance.step)
        self._way = None
        if self.cost_table is not None and self.cost.observed % self._save_every == 0:
            self.save()

    def forget(self, rid: Hashable) -> None:
        self.acceptance.forget(rid)

    def save(self) -> None:
        if self.cost_table is not None and self.cost.observed:
            save_cost_model(self.cost, self.cost_table)

    def stats(self) -> dict[str, Any]:
        errors = sorted(self.cost.errors)
        return {
            "spec_budget_draft_histogram": list(self.draft_histogram),
            "spec_budget_speculative_steps": self.speculative_steps,
            "spec_budget_plain_steps": self.plain_steps,
            "spec_budget_probe_steps": self.probe_steps,
            "spec_budget_cost_error_median": errors[len(errors) // 2] if errors else None,
            "spec_budget_cost_weights": dict(zip(FEATURES, self.cost.weights_list(),
                                                 strict=True)),
        }
