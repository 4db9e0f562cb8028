"""A dispatched request's outputs as OpenAI responses: the whole body, or its SSE stream.

What the model's tokens mean (channels, tool calls, the finish reason) is the chat format's
output assembler (serve_app/chat/output.py); here they become choices, chunks and usage, and
the stream's lease is closed however sending ends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from serve_app.chat.formats import ChatPlan
from serve_app.chat.output import ChatOutput
from serve_app.observability.request_telemetry import RequestTelemetry
from serve_app.protocol.generation import RequestOutput
from serve_app.protocol.media import ImageInput
from serve_app.protocol.openai import now, usage
from serve_app.serving.dispatch import Lease
from serve_app.serving.errors import error_for


@dataclass
class Prompt:
    ids: list[int]
    plan: ChatPlan | None = None  # None: a /v1/completions prompt
    images: tuple[ImageInput, ...] = ()  # their pad runs are in `ids`


@dataclass
class Answer:
    """One response being assembled by its output assembler (the chat format's; for a
    completion the engine's text as it came, PlainOutput); usage without the format's
    generation stub."""

    request_id: str
    model: str
    prompt: Prompt
    output: ChatOutput

    @property
    def chat(self) -> bool:
        return self.prompt.plan is not None

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

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


async def paced(stream: Any, interval: float | None) -> AsyncIterator[Any]:
    """`stream`'s items, and None whenever `interval` seconds pass without one. The pending
    `__anext__` is waited on, never cancelled by the timeout (a cancelled one would end the
    stream); it is cancelled only when the consumer stops early."""
    iterator = stream.__aiter__()
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
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


async def collect(answer: Answer, lease: Lease, retry_after_s: int) -> dict[str, Any]:
    """The whole response of a non-streaming request."""
    outs: list[RequestOutput] = [lease.first]
    try:
        if not lease.finished:
            async for out in lease:
                outs.append(out)
    except Exception as exc:
        raise error_for(exc, retry_after_s, answer.request_id) from None
    last = outs[-1]
    lease.finished = last.finished
    for out in outs:
        answer.output.feed(out)
    finish = answer.output.finish(last.finish_reason)[1]
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None,
                              **answer.finish_fields(last)}
    if answer.chat:
        choice["message"] = answer.output.message()
    else:
        choice["text"] = "".join(o.text for o in outs)
    return {"id": answer.request_id, "object": answer.kind, "created": now(),
            "model": answer.model, "choices": [choice], "usage": answer.usage(last)}


async def sse(answer: Answer, lease: Lease, telemetry: RequestTelemetry, include_usage: bool,
              keepalive_s: float | None, retry_after_s: int) -> AsyncIterator[str]:
    """The SSE events of a streaming request, ending as every OpenAI stream ends (an error
    after the headers were sent travels as an event). A stream silent for `keepalive_s` gets
    an SSE comment, so that read timeouts of clients and proxies do not end it."""
    created, chat = now(), answer.chat
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=True)}\n\n"

    def chunk(delta: dict[str, Any], finish: str | None = None, **fields: Any) -> str:
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                      "logprobs": None, **fields}
        else:
            choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish,
                      "logprobs": None, **fields}
        payload: dict[str, Any] = {"id": answer.request_id, "object": kind, "created": created,
                                   "model": answer.model, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return event(payload)

    first: RequestOutput = lease.first
    last = first
    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        for delta in answer.output.feed(first):
            yield chunk(delta)
        sent = time.monotonic()
        if not lease.finished:
            async for out in paced(lease, keepalive_s):
                if out is not None:
                    last = out
                    for delta in answer.output.feed(out):
                        yield chunk(delta)
                        sent = time.monotonic()
                # Outputs that add no delta (a typed argument's value is sent when it
                # closes) are silence on the wire too.
                if keepalive_s and time.monotonic() - sent >= keepalive_s:
                    yield ": keep-alive\n\n"
                    sent = time.monotonic()
        lease.finished = last.finished
        deltas, finish = answer.output.finish(last.finish_reason)
        for delta in deltas:
            yield chunk(delta)
        yield chunk({}, finish, **answer.finish_fields(last))
        if include_usage:
            yield event({"id": answer.request_id, "object": kind, "created": created,
                         "model": answer.model, "choices": [], "usage": answer.usage(last)})
        yield "data: [DONE]\n\n"
        telemetry.finish(200, answer.prompt_tokens(last), last.completion_tokens)
    except Exception as exc:
        err = error_for(exc, retry_after_s, answer.request_id)
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
