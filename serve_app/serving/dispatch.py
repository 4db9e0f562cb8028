"""Where a request runs: admission on the router's stage, the call to the chosen replica, its
requeue when that replica refuses it, and the lease that releases all of it exactly once.

One `Dispatcher` per caller and target deployment. The ingress has one for the deployment it
fronts (the aggregated target, or a disaggregated app's decode side) and knows nothing more.
A disaggregated app's decode replica has one for the prefill side: it orchestrates its own
requests (prefill there, adopt the hand-over here, stream from here), as the decode server
does in Ray Serve LLM's prefill/decode pattern, so the ingress never learns that an app is
disaggregated. Failures are raised as they are; the caller says what a client sees
(serving/errors.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import ray
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.protocol.generation import GenerateRequest, Prefilled, RequestOutput
from serve_app.protocol.media import cache_keys
from serve_app.routing.admission import AdmissionStage
from serve_app.routing.reservation import ReplicaFull
from serve_app.routing.settings import RouterSettings
from serve_app.serving.errors import unwrap

Output = RequestOutput | Prefilled


class Lease:
    """One dispatched request's hold on the router and its replica: its reservation on the
    admission stage and its handle stream, from which `first` came. Iterate it for the rest
    of the stream. `close` releases both exactly once, whoever calls it first: the normal
    end, an error, a cancellation at any await, or the end of a streaming response's send,
    however it ends (serving/responses.py's LeasedStream)."""

    def __init__(self, request_id: str, stage: AdmissionStage | None) -> None:
        self.request_id = request_id
        self.stage = stage
        self.stream: Any = None
        self.first: Any = None
        self.finished = False  # the replica has sent the final output
        self._held = False  # the stage's reservation is this lease's to release
        self._closed = False

    def hold(self) -> None:
        """The stage admitted the request: its reservation is released by `close`."""
        self._held = True

    def __aiter__(self) -> Any:
        return self.stream.__aiter__()

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

    async def _ask_replicas(self, since: dict[str, int]) -> list[Any]:
        """The admission stage's question to every running replica (Serve's broadcast reaches
        each replica the handle's router knows): their answers, or the exceptions."""
        try:
            return await self.handle.broadcast("routing_info", since).results_async(
                timeout_s=self.ask_timeout_s, return_exceptions=True)
        except DeploymentUnavailableError:
            return []

    async def dispatch(self, request: GenerateRequest, max_tokens: int,
                       near: str | None = None) -> Lease:
        """Run `request` on a replica: admitted on the stage (waiting in its queue for room),
        sent there, and its first output awaited, so that a refused request raises here (the
        caller answers 4xx/5xx before anything is sent). `max_tokens`: what it reserves (a
        prefill replica samples one token); `near`: the node its hand-over goes to (priced
        by the stage). The returned lease is the caller's to close; a failure closes it."""
        lease = Lease(request.request_id, self.stage)
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
            # A prefill replica's hand-over is the last thing its stream sends.
            lease.finished = isinstance(lease.first, Prefilled) or lease.first.finished
            if self.stage is not None:
                self.stage.prefill_done(request.request_id)
            return lease
        except BaseException:
            lease.close()
            raise

    async def _first(self, request: GenerateRequest, replica: str | None,
                     lease: Lease) -> Output:
        """The first output of the call to `replica` (its stream then the lease's). A replica
        that refuses the request (ReplicaFull: another caller took the room) sends it back to
        the front of the stage's queue, with the replica's numbers, until one has room."""
        while True:
            reservation = self.stage.reservation(request.request_id) if self.stage else None
            # The choice travels with the request: the deployment's request router
            # (routing/serve_router.py) sends it there.
            call = request if replica is None else replace(request, replica=replica)
            stream = (self._generate.remote(call) if reservation is None
                      else self._generate.remote(call, reservation))
            lease.stream = stream
            try:
                return await stream.__anext__()
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
