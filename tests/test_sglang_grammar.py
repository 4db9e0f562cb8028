"""The SGLang backend's output constraints (serve_app/engines/sglang/grammar.py): each GrammarSpec
kind as SGLang sampling parameters, the K3 structural tags in xgrammar's structural-tag JSON (as
SGLang 0.5.23's kimik3_structural_tag.py builds them), the grammar server arguments of the
emitted deployments, and the markers against SGLang's own source when it is unpacked
(SGLANG_SRC). CPU only: neither SGLang nor xgrammar is installed."""

from __future__ import annotations

import ast
import json
import logging
from typing import Any

import pytest
from sglang_helpers import app_config
from sglang_source import sglang_file

from capacity.sglang_flags import sglang_fields
from capacity.sglang_recipe import SGLANG_GRAMMAR_ARGS
from serve_app.chat import xtml_render
from serve_app.engines.sglang import grammar
from serve_app.engines.sglang.args import _MANAGED, sampling_params, sglang_server_args
from serve_app.engines.sglang.checks import check_server_args
from serve_app.engines.sglang.grammar import sglang_constraint
from serve_app.protocol.generation import SamplingParams
from serve_app.protocol.grammar import GrammarSpec, ToolSpec

PRODUCTION = "deployments/kimi_dspark.yaml"

THINK_CLOSE = "<|close|>think<|sep|>"
ARG_CLOSE = "<|close|>argument<|sep|>"
SCHEMA = {"type": "object", "properties": {"capital": {"type": "string"}},
          "required": ["capital"], "additionalProperties": False}
# A strict tool (typed arguments, no extra keys) and a non-strict one (any arguments).
WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"],
    "additionalProperties": False}, strict=True)
LOOKUP = ToolSpec("lookup", {"type": "object", "properties": {"q": {"type": "string"}}})

WEATHER_ARGS = {"type": "sequence", "elements": [
    {"type": "tag", "begin": '<|open|>argument key="city" type="string"<|sep|>',
     "content": {"type": "json_schema", "json_schema": {"type": "string"}, "style": "qwen_xml"},
     "end": ARG_CLOSE},
    {"type": "optional", "content": {
        "type": "tag", "begin": '<|open|>argument key="days" type="number"<|sep|>',
        "content": {"type": "json_schema", "json_schema": {"type": "integer"}, "style": "json"},
        "end": ARG_CLOSE}}]}
# Any key, then one branch per JSON type; a string is any text (st.py:350-376, 427-433).
FREE_ARGS = {"type": "star", "content": {
    "type": "tag", "begin": '<|open|>argument key="', "end": ARG_CLOSE,
    "content": {"type": "or", "elements": [
        {"type": "sequence", "elements": [
            {"type": "regex", "pattern": '[^"& \\t\\r\\n\\f\\v=<>]+'},
            {"type": "const_string", "value": f'" type="{xtml}"<|sep|>'},
            {"type": "any_text", "excludes": []} if t == "string" else
            {"type": "json_schema", "json_schema": {"type": t}, "style": "json"}]}
        for t, xtml in [("string", "string"), ("number", "number"), ("integer", "number"),
                        ("boolean", "boolean"), ("array", "array"), ("object", "object"),
                        ("null", "null")]]}}}


def call(name: str, args: dict) -> dict:
    return {"type": "tag", "begin": f'<|open|>call tool="{name}" index="',
            "content": {"type": "sequence", "elements": [
                {"type": "regex", "pattern": "[1-9][0-9]*"},
                {"type": "const_string", "value": '"<|sep|>'}, args]},
            "end": "<|close|>call<|sep|>"}


def tools_section(content: dict) -> dict:
    return {"type": "tag", "begin": "<|open|>tools<|sep|>", "content": content,
            "end": "<|close|>tools<|sep|>"}


REASONING = {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": []},
             "end": THINK_CLOSE}
PRE_CALL_TEXT = {"type": "any_text", "excludes": [
    "<|open|>tools<|sep|>", "<|open|>think<|sep|>", THINK_CLOSE, "<|open|>call",
    "<|close|>message<|sep|>", "<|end_of_msg|>"]}


