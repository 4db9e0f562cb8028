"""What a chat request means in Kimi K3's format: thinking on/off and its effort, the tool set
(request-level and dynamic), tool_choice, response_format, and the messages as the renderer
takes them. Every rule refuses by field name with a 400, before anything is tokenized.

The rules and their precedence are K3's API contract as Moonshot's Kimi Vendor Verifier checks
it (docs/chat-format.md has the table with sources).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft7Validator, Draft202012Validator
from jsonschema.exceptions import SchemaError

from serve_app.chat.xtml_render import EFFORTS, HistoryCall, Message, RenderOptions
from serve_app.protocol.grammar import GrammarSpec, ToolSpec, ToolStrictLevel
from serve_app.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    ImagePart,
    OpenAIError,
    quote,
)

TOOL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_-]{0,255}")
# OpenAI's documented limit for one request's functions; dynamic declarations count too.
MAX_TOOLS = 128
# Deeper JSON than this in a tool schema or an argument object is refused (the renderer and
# the schema checker recurse; a 10^4-deep schema must be a 400, not a RecursionError).
MAX_JSON_DEPTH = 64
# K3's renderer replaces this literal in message text with the next image prompt whenever it
# is given image prompts, so client text could claim an image slot: every client text that
# SGLang 0.5.23 rewrites (srt/entrypoints/openai/serving_chat.py,
# neutralize_kimi_k3_image_placeholder in _prepare_kimi_k3_messages: message content,
# reasoning and tool-call arguments) is rewritten here the same way, so both backends see
# the same ids.
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
IMAGE_PLACEHOLDER_AS_TEXT = "<| kimi_image_placeholder |>"
# reasoning_effort values beyond K3's three map to the nearest level (sglang #39896).
_EFFORT_ALIASES = {"minimal": "low", "low": "low", "medium": "high", "high": "high",
                   "xhigh": "max", "max": "max"}


@dataclass(frozen=True)
class K3Request:
    messages: list[Message]
    options: RenderOptions
    tools_allowed: bool = False  # tool calls may be delivered (tools exist, choice is not none)
    parallel_tool_calls: bool = True
    # What the output must match (serve_app/grammar): the engine constrains every sampled
    # token to it; None: free text.
    grammar: GrammarSpec | None = None
    # Every declared tool (request-level and dynamic): name -> its function object, the
    # schemas a grammar for strict tools compiles.
    declared: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def thinking(self) -> bool:
        return self.options.thinking

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(self.declared)


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d > MAX_JSON_DEPTH:
                return d
            stack += [(c, d + 1) for c in (v.values() if isinstance(v, dict) else v)]
    return deepest


def _check_json(param: str, value: Any) -> None:
    if _depth(value) > MAX_JSON_DEPTH:
        raise _bad(param, f"is nested deeper than {MAX_JSON_DEPTH} levels")


def _check_schema(param: str, schema: Any) -> None:
    """A schema valid under Draft 2020-12 or Draft 7 (which tool schemas in the wild still
    follow: e.g. `$id` with a fragment, which 2020-12 forbids)."""
    _check_json(param, schema)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        try:
            Draft7Validator.check_schema(schema)
        except SchemaError:
            raise _bad(param, f"is not a valid JSON Schema ({_short(exc.message)})") from None
    except RecursionError:
        raise _bad(param, "is nested too deeply") from None


def _short(message: str) -> str:
    return message if len(message) <= 160 else message[:160] + "..."


# --- thinking ----------------------------------------------------------------------------------


def resolve_thinking(body: ChatCompletionRequest) -> tuple[bool, str | None]:
    """(thinking on, effort). On/off: chat_template_kwargs.thinking, then thinking.type, then
    reasoning_effort "none", then on. Effort: chat_template_kwargs.thinking_effort (an explicit
    null renders none), then thinking.effort, then reasoning_effort, then max."""
    kwargs = body.chat_template_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    kwargs = kwargs or {}
    thinking = body.thinking
    if thinking is not None and not isinstance(thinking, dict):
        raise _bad("thinking", 'must be an object such as {"type": "enabled"}')
    kind = (thinking or {}).get("type", "enabled")
    if kind not in ("enabled", "disabled"):
        raise _bad("thinking.type", f'must be "enabled" or "disabled", not {quote(kind)}')
    effort_from_reasoning: str | None = None
    reasoning_off = False
    if body.reasoning_effort is not None:
        value = body.reasoning_effort
        if not isinstance(value, str):
            raise _bad("reasoning_effort", "must be a string: low, high, max or none")
        if value == "none":
            reasoning_off = True
        elif value in _EFFORT_ALIASES:
            effort_from_reasoning = _EFFORT_ALIASES[value]
        else:
            raise _bad("reasoning_effort", f"{quote(value)} is not one of low, high, max, none")
    if "thinking" in kwargs:
        if not isinstance(kwargs["thinking"], bool):
            raise _bad("chat_template_kwargs.thinking", "must be true or false")
        on = kwargs["thinking"]
    elif thinking is not None:
        on = kind == "enabled"
    else:
        on = not reasoning_off
    if not on:
        return False, None  # keep and effort mean nothing without thinking
    keep = (thinking or {}).get("keep")
    if keep not in (None, "all"):
        raise _bad("thinking.keep", 'K3 keeps all reasoning: only "all" is accepted')
    if "thinking_effort" in kwargs:
        effort = kwargs["thinking_effort"]
        if effort is not None and effort not in EFFORTS:
            raise _bad("chat_template_kwargs.thinking_effort",
                       f"must be one of {', '.join(EFFORTS)} or null")
        return True, effort
    effort = (thinking or {}).get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise _bad("thinking.effort", f"must be one of {', '.join(EFFORTS)}")
        return True, effort
    return True, effort_from_reasoning or "max"


# --- tools ---------------------------------------------------------------------------------------


def _declaration(param: str, tool: Any) -> dict[str, Any]:
    """One tool as it is declared to the model: the client's object, null fields dropped at
    the tool and function level, `parameters` untouched."""
    if not isinstance(tool, dict):
        raise _bad(param, "each tool must be an object")
    if "type" not in tool:
        raise _bad(f"{param}.type", 'is required and must be "function"')
    if tool["type"] != "function":
        raise _bad(f"{param}.type", f'{quote(tool["type"])} is not supported; only "function"')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{param}.function", "is required and must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise _bad(f"{param}.function.name", "must match ^[a-zA-Z_][a-zA-Z0-9_-]{0,255}$")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"{param}.function.description", "must be a string")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise _bad(f"{param}.function.strict", "must be true or false")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise _bad(f"{param}.function.parameters", "must be a JSON Schema object")
        _check_schema(f"{param}.function.parameters", params)
    function = {k: v for k, v in fn.items() if v is not None}
    return {**{k: v for k, v in tool.items() if v is not None}, "function": function}


def _tool_list(param: str, tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad(param, "must be an array of tools")
    return [_declaration(f"{param}[{i}]", t) for i, t in enumerate(tools)]


def _add_names(declared: dict[str, dict[str, Any]], tools: list[dict[str, Any]],
               param: str) -> None:
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in declared:
            raise _bad(f"{param}[{i}].function.name",
                       f"the tool name {quote(name)} is declared twice")
        declared[name] = tool["function"]
    if len(declared) > MAX_TOOLS:
        raise _bad(param, f"at most {MAX_TOOLS} tools may be declared in one request")


# --- messages ------------------------------------------------------------------------------------


def _history_call(param: str, call: Any) -> HistoryCall:
    if not isinstance(call, dict):
        raise _bad(param, "must be an object")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(f"{param}.function.name", "is required")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise _bad(f"{param}.id", "must be a string")
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        return HistoryCall(fn["name"], call_id, {})
    if isinstance(args, dict):
        _check_json(f"{param}.function.arguments", args)
        return HistoryCall(fn["name"], call_id, _unclaimed_values(args))
    if not isinstance(args, str):
        raise _bad(f"{param}.function.arguments", "must be a JSON string")
    args = unclaimed(args)
    try:
        parsed = json.loads(args)
    except (ValueError, RecursionError):
        parsed = None  # kept byte-exact in a json block, as the model would have written it
    if isinstance(parsed, dict) and _depth(parsed) <= MAX_JSON_DEPTH:
        return HistoryCall(fn["name"], call_id, parsed)
    return HistoryCall(fn["name"], call_id, None, raw=args)


def unclaimed(value: str) -> str:
    """Client text with K3's image placeholder spelled so that it claims no image."""
    return value.replace(IMAGE_PLACEHOLDER, IMAGE_PLACEHOLDER_AS_TEXT)


