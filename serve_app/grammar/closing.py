"""The short way to finish a constrained answer, for requests that would otherwise be cut.

A grammar makes an answer well-formed only if the model ends what it opens: a model that
writes a free string, a number or an array until `max_tokens` gets an unterminated answer
(`finish_reason: length`), as from every server. With `engine.reference.grammar_budget:
close` the engine instead reserves the end of the budget for finishing the answer
(matchers.py): near the end the model may open nothing new, then the answer's closing path is
forced. The answer ends complete, with its own finish reason, and its response says
`grammar_closed: true` (the budget shaped it).

`ClosingPaths.path` walks a copy of the matcher to an accepting state, choosing at each step
the token that most plainly makes progress: what the grammar forces; a control token that
closes an XTML element (free reasoning, a raw string argument); a quote that closes a string;
then brackets and the shortest JSON values. It is an upper bound on the shortest completion,
not the shortest (that is a search the step cannot afford), and it gives up (None) after
`LIMIT` tokens: a state with no known path is not closed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from llguidance import LLMatcher

from serve_app.grammar.compiler import allowed_bits, vocabulary_bytes, vocabulary_special
from serve_app.tokenizer import Tokenizer

LIMIT = 256
# Tried in this order where nothing is forced and no string or element can be closed: the
# ends of containers, a key's colon, the next element or key where the container may not end
# yet (before any digit: after a number's digits a `0` would only lengthen it), the shortest
# values, the openers a required object or array needs, one character of a string with a
# minimum length.
_JSON_STEPS = ("}", "]", ":", ",", "0", "null", "false", "true", "{", "[", "a")
_CLOSE_CONTROL, _OPEN_CONTROL = "<|close|>", "<|open|>"  # K3's XTML (docs/chat-format.md)
# Where a few tokens are allowed (a tool's name, a key, an enum), each is tried and the one
# whose path is shortest taken; among more, the lowest id.
_BRANCHES = 16
_PUNCTUATION = frozenset(b'"{}[],:')


class ClosingPaths:
    def __init__(self, close_ids: Sequence[int], open_ids: Sequence[int], quote: int | None,
                 steps: Sequence[int], plain: torch.Tensor, eos: Iterable[int]) -> None:
        """`close_ids` / `open_ids`: control tokens that close / open an element (an opened
        call or argument can need many tokens to close); `quote`: the id of `"`;
        `steps`: the JSON tokens of _JSON_STEPS the vocabulary has as one id, in order;
        `plain` [V]: the ids that can open nothing (no control token, no JSON punctuation):
        inside a string or a number they extend it, elsewhere they are a whole value."""
        self.close_ids = list(close_ids)
        self.open_ids = list(open_ids)
        self.quote = quote
        self.steps = list(steps)
        self.plain = plain
        self.vocab_size = len(plain)
        self.eos = frozenset(eos)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int,
                      eos: Iterable[int]) -> ClosingPaths:
        def single(text: str) -> int | None:
            ids = tokenizer.encode_text(text)
            return ids[0] if len(ids) == 1 else None

        def opens_nothing(i: int) -> bool:
            text = vocabulary_bytes(tokenizer, i)  # b"": an id past the vocabulary
            return bool(text) and not vocabulary_special(tokenizer, i) \
                and not any(b in _PUNCTUATION for b in text)

        close = tokenizer.special_ids.get(_CLOSE_CONTROL)
        open_ = tokenizer.special_ids.get(_OPEN_CONTROL)
        steps = [i for i in map(single, _JSON_STEPS) if i is not None]
        plain = torch.tensor([opens_nothing(i) for i in range(vocab_size)], dtype=torch.bool)
        return cls([close] if close is not None else [], [open_] if open_ is not None else [],
                   single('"'), steps, plain, eos)

    def path(self, matcher: LLMatcher, after: int | None = None, branches: bool = True,
             limit: int = LIMIT) -> list[int] | None:
        """Tokens that take `matcher` (not changed), after `after` if given, to a state where
        the answer may end; [] when it may end now; None when no path was found within
        `limit` tokens (or `after` is not allowed)."""
        m = matcher.deep_copy()
        if after is not None and not m.consume_token(after):
            return None
        path: list[int] = []
        while not m.is_accepting():
            if len(path) >= limit or m.is_stopped() or m.is_error():
                return None
            tokens = m.compute_ff_tokens() or self._choose(m, branches, limit - len(path))
            if not tokens:
                return None
            for t in tokens:
                if not m.consume_token(t):
                    return None
                path.append(t)
        return path

    def _choose(self, m: LLMatcher, branches: bool, limit: int) -> list[int]:
        for c in self.close_ids:
            if m.validate_tokens([c]) == 1:
                return [c]
        q = self.quote
        # A quote closes a string when no second quote may follow it (after an opening quote,
        # one may: the empty string).
        opens = q is not None and m.validate_tokens([q, q]) == 2
        if q is not None and not opens and m.validate_tokens([q]) == 1:
            return [q]
        for t in self.steps:
            if m.validate_tokens([t]) == 1:
                return [t]
        if q is not None and m.validate_tokens([q]) == 1:
            return [q]
        # A tool's name, a key, an enum's or a pattern's next character.
        bits = allowed_bits(m, self.vocab_size)
        allowed = [int(t) for t in np.flatnonzero(bits) if int(t) not in self.eos]
        if not allowed:
            return []
        if branches and 1 < len(allowed) <= _BRANCHES:
            lengths = {}
            for t in allowed:
                rest = self.path(m, after=t, branches=False, limit=limit)
                if rest is not None:
                    lengths[t] = len(rest)
            if lengths:
                return [min(lengths, key=lambda t: (lengths[t], t))]
        return [allowed[0]]
