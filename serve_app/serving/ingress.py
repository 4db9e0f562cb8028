"""The OpenAI-compatible ingress: HTTP transport, limits, the chat format and streaming.

(No `from __future__ import annotations` here: FastAPI must see the real request classes
after Serve rewrites the route signatures.)

It turns requests into token ids + sampling parameters, hands them to its dispatcher
(dispatch.py: where a request runs), and turns the outputs that stream back into OpenAI
responses or SSE (responses.py). What a chat means (rendering, request semantics, output
parsing) is the chat format's (serve_app/chat/); which engine backend runs behind the handle,
and whether the app is disaggregated, the ingress never knows.

What a request meets, in order: the edge guard (edge.py: API key -> 401, body size -> 413,
anything unexpected -> an OpenAI-shaped 500), JSON parsing and the schema
(protocol/openai.py: every field, 400 naming it), the model name (404), the chat format's
rules (400), the prompt's size before and after tokenizing and max_tokens against the context
(400), the sampling policy (400), the router (per-client limits and queue -> 429, capacity ->
400, queue timeout -> 503), then the engine; failures as clients see them in errors.py.
"""


import asyncio
import functools
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from serve_app.chat.formats import ChatPlan, chat_format_for
from serve_app.chat.output import PlainOutput
from serve_app.chat.parameters import sampling_values
from serve_app.chat.segments import encode_prompt, text_bytes
from serve_app.config import AppConfig, context_length, media_config
from serve_app.observability.logs import get_logger, install_trace_ids
from serve_app.observability.request_telemetry import RequestTelemetry
from serve_app.protocol.generation import GenerateRequest
from serve_app.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    OpenAIRequest,
    new_id,
    quote,
    validation_error,
)
from serve_app.serving.dispatch import Dispatcher, Lease, serve_caller
from serve_app.serving.edge import (
    EdgeGuard,
    OpenAIJSONResponse,
    configure_edge,
    default_body_bytes,
    error_response,
)
from serve_app.serving.errors import error_for, unavailable
from serve_app.serving.health import HealthProbe
from serve_app.serving.responses import Answer, LeasedStream, Prompt, collect, sse
from serve_app.tokenizer import load_tokenizer
from serve_app.vision import ImageRejected, PreparedImage, load_images

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

    def __init__(self, target: DeploymentHandle, config: dict[str, Any]) -> None:
        """`target`: the deployment that answers (a disaggregated app's decode side, which
        has its requests prefilled on the prefill side itself)."""
        self.config = AppConfig.model_validate(config)
        self.tokenizer = load_tokenizer(self.config.models.tokenizer_path())
        # How the model sees images (None: it takes none, and the chat format refuses them).
        self.media = media_config(self.config)
        self.chat = chat_format_for(self.tokenizer, self.config.api.tool_strict_level,
                                    vision=self.media is not None)
        self.model_name = self.config.models.served_model_name
        self.max_model_len = context_length(self.config)
        ing = self.config.ingress
        edge = configure_edge(_api_keys(self.config),
                              ing.max_body_bytes or default_body_bytes(self.max_model_len,
                                                                       self.media is not None),
                              ing.expose_docs)
        self.retry_after_s = ing.retry_after_s
        self.keepalive_s = ing.sse_keepalive_s
        self._tokenize_pool = ThreadPoolExecutor(ing.tokenizer_threads,
                                                 thread_name_prefix="tokenize")
        self.health_probe = HealthProbe(target, ing.health_cache_s, ing.health_timeout_s)
        # Who we are, so the target can abort our requests if this process dies, and the
        # router (docs/router.md) behind the one place requests are sent from.
        # A disaggregated app's ingress fronts its decode pool.
        fronted = "decode" if self.config.disaggregation.enabled else "both"
        self.dispatcher = Dispatcher(target, self.config.admission(fronted), serve_caller(),
                                     ing.health_timeout_s)
        install_trace_ids()
        logger.info("ingress ready: %d API keys, body limit %d bytes, context %d tokens",
                    len(edge.key_digests), edge.max_body_bytes, self.max_model_len)

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
        engine); the queue length and recent routing decisions. Replicas that send requests
        on themselves (a disaggregated app's decode replicas) add their own stages' views,
        under "downstream" by replica."""
        view = await self.dispatcher.view()
        downstream = await self.dispatcher.downstream_views()
        if downstream:
            view["downstream"] = downstream
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
        """Token ids of the prompt (a chat's images loaded and expanded in it), computed off
        the event loop (a long prompt must not stall /health or other requests). A text that
        cannot fit the context even at the tokenizer's most bytes per token is refused
        without tokenizing it."""
        if isinstance(body, ChatCompletionRequest):
            plan = self.chat.plan(body)
            param, size = "messages", text_bytes(plan.segments)
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
        if size > self.max_model_len * self.tokenizer.max_token_bytes:
            raise OpenAIError(400, f"This model's maximum context length is "
                              f"{self.max_model_len} tokens; the {param} ({size} bytes of "
                              f"text) is longer than that", param=param,
                              code="context_length_exceeded")
        images = await self._load_images(plan) if plan is not None and plan.images else []
        work: Callable[[], tuple[list[int], list[int]]] = (
            functools.partial(encode_prompt, self.tokenizer, plan.segments, images)
            if plan is not None else lambda: (self.tokenizer.encode_text(text), []))
        if size <= INLINE_TOKENIZE_BYTES and not images:
            ids, offsets = work()
        else:  # an image prompt's pad runs are long lists: off the loop too
            ids, offsets = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, work)
        return Prompt(ids, plan, tuple(image.at(offset)
                                       for image, offset in zip(images, offsets, strict=True)))

    async def _load_images(self, plan: ChatPlan) -> list[PreparedImage]:
        """The plan's images decoded and preprocessed (serve_app/vision), in prompt order; a
        bad one is the client's 400 (413: too many bytes) naming its field."""
        assert self.media is not None  # the chat format refuses images without it
        try:
            return await load_images(plan.images, self.config.images, self.media)
        except ImageRejected as exc:
            raise OpenAIError(exc.status, exc.message, param=exc.param) from None

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
        max_tokens = self._limits(body, prompt.ids, prompt.plan is not None)
        thinking = bool(prompt.plan and prompt.plan.k3 and prompt.plan.k3.thinking)
        params = body.sampling(max_tokens, *sampling_values(
            self.config.api.parameter_policy, body, thinking),
            grammar=prompt.plan.grammar if prompt.plan else None)
        rid = new_id("chatcmpl" if prompt.plan else "cmpl")
        telemetry.span.set_attribute("request_id", rid)
        telemetry.span.set_attribute("max_tokens", max_tokens)
        telemetry.span.set_attribute("stream", body.stream)
        request = GenerateRequest(rid, prompt.ids, params, caller=self.dispatcher.caller,
                                  client=client, images=prompt.images)
        try:
            # Waits for the first output, so that a refused request gets its 4xx/5xx.
            lease: Lease | None = await self.dispatcher.dispatch(request, max_tokens)
        except Exception as exc:
            raise error_for(exc, self.retry_after_s, rid) from None
        assert lease is not None
        try:
            telemetry.first_token()
            answer = Answer(rid, self.model_name, prompt, self.chat.output(prompt.plan)
                            if prompt.plan else PlainOutput())
            if body.stream:
                include_usage = body.include_usage(
                    default=bool(prompt.plan and prompt.plan.stream_usage))
                response = LeasedStream(
                    sse(answer, lease, telemetry, include_usage, self.keepalive_s,
                        self.retry_after_s),
                    lease, functools.partial(telemetry.finish, 499, lease.first.prompt_tokens,
                                             lease.first.completion_tokens))
                lease = None  # the response owns it now
                return response
            result = await collect(answer, lease, self.retry_after_s)
            # Metrics, the closing log line and the span end (0.7-1 ms) run once the response
            # has left: they are the server's bookkeeping, not the client's latency. Neither a
            # Starlette BackgroundTask nor call_soon is late enough under Serve (the body is
            # forwarded by another task, after them); the time recorded is still this one.
            asyncio.get_running_loop().call_later(
                TELEMETRY_DELAY_S, telemetry.finish, 200, result["usage"]["prompt_tokens"],
                result["usage"]["completion_tokens"], time.perf_counter())
            return result
        finally:
            if lease is not None:
                lease.close()

