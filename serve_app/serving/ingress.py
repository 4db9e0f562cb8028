"""The OpenAI-compatible ingress: validation, chat template, tokenization, SSE.

(No `from __future__ import annotations` here: FastAPI must see the real request classes
after Serve rewrites the route signatures.)

It turns requests into token ids + sampling parameters, sends them to a target replica, and
turns the committed-token events that stream back into OpenAI responses. It never knows which
engine backend runs behind the handle.
"""


import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.engines.types import EngineUnavailable, GenerateRequest, RequestOutput
from serve_app.models.kv_cache import KVCapacityError
from serve_app.observability.logs import get_logger, install_trace_ids
from serve_app.observability.metrics import app_metrics
from serve_app.observability.tracing import tracer
from serve_app.routing.policy import QueueFull, RequestTooLarge, RouterError
from serve_app.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    _Request,
    new_id,
    now,
    usage,
)
from serve_app.tokenizer import load_tokenizer

logger = get_logger("ingress")

app = FastAPI(title="Kimi + DSpark (OpenAI-compatible)")


@app.exception_handler(OpenAIError)
async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status,
                        headers=getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        err = OpenAIError(400, "the request body is not valid JSON")
    else:
        parts = []
        for e in errors:
            loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        first = errors[0].get("loc", ()) if errors else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        err = OpenAIError(400, "invalid request: " + "; ".join(parts), param=param)
    return JSONResponse(err.body(), status_code=400)


class RequestTelemetry:
    """One request's span, metrics and closing log line (the ingress view: arrival to last
    token, as the client sees it)."""

    def __init__(self, endpoint: str, model: str) -> None:
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.model = model
        self.span = tracer().start_span("ingress.request",
                                        attributes={"endpoint": endpoint, "model": model})
        self._done = False

    def active(self) -> Any:
        """Make the span current, so handle calls made inside carry it to the replicas."""
        return trace.use_span(self.span, end_on_exit=False)

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def finish(self, status: int, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        if self._done:
            return
        self._done = True
        end = time.perf_counter()
        e2e = end - self.started
        ttft = (self.first_token_at - self.started) if self.first_token_at else None
        m = app_metrics()
        if m is not None:
            t = {"model": self.model}
            m.requests.inc(1, tags={**t, "status": str(status)})
            if status == 200:
                m.e2e_latency.observe(e2e, tags=t)
                m.prompt_tokens.inc(prompt_tokens, tags=t)
                if completion_tokens:
                    m.generation_tokens.inc(completion_tokens, tags=t)
                if ttft is not None:
                    m.time_to_first_token.observe(ttft, tags=t)
                    if completion_tokens > 1:
                        m.time_per_output_token.observe(
                            (e2e - ttft) / (completion_tokens - 1), tags=t)
        self.span.set_attribute("status", status)
        self.span.set_attribute("prompt_tokens", prompt_tokens)
        self.span.set_attribute("completion_tokens", completion_tokens)
        if ttft is not None:
            self.span.set_attribute("ttft_s", ttft)
        with self.active():
            logger.info("request finished: status %d, %d prompt + %d completion tokens, "
                        "%.1f ms", status, prompt_tokens, completion_tokens, e2e * 1e3,
                        extra={"status": status, "prompt_tokens": prompt_tokens,
                               "completion_tokens": completion_tokens,
                               "e2e_ms": round(e2e * 1e3, 2)})
        self.span.end()


def _unwrap(exc: BaseException) -> BaseException:
    # Ray wraps a replica's exception; the original is its cause.
    return getattr(exc, "cause", None) or exc


def _router_error(exc: RouterError) -> OpenAIError:
    """Router refusals: 400 (larger than any replica), 429 + Retry-After (queue full), 503
    (queue timeout)."""
    if isinstance(exc, QueueFull):
        err = OpenAIError(429, str(exc), "rate_limit_error", code="router_queue_full")
        err.headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}  # type: ignore[attr-defined]
        return err
    if isinstance(exc, RequestTooLarge):
        return OpenAIError(400, str(exc), param="max_tokens", code="kv_capacity_exceeded")
    return OpenAIError(exc.status, str(exc), "server_error", code="router_queue_timeout")


