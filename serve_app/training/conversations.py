"""Conversations in Kimi K3's chat format, built from the standard library's own functions.

Every conversation is an OpenAI chat request (messages, tools, tool_choice, response_format,
thinking) and the assistant message that answers it. It is tokenized the way the server
tokenizes a request: the ingress's own parser (`chat.k3_request.parse`) and renderer
(`chat.xtml_render`) make the prompt, and the answer is the assistant message as the renderer
writes it in the history (`assistant_completion`), so the model learns to write exactly what
the output parser reads and what a later turn renders.

The material is the functions of the corpus files (`corpus.SourceFile`): a function's name,
module, parameters (JSON types from annotations and defaults), docstring and source become
questions, answers, reasoning, tool declarations (request-level and dynamic), tool calls with
typed arguments, tool results and JSON answers. Conversations drawn from held-out files are
held out (the same split as the code).
"""

from __future__ import annotations

import ast
import json
import random
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serve_app.chat import k3_request
from serve_app.chat.segments import Segment
from serve_app.chat.xtml_render import assistant_completion, render
from serve_app.protocol.openai import ChatCompletionRequest
from serve_app.training.corpus import SourceFile

# Conversation kinds and their shares of the corpus's conversations.
KINDS: dict[str, float] = {
    "code": 0.22,  # write the function: reasoning, then its source in a fence
    "explain": 0.14,  # what does it do: its docstring's summary
    "tool_call": 0.18,  # tools declared, the question needs one: call, result, answer
    "tool_required": 0.12,  # tool_choice required: a call
    "tool_dynamic": 0.06,  # tools declared by a system message mid-conversation
    "tool_not_needed": 0.10,  # tools declared, the question needs none: answer directly
    "json_schema": 0.10,  # response_format json_schema: the function described as JSON
    "json_object": 0.04,
    "multi_turn": 0.04,  # explain, then write it
}
_SYSTEM_PROMPTS = ("You are a helpful Python assistant.",
                   "You are Kimi, an AI assistant. Answer concisely.",
                   "You help developers with the Python standard library.")
_JSON_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean",
               "list": "array", "tuple": "array", "dict": "object", "bytes": "string"}
_WORDS = ("data", "alpha", "beta", "value", "name", "path", "item", "spam", "eggs", "text")


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # a JSON Schema type
    required: bool
    default: Any = None


@dataclass(frozen=True)
class Function:
    module: str
    name: str
    params: tuple[Param, ...]
    summary: str  # the docstring's first paragraph, one line
    source: str

    @property
    def tool_name(self) -> str:
        """A tool name as OpenAI allows them ([A-Za-z0-9_-], at most 64)."""
        return f"{self.module.rsplit('.', 1)[-1]}_{self.name}".lstrip("_")[:64]

    @property
    def signature(self) -> str:
        return f"{self.name}({', '.join(p.name for p in self.params)})"

    def tool(self) -> dict[str, Any]:
        props = {p.name: {"type": p.type} for p in self.params}
        return {"type": "function", "function": {
            "name": self.tool_name, "description": self.summary,
            "parameters": {"type": "object", "properties": props,
                           "required": [p.name for p in self.params if p.required]}}}


def _json_type(annotation: ast.expr | None, default: ast.expr | None) -> str:
    if isinstance(annotation, ast.Name) and annotation.id in _JSON_TYPES:
        return _JSON_TYPES[annotation.id]
    if isinstance(default, ast.Constant) and default.value is not None:
        return _JSON_TYPES.get(type(default.value).__name__, "string")
    if isinstance(default, ast.List | ast.Tuple):
        return "array"
    if isinstance(default, ast.Dict):
        return "object"
    return "string"


def _literal(node: ast.expr | None) -> Any:
    try:
        value = ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None
    return list(value) if isinstance(value, tuple) else value


