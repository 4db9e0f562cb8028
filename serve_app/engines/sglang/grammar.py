"""A request's output constraint (`GrammarSpec`) as SGLang 0.5.23 sampling parameters.

- `json_schema`: a JSON Schema string; the server's grammar backend compiles it, with JSON
  whitespace as --constrained-json-disable-any-whitespace says (sglang/srt/constrained/
  base_grammar_backend.py:408, xgrammar_backend.py:394-397).
- `structural_tag`: xgrammar's structural-tag JSON, `{"type": "structural_tag", "format": F}`
  (parsed at sglang/srt/constrained/xgrammar_backend.py:426-451). The K3 tags are the ones SGLang
  builds for K3's XTML itself (sglang/srt/function_call/kimik3_structural_tag.py, cited as
  `st.py:LINE`), written as plain dicts: neither xgrammar nor SGLang is imported (CI has
  neither). Only xgrammar 0.2.7's formats are used, the version SGLang 0.5.23 pins.

Where this differs from SGLang it says why; the contract is K3's API as docs/chat-format.md
states it (after Moonshot's Kimi-Vendor-Verifier, KVV). Line numbers are SGLang
0.5.23's.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from serve_app.protocol.grammar import JSON_TYPES, XTML_TYPE, GrammarSpec, ToolSpec

logger = logging.getLogger("serve_app.sglang")

# K3's XTML markers (sglang/srt/function_call/kimik3_format.py:3-12; each `<|...|>` is one
# control token, serve_app/chat/xtml_render.py).
THINK_CLOSE = "<|close|>think<|sep|>"
THINK_OPEN = "<|open|>think<|sep|>"
RESPONSE_OPEN = "<|open|>response<|sep|>"
RESPONSE_CLOSE = "<|close|>response<|sep|>"
TOOLS_OPEN = "<|open|>tools<|sep|>"
TOOLS_CLOSE = "<|close|>tools<|sep|>"
MESSAGE_CLOSE = "<|close|>message<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
CALL_OPEN = "<|open|>call"
CALL_CLOSE = "<|close|>call<|sep|>"
ARGUMENT_CLOSE = "<|close|>argument<|sep|>"

# st.py:53-81, 189-196: keywords that imply a type when a schema names none (checked in order).
_IMPLIED_TYPES = (
    ("object", {"additionalProperties", "dependentRequired", "dependentSchemas",
                "maxProperties", "minProperties", "patternProperties", "properties",
                "propertyNames", "required"}),
    ("array", {"contains", "items", "maxContains", "maxItems", "minContains", "minItems",
               "prefixItems", "uniqueItems"}),
    ("string", {"format", "maxLength", "minLength", "pattern"}),
    ("number", {"exclusiveMaximum", "exclusiveMinimum", "maximum", "minimum", "multipleOf"}),
)
# st.py:358: a key of an argument no schema names (an additional property).
_FREE_KEY = r'[^"& \t\r\n\f\v=<>]+'


def sglang_constraint(spec: GrammarSpec | None) -> dict[str, Any]:
    """The entries SGLang's `sampling_params` dict needs for `spec`; {} when unconstrained."""
    if spec is None:
        return {}
    if spec.kind != "tool_call" and (spec.chat_format == "plain" or not spec.thinking):
        # The whole output is the JSON: "plain", or K3 with thinking off, whose generation
        # prompt already ends inside the response channel (`<|open|>response<|sep|>`,
        # serve_app/chat/xtml_render.py). A `json_schema` rather than a structural tag because
        # only this path honours --constrained-json-disable-any-whitespace (the K3 contract:
        # no newlines or tabs, per KVV): xgrammar compiles a structural tag's JSON
        # with any whitespace (xgrammar_backend.py:451 passes no whitespace setting). This is
        # SGLang's own K3 mapping too (entrypoints/openai/protocol.py:1238-1250).
        return {"json_schema": _dumps(spec.answer_schema)}
    try:
        fmt = _tool_call_format(spec) if spec.kind == "tool_call" else _json_answer_format(spec)
    except (ValueError, RecursionError) as e:
        # SGLang answers a tag it cannot build with no constraint (function_call_parser.py:
        # 431-433), never a refusal of a valid schema (KVV fails any 4xx); so does this.
        logger.warning("no grammar for %s (%s): the output is unconstrained", spec.param, e)
        return {}
    return {"structural_tag": _dumps({"type": "structural_tag", "format": fmt})}


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


