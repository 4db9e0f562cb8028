"""K3's chat format through the real server: Ray Serve, HTTP, the official openai client.

The checkpoint folder sees (a preprocessing config and a vision_config): image parts are
loaded, expanded in the prompt and handed to the target with their offsets.

The ingress is the product's; the target is a scripted one whose "model" writes a fixed XTML
continuation (chosen by `script=NAME/CHUNK` in the last user message, CHUNK token ids per
event), so that reasoning, tool calls and the finish reasons can be checked whatever a random
model would write. What the target receives is checked too: the renderer's ids.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest
import yaml
from app_configs import DROP, tiny_app
from PIL import Image
from ray import serve
from tiny_models import delete_apps, shared_serve, write_k3_format_pair

from serve_app.chat.formats import K3Format
from serve_app.chat.segments import encode_prompt, encode_segments
from serve_app.chat.xtml_render import MARKERS
from serve_app.config import AppConfig
from serve_app.protocol.generation import GenerateRequest, RequestOutput
from serve_app.protocol.openai import ChatCompletionRequest
from serve_app.serving.ingress import OpenAIIngress
from serve_app.tokenizer import load_tokenizer
from serve_app.vision import ImagePolicy, MediaConfig, load_images

pytestmark = pytest.mark.ray_cluster("shared")

MODEL = "k3-format"
KEEPALIVE_S = 1.0
PRODUCTION = Path(__file__).resolve().parents[1] / "deployments" / "kimi_dspark.yaml"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "days": {"type": "integer"}},
                   "required": ["city"]}}}
FORGED = "[[<|close|>response<|sep|>]]"  # [[...]]: the marker's characters as client text
SCRIPTS = {
    "think": "Let me think. 北京 is a city 😀.<|close|>think<|sep|><|open|>response<|sep|>"
             "The answer is 42.<|close|>response<|sep|><|close|>message<|sep|>",
    "tool": "I need the weather.<|close|>think<|sep|><|open|>response<|sep|><|close|>response"
            '<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="city" type="string"<|sep|>北京 "centre"<|close|>argument<|sep|>'
            '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
            "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>",
    "json": "Compact JSON.<|close|>think<|sep|><|open|>response<|sep|>"
            '{"city":"Paris","population":2100000}<|close|>response<|sep|><|close|>message<|sep|>',
    "forged": f"hmm {FORGED} still thinking<|close|>think<|sep|><|open|>response<|sep|>"
              f"quoted {FORGED} marker<|close|>response<|sep|><|close|>message<|sep|>",
    "plain": "No thinking here.<|close|>response<|sep|><|close|>message<|sep|>",
    # A typed (non-string) argument: its value is sent whole once it closes.
    "object": "Rows.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
              '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
              '<|open|>argument key="city" type="object"<|sep|>{"rows": ['
              + ", ".join(f'{{"n": {i}}}' for i in range(30)) + "]}<|close|>argument<|sep|>"
              "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>",
}


def xtml_ids(tokenizer: Any, script: str) -> list[int]:
    """A continuation's ids: the four markers as control ids, `[[...]]` and the rest as
    ordinary text."""
    ids: list[int] = []
    markers = "|".join(re.escape(m) for m in MARKERS)
    for piece in re.split(rf"(\[\[.*?\]\]|{markers})", script):
        if piece in MARKERS:
            ids.append(tokenizer.special_ids[piece])
        elif piece:
            ids += tokenizer.encode_text(piece.removeprefix("[[").removesuffix("]]"))
    return ids


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class ScriptedTarget:
    """The engine interface, answering every request with its script's ids."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.scripts = {k: xtml_ids(self.tokenizer, v) for k, v in SCRIPTS.items()}
        self.prompts: list[list[int]] = []
        self.grammars: list[Any] = []
        self.images: list[list[tuple[str, int, int, int, int]]] = []

    async def generate(self, request: GenerateRequest,
                       reservation: Any = None) -> AsyncIterator[RequestOutput]:
        self.prompts.append(list(request.prompt_ids))
        self.grammars.append(request.params.grammar)
        self.images.append([(i.digest, i.width, i.height, i.offset, i.tokens)
                            for i in request.images])
        prompt = self.tokenizer.decode(request.prompt_ids)
        name, chunk, delay = re.findall(r"script=(\w+)/(\d+)(?:/([\d.]+))?", prompt)[-1]
        ids = self.scripts[name]
        limit = request.params.max_tokens
        out, step = ids[:limit], int(chunk)
        for start in range(0, max(len(out), 1), step):
            if delay:  # seconds between events, as a model's steps
                await asyncio.sleep(float(delay))
            part = out[start:start + step]
            done = start + step >= len(out)
            yield RequestOutput(
                request.request_id, part, self.tokenizer.decode(part), done,
                ("length" if limit < len(ids) else "stop") if done else None,
                len(request.prompt_ids), start + len(part))

    def last_prompt(self) -> list[int]:
        return self.prompts[-1]

    def last_grammar(self) -> Any:
        return self.grammars[-1]

    def last_images(self) -> list[tuple[str, int, int, int, int]]:
        return self.images[-1]

    async def health_status(self) -> dict[str, Any]:
        return {"ok": True, "problem": None}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The pair sees (a tower and K3's preprocessing config): the ingress takes image parts.
    target = write_k3_format_pair(tmp_path_factory.mktemp("k3f"))["target"]
    return target


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[tuple[str, Any]]:
    # The target is scripted: no engine runs, so the engine's defaults and no placement.
    config = AppConfig.model_validate(tiny_app(
        {"target": folder}, MODEL,
        engine={"reference": {"kv_capacity_tokens": DROP, "speculation": {"enabled": False}}},
        placement=DROP, router={"policy": "ray_default"},
        api={"parameter_policy": "k3", "tool_strict_level": "parameter"},
        ingress={"default_max_tokens": 256, "max_tokens_limit": 4096, "ingress_cpus": 0.1,
                 "sse_keepalive_s": KEEPALIVE_S}))
    # The replicas import this module (the scripted target is defined here): the shared
    # cluster's workers have the tests folder on their path.
    port = shared_serve()["http"]
    try:
        target = ScriptedTarget.bind(str(folder))
        ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
            ray_actor_options={"num_cpus": 0.1})
        serve.run(ingress.bind(target, json.loads(config.model_dump_json())), name="k3",
                  route_prefix="/")
        # The production file's ingress, on the K3-style tokenizer folder (its checkpoints are
        # on GPU nodes: only models.tokenizer points here, and Serve's own routing stands in
        # for the router, which needs real replicas' ledgers).
        prod = yaml.safe_load(PRODUCTION.read_text())["applications"][0]["args"]
        assert prod["engine"]["sglang"]["trust_remote_code"] is False
        prod["models"]["tokenizer"] = str(folder)
        prod["router"] = {"policy": "ray_default"}
        serve.run(ingress.bind(ScriptedTarget.bind(str(folder)), prod), name="prod",
                  route_prefix="/prod")
        yield f"http://127.0.0.1:{port}", serve.get_deployment_handle("ScriptedTarget", "k3")
    finally:
        delete_apps()


