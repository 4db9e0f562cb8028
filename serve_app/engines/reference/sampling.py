"""Sampling parameters, the target distribution p, and lossless verification of drafts.

Verification follows SGLang's DSpark: greedy requests accept the longest prefix of drafts
that equal the target's argmax and add the target's token at the first mismatch (the bonus);
sampled requests use chain rejection sampling, which leaves the output distributed exactly as
the target's.

Every parameter SamplingParams accepts yields a proper distribution: temperatures below
SamplingParams.greedy's epsilon are greedy, logits are shifted to a zero maximum before they
are scaled (so no temperature overflows them), and top-p always keeps the most likely token
and compares its threshold in float64 (float32 turns top_p=1e-300 into 0, which dropped every
token). Logits that are themselves NaN or inf are a model fault: `SamplingError`, raised before
a token is drawn (models/draw.py; on CUDA a bad distribution could otherwise end in a
device-side assert, fatal to every request).

Constrained requests pass `allowed` masks (serve_app/grammar/matchers.py): the logits of tokens
the grammar forbids become -inf before anything else, so p is the constrained distribution
(renormalised over the allowed tokens) and every rule below — greedy, the rejection rule, the
residual — applies to it unchanged: speculation stays lossless with respect to the
constrained target. The draft's q is masked the same way (models/dspark.py), which only
raises acceptance; an unmasked q would be exact too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from serve_app.models.draw import draw, draw_rows
from serve_app.protocol.generation import SamplingParams

__all__ = ["SamplingError", "SamplingParams", "Verdict", "constrain", "residual_distribution",
           "sample_token", "target_probs", "verify_batch", "verify_drafts"]


class SamplingError(ValueError):
    """The logits of one request cannot be sampled (NaN or inf from the model)."""


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p over the vocabulary for rows of one request: temperature, then top-k, then top-p.

    Callers sample only non-greedy requests, but any temperature > 0 gives a distribution."""
    logits = logits.float()
    # softmax(l / t) == softmax((l - max l) / t). Shifted first, every value is <= 0 and the
    # maximum is exactly 0, so a tiny t sends the others to -inf (probability 0), never to
    # inf - inf = NaN, and the most likely token keeps probability > 0. The floor only keeps a
    # direct call with temperature 0 from computing 0 / 0 at the maximum.
    logits = (logits - logits.amax(-1, keepdim=True)) / max(params.temperature, 1e-30)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # float64 threshold: in float32 a top_p below ~1e-45 rounds to 0 and the comparison
        # would drop the first token too. (The smallest double keeps exactly the first token,
        # as top_p -> 0 does.)
        top_p = max(float(params.top_p), 5e-324)
        rows = probs.reshape(-1, probs.shape[-1])
        keep = (_top_p_by_values(rows, top_p) if rows.device.type == "cpu"
                else _top_p_by_sort(rows, top_p))
        probs = (rows * keep).reshape(probs.shape)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _top_p_by_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p mask of each row of `probs` (rows x vocab): the smallest prefix of the
    descending order whose mass reaches top_p, from a full sort."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.double().cumsum(-1) - sorted_p.double()
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < top_p)


