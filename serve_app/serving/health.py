"""GET /health's answer: a target replica's own account of itself."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray.serve.handle import DeploymentHandle

from serve_app.observability.logs import get_logger

logger = get_logger("ingress")


class HealthProbe:
    """GET /health: a target replica's own account of itself (its engine loop, watchdog and
    ranks; a disaggregated app's decode replica answers for the prefill side it sends to
    as well), cached briefly so that probes stay cheap. No answer within the timeout (no
    replica running, all stuck) is a 503."""

    def __init__(self, target: DeploymentHandle, cache_s: float, timeout_s: float) -> None:
        self.target = target
        self.cache_s = cache_s
        self.timeout_s = timeout_s
        self._at = -1e9
        self._problem: str | None = "not checked yet"
        self._lock = asyncio.Lock()

    async def problem(self) -> str | None:
        async with self._lock:
            if time.monotonic() - self._at > self.cache_s:
                self._problem = await self._ask(self.target)
                self._at = time.monotonic()
            return self._problem

    async def _ask(self, target: DeploymentHandle) -> str | None:
        # A probe that lands on a broken replica while another is healthy asks again: the
        # answer is "can any replica serve", not "is the first one fine".
        problem = None
        deadline = time.monotonic() + self.timeout_s
        for _ in range(3):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            response = target.health_status.remote()
            try:
                status = await asyncio.wait_for(_result(response), left)
            except TimeoutError:
                response.cancel()
                return f"no target replica answered within {self.timeout_s:g} s"
            except Exception as exc:
                logger.warning("health probe failed", exc_info=exc)
                problem = "no target replica is reachable"
                continue
            if status.get("ok"):
                return None
            problem = str(status.get("problem") or "the target replica is unhealthy")
        return problem


async def _result(response: Any) -> Any:
    return await response
