"""The reference engine's step loop: continuous batching with DSpark speculative decoding.

One step = at most one prefill forward (chunks of waiting prompts) + one decode forward for every
running request. With speculation, a decode step drafts gamma tokens per request in one draft
forward, verifies [anchor, drafts] in one target forward, commits the accepted drafts plus the
target's bonus token, and rolls both caches back past the committed length.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from serve_app.engines.reference.model_runner import ModelRunner
from serve_app.engines.reference.sampling import (
    ResidualRule,
    SamplingParams,
    residual_distribution,
    sample_token,
    verify_drafts,
)
from serve_app.engines.reference.scheduler import Scheduler
from serve_app.engines.reference.sequence import Detokenize, Sequence, SpecStats, Status
from serve_app.engines.types import RequestOutput
from serve_app.models.dspark import survival_draft_count


class EngineObserver(Protocol):
    """Hooks for tracing and metrics, called on the engine thread. Times are time.time_ns()."""

    def on_queued(self, seq: Sequence, at_ns: int) -> None: ...

    def on_admitted(self, seq: Sequence, at_ns: int) -> None: ...

    def on_prefill_chunk(self, seq: Sequence, start: int, end: int, start_ns: int,
                         end_ns: int) -> None: ...

    def on_decode_step(self, seq: Sequence, drafted: int, accepted: int, committed: int,
                       start_ns: int, end_ns: int, speculative: bool) -> None:
        """One decode step; with speculation, one verify of `drafted` drafts."""

    def on_finished(self, seq: Sequence, at_ns: int) -> None: ...

    def on_step(self, core: EngineCore) -> None:
        """After every step (queue lengths, KV use)."""


@dataclass
class SpeculationSettings:
    enabled: bool = True
    gamma: int | None = None  # drafts verified per step; default: the draft's block size
    confidence_threshold: float = 0.0  # verify drafts while cumulative survival >= this


@dataclass
class EngineTotals:
    requests_finished: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    spec_completion_tokens: int = 0


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: Iterable[int] = (),
        detokenize: Detokenize | None = None,
        max_batch_size: int = 32,
        prefill_chunk_tokens: int = 512,
        speculation: SpeculationSettings | None = None,
        max_model_len: int | None = None,
        residual_rule: ResidualRule = residual_distribution,
        observer: EngineObserver | None = None,
    ) -> None:
        """`residual_rule` is the rejection sampler's correction distribution; only tests
        replace it (to show that a wrong rule is detected)."""
        self.runner = runner
        self.residual_rule = residual_rule
        self.observer = observer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.max_model_len = max_model_len
        spec = speculation or SpeculationSettings()
        proposer = runner.proposer
        self.speculative = spec.enabled and proposer is not None
        self.gamma = 0
        if self.speculative:
            assert proposer is not None
            self.gamma = spec.gamma or proposer.gamma
            if not 1 <= self.gamma <= proposer.gamma:
                raise ValueError(
                    f"speculation.gamma={spec.gamma} must be in [1, {proposer.gamma}] "
                    "(the draft's block_size)"
                )
        self.confidence_threshold = spec.confidence_threshold
        self.scheduler = Scheduler(
            runner.allocator.capacity_tokens, max_batch_size, prefill_chunk_tokens,
            headroom_tokens=self.gamma + 1, page_size=runner.allocator.page_size,
        )
        self.sequences: dict[str, Sequence] = {}
        self.totals = EngineTotals()
        self._ids = itertools.count()

    # --- requests -----------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request; raises ValueError / KVCapacityError (nothing queued) if it can
        never be served."""
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.sequences:
            raise ValueError(f"request id {rid!r} is already in use")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if params.stop and self.detokenize is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        total = len(prompt_ids) + params.max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context length {self.max_model_len}"
            )
        seq = Sequence(rid, list(prompt_ids), params, self.eos_token_ids, self.detokenize)
        self.scheduler.add(seq)
        self.sequences[rid] = seq
        if self.observer:
            self.observer.on_queued(seq, time.time_ns())
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its cache at once."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        self.runner.free(request_id)
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"
        if self.observer:
            self.observer.on_finished(seq, time.time_ns())
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        for seq in self.scheduler.admit():
            self.runner.add(seq.request_id)
            if self.observer:
                self.observer.on_admitted(seq, time.time_ns())
        plan = self.scheduler.schedule()
        touched: list[Sequence] = []
        if plan.prefill:
            touched += self._prefill(plan.prefill)
        if plan.decode:
            touched += self._decode(plan.decode)
        outputs = [self._output(seq) for seq in touched]
        if self.observer:
            self.observer.on_step(self)
        return outputs

    def _prefill(self, chunks: list[Any]) -> list[Sequence]:
        start_ns = time.time_ns()
        rows = [c.seq.prompt_ids[c.start:c.end] for c in chunks]
        rids = [c.seq.request_id for c in chunks]
        logits = self.runner.forward(rows, rids, capture=self.speculative)
        lengths = [c.end for c in chunks]
        self.runner.commit(rids, lengths, [c.end - c.start for c in chunks])
        done = []
        end_ns = time.time_ns()
        for b, c in enumerate(chunks):
            if self.observer:
                self.observer.on_prefill_chunk(c.seq, c.start, c.end, start_ns, end_ns)
            c.seq.num_cached = c.end
            if c.completes_prompt:
                seq = c.seq
                first = sample_token(logits[b, c.end - c.start - 1], seq.params, seq.generator)
                seq.status = Status.DECODING
                seq.append([first])
                done.append(seq)
        return done

    def _decode(self, seqs: list[Sequence]) -> list[Sequence]:
        start_ns = time.time_ns()
        if not self.speculative:
            logits = self.runner.forward([[s.anchor] for s in seqs],
                                         [s.request_id for s in seqs], capture=False)
            end_ns = time.time_ns()
            for b, seq in enumerate(seqs):
                seq.num_cached += 1
                kept = seq.append([sample_token(logits[b, 0], seq.params, seq.generator)])
                if self.observer:
                    self.observer.on_decode_step(seq, 0, 0, len(kept), start_ns, end_ns, False)
            return seqs

        proposal = self.runner.propose(seqs)
        counts = torch.full((len(seqs),), self.gamma, dtype=torch.long)
        if self.confidence_threshold > 0 and proposal.confidence is not None:
            counts = survival_draft_count(proposal.confidence[:, : self.gamma],
                                          self.confidence_threshold)
        drafts = []
        for b, seq in enumerate(seqs):
            # Never verify past max_tokens: those tokens would be cut anyway.
            remaining = seq.params.max_tokens - len(seq.output_ids)
            k = int(min(counts[b], remaining - 1))
            drafts.append(proposal.tokens[b, :k].tolist())
        rows = [[s.anchor, *d] for s, d in zip(seqs, drafts, strict=True)]
        logits = self.runner.forward(rows, [s.request_id for s in seqs], capture=True)
        end_ns = time.time_ns()
        lengths, tap_rows = [], []
        for b, seq in enumerate(seqs):
            k = len(drafts[b])
            q = proposal.probs[b, :k] if proposal.probs is not None else None
            verdict = verify_drafts(logits[b, : k + 1], drafts[b], q, seq.params, seq.generator,
                                    self.residual_rule)
            seq.stats.record(k, verdict.accepted)
            # Cached now: the anchor and the accepted drafts; the last token is the new anchor.
            seq.num_cached += verdict.accepted + 1
            lengths.append(seq.num_cached)
            tap_rows.append(verdict.accepted + 1)
            kept = seq.append(verdict.tokens)
            if self.observer:
                self.observer.on_decode_step(seq, k, verdict.accepted, len(kept), start_ns,
                                             end_ns, True)
        self.runner.commit([s.request_id for s in seqs], lengths, tap_rows)
        return seqs

    def _output(self, seq: Sequence) -> RequestOutput:
        new_ids = seq.output_ids[seq.reported_tokens :]
        seq.reported_tokens = len(seq.output_ids)
        out = RequestOutput(
            request_id=seq.request_id,
            token_ids=list(new_ids),
            text=seq.text_delta(),
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
        )
        if seq.finished:
            if self.speculative:
                out.spec = seq.stats.as_dict(len(seq.output_ids))
                self.totals.spec.merge(seq.stats)
                self.totals.spec_completion_tokens += len(seq.output_ids)
            if self.observer:
                self.observer.on_finished(seq, time.time_ns())
            self.totals.requests_finished += 1
            self.totals.prompt_tokens += len(seq.prompt_ids)
            self.totals.completion_tokens += len(seq.output_ids)
            self.scheduler.remove(seq)
            self.runner.free(seq.request_id)
            self.sequences.pop(seq.request_id, None)
        return out

    # --- conveniences -------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion; one final output per prompt, with all its tokens."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        tokens: dict[str, list[int]] = {r: [] for r in rids}
        texts: dict[str, str] = {r: "" for r in rids}
        final: dict[str, RequestOutput] = {}
        while len(final) < len(rids):
            for out in self.step():
                tokens[out.request_id] += out.token_ids
                texts[out.request_id] += out.text
                if out.finished:
                    out.token_ids, out.text = tokens[out.request_id], texts[out.request_id]
                    final[out.request_id] = out
        return [final[r] for r in rids]

    def stats(self) -> dict[str, Any]:
        t = self.totals
        stats: dict[str, Any] = {
            "requests_finished": t.requests_finished,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "speculative": self.speculative,
        }
        if self.speculative:
            stats |= t.spec.as_dict(t.spec_completion_tokens)
        return stats

    def capacity(self) -> dict[str, int]:
        alloc = self.runner.allocator
        return {
            "kv_tokens_total": alloc.capacity_tokens,
            "kv_tokens_used": alloc.used_tokens,
            "kv_tokens_free": alloc.free_tokens,
            "kv_tokens_reserved": self.scheduler.reserved_tokens,
        }