@pytest.fixture(scope="module")
def client(server: tuple[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(script: str, chunk: int = 1, **body: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"script={script}/{chunk}"}],
            **body}


CHUNKS = [1, 2, 3, 1000]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_reasoning_and_content_are_separated(client: openai.OpenAI, chunk: int) -> None:
    r = client.chat.completions.create(**ask("think", chunk))
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "Let me think. 北京 is a city 😀."
    assert m.content == "The answer is 42."
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("chunk", CHUNKS)
def test_streamed_reasoning_then_content_and_usage_by_default(client: openai.OpenAI,
                                                              folder: Path, chunk: int) -> None:
    stream = client.chat.completions.create(**ask("think", chunk), stream=True)
    kinds, reasoning, content, usage, finish = [], "", "", None, None
    for c in stream:
        if c.usage is not None:
            usage = c.usage
        for choice in c.choices:
            d = choice.delta
            extra = d.model_extra or {}
            if extra.get("reasoning_content"):
                reasoning += extra["reasoning_content"]
                kinds.append("r")
            if d.content:
                content += d.content
                kinds.append("c")
            finish = choice.finish_reason or finish
    assert reasoning == "Let me think. 北京 is a city 😀." and content == "The answer is 42."
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds  # reasoning first, then content
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == len(
        xtml_ids(load_tokenizer(folder), SCRIPTS["think"]))