def tag_of(spec: GrammarSpec) -> dict:
    """The structural tag's format, after checking the envelope."""
    out = sglang_constraint(spec)
    assert list(out) == ["structural_tag"]
    tag = json.loads(out["structural_tag"])
    assert list(tag) == ["type", "format"] and tag["type"] == "structural_tag"
    return tag["format"]


def tool_spec(*tools: ToolSpec, **kw: Any) -> GrammarSpec:
    return GrammarSpec("tool_call", "tool_choice", tools=tools, chat_format="k3", **kw)


# --- JSON answers ---

@pytest.mark.parametrize("chat_format", ["plain", "k3"])
def test_json_answers_without_reasoning_are_json_schema(chat_format: str) -> None:
    """Plain, or K3 with thinking off (the prompt already opened the response channel): the
    whole output is the JSON, as `json_schema`, the path the whitespace flag applies to."""
    def kw(**more: Any) -> dict:
        return {"chat_format": chat_format, **more}
    assert sglang_constraint(GrammarSpec("json_object", "response_format", **kw())) == {
        "json_schema": '{"type":"object"}'}
    assert sglang_constraint(GrammarSpec("json_schema", "response_format", **kw(
        schema=SCHEMA))) == {"json_schema": json.dumps(SCHEMA, separators=(",", ":"))}
    # strict false: the root's declared type (the rest of the schema is in the prompt only),
    # else any JSON value.
    assert sglang_constraint(GrammarSpec("json_schema", "response_format", **kw(
        schema=SCHEMA, strict=False))) == {"json_schema": '{"type":"object"}'}
    assert sglang_constraint(GrammarSpec("json_schema", "response_format", **kw(
        schema={"properties": {}}, strict=False))) == {"json_schema": "{}"}


def test_k3_json_answer_with_thinking_is_the_response_channel() -> None:
    def answer(schema: Any) -> dict:
        return {"type": "sequence", "elements": [REASONING, {
            "type": "tag", "begin": "<|open|>response<|sep|>",
            "content": {"type": "json_schema", "json_schema": schema, "style": "json"},
            "end": "<|close|>response<|sep|>"}]}

    def spec(kind: str, **kw: Any) -> GrammarSpec:
        return GrammarSpec(kind, "response_format", chat_format="k3", thinking=True, **kw)
    assert tag_of(spec("json_schema", schema=SCHEMA)) == answer(SCHEMA)
    assert tag_of(spec("json_schema", schema=SCHEMA, strict=False)) == answer({"type": "object"})
    assert tag_of(spec("json_object")) == answer({"type": "object"})


# --- tool calls ---

def test_required_with_two_tools() -> None:
    """tool_choice required: text that cannot open calls or close the message, then a tools
    section of one or more calls; the strict tool's arguments follow its schema (declared
    order, `days` optional, integer written as type "number"), the other's are free."""
    assert tag_of(tool_spec(WEATHER, LOOKUP)) == {"type": "sequence", "elements": [
        PRE_CALL_TEXT,
        tools_section({"type": "tags_with_separator", "separator": "", "at_least_one": True,
                       "tags": [call("get_weather", WEATHER_ARGS), call("lookup", FREE_ARGS)]})]}


def test_named_tool_and_parallel_false() -> None:
    named = tag_of(tool_spec(WEATHER))
    assert named["elements"][1] == tools_section({
        "type": "tags_with_separator", "separator": "", "at_least_one": True,
        "tags": [call("get_weather", WEATHER_ARGS)]})
    # parallel_tool_calls false: exactly one call, of either tool.
    assert tag_of(tool_spec(WEATHER, LOOKUP, parallel_tool_calls=False))["elements"][1] == (
        tools_section({"type": "or", "elements": [call("get_weather", WEATHER_ARGS),
                                                  call("lookup", FREE_ARGS)]}))
    assert tag_of(tool_spec(WEATHER, parallel_tool_calls=False))["elements"][1] == (
        tools_section(call("get_weather", WEATHER_ARGS)))


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_with_strict_tools_is_triggered(parallel: bool) -> None:
    """tool_choice auto: any text, and a tools section only when the model opens one; after
    one section nothing more when parallel_tool_calls is false."""
    calls = [call("get_weather", WEATHER_ARGS), call("lookup", FREE_ARGS)]
    section = tools_section({"type": "tags_with_separator", "separator": "",
                             "at_least_one": True, "tags": calls} if parallel else
                            {"type": "or", "elements": calls})
    assert tag_of(tool_spec(WEATHER, LOOKUP, optional_calls=True,
                            parallel_tool_calls=parallel)) == {
        "type": "triggered_tags", "triggers": ["<|open|>tools<|sep|>"], "tags": [section],
        "excludes": ["<|open|>think<|sep|>", THINK_CLOSE, "<|open|>call"],
        "stop_after_first": not parallel}


