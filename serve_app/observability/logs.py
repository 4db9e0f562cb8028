"""Replica logs as JSON lines carrying the request id (Ray Serve adds it) and the trace id.

Ray Serve writes a replica's `ray.serve` logger to its log file, as JSON when the deployment's
`logging_config.encoding` is JSON, with every non-standard record attribute as a field; so the
app logs under `ray.serve.serve_app.*` and a handler filter adds `trace_id`/`span_id`.
"""

from __future__ import annotations

import logging

from serve_app.observability.tracing import current_ids


class TraceIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        trace_id, span_id = current_ids()
        if trace_id is not None:
            record.trace_id = trace_id
            record.span_id = span_id
        return True


def get_logger(component: str) -> logging.Logger:
    """A logger whose lines land in the replica's Serve log file."""
    return logging.getLogger(f"ray.serve.serve_app.{component}")


def install_trace_ids() -> None:
    """Add trace ids to every line the replica's Serve handlers write (idempotent)."""
    for handler in logging.getLogger("ray.serve").handlers:
        if not any(isinstance(f, TraceIdFilter) for f in handler.filters):
            handler.addFilter(TraceIdFilter())
