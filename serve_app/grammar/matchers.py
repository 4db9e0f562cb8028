"""Per-request grammar matchers: the masks the engine samples under, and their roll-back.

A constrained request's matcher has consumed exactly its committed output tokens, except
inside a speculative window: the draft's block is masked as it is proposed (`DraftMasks`, each
position under the state after the drafts before it), the verify window's target rows get the
same masks, and `commit` rolls the matcher back to the accepted prefix through the protocol
every piece of windowed state uses (serve_app/models/target.py: `WindowedState.commit`), after
which the bonus token is consumed like any sampled token.

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
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
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


@dataclass
class _State:
    matcher: LLMatcher
    length: int  # the request's tokens the matcher has seen (prompt + consumed output)
    stop_at: int | None = None  # its length at max_tokens (with closing; else None)
    # The matcher as of the last commit. A window is rolled back by restarting from a copy of
    # it, not by LLMatcher.rollback: llguidance 1.9.1's masks after rollback() and consume can
    # differ from a fresh matcher's on the same tokens once masks were computed in the rolled
    # back part (it then allowed a token its consume refused: tests/test_grammar.py).
    at_commit: LLMatcher | None = None
    # The window since the last commit: masks[j] is the mask after the window's first j tokens.
    masks: list[torch.Tensor] = field(default_factory=list)
    budgets: list[_Budget] = field(default_factory=list)  # beside masks, one per position
    window: list[int] = field(default_factory=list)
    consumed: list[bool] = field(default_factory=list)  # per window token: the matcher took it
    dead: bool = False  # a window token was not allowed: later masks are never used
    closed: bool = False  # a committed token was sampled under a mask the budget narrowed


class GrammarStates:
    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = (),
                 closing: ClosingPaths | None = None) -> None:
        """`eos_token_ids`: the ids that end generation. The matcher never consumes them (its
        roll-back does not cross a stop): an EOS leaves the grammar's state as it was, and
        the request ends there (or, with ignore_eos, goes on under the same mask).
        `closing`: answers are closed before max_tokens cuts them (None: they are cut)."""
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.closing = closing
        self._states: dict[Hashable, _State] = {}
        self.mask_seconds = 0.0  # telemetry: time spent computing masks
        self.masks_computed = 0
        self.requests_closed = 0  # telemetry: answers the budget shaped (`closed`)

    def add(self, rid: Hashable, matcher: LLMatcher, length: int, max_tokens: int) -> None:
        """A request whose matcher has seen `length` tokens (its prompt) and which may
        sample `max_tokens`."""
        stop_at = length + max_tokens if self.closing is not None else None
        self._states[rid] = _State(matcher, length, stop_at, at_commit=matcher.deep_copy())

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._states

    def free(self, rid: Hashable) -> None:
        self._states.pop(rid, None)

    def __len__(self) -> int:
        return len(self._states)

    def committed(self, rid: Hashable) -> int:
        """The request's tokens the matcher has committed (its window not included)."""
        return self._states[rid].length

    def closed(self, rid: Hashable) -> bool:
        """Whether the budget shaped the request's answer: a committed token was sampled
        under a mask it narrowed (the response then says `grammar_closed`)."""
        state = self._states.get(rid)
        return state is not None and state.closed

    # --- masks ----------------------------------------------------------------------------

    def _compute(self, matcher: LLMatcher) -> torch.Tensor:
        """The matcher's mask (all False once it is stopped or failed: nothing may follow)."""
        start = time.perf_counter()
        bits = allowed_bits(matcher, self.vocab_size)
        self.mask_seconds += time.perf_counter() - start
        self.masks_computed += 1
        return torch.from_numpy(bits.astype(bool))

    def _current(self, state: _State) -> torch.Tensor:
        if not state.masks:
            self._push(state, None, None)
        return state.masks[-1]

    def _push(self, state: _State, before: _Budget | None, token: int | None) -> None:
        """The mask (and budget) at the matcher's position, which it reached from the
        position of `before` by `token` (None: the window's first position)."""
        budget = self._budget(state, before, token)
        if budget.mode == "free":
            mask = self._compute(state.matcher)
            if budget.refused:
                mask[list(budget.refused)] = False
        else:
            assert budget.path and self.closing is not None
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[budget.path[0]] = True
            if budget.mode == "plain":
                mask = (self._compute(state.matcher) & self.closing.plain) | mask
        state.masks.append(mask)
        state.budgets.append(budget)

    def _budget(self, state: _State, before: _Budget | None, token: int | None) -> _Budget:
        """How the budget narrows this position's mask: a function of the request's tokens
        (the previous position's budget and the token between them)."""
        if self.closing is None or state.stop_at is None:
            return _Budget()
        position = state.length + len(state.window)
        left = state.stop_at - position  # tokens still to sample, this one included
        path, check_at = None, position
        if before is not None:
            check_at = before.check_at
            if before.path and token == before.path[0]:
                path = before.path[1:]  # the model (or the mask) followed the path
        if path is None and position >= check_at:
            path = self.closing.path(state.matcher)
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
        openers = [o for o in self.closing.open_ids
                   if left > 0 and state.matcher.validate_tokens([o]) == 1]
        if openers and path is None:
            path = self.closing.path(state.matcher)
        refused = tuple(
            o for o in openers
            if path is not None and (not path or path[0] != o)
            and (after := self.closing.path(state.matcher, o)) is not None
            and 1 + len(after) + CLOSE_MARGIN >= left)
        return _Budget(path, check_at, refused=refused)

    def mask(self, rid: Hashable) -> torch.Tensor:
        """Allowed next tokens [V] after what the matcher has consumed (window included), to
        sample under: a GrammarFault when it allows none."""
        state = self._states[rid]
        mask = self._current(state)
        if not bool(mask.any()):
            raise GrammarFault("the grammar allows no token here"
                               + (f" ({state.matcher.get_error()[:200]})"
                                  if state.matcher.is_error() else ""))
        return mask

    def draft_mask(self, rid: Hashable) -> torch.Tensor | None:
        """The current mask for drafting: None when it allows nothing (the draft then chooses
        freely, and the verify step meets the fault for this request alone)."""
        mask = self._current(self._states[rid])
        return mask if bool(mask.any()) else None

    def advance(self, rid: Hashable, token: int) -> bool:
        """Consume one token tentatively (a draft, or a sampled token before commit): False,
        consuming nothing, when the current mask does not allow it."""
        state = self._states[rid]
        if state.dead or not bool(self._current(state)[token]):
            state.dead = True
            return False
        # The window and its masks stay aligned: masks[j] follows the window's first j tokens.
        token = int(token)
        before = state.budgets[-1]
        if token not in self.eos and not state.matcher.consume_token(token):
            raise GrammarFault(f"the grammar refused token {token} it allowed"
                               + (f" ({state.matcher.get_error()[:200]})"
                                  if state.matcher.is_error() else ""))
        state.window.append(token)
        state.consumed.append(token not in self.eos)
        if token in self.eos:
            state.masks.append(state.masks[-1])
            state.budgets.append(before)
        else:
            self._push(state, before, token)
        return True

    def window_masks(self, rid: Hashable, drafts: Sequence[int]) -> torch.Tensor:
        """Masks [k+1, V] for a verify window [anchor, d_1..d_k]: row j under the state after
        d_1..d_j. Drafts a masked proposer consumed already are reused; rows after a draft the
        grammar does not allow repeat the last mask (the rejection rule never reaches them:
        that draft has target probability 0)."""
        state = self._states[rid]
        drafts = [int(d) for d in drafts]
        common = 0
        while common < min(len(state.window), len(drafts)) \
                and state.window[common] == drafts[common]:
            common += 1
        if common < len(state.window):
            self._truncate(state, common)
        self._current(state)
        for d in drafts[common:]:
            if not self.advance(rid, d):
                break
        rows = state.masks[: len(drafts) + 1]
        rows += [rows[-1]] * (len(drafts) + 1 - len(rows))
        return torch.stack(rows)

    # --- the window protocol ----------------------------------------------------------------

    def _truncate(self, state: _State, keep: int) -> None:
        """Roll the window back to its first `keep` tokens (still uncommitted)."""
        if any(state.consumed[keep:]):
            assert state.at_commit is not None
            matcher = state.at_commit.deep_copy()
            for token, consumed in zip(state.window[:keep], state.consumed, strict=False):
                if consumed and not matcher.consume_token(token):
                    raise GrammarFault("the grammar could not roll back")
            state.matcher = matcher
        del state.window[keep:]
        del state.consumed[keep:]
        del state.masks[keep + 1:]
        del state.budgets[keep + 1:]
        state.dead = False

    def commit(self, rids: Sequence[Hashable], lengths: Sequence[int]) -> None:
        """Keep `lengths[i]` of rids[i]'s tokens: the window is rolled back to that point (a
        verify window's accepted prefix) and the rest of it is committed."""
        for rid, n in zip(rids, lengths, strict=True):
            state = self._states.get(rid)
            if state is None:
                continue
            keep = n - state.length
            if not 0 <= keep <= len(state.window):
                raise GrammarFault(f"commit to {n} tokens outside the window "
                                   f"[{state.length}, {state.length + len(state.window)}]")
            self._truncate(state, keep)
            if any(state.consumed):
                state.at_commit = state.matcher.deep_copy()
            # Window token j was sampled under the mask at position j.
            if not state.closed and any(b.narrowed for b in state.budgets[:keep]):
                state.closed = True
                self.requests_closed += 1
            state.length = n
            state.window, state.consumed = [], []
            state.masks = state.masks[-1:]
            state.budgets = state.budgets[-1:]

    def consume(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Sampled tokens, committed at once (each allowed by the mask it was sampled under)."""
        for t in tokens:
            if not self.advance(rid, t):
                raise GrammarFault(f"token {t} is not allowed by the grammar")
        state = self._states[rid]
        self.commit([rid], [state.length + len(state.window)])


class DraftMasks:
    """The draft's per-position mask for one proposal: position k of the block is masked under
    the state after the anchor and drafts 1..k, consuming each draft as it is chosen (the
    window that the verify step then reuses)."""

    def __init__(self, states: GrammarStates, rids: Sequence[Hashable]) -> None:
        self.states = states
        self.rows = [(b, rid) for b, rid in enumerate(rids) if rid in states]

    def __call__(self, position: int, previous: torch.Tensor) -> torch.Tensor | None:
        """Allowed tokens [B, V] at block position `position`, whose previous tokens (the
        anchors at position 0) are `previous` [B]; None: no row is constrained."""
        if not self.rows:
            return None
        allowed = torch.ones(len(previous), self.states.vocab_size, dtype=torch.bool)
        for b, rid in self.rows:
            # A fault here would fail the whole batched proposal: the row drafts unmasked
            # instead, and the verify step's window_masks meets the fault again and fails
            # this request alone.
            with contextlib.suppress(GrammarFault):
                if position > 0:
                    self.states.advance(rid, int(previous[b]))
                mask = self.states.draft_mask(rid)
                if mask is not None:
                    allowed[b] = mask
        return allowed
