"""Kimi K3's chat format (XTML) rendered to segments: the project's own renderer.

A K3 checkpoint renders its chats in Python (`encoding_k3.py`, remote code this server never
runs); this module renders the same bytes from the contract in
`docs/chat-format.md` (sources: Moonshot's Kimi Vendor Verifier, SGLang 0.5.23, the MLX port).

The tag grammar: `<|open|>NAME key="value"...<|sep|>` ... `<|close|>NAME<|sep|>`, a message
ends with `<|end_of_msg|>`. The four markers are control tokens; tag names, attributes
(each attribute as four text segments: ` key`, `="`, the escaped value, `"`) and every body are
text segments, so no client string can become a marker.

An image part renders as an image segment exactly where K3's renderer puts its image prompt:
in the content of a user, system, tool or assistant message (the checkpoint's
`encoding_k3.py`, `_render_content_segments`), in the order of the content's parts.

Prompt order: request-level tool declaration, thinking effort, the messages (a system message
with `tools` declares them in place), tool_choice, response_format, the generation prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from serve_app.chat.segments import Segment, control, image, text
from serve_app.protocol.openai import ImagePart

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
EFFORTS = ("low", "high", "max")
# The generation prompt's last three tokens (`<|open|>think<|sep|>` or
# `<|open|>response<|sep|>`): model input, but not counted in usage.prompt_tokens.
GENERATION_STUB_TOKENS = 3


@dataclass(frozen=True)
class HistoryCall:
    """A tool call in an assistant message of the history."""

    name: str
    id: str | None = None
    # The parsed arguments object (keys in the client's order); None with `raw` set: the
    # client's string did not parse, so it renders byte-exact in a json block.
    arguments: dict[str, Any] | None = None
    raw: str | None = None


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant or tool (developer is mapped to system earlier)
    parts: tuple[str | ImagePart, ...] = ()  # the content's text and image parts, in order
    name: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[HistoryCall, ...] = ()
    tool_call_id: str | None = None
    tools: tuple[dict[str, Any], ...] = ()  # a system message's dynamic tool declaration


@dataclass(frozen=True)
class RenderOptions:
    thinking: bool = True
    effort: str | None = "max"  # rendered only with thinking on
    tools: tuple[dict[str, Any], ...] = ()  # request-level declarations, as the client sent them
    tool_choice: str | None = None  # "required" / "none" render a message; anything else none
    response_format: str | None = None  # "json_object" / "json_schema"
    response_schema: Any = None
    add_generation_prompt: bool = True


def deep_sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: deep_sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [deep_sorted(v) for v in value]
    return value


def compact_json(value: Any) -> str:
    """Declarations and schemas: keys sorted at every depth, compact, non-ASCII kept."""
    return json.dumps(deep_sorted(value), ensure_ascii=False, separators=(",", ":"))


def escape_attribute(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def argument_type(value: Any) -> str:
    if isinstance(value, bool):  # before numbers: True is an int in Python
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def argument_text(value: Any) -> str:
    # Strings raw; everything else JSON with the default separators (not the compact ones).
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _open(tag: str, attrs: Iterable[tuple[str, str]] = ()) -> list[Segment]:
    out = [control(OPEN), text(tag)]
    for key, value in attrs:
        out += [text(f" {key}"), text('="'), text(escape_attribute(value)), text('"')]
    return [*out, control(SEP)]


def _close(tag: str) -> list[Segment]:
    return [control(CLOSE), text(tag), control(SEP)]


def _message(attrs: list[tuple[str, str]], body: list[Segment]) -> list[Segment]:
    return [*_open("message", attrs), *body, *_close("message"), control(END_OF_MSG)]


def _internal(kind: str, body: str) -> list[Segment]:
    return _message([("role", "system"), ("type", kind)], [text(body.strip())])


def _role(role: str, name: str | None) -> list[tuple[str, str]]:
    return [("role", role)] + ([("name", name)] if name else [])


def _parts(parts: Sequence[str | ImagePart]) -> list[Segment]:
    return [image(p) if isinstance(p, ImagePart) else text(p) for p in parts if p]


def tool_declaration(tools: Sequence[dict[str, Any]], dynamic: bool) -> list[Segment]:
    head = ("## New Tools Available\n"
            "The system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\n"
            "Here are the specs for the extended tools.\n\n") if dynamic else (
        "# Tools\nHere are the available tools, described in JSONSchema.\n\n")
    body = f"{head}```json\n{compact_json(list(tools))}\n```"
    return _message([("role", "system"), ("type", "tool-declare")], [text(body)])


def effort_message(effort: str) -> list[Segment]:
    return _internal("thinking-effort", (
        "`thinking_effort` guides on how much to think in your thinking channel (not including "
        "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
        f"Now the system is invoked with `thinking_effort={effort}`."))


def tool_choice_message(choice: str) -> list[Segment]:
    must = "You MUST call tools" if choice == "required" else "You MUST NOT call any tools"
    return _internal("tool-choice", f"The system is invoked with `tool_choice={choice}`.\n"
                     f"{must} in the next message.")


def response_format_message(kind: str, schema: Any) -> list[Segment]:
    body = (f"The system is invoked with `response_format={kind}`.\n"
            "Your response must be raw JSON data without markdown code blocks (```json) or any "
            "additional formatting.")
    if kind == "json_schema":
        body += f"\nThe JSON data must match the following schema:\n```json\n{compact_json(schema)}\n```"
    return _internal("response-format", body)


def _assistant(m: Message, thinking: bool) -> list[Segment]:
    body: list[Segment] = []
    if thinking:  # the think tags are structural: present even with no reasoning
        reasoning = m.reasoning if m.reasoning and m.reasoning.strip() else ""
        body += [*_open("think"), *_parts([reasoning]), *_close("think")]
    body += [*_open("response"), *_parts(m.parts), *_close("response")]
    if m.tool_calls:
        body += _open("tools")
        for i, call in enumerate(m.tool_calls, start=1):
            body += _open("call", [("tool", call.name), ("index", str(i))])
            if call.raw is not None:
                body += [*_open("json", [("type", "object")]), text(call.raw), *_close("json")]
            else:
                for key, value in (call.arguments or {}).items():
                    body += [*_open("argument", [("key", key), ("type", argument_type(value))]),
                             *_parts([argument_text(value)]), *_close("argument")]
            body += _close("call")
        body += _close("tools")
    return _message(_role("assistant", m.name), body)


def generation_prompt(thinking: bool) -> list[Segment]:
    """What a prompt ends with: the assistant message opened, then its first channel."""
    return [*_open("message", [("role", "assistant")]), *_open("think" if thinking else "response")]


def assistant_completion(m: Message, thinking: bool) -> list[Segment]:
    """What the model writes after `generation_prompt`: an unnamed assistant message as the
    history renders it, less that prompt (the training corpus's completions, so that what the
    model learns to write is exactly what a later turn renders)."""
    whole, stub = _assistant(m, thinking), generation_prompt(thinking)
    if m.name or whole[:len(stub)] != stub:
        raise ValueError("a completion is an unnamed assistant message")
    return whole[len(stub):]


class RenderError(ValueError):
    """A conversation the format cannot express; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def order_tool_results(messages: Sequence[Message]) -> list[tuple[int, Message]]:
    """Each run of tool results in the order of the calls they answer, matched by
    `tool_call_id` against the latest assistant's calls, each named after its call (a
    stale client `name` loses). A run with any result that matches no call stays as sent.
    Returns (index in the request, message) pairs, so errors can name the client's field."""
    out: list[tuple[int, Message]] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.role != "tool":
            if m.role == "assistant":
                calls = {}
                for pos, call in enumerate(m.tool_calls, start=1):
                    if call.id is not None and call.id not in calls:  # first of a duplicate
                        calls[call.id] = (pos, call.name)
            out.append((i, m))
            i += 1
            continue
        run: list[tuple[int, Message]] = []
        while i < len(messages) and messages[i].role == "tool":
            run.append((i, messages[i]))
            i += 1
        matched = [calls.get(m.tool_call_id or "") for _, m in run]
        if all(matched):
            order = sorted(range(len(run)), key=lambda k: (matched[k][0], k))  # type: ignore[index]
            run = [(run[k][0], _named(run[k][1], matched[k][1])) for k in order]  # type: ignore[index]
        out += run
    return out


