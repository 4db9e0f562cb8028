"""Prometheus metrics through Ray's metrics API.

Why Ray's API rather than an OpenTelemetry Prometheus exporter per process: Ray aggregates
every process of a node (ingress, replicas, rank workers) behind the node's one metrics
endpoint, which the cluster's Prometheus already scrapes; per-process exporters would need a
port per replica and service discovery for each. Ray prefixes every name with `ray_`.

Names follow SGLang's where the meaning is the same (`sglang:spec_accept_length` ->
`ray_kimi_spec_accept_length`, ...); see docs/observability.md for the full list.
"""

from __future__ import annotations

import threading
from typing import Any

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0]
_TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5]
_ACCEPT_BUCKETS = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0,
                   16.0]


class AppMetrics:
    """Every metric of the app, created once per process (Ray must be initialised)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        model = ("model",)
        replica = ("replica",)
        # Request level (ingress), SGLang names.
        self.time_to_first_token = Histogram(
            "kimi_time_to_first_token_seconds", "Time to first token (ingress view).",
            boundaries=_LATENCY_BUCKETS, tag_keys=model)
        self.time_per_output_token = Histogram(
            "kimi_time_per_output_token_seconds", "Time per output token after the first.",
            boundaries=_TPOT_BUCKETS, tag_keys=model)
        self.e2e_latency = Histogram(
            "kimi_e2e_request_latency_seconds", "End-to-end request latency (ingress view).",
            boundaries=_LATENCY_BUCKETS, tag_keys=model)
        self.prompt_tokens = Counter("kimi_prompt_tokens_total", "Prompt tokens processed.",
                                     tag_keys=model)
        self.generation_tokens = Counter("kimi_generation_tokens_total",
                                         "Completion tokens returned.", tag_keys=model)
        self.requests = Counter("kimi_num_requests_total", "Requests by final HTTP status.",
                                tag_keys=("model", "status"))
        # Engine level (target replica).
        self.queue_requests = Gauge("kimi_num_queue_reqs", "Requests waiting for KV admission.",
                                    tag_keys=replica)
        self.running_requests = Gauge("kimi_num_running_reqs", "Requests admitted (prefilling "
                                      "or decoding).", tag_keys=replica)
        self.queue_time = Histogram("kimi_queue_time_seconds", "Wait from arrival at the "
                                    "engine to KV admission.", boundaries=_LATENCY_BUCKETS,
                                    tag_keys=replica)
        self.kv_tokens_used = Gauge("kimi_kv_tokens_used", "KV tokens in use.",
                                    tag_keys=replica)
        self.kv_tokens_capacity = Gauge("kimi_max_total_num_tokens", "KV token capacity.",
                                        tag_keys=replica)
        self.token_usage = Gauge("kimi_token_usage", "KV tokens used / capacity.",
                                 tag_keys=replica)
        # State slots: one per running request (the K3 hybrid's KDA states, any engine's
        # max running requests); in use = kimi_num_running_reqs.
        self.state_slots_total = Gauge("kimi_max_running_requests", "State slots: requests "
                                       "the engine can run at once (SGLang's resolved "
                                       "max_running_requests; the reference engine's batch "
                                       "bound or KDA state pool).", tag_keys=replica)
        # Prefix cache (SGLang's names where it has them: cache_hit_rate).
        self.cache_hit_rate = Gauge("kimi_cache_hit_rate", "Prefix cache: prompt tokens served "
                                    "from the cache / prompt tokens, over the replica's "
                                    "lifetime (sglang:cache_hit_rate).", tag_keys=replica)
        self.cached_tokens = Gauge("kimi_cached_tokens_total", "Prefix cache: prompt tokens "
                                   "served from the cache so far.", tag_keys=replica)
        self.cache_snapshots = Gauge("kimi_cache_state_snapshots", "Prefix cache: KDA state "
                                     "snapshots held (the hybrid's resumable positions).",
                                     tag_keys=replica)
        self.cache_evictions = Gauge("kimi_cache_evicted_total", "Prefix cache: evictions so "
                                     "far, of KV pages and of state snapshots.",
                                     tag_keys=("replica", "kind"))
        self.spec_accept_length = Histogram(
            "kimi_spec_accept_length", "Per finished request: completion tokens per verify "
            "step, bonus included (SGLang's spec_accept_length).", boundaries=_ACCEPT_BUCKETS,
            tag_keys=replica)
        self.spec_accept_rate = Gauge("kimi_spec_accept_rate", "Accepted / proposed drafts, "
                                      "over the replica's lifetime.", tag_keys=replica)
        self.spec_verify_calls = Counter("kimi_spec_verify_calls_total", "Verify steps.",
                                         tag_keys=replica)
        self.spec_drafts = Counter("kimi_spec_draft_tokens_total", "Drafts by outcome.",
                                   tag_keys=("replica", "outcome"))
        # Constrained decoding (the reference engine's grammar compiler and matchers).
        self.grammar_compiles = Gauge("kimi_grammar_compiles_total", "Grammars compiled so far, "
                                      "by outcome (compiled, failed: a 400) and cache hits.",
                                      tag_keys=("replica", "outcome"))
        self.grammar_compile_seconds = Gauge("kimi_grammar_compile_seconds_total", "Time spent "
                                             "compiling grammars so far (off the step loop).",
                                             tag_keys=replica)
        self.grammar_mask_seconds = Gauge("kimi_grammar_mask_seconds_total", "Time the step "
                                          "loop spent computing token masks so far (every "
                                          "sampled, drafted and verified position of a "
                                          "constrained request).", tag_keys=replica)
        self.grammar_masks = Gauge("kimi_grammar_masks_total", "Token masks computed so far.",
                                   tag_keys=replica)
        self.grammar_closed = Gauge("kimi_grammar_closed_total", "Constrained answers closed "
                                    "before max_tokens so far (grammar_budget: close).",
                                    tag_keys=replica)
        # Router.
        self.router_decisions = Counter("kimi_router_decisions_total", "Routing decisions by "
                                        "reason.", tag_keys=("reason",))
        self.router_state_slots_reserved = Gauge(
            "kimi_router_state_slots_reserved", "State slots the router has reserved on a "
            "replica (its in-flight requests, one each), per ingress.", tag_keys=replica)
        self.router_kv_tokens_committed = Gauge(
            "kimi_router_kv_tokens_committed", "KV tokens the router has committed on a "
            "replica (prompt + max_tokens of its in-flight requests), per ingress.",
            tag_keys=replica)
        # Autoscaling (Serve's controller runs the policy; a leaving replica counts its moves).
        deployment = ("deployment",)
        self.autoscaling_desired_replicas = Gauge(
            "kimi_autoscaling_desired_replicas", "Replicas the autoscaling policy asks for "
            "(before Serve's bounds and delays).", tag_keys=deployment)
        self.autoscaling_running_replicas = Gauge(
            "kimi_autoscaling_running_replicas", "Replicas serving, as the policy saw them.",
            tag_keys=deployment)
        self.autoscaling_decisions = Counter(
            "kimi_autoscaling_decisions_total", "Policy decisions by reason (kv, slots, "
            "queue_wait, ttft, underused, within_band, starting, no_reports).",
            tag_keys=("deployment", "reason"))
        self.requests_moved = Counter(
            "kimi_requests_moved_total", "Running requests a leaving replica (scaled down, "
            "restarted) moved to another.", tag_keys=replica)


_metrics: AppMetrics | None = None
_lock = threading.Lock()


def app_metrics() -> AppMetrics | None:
    """The process's metrics, or None outside Ray (unit tests of the engine alone)."""
    global _metrics
    if _metrics is None:
        import ray

        if not ray.is_initialized():
            return None
        with _lock:
            if _metrics is None:
                _metrics = AppMetrics()
    return _metrics


def replica_name() -> str:
    """The Serve replica this process is (a metric label and an actor-name prefix)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:  # outside a Serve replica (tests, benchmarks)
        import os

        return f"local-{os.getpid()}"


def tags(**values: Any) -> dict[str, str]:
    return {k: str(v) for k, v in values.items()}


def record_finished_request(spec: dict[str, Any], replica_tags: dict[str, str]) -> None:
    """A finished request's speculative statistics (SGLang's names, as both backends report
    them in RequestOutput.spec) into the replica's metrics."""
    m = app_metrics()
    if m is None or not spec or not spec.get("spec_verify_ct"):
        return
    m.spec_accept_length.observe(spec["spec_accept_length"], tags=replica_tags)
    m.spec_verify_calls.inc(spec["spec_verify_ct"], tags=replica_tags)
    accepted = spec["spec_accepted_drafts"]
    rejected = spec["spec_proposed_drafts"] - accepted
    if accepted:
        m.spec_drafts.inc(accepted, tags={**replica_tags, "outcome": "accepted"})
    if rejected:
        m.spec_drafts.inc(rejected, tags={**replica_tags, "outcome": "rejected"})
