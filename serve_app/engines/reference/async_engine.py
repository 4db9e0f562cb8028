"""The reference backend behind the async engine interface.

The step loop runs in one thread (it holds the GIL only between torch kernels); requests,
aborts and outputs cross into it through a locked inbox and out through each request's asyncio
queue, so the event loop of the Serve replica never waits for a forward pass.

Failures come in two sizes. A request whose own processing failed (its output carries `error`)
ends its stream with RequestFailed; everything else carries on. An exception out of a step is
an engine fault (a dead rank, a CUDA error): every stream, and every later call, gets
EngineUnavailable and the health check fails, so Serve replaces the replica. A step that never
returns (a stopped rank leaves a collective waiting forever, and a thread stuck in one cannot be
interrupted) is caught by the watchdog thread, which fails the engine the same way. Messages
given to clients are fixed sentences; the exception and its traceback go to the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from serve_app.engines.interface import Engine
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.handoff import RequestHandoff
from serve_app.engines.reference.sequence import Status
from serve_app.engines.reference.telemetry import EngineTelemetry
from serve_app.models.kv_capacity import KVCapacityError
from serve_app.protocol.generation import (
    EngineUnavailable,
    GenerateRequest,
    Moved,
    RequestFailed,
    RequestOutput,
    SamplingParams,
)

logger = logging.getLogger(__name__)

ENGINE_FAILED = "the engine failed; the replica will be replaced"
# A request's grammar compiles within this or is refused (400): llguidance's parser limits
# bound the work of one compile, this bounds the wait for a client.
GRAMMAR_COMPILE_TIMEOUT_S = 2.0
SHUT_DOWN = "engine is shut down"  # the message clients have always seen


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | RequestHandoff | Moved | BaseException] = \
            asyncio.Queue()

    def put(self, item: RequestOutput | RequestHandoff | Moved | BaseException) -> None:
        # RuntimeError: the caller's event loop is closed, so nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _settle(future: asyncio.Future[int], value: int) -> None:
    if not future.done():  # the caller may have stopped waiting
        future.set_result(value)


class ReferenceAsyncEngine(Engine):
    supports_handoff = True
    supports_migration = True

    def __init__(self, core: EngineCore, replica: str = "local",
                 watchdog_s: float | None = None) -> None:
        """`watchdog_s`: a step (or an abort's cache free, which also talks to every rank)
        running longer than this fails the engine; None = no watchdog. Idle time never
        counts."""
        if watchdog_s is not None and not watchdog_s > 0:
            raise ValueError(f"watchdog_s={watchdog_s} must be > 0 (or None: no watchdog)")
        self.core = core
        self.watchdog_s = watchdog_s
        self.telemetry = EngineTelemetry(replica)
        core.observer = self.telemetry
        # Grammars compile here, never on the step loop's thread or the event loop; two at a
        # time, so a flood of hostile schemas waits its turn and leaves the loop's pool alone.
        self._compiles = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self._inbox: list[tuple[str, Any]] = []
        self._lock = threading.Lock()  # the inbox, the streams, and the failure record
        self._wake = threading.Event()
        self._stopped = threading.Event()  # wakes the watchdog at shutdown
        self._streams: dict[str, _Stream] = {}
        self._failure: str | None = None  # client-safe message, once the engine has failed
        self._problem: str | None = None  # operator-facing reason, same moment
        # time.monotonic() when the loop thread started its current busy stretch; None while
        # it waits for work (so idle time never trips the watchdog).
        self._busy_since: float | None = None
        self._stopping = False
        self._health_ids = itertools.count()
        self._own: set[str] = set()  # the engine's own requests (health probes): never moved
        self._evacuated = False  # set by `evacuate`: every later client request moves at once
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        self._watchdog: threading.Thread | None = None
        if watchdog_s is not None:
            self._watchdog = threading.Thread(target=self._watch, name="engine-watchdog",
                                              daemon=True)
            self._watchdog.start()

    # --- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping and self._failure is None:
                # A busy stretch starts only with something to do: an idle pass that set the
                # clock first and was preempted before clearing it (a loaded machine) read as
                # a step running since then. The inbox is peeked without its lock: an item put
                # after the peek sets the wake event, so the wait returns at once.
                if not self._inbox and not self.core.has_work:
                    self._busy_since = None
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._busy_since = time.monotonic()
                self._drain_inbox()
                if not self.core.has_work:
                    continue
                outputs = self.core.step()
                if self._failure is not None:
                    break  # the watchdog gave up on this step: its streams are already failed
                self._deliver(outputs)
        except BaseException as exc:  # a dead rank, a CUDA error: fail everything in flight
            logger.exception("engine loop failed; failing every request")
            self._fail_engine(ENGINE_FAILED, f"the engine loop failed ({type(exc).__name__}); "
                              "see the replica log")
        finally:
            self._busy_since = None

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.error is not None:
                # This request alone was aborted in the engine (already removed and freed).
                stream = self._streams.pop(out.request_id, None)
                if stream is not None:
                    stream.put(RequestFailed(out.error))
                continue
            stream = self._streams.get(out.request_id)
            if out.prefilled:
                # A hand-off request is ready: it leaves the engine here, on the loop thread
                # that owns the engine, and its stream ends with the hand-over.
                self._streams.pop(out.request_id, None)
                try:
                    item: RequestHandoff | BaseException = self.core.export(out.request_id)
                except Exception:
                    logger.exception("request %s: export failed; aborting it", out.request_id)
                    self.core.abort(out.request_id)
                    item = RequestFailed("the engine could not hand the request over")
                if stream is not None:
                    stream.put(item)
                continue
            if stream is not None:
                stream.put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for op, arg in inbox:
            if op in ("add", "prefill", "adopt"):
                request, stream = arg
                try:
                    if op == "adopt":
                        self.core.adopt(request)
                    else:
                        self.core.add_request(request.prompt_ids, request.params,
                                              request.request_id, hand_off=op == "prefill",
                                              images=tuple(request.images))
                except (ValueError, KVCapacityError) as exc:  # refused: nothing was queued
                    self._refuse(request.request_id, stream, exc)
                except Exception:
                    logger.exception("request %s: add_request failed; refusing it",
                                     request.request_id)
                    self._refuse(request.request_id, stream,
                                 RequestFailed("the engine could not accept the request"))
                    # Whatever add_request got as far as queuing must not run unwatched.
                    if request.request_id in self.core.sequences:
                        self.core.abort(request.request_id)
            elif op == "abort":
                self.core.abort(arg)
                self._streams.pop(arg, None)
            elif op == "evacuate":
                done: asyncio.Future[int] = arg
                with contextlib.suppress(RuntimeError):  # the caller's loop has closed
                    done.get_loop().call_soon_threadsafe(_settle, done, self._evacuate())

    def _evacuate(self) -> int:
        """On the loop thread, between steps: every client request leaves its stream with a
        `Moved` (a decoding one with its hand-over, one not started yet with nothing to
        carry: it starts again elsewhere). Prefill hand-off requests and the engine's own
        health probes stay (they end within a step or two). Returns how many moved."""
        with self._lock:
            streams = [(rid, st) for rid, st in self._streams.items()
                       if rid not in self._own]
        moved = 0
        for rid, stream in streams:
            seq = self.core.sequences.get(rid)
            if seq is None or seq.hand_off:
                continue
            item: Moved | BaseException
            if seq.status is Status.DECODING:
                try:
                    item = Moved(rid, self.core.export(rid))
                except Exception:
                    logger.exception("request %s: export failed; it finishes here", rid)
                    continue
            elif seq.status in (Status.WAITING, Status.PREFILLING):
                self.core.abort(rid)
                item = Moved(rid)
            else:
                continue
            with self._lock:
                self._streams.pop(rid, None)
            stream.put(item)
            moved += 1
        return moved

    def _refuse(self, request_id: str, stream: _Stream, exc: BaseException) -> None:
        stream.put(exc)
        self._streams.pop(request_id, None)

    def _send(self, op: str, arg: Any) -> None:
        with self._lock:
            self._inbox.append((op, arg))
        self._wake.set()

    def _fail_engine(self, message: str, problem: str) -> None:
        """Record the first failure and end every stream with EngineUnavailable(message)."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure, self._problem = message, problem
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(EngineUnavailable(message))
        self._wake.set()

    # --- the watchdog thread --------------------------------------------------------------------

    def _watch(self) -> None:
        assert self.watchdog_s is not None
        limit = self.watchdog_s
        poll = min(0.25, max(0.01, limit / 4))  # notices a stuck step within limit + poll
        while not self._stopped.wait(poll):
            if self._failure is not None:
                return
            since = self._busy_since
            if since is not None and time.monotonic() - since > limit:
                logger.error("an engine step has run for more than the %g s watchdog (a rank "
                             "stopped, or a collective hangs); failing every request", limit)
                self._fail_engine(
                    f"an engine step exceeded the watchdog ({limit:g} s); the replica will be "
                    "replaced",
                    f"an engine step exceeded the {limit:g} s watchdog and is still stuck",
                )
                return

    # --- the interface --------------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why this engine cannot serve, for operators (health checks, logs); None if it can.
        Cheap and non-blocking: it reads flags, it runs nothing."""
        if self._problem is not None:
            return self._problem
        if self._stopping:
            return "the engine is shut down"
        if not self._thread.is_alive():
            return "the engine loop thread is not running"
        since = self._busy_since
        if self.watchdog_s is not None and since is not None:
            busy = time.monotonic() - since
            if busy > self.watchdog_s:
                return (f"an engine step has run for {busy:.1f} s, over the {self.watchdog_s:g} "
                        "s watchdog")
        return None

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise EngineUnavailable(self._failure)
        if self._stopping or not self._thread.is_alive():
            raise EngineUnavailable(SHUT_DOWN)

    async def _prepare_grammar(self, request: GenerateRequest) -> None:
        """Compile the request's grammar into the engine's cache off every loop, so that its
        add_request only copies a matcher; a schema that does not compile in time is a
        ValueError naming the field (a 400), and nothing is queued."""
        spec, compiler = request.params.grammar, self.core.grammar
        if spec is None or compiler is None:
            return  # add_request refuses a grammar when the engine has no compiler
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._compiles, compiler.prepare, spec)
        try:
            await asyncio.wait_for(asyncio.shield(work), GRAMMAR_COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise ValueError(f"{spec.param}: the grammar did not compile within "
                             f"{GRAMMAR_COMPILE_TIMEOUT_S:g} s") from None

    async def generate(self, request: GenerateRequest
                       ) -> AsyncIterator[RequestOutput | Moved]:
        await self._prepare_grammar(request)
        async for out in self._run_stream("add", request.request_id, request):
            yield out

    async def prefill(self, request: GenerateRequest) -> RequestHandoff | RequestOutput:
        """Prefill only (a prefill replica of a disaggregated app): the request's hand-over
        to a decode engine (`adopt`), or its final output when it ended on its first token."""
        await self._prepare_grammar(request)
        async for item in self._run_stream("prefill", request.request_id, request):
            if isinstance(item, RequestHandoff) or item.finished:
                return item
        raise RequestFailed("the prefill ended without a result")

    async def adopt(self, handoff: RequestHandoff) -> AsyncIterator[RequestOutput | Moved]:
        """Decode a request another engine prefilled (its `prefill`) or ran (its `evacuate`),
        streaming what its client has not been sent yet."""
        if handoff.params.grammar is not None and self.core.grammar is not None:
            await asyncio.get_running_loop().run_in_executor(
                self._compiles, self.core.grammar.prepare, handoff.params.grammar)
        async for out in self._run_stream("adopt", handoff.request_id, handoff):
            yield out

    async def _run_stream(self, op: str, request_id: str, arg: Any
                          ) -> AsyncIterator[RequestOutput | RequestHandoff | Moved]:
        """Send `op` for one request and relay its stream until it ends."""
        stream = _Stream(asyncio.get_running_loop())
        if self._evacuated and op != "prefill" and request_id not in self._own:
            # Its replica is leaving: a request that reaches it now goes elsewhere at once.
            yield Moved(request_id, arg if op == "adopt" else None)
            return
        # Checked and registered under the lock that _fail_engine takes: a stream is either
        # refused here or failed there, never left waiting on a dead engine.
        with self._lock:
            self._check_alive()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self.telemetry.attach(request_id)  # the caller's trace becomes the parent
        self._send(op, (arg, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = isinstance(item, RequestHandoff | Moved) or item.finished
                yield item
                if finished:
                    return
        finally:
            # Client gone (cancelled) or consumer stopped early: free the cache at once.
            if not finished:
                self._send("abort", request_id)

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    async def evacuate(self) -> int:
        """Every client request this engine runs leaves its stream with a `Moved` (between
        two steps, on the loop thread that owns the engine), and so does every one that
        arrives later; returns how many moved now."""
        self._check_alive()
        self._evacuated = True
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._send("evacuate", done)
        return await done

    async def health(self, timeout_s: float) -> None:
        """A real 1-token generation through every rank; EngineUnavailable if the engine has
        failed, a step is stuck, or the generation fails or times out."""
        if (problem := self.problem()) is not None:
            raise EngineUnavailable(f"the engine is unhealthy: {problem}")
        rid = f"health-{next(self._health_ids)}"
        prompt = [(self.core.eos_token_ids and min(self.core.eos_token_ids)) or 0]

        async def one_token() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            async for out in self.generate(GenerateRequest(rid, prompt, params)):
                if out.finished and out.completion_tokens != 1:
                    raise EngineUnavailable(f"health generation returned {out.completion_tokens} "
                                            "tokens")

        self._own.add(rid)
        try:
            await asyncio.wait_for(one_token(), timeout_s)
        except TimeoutError:
            raise EngineUnavailable(f"health generation took longer than {timeout_s} s") from None
        except RequestFailed as exc:
            raise EngineUnavailable(f"health generation failed: {exc}") from None
        finally:
            self._own.discard(rid)

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def capacity(self) -> dict[str, int]:
        return self.core.capacity()

    def prefix_events(self, since: int) -> dict[str, Any] | None:
        """The prefix cache's events from `since` on: {next, events, held (every block it
        holds, only when events were lost)}, or None without a prefix cache."""
        prefix = self.core.runner.prefix
        if prefix is None:
            return None
        with prefix.lock:  # the engine thread changes the tree under the same lock
            nxt, events, lost = prefix.events_since(since)
            held = prefix.block_hashes_held() if lost else None
        return {"next": nxt, "events": events, "held": held}

    async def shutdown(self) -> None:
        self._stopping = True
        self._stopped.set()
        self._wake.set()
        # A loop thread stuck in a step (the watchdog fired) will not come back: don't wait
        # the full 30 s for it.
        await asyncio.to_thread(self._thread.join, 1 if self._failure is not None else 30)
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(EngineUnavailable(SHUT_DOWN))
        if self._thread.is_alive():
            # The followers would meet the shutdown broadcast in the middle of the stuck step's
            # collectives; Ray ends their actors with the replica instead.
            logger.warning("engine loop is still inside a step; not telling the ranks to stop")
            return
        if self.core.budget is not None:
            # The loop thread has stopped: the fitted step-cost table is final.
            self.core.budget.save()
        try:
            self.core.runner.shutdown()
        except Exception:
            if self._failure is None:
                raise
            # After an engine fault the ranks may be gone already; shutting down must not fail.
            logger.warning("telling the ranks to stop failed after an engine fault",
                           exc_info=True)
