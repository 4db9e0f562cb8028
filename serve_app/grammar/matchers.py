"""Per-request grammar matchers: the masks the engine samples under, and their roll-back.

A constrained request's matcher has consumed exactly its committed output tokens, except
inside a speculative window: the draft's block is masked as it is proposed (`DraftMasks`, each
position under the state after the drafts before it), the verify window's target rows get the
same masks, and `commit` rolls the matcher back to the accepted prefix (as the model runner's
commit rolls back the target's cache and the proposer), after which the bonus token is
consumed like any sampled token. Each request's `RequestGrammar` belongs to its sequence
(engines/reference/sequence.py), which samples and verifies under it, and goes with it.

Lengths are counted as the target cache counts them, in the request's tokens (prompt
included): a matcher starts at its prompt's length.

With a `ClosingPaths` (engine.reference.grammar_budget: close), a request's masks also depend
on its budget (closing.py): once the tokens it has left come within twice its closing path's
length (plus `CLOSE_MARGIN`) the model may open nothing new, and within the path's length
(plus the margin) each mask allows only the path's next token, until the answer may end. The
decision is a function of the request's tokens alone — kept per window position beside the
masks and rolled back with them — so that the draft's block, the verify window and the token
sampled after it see the same masks, and speculation stays exact.

Everything here runs on rank 0's engine thread: followers never sample.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from llguidance import LLMatcher

from serve_app.grammar.closing import ClosingPaths
from serve_app.grammar.compiler import allowed_bits

# The zones start this many tokens early: a path can grow by a few tokens in one step (a
# string's escape, a number's exponent) even where nothing new may be opened.
CLOSE_MARGIN = 8
# How often (in tokens) a request far from its budget's end looks at its closing path again:
# a path grows by what the model opens, which a check this often sees in time.
RECHECK_TOKENS = 32


class GrammarFault(RuntimeError):
    """A matcher refused a token it had allowed, or allows nothing (a compiler bug, not the
    client's): the engine fails this request alone."""


@dataclass(frozen=True)
class _Budget:
    """Where a request stands against its max_tokens at one position (closing.py)."""

    path: list[int] | None = None  # the closing path from here; None: not known
    check_at: int = 0  # the position at which the path is looked for again
    mode: Literal["free", "plain", "forced"] = "free"  # the mask here: the grammar's; its
    # tokens that open nothing, and path[0]; only path[0]
    refused: tuple[int, ...] = ()  # control tokens that would open more than is left

    @property
    def narrowed(self) -> bool:
        """The budget took tokens out of the grammar's mask here."""
        return self.mode != "free" or bool(self.refused)


class GrammarStates:
    """What every constrained request of one engine shares: the vocabulary, the stop ids, the
    closing paths, and the counters. Each request's own state is a `RequestGrammar`, which
    its sequence owns and which goes with it."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = (),
                 closing: ClosingPaths | None = None) -> None:
        """`eos_token_ids`: the ids that end generation. The matcher never consumes them (its
        roll-back does not cross a stop): an EOS leaves the grammar's state as it was, and
        the request ends there (or, with ignore_eos, goes on under the same mask).
        `closing`: answers are closed before max_tokens cuts them (None: they are cut)."""
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.closing = closing
        self.mask_seconds = 0.0  # telemetry: time spent computing masks
        self.masks_computed = 0
        self.requests_closed = 0  # telemetry: answers the budget shaped (`closed`)

    def start(self, matcher: LLMatcher, length: int, max_tokens: int) -> RequestGrammar:
        """A request whose matcher has seen `length` tokens (its prompt) and which may
        sample `max_tokens`."""
        stop_at = length + max_tokens if self.closing is not None else None
        return RequestGrammar(self, matcher, length, stop_at)

    def compute(self, matcher: LLMatcher) -> torch.Tensor:
        """The matcher's mask (all False once it is stopped or failed: nothing may follow)."""
        start = time.perf_counter()
        bits = allowed_bits(matcher, self.vocab_size)
        self.mask_seconds += time.perf_counter() - start
        self.masks_computed += 1
        return torch.from_numpy(bits.astype(bool))


class RequestGrammar:
    """One constrained request's matcher, its window since the last commit, and its budget."""

    def __init__(self, shared: GrammarStates, matcher: LLMatcher, length: int,
                 stop_at: int | None) -> None:
        self.shared = shared
        self.matcher = matcher
        # The request's tokens the matcher has committed (prompt + output; its window not
        # included).
        self.length = length
        self.stop_at = stop_at  # its length at max_tokens (with closing; else None)
        # The matcher as of the last commit. A window is rolled back by restarting from a copy
        # of it, not by LLMatcher.rollback: llguidance 1.9.1's masks after rollback() and
        # consume can differ from a fresh matcher's on the same tokens once masks were
        # computed in the rolled back part (it then allowed a token its consume refused:
        # tests/test_grammar.py).
        self.at_commit: LLMatcher | None = matcher.deep_copy()
        # The window since the last commit: masks[j] is the mask after its first j tokens.
        self.masks: list[torch.Tensor] = []
        self.budgets: list[_Budget] = []  # beside masks, one per position
        self.window: list[int] = []
        self.consumed: list[bool] = []  # per window token: the matcher took it
        self.dead = False  # a window token was not allowed: later masks are never used
        self.closed = False  # a committed token was sampled under a mask the budget narrowed

    # --- masks ----------------------------------------------------------------------------

    def _current(self) -> torch.Tensor:
        if not self.masks:
            self._push(None, None)
        return self.masks[-1]

    def _push(self, before: _Budget | None, token: int | None) -> None:
        """The mask (and budget) at the matcher's position, which it reached from the
        position of `before` by `token` (None: the window's first position)."""
        shared = self.shared
        budget = self._budget(before, token)
        if budget.mode == "free":
            mask = shared.compute(self.matcher)
            if budget.refused:
                mask[list(budget.refused)] = False
        else:
            assert budget.path and shared.closing is not None
            mask = torch.zeros(shared.vocab_size, dtype=torch.bool)
            mask[budget.path[0]] = True
            if budget.mode == "plain":
                mask = (shared.compute(self.matcher) & shared.closing.plain) | mask
        self.masks.append(mask)
        self.budgets.append(budget)

    def _budget(self, before: _Budget | None, token: int | None) -> _Budget:
        """How the budget narrows this position's mask: a function of the request's tokens
        (the previous position's budget and the token between them)."""
        closing = self.shared.closing
        if closing is None or self.stop_at is None:
            return _Budget()
        position = self.length + len(self.window)
        left = self.stop_at - position  # tokens still to sample, this one included
        path, check_at = None, position
        if before is not None:
            check_at = before.check_at
            if before.path and token == before.path[0]:
                path = before.path[1:]  # the model (or the mask) followed the path
        if path is None and position >= check_at:
            path = closing.path(self.matcher)
            if path is None:
                return _Budget(None, position + RECHECK_TOKENS)
            slack = left - 2 * len(path) - CLOSE_MARGIN
            check_at = position + max(1, min(RECHECK_TOKENS, slack))
        if path and 0 < left <= len(path) + CLOSE_MARGIN:
            return _Budget(path, check_at, "forced")
        if path and 0 < left <= 2 * len(path) + CLOSE_MARGIN:
            return _Budget(path, check_at, "plain")
        # A new call or argument (K3's `<|open|>`) may need more than the rest of the budget
        # (a tool with required arguments): where the closing path is another way on, it is
        # refused if it would not fit.
        openers = [o for o in closing.open_ids
                   if left > 0 and self.matcher.validate_tokens([o]) == 1]
        if openers and path is None:
            path = closing.path(self.matcher)
        refused = tuple(
            o for o in openers
            if path is not None and (not path or path[0] != o)
            and (after := closing.path(self.matcher, o)) is not None
            and 1 + len(after) + CLOSE_MARGIN >= left)
        return _Budget(path, check_at, refused=refused)

    def _fault(self, message: str) -> GrammarFault:
        if self.matcher.is_error():
            message += f" ({self.matcher.get_error()[:200]})"
        return GrammarFault(message)

    def mask(self) -> torch.Tensor:
        """Allowed next tokens [V] after what the matcher has consumed (window included), to
        sample under: a GrammarFault when it allows none."""
        mask = self._current()
        if not bool(mask.any()):
            raise self._fault("the grammar allows no token here")
        return mask

    def draft_mask(self) -> torch.Tensor | None:
        """The current mask for drafting: None when it allows nothing (the draft then chooses
        freely, and the verify step meets the fault for this request alone)."""
        mask = self._current()
        return mask if bool(mask.any()) else None

    def advance(self, token: int) -> bool:
        """Consume one token tentatively (a draft, or a sampled token before commit): False,
        consuming nothing, when the current mask does not allow it."""
        if self.dead or not bool(self._current()[token]):
            self.dead = True
            return False
        # The window and its masks stay aligned: masks[j] follows the window's first j tokens.
        token = int(token)
        before = self.budgets[-1]
        eos = token in self.shared.eos
        if not eos and not self.matcher.consume_token(token):
            raise self._fault(f"the grammar refused token {token} it allowed")
        self.window.append(token)
        self.consumed.append(not eos)
        if eos:
            self.masks.append(self.masks[-1])
            self.budgets.append(before)
        else:
            self._push(before, token)
        return True

    def window_masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """Masks [k+1, V] for a verify window [anchor, d_1..d_k]: row j under the state after
        d_1..d_j. Drafts a masked proposer consumed already are reused; rows after a draft the
        grammar does not allow repeat the last mask (the rejection rule never reaches them:
        that draft has target probability 0)."""
        drafts = [int(d) for d in drafts]
        common = 0
        while common < min(len(self.window), len(drafts)) and self.window[common] == drafts[common]:
            common += 1
        if common < len(self.window):
            self._truncate(common)
        self._current()
        for d in drafts[common:]:
            if not self.advance(d):
                break
        rows = self.masks[: len(drafts) + 1]
        rows += [rows[-1]] * (len(drafts) + 1 - len(rows))
        return torch.stack(rows)

    # --- the window protocol ----------------------------------------------------------------

    def _truncate(self, keep: int) -> None:
        """Roll the window back to its first `keep` tokens (still uncommitted)."""
        if any(self.consumed[keep:]):
            assert self.at_commit is not None
            matcher = self.at_commit.deep_copy()
            for token, consumed in zip(self.window[:keep], self.consumed, strict=False):
                if consumed and not matcher.consume_token(token):
                    raise GrammarFault("the grammar could not roll back")
            self.matcher = matcher
        del self.window[keep:]
        del self.consumed[keep:]
        del self.masks[keep + 1:]
        del self.budgets[keep + 1:]
        self.dead = False

    def commit(self, length: int) -> None:
        """Keep `length` of the request's tokens: the window is rolled back to that point (a
        verify window's accepted prefix) and the rest of it is committed."""
        keep = length - self.length
        if not 0 <= keep <= len(self.window):
            raise GrammarFault(f"commit to {length} tokens outside the window "
                               f"[{self.length}, {self.length + len(self.window)}]")
        self._truncate(keep)
        if any(self.consumed):
            self.at_commit = self.matcher.deep_copy()
        # Window token j was sampled under the mask at position j.
        if not self.closed and any(b.narrowed for b in self.budgets[:keep]):
            self.closed = True
            self.shared.requests_closed += 1
        self.length = length
        self.window, self.consumed = [], []
        self.masks = self.masks[-1:]
        self.budgets = self.budgets[-1:]

    def consume(self, tokens: Sequence[int]) -> None:
        """Sampled tokens, committed at once (each allowed by the mask it was sampled under)."""
        for t in tokens:
            if not self.advance(t):
                raise GrammarFault(f"token {t} is not allowed by the grammar")
        self.commit(self.length + len(self.window))


class DraftMasks:
    """The draft's per-position mask for one proposal: position k of the block is masked under
    the state after the anchor and drafts 1..k, consuming each draft as it is chosen (the
    window that the verify step then reuses)."""

    def __init__(self, grammars: Sequence[RequestGrammar | None]) -> None:
        """One entry per row of the proposal: that request's grammar, or None."""
        self.rows = [(b, g) for b, g in enumerate(grammars) if g is not None]
        self.vocab_size = self.rows[0][1].shared.vocab_size if self.rows else 0

    def __call__(self, position: int, previous: torch.Tensor) -> torch.Tensor | None:
        """Allowed tokens [B, V] at block position `position`, whose previous tokens (the
        anchors at position 0) are `previous` [B]; None: no row is constrained."""
        if not self.rows:
            return None
        allowed = torch.ones(len(previous), self.vocab_size, dtype=torch.bool)
        for b, grammar in self.rows:
            # A fault here would fail the whole batched proposal: the row drafts unmasked
            # instead, and the verify step's window_masks meets the fault again and fails
            # this request alone.
            with contextlib.suppress(GrammarFault):
                if position > 0:
                    grammar.advance(int(previous[b]))
                mask = grammar.draft_mask()
                if mask is not None:
                    allowed[b] = mask
        return allowed
