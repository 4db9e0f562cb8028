"""The reference engine's step loop: continuous batching with DSpark speculative decoding.

One step = at most one prefill forward (chunks of waiting prompts) + one decode forward for every
running request. With speculation, a decode step drafts gamma tokens for the requests worth
drafting for in one draft forward, verifies each request's window [anchor, k of its drafts] (k
chosen per request by the verify budget, spec_budget.py; 0 for the rest) in one target forward,
commits the accepted drafts plus the target's bonus token, and rolls both caches back past the
committed length.

Faults are isolated per request: an exception while sampling, verifying, committing or
detokenizing for one sequence aborts that sequence alone (its final output carries `error`); the
rest of the batch carries on with exactly the tokens it would have produced. A batched operation
(a forward, the draft's proposal, a cache commit) that raises is an engine fault and propagates.
Observer hooks are telemetry: their exceptions are logged, never allowed to fail requests.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

from serve_app.config import SpeculationConfig
from serve_app.engines.reference.handoff import RequestHandoff, image_keys
from serve_app.engines.reference.images import check_image_shapes
from serve_app.engines.reference.model_runner import ModelRunner
from serve_app.engines.reference.observer import EngineObserver, StepReport
from serve_app.engines.reference.sampling import (
    ResidualRule,
    SamplingParams,
    residual_distribution,
)
from serve_app.engines.reference.scheduler import Scheduler
from serve_app.engines.reference.sequence import Detokenize, Sequence, Status, verify_windows
from serve_app.engines.reference.spec_budget import (
    StepShape,
    VerifyBudget,
    costly_class,
    request_class,
)
from serve_app.engines.spec_stats import EngineTotals
from serve_app.grammar.closing import ClosingPaths
from serve_app.grammar.compiler import GrammarCompiler
from serve_app.grammar.matchers import GrammarStates, RequestGrammar
from serve_app.models.dspark import survival_draft_count
from serve_app.protocol.generation import RequestOutput, is_int
from serve_app.protocol.media import ImageInput, check_images

logger = logging.getLogger(__name__)

# The finish reasons of a request that ran to its end. Its committed tokens are worth keeping
# in the prefix cache, and so is a hand-over's prompt; an abort's or a failure's are not.
_FINISHED = frozenset({"stop", "length"})
_DONATES = _FINISHED | {"handoff"}


def _fixed_windows(seq: Sequence) -> bool:
    """Whether the adaptive budget gives `seq` its whole block every step: a seeded sampled
    request's rejection tests draw from its own generator, so its tokens depend on its
    windows, and a seed must reproduce it whatever the timing and the traffic around it
    (docs/speculation.md). Greedy requests are the same under any window."""
    return not seq.params.greedy and seq.params.seed is not None


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: Iterable[int] = (),
        detokenize: Detokenize | None = None,
        max_batch_size: int = 32,
        prefill_chunk_tokens: int = 512,
        max_prefill_tokens_per_request: int | None = None,
        speculation: SpeculationConfig | None = None,
        max_model_len: int | None = None,
        residual_rule: ResidualRule = residual_distribution,
        observer: EngineObserver | None = None,
        grammar: GrammarCompiler | None = None,
        grammar_closing: ClosingPaths | None = None,
    ) -> None:
        """`residual_rule` is the rejection sampler's correction distribution; only tests
        replace it (to show that a wrong rule is detected). `max_prefill_tokens_per_request`:
        see Scheduler (None: a quarter of prefill_chunk_tokens). `grammar`: compiles the
        requests' output constraints (None: this engine refuses constrained requests).
        `grammar_closing`: constrained answers are closed before max_tokens would cut them
        (serve_app/grammar/closing.py; None: they are cut, as OpenAI's API does)."""
        self.runner = runner
        self.grammar = grammar
        self.residual_rule = residual_rule
        self.observer = observer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.max_model_len = max_model_len
        self.vocab_size = runner.target.config.vocab_size
        spec = speculation or SpeculationConfig()
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
        self.speculation_max_batch = spec.max_batch_size
        # The adaptive verify budget (spec_budget.py); None: fixed windows.
        self.budget = (VerifyBudget(self.gamma, spec.cost_table)
                       if self.speculative and spec.adaptive else None)
        self.scheduler = Scheduler(
            runner.allocator.capacity_tokens, max_batch_size, prefill_chunk_tokens,
            headroom_tokens=self.gamma + 1, page_size=runner.allocator.page_size,
            max_prefill_tokens_per_request=max_prefill_tokens_per_request,
            state_slots=runner.state_slots,
            prefix=runner.prefix,
        )
        self.sequences: dict[str, Sequence] = {}
        # What constrained requests share (each one's matcher is its sequence's; rank 0 alone
        # samples, so followers have none).
        self.grammars = GrammarStates(self.vocab_size, self.eos_token_ids, grammar_closing)
        self.totals = EngineTotals()
        self._ids = itertools.count()
        # Sequences that failed during the current step: (sequence, what it was doing).
        self._failed: list[tuple[Sequence, str]] = []

    # --- requests -----------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
        hand_off: bool = False, images: tuple[ImageInput, ...] = (),
    ) -> str:
        """Queue a request; raises ValueError (naming the field) / KVCapacityError (nothing
        queued) if it can never be served. Everything that can be checked here is, so that a
        bad request is refused rather than failing inside a step. `hand_off`: prefill it and
        sample its first token only; a step output with `prefilled` set then says it waits
        for `export` to a decode engine (a request that ends on its first token just ends).
        `images`: the prompt's images, their pad runs in `prompt_ids` (protocol/media.py); an
        engine without a vision tower refuses them rather than running the pads as text."""
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.sequences:
            raise ValueError(f"request id {rid!r} is already in use")
        self._validate(prompt_ids, params)
        images = tuple(images)
        if images:
            if self.runner.images is None:
                raise ValueError("images: this engine's model has no vision tower; it cannot "
                                 "take image input")
            check_images(len(prompt_ids), images)
            check_image_shapes(images)
        total = len(prompt_ids) + params.max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context length {self.max_model_len}"
            )
        seq = Sequence(rid, list(prompt_ids), params, self.eos_token_ids, self.detokenize,
                       hand_off=hand_off, images=images)
        # A GrammarError (a ValueError naming the field) leaves nothing queued.
        seq.grammar = self._grammar(params, len(prompt_ids))
        self.scheduler.add(seq)
        self.sequences[rid] = seq
        self._notify("on_queued", seq, time.time_ns())
        return rid

    def _grammar(self, params: SamplingParams, length: int) -> RequestGrammar | None:
        """The request's grammar state, a fresh matcher at its prompt's `length`; None
        without a grammar."""
        if params.grammar is None:
            return None
        if self.grammar is None:
            raise ValueError(f"{params.grammar.param}: this engine cannot constrain its "
                             "output (it was built without a tokenizer)")
        return self.grammars.start(self.grammar.matcher(params.grammar), length,
                                   params.max_tokens)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The prompt against this engine's vocabulary (SamplingParams checks its own
        fields): each error names the field."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if not all(map(is_int, prompt_ids)):
            i = next(i for i, t in enumerate(prompt_ids) if not is_int(t))
            raise ValueError(f"prompt: token {i} is {type(prompt_ids[i]).__name__}, not an int")
        vocab = self.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            i, t = next((i, t) for i, t in enumerate(prompt_ids) if not 0 <= t < vocab)
            raise ValueError(f"prompt: token id {t} at position {i} is outside the "
                             f"vocabulary [0, {vocab})")
        if not isinstance(params, SamplingParams):  # which checks its own fields
            raise ValueError(f"params must be SamplingParams, not {type(params).__name__}")
        if params.stop and self.detokenize is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its cache at once."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return False
        self._retire(seq, "abort")
        return True

    def export(self, request_id: str) -> RequestHandoff:
        """A request leaves this engine as a RequestHandoff, between steps: a prefilled
        hand-off request (`add_request(hand_off=True)`, after its `prefilled` output), or a
        decoding one moving to another engine (a migration); what it computed stays in the
        prefix cache if there is one."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.status not in (Status.PREFILLED, Status.DECODING):
            raise ValueError(f"request {request_id!r} is neither prefilled for a hand-over nor "
                             "decoding")
        handoff = RequestHandoff(
            request_id, list(seq.prompt_ids), list(seq.output_ids), seq.params, seq.num_cached,
            seq.cached_tokens, seq.generator.get_state(), self.runner.export(request_id),
            images=tuple(image_keys(seq.images)), reported_tokens=seq.reported_tokens,
            streamed_text=seq.streamed_text, text=seq.text, stats=seq.stats)
        self._retire(seq, "handoff")
        return handoff

    def adopt(self, handoff: RequestHandoff, request_id: str | None = None) -> str:
        """A request another engine `export`ed (prefilled there, or decoding there) joins this
        one's running batch and decodes exactly as if it had run here from the start; its
        first output carries the tokens the client has not been sent yet. Raises ValueError /
        KVCapacityError (nothing changed) when it cannot: the sender still holds nothing, so
        the caller retries elsewhere."""
        rid = request_id or handoff.request_id
        if rid in self.sequences:
            raise ValueError(f"request id {rid!r} is already in use")
        params = handoff.params
        self._validate(handoff.prompt_ids, params)
        check_images(len(handoff.prompt_ids), handoff.images)
        outputs = len(handoff.output_ids)
        if not outputs or handoff.num_cached != len(handoff.prompt_ids) + outputs - 1:
            raise ValueError("a hand-over carries its prompt and outputs in the caches, all but "
                             "the newest output (the next step's anchor)")
        if not 0 <= handoff.reported_tokens <= outputs or outputs > params.max_tokens:
            raise ValueError("a hand-over's outputs disagree with what it reported and its "
                             "max_tokens")
        seq = Sequence(rid, list(handoff.prompt_ids), params, self.eos_token_ids,
                       self.detokenize, images=tuple(handoff.images))
        seq.output_ids = list(handoff.output_ids)
        seq.num_cached = handoff.num_cached
        seq.cached_tokens = handoff.cached_tokens
        seq.reported_tokens = handoff.reported_tokens
        seq.text, seq.streamed_text = handoff.text, handoff.streamed_text
        if handoff.stats is not None:
            seq.stats = handoff.stats
        seq.generator.set_state(handoff.generator_state)
        seq.grammar = self._grammar(params, len(seq.prompt_ids))
        if seq.grammar is not None:
            # The matcher of a fresh request, walked over what the other side sampled.
            seq.grammar.consume(seq.output_ids)
        self.scheduler.adopt(seq)
        try:
            self.runner.adopt(rid, handoff.num_cached, handoff.shares)
        except BaseException:
            self.scheduler.remove(seq)
            raise
        self.sequences[rid] = seq
        # Queued and admitted at once: observers see it begin like any request (the trace's
        # engine.request span on this side, under its caller's).
        now = time.time_ns()
        self._notify("on_queued", seq, now)
        self._notify("on_admitted", seq, now)
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step. Raises only for engine faults (a batched forward, a cache operation); a
        request whose own processing raised gets a final output with `error` instead."""
        self._failed = []
        for seq in self.scheduler.admit():
            prompt = seq.prompt_keys if self.runner.prefix is not None else ()
            seq.num_cached = seq.cached_tokens = self.runner.add(seq.request_id, prompt,
                                                                 seq.images)
            self._notify("on_admitted", seq, time.time_ns())
        plan = self.scheduler.schedule()
        touched: list[Sequence] = []
        if plan.prefill:
            touched += self._prefill(plan.prefill)
        if plan.decode:
            touched += self._decode(plan.decode)
        outputs = []
        for seq in touched:
            if seq.status is Status.PREFILLED:
                # Nothing streams from here: the decode engine reports the first token.
                outputs.append(RequestOutput(
                    seq.request_id, [], "", False, None, len(seq.prompt_ids), 0,
                    cached_tokens=seq.cached_tokens, prefilled=True))
                continue
            try:
                text = seq.text_delta()
            except Exception as exc:
                self._isolate(seq, "detokenizing", exc)
                continue
            outputs.append(self._output(seq, text))
        # Last: every commit of this step is done, so the failed sequences' frees come after
        # them on every rank.
        outputs += [self._fail(seq, stage) for seq, stage in self._failed]
        self._failed = []
        if self.observer is not None:
            self._notify("on_step", self.report())
        return outputs

    def report(self) -> StepReport:
        spec = self.totals.spec
        return StepReport(len(self.scheduler.waiting), len(self.scheduler.running),
                          self.capacity(), self.prefix_cache_stats(), self.grammar_stats(),
                          spec.accept_rate if spec.proposed_drafts else None)

    def _isolate(self, seq: Sequence, stage: str, exc: Exception) -> None:
        """Record that `seq` failed while `stage` (e.g. "sampling"); `_fail` ends it."""
        logger.error("request %s failed in the engine while %s; aborting it alone",
                     seq.request_id, stage, exc_info=exc)
        self._failed.append((seq, stage))

    def _fail(self, seq: Sequence, stage: str) -> RequestOutput:
        """Retire a failed sequence and give its final output."""
        self._retire(seq, "error")
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[],
            text="",
            finished=True,
            finish_reason="error",
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=seq.reported_tokens,  # what the client was given
            error=f"the request failed in the engine while {stage}",
        )

    def _retire(self, seq: Sequence, reason: str) -> None:
        """The one way a request leaves this engine, whatever ends it (`reason`: stop /
        length, it finished; handoff, `export`; abort; error, it failed alone). Its place in
        the scheduler, its entry and every per-request state go at once: the runner frees its
        caches (a request that ran to its end donates its committed prefix to the prefix
        cache), its grammar goes with the sequence; the totals and the observer hear of it
        once."""
        self.scheduler.remove(seq)
        self.sequences.pop(seq.request_id, None)
        if self.budget is not None:
            self.budget.forget(seq.request_id)
        prefix = self.runner.prefix
        keep = prefix.finish_point(seq.num_cached) if prefix is not None and \
            reason in _DONATES else 0
        self.runner.free(seq.request_id, seq.all_keys[:keep])
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if reason == "error":
            self.totals.requests_failed += 1
        elif reason in _FINISHED:
            self.totals.add_finished(len(seq.prompt_ids), len(seq.output_ids),
                                     seq.stats if self.speculative else None)
        self._notify("on_finished", seq, time.time_ns())

    def _notify(self, hook: str, *args: Any) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, hook)(*args)
        except Exception:
            logger.exception("engine observer %s failed (ignored: telemetry only)", hook)

    def _prefill(self, chunks: list[Any]) -> list[Sequence]:
        start_ns = time.time_ns()
        rows = [c.seq.prompt_ids[c.start:c.end] for c in chunks]
        rids = [c.seq.request_id for c in chunks]
        logits = self.runner.forward(rows, rids, capture=self.speculative, last_only=True)
        lengths = [c.end for c in chunks]
        cache_at = self._cache_at([(c.seq, c.start, c.end) for c in chunks])
        self.runner.commit(rids, lengths, [c.end - c.start for c in chunks], cache_at)
        done = []
        end_ns = time.time_ns()
        for b, c in enumerate(chunks):
            self._notify("on_prefill_chunk", c.seq, c.start, c.end, start_ns, end_ns)
            c.seq.num_cached = c.end
            if c.completes_prompt:
                seq = c.seq
                stage = "sampling"
                try:
                    first = seq.sample(logits[b, 0])
                    seq.status = Status.DECODING
                    stage = "checking stop conditions"
                    seq.append([first])
                    if seq.hand_off and not seq.finished:
                        seq.status = Status.PREFILLED
                except Exception as exc:
                    self._isolate(seq, stage, exc)
                    continue
                done.append(seq)
        return done

    def _decode(self, seqs: list[Sequence]) -> list[Sequence]:
        start_ns = time.time_ns()
        t0 = time.perf_counter()
        # Never verify past max_tokens: those tokens would be cut anyway.
        caps = [min(self.gamma, s.params.max_tokens - len(s.output_ids) - 1) for s in seqs]
        classes = [request_class(s.params.greedy, s.grammar is not None) for s in seqs]
        rids = [s.request_id for s in seqs]
        fixed = [_fixed_windows(s) for s in seqs] if self.budget is not None else []
        # Which requests the draft runs for: all, or (the adaptive budget) those expected to
        # pay for it. None (or more than speculation.max_batch_size decoding): a plain step,
        # which still captures the taps the draft's context needs.
        if not self.speculative or (self.speculation_max_batch is not None
                                    and len(seqs) > self.speculation_max_batch):
            drafted = []
        elif self.budget is not None:
            drafted = self.budget.to_draft(classes, rids, caps, fixed)
        else:
            drafted = list(range(len(seqs)))
        if not drafted:
            ok = self._plain_decode(seqs, self.speculative, start_ns)
            if self.budget is not None:
                self.budget.step_time(StepShape(len(seqs), len(seqs), 1, 0),
                                      time.perf_counter() - t0)
            return ok
        proposal = self.runner.propose([seqs[b] for b in drafted])
        row = {b: i for i, b in enumerate(drafted)}  # request -> its row of the proposal
        confidence = (proposal.confidence[:, : self.gamma].tolist()
                      if proposal.confidence is not None else None)
        if self.budget is not None:
            # Each request's confidence row (None: not drafted for, its cap is 0).
            by_request = [confidence[row[b]] if confidence is not None and b in row else None
                          for b in range(len(seqs))]
            plan = self.budget.plan(
                classes, rids, by_request if confidence is not None else None,
                [caps[b] if b in row else 0 for b in range(len(seqs))],
                [b in row for b in range(len(seqs))], fixed)
            counts = plan.drafts
        elif self.confidence_threshold > 0 and proposal.confidence is not None:
            counts = survival_draft_count(proposal.confidence[:, : self.gamma],
                                          self.confidence_threshold).tolist()
        else:
            counts = [self.gamma] * len(seqs)
        drafts = [proposal.tokens[row[b], : max(0, min(counts[b], caps[b]))].tolist()
                  if b in row else [] for b in range(len(seqs))]
        windows = [[s.anchor, *d] for s, d in zip(seqs, drafts, strict=True)]
        logits = self.runner.forward(windows, rids, capture=True, verify=True)
        end_ns = time.time_ns()
        ok, lengths, tap_rows = [], [], []
        moved: list[tuple[Sequence, int, int]] = []
        verdicts = verify_windows(
            seqs, [logits[b, : len(d) + 1] for b, d in enumerate(drafts)], drafts,
            [proposal.probs[row[b], : len(d)] if proposal.probs is not None and d else None
             for b, d in enumerate(drafts)], self.residual_rule)
        for b, (seq, verdict) in enumerate(zip(seqs, verdicts, strict=True)):
            k = len(drafts[b])
            if isinstance(verdict, Exception):
                self._isolate(seq, "verifying drafts", verdict)
                continue
            try:
                kept = seq.append(verdict.tokens)
            except Exception as exc:
                self._isolate(seq, "checking stop conditions", exc)
                continue
            seq.stats.record(k, verdict.accepted)
            if self.budget is not None:
                self.budget.verdict(classes[b], seq.request_id,
                                    confidence[row[b]] if confidence and b in row else None,
                                    k, verdict.accepted)
            # Cached now: the anchor and the accepted drafts; the last token is the new anchor.
            start = seq.num_cached
            seq.num_cached += verdict.accepted + 1
            moved.append((seq, start, seq.num_cached))
            ok.append(seq)
            lengths.append(seq.num_cached)
            tap_rows.append(verdict.accepted + 1)
            self._notify("on_decode_step", seq, k, verdict.accepted, len(kept), start_ns,
                         end_ns, True)
        # The same call on every path (with fewer requests when some failed): a failed
        # request's uncommitted verify rows go with its pages when step() frees it.
        self.runner.commit([s.request_id for s in ok], lengths, tap_rows, self._cache_at(moved))
        if self.budget is not None:
            self.budget.step_time(
                StepShape(len(seqs), sum(map(len, windows)), max(map(len, windows)),
                          len(drafted), sum(costly_class(classes[b]) for b in drafted)),
                time.perf_counter() - t0)
        return ok

    def _plain_decode(self, seqs: list[Sequence], plain: bool, start_ns: int
                      ) -> list[Sequence]:
        """One token per request from a target forward of its anchor. `plain`: a speculative
        engine's step without drafts (the draft's context still follows: taps captured, and
        the step counts as a verify of 0 drafts)."""
        rids = [s.request_id for s in seqs]
        logits = self.runner.forward([[s.anchor] for s in seqs], rids, capture=plain)
        end_ns = time.time_ns()
        for seq in seqs:
            seq.num_cached += 1
        cache_at = self._cache_at([(s, s.num_cached - 1, s.num_cached) for s in seqs])
        # The same commit as every other forward's (it rolls nothing back here).
        self.runner.commit(rids, [s.num_cached for s in seqs], [1] * len(seqs), cache_at)
        ok = []
        for b, seq in enumerate(seqs):
            stage = "sampling"
            try:
                token = seq.sample(logits[b, 0])
                stage = "checking stop conditions"
                kept = seq.append([token])
            except Exception as exc:
                self._isolate(seq, stage, exc)
                continue
            if plain:
                seq.stats.record(0, 0)  # a target step that accepted no drafts
            self._notify("on_decode_step", seq, 0, 0, len(kept), start_ns, end_ns, plain)
            ok.append(seq)
        return ok

    def _output(self, seq: Sequence, text: str) -> RequestOutput:
        """`text`: the sequence's text_delta(), taken by step() where a failure is isolated."""
        new_ids = seq.output_ids[seq.reported_tokens :]
        seq.reported_tokens = len(seq.output_ids)
        out = RequestOutput(
            request_id=seq.request_id,
            token_ids=list(new_ids),
            text=text,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            cached_tokens=seq.cached_tokens,
        )
        if seq.finished:
            if self.speculative:
                out.spec = seq.stats.as_dict(len(seq.output_ids))
            out.grammar_closed = seq.grammar is not None and seq.grammar.closed
            self._retire(seq, str(seq.finish_reason))
        return out

    def _cache_at(self, moved: list[tuple[Sequence, int, int]]) -> dict[str, list[int]] | None:
        """For each (sequence, start, end) whose committed length went from start to end, the
        prefix the prefix cache chooses to keep of it (prefix_cache.py); None when none."""
        prefix = self.runner.prefix
        if prefix is None:
            return None
        cache_at = {}
        for seq, start, end in moved:
            line = prefix.cache_point(start, end, len(seq.prompt_ids))
            if line:
                cache_at[seq.request_id] = seq.all_keys[:line]
        return cache_at or None

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
        return {**self.totals.stats(len(self.scheduler.running), self.speculative),
                "waiting": len(self.scheduler.waiting), **self.prefix_cache_stats(),
                **self.grammar_stats(),
                **(self.budget.stats() if self.budget is not None else {})}

    def grammar_stats(self) -> dict[str, Any]:
        """Constrained decoding's work: compiles (and their time), cache hits, refusals, and
        the masks computed on the step loop (and their time); empty without a compiler."""
        if self.grammar is None:
            return {}
        c = self.grammar.stats
        return {"grammar_compiled": c.compiled, "grammar_compile_seconds": c.compile_seconds,
                "grammar_cache_hits": c.cache_hits, "grammar_failed": c.failed,
                "grammar_masks": self.grammars.masks_computed,
                "grammar_mask_seconds": self.grammars.mask_seconds,
                "grammar_closed": self.grammars.requests_closed}

    def prefix_cache_stats(self) -> dict[str, Any]:
        """SGLang-named where SGLang has the number (cache_hit_rate)."""
        prefix = self.runner.prefix
        if prefix is None:
            return {}
        s = prefix.stats
        return {"cache_hit_rate": s["hit_tokens"] / s["query_tokens"] if s["query_tokens"]
                else 0.0, "cached_tokens_total": s["hit_tokens"], "prefix_queries": s["queries"],
                "prefix_cached_pages": prefix.cached_pages, "prefix_snapshots": prefix.snapshots,
                "prefix_evicted_pages": s["evicted_pages"],
                "prefix_evicted_snapshots": s["evicted_snapshots"]}

    def capacity(self) -> dict[str, int]:
        """KV tokens and state slots. Every running request holds one slot (its per-request
        state, where the target has one, and one of the batch's places), taken at admission.
        `kv_tokens_evictable`: of the used tokens, the prefix cache's pages no request uses
        (eviction frees them on demand), so what requests hold is used minus evictable."""
        alloc = self.runner.allocator
        sched = self.scheduler
        prefix = self.runner.prefix
        evictable = 0 if prefix is None else (
            prefix.cached_pages * prefix.page - prefix.pinned_tokens)
        return {
            "kv_tokens_total": alloc.capacity_tokens,
            "kv_tokens_used": alloc.used_tokens,
            "kv_tokens_evictable": evictable,
            "kv_tokens_free": alloc.free_tokens,
            "kv_tokens_reserved": sched.reserved_tokens,
            "state_slots_total": sched.slots_total,
            "state_slots_used": len(sched.running),
            "state_slots_free": sched.slots_total - len(sched.running),
            "state_slots_reserved": len(sched.running),
        }
