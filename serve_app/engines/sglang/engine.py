"""The SGLang 0.5.23 backend: K3 + DSPARK on SGLang's Ray engine, behind the engine interface.

`sglang` itself is imported only inside `SGLangEngine.start`, on GPU nodes (CI has no GPU and
never installs it); the mapping (`args`), the start-up checks (`checks`) and the output
translation (`output`) are pure Python beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from serve_app.engines.interface import Engine
from serve_app.engines.sglang.args import sampling_params, server_args_cli, sglang_server_args
from serve_app.engines.sglang.checks import startup_problems
from serve_app.engines.sglang.kv_events import (
    KVEventSubscriber,
    free_port_range,
    learn_sentinels,
    start_subscriber,
)
from serve_app.engines.sglang.media import K3MediaIds, collapse_image_prompt, image_data
from serve_app.engines.sglang.output import OutputTracker
from serve_app.engines.spec_stats import EngineTotals, SpecStats
from serve_app.netutil import free_port
from serve_app.observability.metrics import (
    app_metrics,
    record_finished_request,
    replica_name,
    tags,
)
from serve_app.protocol.generation import (
    EngineUnavailable,
    GenerateRequest,
    RequestOutput,
    Role,
    SamplingParams,
)
from serve_app.protocol.media import ImageInput

if TYPE_CHECKING:
    from serve_app.config import AppConfig

logger = logging.getLogger("serve_app.sglang")

# SGLang 0.5.23's srt/disaggregation/utils.py: a request with this bootstrap host is moved by
# the fake transfer backend (no peer), as its /health_generate does on PD servers.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def sglang_inputs(prompt_ids: Sequence[int], images: Sequence[ImageInput],
                  ids: K3MediaIds | None,
                  expand: Callable[[list[int], Sequence[ImageInput]], list[int]] | None = None
                  ) -> dict[str, Any]:
    """The `async_generate` inputs of a prompt: its ids as they are without images; with
    images, the ids collapsed to one `<|media_pad|>` per image and the images' PNGs
    (serve_app/engines/sglang/media.py has the reasons, from SGLang's source). `expand`:
    SGLang's own expansion of collapsed ids (its K3 processor's), which must give `prompt_ids`
    back, token for token, or the request is refused here (ValueError) rather than prefilled
    with another prompt than the one counted."""
    if not images:
        return {"input_ids": list(prompt_ids)}
    if ids is None:
        raise ValueError("this SGLang server has no K3 image processor (a checkpoint without "
                         "vision_config, or the tower disabled): it cannot take images")
    collapsed = collapse_image_prompt(prompt_ids, images, ids)
    if expand is not None and expand(collapsed, images) != list(prompt_ids):
        raise ValueError("SGLang's K3 processor would expand this prompt's images to other ids "
                         "than the ingress rendered (the image framing differs)")
    return {"input_ids": collapsed, "image_data": image_data(images)}


def _k3_media(engine: Any) -> tuple[K3MediaIds | None,
                                   Callable[[list[int], Sequence[ImageInput]], list[int]] | None]:
    """This server's K3 image processor, as `sglang_inputs` uses it: the media ids its
    tokenizer gives (`_encode_k3_special_tokens`, 0.5.23 multimodal/processors/kimi_k3.py:
    72-78) and its expansion (`_expand_k3_image_prompt_token_ids`, :81-127) with the token
    counts its NaViT resize gives each image's size (`navit_resize_config`, kimi_k25.py:34-74,
    the same call as kimi_k3.py:222-232). (None, None) when the server has no K3 processor."""
    processor = getattr(engine.tokenizer_manager, "mm_processor", None)
    if processor is None:
        return None, None
    from sglang.srt.multimodal.processors import kimi_k3  # GPU nodes only

    if not isinstance(processor, kimi_k3.KimiK3ImageProcessor):
        return None, None
    tokenizer = processor._tokenizer
    ids = K3MediaIds.from_encode(
        lambda text: kimi_k3._encode_k3_special_tokens(tokenizer, text))
    if ids.pad != processor.mm_tokens.image_token_id:
        raise EngineUnavailable("the served tokenizer's <|media_pad|> is not the checkpoint's "
                                "media_placeholder_token_id")
    config = processor._processor.preprocess_config

    def expand(collapsed: list[int], images: Sequence[ImageInput]) -> list[int]:
        counts = [kimi_k3.navit_resize_config(
            i.width, i.height, config.patch_size, config.merge_kernel_size,
            config.in_patch_limit, config.patch_limit_on_one_side,
            config.fixed_output_tokens)["num_tokens"] for i in images]
        return kimi_k3._expand_k3_image_prompt_token_ids(
            collapsed, ids.pad, counts, [(i.width, i.height) for i in images],
            tokenizer).flatten().tolist()

    return ids, expand


def _bootstrap(handoff: SGLangHandoff) -> dict[str, Any]:
    """The request fields that put a request in its prefill server's room, on both sides."""
    return {"bootstrap_host": handoff.bootstrap_host, "bootstrap_port": handoff.bootstrap_port,
            "bootstrap_room": handoff.bootstrap_room}