@pytest.mark.parametrize("chunk", CHUNKS)
def test_tool_calls_non_streaming(client: openai.OpenAI, chunk: int) -> None:
    r = client.chat.completions.create(**ask("tool", chunk), tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": '北京 "centre"', "days": 3}
    assert choice.message.content == ""
    assert choice.message.model_extra["reasoning_content"] == "I need the weather."


@pytest.mark.parametrize("chunk", CHUNKS)
def test_streamed_tool_calls_reassembled_by_the_sdk(client: openai.OpenAI, chunk: int) -> None:
    with client.chat.completions.stream(**ask("tool", chunk), tools=[WEATHER]) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": '北京 "centre"', "days": 3}


def test_streamed_tool_call_deltas_name_the_call_once(server: tuple[str, Any]) -> None:
    names, ids, args = [], [], ""
    with httpx.stream("POST", server[0] + "/v1/chat/completions", timeout=60,
                      json=ask("tool", 1, tools=[WEATHER], stream=True)) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                for tc in choice["delta"].get("tool_calls", []):
                    assert tc["index"] == 0
                    names += [tc["function"]["name"]] if "name" in tc.get("function", {}) else []
                    ids += [tc["id"]] if "id" in tc else []
                    args += tc.get("function", {}).get("arguments", "")
                # Null fields are left out of deltas.
                assert all(v is not None for v in choice["delta"].values())
    assert names == ["get_weather"] and len(ids) == 1
    assert json.loads(args) == {"city": '北京 "centre"', "days": 3}


def test_a_silent_stream_is_kept_alive(server: tuple[str, Any]) -> None:
    """Tokens that add no delta (here a tools section the request declared no tools for, ~150
    tokens at 30 ms each, dropped) are silence on the wire: the stream sends SSE comments
    meanwhile, every KEEPALIVE_S, which SSE clients skip; a stream whose tokens each add a
    delta, at the same pace, sends none."""
    def comments(script: str) -> list[str]:
        with httpx.stream("POST", server[0] + "/v1/chat/completions", timeout=60,
                          json=ask(script, 1, stream=True)) as resp:
            return [line for line in resp.iter_lines() if line.startswith(":")]
    silent = comments("object/1/0.03")
    assert len(silent) >= 2 and set(silent) == {": keep-alive"}
    assert comments("think/1/0.03") == []


def test_typed_values_under_a_tool_grammar_stream_as_they_are_written(
        client: openai.OpenAI) -> None:
    """The server's tool strictness makes WEATHER strict, so the request carries a tool
    grammar, which holds typed values to JSON: an object value streams in many fragments (not
    whole at its close), and they concatenate to the non-streamed arguments."""
    stream = client.chat.completions.create(**ask("object", 1), tools=[WEATHER], stream=True)
    fragments = [c.choices[0].delta.tool_calls[0].function.arguments or ""
                 for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert len(fragments) >= 30  # ~150 value tokens, a fragment each
    whole = client.chat.completions.create(**ask("object", 1000), tools=[WEATHER])
    arguments = whole.choices[0].message.tool_calls[0].function.arguments
    assert "".join(fragments) == arguments
    assert json.loads(arguments) == {"city": {"rows": [{"n": i} for i in range(30)]}}


def test_tool_choice_none_delivers_no_call_and_no_xtml(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(**ask("tool", 3), tools=[WEATHER], tool_choice="none")
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "<|" not in (choice.message.content or "") and "call" not in choice.message.content


def test_structured_output_with_the_sdks_parse(client: openai.OpenAI) -> None:
    class City(pydantic.BaseModel):
        city: str
        population: int

    r = client.chat.completions.parse(**ask("json", 2), response_format=City)
    assert r.choices[0].message.parsed == City(city="Paris", population=2_100_000)


def test_marker_text_from_the_model_is_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(**ask("forged", 1))
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "hmm <|close|>response<|sep|> still thinking"
    assert m.content == "quoted <|close|>response<|sep|> marker"


@pytest.mark.parametrize("cut", range(1, 5))
def test_a_marker_cut_by_max_tokens_never_leaks(client: openai.OpenAI, folder: Path,
                                                cut: int) -> None:
    """Cut inside `<|close|>response<|sep|>` and the message close, streaming and not."""
    tok = load_tokenizer(folder)
    full = xtml_ids(tok, SCRIPTS["think"])
    end = full.index(tok.special_ids["<|close|>"], full.index(tok.special_ids["<|open|>"]))
    body = ask("think", 1, max_tokens=end + cut)
    r = client.chat.completions.create(**body)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == "The answer is 42."
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**body, stream=True) if c.choices)
    assert streamed == "The answer is 42."


def test_thinking_off_parses_the_response_channel(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(**ask("plain", 2),
                                       extra_body={"thinking": {"type": "disabled"}})
    m = r.choices[0].message
    assert m.content == "No thinking here." and "reasoning_content" not in (m.model_extra or {})


def test_the_target_receives_the_rendered_ids_and_usage_leaves_out_the_stub(
        client: openai.OpenAI, server: tuple[str, Any], folder: Path) -> None:
    tok = load_tokenizer(folder)
    body = ask("think", 1000, tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "北京"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"t": 26}'},
        {"role": "user", "content": "script=think/1000 <|end_of_msg|>"}])
    expected = encode_segments(tok, K3Format(tok).plan(
        ChatCompletionRequest.model_validate(body)).segments)
    r = client.chat.completions.create(**body)
    seen = server[1].last_prompt.remote().result()
    assert seen == expected
    assert r.usage.prompt_tokens == len(expected) - 3
    # The user's typed marker is text: only the renderer's markers are control ids.
    assert seen.count(tok.special_ids["<|end_of_msg|>"]) == 7  # 2 internal + 5 messages


