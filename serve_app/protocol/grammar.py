"""What a request's output must match, said once for both engines.

The ingress turns a chat request's response_format / tools / tool_choice into a `GrammarSpec`
(backend-neutral: JSON data, no compiled objects), it travels inside SamplingParams, and each
engine compiles it its own way: the reference engine to an llguidance grammar
(serve_app/grammar/lark.py), the SGLang backend to SGLang's sampling parameters
(serve_app/engines/sglang/grammar.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

# JSON Schema's type names, in SGLang's order (srt/function_call/kimik3_structural_tag.py:33-52),
# and the XTML `type` attribute of a K3 argument of each.
JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
XTML_TYPE = {t: ("number" if t == "integer" else t) for t in JSON_TYPES}

Kind = Literal["json_object", "json_schema", "tool_call"]


# The server's tool strictness (config.py: api.tool_strict_level), SGLang's
# SGLANG_TOOL_STRICT_LEVEL for K3: 0 off, 1 function, 2 parameter.
ToolStrictLevel = Literal["off", "function", "parameter"]


@dataclass(frozen=True)
class ToolSpec:
    """A tool a call may name: its declared function."""

    name: str
    parameters: dict[str, Any] | None = None  # a JSON Schema object; None: no arguments
    strict: bool = False  # the arguments must validate against `parameters`


@dataclass(frozen=True)
class GrammarSpec:
    """One request's output constraint.

    - kind "json_object": the answer is one JSON object; "json_schema": one JSON value valid
      against `schema` (strict) or of the type its root declares (not strict: the rest of
      the schema is only in the prompt); "tool_call": the answer carries at least one call
      of `tools` (tool_choice required or named) — or, with `optional_calls`, any text and
      calls of `tools` whose arguments are constrained when the tool is strict (tool_choice
      auto).
    - chat_format "k3": the output is K3's XTML assistant message (think channel when
      `thinking`, the response channel, the tools section, the message's end), and only the
      parts the kind names are constrained; "plain": the whole output is the JSON.
    - `param`: the request field an error about this constraint names.
    """

    kind: Kind
    param: str
    schema: Any = None
    strict: bool = True
    tools: tuple[ToolSpec, ...] = ()
    optional_calls: bool = False
    parallel_tool_calls: bool = True
    chat_format: Literal["k3", "plain"] = "plain"
    thinking: bool = False

    def __post_init__(self) -> None:
        if self.kind == "tool_call" and not self.tools:
            raise ValueError("a tool_call grammar needs at least one tool")
        if self.kind == "tool_call" and self.chat_format != "k3":
            raise ValueError("tool calls are constrained in K3's XTML format only")

    @property
    def answer_schema(self) -> Any:
        """The schema a JSON answer is held to (json_object, json_schema; None for calls).
        Not strict: the type its root declares, as KVV reads strict false (a JSON object
        for an object schema, "the internal structure is not enforced"), else any value."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json_schema":
            return None
        if self.strict:
            return self.schema
        declared = self.schema.get("type") if isinstance(self.schema, dict) else None
        names = [declared] if isinstance(declared, str) else declared
        if isinstance(names, list) and names and all(n in JSON_TYPES for n in names):
            return {"type": declared}
        return {}

    @cached_property
    def key(self) -> str:
        """Equal for equal constraints (the compiled-grammar cache's key)."""
        data = {"kind": self.kind, "schema": self.schema, "strict": self.strict,
                "tools": [[t.name, t.parameters, t.strict] for t in self.tools],
                "optional_calls": self.optional_calls, "parallel": self.parallel_tool_calls,
                "format": self.chat_format, "thinking": self.thinking}
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