def slot_bound(info: dict[str, Any], server_args: dict[str, Any],
               internal_states: list[dict[str, Any]] | None = None) -> int | None:
    """SGLang's state-slot bound, the requests it runs at once (`max_running_requests`), as
    the server resolved it. SGLang 0.5.23's scheduler info (`Scheduler.get_init_info`:
    max_total_num_tokens, max_req_input_len, ...) does not carry it; its internal state does
    (`effective_max_running_requests_per_dp`, one state per DP rank, from the worker's memory
    plan), read once the engine answers. In that order: the scheduler info (should a version
    add it), the internal states' sum, the configured `max_running_requests`; None when none is
    known (the router then treats the replica as unbounded in slots)."""
    if info.get("max_running_requests"):
        return int(info["max_running_requests"])
    per_dp = [int(s["effective_max_running_requests_per_dp"]) for s in internal_states or ()
              if s.get("effective_max_running_requests_per_dp")]
    if per_dp:
        return sum(per_dp)
    configured = server_args.get("max_running_requests")
    return int(configured) if configured else None


def capacity_report(kv_tokens_total: int, kv_tokens_used: int, state_slots_total: int | None,
                    in_flight: int, max_req_input_len: int) -> dict[str, int]:
    """The engine interface's capacity() from what this backend knows: KV tokens of the
    requests in flight (an upper bound: SGLang's prefix cache shares pages) and one state slot
    per request in flight (running or in SGLang's own waiting queue: either way a router must
    not send more). SGLang does not expose its reservations, so reserved = used. With no slot
    bound known the state_slots_* keys are left out: the router then treats the replica as
    unbounded in slots, as it does an engine that predates them."""
    used = min(kv_tokens_used, kv_tokens_total)
    report = {
        "kv_tokens_total": kv_tokens_total,
        "kv_tokens_used": used,
        "kv_tokens_free": kv_tokens_total - used,
        "kv_tokens_reserved": used,
        "max_req_input_len": max_req_input_len,
    }
    if state_slots_total is not None:
        report |= {"state_slots_total": state_slots_total,
                   "state_slots_used": in_flight,
                   "state_slots_free": max(state_slots_total - in_flight, 0),
                   "state_slots_reserved": in_flight}
    return report


