"""The target deployments' Serve autoscaling policy: Serve's AutoscalingContext -> the pure
policy (serve_app.routing.autoscaling.decide) -> Serve's target replica count, with the
decision and its reason in the policy state, the controller's log and the metrics. Serve
applies the bounds (min / max replicas) and the upscale / downscale delays around it.

It runs in Serve's controller, once per deployment: `policy_kwargs` are the deployment's
AutoscalingSettings (app.py writes them from `placement.autoscaling`).
"""

from __future__ import annotations

import logging
from typing import Any

from serve_app.observability.metrics import app_metrics
from serve_app.routing.autoscaling import Decision, ReplicaLoad, decide, decision_record
from serve_app.routing.settings import AutoscalingSettings

logger = logging.getLogger("serve_app.autoscaling")


class LedgerPolicy:
    """Serve's class-callable policy: one instance per deployment in the controller."""

    def __init__(self, **settings: Any) -> None:
        self.settings = AutoscalingSettings(**settings)
        self._last: tuple[int, str] | None = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        by_replica: dict[Any, dict[str, float]] = {}
        for name, values in (ctx.aggregated_metrics or {}).items():
            for replica, value in values.items():
                by_replica.setdefault(replica, {})[name] = value
        loads = [ReplicaLoad.from_metrics(m) for m in by_replica.values()]
        decision = decide(self.settings, ctx.current_num_replicas, ctx.target_num_replicas,
                          loads)
        self._report(ctx.deployment_name, ctx.current_num_replicas, decision)
        state = dict(ctx.policy_state or {})
        state["decision"] = decision_record(decision)
        return decision.replicas, state

    def _report(self, deployment: str, running: int, decision: Decision) -> None:
        if (decision.replicas, decision.reason) != self._last:
            self._last = (decision.replicas, decision.reason)
            logger.info("autoscaling %s: %d running -> %d (%s) %s", deployment, running,
                        decision.replicas, decision.reason,
                        {k: round(v, 3) for k, v in decision.load.items()})
        metrics = app_metrics()
        if metrics is None:
            return
        try:
            t = {"deployment": deployment}
            metrics.autoscaling_desired_replicas.set(decision.replicas, tags=t)
            metrics.autoscaling_running_replicas.set(running, tags=t)
            metrics.autoscaling_decisions.inc(tags={**t, "reason": decision.reason})
        except Exception:  # metrics must never stop a scaling decision
            logger.exception("autoscaling metrics not exported")