def _named(m: Message, name: str) -> Message:
    return Message(m.role, m.parts, name, m.reasoning, m.tool_calls, m.tool_call_id, m.tools)


def render(messages: Sequence[Message], options: RenderOptions) -> list[Segment]:
    o = options
    out: list[Segment] = []
    if o.tools:
        out += tool_declaration(o.tools, dynamic=False)
    if o.thinking and o.effort is not None:
        if o.effort not in EFFORTS:
            raise RenderError("thinking.effort", f"must be one of {', '.join(EFFORTS)}")
        out += effort_message(o.effort)
    calls: tuple[HistoryCall, ...] = ()
    results = 0  # tool messages since the last assistant message
    for index, m in order_tool_results(messages):
        if m.role == "system" and m.tools:
            out += tool_declaration(m.tools, dynamic=True)
        elif m.role in ("system", "user"):
            out += _message(_role(m.role, m.name), _parts(m.parts))
        elif m.role == "assistant":
            calls, results = m.tool_calls, 0
            out += _assistant(m, o.thinking)
        elif m.role == "tool":
            results += 1
            name = m.name or (calls[results - 1].name if results <= len(calls) else None)
            if not name:
                raise RenderError(f"messages[{index}].tool_call_id",
                                  "this tool result matches no tool call of the preceding "
                                  "assistant message")
            out += _message([("role", "tool"), ("tool", name), ("index", str(results))],
                            _parts(m.parts))
        else:
            raise RenderError(f"messages[{index}].role", "unknown role")
    if o.tool_choice in ("required", "none"):
        out += tool_choice_message(o.tool_choice)
    if o.response_format in ("json_object", "json_schema"):
        out += response_format_message(o.response_format, o.response_schema)
    if o.add_generation_prompt:
        out += generation_prompt(o.thinking)
    return out
