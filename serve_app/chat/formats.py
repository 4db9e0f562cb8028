"""The chat format a checkpoint speaks, chosen from its tokenizer folder (never from a flag):
K3's XTML when the folder declares the XTML control tokens, else the folder's Jinja template.

A format turns a validated request into a plan (segments to encode, what the output parser
must know) and makes the per-request output assembler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serve_app.chat import k3_request
from serve_app.chat.jinja_render import template_chat
from serve_app.chat.k3_request import K3Request
from serve_app.chat.output import ChatOutput, PlainOutput, XTMLOutput
from serve_app.chat.segments import Segment, has_media_tokens, image_parts
from serve_app.chat.xtml_output import XTMLControls, XTMLOutputParser
from serve_app.chat.xtml_render import (
    CLOSE,
    END_OF_MSG,
    GENERATION_STUB_TOKENS,
    MARKERS,
    OPEN,
    SEP,
    RenderError,
    render,
)
from serve_app.protocol.grammar import GrammarSpec, ToolStrictLevel
from serve_app.protocol.openai import (
    CHAT_FORMAT_FIELDS,
    ChatCompletionRequest,
    ImagePart,
    OpenAIError,
    no_vision,
)
from serve_app.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatPlan:
    segments: list[Segment]
    # Trailing prompt tokens that are the format's generation stub, not the client's prompt
    # (usage.prompt_tokens leaves them out).
    stub_tokens: int = 0
    # Streams carry usage even without stream_options.include_usage (K3's API does).
    stream_usage: bool = False
    k3: K3Request | None = None
    grammar: GrammarSpec | None = None  # what the output must match (serve_app/grammar)
    # The image parts, in prompt order: the i-th image segment of `segments` is images[i].
    images: tuple[ImagePart, ...] = ()


class ChatFormat(Protocol):
    name: str

    def plan(self, body: ChatCompletionRequest) -> ChatPlan: ...

    def output(self, plan: ChatPlan) -> ChatOutput: ...


class JinjaFormat:
    """A checkpoint's Jinja template: plain conversations of system, user and assistant
    text. What the template cannot express is refused, not ignored."""

    name = "jinja"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.chat = template_chat(tokenizer)

    def plan(self, body: ChatCompletionRequest) -> ChatPlan:
        # A JSON response_format needs nothing of the template: the grammar makes the whole
        # answer that JSON.
        kind, schema, strict = k3_request.response_format(body.response_format)
        grammar = (k3_request.response_grammar(kind, schema, strict, "plain")
                   if kind is not None else None)
        for name in CHAT_FORMAT_FIELDS:
            if name == "response_format":
                continue
            if body.sent(name) and not _neutral(name, getattr(body, name)):
                raise OpenAIError(400, f"{name} is not supported by this model's chat format",
                                  param=name, code="unsupported_parameter")
        messages = []
        for i, m in enumerate(body.messages):
            role = "system" if m.role == "developer" else m.role
            if role == "tool" or m.tool_calls or m.tools not in (None, []):
                raise OpenAIError(400, "tool messages and tool calls are not supported by this "
                                  "model's chat format", param=f"messages[{i}]")
            messages.append({"role": role, "content": m.text(f"messages[{i}]")})
        try:
            return ChatPlan(self.chat.segments(messages), grammar=grammar)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None

    def output(self, plan: ChatPlan) -> ChatOutput:
        return PlainOutput()


def _neutral(name: str, value: object) -> bool:
    """Values that ask nothing of the format."""
    return {"tools": value == [], "tool_choice": value in ("none", "auto"),
            "parallel_tool_calls": isinstance(value, bool)}.get(name, False)


class K3Format:
    name = "k3"

    def __init__(self, tokenizer: Tokenizer, tool_strict_level: ToolStrictLevel = "off",
                 vision: bool = False) -> None:
        """`vision`: the served model takes images (its checkpoint has a vision tower and a
        preprocessing config); it needs the tokenizer's media tokens too."""
        ids = tokenizer.special_ids
        self.controls = XTMLControls(ids[OPEN], ids[CLOSE], ids[SEP], ids[END_OF_MSG])
        self.tokenizer = tokenizer
        self.tool_strict_level = tool_strict_level
        self.vision = vision and has_media_tokens(ids)

    def plan(self, body: ChatCompletionRequest) -> ChatPlan:
        request = k3_request.parse(body, tool_strict_level=self.tool_strict_level)
        try:
            segments = render(request.messages, request.options)
        except RenderError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
        images = image_parts(segments)
        if images and not self.vision:
            raise no_vision(images[0])
        return ChatPlan(segments, GENERATION_STUB_TOKENS, stream_usage=True, k3=request,
                        grammar=request.grammar, images=images)

    def output(self, plan: ChatPlan) -> ChatOutput:
        assert plan.k3 is not None
        tok = self.tokenizer
        parser = XTMLOutputParser(
            self.controls, tok.token_bytes, thinking=plan.k3.thinking,
            tools_allowed=plan.k3.tools_allowed, is_special=tok.is_special,
            json_values=plan.grammar is not None and plan.grammar.kind == "tool_call")
        return XTMLOutput(parser, plan.k3.thinking, frozenset(plan.k3.tool_names))


def chat_format_for(tokenizer: Tokenizer, tool_strict_level: ToolStrictLevel = "off",
                    vision: bool = False) -> ChatFormat:
    """The tokenizer folder's chat format (`tool_strict_level`: the server's, for K3; a Jinja
    template's format declares no tools; `vision`: the model takes images, for K3 only: a
    Jinja template's images are refused)."""
    if all(m in tokenizer.special_ids for m in MARKERS):
        return K3Format(tokenizer, tool_strict_level, vision)
    if tokenizer.chat_template is not None:
        return JinjaFormat(tokenizer)
    raise ValueError("the tokenizer folder declares neither K3's XTML control tokens "
                     f"({', '.join(MARKERS)}) nor a Jinja chat_template")
