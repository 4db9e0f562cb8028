"""Traces (OpenTelemetry through Ray Serve's hooks), Prometheus metrics (Ray's metrics API) and
JSON logs with request and trace ids. See docs/observability.md."""
