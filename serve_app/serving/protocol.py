"""OpenAI request/response shapes (the subset this server implements) and error bodies.

Extension: `usage` carries the speculative statistics under SGLang's names
(`spec_accept_length`, `spec_accept_rate`, `spec_verify_ct`,
`spec_correct_drafts_histogram`) when the engine speculated. Requests may also set `top_k`,
`stop_token_ids` and `ignore_eos` (SGLang/vLLM extensions).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from serve_app.engines.types import SamplingParams


class OpenAIError(Exception):
    """Raised anywhere in the ingress; rendered as {"error": {...}} with its status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Request(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI's own API does.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool | int | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling(self, default_max_tokens: int, max_tokens_limit: int) -> SamplingParams:
        if self.n != 1:
            raise OpenAIError(400, "n > 1 is not supported by this server", param="n")
        if self.logprobs:
            raise OpenAIError(400, "logprobs are not supported by this server", param="logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        if max_tokens > max_tokens_limit:
            raise OpenAIError(400, f"max_tokens={max_tokens} exceeds this server's limit "
                              f"{max_tokens_limit}", param="max_tokens")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=max_tokens, stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise OpenAIError(400, "only text content parts are supported",
                                  param="messages")
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def prompt_ids_or_text(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and all(isinstance(t, int) for t in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) == 1:
            return p[0]  # type: ignore[return-value]
        raise OpenAIError(400, "batched prompts are not supported; send one prompt per request",
                          param="prompt")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int,
          spec: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if spec:
        out |= {k: v for k, v in spec.items() if k.startswith("spec_")}
    return out


def now() -> int:
    return int(time.time())