@pytest.mark.parametrize("optional_calls", [False, True])
def test_thinking_puts_the_reasoning_first(optional_calls: bool) -> None:
    off = tag_of(tool_spec(WEATHER, optional_calls=optional_calls))
    on = tag_of(tool_spec(WEATHER, optional_calls=optional_calls, thinking=True))
    assert on == {"type": "sequence", "elements": [REASONING, off]}


def test_structural_tag_text_holds_the_exact_markers() -> None:
    text = sglang_constraint(tool_spec(WEATHER, LOOKUP, thinking=True))["structural_tag"]
    for marker in ("<|close|>think<|sep|>", "<|open|>tools<|sep|>", "<|close|>tools<|sep|>",
                   '<|open|>call tool=\\"get_weather\\" index=\\"', "<|close|>call<|sep|>",
                   '<|open|>argument key=\\"city\\" type=\\"string\\"<|sep|>',
                   "<|close|>argument<|sep|>", "<|close|>message<|sep|>", "<|end_of_msg|>"):
        assert marker in text, marker
    # The markers are K3's control tokens as the app renders them.
    o, c, s = xtml_render.OPEN, xtml_render.CLOSE, xtml_render.SEP
    ours = (grammar.THINK_OPEN, grammar.THINK_CLOSE, grammar.RESPONSE_OPEN,
            grammar.TOOLS_CLOSE, grammar.CALL_OPEN, grammar.END_OF_MSG)
    assert ours == (f"{o}think{s}", f"{c}think{s}", f"{o}response{s}", f"{c}tools{s}",
                    f"{o}call", xtml_render.END_OF_MSG)


def test_strict_argument_schemas() -> None:
    """Per-type branches, $ref through $defs, additional properties, SGLang's split of a
    negative integer lower bound, escaped attribute values (st.py:212-424)."""
    defs = {"P": {"type": "object", "properties": {"x": {"type": "number"}}}}
    tool = ToolSpec("t", {"type": "object", "$defs": defs, "properties": {
        'a"&b': {"type": ["string", "null"]}, "p": {"$ref": "#/$defs/P"},
        "n": {"type": "integer", "minimum": -5}}, "required": ['a"&b', "n"]}, strict=True)
    args = tag_of(tool_spec(tool))["elements"][1]["content"]["tags"][0]["content"][
        "elements"][2]["elements"]

    def arg(key: str, xtml: str, schema: Any, style: str = "json") -> dict:
        return {"type": "tag", "begin": f'<|open|>argument key="{key}" type="{xtml}"<|sep|>',
                "content": {"type": "json_schema", "json_schema": schema, "style": style},
                "end": ARG_CLOSE}
    # Each narrowed schema carries the root's $defs, so references inside still resolve.
    assert args[0] == {"type": "or", "elements": [
        arg("a&quot;&amp;b", "string", {"type": "string", "$defs": defs}, "qwen_xml"),
        arg("a&quot;&amp;b", "null", {"type": "null", "$defs": defs})]}
    assert args[1] == {"type": "optional", "content": arg("p", "object", {
        "type": "object", "properties": {"x": {"type": "number"}}, "$defs": defs})}
    assert args[2] == arg("n", "number", {"anyOf": [
        {"type": "integer", "minimum": -5, "$defs": defs, "maximum": -1},
        {"type": "integer", "minimum": 0, "$defs": defs}]})
    # additionalProperties absent: any further keys, values checked only as JSON.
    extra = args[3]
    assert extra["type"] == "star" and extra["content"]["begin"] == '<|open|>argument key="'
    assert extra["content"]["content"]["elements"][0]["elements"][2] == {
        "type": "json_schema", "json_schema": {"type": "string"}, "style": "qwen_xml"}
    assert len(args) == 4
    # A strict tool without parameters takes no arguments.
    no_params = tag_of(tool_spec(ToolSpec("now", None, strict=True)))
    assert no_params["elements"][1]["content"]["tags"][0]["content"]["elements"][2] == {
        "type": "const_string", "value": ""}


