"""The SGLang 0.5.23 backend: K3 + DSPARK on SGLang's Ray engine, behind the engine interface.

`sglang` itself is imported only inside `SGLangEngine.start`, on GPU nodes (CI has no GPU and
never installs it); the mapping (`args`), the start-up checks (`checks`) and the output
translation (`output`) are pure Python beside it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from serve_app.engines.sglang.args import sampling_params, server_args_cli, sglang_server_args
from serve_app.engines.sglang.checks import startup_problems
from serve_app.engines.sglang.output import OutputTracker
from serve_app.engines.spec_stats import EngineTotals, SpecStats
from serve_app.engines.types import EngineUnavailable, GenerateRequest, RequestOutput
from serve_app.observability.metrics import (
    app_metrics,
    record_finished_request,
    replica_name,
    tags,
)

if TYPE_CHECKING:
    from serve_app.config import AppConfig

logger = logging.getLogger("serve_app.sglang")


class SGLangEngine:
    """One SGLang RayEngine (one target replica) behind the engine interface."""

    def __init__(self, engine: Any, config: AppConfig, server_args: dict[str, Any]) -> None:
        self.engine = engine
        self.config = config
        self.server_args = server_args
        self.speculative = server_args.get("speculative_algorithm") is not None
        self.incremental = bool(server_args.get("incremental_streaming_output"))
        info = engine._scheduler_init_result.scheduler_infos[0]
        # The KV pool SGLang sized after loading the weights (Scheduler.get_init_info).
        self.kv_tokens_total = int(info["max_total_num_tokens"])
        self.max_req_input_len = int(info.get("max_req_input_len") or 0)
        self._active: dict[str, OutputTracker] = {}
        self._totals = EngineTotals()
        self._metric_tags = tags(replica=replica_name())
        metrics = app_metrics()
        if metrics is not None:
            metrics.kv_tokens_capacity.set(self.kv_tokens_total, tags=self._metric_tags)
        self._stopped = False

    @classmethod
    def start(cls, config: AppConfig) -> SGLangEngine:
        """Start SGLang's Ray engine in the current placement group (the replica's). Blocks
        until every scheduler actor has loaded its shards."""
        problems = startup_problems(config)
        if problems:
            raise EngineUnavailable("SGLang start-up checks failed:\n  - "
                                    + "\n  - ".join(problems))
        from ray.util.placement_group import get_current_placement_group

        if get_current_placement_group() is None:
            raise EngineUnavailable("the SGLang backend must run inside the replica's placement "
                                    "group (placement_group_bundles in the deployment)")
        from sglang.srt.ray.engine import RayEngine  # GPU nodes only: the `sglang` extra

        args = sglang_server_args(config)
        logger.info("starting SGLang RayEngine: %s", " ".join(server_args_cli(args)))
        # placement_group=None: RayEngine takes the current group and puts rank 0's node first.
        engine = RayEngine(**args)
        return cls(engine, config, args)

    def _check_alive(self) -> None:
        if self._stopped:
            raise EngineUnavailable("engine is shut down")

    def problem(self) -> str | None:
        """Cheap liveness for GET /health. SGLang's own scheduler watchdog
        (`--watchdog-timeout`) kills a stuck scheduler, which ends its Ray actor; a dead
        scheduler actor fails the real health generation of `check_health`."""
        return "the engine is shut down" if self._stopped else None

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.tokenizer_manager.abort_request(rid=request_id)
        except Exception:  # the engine is already gone; nothing left to free
            logger.exception("abort of %s failed", request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        rid = request.request_id
        if rid in self._active:
            raise ValueError(f"request id {rid!r} is already in use")
        tracker = OutputTracker(rid, len(request.prompt_ids), self.speculative, self.incremental)
        self._active[rid] = tracker
        finished = False
        try:
            # The ingress tokenized already: pass ids, SGLang detokenizes the output.
            stream = await self.engine.async_generate(
                input_ids=list(request.prompt_ids), sampling_params=sampling_params(
                    request.params), stream=True, rid=rid)
            async for chunk in stream:
                out = tracker.update(chunk)
                finished = out.finished
                if finished:
                    self._totals.add_finished(out.prompt_tokens, out.completion_tokens,
                                              SpecStats.from_dict(out.spec) if out.spec else None)
                    # The same per-replica metrics as the reference engine, from meta_info.
                    record_finished_request(out.spec or {}, self._metric_tags)
                yield out
                if finished:
                    return
        finally:
            self._active.pop(rid, None)
            # Client gone (generator closed/cancelled) or an error: free the KV at once.
            if not finished:
                self._abort(rid)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    async def health(self, timeout_s: float) -> None:
        """A real 1-token generation through every TP rank (a dead rank stalls the collective,
        so this times out)."""
        self._check_alive()
        rid = f"health-{uuid.uuid4().hex[:12]}"

        async def one_token() -> None:
            out = await self.engine.async_generate(
                input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0,
                                                "ignore_eos": True}, stream=False, rid=rid)
            meta = out.get("meta_info", {})
            if meta.get("completion_tokens") != 1:
                raise EngineUnavailable(f"health generation returned {meta}")

        try:
            await asyncio.wait_for(one_token(), timeout_s)
        except TimeoutError:
            self._abort(rid)
            raise EngineUnavailable(f"health generation took longer than {timeout_s} s") from None

    def stats(self) -> dict[str, Any]:
        return {**self._totals.stats(len(self._active), self.speculative), "backend": "sglang"}

    def capacity(self) -> dict[str, int]:
        """KV tokens: the pool SGLang reported after start-up; 'used' counts the tokens of the
        requests this replica has in flight (prompt + generated so far), an upper bound on
        what they hold, since SGLang's prefix cache shares pages."""
        used = sum(t.prompt_tokens + len(t.token_ids) for t in self._active.values())
        used = min(used, self.kv_tokens_total)
        return {
            "kv_tokens_total": self.kv_tokens_total,
            "kv_tokens_used": used,
            "kv_tokens_free": self.kv_tokens_total - used,
            "max_req_input_len": self.max_req_input_len,
        }

    async def shutdown(self) -> None:
        self._stopped = True
        for rid in list(self._active):
            self._abort(rid)
        # Kills the scheduler actors and frees the GPUs.
        await asyncio.to_thread(self.engine.shutdown)
