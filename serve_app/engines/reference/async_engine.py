"""The reference backend behind the async engine interface.

The step loop runs in one thread (it holds the GIL only between torch kernels); requests,
aborts and outputs cross into it through a locked inbox and out through each request's asyncio
queue, so the event loop of the Serve replica never waits for a forward pass.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.types import (
    EngineUnavailable,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
)
from serve_app.models.kv_cache import KVCapacityError

logger = logging.getLogger(__name__)


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class ReferenceAsyncEngine:
    def __init__(self, core: EngineCore, replica: str = "local") -> None:
        from serve_app.observability.engine_telemetry import EngineTelemetry

        self.core = core
        self.telemetry = EngineTelemetry(replica)
        core.observer = self.telemetry
        self._inbox: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._failure: BaseException | None = None
        self._stopping = False
        self._health_ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.core.has_work:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.core.step():
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
        except BaseException as exc:  # a dead rank, a CUDA error: fail everything in flight
            logger.exception("engine loop failed")
            self._failure = exc
            for stream in self._streams.values():
                stream.put(EngineUnavailable(f"engine failed: {exc!r}"))
            self._streams.clear()

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for op, arg in inbox:
            if op == "add":
                request, stream = arg
                try:
                    self.core.add_request(request.prompt_ids, request.params, request.request_id)
                except (ValueError, KVCapacityError) as exc:  # refused: nothing was queued
                    stream.put(exc)
                    self._streams.pop(request.request_id, None)
            elif op == "abort":
                self.core.abort(arg)
                self._streams.pop(arg, None)

    def _send(self, op: str, arg: Any) -> None:
        with self._lock:
            self._inbox.append((op, arg))
        self._wake.set()

    # --- the interface --------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise EngineUnavailable(f"engine failed: {self._failure!r}")
        if self._stopping or not self._thread.is_alive():
            raise EngineUnavailable("engine is shut down")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request.request_id] = stream
        self.telemetry.attach(request.request_id)  # the caller's trace becomes the parent
        self._send("add", (request, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # Client gone (cancelled) or consumer stopped early: free the cache at once.
            if not finished:
                self._send("abort", request.request_id)

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    async def health(self, timeout_s: float) -> None:
        """A real 1-token generation through every rank."""
        self._check_alive()
        rid = f"health-{next(self._health_ids)}"
        prompt = [(self.core.eos_token_ids and min(self.core.eos_token_ids)) or 0]

        async def one_token() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            async for out in self.generate(GenerateRequest(rid, prompt, params)):
                if out.finished and out.completion_tokens != 1:
                    raise EngineUnavailable(f"health generation returned {out.completion_tokens} "
                                            "tokens")

        try:
            await asyncio.wait_for(one_token(), timeout_s)
        except TimeoutError:
            raise EngineUnavailable(f"health generation took longer than {timeout_s} s") from None

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def capacity(self) -> dict[str, int]:
        return self.core.capacity()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 30)
        for stream in self._streams.values():
            stream.put(EngineUnavailable("engine is shut down"))
        self._streams.clear()
        self.core.runner.shutdown()
