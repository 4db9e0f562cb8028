"""OpenTelemetry tracing, wired through Ray Serve's own tracing hooks.

Ray Serve creates the proxy span (`proxy_http_request`, honouring an incoming W3C
`traceparent`) and one span per replica call, and carries the context across handles. It does
so in every process that has `RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH` set, which must be in the
environment of every node before Ray starts (`tracing_config` alone reaches replicas only, not
the proxy, and the trace id would not be carried from the client). That variable names
`serve_app.observability.tracing:span_processors`, which builds the exporter chosen by our own
variables:

  SERVE_APP_TRACE_EXPORTER   none | console | otlp_grpc | otlp_http | collector
  SERVE_APP_OTLP_ENDPOINT    the collector address for OTLP (e.g. http://otel:4318/v1/traces)
  RAY_SERVE_TRACING_SAMPLING_RATIO   0..1 (Ray's own; parent-based)

`tracing_env(config)` turns the config tree's `observability.tracing` into those variables.
The app's spans (ingress, router, engine) are children of Ray Serve's spans.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from pydantic import BaseModel, ConfigDict, Field

EXPORTER_ENV = "SERVE_APP_TRACE_EXPORTER"
ENDPOINT_ENV = "SERVE_APP_OTLP_ENDPOINT"
COLLECTOR_ACTOR = "serve_app_span_collector"
IMPORT_PATH = "serve_app.observability.tracing:span_processors"

Exporter = Literal["none", "console", "otlp_grpc", "otlp_http", "collector"]


class TracingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    exporter: Exporter = "none"
    endpoint: str | None = Field(default=None, description="OTLP collector address")
    sampling_ratio: float = Field(default=1.0, ge=0.0, le=1.0)


def tracing_env(config: TracingConfig) -> dict[str, str]:
    """Environment every Ray node needs (set before `ray start` / `ray.init`)."""
    if config.exporter == "none":
        return {}
    env = {"RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH": IMPORT_PATH,
           "RAY_SERVE_TRACING_SAMPLING_RATIO": str(config.sampling_ratio),
           EXPORTER_ENV: config.exporter}
    if config.endpoint:
        env[ENDPOINT_ENV] = config.endpoint
    return env


class SpanStore:
    """In-memory store of finished spans, run as one named Ray actor (see CollectorExporter)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def add(self, spans: list[dict[str, Any]]) -> None:
        self.spans.extend(spans)

    def get(self) -> list[dict[str, Any]]:
        return list(self.spans)

    def clear(self) -> None:
        self.spans.clear()


def collector_actor() -> Any:
    """The cluster's span store (created on first use)."""
    import ray

    return ray.remote(SpanStore).options(  # type: ignore[attr-defined]
        name=COLLECTOR_ACTOR, namespace="serve_app", get_if_exists=True, lifetime="detached",
        num_cpus=0).remote()


class CollectorExporter(SpanExporter):
    """Ships finished spans to the span store actor, so the spans of every process (proxy,
    ingress, target replicas) can be read in one place: tests and debugging."""

    def __init__(self) -> None:
        self._actor: Any = None

    def export(self, spans: Any) -> SpanExportResult:
        if self._actor is None:
            self._actor = collector_actor()
        self._actor.add.remote([span_to_dict(s) for s in spans])
        return SpanExportResult.SUCCESS


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
    }


def span_processors() -> list[SpanProcessor]:
    """Ray Serve's exporter hook (RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH points here; Serve
    insists that it takes no arguments)."""
    kind = os.environ.get(EXPORTER_ENV, "console")
    endpoint = os.environ.get(ENDPOINT_ENV) or None
    if kind == "none":
        return []
    if kind == "console":
        return [SimpleSpanProcessor(ConsoleSpanExporter())]
    if kind == "collector":
        return [SimpleSpanProcessor(CollectorExporter())]
    if kind == "otlp_grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return [BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))]
    if kind == "otlp_http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        return [BatchSpanProcessor(HTTPSpanExporter(endpoint=endpoint))]
    raise ValueError(f"{EXPORTER_ENV}={kind!r}; allowed: none, console, otlp_grpc, otlp_http, "
                     "collector")


def tracer() -> trace.Tracer:
    return trace.get_tracer("serve_app")


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[trace.Span]:
    """A child of the current span (a no-op span when tracing is off)."""
    with tracer().start_as_current_span(name) as current:
        for key, value in attributes.items():
            if value is not None:
                current.set_attribute(key, value)
        yield current


def current_ids() -> tuple[str | None, str | None]:
    """(trace id, span id) of the current span, hex, or Nones when not tracing."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None, None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
