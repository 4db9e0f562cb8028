"""The OpenAI-compatible ingress: validation, chat template, tokenization, SSE.

(No `from __future__ import annotations` here: FastAPI must see the real request classes
after Serve rewrites the route signatures.)

It turns requests into token ids + sampling parameters, sends them to a target replica, and
turns the committed-token events that stream back into OpenAI responses. It never knows which
engine backend runs behind the handle.
"""


import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.engines.types import EngineUnavailable, GenerateRequest, RequestOutput
from serve_app.models.kv_cache import KVCapacityError
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

logger = logging.getLogger("serve_app.ingress")

app = FastAPI(title="Kimi + DSpark (OpenAI-compatible)")


@app.exception_handler(OpenAIError)
async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


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


def _unwrap(exc: BaseException) -> BaseException:
    # Ray wraps a replica's exception; the original is its cause.
    return getattr(exc, "cause", None) or exc


def _error_for(exc: BaseException) -> OpenAIError:
    cause = _unwrap(exc)
    if isinstance(cause, OpenAIError):
        return cause
    if isinstance(cause, KVCapacityError):
        return OpenAIError(400, str(cause), code="kv_capacity_exceeded")
    if isinstance(cause, ValueError):
        return OpenAIError(400, str(cause))
    if isinstance(cause, EngineUnavailable):
        return OpenAIError(503, f"the engine is unavailable: {cause}", "server_error")
    logger.exception("request failed", exc_info=exc)
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

    # --- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "kimi-dspark-serve",
            "max_model_len": self.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest) -> Any:
        self._check_model(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = self.tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        return await self._serve(body, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Any:
        self._check_model(body)
        if body.echo or body.suffix:
            raise OpenAIError(400, "echo and suffix are not supported", param="echo")
        prompt = body.prompt_ids_or_text()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise OpenAIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return await self._serve(body, prompt_ids, chat=False)

    # --- the request path -----------------------------------------------------------------------

    def _check_model(self, body: _Request) -> None:
        if body.model != self.model_name:
            raise OpenAIError(404, f"the model {body.model!r} does not exist; this server serves "
                              f"{self.model_name!r}", param="model", code="model_not_found")

    async def _serve(self, body: _Request, prompt_ids: list[int], chat: bool) -> Any:
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
        stream = self.target.options(stream=True).generate.remote(
            GenerateRequest(rid, prompt_ids, params))
        # Wait for the first event before answering, so a refused request gets its 4xx.
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise OpenAIError(500, "the engine returned no output", "server_error") from None
        except Exception as exc:
            raise _error_for(exc) from None
        if body.stream:
            return StreamingResponse(self._sse(body, rid, chat, first, stream),
                                     media_type="text/event-stream")
        return await self._collect(body, rid, chat, first, stream)

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
                   stream: Any) -> AsyncIterator[str]:
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
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            # Client disconnected (this generator was closed): cancelling the handle's stream
            # reaches the replica, whose generator aborts the request in the engine.
            if not last.finished:
                stream.cancel()