def _unclaimed_values(value: Any) -> Any:
    """Every string value of a JSON value unclaimed (keys as sent, as SGLang does); the
    depth is bounded by the caller."""
    if isinstance(value, str):
        return unclaimed(value)
    if isinstance(value, list):
        return [_unclaimed_values(v) for v in value]
    if isinstance(value, dict):
        return {k: _unclaimed_values(v) for k, v in value.items()}
    return value


def _parts(m: ChatMessage, where: str) -> tuple[str | ImagePart, ...]:
    return tuple(p if isinstance(p, ImagePart) else unclaimed(p) for p in m.parts(where))


def _message(i: int, m: ChatMessage, declared: dict[str, dict[str, Any]]) -> Message:
    where = f"messages[{i}]"
    role = "system" if m.role == "developer" else m.role
    if m.name is not None and not isinstance(m.name, str):
        raise _bad(f"{where}.name", "must be a string")
    if m.tools is not None and m.tools != []:  # an empty list declares nothing
        if role != "system":
            raise _bad(f"{where}.tools", "tools may only be declared in a system message")
        tools = _tool_list(f"{where}.tools", m.tools)
        if any(isinstance(p, ImagePart) or p.strip() for p in _parts(m, where)):
            raise _bad(f"{where}.content", "a system message that declares tools must have "
                       "empty content (its content would not be shown to the model)")
        _add_names(declared, tools, f"{where}.tools")
        return Message("system", (), tools=tuple(tools))
    if role == "tool":
        if not isinstance(m.tool_call_id, str) or not m.tool_call_id:
            raise _bad(f"{where}.tool_call_id", "is required in a tool message")
        return Message("tool", _parts(m, where), m.name, tool_call_id=m.tool_call_id)
    if role == "assistant":
        reasoning = m.reasoning_content if m.reasoning_content else m.reasoning
        if reasoning is not None and not isinstance(reasoning, str):
            raise _bad(f"{where}.reasoning_content", "must be a string")
        if reasoning is not None:
            reasoning = unclaimed(reasoning)
        calls: tuple[HistoryCall, ...] = ()
        if m.tool_calls is not None:
            if not isinstance(m.tool_calls, list):
                raise _bad(f"{where}.tool_calls", "must be an array")
            calls = tuple(_history_call(f"{where}.tool_calls[{j}]", c)
                          for j, c in enumerate(m.tool_calls))
        return Message("assistant", _parts(m, where), m.name, reasoning, calls)
    return Message(role, _parts(m, where), m.name)


