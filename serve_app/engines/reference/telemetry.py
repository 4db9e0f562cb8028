"""Spans and metrics of the reference engine, from its observer hooks (engine thread).

Per request, under the replica span Ray Serve opened for the call:
  engine.request            (arrival at the engine -> last token)
    engine.queue            (arrival -> KV admission)
    engine.prefill_chunk    (one per chunk: positions, tokens)
    engine.decode           (first decode step -> finish; steps and tokens aggregated)
      engine.verify         (one per speculative step: drafted, accepted, committed tokens)
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span

from serve_app.engines.reference.observer import StepReport
from serve_app.engines.reference.sequence import Sequence
from serve_app.observability.metrics import app_metrics, record_finished_request, tags
from serve_app.observability.tracing import tracer


class _RequestSpans:
    def __init__(self, root: Span) -> None:
        self.root = root
        self.ctx = trace.set_span_in_context(root)
        self.queue: Span | None = None
        self.decode: Span | None = None
        self.decode_ctx: Any = None
        self.decode_steps = 0
        self.queued_ns = 0


class EngineTelemetry:
    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.metrics = app_metrics()
        self._tags = tags(replica=replica)
        self._parents: dict[str, Any] = {}
        self._spans: dict[str, _RequestSpans] = {}
        self._lock = threading.Lock()
        self._tracer = tracer()

    def attach(self, request_id: str) -> None:
        """Called on the event loop, in the request's context: remember its trace parent."""
        with self._lock:
            self._parents[request_id] = otel_context.get_current()

    # --- EngineObserver ---------------------------------------------------------------------

    def on_queued(self, seq: Sequence, at_ns: int) -> None:
        with self._lock:
            parent = self._parents.pop(seq.request_id, None)
        root = self._tracer.start_span("engine.request", context=parent, start_time=at_ns,
                                       attributes={"request_id": seq.request_id,
                                                   "prompt_tokens": len(seq.prompt_ids),
                                                   "max_tokens": seq.params.max_tokens,
                                                   "temperature": seq.params.temperature})
        spans = _RequestSpans(root)
        spans.queued_ns = at_ns
        spans.queue = self._tracer.start_span("engine.queue", context=spans.ctx,
                                              start_time=at_ns)
        self._spans[seq.request_id] = spans

    def on_admitted(self, seq: Sequence, at_ns: int) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        wait_s = (at_ns - spans.queued_ns) / 1e9
        if spans.queue is not None:
            spans.queue.set_attribute("queue_wait_s", wait_s)
            spans.queue.end(end_time=at_ns)
            spans.queue = None
        if self.metrics:
            self.metrics.queue_time.observe(wait_s, tags=self._tags)

    def on_prefill_chunk(self, seq: Sequence, start: int, end: int, start_ns: int,
                         end_ns: int) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        chunk = self._tracer.start_span("engine.prefill_chunk", context=spans.ctx,
                                        start_time=start_ns,
                                        attributes={"start": start, "end": end,
                                                    "tokens": end - start,
                                                    "prompt_tokens": len(seq.prompt_ids)})
        chunk.end(end_time=end_ns)

    def on_decode_step(self, seq: Sequence, drafted: int, accepted: int, committed: int,
                       start_ns: int, end_ns: int, speculative: bool) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        if spans.decode is None:
            spans.decode = self._tracer.start_span("engine.decode", context=spans.ctx,
                                                   start_time=start_ns)
            spans.decode_ctx = trace.set_span_in_context(spans.decode)
        spans.decode_steps += 1
        if speculative:
            step = self._tracer.start_span(
                "engine.verify", context=spans.decode_ctx, start_time=start_ns,
                attributes={"drafted": drafted, "accepted": accepted, "committed": committed,
                            "step": spans.decode_steps})
            step.end(end_time=end_ns)

    def on_finished(self, seq: Sequence, at_ns: int) -> None:
        spans = self._spans.pop(seq.request_id, None)
        completion = len(seq.output_ids)
        spec = seq.stats.as_dict(completion) if seq.stats.verify_ct else {}
        if spans is not None:
            if spans.queue is not None:
                spans.queue.end(end_time=at_ns)
            if spans.decode is not None:
                spans.decode.set_attribute("steps", spans.decode_steps)
                spans.decode.set_attribute("completion_tokens", completion)
                spans.decode.end(end_time=at_ns)
            root = spans.root
            root.set_attribute("completion_tokens", completion)
            root.set_attribute("finish_reason", seq.finish_reason or "")
            for key in ("spec_accept_length", "spec_accept_rate", "spec_verify_ct"):
                if key in spec:
                    root.set_attribute(key, spec[key])
            root.end(end_time=at_ns)
        record_finished_request(spec, self._tags)

    def on_step(self, report: StepReport) -> None:
        if not self.metrics:
            return
        m, t = self.metrics, self._tags
        capacity = report.capacity
        m.queue_requests.set(report.waiting, tags=t)
        m.running_requests.set(report.running, tags=t)
        m.kv_tokens_used.set(capacity["kv_tokens_used"], tags=t)
        m.kv_tokens_capacity.set(capacity["kv_tokens_total"], tags=t)
        m.token_usage.set(capacity["kv_tokens_used"] / capacity["kv_tokens_total"], tags=t)
        if capacity.get("state_slots_total") is not None:  # in use: running_requests above
            m.state_slots_total.set(capacity["state_slots_total"], tags=t)
        cache = report.prefix_cache
        if cache:
            m.cache_hit_rate.set(cache["cache_hit_rate"], tags=t)
            m.cached_tokens.set(cache["cached_tokens_total"], tags=t)
            m.cache_snapshots.set(cache["prefix_snapshots"], tags=t)
            m.cache_evictions.set(cache["prefix_evicted_pages"], tags={**t, "kind": "page"})
            m.cache_evictions.set(cache["prefix_evicted_snapshots"],
                                  tags={**t, "kind": "snapshot"})
        if report.spec_accept_rate is not None:
            m.spec_accept_rate.set(report.spec_accept_rate, tags=t)
        grammar = report.grammar
        if grammar:
            for outcome, key in (("compiled", "grammar_compiled"), ("failed", "grammar_failed"),
                                 ("cache_hit", "grammar_cache_hits")):
                m.grammar_compiles.set(grammar[key], tags={**t, "outcome": outcome})
            m.grammar_compile_seconds.set(grammar["grammar_compile_seconds"], tags=t)
            m.grammar_mask_seconds.set(grammar["grammar_mask_seconds"], tags=t)
            m.grammar_masks.set(grammar["grammar_masks"], tags=t)
            m.grammar_closed.set(grammar["grammar_closed"], tags=t)