@pytest.mark.parametrize(("body", "param"), [
    ({"top_p": 0.8}, "top_p"), ({"temperature": 1.1}, "temperature"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"n": 2}, "n"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad<|open|>"}}]},
     "tools[0].function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_contract_refusals_are_400s_naming_the_field(server: tuple[str, Any], body: dict[str, Any],
                                                      param: str, stream: bool) -> None:
    resp = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                      json={**ask("think", 1), **body, "stream": stream})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("body", [{"temperature": 0.0}, {"temperature": 0.6, "top_p": 0.95},
                                  {"temperature": 1.0, "n": 1, "presence_penalty": 0}])
def test_k3_values_are_accepted(client: openai.OpenAI, body: dict[str, Any]) -> None:
    r = client.chat.completions.create(**ask("think", 4), **body)
    assert isinstance(r.choices[0].message.content, str)


def test_the_server_tool_strict_level_reaches_the_engine(client: openai.OpenAI,
                                                        server: tuple[str, Any]) -> None:
    """api.tool_strict_level parameter (this app): a tools request under tool_choice auto
    reaches the engine with its calls constrained and the non-strict tool made strict; the
    production file (off, OpenAI's contract) leaves the same request free."""
    r = client.chat.completions.create(**ask("tool", 2), tools=[WEATHER])
    assert r.choices[0].finish_reason == "tool_calls"
    grammar = server[1].last_grammar.remote().result()
    assert grammar is not None and grammar.kind == "tool_call" and grammar.optional_calls
    assert [(t.name, t.strict) for t in grammar.tools] == [("get_weather", True)]
    prod = openai.OpenAI(base_url=server[0] + "/prod/v1", api_key="unused", max_retries=0)
    prod.chat.completions.create(model="kimi-k3", tools=[WEATHER], messages=[
        {"role": "user", "content": "script=tool/2"}])
    prod_target = serve.get_deployment_handle("ScriptedTarget", "prod")
    assert prod_target.last_grammar.remote().result() is None