# --- response_format and tool_choice -------------------------------------------------------------


def response_grammar(kind: str, schema: Any, strict: bool, chat_format: Literal["k3", "plain"],
                     thinking: bool = False) -> GrammarSpec:
    """The grammar of a JSON response_format (kind from `response_format`)."""
    param = "response_format.json_schema.schema" if kind == "json_schema" else "response_format"
    return GrammarSpec(kind, param, schema=schema, strict=strict,  # type: ignore[arg-type]
                       chat_format=chat_format, thinking=thinking)


def response_format(value: Any) -> tuple[str | None, Any, bool]:
    """(kind, schema, strict) of a request's response_format: kind None for text."""
    if value is None:
        return None, None, False
    if not isinstance(value, dict):
        raise _bad("response_format", "must be an object")
    kind = value.get("type")
    if kind == "text":
        return None, None, False
    if kind == "json_object":
        return "json_object", None, True
    if kind != "json_schema":
        raise _bad("response_format.type",
                   f"{quote(kind)} is not one of text, json_object, json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "is required with type json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("response_format.json_schema.name", "is required (a non-empty string)")
    if "schema" not in spec:
        raise _bad("response_format.json_schema.schema", "is required")
    schema = spec["schema"]
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "must be a JSON Schema object")
    strict = spec.get("strict", True)
    if strict is None:
        strict = True
    if not isinstance(strict, bool):
        raise _bad("response_format.json_schema.strict", "must be true or false")
    _check_schema("response_format.json_schema.schema", schema)
    return "json_schema", schema, strict


