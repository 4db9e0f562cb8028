"""A GrammarSpec as an llguidance Lark grammar: what the reference engine compiles.

For K3's XTML format the grammar is a structural tag over the assistant message the model is
already inside (docs/chat-format.md): the think channel's reasoning is free text up to
`<|close|>think<|sep|>`, then the response channel, then — for tool calls — the tools section,
then `<|close|>message<|sep|>`, after which only the end-of-message token is allowed (the
matcher's EOS). Control tokens appear in the grammar by name (`<|open|>`), so free text can
never contain one: the lexer cannot produce a control token from text.

A call's body follows what K3 writes in its history (docs/chat-format.md §2.4): typed
`<|open|>argument key=".." type=".."<|sep|>value<|close|>argument<|sep|>` elements when the
parameters schema is a plain object whose properties each map to an XTML type (as SGLang's
kimik3_structural_tag.py builds them), else one `<|open|>json type="object"<|sep|>` block whose
text is the whole arguments object, constrained by the whole schema (exact for `$ref`,
`anyOf` at the root, string patterns and the rest).

JSON is compact (no whitespace between tokens): K3's contract asks for it (KVV
`test_response_format_with`), and it is what `json.dumps(..., separators=(",", ":"))` writes.
"""

from __future__ import annotations

import json
from typing import Any

from serve_app.protocol.grammar import XTML_TYPE, GrammarSpec, ToolSpec

# The JSON compiler's options: compact, and strict about keywords it cannot enforce (a schema
# it would only half-enforce is an error for response_format; tools fall back, compiler.py).
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# Annotation keywords that constrain nothing.
_ANNOTATIONS = frozenset({"description", "title", "examples", "default", "$comment",
                          "deprecated", "readOnly", "writeOnly", "$schema", "$id"})
# What a parameters object may say and still be written as typed arguments.
_TYPED_OBJECT_KEYS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties"}