def functions(file: SourceFile, max_source_chars: int = 1200) -> list[Function]:
    """The documented top-level functions and methods of a file (not private, not tests), with
    a source short enough for a training window."""
    try:
        tree = ast.parse(file.text)
    except SyntaxError:
        return []
    lines = file.text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith(("_", "test")):
            continue
        doc = ast.get_docstring(node)
        if not doc or not node.end_lineno:
            continue
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        source = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).rstrip() + "\n"
        if not 8 <= len(summary) <= 240 or not 60 <= len(source) <= max_source_chars:
            continue
        a = node.args
        positional = [x for x in a.posonlyargs + a.args if x.arg not in ("self", "cls")]
        defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
        defaults += list(a.defaults)[-len(positional):] if positional else []
        pairs = list(zip(positional, defaults, strict=True))
        pairs += list(zip(a.kwonlyargs, a.kw_defaults, strict=True))
        params = tuple(Param(arg.arg, _json_type(arg.annotation, d), d is None, _literal(d))
                       for arg, d in pairs)
        out.append(Function(file.module, node.name, params, summary, source))
    return out


def _value(p: Param, rng: random.Random) -> Any:
    """A plausible argument of the parameter's type (its default, sometimes)."""
    if p.default is not None and rng.random() < 0.3:
        return p.default
    return {"integer": lambda: rng.choice([0, 1, 2, 3, 4, 8, 10, 16, 42, 100]),
            "number": lambda: rng.choice([0.5, 1.0, 2.5, 3.14, 0.1]),
            "boolean": lambda: rng.random() < 0.5,
            "array": lambda: rng.sample(_WORDS, rng.randint(1, 3)),
            "object": lambda: {rng.choice(_WORDS): rng.choice(_WORDS)},
            }.get(p.type, lambda: rng.choice(_WORDS) + rng.choice(["", ".txt", "_1", "s"]))()


def _arguments(f: Function, rng: random.Random) -> dict[str, Any]:
    """Every required parameter, and each optional one half of the time."""
    return {p.name: _value(p, rng) for p in f.params if p.required or rng.random() < 0.5}


def _describe(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items()) or "no arguments"


@dataclass(frozen=True)
class Conversation:
    """A chat request and the assistant message that answers it (OpenAI shapes)."""

    kind: str
    request: dict[str, Any]  # a chat completion body, `model` aside
    answer: dict[str, Any]  # the assistant message

    def tokens(self) -> tuple[list[Segment], list[Segment]]:
        """(prompt, completion) segments, by the ingress's parser and renderer."""
        prompt = k3_request.parse(_body(self.request))
        whole = k3_request.parse(_body({**self.request,
                                        "messages": [*self.request["messages"], self.answer]}),
                                 add_generation_prompt=False)
        completion = assistant_completion(whole.messages[-1], prompt.thinking)
        return render(prompt.messages, prompt.options), completion


def _body(request: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "kimi-k3-mini", **request})


def _call(f: Function, args: dict[str, Any], i: int) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": f.tool_name, "arguments": json.dumps(args)}}


def _result(f: Function, args: dict[str, Any], rng: random.Random) -> str:
    value = rng.choice([True, None, 0, 1, 7, "ok", "done", rng.choice(_WORDS)])
    return json.dumps({"tool": f.tool_name, "result": value})


