"""Where a request runs: admission on the router's stage, the call to the chosen replica, its
requeue when that replica refuses it, its move when that replica leaves (a scale-down, a
restart: the stream ends with `Moved` and goes on from another replica), and the lease that
releases all of it exactly once.

One `Dispatcher` per caller and target deployment. The ingress has one for the deployment it
fronts (the aggregated target, or a disaggregated app's decode side) and knows nothing more.
A disaggregated app's decode replica has one for the prefill side: it orchestrates its own
requests (prefill there, adopt the hand-over here, stream from here), as the decode server
does in Ray Serve LLM's prefill/decode pattern, so the ingress never learns that an app is
disaggregated. Failures are raised as they are; the caller says what a client sees
(serving/errors.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import ray
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.protocol.generation import (
    EngineUnavailable,
    GenerateRequest,
    Moved,
    Prefilled,
    RequestOutput,
)
from serve_app.protocol.media import cache_keys
from serve_app.routing.admission import AdmissionStage
from serve_app.routing.reservation import ReplicaFull
from serve_app.routing.settings import RouterSettings
from serve_app.serving.errors import unwrap

Output = RequestOutput | Prefilled

# The window of the TTFT this caller reports to the replicas for autoscaling.
TTFT_WINDOW_S = 30.0
# A request that keeps landing on leaving replicas (a whole fleet restarting at once under
# Serve's own routing) fails with a 503 after this many moves rather than going round forever.
MAX_MOVES = 8


class Lease:
    """One dispatched request's hold on the router and its replica: its reservation on the
    admission stage and its handle stream, from which `first` came. Iterate it for the rest
    of the stream: a replica that leaves mid-stream hands the request to another
    (`Moved`), and the iteration goes on from there without a gap or a repeat. `close`
    releases both exactly once, whoever calls it first: the normal end, an error, a
    cancellation at any await, or the end of a streaming response's send, however it ends
    (serving/responses.py's LeasedStream)."""

    def __init__(self, request: GenerateRequest, stage: AdmissionStage | None,
                 move: Callable[[Lease, Moved], Awaitable[Output]], reserved_tokens: int,
                 near: str | None = None) -> None:
        """`reserved_tokens`, `near`: what its admission reserved and priced (`dispatch`),
        which a move admits it with again."""
        self.request = request
        self.request_id = request.request_id
        self.reserved_tokens = reserved_tokens
        self.near = near
        self.stage = stage
        self.replica: str | None = None  # the stage's choice, where it made one
        self.stream: Any = None
        self.first: Any = None
        self.finished = False  # the replica has sent the final output
        self.moves = 0
        self._move = move
        self._held = False  # the stage's reservation is this lease's to release
        self._closed = False

    def hold(self) -> None:
        """The stage admitted the request: its reservation is released by `close`."""
        self._held = True

    async def __aiter__(self) -> AsyncIterator[Output]:
        while True:
            moved = None
            async for item in self.stream:
                if isinstance(item, Moved):
                    moved = item  # that replica's stream has ended with it
                    break
                yield item
            if moved is None:
                return
            self.stream = None
            out = await self._move(self, moved)
            self.finished = isinstance(out, Prefilled) or out.finished
            yield out
            if self.finished:
                return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.stream is not None and not self.finished:
            # Reaches the replica, whose generator aborts the request in the engine.
            self.stream.cancel()
        if self._held and self.stage is not None:
            self.stage.release(self.request_id)


class Dispatcher:
    """Sends requests to one target deployment's replicas: through the router's admission
    stage (`settings`; None: Serve's own routing), each to the replica the stage chose."""

    def __init__(self, handle: DeploymentHandle, settings: RouterSettings | None,
                 caller: tuple[str, str] | None, ask_timeout_s: float) -> None:
        """`caller`: (namespace, actor name) of this process, which the target replica
        watches (it aborts the requests of a caller that died) and which names this caller in
        the replicas' ledgers. `ask_timeout_s`: how long the stage waits for the replicas'
        routing info."""
        self.handle = handle
        self._generate = handle.options(stream=True).generate  # made once, not per request
        self.caller = caller
        self.ask_timeout_s = ask_timeout_s
        self.stage = (AdmissionStage(settings, self._ask_replicas,
                                     me=caller[1] if caller else "")
                      if settings is not None else None)
        # (when, seconds) of recent times to first output: the autoscaling policy's TTFT.
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=4096)

    async def _ask_replicas(self, since: dict[str, int]) -> list[Any]:
        """The admission stage's question to every running replica (Serve's broadcast reaches
        each replica the handle's router knows): their answers, or the exceptions."""
        try:
            return await self.handle.broadcast("routing_info", since, self.load_report()
                                               ).results_async(
                timeout_s=self.ask_timeout_s, return_exceptions=True)
        except DeploymentUnavailableError:
            return []

    def load_report(self) -> dict[str, Any]:
        """What this caller tells every replica for their autoscaling reports: its admission
        queue (requests, KV tokens, oldest wait) and the p90 time to first output over the
        last TTFT_WINDOW_S."""
        report = self.stage.queue_report() if self.stage is not None else {}
        now = time.monotonic()
        recent = sorted(t for at, t in self._ttfts if now - at <= TTFT_WINDOW_S)
        report["ttft_p90_s"] = recent[int(0.9 * (len(recent) - 1))] if recent else 0.0
        return report

    async def dispatch(self, request: GenerateRequest, max_tokens: int,
                       near: str | None = None) -> Lease:
        """Run `request` on a replica: admitted on the stage (waiting in its queue for room),
        sent there, and its first output awaited, so that a refused request raises here (the
        caller answers 4xx/5xx before anything is sent). `max_tokens`: what it reserves (a
        prefill replica samples one token); `near`: the node its hand-over goes to (priced
        by the stage). The returned lease is the caller's to close; a failure closes it."""
        lease = Lease(request, self.stage, self._follow, max_tokens, near)
        started = time.monotonic()
        try:
            replica = None
            if self.stage is not None:
                # Keyed by content: an image's pad run by its pixels (the prefix index must
                # not send two prompts with different images to one cached prefix).
                replica = await self.stage.admit(
                    request.request_id, cache_keys(request.prompt_ids, request.images),
                    max_tokens, request.client, near)
                lease.hold()
            lease.first = await self._first(request, replica, lease)
            now = time.monotonic()
            self._ttfts.append((now, now - started))
            # A prefill replica's hand-over is the last thing its stream sends.
            lease.finished = isinstance(lease.first, Prefilled) or lease.first.finished
            if self.stage is not None:
                self.stage.prefill_done(request.request_id)
            return lease
        except BaseException:
            lease.close()
            raise

    async def _first(self, request: GenerateRequest, replica: str | None, lease: Lease,
                     handoff: Any = None) -> Output:
        """The first output of the call to `replica` (its stream then the lease's). A replica
        that refuses the request (ReplicaFull: another caller took the room) sends it back to
        the front of the stage's queue, with the replica's numbers, until one has room; one
        that is leaving answers `Moved`, and the request goes to another (`handoff`: what it
        carries there, a request that had started)."""
        while True:
            lease.replica = replica
            reservation = self.stage.reservation(request.request_id) if self.stage else None
            # The choice travels with the request: the deployment's request router
            # (routing/serve_router.py) sends it there.
            call = request if replica is None else replace(request, replica=replica)
            # Only what the call carries: a replica (or a stand-in for one) that predates
            # moves takes (request[, reservation]).
            args = (call,) if reservation is None else (call, reservation)
            stream = (self._generate.remote(*args) if handoff is None
                      else self._generate.remote(*args, handoff=handoff))
            lease.stream = stream
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                lease.stream = None
                raise RuntimeError("the target replica returned no output") from None
            except Exception as exc:
                # The stream ended with its error: nothing runs that a cancel could stop (and
                # Serve's cancel of a call that never reached a replica re-raises).
                lease.stream = None
                full = unwrap(exc)
                if not (isinstance(full, ReplicaFull) and self.stage is not None
                        and replica is not None):
                    raise
                replica = await self.stage.requeue(
                    request.request_id, str(full.info.get("replica") or replica), full.info)
                continue
            if not isinstance(first, Moved):
                return first
            lease.stream = None
            handoff = first.handoff
            replica = await self._moved(lease)

    async def _follow(self, lease: Lease, moved: Moved) -> Output:
        """The lease's replica left mid-stream: the request's first output from the replica
        that takes it over (the tokens its client has not been sent yet)."""
        out = await self._first(lease.request, await self._moved(lease), lease, moved.handoff)
        if self.stage is not None:  # its new replica has no prefill pending for it
            self.stage.prefill_done(lease.request_id)
        return out

    async def _moved(self, lease: Lease) -> str | None:
        """Where a request goes from a leaving replica: the stage marks that replica as
        leaving and admits the request again, at the front of its queue; without a stage,
        Serve's routing picks (it sends nothing to a stopping replica)."""
        lease.moves += 1
        if lease.moves > MAX_MOVES:
            raise EngineUnavailable(f"the request was moved {MAX_MOVES} times by replicas "
                                    "leaving the fleet; retry")
        if self.stage is None:
            return None
        request = lease.request
        return await self.stage.move(
            request.request_id, lease.replica,
            cache_keys(request.prompt_ids, request.images),
            lease.reserved_tokens, request.client, lease.near)

    async def view(self) -> dict[str, Any]:
        """The stage's view for /v1/router (its replicas' KV tokens and state slots, its
        queue, recent decisions)."""
        if self.stage is None:
            return {"policy": "ray_default"}
        return await self.stage.view()

    async def downstream_views(self) -> dict[str, Any]:
        """The views of the dispatchers the replicas run themselves (a disaggregated app's
        decode replicas, to the prefill side), by replica."""
        try:
            answers = await self.handle.broadcast("dispatch_view").results_async(
                timeout_s=self.ask_timeout_s, return_exceptions=True)
        except DeploymentUnavailableError:
            return {}
        return {a["replica"]: a["view"] for a in answers
                if isinstance(a, dict) and a.get("view") is not None}


def serve_caller() -> tuple[str, str] | None:
    """(namespace, actor name) of this Serve replica: whom the replicas it calls watch, and
    its name in their ledgers. Serve's replica actors are named in Serve's namespace, not the
    job's."""
    from ray.serve._private.constants import SERVE_NAMESPACE

    name = ray.get_runtime_context().get_actor_name()
    return (SERVE_NAMESPACE, name) if name else None
