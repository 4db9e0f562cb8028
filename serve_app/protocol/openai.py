"""OpenAI request/response shapes (the subset this server implements) and error bodies.

Every field a client sends is validated here, once, before anything is tokenized or queued:
a bad value is a 400 that names the field. OpenAI fields this server does not implement are
refused when set (a client asking for JSON mode or a forced tool call must not get free text
it cannot tell apart); fields that do not change the output (`user`, `metadata`, `store`,
`service_tier`) are accepted. Unknown non-OpenAI fields are ignored, as vLLM and SGLang do.

Extension: `usage` carries the speculative statistics under SGLang's names
(`spec_accept_length`, `spec_accept_rate`, `spec_verify_ct`,
`spec_correct_drafts_histogram`) when the engine speculated. Requests may also set `top_k`,
`stop_token_ids` and `ignore_eos` (SGLang/vLLM extensions).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from serve_app.protocol.generation import SamplingParams
from serve_app.protocol.grammar import GrammarSpec

# Bounds that keep every accepted value meaningful to the sampler and the engine (and to
# SGLang, whose kernels take int32/int64).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_K = 2**31 - 1


class OpenAIError(Exception):
    """Raised anywhere in the ingress; rendered as {"error": {...}} with its status. The
    message is shown to clients: it never carries reprs, paths or internal addresses."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in one replica and re-raised in its caller's (a decode replica's failure on
        # the prefill side reaches the ingress as the error it is).
        return (type(self), (self.status, self.message, self.type, self.param, self.code,
                             self.headers))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def quote(value: object, limit: int = 64) -> str:
    """A client-supplied value as it may appear in an error message: JSON-quoted, ASCII-only
    (a lone surrogate or a control character cannot break the response), and cut short."""
    if not isinstance(value, str):
        return json.dumps(value, ensure_ascii=True, default=str)[:limit]
    text = value if len(value) <= limit else value[:limit] + "..."
    return json.dumps(text, ensure_ascii=True)


def _valid_unicode(value: str) -> str:
    # JSON may carry "\ud800": Python accepts the lone surrogate, the tokenizer (Rust, UTF-8)
    # and every JSON encoder downstream do not.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (not valid Unicode)") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Strictish(BaseModel):
    # Unknown fields are ignored (vLLM/SGLang behaviour); NaN and infinities are never numbers.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# OpenAI fields this server does not implement: the values that mean "not used" (numbers
# compare by value, so 0 also stands for 0.0), and why any other value is refused with a 400
# naming the field.
_LOGPROBS = "logprobs are not supported by this server"
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str | None]] = {
    # The deprecated forms of `tools` / `tool_choice`.
    "functions": ((None, []), "functions is deprecated and not supported; use tools"),
    "function_call": ((None, "none"), "function_call is deprecated and not supported; use "
                      "tool_choice"),
    "logit_bias": ((None, {}), None),
    "logprobs": ((None, False, 0), _LOGPROBS),
    "top_logprobs": ((None, 0), _LOGPROBS),
    "presence_penalty": ((None, 0), "presence_penalty is not supported by this server (only 0)"),
    "frequency_penalty": ((None, 0), "frequency_penalty is not supported by this server "
                          "(only 0)"),
    "repetition_penalty": ((None, 1), "repetition_penalty is not supported by this server "
                           "(only 1)"),
    "min_p": ((None, 0), "min_p is not supported by this server (only 0)"),
    "min_tokens": ((None, 0), None),
    "best_of": ((None, 1), "best_of > 1 is not supported by this server"),
    "n": ((None, 1), "n > 1 is not supported by this server"),
    "prediction": ((None,), None),
    "audio": ((None,), None),
    "modalities": ((None, ["text"]), None),
    "web_search_options": ((None,), None),
    "guided_json": ((None,), None),
    "guided_regex": ((None,), None),
    "guided_choice": ((None,), None),
    "guided_grammar": ((None,), None),
}
# Where OpenAI documents a range, an out-of-range value gets the range in its message.
_RANGES = {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
           "top_logprobs": (0, 20)}


def _equal(a: Any, b: Any) -> bool:
    # True == 1 in Python; a client sending `"n": true` did not ask for n=1.
    return (type(a) is type(b) and a == b) or (
        isinstance(a, int | float) and not isinstance(a, bool)
        and isinstance(b, int | float) and not isinstance(b, bool) and a == b)