def _top_p_by_values(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_top_p_by_sort`'s mask on CPU from numpy's sort of the values alone: the sorted
    prefix gives how many tokens the nucleus keeps and the smallest kept value; every token
    above that value is kept, and of the tokens equal to it as many as the prefix holds (the
    first by index; which of equal probabilities is kept is arbitrary for the sort too). On
    one CPU thread torch's sort (with its order, then a scatter) took 349 µs for the embedded
    pair's 4,096 probabilities and 16 ms for K3's 163,840, numpy's sort of the values 18 µs
    and 0.6 ms: at K3 thinking half of the target's rows have a nucleus of over 490 tokens, so
    a top-k of candidates rarely found it, and a sampled verify at 16 requests spent 20 ms
    of a 122 ms step here."""
    p = probs.detach().contiguous().numpy()
    descending = np.sort(p, axis=-1)[:, ::-1]
    before = np.cumsum(descending, axis=-1, dtype=np.float64) - descending
    kept = np.maximum((before < top_p).sum(-1), 1)  # the first token always (0 < top_p)
    cut = descending[np.arange(len(p)), kept - 1][:, None]
    keep = p >= cut
    tied = p == cut
    need = kept - (p > cut).sum(-1)
    # Rows that keep only some of the tokens tied at the cut (rare: equal probabilities
    # straddling top_p) keep the first `need` of them; a running count over every row cost as
    # much as the sort.
    some = np.nonzero(need < tied.sum(-1))[0]
    if len(some):
        keep[some] &= ~tied[some] | (np.cumsum(tied[some], axis=-1) <= need[some, None])
    return torch.from_numpy(keep)


def _distribution_errors(probs: torch.Tensor) -> list[SamplingError | None]:
    """Per row of p ([..., V]): the fault to name before drawing from it, or None. Only NaN/inf
    logits make one (see target_probs): they leave NaN in the normalised probabilities, and so
    in their sum: one reduction (an element-wise isfinite and an all took ~70 µs a row, a
    sampled verify ~3 rows a request)."""
    return [None if ok else SamplingError("the target logits are not finite")
            for ok in torch.isfinite(probs.sum(-1)).reshape(-1).tolist()]


def constrain(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Logits with the tokens `allowed` (bool, broadcastable) forbids at -inf."""
    if allowed is None:
        return logits
    return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None, allowed: torch.Tensor | None = None) -> int:
    """One token from one row of logits; `allowed` [V]: the grammar's mask, or None."""
    logits = constrain(logits, allowed)
    if params.greedy:
        return int(logits.argmax())
    probs = target_probs(logits, params)
    (error,) = _distribution_errors(probs)
    if error is not None:
        raise error
    return draw(probs, generator)


@dataclass
class Verdict:
    """The outcome of verifying one request's drafts: tokens to commit (accepted drafts + the
    bonus/correction token) and how many drafts were accepted."""

    tokens: list[int]
    accepted: int = field(default=0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The rejection rule's correction distribution: normalize(max(p - q, 0))."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    # p == q exactly (possible for one-hot q at a one-hot p): any draw from p is right.
    return residual / total if total > 0 else p


def _valid_draft_rows(draft_probs: torch.Tensor) -> list[bool]:
    """Per row of [k, V] draft distributions: can the rejection rule use it (finite,
    non-negative, some mass)? One reduction and one host copy for all k rows, not three
    per draft (each a device sync on CUDA)."""
    q = draft_probs.float()
    # A NaN or inf anywhere makes the sum not finite, a negative entry the minimum negative.
    total = q.sum(-1)
    return (torch.isfinite(total) & (total > 0) & (q.amin(-1) >= 0)).tolist()


ResidualRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def verify_drafts(
    target_logits: torch.Tensor,
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    residual_rule: ResidualRule = residual_distribution,
    allowed: torch.Tensor | None = None,
) -> Verdict:
    """One request's `verify_batch`: target_logits [k+1, V] rows for [anchor, d_1..d_k] (row j
    scores the token after the j-th input); drafts: the k proposed tokens; draft_probs [k, V]:
    the draft distributions they were drawn from (None: one-hot, i.e. deterministic
    proposals); `allowed` [k+1, V]: the grammar's mask for each row, or None. Raises what
    failed (SamplingError: the target's logits are not finite)."""
    (verdict,) = verify_batch([target_logits], [drafts], [draft_probs], [params], [generator],
                              residual_rule, [allowed])
    if isinstance(verdict, Exception):
        raise verdict
    return verdict


def verify_batch(
    target_logits: Sequence[torch.Tensor],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    residual_rule: ResidualRule = residual_distribution,
    allowed: Sequence[torch.Tensor | None] | None = None,
) -> list[Verdict | Exception]:
    """Each request's verdict (`verify_drafts`' arguments, one entry per request), or what
    failed for that request alone. Sampled requests walk their windows together, a position
    at a time: the rows the walks reach are turned into p in one `target_probs` per sampling
    setting, and the bonus and correction tokens drawn in one `draw_rows`. Each request draws
    from its own generator in the order a walk of its own would: its uniforms position by
    position, then its last token. Per request, the target's rows were ~0.3 ms a request
    (softmax, top-p, the checks and a dozen scalar reads, each with torch's per-call cost): 9-12
    ms of a step at 16 sampled requests."""
    n = len(drafts)
    out: list[Verdict | Exception | None] = [None] * n
    walks: list[_Walk] = []
    for b in range(n):
        try:
            logits = constrain(target_logits[b], allowed[b] if allowed is not None else None)
            d = [int(t) for t in drafts[b]]
            if params[b].greedy:
                target = logits.argmax(-1).tolist()
                accepted = 0
                while accepted < len(d) and d[accepted] == target[accepted]:
                    accepted += 1
                out[b] = Verdict([*d[:accepted], target[accepted]], accepted)
                continue
            q = draft_probs[b]
            usable = _valid_draft_rows(q[: len(d)]) if q is not None and d else [True] * len(d)
            walks.append(_Walk(b, logits, d, q, usable, params[b], generators[b]))
        except Exception as exc:
            out[b] = exc
    while walks:
        _p_rows(walks)
        last: list[tuple[_Walk, torch.Tensor, int]] = []  # the walk, its last draw's row, at j
        going = []
        for w in walks:
            try:
                if w.failed is not None:
                    raise w.failed
                p = w.p
                assert p is not None
                j, vocab = w.j, p.shape[-1]
                if j == len(w.drafts):
                    last.append((w, p, j))  # every draft accepted: the bonus
                    continue
                d = w.drafts[j]
                if not 0 <= d < vocab or not w.usable[j]:
                    # Not a token, or a NaN/negative q: reject it. Drawing position j from p
                    # alone ignores the draft, which is exact whatever the draft was.
                    last.append((w, p, j))
                    continue
                q_row = (w.q[j].float() if w.q is not None
                         else torch.nn.functional.one_hot(torch.tensor(d), vocab).float())
                q_d, p_d = float(q_row[d]), float(p[d])
                u = float(torch.rand((), generator=w.generator))
                if q_d > 0 and u * q_d < p_d:
                    w.j += 1
                    going.append(w)
                    continue
                last.append((w, residual_rule(p, q_row), j))
            except Exception as exc:
                out[w.index] = exc
        if last:
            tokens = draw_rows(torch.stack([row for _, row, _ in last]),
                               [w.generator for w, _, _ in last]).tolist()
            for (w, _, j), token in zip(last, tokens, strict=True):
                out[w.index] = Verdict([*w.drafts[:j], int(token)], j)
        walks = going
    return [v if v is not None else RuntimeError("no verdict") for v in out]


@dataclass
class _Walk:
    """One sampled request's rejection walk in `verify_batch`: at position j, with p its
    target's distribution there (`_p_rows`)."""

    index: int
    logits: torch.Tensor
    drafts: list[int]
    q: torch.Tensor | None
    usable: list[bool]
    params: SamplingParams
    generator: torch.Generator | None
    j: int = 0
    p: torch.Tensor | None = None
    failed: Exception | None = None


def _p_rows(walks: Sequence[_Walk]) -> None:
    """Each walk's p at its position, one `target_probs` per sampling setting (a row whose
    logits are not finite fails its own walk)."""
    groups: dict[tuple[float, int, float], list[_Walk]] = {}
    for w in walks:
        w.p, w.failed = None, None
        groups.setdefault((w.params.temperature, w.params.top_k, w.params.top_p), []).append(w)
    for group in groups.values():
        try:
            probs = target_probs(torch.stack([w.logits[w.j] for w in group]), group[0].params)
            errors = _distribution_errors(probs)
        except Exception as exc:
            for w in group:
                w.failed = exc
            continue
        for w, row, error in zip(group, probs, errors, strict=True):
            w.p, w.failed = (row, None) if error is None else (None, error)
