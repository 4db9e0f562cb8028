"""One request inside the engine: its tokens, progress, stop conditions and speculative stats,
and what it samples with (its generator and, when constrained, its grammar)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from serve_app.engines.reference.sampling import (
    ResidualRule,
    SamplingParams,
    Verdict,
    sample_token,
    verify_batch,
)
from serve_app.engines.spec_stats import SpecStats
from serve_app.grammar.matchers import RequestGrammar
from serve_app.protocol.media import ImageInput, cache_keys

Detokenize = Callable[[list[int]], str]


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no KV reserved yet
    PREFILLING = "prefilling"  # KV reserved, prompt partly in the cache
    DECODING = "decoding"
    # Prefilled with its first token sampled, held for `EngineCore.export` to a decode engine
    # (a hand-off request: prefill/decode disaggregation); it decodes nothing here.
    PREFILLED = "prefilled"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    detokenize: Detokenize | None = None
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the target cache (prompt, then committed outputs except the
    # newest, which is the next step's anchor).
    num_cached: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied at admission
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    text: str = ""
    reported_tokens: int = 0  # output tokens already handed out in step outputs
    hand_off: bool = False  # stop after prefill, to be exported to a decode engine
    # The prompt's images, their pad runs inside prompt_ids (protocol/media.py).
    images: tuple[ImageInput, ...] = ()
    # The output's constraint (a matcher that has consumed exactly the committed outputs, plus
    # a verify window's drafts); None: free.
    grammar: RequestGrammar | None = None
    streamed_text: int = 0  # characters of `text` already handed out
    generator: torch.Generator = field(init=False)
    # What the prefix cache keys the prompt on: the ids, each image's pad run replaced by its
    # pixels' key, so two prompts share a cached prefix only where their images are the same.
    prompt_keys: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_keys = cache_keys(self.prompt_ids, self.images)
        self.generator = torch.Generator()
        if self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)
        else:
            self.generator.seed()

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def all_keys(self) -> list[int]:
        """`all_ids` as the prefix cache keys them (`prompt_keys`, then the outputs)."""
        return self.prompt_keys + self.output_ids

    @property
    def anchor(self) -> int:
        return self.output_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def max_length(self, headroom: int) -> int:
        """Worst-case KV tokens: prompt, every output, and a verify window past the end."""
        return len(self.prompt_ids) + self.params.max_tokens + headroom

    def sample(self, logits: torch.Tensor) -> int:
        """One token from one row of logits, under the grammar (which then takes it: the
        token is committed)."""
        grammar = self.grammar
        token = sample_token(logits, self.params, self.generator,
                             grammar.mask() if grammar is not None else None)
        if grammar is not None:
            grammar.consume([token])
        return token

    def append(self, tokens: list[int]) -> list[int]:
        """Commit generated tokens, stopping exactly at EOS, a stop token, a stop string or
        max_tokens. Returns the tokens actually kept."""
        kept: list[int] = []
        stop_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stop_ids |= self.eos_token_ids
        for tok in tokens:
            if tok in stop_ids:
                self._finish("stop")
                break
            self.output_ids.append(tok)
            kept.append(tok)
            if self.params.stop and self._hit_stop_string():
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self._finish("length")
                break
        return kept

    def _hit_stop_string(self) -> bool:
        assert self.detokenize is not None, "stop strings need a tokenizer"
        text = self.detokenize(self.output_ids)
        # Only the tail can hold a new match: search from where the last check ended.
        start = max(0, len(self.text) - max(len(s) for s in self.params.stop))
        hits = [i for s in self.params.stop if (i := text.find(s, start)) >= 0]
        self.text = text
        if hits:
            self.text = text[: min(hits)]
            self._finish("stop")
            return True
        return False

    def _finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    def text_delta(self) -> str:
        """New text since the last call. While running, text that could still turn out to be
        the start of a stop string is held back."""
        if self.detokenize is None:
            return ""
        if not self.params.stop:
            self.text = self.detokenize(self.output_ids)
        hold = 0 if self.finished or not self.params.stop else max(map(len, self.params.stop)) - 1
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the rest of it.
        end = len(self.text) - hold
        while not self.finished and end > self.streamed_text and self.text[end - 1] == "\ufffd":
            end -= 1
        if end <= self.streamed_text:
            return ""
        delta = self.text[self.streamed_text:end]
        self.streamed_text = end
        return delta


def verify_windows(seqs: Seq[Sequence], logits: Seq[torch.Tensor], drafts: Seq[list[int]],
                   draft_probs: Seq[torch.Tensor | None], residual_rule: ResidualRule
                   ) -> list[Verdict | Exception]:
    """Each sequence's verdict on its verify window [anchor, *drafts] (`logits[i]` [k+1, V]),
    each row under its grammar's mask after the drafts before it, or what failed for that
    sequence alone. The batch walks together (`verify_batch`); a grammar keeps the accepted
    drafts (the window's prefix), then takes the bonus token like any sampled one."""
    out: list[Verdict | Exception | None] = [None] * len(seqs)
    allowed: list[torch.Tensor | None] = []
    for b, seq in enumerate(seqs):
        try:
            allowed.append(seq.grammar.window_masks(drafts[b]) if seq.grammar is not None
                           else None)
        except Exception as exc:
            out[b] = exc
            allowed.append(None)
    batch = [b for b in range(len(seqs)) if out[b] is None]
    verdicts = verify_batch([logits[b] for b in batch], [drafts[b] for b in batch],
                            [draft_probs[b] for b in batch], [seqs[b].params for b in batch],
                            [seqs[b].generator for b in batch], residual_rule,
                            [allowed[b] for b in batch])
    for b, verdict in zip(batch, verdicts, strict=True):
        grammar = seqs[b].grammar
        if grammar is not None and isinstance(verdict, Verdict):
            try:
                grammar.commit(grammar.length + verdict.accepted)
                grammar.consume(verdict.tokens[-1:])
            except Exception as exc:
                verdict = exc
        out[b] = verdict
    return [v if v is not None else RuntimeError("no verdict") for v in out]
