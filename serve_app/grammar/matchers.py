"""Per-request grammar matchers: the masks the engine samples under, and their roll-back.

A constrained request's matcher has consumed exactly its committed output tokens, except
inside a speculative window: the draft's block is masked as it is proposed (`DraftMasks`, each
position under the state after the drafts before it), the verify window's target rows get the
same masks, and `commit` rolls the matcher back to the accepted prefix through the protocol
every piece of windowed state uses (serve_app/models/target.py: `WindowedState.commit`), after
which the bonus token is consumed like any sampled token.

Lengths are counted as the target cache counts them, in the request's tokens (prompt
included): a matcher starts at its prompt's length.

Everything here runs on rank 0's engine thread: followers never sample.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from llguidance import LLMatcher


class GrammarFault(RuntimeError):
    """A matcher refused a token it had allowed, or allows nothing (a compiler bug, not the
    client's): the engine fails this request alone."""


@dataclass
class _State:
    matcher: LLMatcher
    length: int  # the request's tokens the matcher has seen (prompt + consumed output)
    # The matcher as of the last commit. A window is rolled back by restarting from a copy of
    # it, not by LLMatcher.rollback: llguidance 1.9.1's masks after rollback() and consume can
    # differ from a fresh matcher's on the same tokens once masks were computed in the rolled
    # back part (it then allowed a token its consume refused: tests/test_grammar.py).
    at_commit: LLMatcher | None = None
    # The window since the last commit: masks[j] is the mask after the window's first j tokens.
    masks: list[torch.Tensor] = field(default_factory=list)
    window: list[int] = field(default_factory=list)
    consumed: list[bool] = field(default_factory=list)  # per window token: the matcher took it
    dead: bool = False  # a window token was not allowed: later masks are never used


class GrammarStates:
    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        """`eos_token_ids`: the ids that end generation. The matcher never consumes them (its
        roll-back does not cross a stop): an EOS leaves the grammar's state as it was, and
        the request ends there (or, with ignore_eos, goes on under the same mask)."""
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self._states: dict[Hashable, _State] = {}
        self.mask_seconds = 0.0  # telemetry: time spent computing masks
        self.masks_computed = 0

    def add(self, rid: Hashable, matcher: LLMatcher, length: int) -> None:
        self._states[rid] = _State(matcher, length, at_commit=matcher.deep_copy())

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._states

    def free(self, rid: Hashable) -> None:
        self._states.pop(rid, None)

    def __len__(self) -> int:
        return len(self._states)

    def committed(self, rid: Hashable) -> int:
        """The request's tokens the matcher has committed (its window not included)."""
        return self._states[rid].length

    # --- masks ----------------------------------------------------------------------------

    def _compute(self, matcher: LLMatcher) -> torch.Tensor:
        """The matcher's mask (all False once it is stopped or failed: nothing may follow)."""
        start = time.perf_counter()
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[: self.vocab_size]
        self.mask_seconds += time.perf_counter() - start
        self.masks_computed += 1
        return torch.from_numpy(bits.astype(bool))

    def _current(self, state: _State) -> torch.Tensor:
        if not state.masks:
            state.masks.append(self._compute(state.matcher))
        return state.masks[-1]

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
        if token in self.eos:
            state.masks.append(state.masks[-1])
        elif state.matcher.consume_token(int(token)):
            state.masks.append(self._compute(state.matcher))
        else:
            raise GrammarFault(f"the grammar refused token {token} it allowed"
                               + (f" ({state.matcher.get_error()[:200]})"
                                  if state.matcher.is_error() else ""))
        state.window.append(int(token))
        state.consumed.append(token not in self.eos)
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
            state.length = n
            state.window, state.consumed = [], []
            state.masks = state.masks[-1:]

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
