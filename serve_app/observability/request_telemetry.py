"""One request's span, metrics and closing log line, as the ingress sees it."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace

from serve_app.observability.logs import get_logger
from serve_app.observability.metrics import app_metrics
from serve_app.observability.tracing import tracer

logger = get_logger("ingress")


class RequestTelemetry:
    """One request's span, metrics and closing log line (the ingress view: arrival to last
    token, as the client sees it). Labels carry the server's own names only: a client's
    `model` string never becomes a metric series."""

    def __init__(self, endpoint: str, model: str) -> None:
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.model = model
        self.span = tracer().start_span("ingress.request",
                                        attributes={"endpoint": endpoint, "model": model})
        self._done = False

    def active(self) -> Any:
        """Make the span current, so handle calls made inside carry it to the replicas."""
        return trace.use_span(self.span, end_on_exit=False)

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def finish(self, status: int, prompt_tokens: int = 0, completion_tokens: int = 0,
               end: float | None = None) -> None:
        """`end`: when the answer was complete, if this runs later (perf_counter)."""
        if self._done:
            return
        self._done = True
        end = end or time.perf_counter()
        e2e = end - self.started
        ttft = (self.first_token_at - self.started) if self.first_token_at else None
        m = app_metrics()
        if m is not None:
            t = {"model": self.model}
            m.requests.inc(1, tags={**t, "status": str(status)})
            if status == 200:
                m.e2e_latency.observe(e2e, tags=t)
                m.prompt_tokens.inc(prompt_tokens, tags=t)
                if completion_tokens:
                    m.generation_tokens.inc(completion_tokens, tags=t)
                if ttft is not None:
                    m.time_to_first_token.observe(ttft, tags=t)
                    if completion_tokens > 1:
                        m.time_per_output_token.observe(
                            (e2e - ttft) / (completion_tokens - 1), tags=t)
        self.span.set_attribute("status", status)
        self.span.set_attribute("prompt_tokens", prompt_tokens)
        self.span.set_attribute("completion_tokens", completion_tokens)
        if ttft is not None:
            self.span.set_attribute("ttft_s", ttft)
        with self.active():
            logger.info("request finished: status %d, %d prompt + %d completion tokens, "
                        "%.1f ms", status, prompt_tokens, completion_tokens, e2e * 1e3,
                        extra={"status": status, "prompt_tokens": prompt_tokens,
                               "completion_tokens": completion_tokens,
                               "e2e_ms": round(e2e * 1e3, 2)})
        self.span.end()