@dataclass(frozen=True)
class SGLangHandoff:
    """What a PD prefill replica hands the decode side for one request: the request, and
    where its prefill server waits for the decode server (SGLang's bootstrap: this replica's
    node, its bootstrap port, and a room number for this request). The caches move from
    server to server (the transfer backend), never through Ray."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    # The decode server tokenizes the same request (its K3 processor expands the same ids
    # from the same PNGs, so both sides hold prompts of one length); the patches stay behind.
    images: tuple[ImageInput, ...] = ()


class SGLangEngine(Engine):
    """One SGLang RayEngine (one target replica) behind the engine interface; in a
    disaggregated app, one side's server (`role`: SGLang's --disaggregation-mode)."""

    supports_handoff = True

    def __init__(self, engine: Any, config: AppConfig, server_args: dict[str, Any],
                 kv_events: KVEventSubscriber | None = None) -> None:
        self.engine = engine
        self.role = server_args.get("disaggregation_mode", "both")
        # Prefill side: requests whose prefill server waits for (or sends to) a decode server.
        self._prefills: dict[str, asyncio.Task[None]] = {}
        # SGLang's KV events, translated onto the router's block hashes (prefix_events).
        self.kv_events = kv_events
        self.config = config
        self.server_args = server_args
        self.speculative = server_args.get("speculative_algorithm") is not None
        self.incremental = bool(server_args.get("incremental_streaming_output"))
        info = engine._scheduler_init_result.scheduler_infos[0]
        # The KV pool SGLang sized after loading the weights (Scheduler.get_init_info).
        self.kv_tokens_total = int(info["max_total_num_tokens"])
        self.max_req_input_len = int(info.get("max_req_input_len") or 0)
        # Until the scheduler's internal state answers (_resolve_slots): the configured bound.
        self._scheduler_info = info
        self.state_slots_total = slot_bound(info, server_args)
        self._slots_resolved = False
        self._active: dict[str, OutputTracker] = {}
        self._totals = EngineTotals()
        self._metric_tags = tags(replica=replica_name())
        metrics = app_metrics()
        if metrics is not None:
            metrics.kv_tokens_capacity.set(self.kv_tokens_total, tags=self._metric_tags)
        self._export_slots()
        self._stopped = False
        # Images: SGLang's media ids and its K3 expansion (its processor's own functions),
        # and the images of requests whose sentinels are being learned (kv_events doc).
        self.media_ids, self._expand = _k3_media(engine)
        self._learning: dict[str, tuple[ImageInput, ...]] = {}
        self._learn_sentinels_from(engine)

    def _learn_sentinels_from(self, engine: Any) -> None:
        """Wrap this server's K3 processor (it runs in this process: RayEngine's tokenizer
        manager, tokenizer_manager.py:1202-1208) so that each image request's pad sentinels
        are learned from its output, before the scheduler sees the request."""
        processor = getattr(engine.tokenizer_manager, "mm_processor", None)
        if processor is None or self.kv_events is None:
            return
        process = processor.process_mm_data_async

        async def process_and_learn(*args: Any, **kwargs: Any) -> Any:
            out = await process(*args, **kwargs)
            rid = getattr(kwargs.get("request_obj"), "rid", None)
            images = self._learning.pop(rid, None) if isinstance(rid, str) else None
            if images and self.kv_events is not None and out is not None:
                learn_sentinels(self.kv_events.translator.images,
                                getattr(out, "mm_items", None) or (), images)
            return out

        processor.process_mm_data_async = process_and_learn

    def _export_slots(self) -> None:
        metrics = app_metrics()
        if metrics is None:
            return
        if self.state_slots_total is not None:
            metrics.state_slots_total.set(self.state_slots_total, tags=self._metric_tags)
        metrics.running_requests.set(len(self._active), tags=self._metric_tags)

    async def _resolve_slots(self) -> None:
        """Once: max_running_requests as the schedulers resolved it (SGLang lowers it to what
        its memory plan holds), from their internal state. A failure keeps the configured
        bound and is tried again on the next request."""
        if self._slots_resolved:
            return
        self._slots_resolved = True
        try:
            states = await asyncio.wait_for(
                self.engine.tokenizer_manager.get_internal_state(), 10.0)
        except Exception:  # the schedulers are busy or gone: keep what is known, retry later
            self._slots_resolved = False
            logger.exception("max_running_requests not read from the scheduler state")
            return
        self.state_slots_total = slot_bound(self._scheduler_info, self.server_args, states)
        logger.info("state slots (max_running_requests): %s", self.state_slots_total)
        self._export_slots()

    @classmethod
    def start(cls, config: AppConfig, role: Role = "both") -> SGLangEngine:
        """Start SGLang's Ray engine in the current placement group (the replica's). Blocks
        until every scheduler actor has loaded its shards. `role`: a disaggregated app's
        side."""
        problems = startup_problems(config, role=role)
        if problems:
            raise EngineUnavailable("SGLang start-up checks failed:\n  - "
                                    + "\n  - ".join(problems))
        from ray.util.placement_group import get_current_placement_group

        # Outside Ray there is no placement group; asking for one would start a local cluster.
        if not ray.is_initialized() or get_current_placement_group() is None:
            raise EngineUnavailable("the SGLang backend must run inside the replica's placement "
                                    "group (placement_group_bundles in the deployment)")
        from sglang.srt.ray.engine import RayEngine  # GPU nodes only: the `sglang` extra

        subscriber, port = cls._kv_events(config)
        # A prefill server's bootstrap server runs in this process (SGLang's tokenizer
        # manager): a free port here unless the config fixes one.
        bootstrap = (config.disaggregation.bootstrap_port or free_port("")
                     if role == "prefill" else None)
        args = sglang_server_args(config, kv_events_port=port, role=role,
                                  bootstrap_port=bootstrap)
        if subscriber is None:
            args.pop("kv_events_config", None)  # nobody would read them
        logger.info("starting SGLang RayEngine: %s", " ".join(server_args_cli(args)))
        # placement_group=None: RayEngine takes the current group and puts rank 0's node first.
        try:
            engine = RayEngine(**args)
        except BaseException:
            if subscriber is not None:
                subscriber.stop()
            raise
        return cls(engine, config, args, subscriber)

    @staticmethod
    def _kv_events(config: AppConfig) -> tuple[KVEventSubscriber | None, int | None]:
        """The KV event subscriber, connected before SGLang starts (so that no batch is
        missed), and the publisher's port. RayEngine runs the rank-0 scheduler (attn-TP rank
        0, the KV publisher) on this replica's node (`_find_engine_bundle`), so it binds
        loopback at a port picked free here; attention-DP rank r binds port + r (ranks on
        another node are not reached: their events are not followed)."""
        s = config.engine.sglang
        if not s.kv_events:
            return None, None
        ranks = max(1, config.parallelism.attention_dp)
        port = s.kv_events_port or free_port_range(ranks)
        subscriber = start_subscriber(
            config.router.block_size, [f"tcp://127.0.0.1:{port + r}" for r in range(ranks)])
        return subscriber, port

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
        async for out in self._stream(request):
            yield out

    async def prefill(self, request: GenerateRequest) -> SGLangHandoff:
        """A PD prefill server's part of `request`, answered at once: the hand-over names this
        server's bootstrap and a new room. SGLang's prefill keeps the request in its bootstrap
        queue until the decode server that `adopt`s the hand-over joins the room, then
        prefills and sends the caches, KDA states and the draft's KV to it (its transfer
        backend). So the request runs here in the background until that transfer ends; it
        counts in capacity() meanwhile. A decode server that never comes: SGLang's bootstrap
        timeout aborts it."""
        self._check_alive()
        handoff = SGLangHandoff(request.request_id, list(request.prompt_ids), request.params,
                                ray.util.get_node_ip_address(),
                                int(self.server_args["disaggregation_bootstrap_port"]),
                                secrets.randbits(63),
                                tuple(dataclasses.replace(i, patches=None)
                                      for i in request.images))
        task = asyncio.get_running_loop().create_task(self._prefill(request, handoff))
        self._prefills[request.request_id] = task
        task.add_done_callback(lambda _: self._prefills.pop(request.request_id, None))
        return handoff

    async def _prefill(self, request: GenerateRequest, handoff: SGLangHandoff) -> None:
        try:
            async for _ in self._stream(request, **_bootstrap(handoff)):
                pass
        except Exception:  # the decode side reports the request's failure to its client
            logger.exception("PD prefill of %s failed", request.request_id)

    async def adopt(self, handoff: SGLangHandoff) -> AsyncIterator[RequestOutput]:
        """A PD decode server's part: the request joins its prefill server's room, SGLang
        receives the caches into pages it pre-allocated and decodes; the stream carries the
        whole answer from the first token (sampled on the prefill side)."""
        request = GenerateRequest(handoff.request_id, handoff.prompt_ids, handoff.params,
                                  images=handoff.images)
        async for out in self._stream(request, **_bootstrap(handoff)):
            yield out

    async def _stream(self, request: GenerateRequest, **bootstrap: Any
                      ) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        rid = request.request_id
        if rid in self._active:
            raise ValueError(f"request id {rid!r} is already in use")
        await self._resolve_slots()
        inputs = sglang_inputs(request.prompt_ids, request.images, self.media_ids,
                               self._expand)
        tracker = OutputTracker(rid, len(request.prompt_ids), self.speculative, self.incremental)
        self._active[rid] = tracker
        self._export_slots()
        finished = False
        try:
            if request.images:
                self._learning[rid] = tuple(request.images)
            # The ingress tokenized already: pass ids (and images, `sglang_inputs`), SGLang
            # detokenizes the output.
            stream = await self.engine.async_generate(
                **inputs, sampling_params=sampling_params(request.params), stream=True,
                rid=rid, **bootstrap)
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
            self._learning.pop(rid, None)
            self._export_slots()
            # Client gone (generator closed/cancelled) or an error: free the KV at once.
            if not finished:
                self._abort(rid)

    async def abort(self, request_id: str) -> None:
        task = self._prefills.pop(request_id, None)
        if task is not None:
            task.cancel()
        self._abort(request_id)

    async def health(self, timeout_s: float) -> None:
        """A real 1-token generation through every TP rank (a dead rank stalls the collective,
        so this times out)."""
        self._check_alive()
        rid = f"health-{uuid.uuid4().hex[:12]}"

        async def one_token() -> None:
            # A PD server is asked as SGLang's own /health_generate asks it: through its
            # fake transfer (FAKE_BOOTSTRAP_HOST), which needs no server on the other side.
            pd = {} if self.role == "both" else {"bootstrap_host": FAKE_BOOTSTRAP_HOST,
                                                 "bootstrap_room": 0}
            out = await self.engine.async_generate(
                input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0,
                                                "ignore_eos": True}, stream=False, rid=rid,
                **pd)
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
        what they hold, since SGLang's prefix cache shares pages. State slots: SGLang's
        max_running_requests, one per request in flight (`capacity_report`)."""
        used = sum(t.prompt_tokens + len(t.token_ids) for t in self._active.values())
        return capacity_report(self.kv_tokens_total, used, self.state_slots_total,
                               len(self._active), self.max_req_input_len)

    def prefix_events(self, since: int) -> dict[str, Any] | None:
        """SGLang's radix-cache events from `since` on, as router block hashes: {next, events,
        held (every block, only when events were lost)}; None without a running subscriber
        (engine.sglang.kv_events off, or no pyzmq/msgspec)."""
        if self.kv_events is None or not self.kv_events.running:
            return None
        return self.kv_events.translator.state(since)

    async def shutdown(self) -> None:
        self._stopped = True
        for task in list(self._prefills.values()):
            task.cancel()
        if self.kv_events is not None:
            self.kv_events.stop()
        for rid in list(self._active):
            self._abort(rid)
        # Kills the scheduler actors and frees the GPUs.
        await asyncio.to_thread(self.engine.shutdown)