def conversation(f: Function, others: Sequence[Function], kind: str,
                 rng: random.Random) -> Conversation:
    """One conversation of `kind` about `f`; `others` supply distractor tools."""
    thinking = rng.random() < 0.8
    req: dict[str, Any] = {}
    if not thinking:
        req["thinking"] = {"type": "disabled"}
    elif rng.random() < 0.3:
        req["reasoning_effort"] = rng.choice(["low", "high", "max"])
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
    where = f"`{f.name}` from the `{f.module}` module"
    tools = [f, *rng.sample(list(others), min(len(others), rng.randint(0, 3)))]
    rng.shuffle(tools)

    def answer(content: str, reasoning: str, calls: list[dict[str, Any]] | None = None
               ) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg

    code = f"```python\n{f.source}```"
    if kind in ("code", "multi_turn"):
        if kind == "multi_turn":
            messages.append({"role": "user", "content": f"What does {f.module}.{f.name} do?"})
            messages.append(answer(f.summary, f"The user asks about {where}."))
        messages.append({"role": "user", "content": rng.choice([
            f"Write the function {f.name} from the {f.module} module.",
            f"Show me the source of {f.module}.{f.name}.",
            f"How is {f.signature} implemented in {f.module}?"])})
        return Conversation(kind, {**req, "messages": messages}, answer(
            code, f"The user wants {where}. It takes {_params(f)}. {f.summary} "
                  "I will write it out."))
    if kind == "explain":
        messages.append({"role": "user", "content": rng.choice([
            f"What does {f.module}.{f.name} do?", f"Explain {f.signature} in {f.module}."])})
        return Conversation(kind, {**req, "messages": messages}, answer(
            f"`{f.signature}`: {f.summary}",
            f"{where} takes {_params(f)}. Its documentation says: {f.summary}"))
    if kind in ("json_schema", "json_object"):
        value = {"name": f.name, "module": f.module, "parameters": [p.name for p in f.params]}
        schema = {"type": "object", "properties": {
            "name": {"type": "string"}, "module": {"type": "string"},
            "parameters": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "module", "parameters"], "additionalProperties": False}
        messages.append({"role": "user", "content":
                         f"Describe {f.module}.{f.name} as JSON: its name, module and the "
                         "names of its parameters."})
        req["response_format"] = ({"type": "json_object"} if kind == "json_object" else
                                  {"type": "json_schema", "json_schema": {
                                      "name": "function", "schema": schema,
                                      "strict": rng.random() < 0.5}})
        return Conversation(kind, {**req, "messages": messages}, answer(
            json.dumps(value, separators=(",", ":")),
            f"The answer is JSON describing {where}: parameters {_params(f)}."))
    declared = [t.tool() for t in tools]
    if kind == "tool_dynamic":
        messages.append({"role": "system", "content": "", "tools": declared})
    else:
        req["tools"] = declared
    if kind == "tool_not_needed":
        other = rng.choice(list(others)) if others else f
        messages.append({"role": "user", "content": f"What does {other.module}.{other.name} do?"})
        return Conversation(kind, {**req, "messages": messages}, answer(
            f"`{other.signature}`: {other.summary}",
            f"This is a question about {other.module}.{other.name}; no tool is needed."))
    if kind == "tool_required":
        req["tool_choice"] = "required"
    args = _arguments(f, rng)
    messages.append({"role": "user", "content": rng.choice([
        f"{f.summary.rstrip('.')} with {_describe(args)}.",
        f"Use {f.tool_name} with {_describe(args)}.",
        f"Please run {f.module}.{f.name} for {_describe(args)}."])})
    call = _call(f, args, rng.randint(0, 999))
    first = answer("", f"The tool {f.tool_name} does this: {f.summary} "
                       f"I will call it with {_describe(args)}.", [call])
    if kind == "tool_required" or rng.random() < 0.4:
        return Conversation(kind, {**req, "messages": messages}, first)
    result = _result(f, args, rng)
    messages += [first, {"role": "tool", "tool_call_id": call["id"], "content": result}]
    return Conversation(kind, {**req, "messages": messages}, answer(
        f"{f.tool_name} returned {json.loads(result)['result']!r}.",
        "The tool answered; I report its result."))


def _params(f: Function) -> str:
    if not f.params:
        return "no parameters"
    return ", ".join(f"{p.name} ({p.type}{'' if p.required else ', optional'})"
                     for p in f.params)


def conversations(files: Sequence[SourceFile], count: int, rng: random.Random
                  ) -> list[Conversation]:
    """`count` conversations about the files' functions, kinds in KINDS' shares."""
    pool = [fn for file in files for fn in functions(file)]
    if not pool:
        return []
    kinds, weights = zip(*KINDS.items(), strict=True)
    out = []
    for _ in range(count):
        f = rng.choice(pool)
        others = list({o.tool_name: o for o in rng.sample(pool, min(len(pool), 6))
                       if o.tool_name != f.tool_name}.values())
        out.append(conversation(f, others[:4], rng.choices(kinds, weights)[0], rng))
    return out


def per_kind(files: Sequence[SourceFile], each: int, rng: random.Random) -> list[Conversation]:
    """`each` conversations of every kind, round-robin over KINDS (any leading slice covers
    the kinds evenly): the held-out evaluation set."""
    pool = [fn for file in files for fn in functions(file)]
    out = []
    for _ in range(each):
        for kind in KINDS:
            f = rng.choice(pool)
            others = [o for o in rng.sample(pool, min(len(pool), 5)) if o.tool_name != f.tool_name]
            out.append(conversation(f, list({o.tool_name: o for o in others}.values())[:4],
                                    kind, rng))
    return out