# --- xgrammar structural-tag formats (xgrammar/structural_tag.py), as JSON ---

def _tag(begin: str, content: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _seq(*elements: dict) -> dict:
    return {"type": "sequence", "elements": list(elements)}


def _one_of(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _any_text(*excludes: str) -> dict:
    return {"type": "any_text", "excludes": list(excludes)}


def _const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def _json(schema: Any, style: str = "json") -> dict:
    return {"type": "json_schema", "json_schema": schema, "style": style}


# --- the K3 assistant message ---

def _with_reasoning(suffix: dict, thinking: bool) -> dict:
    """st.py:491-499: with thinking on, free reasoning up to the think channel's close first
    (the prompt ends with `<|open|>think<|sep|>`). The tag holds the reasoning because no
    reasoning parser defers the grammar here (sglang_server_args sets none; SGLang does the
    same then: serving_chat.py:1831)."""
    if not thinking:
        return suffix
    return _seq(_tag("", _any_text(), THINK_CLOSE), suffix)


def _json_answer_format(spec: GrammarSpec) -> dict:
    """Thinking on: the reasoning, then the response channel holding only the JSON. SGLang
    would start the JSON right after the reasoning (ReasonerGrammarObject), text outside any
    channel that our XTML parser drops; the channel's markers keep the model on the format it
    was trained on, as TRT-LLM's K3 tag does (PR #17845). The JSON's whitespace is free here."""
    return _with_reasoning(_tag(RESPONSE_OPEN, _json(spec.answer_schema), RESPONSE_CLOSE),
                           spec.thinking)


def _tool_call_format(spec: GrammarSpec) -> dict:
    calls = [_call_tag(tool) for tool in spec.tools]
    if spec.parallel_tool_calls:  # st.py:467-476: one or more calls, or exactly one
        content = {"type": "tags_with_separator", "tags": calls, "separator": "",
                   "at_least_one": True}
    else:
        content = _one_of(calls)
    section = _tag(TOOLS_OPEN, content, TOOLS_CLOSE)
    if spec.optional_calls:
        # tool_choice auto with strict tools (st.py:479-488, 622, chosen at
        # function_call_parser.py:342-345, 397-403): any text; a tools section when the model
        # opens one; no call markers outside it; after one section, nothing more when
        # parallel_tool_calls is false.
        suffix = {"type": "triggered_tags", "triggers": [TOOLS_OPEN], "tags": [section],
                  "excludes": [THINK_OPEN, THINK_CLOSE, CALL_OPEN],
                  "stop_after_first": not spec.parallel_tool_calls}
    else:
        # required / named (st.py:612-620): free text (the model closes the channel it is in),
        # then the section. The free text may not close the message either (not in SGLang:
        # sglang #39895), or a forced call would follow a closed message.
        suffix = _seq(_any_text(TOOLS_OPEN, THINK_OPEN, THINK_CLOSE, CALL_OPEN, MESSAGE_CLOSE,
                                END_OF_MSG), section)
    return _with_reasoning(suffix, spec.thinking)


def _escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")  # st.py:84-85


def _call_tag(tool: ToolSpec) -> dict:
    """st.py:450-464: `<|open|>call tool="NAME" index="N"<|sep|>` ARGS `<|close|>call<|sep|>`."""
    return _tag(f'{CALL_OPEN} tool="{_escape_attr(tool.name)}" index="',
                _seq({"type": "regex", "pattern": r"[1-9][0-9]*"}, _const('"<|sep|>'),
                     _arguments(tool)),
                CALL_CLOSE)


def _arguments(tool: ToolSpec) -> dict:
    """st.py:427-447: a strict tool's typed arguments follow its schema; any other's are any
    keys with any values."""
    params = tool.parameters
    if not tool.strict:
        root = params if isinstance(params, dict) else {}
        return {"type": "star", "content": _free_argument(True, root, loose_strings=True)}
    if params is None:
        return _const("")  # st.py:434-437: no parameters, no arguments
    if not isinstance(params, dict) or "object" not in _schema_types(params, params):
        raise ValueError(f"strict tool {tool.name!r}: parameters must be an object schema")
    properties = params.get("properties", {})
    required = params.get("required", [])
    if not isinstance(properties, dict) or not (
            isinstance(required, list) and all(isinstance(k, str) for k in required)):
        raise ValueError(f"strict tool {tool.name!r}: bad properties or required")
    if set(required) - set(properties):
        raise ValueError(f"strict tool {tool.name!r}: a required parameter has no schema")
    # st.py:396-424: each declared property in schema order, the required ones mandatory,
    # then any additional properties the schema allows.
    elements = []
    for key, schema in properties.items():
        if not isinstance(schema, bool | dict):
            raise ValueError(f"strict tool {tool.name!r}: property {key!r} is no schema")
        variants = [_tag(f'<|open|>argument key="{_escape_attr(key)}" type="{XTML_TYPE[t]}"'
                         "<|sep|>", value, ARGUMENT_CLOSE)
                    for t, value in _value_variants(schema, params)]
        if not variants:
            if key in required:
                raise ValueError(f"strict tool {tool.name!r}: {key!r} accepts no value")
            continue
        argument = _one_of(variants)
        elements.append(argument if key in required else {"type": "optional",
                                                          "content": argument})
    extra = params.get("additionalProperties", True)
    if extra is not False:
        if not isinstance(extra, bool | dict):
            raise ValueError(f"strict tool {tool.name!r}: bad additionalProperties")
        elements.append({"type": "star", "content": _free_argument(extra, params)})
    return _seq(*elements) if elements else _const("")


def _free_argument(schema: bool | dict, root: dict, loose_strings: bool = False) -> dict:
    """st.py:350-376: one argument with a key no schema names and a value of `schema`."""
    variants = [_seq({"type": "regex", "pattern": _FREE_KEY},
                     _const(f'" type="{XTML_TYPE[t]}"<|sep|>'), value)
                for t, value in _value_variants(schema, root, loose_strings)]
    if not variants:
        raise ValueError("the additional-properties schema accepts no value")
    return _tag('<|open|>argument key="', _one_of(variants), ARGUMENT_CLOSE)


def _value_variants(schema: bool | dict, root: dict,
                    loose_strings: bool = False) -> list[tuple[str, dict]]:
    """st.py:310-323: (JSON type, value format) for each type `schema` admits."""
    out = []
    for t in _schema_types(schema, root):
        narrowed = _narrow(schema, t, root)
        if narrowed is not False:
            out.append((t, _value_format(narrowed, t, loose_strings)))
    return out


def _value_format(schema: Any, t: str, loose_string: bool) -> dict:
    """st.py:270-307: a string value is raw text (xgrammar's qwen_xml style; any text for a
    non-strict tool), every other value JSON."""
    if loose_string and t == "string":
        return _any_text()
    if t == "integer" and isinstance(schema, dict) and not (
            {"maximum", "exclusiveMaximum", "multipleOf"} & schema.keys()):
        # st.py:277-303: xgrammar miscompiles a one-sided negative integer lower bound, so the
        # range is split at zero (the same values).
        bounds = []
        if _is_int(schema.get("minimum")):
            bounds.append(schema["minimum"])
        if _is_int(schema.get("exclusiveMinimum")):
            bounds.append(schema["exclusiveMinimum"] + 1)
        if bounds and max(bounds) < 0:
            negative = {**schema, "maximum": -1}
            rest = {k: v for k, v in schema.items() if k != "exclusiveMinimum"}
            schema = {"anyOf": [negative, {**rest, "minimum": 0}]}
    return _json(schema, "qwen_xml" if t == "string" else "json")


# --- JSON Schema: which types a schema admits, and the schema narrowed to one (st.py:88-267) ---

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    for t, kinds in (("boolean", bool), ("integer", int), ("number", float), ("string", str),
                     ("array", list)):
        if isinstance(value, kinds):
            return t
    return "object"


def _has_type(value: Any, t: str) -> bool:
    return _type_of(value) == t or (t == "number" and _type_of(value) == "integer")


def _resolve(ref: str, root: dict) -> bool | dict | None:
    """A local `#/...` reference (JSON Pointer escapes), or None."""
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, bool | dict) else None


def _ordered(types: set[str]) -> list[str]:
    return [t for t in JSON_TYPES if t in types]


def _schema_types(schema: bool | dict, root: dict, seen: frozenset[str] = frozenset()
                  ) -> list[str]:
    """st.py:127-197: the JSON types `schema` admits, from $ref, type, anyOf/oneOf, allOf,
    const, enum, then type-implying keywords; all of them when nothing says."""
    if isinstance(schema, bool):
        return list(JSON_TYPES) if schema else []
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in seen and (target := _resolve(ref, root)) is not None:
        return _schema_types(target, root, seen | {ref})
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared] if declared in JSON_TYPES else list(JSON_TYPES)
    if isinstance(declared, list):
        return _ordered(set(declared))
    for keyword in ("anyOf", "oneOf"):
        if isinstance(options := schema.get(keyword), list):
            return _ordered({t for o in options if isinstance(o, bool | dict)
                             for t in _schema_types(o, root, seen)})
    if isinstance(options := schema.get("allOf"), list):
        sets = [set(_schema_types(o, root, seen)) for o in options if isinstance(o, bool | dict)]
        # An integer is a number: a branch allowing numbers allows integers too.
        narrowing = [s | ({"integer"} if "number" in s else set())
                     for s in sets if s != set(JSON_TYPES)]
        if narrowing:
            common = set.intersection(*narrowing)
            if "number" in common:
                common.discard("integer")
            return _ordered(common)
    if "const" in schema:
        return [_type_of(schema["const"])]
    if isinstance(enum := schema.get("enum"), list):
        return _ordered({_type_of(v) for v in enum})
    for t, keywords in _IMPLIED_TYPES:
        if keywords & schema.keys():
            return [t]
    return list(JSON_TYPES)