def lark_string(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: Any, lenient: bool = False) -> str:
    """`%json {...}`: one compact JSON value valid against `schema`."""
    body: dict[str, Any] = dict(schema) if isinstance(schema, dict) else (
        {} if schema is True else {"not": {}})
    body["x-guidance"] = {**COMPACT, "lenient": lenient}
    return "%json " + json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def _attr(value: str) -> str:
    """An XTML attribute value (only & and " are escaped, as the renderer does)."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _argument_header(key: str, xtml_type: str) -> str:
    return 'argument key="' + _attr(key) + '" type="' + xtml_type + '"'


def _string_value(schema: dict[str, Any]) -> str | None:
    """A raw (unquoted) string argument: free text, or one of its enum / const values; None
    when the schema constrains a string in a way raw text cannot say (pattern, lengths,
    format): then the call uses the json block."""
    if set(schema) - _ANNOTATIONS - {"type", "enum", "const"}:
        return None
    if "const" in schema:
        values = [schema["const"]]
    elif "enum" in schema:
        values = schema["enum"]
    else:
        return "TEXT"
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        return None
    return "(" + " | ".join(lark_string(v) for v in values) + ")"


def _value_variants(schema: Any) -> list[tuple[str, str]] | None:
    """(xtml type, value rule) per JSON type the property allows; None: not expressible."""
    if schema is True or schema == {}:
        return [("string", "TEXT"), *[(t, json_rule({"type": t}))
                                      for t in ("number", "boolean", "null", "object", "array")]]
    if not isinstance(schema, dict) or "$ref" in json.dumps(schema):
        return None
    kinds = schema.get("type")
    if isinstance(kinds, str):
        kinds = [kinds]
    if not isinstance(kinds, list) or not kinds or not all(k in XTML_TYPE for k in kinds):
        return None
    if len(kinds) > 1 and set(schema) - _ANNOTATIONS - {"type"}:
        return None  # per-type keywords of a multi-type schema: left to the json block
    variants = []
    for kind in dict.fromkeys(kinds):
        if kind == "string":
            rule = _string_value(schema)
            if rule is None:
                return None
        else:
            rule = json_rule({**schema, "type": kind})
        variants.append((XTML_TYPE[kind], rule))
    return variants


def _typed_arguments(name: str, params: dict[str, Any]) -> list[str] | None:
    """Rules for typed arguments (the first is the body), or None: use the json block."""
    if set(params) - _TYPED_OBJECT_KEYS or params.get("type", "object") != "object":
        return None
    props = params.get("properties", {})
    required = params.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list) \
            or not set(required) <= set(props):
        return None
    body, rules = [], []
    for i, (key, sub) in enumerate(props.items()):
        variants = _value_variants(sub)
        if variants is None:
            return None
        rule = f"a_{name}_{i}"
        alts = [f"<|open|> {lark_string(_argument_header(key, t))} <|sep|> {value} "
                '<|close|> "argument" <|sep|>' for t, value in variants]
        rules.append(f"{rule}: " + "\n    | ".join(alts))
        body.append(rule if key in required else f"{rule}?")
    return [" ".join(body) or '""', *rules]


def _call_rules(index: int, tool: ToolSpec) -> list[str]:
    """The call of one tool: its header, then its body."""
    rule = f"call_{index}"
    header = 'call tool="' + _attr(tool.name) + '" index="'
    head = f"<|open|> {lark_string(header)} INDEX " + '"\\"" <|sep|>'
    params = tool.parameters
    if not tool.strict or params is None or params == {} or params == {"type": "object"} \
            or params == {"type": "object", "properties": {}}:
        body, extra = "(args_free | json_block_free)?", []
    else:
        typed = _typed_arguments(str(index), params) if isinstance(params, dict) else None
        if typed is not None:
            body, extra = typed[0], typed[1:]
        else:
            body = f'<|open|> "json type=\\"object\\"" <|sep|> {json_rule(params)} ' \
                   f'<|close|> "json" <|sep|>'
            extra = []
    return [f"{rule}: {head} {body} <|close|> \"call\" <|sep|>", *extra]


# Rules every K3 grammar may use: free text (no control token can be lexed from text), a call
# index (bounded, so that no answer can spend max_tokens on digits), and the free arguments of a non-strict tool — any keys, each value well-formed for the
# type it declares (the output parser decodes non-string values as JSON), or a free json block.
_FREE_ARG = " | ".join(
    f'<|open|> "argument key=\\"" KEY {lark_string(chr(34) + " type=" + chr(34) + t + chr(34))} '
    f'<|sep|> {"TEXT" if t == "string" else json_rule({"type": t})} <|close|> "argument" <|sep|>'
    for t in ("string", "number", "boolean", "null", "object", "array"))
_K3_COMMON = [
    "TEXT: /(?s:.*)/",
    "INDEX: /[1-9][0-9]?/",  # calls count from 1; at most 99 in one answer
    "KEY: /[^\"&\\t\\r\\n<>=]+/",
    "args_free: free_arg+",
    f"free_arg: {_FREE_ARG}",
    'json_block_free: <|open|> "json type=\\"object\\"" <|sep|> '
    + json_rule({"type": "object"}) + ' <|close|> "json" <|sep|>',
]


def lark_grammar(spec: GrammarSpec, relaxed: frozenset[str] = frozenset()) -> str:
    """The grammar text. `relaxed`: tools whose schemas are not enforced (they failed to
    compile; compiler.py) — their calls keep the structure with free arguments."""
    schema = spec.answer_schema
    answer = json_rule(schema) if schema is not None else None
    if spec.chat_format == "plain":
        assert answer is not None
        return f"start: {answer}\n"
    rules = list(_K3_COMMON)
    # Thinking on: the prompt ends inside the think channel; off: inside the response channel.
    head = '<|close|> "think" <|sep|> <|open|> "response" <|sep|>' if spec.thinking else ""
    reasoning = "TEXT " if spec.thinking else ""
    end = '<|close|> "message" <|sep|>'
    if answer is not None:
        start = f'{reasoning}{head} {answer} <|close|> "response" <|sep|> {end}'
    else:
        calls = []
        for i, tool in enumerate(spec.tools):
            if tool.name in relaxed:
                tool = ToolSpec(tool.name, None, strict=False)
            rules += _call_rules(i, tool)
            calls.append(f"call_{i}")
        rules.append("call: " + " | ".join(calls))
        section = '<|open|> "tools" <|sep|> ' + ("call+" if spec.parallel_tool_calls else "call") \
            + ' <|close|> "tools" <|sep|>'
        rules.append(f"tools: {section}")
        # A forced call comes with an empty response channel, as K3 writes a pure tool-call
        # turn (docs/chat-format.md §2.4): the call cannot be postponed past max_tokens by
        # text; under auto the answer is free and the tools section optional.
        if spec.optional_calls:
            start = f'{reasoning}{head} TEXT <|close|> "response" <|sep|> tools? {end}'
        else:
            start = f'{reasoning}{head} <|close|> "response" <|sep|> tools {end}'
    return "\n".join([f"start: {start}", *rules]) + "\n"
