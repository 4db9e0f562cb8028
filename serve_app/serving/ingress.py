"""The OpenAI-compatible ingress: HTTP transport, limits and streaming.

(No `from __future__ import annotations` here: FastAPI must see the real request classes
after Serve rewrites the route signatures.)

It turns requests into token ids + sampling parameters, sends them to a target replica, and
turns the committed-token events that stream back into OpenAI responses or SSE. What a chat
means (rendering, request semantics, output parsing) is the chat format's (serve_app/chat/);
the ingress never knows which engine backend runs behind the handle.

What a request meets, in order: the edge guard (edge.py: API key -> 401, body size -> 413,
anything unexpected -> an OpenAI-shaped 500), JSON parsing and the schema (protocol.py: every
field, 400 naming it), the model name (404), the chat format's rules (400), the prompt's size
before and after tokenizing and max_tokens against the context (400), the sampling policy
(400), the router (per-client limits and queue -> 429, capacity -> 400, queue timeout -> 503),
then the engine; failures as clients see them in errors.py.
"""


import asyncio
import functools
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from serve_app.chat.formats import ChatPlan, chat_format_for
from serve_app.chat.output import ChatOutput, PlainOutput
from serve_app.chat.parameters import sampling_values
from serve_app.chat.segments import encode_segments, text_bytes
from serve_app.config import AppConfig, context_length
from serve_app.observability.logs import get_logger, install_trace_ids
from serve_app.observability.request_telemetry import RequestTelemetry
from serve_app.protocol.generation import (
    GenerateRequest,
    Prefilled,
    RequestOutput,
)
from serve_app.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    OpenAIRequest,
    new_id,
    now,
    quote,
    usage,
    validation_error,
)
from serve_app.routing.admission import AdmissionStage
from serve_app.routing.policy import RouterError
from serve_app.routing.reservation import ReplicaFull
from serve_app.serving.edge import (
    EdgeGuard,
    OpenAIJSONResponse,
    configure_edge,
    error_response,
)
from serve_app.serving.errors import error_for, router_error, unavailable, unwrap
from serve_app.serving.health import HealthProbe
from serve_app.tokenizer import load_tokenizer

logger = get_logger("ingress")

# Prompts up to this size are tokenized on the event loop (tens of microseconds, less than the
# hop to a thread); longer ones on the tokenizer threads, so that they never hold the loop
# (/health and every other request included).
INLINE_TOKENIZE_BYTES = 8192
# How long after a non-streaming response its telemetry is recorded (see _serve).
TELEMETRY_DELAY_S = 0.005


# No trailing-slash redirects: a 307 with an empty body is not an answer an OpenAI client
# understands; a wrong path is a 404 like any other.
app = FastAPI(title="Kimi + DSpark (OpenAI-compatible)", default_response_class=OpenAIJSONResponse,
              redirect_slashes=False)


@app.exception_handler(OpenAIError)
async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc)


@app.exception_handler(HTTPException)
async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    # Unknown paths (404), wrong methods (405): the same shape as every other error.
    kind = "not_found" if exc.status_code == 404 else None
    message = {404: "unknown path", 405: "method not allowed for this path"}.get(
        exc.status_code, "request refused")
    err = OpenAIError(exc.status_code, message, code=kind)
    err.headers = dict(exc.headers or {}) or None
    return error_response(err)


@app.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(OpenAIError(400, "invalid request"))


app.add_middleware(EdgeGuard)


# --- a request's prompt and answer ---------------------------------------------------------------


@dataclass
class Prompt:
    ids: list[int]
    plan: ChatPlan | None = None  # None: a /v1/completions prompt


