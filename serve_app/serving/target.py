"""The target deployment: one replica = one engine = one placement group.

The replica process is rank 0 (it sits in bundle 0, so rank 0 is on the replica's node, as
SGLang's Ray engine also requires). Ranks 1..N-1 are `RankWorker` actors placed bundle by bundle
(one bundle per node), each with one GPU (or one CPU slot locally); together they form the
engine's TP group, and the DSpark draft runs sharded on the same ranks.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import ray
import ray.exceptions
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serve_app.config import AppConfig, context_length
from serve_app.engines.interface import Engine
from serve_app.netutil import free_port
from serve_app.observability.logs import get_logger, install_trace_ids
from serve_app.observability.metrics import app_metrics, replica_name
from serve_app.protocol.generation import (
    EngineUnavailable,
    GenerateRequest,
    Moved,
    Prefilled,
    RequestOutput,
    Role,
)
from serve_app.protocol.media import cache_keys
from serve_app.routing.reservation import ReplicaFull, ReplicaLedger, Reservation
from serve_app.serving.dispatch import Dispatcher, serve_caller
from serve_app.serving.errors import error_for
from serve_app.serving.health import HealthProbe
from serve_app.serving.leaving import replica_stopping

logger = get_logger("target")

# How often a replica with requests in flight checks whether Serve is stopping it.
LEAVING_POLL_S = 0.1
# A caller's queue report older than this is dropped from the autoscaling reports (callers
# ask every second while they route, every 0.2 s while a request waits).
CALLER_LOAD_TTL_S = 10.0


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
                     ) -> tuple[Engine, list[Any], list[dict[str, Any]]]:
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
    from serve_app.tokenizer import load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(config.models.tokenizer_path())
    core = build_engine(runner, config.engine.reference, eos_token_ids=stop_token_ids(tokenizer),
                        detokenize=tokenizer.decode, tokenizer=tokenizer,
                        max_model_len=context_length(config))
    engine = ReferenceAsyncEngine(core, replica=replica_tag,
                                  watchdog_s=config.engine.step_watchdog_s)
    return engine, workers, info


def _start_sglang(config: AppConfig, role: Role
                  ) -> tuple[Engine, list[Any], list[dict[str, Any]]]:
    """SGLang's RayEngine in this replica's placement group: rank 0 on this node, one
    scheduler actor per GPU of the bundles. It owns its actors (no RankWorkers here).
    `role`: a disaggregated app's side (SGLang's --disaggregation-mode)."""
    from serve_app.engines.sglang.engine import SGLangEngine

    engine = SGLangEngine.start(config, role)
    info = [_placement_info(0, config.parallelism.devices_per_node)]
    return engine, [], info


class TargetReplica:
    """The body of the target deployment (wrapped with serve.deployment in app.py): it starts
    the configured engine backend and serves the engine interface to the ingress/router."""

    def __init__(self, config: dict[str, Any], role: Role = "both",
                 prefill: DeploymentHandle | None = None) -> None:
        """`role`: "both" (prefill and decode), or a side of a disaggregated app: "prefill"
        (prefills and exports each request: `generate` answers with a `Prefilled`) or
        "decode" (`generate` has each request prefilled on the `prefill` deployment, adopts
        the hand-over and streams the answer: this side orchestrates, the ingress fronts it
        alone)."""
        self.role = role
        self.config = AppConfig.model_validate(config)
        install_trace_ids()
        started = time.perf_counter()
        self.engine: Engine
        if self.config.engine.backend == "sglang":
            self.engine, self.workers, self.info = _start_sglang(self.config, role)
        else:
            self.engine, self.workers, self.info = _start_reference(self.config, config)
        self.replica = replica_name()
        self._status_at = -1e9
        self._status: dict[str, Any] = {}
        self._last_check_problem: str | None = None
        # Requests by the ingress actor that sent them, and the tasks serving them: if that
        # actor dies, nobody reads the tokens, so the work is aborted (see _watch_callers).
        self._by_caller: dict[tuple[str, str], dict[str, asyncio.Task[Any]]] = {}
        self._watcher: asyncio.Task[None] | None = None
        # The authoritative reservation ledger of the requests this replica accepted, from
        # every ingress (docs/router.md, "Several ingress replicas"); only with the router's
        # capacity admission (kv_aware): other policies let the engine queue, as before.
        self.ledger: ReplicaLedger | None = None
        settings = self.config.admission()
        if settings is not None and settings.policy == "kv_aware":
            kv, slots = _totals(self.engine.capacity())
            self.ledger = ReplicaLedger(settings.block_size, settings.share_prefix, kv, slots)
        # A decode replica's own dispatcher to the prefill side (its admission stage prices
        # prefill replicas against this node), and that side's health for GET /health.
        self.prefill: Dispatcher | None = None
        self.prefill_health: HealthProbe | None = None
        # Leaving (Serve stops it: a scale-down, a redeploy; or `drain`): it takes nothing
        # new, and its running requests move to other replicas (docs/runbook.md
        # "Autoscaling"). Watched while requests are in flight (`_watch_stop`).
        self.draining = False
        self.moved_out = 0
        self._stop_watch: asyncio.Task[None] | None = None
        # Each caller's last queue and TTFT report (`routing_info`), with when it came.
        self._caller_loads: dict[str, tuple[float, dict[str, Any]]] = {}
        # A decode replica's requests still at the prefill side (queued or prefilling there),
        # with the KV tokens each reserved here: that wait is the prefill pool's load, which
        # its own reports carry (record_autoscaling_stats).
        self._at_prefill: dict[str, int] = {}
        if role == "decode":
            if prefill is None:
                raise ValueError("a decode replica needs the prefill deployment's handle")
            if not self.engine.supports_handoff:
                raise EngineUnavailable(f"the {self.config.engine.backend} engine cannot adopt "
                                        "hand-overs")
            ing = self.config.ingress
            self.prefill = Dispatcher(prefill, settings, serve_caller(), ing.health_timeout_s)
            # Half the ingress's probe timeout: this replica's answer to the ingress, which
            # waits for the prefill side's, must come within the ingress's.
            self.prefill_health = HealthProbe(prefill, ing.health_cache_s,
                                              ing.health_timeout_s / 2)
        logger.info("replica ready in %.2f s: %s", time.perf_counter() - started,
                    self.engine.capacity())

    def _replica_id(self) -> str:
        return serve.get_replica_context().replica_id.unique_id

    async def generate(self, request: GenerateRequest, reservation: Reservation | None = None,
                       handoff: Any = None) -> AsyncIterator[RequestOutput | Prefilled | Moved]:
        """Reserve the request on this replica's ledger (the facts its caller's admission
        stage computed, or the same facts computed here for a call that carries none), then
        stream its outputs; released exactly once when the request ends here, however it
        ends (finished, failed, aborted, moved, its caller gone). Refused before any engine
        work with ReplicaFull, which carries this ledger's numbers. A prefill replica answers
        with one `Prefilled` (or the final output of a request that ended on its first
        token); a decode replica has the request prefilled there first (`_prefilled_there`).
        `handoff`: a request that moved here from a leaving replica (its engine's hand-over),
        which goes on from where it was. A leaving replica's streams end with `Moved`, which
        the caller's dispatcher follows to another replica."""
        caller = request.caller
        if self.draining:
            yield Moved(request.request_id, handoff)
            return
        # A prefill replica samples one token of each request.
        max_tokens = 1 if self.role == "prefill" else request.params.max_tokens
        self._reserve(request.request_id, caller, reservation,
                      cache_keys(request.prompt_ids, request.images), max_tokens)
        self._track(caller, request.request_id)
        self._watch_leaving()
        try:
            if handoff is not None:
                stream = self.engine.adopt(handoff)
            elif self.role == "both":
                stream = self.engine.generate(request)
            elif self.role == "decode":
                stream = self._prefilled_there(request)
            else:
                yield await self._prefill(request)
                return
            async for out in stream:
                if isinstance(out, Moved):
                    self._count_move()
                yield out
        finally:
            self._release(caller, request.request_id)

    async def _prefill(self, request: GenerateRequest) -> RequestOutput | Prefilled:
        """A prefill replica's answer: the hand-over, put into this process's object store
        (the decode replica fetches it from here, and the tokens go from there to the
        ingress, past this replica, busy prefilling other prompts), or the final output of a
        request that ended on its first token."""
        result = await self.engine.prefill(request)
        if isinstance(result, RequestOutput):
            return result
        return Prefilled(request.request_id, ray.put(result))

    async def _prefilled_there(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """A decode replica's request: admitted on the prefill side (one token, priced
        against this node), prefilled there, its hand-over adopted here and the answer
        streamed from its first token. A failure there reaches the client as the OpenAI
        error it is (a full prefill queue is a 429, a lost hand-over a 503)."""
        assert self.prefill is not None
        rid = request.request_id
        there = replace(request, caller=self.prefill.caller, replica=None)
        self._at_prefill[rid] = len(request.prompt_ids) + request.params.max_tokens
        try:
            lease = await self.prefill.dispatch(there, 1, near=self.info[0]["node_id"])
        except Exception as exc:
            raise error_for(exc, self.config.ingress.retry_after_s, rid) from None
        finally:
            self._at_prefill.pop(rid, None)
        first = lease.first
        lease.close()  # the prefill replica has let the request go
        if isinstance(first, RequestOutput):  # it ended on its first token
            yield first
            return
        async for out in self.engine.adopt(await fetch_handoff(first)):
            yield out

    # --- leaving ------------------------------------------------------------------------------

    def _watch_leaving(self) -> None:
        """While requests are in flight, watch for Serve stopping this replica (its graceful
        shutdown waits for them, but nothing tells the replica: `replica_stopping`)."""
        if self._stop_watch is None or self._stop_watch.done():
            self._stop_watch = asyncio.get_running_loop().create_task(self._watch_stop())

    async def _watch_stop(self) -> None:
        while not self.draining and (self._by_caller or self._busy()):
            if replica_stopping():
                await self.drain()
                return
            await asyncio.sleep(LEAVING_POLL_S)

    async def drain(self) -> int:
        """Leave: take nothing new (every later call answers `Moved` at once, and the
        routers read no capacity here), and move every running request to other replicas
        (an engine without `supports_migration` finishes them here, within Serve's
        graceful_shutdown_timeout_s). Serve stopping the replica calls it; so can an
        operator. Returns how many requests moved."""
        if self.draining:
            return 0
        self.draining = True
        moved = 0
        if self.engine.supports_migration and self.role != "prefill":
            try:
                moved = await self.engine.evacuate()
            except EngineUnavailable as exc:  # a failed engine: its streams have ended already
                logger.warning("replica leaving with its engine down (%s): nothing to move", exc)
        logger.info("replica leaving: %d running requests moved to other replicas", moved)
        return moved

    async def dispatch_view(self) -> dict[str, Any]:
        """This replica's own dispatcher's view (a decode replica's, to the prefill side),
        for the ingress's /v1/router; None without one."""
        view = await self.prefill.view() if self.prefill is not None else None
        return {"replica": self._replica_id(), "view": view}

    def _reserve(self, request_id: str, caller: tuple[str, str] | None,
                 reservation: Reservation | None, prompt_keys: list[int], max_tokens: int
                 ) -> None:
        """Reserve a request on this replica's ledger: the facts its ingress computed, or for
        a call that carries none (sent by Serve's own routing) the same facts computed here
        (`prompt_keys`: the prompt's `cache_keys`, as the ingress's stage keys it).
        Refused before any engine work with ReplicaFull, which carries this ledger's numbers
        and this replica's id."""
        if self.ledger is None:
            return
        r = reservation or self.ledger.reservation_for(prompt_keys, max_tokens)
        try:
            self.ledger.reserve(request_id, caller[1] if caller else "", r)
        except ReplicaFull as exc:
            exc.info["replica"] = self._replica_id()
            raise

    def _release(self, caller: tuple[str, str] | None, request_id: str) -> None:
        """The request has ended here, however it ended: its reservation and its caller's
        watch go, once."""
        if self.ledger is not None:
            self.ledger.release(request_id)
        self._untrack(caller, request_id)

    def _track(self, caller: tuple[str, str] | None, request_id: str) -> None:
        """Serve `request_id` for `caller` (an actor): its task is cancelled if that actor
        dies (`_watch_callers`)."""
        task = asyncio.current_task()
        if caller is not None and task is not None:
            self._by_caller.setdefault(caller, {})[request_id] = task
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.get_running_loop().create_task(self._watch_callers())

    def _untrack(self, caller: tuple[str, str] | None, request_id: str) -> None:
        if caller is not None:
            mine = self._by_caller.get(caller, {})
            mine.pop(request_id, None)
            if not mine:
                self._by_caller.pop(caller, None)

    async def _watch_callers(self) -> None:
        """Once a second, while requests are in flight: is each sending ingress still alive?
        A dead one's requests are cancelled (their generators abort them in the engine)."""
        while self._by_caller:
            await asyncio.sleep(1.0)
            for caller in list(self._by_caller):
                if await asyncio.to_thread(_actor_alive, *caller):
                    continue
                tasks = self._by_caller.pop(caller, {})
                logger.warning("ingress %s is gone: aborting its %d requests", caller[1],
                               len(tasks))
                for task in tasks.values():
                    task.cancel()

    async def health_status(self) -> dict[str, Any]:
        """What GET /health reports: cheap (no generation), cached for a second. Problems:
        the engine's own (loop dead, a step past the watchdog, failed), a rank worker gone,
        or the last real health generation failed."""
        if time.monotonic() - self._status_at > 1.0:
            problem = self.engine.problem() or await self._rank_problem(timeout_s=2.0)
            problem = problem or self._last_check_problem
            if problem is None and self.prefill_health is not None:
                # A decode replica serves nothing while no prefill replica can: say so, but
                # only here (Serve's check_health must not replace it for its peers' fault).
                there = await self.prefill_health.problem()
                problem = f"prefill side: {there}" if there is not None else None
            self._status = {"ok": problem is None, "problem": problem, "replica": self.replica}
            self._status_at = time.monotonic()
        return self._status

    async def _rank_problem(self, timeout_s: float) -> str | None:
        if not self.workers:
            return None
        try:
            alive = await asyncio.wait_for(
                asyncio.gather(*[w.alive.remote() for w in self.workers]), timeout_s)
        except TimeoutError:
            return "a rank worker did not answer"
        except Exception:
            logger.exception("rank worker check failed")
            return "a rank worker is gone"
        if not all(alive):
            return "a rank worker stopped following rank 0"
        return None

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica. A real 1-token
        generation when the engine is idle; under load, the engine's progress (its watchdog)
        is the evidence, since a probe queued behind long prefills would time out on a
        healthy replica."""
        timeout = self.config.engine.health_check_timeout_s
        problem = self.engine.problem() or await self._rank_problem(timeout)
        if problem is None and not self._busy():
            try:
                await self.engine.health(timeout)
            except EngineUnavailable as exc:
                problem = str(exc)
        self._last_check_problem = problem
        self._status_at = -1e9  # the next /health probe sees this at once
        if problem is not None:
            raise EngineUnavailable(problem)

    def _busy(self) -> bool:
        stats = self.engine.stats()
        return bool(stats.get("running") or stats.get("waiting"))

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def capacity(self) -> dict[str, int]:
        return self.engine.capacity()

    def routing_info(self, prefix_since: dict[str, int] | None = None,
                     caller_load: dict[str, Any] | None = None) -> dict[str, Any]:
        """Who this replica is (Serve's unique id, as the request router sees it) and its
        capacity (KV tokens and state slots), and its ledger's reservations across every
        ingress: the router's admission stage asks every replica for it
        (serve_app.routing.admission). With a prefix cache, also its events since
        `prefix_since[this replica]` (the caller's read position; one dict for a broadcast).
        `caller_load`: the asking caller's queue and TTFT (Dispatcher.load_report), kept for
        this replica's autoscaling reports."""
        if caller_load:
            self._caller_loads[str(caller_load.get("caller", ""))] = (time.monotonic(),
                                                                       caller_load)
        engine_cap = self.engine.capacity()
        cap = engine_cap
        if self.draining:  # leaving: the routers send nothing more here
            cap = {**cap, "kv_tokens_total": 0, "state_slots_total": 0, "draining": True}
        me = self._replica_id()
        # Its node: a disaggregated pair on one node hands over through that node's object
        # store (the router prices a pair across nodes: RouterSettings.handoff_cost).
        info: dict[str, Any] = {"replica": me, "node": self.info[0]["node_id"], **cap}
        prefix = self.engine.prefix_events((prefix_since or {}).get(me, 0))
        if prefix is not None:
            info["prefix"] = prefix
        if self.ledger is not None:
            # The authoritative reservations, from every ingress (and each one's share): the
            # ingresses' hint of each other's load.
            self.ledger.set_capacity(*_totals(engine_cap))
            info["ledger"] = self.ledger.report()
        return info

    def placement(self) -> list[dict[str, Any]]:
        return self.info

    def _count_move(self) -> None:
        self.moved_out += 1
        metrics = app_metrics()
        if metrics is not None:
            metrics.requests_moved.inc(tags={"replica": self.replica})

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler gets from this replica every metrics_interval_s, for the
        deployment's policy (serve_app/routing/autoscaling.py, which names them in
        METRICS): its ledger's reservations against its capacity (the engine's own counts
        without a ledger), and its callers' queues and TTFT as they last reported them
        (reports older than CALLER_LOAD_TTL_S are dropped: a caller that stopped asking has
        nothing waiting). A decode replica leaves out the requests still at the prefill side
        (prompt + max_tokens each; where the ledger charged a shared prefix once, that
        leaves out more than they hold, never less): a queue of long prompts is the prefill
        pool's to scale for, and more decode replicas would only hold more of them waiting."""
        cap = self.engine.capacity()
        kv_total, slots_total = _totals(cap)
        if self.ledger is not None:
            ledger = self.ledger.report()
            kv, slots = ledger["kv_tokens_committed"], ledger["state_slots_reserved"]
            kv = max(0, kv - sum(self._at_prefill.values()))
            slots = max(0, slots - len(self._at_prefill))
        else:
            kv = cap.get("kv_tokens_reserved", cap.get("kv_tokens_used", 0))
            slots = cap.get("state_slots_used", 0)
        now = time.monotonic()
        for caller, (at, _) in list(self._caller_loads.items()):
            if now - at > CALLER_LOAD_TTL_S:
                del self._caller_loads[caller]
        loads = [load for _, load in self._caller_loads.values()]
        return {
            "kv_committed": float(kv), "kv_total": float(kv_total),
            "slots_reserved": float(slots), "slots_total": float(slots_total or 0),
            "queued": float(sum(x.get("queued", 0) for x in loads)),
            "queued_tokens": float(sum(x.get("queued_tokens", 0) for x in loads)),
            "oldest_wait_s": float(max((x.get("oldest_wait_s", 0.0) for x in loads),
                                       default=0.0)),
            "ttft_p90_s": float(max((x.get("ttft_p90_s", 0.0) for x in loads), default=0.0)),
            "draining": 1.0 if self.draining else 0.0,
        }

    def holdings(self) -> dict[str, Any]:
        """What this replica still holds: its ledger's reservations and its engine's running
        requests and slots (all 0 once a leaving replica's requests have moved or ended),
        and how many requests moved out."""
        ledger = self.ledger.report() if self.ledger is not None else {}
        stats, cap = self.engine.stats(), self.engine.capacity()
        return {"kv_tokens_committed": ledger.get("kv_tokens_committed", 0),
                "state_slots_reserved": ledger.get("state_slots_reserved", 0),
                "running": stats.get("running", 0), "waiting": stats.get("waiting", 0),
                "state_slots_used": cap.get("state_slots_used", 0),
                # The prefix cache's idle pages are not held by any request.
                "kv_tokens_held": cap.get("kv_tokens_used", 0) - cap.get("kv_tokens_evictable", 0),
                "moved_out": self.moved_out}

    def __del__(self) -> None:
        # Serve calls this after the graceful shutdown's wait: the line operators (and
        # tests/test_autoscaling_serve.py) read to see that a leaving replica let go of
        # everything.
        if getattr(self, "engine", None) is not None:
            try:
                logger.info("replica left, holding %s", json.dumps(self.holdings()))
            except Exception:
                logger.exception("replica left; its holdings could not be read")
        for w in getattr(self, "workers", []):
            ray.kill(w, no_restart=True)


async def fetch_handoff(prefilled: Prefilled) -> Any:
    """The hand-over a prefill replica put into its object store: fetched from there (Ray
    moves it between the nodes), or EngineUnavailable when its owner died first (retryable:
    the client gets a 503)."""
    try:
        return await prefilled.handoff
    except ray.exceptions.ObjectLostError:  # the prefill replica, its owner, is gone
        raise EngineUnavailable("the prefill replica that held the request's hand-over is "
                                "gone; retry") from None


def _totals(cap: dict[str, int]) -> tuple[int, int | None]:
    slots = cap.get("state_slots_total")
    return int(cap["kv_tokens_total"]), None if slots is None else int(slots)


def _actor_alive(namespace: str, name: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:  # no live actor has that name any more
        return False
    except Exception:  # the GCS is busy or unreachable: do not abort on a guess
        return True
    return True