def _with_root_defs(schema: Any, root: dict) -> Any:
    """The root's $defs/definitions beside a sub-schema, so its references still resolve."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, **{k: root[k] for k in ("$defs", "definitions")
                         if k in root and k not in schema}}


def _narrow(schema: bool | dict, t: str, root: dict) -> bool | dict:
    """st.py:212-267: `schema` admitting only JSON type `t`; False when it admits none."""
    if isinstance(schema, bool):
        return {"type": t} if schema else False
    ref = schema.get("$ref")
    if isinstance(ref, str) and (target := _resolve(ref, root)) is not None:
        return _with_root_defs(_narrow(target, t, root), root)
    out = dict(schema)
    declared = out.get("type")
    if isinstance(declared, list | str) and t not in (
            declared if isinstance(declared, list) else [declared]):
        return False
    if not isinstance(declared, str):
        out["type"] = t
    for keyword in ("anyOf", "oneOf"):
        if not isinstance(options := out.get(keyword), list):
            continue
        kept = [_narrow(o, t, root) for o in options
                if isinstance(o, bool | dict) and t in _schema_types(o, root)]
        if not kept:
            return False
        if len(kept) == 1 and isinstance(kept[0], dict):
            del out[keyword]
            out.update(kept[0])
        else:
            out[keyword] = kept
    if isinstance(out.get("enum"), list):
        out["enum"] = [v for v in out["enum"] if _has_type(v, t)]
        if not out["enum"]:
            return False
    if "const" in out and not _has_type(out["const"], t):
        return False
    return _with_root_defs(out, root)