def _error_for(exc: BaseException) -> OpenAIError:
    cause = _unwrap(exc)
    if isinstance(cause, OpenAIError):
        return cause
    if isinstance(cause, RouterError):
        return _router_error(cause)
    if isinstance(cause, KVCapacityError):
        return OpenAIError(400, str(cause), code="kv_capacity_exceeded")
    if isinstance(cause, ValueError):
        return OpenAIError(400, str(cause))
    if isinstance(cause, EngineUnavailable):
        return OpenAIError(503, f"the engine is unavailable: {cause}", "server_error")
    logger.error("request failed", exc_info=exc)
    return OpenAIError(500, f"internal error: {cause!r}", "server_error")


# Decorated here, at import, so that every process importing this module (the replicas too)
# gets the FastAPI app with these methods bound as routes.
@serve.ingress(app)
class OpenAIIngress:
    """The body of the ingress deployment."""

    def __init__(self, target: DeploymentHandle, config: dict[str, Any]) -> None:
        self.config = AppConfig.model_validate(config)
        self.target = target
        self.tokenizer = load_tokenizer(self.config.models.tokenizer_path())
        self.model_name = self.config.models.served_model_name
        from serve_app.app import context_length

        self.max_model_len = context_length(self.config)
        install_trace_ids()
        # The long-context router (docs/router.md): None = Serve's own routing.
        self.router = None
        if self.config.router.policy != "ray_default":
            from serve_app.serving.admission import stage_for

            self.router = stage_for("TargetDeployment",
                                    self.config.router.settings(self.config.engine.backend))

    # --- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/router")
    async def router_state(self) -> dict[str, Any]:
        """Per-replica KV commitment, queue length and recent routing decisions."""
        return self.router.snapshot() if self.router else {"policy": "ray_default"}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "kimi-dspark-serve",
            "max_model_len": self.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest) -> Any:
        telemetry = RequestTelemetry("chat.completions", body.model)
        with telemetry.active():
            try:
                self._check_model(body)
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                try:
                    prompt_ids = self.tokenizer.apply_chat_template(messages)
                except ValueError as exc:
                    raise OpenAIError(400, str(exc), param="messages") from None
                return await self._serve(body, prompt_ids, True, telemetry)
            except OpenAIError as exc:
                telemetry.finish(exc.status)
                raise

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Any:
        telemetry = RequestTelemetry("completions", body.model)
        with telemetry.active():
            try:
                self._check_model(body)
                if body.echo or body.suffix:
                    raise OpenAIError(400, "echo and suffix are not supported", param="echo")
                prompt = body.prompt_ids_or_text()
                prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                vocab = self.tokenizer.vocab_size
                if any(not 0 <= t < vocab for t in prompt_ids):
                    raise OpenAIError(400, f"prompt token ids must be in [0, {vocab})",
                                      param="prompt")
                return await self._serve(body, prompt_ids, False, telemetry)
            except OpenAIError as exc:
                telemetry.finish(exc.status)
                raise

    # --- the request path -----------------------------------------------------------------------

    def _check_model(self, body: _Request) -> None:
        if body.model != self.model_name:
            raise OpenAIError(404, f"the model {body.model!r} does not exist; this server serves "
                              f"{self.model_name!r}", param="model", code="model_not_found")

    async def _serve(self, body: _Request, prompt_ids: list[int], chat: bool,
                     telemetry: RequestTelemetry) -> Any:
        if not prompt_ids:
            raise OpenAIError(400, "the prompt is empty", param="messages" if chat else "prompt")
        params = body.sampling(self.config.ingress.default_max_tokens,
                               self.config.ingress.max_tokens_limit)
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise OpenAIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {total} tokens ({len(prompt_ids)} in the "
                f"{'messages' if chat else 'prompt'}, {params.max_tokens} in the completion).",
                param="max_tokens", code="context_length_exceeded")
        rid = new_id("chatcmpl" if chat else "cmpl")
        telemetry.span.set_attribute("request_id", rid)
        telemetry.span.set_attribute("max_tokens", params.max_tokens)
        telemetry.span.set_attribute("stream", body.stream)
        if self.router is not None:
            await self._admit(rid, prompt_ids, params.max_tokens)
        stream = self.target.options(stream=True).generate.remote(
            GenerateRequest(rid, prompt_ids, params))
        # Wait for the first event before answering, so a refused request gets its 4xx.
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise OpenAIError(500, "the engine returned no output", "server_error") from None
        except Exception as exc:
            if self.router is not None:
                self.router.release(rid)  # idempotent with the routing hook
            raise _error_for(exc) from None
        if self.router is not None:
            self.router.prefill_done(rid)
        telemetry.first_token()
        if body.stream:
            return StreamingResponse(self._sse(body, rid, chat, first, stream, telemetry),
                                     media_type="text/event-stream")
        response = await self._collect(body, rid, chat, first, stream)
        telemetry.finish(200, response["usage"]["prompt_tokens"],
                         response["usage"]["completion_tokens"])
        return response

    async def _admit(self, rid: str, prompt_ids: list[int], max_tokens: int) -> None:
        assert self.router is not None
        if not self.router.ready:
            # The handle's router (and with it the replicas' KV capacities) exists only after
            # this process's first call on the handle: make one that needs no routing decision.
            try:
                await self.target.capacity.remote()
            except Exception as exc:
                raise _error_for(exc) from None
        try:
            await self.router.admit(rid, prompt_ids, max_tokens)
        except RouterError as exc:
            raise _router_error(exc) from None

    async def _collect(self, body: _Request, rid: str, chat: bool, first: RequestOutput,
                       stream: AsyncIterator[RequestOutput]) -> dict[str, Any]:
        text, last = first.text, first
        try:
            if not first.finished:
                async for out in stream:
                    text += out.text
                    last = out
        except Exception as exc:
            raise _error_for(exc) from None
        finally:
            if not last.finished:  # cancelled: the client went away
                stream.cancel()  # type: ignore[attr-defined]
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason,
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": now(), "model": self.model_name, "choices": [choice],
            "usage": usage(last.prompt_tokens, last.completion_tokens, last.spec),
        }

    async def _sse(self, body: _Request, rid: str, chat: bool, first: RequestOutput,
                   stream: Any, telemetry: RequestTelemetry) -> AsyncIterator[str]:
        created = now()
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                          "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish,
                          "logprobs": None}
            payload: dict[str, Any] = {"id": rid, "object": kind, "created": created,
                                       "model": self.model_name, "choices": [choice]}
            if body.include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        last = first
        try:
            yield chunk(first.text, None, role=True)
            if not first.finished:
                async for out in stream:
                    last = out
                    if out.text:
                        yield chunk(out.text, None)
            yield chunk(None if chat else "", last.finish_reason)
            if body.include_usage:
                payload = {"id": rid, "object": kind, "created": created,
                           "model": self.model_name, "choices": [],
                           "usage": usage(last.prompt_tokens, last.completion_tokens, last.spec)}
                yield f"data: {json.dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:
            err = _error_for(exc)
            telemetry.finish(err.status, last.prompt_tokens, last.completion_tokens)
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            # Client disconnected (this generator was closed): cancelling the handle's stream
            # reaches the replica, whose generator aborts the request in the engine.
            if not last.finished:
                stream.cancel()
                telemetry.finish(499, last.prompt_tokens, last.completion_tokens)
            else:
                telemetry.finish(200, last.prompt_tokens, last.completion_tokens)
