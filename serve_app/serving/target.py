"""The target deployment: one replica = one engine = one placement group.

The replica process is rank 0 (it sits in bundle 0, so rank 0 is on the replica's node, as
SGLang's Ray engine also requires). Ranks 1..N-1 are `RankWorker` actors placed bundle by bundle
(one bundle per node), each with one GPU (or one CPU slot locally); together they form the
engine's TP group, and the DSpark draft runs sharded on the same ranks.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serve_app.config import AppConfig
from serve_app.engines.types import EngineUnavailable, GenerateRequest, RequestOutput
from serve_app.netutil import free_port
from serve_app.observability.logs import get_logger, install_trace_ids
from serve_app.observability.metrics import replica_name

logger = get_logger("target")


def _placement_info(rank: int, devices_per_node: int) -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    gpu_ids = [int(g) for g in ray.get_gpu_ids()]
    return {
        "rank": rank,
        "node_id": ctx.get_node_id(),
        "pid": os.getpid(),
        "gpu_ids": gpu_ids,
        # The device this rank drives on its node: its GPU, or its CPU slot locally.
        "device_index": gpu_ids[0] if gpu_ids else rank % devices_per_node,
    }


def _torch_device_setup(config: AppConfig, info: dict[str, Any]) -> None:
    if config.engine.reference.device == "cuda":
        import torch

        # With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES every GPU is visible: pick ours.
        index = info["device_index"] if torch.cuda.device_count() > 1 else 0
        torch.cuda.set_device(index)
    else:
        import torch

        # One intra-op thread per rank on CPU: ranks share the cores.
        torch.set_num_threads(max(1, int(config.placement.cpus_per_rank)))


def _build_runner(config: AppConfig, rank: int, rendezvous: str) -> Any:
    from serve_app.engines.reference.builder import build_runner, init_tensor_parallel

    world = config.parallelism.world_size
    group = init_tensor_parallel(rendezvous, rank, world) if world > 1 else None
    started = time.perf_counter()
    runner = build_runner(config.models.target_path(), config.models.draft_path(),
                          config.engine.reference, rank, world, group)
    logger.info("rank %d/%d: target%s loaded in %.2f s", rank, world,
                " + draft" if runner.proposer else "", time.perf_counter() - started)
    return runner


@ray.remote(max_concurrency=2)
class RankWorker:
    """A follower rank: loads its shards, then mirrors rank 0's operations."""

    def __init__(self, config: dict[str, Any], rank: int) -> None:
        self.config = AppConfig.model_validate(config)
        self.rank = rank
        self.info = _placement_info(rank, self.config.parallelism.devices_per_node)
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def start(self, rendezvous: str) -> dict[str, Any]:
        _torch_device_setup(self.config, self.info)
        runner = _build_runner(self.config, self.rank, rendezvous)

        def follow() -> None:
            try:
                runner.follow()
            except Exception as exc:  # rank 0 gone or a collective failed
                self._error = repr(exc)
                logger.exception("rank %d stopped", self.rank)

        self._thread = threading.Thread(target=follow, name=f"rank-{self.rank}", daemon=True)
        self._thread.start()
        return self.info

    def alive(self) -> bool:
        if self._error is not None:
            raise RuntimeError(f"rank {self.rank} failed: {self._error}")
        return self._thread is not None and self._thread.is_alive()





def _start_reference(config: AppConfig, raw: dict[str, Any]
                     ) -> tuple[Any, list[Any], list[dict[str, Any]]]:
    """Rank 0 here, ranks 1..N-1 as RankWorker actors in the replica's placement group.
    Returns (engine, rank workers, placement of every rank)."""
    par = config.parallelism
    info = [_placement_info(0, par.devices_per_node)]
    pg = get_current_placement_group()
    rendezvous = f"tcp://{ray.util.get_node_ip_address()}:{free_port('')}"
    resources = {"num_gpus": 1} if config.placement.accelerator == "GPU" else {}
    # Named after the replica, so operators can find a replica's ranks in `ray list actors`.
    replica_tag = replica_name()
    workers = [
        RankWorker.options(
            name=f"{replica_tag}-rank{rank}",
            num_cpus=config.placement.cpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=rank // par.devices_per_node,
            ) if pg is not None else None,
            **resources,
        ).remote(raw, rank)
        for rank in range(1, par.world_size)
    ]
    starts = [w.start.remote(rendezvous) for w in workers]
    logger.info("replica: starting %d ranks (%s, %s)", par.world_size, config.strategy,
                config.bundles())
    _torch_device_setup(config, info[0])
    runner = _build_runner(config, 0, rendezvous)
    info += ray.get(starts, timeout=config.engine.startup_timeout_s)

    from serve_app.engines.reference.async_engine import ReferenceAsyncEngine
    from serve_app.engines.reference.builder import build_engine
    from serve_app.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.models.tokenizer_path())
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    core = build_engine(runner, config.engine.reference, eos_token_ids=eos,
                        detokenize=tokenizer.decode)
    if config.engine.max_model_len:
        core.max_model_len = config.engine.max_model_len
    return ReferenceAsyncEngine(core, replica=replica_tag), workers, info


def _start_sglang(config: AppConfig) -> tuple[Any, list[Any], list[dict[str, Any]]]:
    """SGLang's RayEngine in this replica's placement group: rank 0 on this node, one
    scheduler actor per GPU of the bundles. It owns its actors (no RankWorkers here)."""
    from serve_app.engines.sglang import SGLangEngine

    engine = SGLangEngine.start(config)
    info = [_placement_info(0, config.parallelism.devices_per_node)]
    return engine, [], info


class TargetReplica:
    """The body of the target deployment (wrapped with serve.deployment in app.py): it starts
    the configured engine backend and serves the engine interface to the ingress/router."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = AppConfig.model_validate(config)
        install_trace_ids()
        started = time.perf_counter()
        if self.config.engine.backend == "sglang":
            self.engine, self.workers, self.info = _start_sglang(self.config)
        else:
            self.engine, self.workers, self.info = _start_reference(self.config, config)
        logger.info("replica ready in %.2f s: %s", time.perf_counter() - started,
                    self.engine.capacity())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(request):
            yield out

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica."""
        timeout = self.config.engine.health_check_timeout_s
        if self.workers:
            try:
                alive = await asyncio.wait_for(
                    asyncio.gather(*[w.alive.remote() for w in self.workers]), timeout)
            except Exception as exc:
                raise EngineUnavailable(f"a rank worker is gone: {exc!r}") from None
            if not all(alive):
                raise EngineUnavailable("a rank worker stopped following rank 0")
        await self.engine.health(timeout)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def capacity(self) -> dict[str, int]:
        return self.engine.capacity()

    def record_routing_stats(self) -> dict[str, int]:
        """Serve's routing-stats hook; the router reads kv_tokens_total from it when a replica
        appears (serve_app.serving.router)."""
        return self.engine.capacity()

    def placement(self) -> list[dict[str, Any]]:
        return self.info

    def __del__(self) -> None:
        for w in getattr(self, "workers", []):
            ray.kill(w, no_restart=True)