def _refuse_unsupported(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    for name, (allowed, why) in _UNSUPPORTED.items():
        if name not in data or any(_equal(data[name], a) for a in allowed):
            continue
        value = data[name]
        if name in _RANGES and isinstance(value, int | float) and not isinstance(value, bool):
            lo, hi = _RANGES[name]
            if not lo <= value <= hi:
                raise OpenAIError(400, f"{name}={quote(value)} is out of range [{lo}, {hi}]",
                                  param=name)
        raise OpenAIError(400, why or f"{name} is not supported by this server", param=name,
                          code="unsupported_parameter")
    if data.get("stream_options") is not None and data.get("stream") is not True:
        raise OpenAIError(400, "stream_options is only allowed when stream is true",
                          param="stream_options")
    return data


class StreamOptions(_Strictish):
    include_usage: bool | None = None  # None: the chat format's default


class OpenAIRequest(_Strictish):
    """The fields chat and completion requests share (their sampling, limits and stream)."""

    model: Text = Field(max_length=256)
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOP_K)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refuse_unsupported(data)

    @model_validator(mode="after")
    def _stops(self) -> OpenAIRequest:
        stops = self.stop_list
        if any(not s for s in stops):
            raise ValueError("stop: stop strings must be non-empty")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop: at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: a stop sequence may have at most {MAX_STOP_CHARS} "
                             "characters")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self, default: bool = False) -> bool:
        asked = self.stream_options.include_usage if self.stream_options else None
        return default if asked is None else asked

    def requested_max_tokens(self, default_max_tokens: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default_max_tokens

    def sampling(self, max_tokens: int, temperature: float, top_p: float,
                 grammar: GrammarSpec | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=temperature, top_p=top_p, top_k=self.top_k,
            max_tokens=max_tokens, stop=tuple(self.stop_list),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            seed=self.seed, grammar=grammar,
        )


# A content part's URL may be a data URL of OpenAI's 20 MB per-image limit (base64: 4/3 of
# it, plus its header); longer is refused here, before anything decodes it. The deployment's
# own limits (serve_app/vision: bytes, pixels, images per request) are checked on the image.
MAX_IMAGE_URL_CHARS = 20 * 2**20 * 4 // 3 + 1024
IMAGE_PART_TYPES = ("image_url", "input_image")
# Parts of media this server does not take: refused by name (not silently dropped).
_MEDIA_PART_TYPES = {"video_url": "video", "input_video": "video", "video": "video",
                     "audio_url": "audio", "input_audio": "audio", "audio": "audio",
                     "file": "file", "input_file": "file"}
_DETAILS = ("auto", "low", "high")


@dataclass(frozen=True)
class ImagePart:
    """An image content part as sent: its URL (a data URL, or http(s) where the deployment
    fetches) and the field it came from, which every error about the image names."""

    where: str  # the part: messages[i].content[j]
    url: str
    detail: str | None = None  # OpenAI's hint; K3's processor has no use for it

    @property
    def param(self) -> str:
        """The field an error about the image names."""
        return f"{self.where}.image_url"


class ContentPart(BaseModel):
    """Any content part: its fields are read by `ChatMessage.parts`, which names the field
    of every malformed one."""

    model_config = ConfigDict(extra="allow")

    type: Text = Field(max_length=64)


def _part_text(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise OpenAIError(400, "a text content part needs a string `text`", param=param)
    try:
        return _valid_unicode(value)
    except ValueError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param=param) from None


def _image_part(where: str, part: ContentPart) -> ImagePart:
    """`{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` (Chat Completions) or
    `{"type": "input_image", "image_url": "...", "detail": ...}` (Responses): either type
    with either form of `image_url`, as SGLang 0.5.23 normalises them for K3
    (srt/entrypoints/openai/serving_chat.py, _prepare_kimi_k3_messages)."""
    fields = part.model_extra or {}
    image = fields.get("image_url")
    param = f"{where}.image_url"
    detail = fields.get("detail")
    detail_param = f"{where}.detail"
    if isinstance(image, dict):
        url, url_param = image.get("url"), f"{param}.url"
        if "detail" in image:
            detail, detail_param = image["detail"], f"{param}.detail"
    elif isinstance(image, str):
        url, url_param = image, param
    elif image is None:
        raise OpenAIError(400, f"an {part.type} content part needs `image_url`", param=param)
    else:
        raise OpenAIError(400, 'image_url must be an object {"url": ...} or a URL string',
                          param=param)
    if not isinstance(url, str) or not url:
        raise OpenAIError(400, "the image URL must be a non-empty string", param=url_param)
    if len(url) > MAX_IMAGE_URL_CHARS:
        raise OpenAIError(400, f"the image URL has {len(url)} characters; at most "
                          f"{MAX_IMAGE_URL_CHARS} (a 20 MB image as a data URL)", param=url_param)
    try:
        _valid_unicode(url)
    except ValueError as exc:
        raise OpenAIError(400, f"{url_param}: {exc}", param=url_param) from None
    if detail is not None and detail not in _DETAILS:
        raise OpenAIError(400, f"detail {quote(detail)} is not one of auto, low, high",
                          param=detail_param)
    return ImagePart(where, url, detail)


class ChatMessage(BaseModel):
    """One message. The fields of tool calling and reasoning are taken as sent and checked by
    the chat format, which knows what its model can express (errors name the field)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = Field(default=None, max_length=256)
    tool_calls: Any = None
    tool_call_id: Any = None
    reasoning_content: Text | None = None
    reasoning: Text | None = None
    tools: Any = None

    def parts(self, where: str) -> list[str | ImagePart]:
        """The content's text and image parts in order (`where`: this message's field,
        `messages[i]`); any other part, or a malformed one, is a 400 naming its field."""
        if not isinstance(self.content, list):
            return [self.content] if self.content else []
        out: list[str | ImagePart] = []
        for j, part in enumerate(self.content):
            at = f"{where}.content[{j}]"
            if part.type in ("text", "input_text"):
                out.append(_part_text(f"{at}.text", (part.model_extra or {}).get("text")))
            elif part.type in IMAGE_PART_TYPES:
                out.append(_image_part(at, part))
            elif part.type in _MEDIA_PART_TYPES:
                raise OpenAIError(400, f"{_MEDIA_PART_TYPES[part.type]} content parts "
                                  f"({quote(part.type)}) are not supported by this server; "
                                  "send text and image parts", param=f"{at}.type")
            else:
                raise OpenAIError(400, f"content part type {quote(part.type)} is not "
                                  "supported; only text, image_url and input_image",
                                  param=f"{at}.type")
        return out

    def text_parts(self, where: str) -> list[str]:
        """The content's text parts, for a model without vision input: an image part is a
        400 naming it."""
        out = []
        for part in self.parts(where):
            if isinstance(part, ImagePart):
                raise no_vision(part)
            out.append(part)
        return out

    def text(self, where: str) -> str:
        return "".join(self.text_parts(where))


def no_vision(part: ImagePart) -> OpenAIError:
    """An image part sent to a model without vision input: a 400 naming the part."""
    return OpenAIError(400, "the served model has no vision input", param=part.where)


# Chat fields whose meaning the chat format decides (K3's contract, or a 400 where a
# checkpoint's template cannot express them); /v1/completions refuses them.
CHAT_FORMAT_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format",
                      "thinking", "reasoning_effort", "chat_template_kwargs")


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    thinking: Any = None
    reasoning_effort: Any = None
    chat_template_kwargs: Any = None

    def sent(self, name: str) -> bool:
        """The client set this field to something other than null."""
        return name in self.model_fields_set and getattr(self, name) is not None


class CompletionRequest(OpenAIRequest):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    suffix: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_chat_fields(cls, data: Any) -> Any:
        for name in CHAT_FORMAT_FIELDS:
            if isinstance(data, dict) and data.get(name) is not None:
                raise OpenAIError(400, f"{name} is a chat field: send it to "
                                  "/v1/chat/completions", param=name)
        return data

    @model_validator(mode="after")
    def _no_echo_or_suffix(self) -> CompletionRequest:
        if self.echo:
            raise OpenAIError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported by this server", param="suffix")
        return self

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


def _field_path(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content', 'function-after[...]') -> 'messages[0].content': indices in
    brackets, the union-member tags pydantic adds dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return json.dumps(out, ensure_ascii=True)[1:-1]  # a client controls its own JSON's keys


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(exc: ValidationError) -> OpenAIError:
    """A pydantic error as one 400 naming every bad field (one message per field: of a union's
    failed members, the first, which is the most specific here)."""
    messages: dict[str, str] = {}
    for e in exc.errors(include_url=False, include_input=False):
        loc = _field_path(tuple(e.get("loc", ())))
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        head, sep, rest = msg.partition(": ")
        if not loc and sep and head.isidentifier():  # a model-level check naming its field
            loc, msg = head, rest
        messages.setdefault(loc, msg)
        if len(messages) == 8:
            break
    parts = [f"{loc}: {msg}" if loc else msg for loc, msg in messages.items()]
    first = next(iter(messages), "") or None
    return OpenAIError(400, "invalid request: " + "; ".join(parts), param=first)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int,
          spec: dict[str, Any] | None, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object (with `prompt_tokens_details.cached_tokens`: the prompt tokens the
    prefix cache served), plus SGLang's speculative-decoding statistics."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens,
                           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if spec:
        out |= {k: v for k, v in spec.items() if k.startswith("spec_")}
    return out


def now() -> int:
    return int(time.time())