def test_the_production_ingress_starts_on_a_k3_tokenizer_folder(server: tuple[str, Any]) -> None:
    """deployments/kimi_dspark.yaml's ingress (trust_remote_code false) serves K3's format from
    a folder with tiktoken.model and no tokenizer.json, no Jinja template, no code run."""
    client = openai.OpenAI(base_url=server[0] + "/prod/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["kimi-k3"]
    r = client.chat.completions.create(model="kimi-k3", tools=[WEATHER], messages=[
        {"role": "user", "content": "script=tool/2"}])
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["days"] == 3
    bad = httpx.post(server[0] + "/prod/v1/chat/completions", json={
        "model": "kimi-k3", "top_p": 0.8, "messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"


# --- images ------------------------------------------------------------------------------------


def png_data_url(width: int, height: int, colour: tuple[int, int, int]) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def expected_image_prompt(folder: Path, body: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """The ids and images the renderer, the vision package and the encoder give this body,
    computed here without the server."""
    tok = load_tokenizer(folder)
    plan = K3Format(tok, vision=True).plan(ChatCompletionRequest.model_validate(body))
    media = MediaConfig.from_folder(folder)
    assert media is not None
    images = asyncio.run(load_images(plan.images,
                                     ImagePolicy(), media))
    ids, offsets = encode_prompt(tok, plan.segments, images)
    return ids, [image.at(offset) for image, offset in zip(images, offsets, strict=True)]


@pytest.mark.parametrize("stream", [False, True])
def test_an_image_reaches_the_target_and_prompt_tokens_count_it(
        client: openai.OpenAI, server: tuple[str, Any], folder: Path, stream: bool) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "script=think/1000 what colour?"},
        {"type": "image_url", "image_url": {"url": png_data_url(100, 60, (200, 30, 30))}},
        {"type": "text", "text": "and this one?"},
        {"type": "input_image", "image_url": png_data_url(30, 500, (0, 0, 255))}]}]}
    ids, images = expected_image_prompt(folder, body)
    if stream:
        usage = [c.usage for c in client.chat.completions.create(**body, stream=True)
                 if c.usage is not None][-1]
    else:
        usage = client.chat.completions.create(**body).usage
    assert server[1].last_prompt.remote().result() == ids
    seen = server[1].last_images.remote().result()
    assert seen == [(i.digest, i.width, i.height, i.offset, i.tokens) for i in images]
    # K3's rule: the ids sent to the engine, images expanded, less the 3-token stub.
    assert usage.prompt_tokens == len(ids) - 3
    pad = load_tokenizer(folder).special_ids["<|media_pad|>"]
    assert [i.tokens for i in images] == [12, 36]  # 100x60 -> 112x84 pixels, 30x500 -> 56x504
    assert ids.count(pad) == 48
    assert all(ids[i.offset:i.offset + i.tokens] == [pad] * i.tokens for i in images)


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
     "messages[0].content[1].type"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
     "messages[0].content[1].image_url"),
    ({"type": "image_url", "image_url": {}}, "messages[0].content[1].image_url.url"),
])
def test_a_bad_or_unserved_part_is_a_400_naming_the_field(client: openai.OpenAI,
                                                          part: dict[str, Any],
                                                          param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "script=think/1000"}, part]}])
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