def test_non_strict_tools_leave_arguments_free() -> None:
    strict_off = ToolSpec("get_weather", WEATHER.parameters, strict=False)
    section = tag_of(tool_spec(strict_off))["elements"][1]
    assert section["content"]["tags"][0] == call("get_weather", FREE_ARGS)


@pytest.mark.parametrize("parameters", [
    {"type": "string"},  # not an object schema
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},  # accepts no value
])
def test_an_unbuildable_tag_leaves_the_output_free(parameters: dict,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """As SGLang (function_call_parser.py:431-433): no constraint rather than a failure."""
    with caplog.at_level(logging.WARNING, logger="serve_app.sglang"):
        assert sglang_constraint(tool_spec(ToolSpec("f", parameters, strict=True))) == {}
    assert "no grammar for tool_choice" in caplog.text


def test_sampling_params_carry_the_constraint() -> None:
    spec = tool_spec(WEATHER)
    out = sampling_params(SamplingParams(temperature=0.0, max_tokens=9, grammar=spec))
    assert out == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 9,
                   "ignore_eos": False, **sglang_constraint(spec)}
    json_out = sampling_params(SamplingParams(grammar=GrammarSpec("json_object", "rf")))
    assert json_out["json_schema"] == '{"type":"object"}'
    free = sampling_params(SamplingParams())
    assert "json_schema" not in free and "structural_tag" not in free
    assert sglang_constraint(None) == {}


# --- server arguments ---

def test_production_names_the_grammar_backend() -> None:
    """xgrammar (the backend of SGLang's K3 structural tags) and compact JSON on the
    json_schema path, both SGLang 0.5.23 flags the start-up checks accept."""
    assert SGLANG_GRAMMAR_ARGS == {"grammar_backend": "xgrammar",
                                   "constrained_json_disable_any_whitespace": True}
    fields = sglang_fields()
    assert fields["grammar_backend"]["flag"] == "--grammar-backend"
    assert "xgrammar" in fields["grammar_backend"]["choices"]
    assert fields["constrained_json_disable_any_whitespace"]["type"] == "bool"
    assert fields["constrained_json_disable_any_whitespace"]["default"] is False
    assert not set(SGLANG_GRAMMAR_ARGS) & _MANAGED
    config = app_config(PRODUCTION)
    assert config.engine.sglang.extra_server_args == SGLANG_GRAMMAR_ARGS
    args = sglang_server_args(config)
    assert args["grammar_backend"] == "xgrammar"
    assert args["constrained_json_disable_any_whitespace"] is True
    assert check_server_args(args) == []


# --- SGLang's source, when unpacked ---

def test_markers_are_sglangs() -> None:
    source = sglang_file("srt/function_call/kimik3_format.py")
    constants = {node.targets[0].id: node.value.value
                 for node in ast.parse(source.read_text()).body
                 if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                 and isinstance(node.value, ast.Constant)}
    names = ("THINK_OPEN", "THINK_CLOSE", "RESPONSE_OPEN", "RESPONSE_CLOSE", "TOOLS_OPEN",
             "TOOLS_CLOSE", "MESSAGE_CLOSE", "CALL_OPEN", "CALL_CLOSE", "ARGUMENT_CLOSE")
    assert {n: getattr(grammar, n) for n in names} == {n: constants[n] for n in names}
    # The patterns mirrored from the tag builder, as written there.
    tags = (source.parent / "kimik3_structural_tag.py").read_text()
    assert "RegexFormat(pattern=r\"[1-9][0-9]*\")" in tags
    assert "RegexFormat(pattern=r'[^\"& \\t\\r\\n\\f\\v=<>]+')" in tags
    assert grammar._FREE_KEY == r'[^"& \t\r\n\f\v=<>]+'