@dataclass
class Answer:
    """One response being assembled by its output assembler (the chat format's; for a
    completion the engine's text as it came, PlainOutput); usage without the format's
    generation stub."""

    prompt: Prompt
    output: ChatOutput

    @property
    def chat(self) -> bool:
        return self.prompt.plan is not None

    def feed(self, out: RequestOutput) -> list[dict[str, Any]]:
        return self.output.feed(out)

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        return self.output.finish(reason)

    def prompt_tokens(self, last: RequestOutput) -> int:
        stub = self.prompt.plan.stub_tokens if self.prompt.plan else 0
        return max(0, last.prompt_tokens - stub)

    @staticmethod
    def finish_fields(last: RequestOutput) -> dict[str, Any]:
        """Beside the final choice's finish_reason: `grammar_closed` when the deployment's
        grammar_budget close ended this constrained answer within max_tokens (its calls and
        JSON are complete; the budget, not the model alone, decided where it ended)."""
        return {"grammar_closed": True} if last.grammar_closed else {}

    def usage(self, last: RequestOutput) -> dict[str, Any]:
        return usage(self.prompt_tokens(last), last.completion_tokens, last.spec,
                     last.cached_tokens)


# --- a request's hold on the router and the target ------------------------------------------------


class Lease:
    """One admitted request: its reservations on the router's admission stages (one; a
    disaggregated request's two, decode and prefill) and its handle stream. `close` releases
    all of them exactly once, whoever calls it first: the normal end, an error, a cancellation
    at any await, or the end of a streaming response's send, however it ends
    (`LeasedStream`)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.stages: list[AdmissionStage] = []
        self.stream: Any = None
        self.finished = False
        self._closed = False

    def hold(self, stage: AdmissionStage) -> None:
        """The request's reservation on `stage`, admitted: this lease releases it."""
        self.stages.append(stage)

    def release(self, stage: AdmissionStage) -> None:
        """Release one stage's reservation before the end (a disaggregated request's prefill
        side, once its replica has handed the request over)."""
        if stage in self.stages:
            self.stages.remove(stage)
            stage.release(self.request_id)

    def prefill_done(self) -> None:
        for stage in self.stages:
            stage.prefill_done(self.request_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.stream is not None and not self.finished:
            # Reaches the replica, whose generator aborts the request in the engine.
            self.stream.cancel()
        for stage in self.stages:
            stage.release(self.request_id)
        self.stages.clear()


async def _paced(stream: Any, interval: float | None) -> AsyncIterator[Any]:
    """`stream`'s items, and None whenever `interval` seconds pass without one. The pending
    `__anext__` is waited on, never cancelled by the timeout (a cancelled one would end the
    stream); it is cancelled only when the consumer stops early."""
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            item, pending = pending, None
            try:
                value = item.result()
            except StopAsyncIteration:
                return
            yield value
    finally:
        if pending is not None:
            pending.cancel()


async def _first_output(stream: Any, lease: Lease) -> Any:
    """The first output of a target call's `stream`, which `lease` then owns. A stream that
    ends without one is a 500. One that fails has ended with its error: the lease drops it
    (nothing runs that a cancel could stop, and Serve's cancel of a call that never reached a
    replica re-raises) and the error propagates."""
    lease.stream = stream
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise OpenAIError(500, "the engine returned no output", "server_error") from None
    except Exception:
        lease.stream = None
        raise


class LeasedStream(StreamingResponse):
    """The SSE response of one admitted request, which closes its lease when sending ends, on
    every path. The body generator's own `finally` is not enough: when the client leaves before
    the first byte, Starlette cancels the send before the generator starts, and a generator
    that never started runs no `finally`. The lease was then released only when the garbage
    collector reached the dropped response, seconds later or, in a reference cycle, much later:
    its tokens stayed committed in the router meanwhile."""

    def __init__(self, body: AsyncIterator[str], lease: Lease,
                 on_abandon: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.lease, self.on_abandon = lease, on_abandon

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.lease.finished:
                self.on_abandon()
            self.lease.close()


# --- the deployment --------------------------------------------------------------------------------


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        # ValueError covers invalid UTF-8, NaN/Infinity and ints past Python's digit limit.
        raise OpenAIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise OpenAIError(400, "the request body is nested too deeply") from None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _api_keys(config: AppConfig) -> list[str]:
    keys = list(config.ingress.api_keys)
    env = config.ingress.api_keys_env
    if env and os.environ.get(env):
        keys += [k.strip() for k in os.environ[env].split(",") if k.strip()]
    return keys


# Decorated here, at import, so that every process importing this module (the replicas too)
# gets the FastAPI app with these methods bound as routes.
@serve.ingress(app)
class OpenAIIngress:
    """The body of the ingress deployment."""

    def __init__(self, target: DeploymentHandle, config: dict[str, Any],
                 decode: DeploymentHandle | None = None) -> None:
        """`target`: the target deployment (a disaggregated app's prefill side); `decode`: a
        disaggregated app's decode side, which streams each answer the prefill side handed
        over."""
        self.config = AppConfig.model_validate(config)
        self.target = target
        self._generate = target.options(stream=True).generate  # made once, not per request
        self._decode = decode.options(stream=True).decode if decode is not None else None
        self.tokenizer = load_tokenizer(self.config.models.tokenizer_path())
        self.chat = chat_format_for(self.tokenizer, self.config.api.tool_strict_level)
        self.model_name = self.config.models.served_model_name
        self.max_model_len = context_length(self.config)
        ing = self.config.ingress
        edge = configure_edge(_api_keys(self.config),
                              ing.max_body_bytes or 16 * self.max_model_len + 65_536,
                              ing.expose_docs)
        self.retry_after_s = ing.retry_after_s
        self.keepalive_s = ing.sse_keepalive_s
        self._tokenize_pool = ThreadPoolExecutor(ing.tokenizer_threads,
                                                 thread_name_prefix="tokenize")
        self.health_probe = HealthProbe(target, ing.health_cache_s, ing.health_timeout_s,
                                        decode)
        # Who we are, so the target can abort our requests if this process dies.
        # Serve's replica actors are named in Serve's namespace, not the job's.
        from ray.serve._private.constants import SERVE_NAMESPACE

        name = ray.get_runtime_context().get_actor_name()
        self.caller = (SERVE_NAMESPACE, name) if name else None
        install_trace_ids()
        logger.info("ingress ready: %d API keys, body limit %d bytes, context %d tokens",
                    len(edge.key_digests), edge.max_body_bytes, self.max_model_len)
        # The long-context router (docs/router.md): None = Serve's own routing. A
        # disaggregated app has one admission stage per side: the prefill side's is `router`
        # (the target's), the decode side's `decode_router`; a request holds a pair.
        self.router: AdmissionStage | None = None
        self.decode_router: AdmissionStage | None = None
        if self.config.router.policy != "ray_default":
            settings = self.config.router.settings(
                self.config.engine.backend, self.max_model_len,
                self.config.engine.reference.prefix_cache.enabled)
            self.router = AdmissionStage(
                settings, functools.partial(self._ask_replicas, target), me=name or "")
            if decode is not None:
                self.decode_router = AdmissionStage(
                    settings, functools.partial(self._ask_replicas, decode), me=name or "")

    async def _ask_replicas(self, handle: DeploymentHandle, since: dict[str, int]) -> list[Any]:
        """An admission stage's question to every running replica of `handle`'s deployment
        (Serve's broadcast reaches each replica the handle's router knows): their answers, or
        the exceptions."""
        try:
            return await handle.broadcast("routing_info", since).results_async(
                timeout_s=self.config.ingress.health_timeout_s, return_exceptions=True)
        except DeploymentUnavailableError:
            return []

    # --- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Any:
        problem = await self.health_probe.problem()
        if problem is None:
            return {"status": "ok"}
        return error_response(unavailable(problem, self.retry_after_s))

    @app.get("/v1/router")
    async def router_state(self) -> dict[str, Any]:
        """Per replica: KV tokens and state slots (total, reserved by the router, used by the
        engine); the queue length and recent routing decisions. Disaggregated: the prefill
        side's, with the decode side's under "decode"."""
        if self.router is None:
            return {"policy": "ray_default"}
        view = await self.router.view()
        if self.decode_router is not None:
            view["decode"] = await self.decode_router.view()
        return view

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "kimi-dspark-serve",
            "max_model_len": self.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._handle(request, chat=False)

    # --- the request path -----------------------------------------------------------------------

    async def _handle(self, request: Request, chat: bool) -> Any:
        telemetry = RequestTelemetry("chat.completions" if chat else "completions",
                                     self.model_name)
        with telemetry.active():
            try:
                body = await _parse(request, ChatCompletionRequest if chat else CompletionRequest)
                self._check_model(body)
                prompt = await self._tokenize(body)
                return await self._serve(body, prompt, telemetry, self._client_of(request))
            except OpenAIError as exc:
                telemetry.finish(exc.status)
                raise
            except asyncio.CancelledError:  # the client left before the answer was ready
                telemetry.finish(499)
                raise

    def _client_of(self, request: Request) -> str:
        """Whose request this is, for the per-client limits: the API key it used, else the
        address it came from."""
        state = request.scope.get("state") or {}
        if "client" in state:
            return str(state["client"])
        client = request.client
        return f"addr-{client.host}" if client else "addr-unknown"

    def _check_model(self, body: OpenAIRequest) -> None:
        if body.model != self.model_name:
            raise OpenAIError(404, f"the model {quote(body.model)} does not exist; this server "
                              f"serves {quote(self.model_name)}", param="model",
                              code="model_not_found")

    async def _tokenize(self, body: OpenAIRequest) -> Prompt:
        """Token ids of the prompt, computed off the event loop (a long prompt must not stall
        /health or other requests). A text that cannot fit the context even at the
        tokenizer's most bytes per token is refused without tokenizing it."""
        if isinstance(body, ChatCompletionRequest):
            plan = self.chat.plan(body)
            param, size = "messages", text_bytes(plan.segments)
            work: Callable[[], list[int]] = lambda: encode_segments(self.tokenizer, plan.segments)  # noqa: E731
        else:
            assert isinstance(body, CompletionRequest)
            plan, param = None, "prompt"
            text = body.prompt_ids_or_text()
            if not isinstance(text, str):
                vocab = self.tokenizer.vocab_size
                if any(not 0 <= t < vocab for t in text):
                    raise OpenAIError(400, f"prompt token ids must be in [0, {vocab})",
                                      param="prompt")
                return Prompt(text)
            size = len(text.encode("utf-8"))
            work = lambda: self.tokenizer.encode_text(text)  # noqa: E731
        if size > self.max_model_len * self.tokenizer.max_token_bytes:
            raise OpenAIError(400, f"This model's maximum context length is "
                              f"{self.max_model_len} tokens; the {param} ({size} bytes of "
                              f"text) is longer than that", param=param,
                              code="context_length_exceeded")
        if size <= INLINE_TOKENIZE_BYTES:
            return Prompt(work(), plan)
        return Prompt(await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, work),
                      plan)

    def _limits(self, body: OpenAIRequest, prompt_ids: list[int], chat: bool) -> int:
        """max_tokens against this server's limit and the context: the request's max_tokens."""
        ing = self.config.ingress
        max_tokens = body.requested_max_tokens(ing.default_max_tokens)
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        if max_tokens > ing.max_tokens_limit:
            raise OpenAIError(400, f"{param}={max_tokens} exceeds this server's limit "
                              f"{ing.max_tokens_limit}", param=param)
        if not prompt_ids:
            raise OpenAIError(400, "the prompt is empty", param="messages" if chat else "prompt")
        total = len(prompt_ids) + max_tokens
        if total > self.max_model_len:
            raise OpenAIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {total} tokens ({len(prompt_ids)} in the "
                f"{'messages' if chat else 'prompt'}, {max_tokens} in the completion).",
                param=param, code="context_length_exceeded")
        return max_tokens

    async def _serve(self, body: OpenAIRequest, prompt: Prompt, telemetry: RequestTelemetry,
                     client: str) -> Any:
        chat, prompt_ids = prompt.plan is not None, prompt.ids
        max_tokens = self._limits(body, prompt_ids, chat)
        thinking = bool(prompt.plan and prompt.plan.k3 and prompt.plan.k3.thinking)
        params = body.sampling(max_tokens, *sampling_values(
            self.config.api.parameter_policy, body, thinking),
            grammar=prompt.plan.grammar if prompt.plan else None)
        rid = new_id("chatcmpl" if chat else "cmpl")
        telemetry.span.set_attribute("request_id", rid)
        telemetry.span.set_attribute("max_tokens", max_tokens)
        telemetry.span.set_attribute("stream", body.stream)
        lease: Lease | None = Lease(rid)
        try:
            assert lease is not None
            # The reservation rides on the target call (no extra round trip): the replica
            # reserves it on its own, authoritative ledger before any engine work.
            decode_replica = near = None
            target_max_tokens = max_tokens
            if self.decode_router is not None:
                # The pair, decode side first: it holds the request for the whole answer, and
                # a request no decode replica can take must not be prefilled. The prefill
                # replica then samples only the first token.
                decode_replica = await self._admit(self.decode_router, lease, prompt_ids,
                                                   max_tokens, client)
                near, target_max_tokens = self.decode_router.node_of(decode_replica), 1
            replica = None
            if self.router is not None:
                replica = await self._admit(self.router, lease, prompt_ids, target_max_tokens,
                                            client, near)

            def generate(chosen: str | None) -> Any:
                request = GenerateRequest(rid, prompt_ids, params, caller=self.caller,
                                          replica=chosen)
                reservation = self.router.reservation(rid) if self.router is not None else None
                return (self._generate.remote(request) if reservation is None
                        else self._generate.remote(request, reservation))

            # Wait for the first event before answering, so a refused request gets its 4xx.
            first = await self._first(self.router, replica, generate, lease)
            if isinstance(first, Prefilled):
                if self.router is not None:
                    lease.release(self.router)  # its replica has let the request go
                first = await self._decoded(first, decode_replica, lease)
            lease.finished = first.finished
            lease.prefill_done()
            telemetry.first_token()
            answer = Answer(prompt, self.chat.output(prompt.plan) if prompt.plan
                            else PlainOutput())
            if body.stream:
                sse = self._sse(body, rid, answer, first, lease, telemetry)
                response = LeasedStream(sse, lease, functools.partial(
                    telemetry.finish, 499, first.prompt_tokens, first.completion_tokens))
                lease = None  # the response owns it now
                return response
            response = await self._collect(rid, answer, first, lease)
            # Metrics, the closing log line and the span end (0.7-1 ms) run once the response
            # has left: they are the server's bookkeeping, not the client's latency. Neither a
            # Starlette BackgroundTask nor call_soon is late enough under Serve (the body is
            # forwarded by another task, after them); the time recorded is still this one.
            asyncio.get_running_loop().call_later(
                TELEMETRY_DELAY_S, telemetry.finish, 200, response["usage"]["prompt_tokens"],
                response["usage"]["completion_tokens"], time.perf_counter())
            return response
        finally:
            if lease is not None:
                lease.close()

    async def _admit(self, stage: AdmissionStage, lease: Lease, prompt_ids: list[int],
                     max_tokens: int, client: str, near: str | None = None) -> str:
        """The replica `stage` admits the request to, its reservation then held by `lease`."""
        try:
            replica = await stage.admit(lease.request_id, prompt_ids, max_tokens, client, near)
        except RouterError as exc:
            raise router_error(exc, self.retry_after_s) from None
        lease.hold(stage)
        return replica

    async def _first(self, stage: AdmissionStage | None, replica: str | None,
                     call: Callable[[str | None], Any], lease: Lease) -> Any:
        """The first output of `call(replica)` (a target call's stream, which `lease` then
        owns). A replica that refuses the request (ReplicaFull: another ingress took the room)
        sends it back to the front of `stage`'s queue, with the replica's numbers, until a
        replica has room; any other failure is the client's error."""
        while True:
            try:
                return await _first_output(call(replica), lease)
            except Exception as exc:
                full = unwrap(exc)
                if not (isinstance(full, ReplicaFull) and stage is not None
                        and replica is not None):
                    raise error_for(exc, self.retry_after_s, lease.request_id) from None
                try:
                    replica = await stage.requeue(
                        lease.request_id, str(full.info.get("replica") or replica), full.info)
                except RouterError as err:
                    raise router_error(err, self.retry_after_s) from None

    async def _decoded(self, prefilled: Prefilled, replica: str | None,
                       lease: Lease) -> RequestOutput:
        """A disaggregated request's first output, from the decode replica that adopts its
        hand-over (`replica`, the decode side's admission stage's choice; None: Serve's
        routing): Ray gives that replica the reference, and it fetches the hand-over from the
        prefill replica's object store (the ingress never holds the caches). The answer
        streams from there; a lost hand-over (the prefill replica died) is a 503."""
        if self._decode is None:
            raise OpenAIError(500, "the engine handed over a request but there is no decode "
                              "side", "server_error")
        stage, decode = self.decode_router, self._decode

        def call(chosen: str | None) -> Any:
            reservation = stage.reservation(lease.request_id) if stage is not None else None
            return decode.remote(prefilled.handoff, self.caller, replica=chosen,
                                 reservation=reservation)

        return await self._first(stage, replica, call, lease)

    async def _collect(self, rid: str, answer: Answer, first: RequestOutput,
                       lease: Lease) -> dict[str, Any]:
        outs, last = [first], first
        try:
            if not first.finished:
                async for out in lease.stream:
                    outs.append(out)
                    last = out
        except Exception as exc:
            raise error_for(exc, self.retry_after_s, rid) from None
        lease.finished = last.finished
        text = "".join(o.text for o in outs)
        for out in outs:
            answer.feed(out)
        finish = answer.finish(last.finish_reason)[1]
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None,
                                  **answer.finish_fields(last)}
        if answer.chat:
            choice["message"] = answer.output.message()
        else:
            choice["text"] = text
        return {
            "id": rid, "object": "chat.completion" if answer.chat else "text_completion",
            "created": now(), "model": self.model_name, "choices": [choice],
            "usage": answer.usage(last),
        }

    async def _sse(self, body: OpenAIRequest, rid: str, answer: Answer, first: RequestOutput,
                   lease: Lease, telemetry: RequestTelemetry) -> AsyncIterator[str]:
        created = now()
        chat = answer.chat
        kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = body.include_usage(
            default=bool(answer.prompt.plan and answer.prompt.plan.stream_usage))

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=True)}\n\n"

        def chunk(delta: dict[str, Any], finish: str | None = None,
                  **fields: Any) -> str:
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                          "logprobs": None, **fields}
            else:
                choice = {"index": 0, "text": delta.get("content", ""),
                          "finish_reason": finish, "logprobs": None, **fields}
            payload: dict[str, Any] = {"id": rid, "object": kind, "created": created,
                                       "model": self.model_name, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return event(payload)

        last = first
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            for delta in answer.feed(first):
                yield chunk(delta)
            sent = time.monotonic()
            if not first.finished:
                async for out in _paced(lease.stream, self.keepalive_s):
                    if out is not None:
                        last = out
                        for delta in answer.feed(out):
                            yield chunk(delta)
                            sent = time.monotonic()
                    # Outputs that add no delta (a typed argument's value is sent when it
                    # closes) are silence on the wire too.
                    if self.keepalive_s and time.monotonic() - sent >= self.keepalive_s:
                        yield ": keep-alive\n\n"
                        sent = time.monotonic()
            lease.finished = last.finished
            deltas, finish = answer.finish(last.finish_reason)
            for delta in deltas:
                yield chunk(delta)
            yield chunk({}, finish, **answer.finish_fields(last))
            if include_usage:
                yield event({"id": rid, "object": kind, "created": created,
                             "model": self.model_name, "choices": [],
                             "usage": answer.usage(last)})
            yield "data: [DONE]\n\n"
            telemetry.finish(200, answer.prompt_tokens(last), last.completion_tokens)
        except Exception as exc:
            # Headers are sent: the error travels as an event, and the stream still ends the
            # way every OpenAI stream ends.
            err = error_for(exc, self.retry_after_s, rid)
            telemetry.finish(err.status, last.prompt_tokens, last.completion_tokens)
            yield event(err.body())
            yield "data: [DONE]\n\n"
        finally:
            # Client disconnected (this generator was closed or cancelled): closing the lease
            # cancels the handle's stream, which reaches the replica's generator and aborts the
            # request in the engine; and it gives the router its tokens back.
            if not lease.finished:
                telemetry.finish(499, last.prompt_tokens, last.completion_tokens)
            lease.close()