def _tool_choice(value: Any, names: tuple[str, ...]) -> tuple[str, str | None]:
    """(auto / none / required / named, the named function)."""
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise _bad("tool_choice", f"{quote(value)} is not one of auto, none, required")
        if value == "required" and not names:
            raise _bad("tool_choice", "required needs at least one declared tool")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and value.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)):
        raise _bad("tool_choice", 'must be auto, none, required or {"type": "function", '
                   '"function": {"name": ...}}')
    if fn["name"] not in names:
        raise _bad("tool_choice.function.name", f"{quote(fn['name'])} is not a declared tool")
    return "named", fn["name"]


def parse(body: ChatCompletionRequest, add_generation_prompt: bool = True,
          tool_strict_level: ToolStrictLevel = "off") -> K3Request:
    """The request in K3's terms; `tool_strict_level` is the server's (config.py:
    api.tool_strict_level): "parameter" treats every declared tool as strict, "function" and
    above constrain the structure of calls under tool_choice auto too."""
    thinking, effort = resolve_thinking(body)
    declared: dict[str, dict[str, Any]] = {}
    request_tools = _tool_list("tools", body.tools) if body.tools is not None else []
    _add_names(declared, request_tools, "tools")
    messages = [_message(i, m, declared) for i, m in enumerate(body.messages)]
    names = tuple(declared)
    choice, named = _tool_choice(body.tool_choice, names)
    if body.parallel_tool_calls is not None and not isinstance(body.parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls", "must be true or false")
    kind, schema, strict = response_format(body.response_format)
    parallel = body.parallel_tool_calls is not False
    tools = tuple(ToolSpec(name, fn.get("parameters"),
                           fn.get("strict") is True or tool_strict_level == "parameter")
                  for name, fn in declared.items())
    grammar = None
    # A forced call with a JSON response_format: both internal messages render (Moonshot's
    # reference counts them: KVV's prompt-token case of that pair), and the call is what is
    # constrained, its arguments being JSON already. SGLang refuses the pair with a 400.
    if choice in ("required", "named"):
        grammar = GrammarSpec("tool_call", "tool_choice", chat_format="k3", thinking=thinking,
                              tools=tuple(t for t in tools if named in (None, t.name)),
                              parallel_tool_calls=parallel)
    elif kind is not None:
        grammar = response_grammar(kind, schema, strict, "k3", thinking)
    elif choice == "auto" and tools and (any(t.strict for t in tools) or not parallel
                                         or tool_strict_level != "off"):
        # Strict tools (or parallel_tool_calls false, or a server strictness level) under
        # auto: the answer is free, and a call, if made, follows its schema (SGLang's
        # triggered tags), at most one without parallel calls.
        grammar = GrammarSpec("tool_call", "tools", chat_format="k3", thinking=thinking,
                              tools=tools, optional_calls=True, parallel_tool_calls=parallel)
    options = RenderOptions(
        thinking=thinking, effort=effort, tools=tuple(request_tools),
        tool_choice=choice if choice in ("required", "none") and names else None,
        response_format=kind, response_schema=schema,
        add_generation_prompt=add_generation_prompt)
    return K3Request(messages, options, tools_allowed=bool(names) and choice != "none",
                     parallel_tool_calls=parallel, grammar=grammar, declared=declared)
