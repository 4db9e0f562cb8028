"""Image content parts from the wire to K3's prompt, without a server: the parts as the
protocol reads them (every malformed one a 400 naming its field), where K3's renderer puts
each image, the image prompt's ids and offsets with K3's real tokenizer, and the
`<|kimi_image_placeholder|>` rewrite."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from tiny_models import write_k3_style_tokenizer

from serve_app.chat import k3_request
from serve_app.chat.formats import JinjaFormat, K3Format
from serve_app.chat.segments import encode_prompt, encode_segments, image_parts
from serve_app.chat.xtml_render import render
from serve_app.protocol.openai import (
    MAX_IMAGE_URL_CHARS,
    ChatCompletionRequest,
    ImagePart,
    OpenAIError,
)
from serve_app.tokenizer import load_tokenizer

# K3's real text vocabulary and control ids, its media tokens among them (163602-163605):
# loaded once per module by the fixture below.
K3_TOKENIZER: Any = None
PNG = "data:image/png;base64,iVBORw0KGgo="


@pytest.fixture(scope="module", autouse=True)
def _k3_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> None:
    global K3_TOKENIZER
    K3_TOKENIZER = load_tokenizer(write_k3_style_tokenizer(tmp_path_factory.mktemp("k3")))


@dataclass(frozen=True)
class Sized:
    """What the image prompt reads of a prepared image."""

    width: int
    height: int
    tokens: int


def request(messages: list[dict[str, Any]], **body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **body})


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def image_url(url: Any = PNG, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def k3_plan(messages: list[dict[str, Any]], vision: bool = True, **body: Any) -> Any:
    return K3Format(K3_TOKENIZER, vision=vision).plan(request(messages, **body))


def refused(messages: list[dict[str, Any]], vision: bool = True) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        k3_plan(messages, vision)
    assert info.value.status == 400
    return info.value


# --- the parts on the wire ---------------------------------------------------------------------


def test_both_image_part_shapes_are_read_with_their_field() -> None:
    m = request([user({"type": "text", "text": "a"}, image_url(detail="low"),
                      {"type": "input_image", "image_url": "data:image/jpeg;base64,AA",
                       "detail": "high"},
                      {"type": "input_image", "image_url": {"url": PNG}})]).messages[0]
    assert m.parts("messages[0]") == [
        "a", ImagePart("messages[0].content[1]", PNG, "low"),
        ImagePart("messages[0].content[2]", "data:image/jpeg;base64,AA", "high"),
        ImagePart("messages[0].content[3]", PNG)]
    assert m.parts("messages[0]")[1].param == "messages[0].content[1].image_url"


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "image_url"}, "image_url"),
    ({"type": "image_url", "image_url": None}, "image_url"),
    ({"type": "image_url", "image_url": 5}, "image_url"),
    ({"type": "image_url", "image_url": ["data:,"]}, "image_url"),
    ({"type": "image_url", "image_url": {}}, "image_url.url"),
    ({"type": "image_url", "image_url": {"detail": "low"}}, "image_url.url"),
    (image_url(5), "image_url.url"),
    (image_url(None), "image_url.url"),
    (image_url(""), "image_url.url"),
    (image_url({"url": PNG}), "image_url.url"),
    (image_url("data:image/png;base64,\ud800"), "image_url.url"),
    (image_url("d" * (MAX_IMAGE_URL_CHARS + 1)), "image_url.url"),
    (image_url(detail="ultra"), "image_url.detail"),
    ({"type": "input_image"}, "image_url"),
    ({"type": "input_image", "image_url": 7}, "image_url"),
    ({"type": "input_image", "image_url": ""}, "image_url"),
    ({"type": "input_image", "image_url": "\udfff"}, "image_url"),
    ({"type": "input_image", "image_url": PNG, "detail": 3}, "detail"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA"}}, "type"),
    ({"type": "input_video", "video_url": "x"}, "type"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "type"),
    ({"type": "audio_url", "audio_url": {"url": "x"}}, "type"),
    ({"type": "input_file", "file_id": "f"}, "type"),
    ({"type": "bogus"}, "type"),
])
def test_every_malformed_or_unserved_part_is_a_400_naming_its_field(part: dict[str, Any],
                                                                    param: str) -> None:
    err = refused([user({"type": "text", "text": "look"}, part)])
    assert err.param == f"messages[0].content[1].{param}", err.message
    assert "\\u" not in err.message and "\ud800" not in err.message


def test_a_video_part_says_what_is_not_served() -> None:
    err = refused([user({"type": "video_url", "video_url": {"url": "x"}})])
    assert "video" in err.message and err.param == "messages[0].content[0].type"


def test_a_model_without_vision_refuses_the_image_part_by_name() -> None:
    # K3's format on a checkpoint without a tower, and a Jinja template's: one answer.
    messages = [{"role": "system", "content": "s"}, user({"type": "text", "text": "a"},
                                                         image_url())]
    err = refused(messages, vision=False)
    assert (err.param, err.message) == ("messages[1].content[1]",
                                        "the served model has no vision input")
    jinja = JinjaFormat.__new__(JinjaFormat)  # the refusal comes before the template runs
    with pytest.raises(OpenAIError) as info:
        jinja.plan(request(messages))
    assert info.value.param == "messages[1].content[1]"


def test_vision_needs_the_tokenizers_media_tokens() -> None:
    class NoMedia:
        def __init__(self) -> None:
            self.special_ids = {k: v for k, v in K3_TOKENIZER.special_ids.items()
                                if "media" not in k}

    assert K3Format(NoMedia(), vision=True).vision is False  # type: ignore[arg-type]
    assert K3Format(K3_TOKENIZER, vision=True).vision is True


# --- where K3's renderer puts them -------------------------------------------------------------


def test_an_image_segment_stands_where_its_part_is_in_every_role() -> None:
    """K3's renderer (`encoding_k3.py` `_render_content_segments`) renders image parts in the
    content of user, system, tool and assistant messages, in part order."""
    plan = k3_plan([
        {"role": "system", "content": [image_url("data:s"), {"type": "text", "text": "sys"}]},
        user({"type": "text", "text": "before"}, image_url("data:u1"),
             {"type": "text", "text": "between"}, image_url("data:u2")),
        {"role": "assistant", "content": [{"type": "text", "text": "seen"}, image_url("data:a")]},
    ], thinking={"type": "disabled"})
    flat = ["<IMG " + s.image.url + ">" if s.image else s.text for s in plan.segments]
    text = "".join(flat)
    assert ('<|open|>message role="system"<|sep|><IMG data:s>sys<|close|>message' in text)
    assert ('role="user"<|sep|>before<IMG data:u1>between<IMG data:u2><|close|>message'
            in text)
    assert '<|open|>response<|sep|>seen<IMG data:a><|close|>response' in text
    assert [p.url for p in plan.images] == ["data:s", "data:u1", "data:u2", "data:a"]
    assert [p.where for p in plan.images] == [
        "messages[0].content[0]", "messages[1].content[1]", "messages[1].content[3]",
        "messages[2].content[1]"]


def test_tool_result_images_follow_the_calls_order() -> None:
    """Tool results render in the order of the calls they answer: so do their images, and
    the plan's images are in prompt order, not request order."""
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]}
    plan = k3_plan([user({"type": "text", "text": "go"}), call,
                    {"role": "tool", "tool_call_id": "c2", "content": [image_url("data:2")]},
                    {"role": "tool", "tool_call_id": "c1", "content": [image_url("data:1")]}],
                   tools=[{"type": "function", "function": {"name": "shot"}}])
    assert [(p.url, p.where) for p in plan.images] == [
        ("data:1", "messages[3].content[0]"), ("data:2", "messages[2].content[0]")]


def test_a_system_message_declaring_tools_takes_no_image() -> None:
    err = refused([{"role": "system", "tools": [{"type": "function", "function": {"name": "f"}}],
                    "content": [image_url()]}, user({"type": "text", "text": "x"})])
    assert err.param == "messages[0].content"


# --- the image prompt's ids --------------------------------------------------------------------


def test_the_image_prompt_ids_and_offsets_with_k3s_tokenizer() -> None:
    """`<|media_begin|>image WxH<|media_content|>` + tokens x `<|media_pad|>` +
    `<|media_end|>` (SGLang 0.5.23 `_expand_k3_image_prompt_token_ids`), the size as
    ordinary text; each image's offset is where its pad run starts."""
    plan = k3_plan([user({"type": "text", "text": "what?"}, image_url("data:a"),
                         image_url("data:b"))], thinking={"type": "disabled"})
    sizes = [Sized(640, 480, 6), Sized(37, 1001, 3)]
    ids, offsets = encode_prompt(K3_TOKENIZER, plan.segments, sizes)
    text_only = [s for s in plan.segments if s.image is None]
    head = encode_segments(K3_TOKENIZER, text_only[:text_only.index(
        next(s for s in text_only if s.text == "what?")) + 1])
    size_640 = K3_TOKENIZER.encode_text("image 640x480")
    size_37 = K3_TOKENIZER.encode_text("image 37x1001")
    assert ids[len(head):len(head) + 2 + len(size_640) + 6 + 1] == [
        163602, *size_640, 163603, *[163605] * 6, 163604]
    assert offsets[0] == len(head) + 1 + len(size_640) + 1
    second = offsets[0] + 6 + 1
    assert ids[second:offsets[1]] == [163602, *size_37, 163603]
    assert ids[offsets[1]:offsets[1] + 4] == [163605] * 3 + [163604]
    assert ids.count(163605) == 9
    # Everything else is the text-only encoding, unchanged.
    rest = ids[:len(head)] + ids[offsets[1] + 4:]
    assert rest == encode_segments(K3_TOKENIZER, text_only)


def test_the_image_count_must_match_the_segments() -> None:
    plan = k3_plan([user(image_url(), image_url())])
    with pytest.raises(ValueError):
        encode_prompt(K3_TOKENIZER, plan.segments, [Sized(1, 1, 1)])
    with pytest.raises(ValueError):
        encode_segments(K3_TOKENIZER, plan.segments)


def test_client_text_cannot_forge_media_tokens() -> None:
    plan = k3_plan([user({"type": "text", "text": "<|media_pad|><|media_begin|>"})])
    ids = encode_segments(K3_TOKENIZER, plan.segments)
    assert not {163602, 163603, 163604, 163605} & set(ids)


def test_prompt_tokens_count_the_image_tokens() -> None:
    """usage.prompt_tokens is the ids sent to the engine, images expanded, minus K3's
    3-token stub (kimi-k3-api.md 4.5): here the text prompt plus each image's prompt."""
    text = k3_plan([user({"type": "text", "text": "hi"})])
    with_image = k3_plan([user({"type": "text", "text": "hi"}, image_url())])
    ids, _ = encode_prompt(K3_TOKENIZER, with_image.segments, [Sized(28, 28, 1)])
    frame = len(K3_TOKENIZER.encode("<|media_begin|>image 28x28<|media_content|>")) + 1
    assert with_image.stub_tokens == 3
    assert len(ids) - with_image.stub_tokens == (
        len(encode_segments(K3_TOKENIZER, text.segments)) - 3 + frame + 1)


# --- the placeholder rewrite -------------------------------------------------------------------


PLACEHOLDER = "<|kimi_image_placeholder|>"
AS_TEXT = "<| kimi_image_placeholder |>"


def test_the_image_placeholder_in_client_text_is_rewritten() -> None:
    """Where SGLang 0.5.23 rewrites it (`_prepare_kimi_k3_messages`): every message's text,
    string or parts, the assistant's reasoning and its calls' arguments."""
    parsed = k3_request.parse(request([
        {"role": "system", "content": f"s{PLACEHOLDER}"},
        user({"type": "text", "text": f"u{PLACEHOLDER}"}, image_url()),
        {"role": "assistant", "content": PLACEHOLDER, "reasoning_content": f"r{PLACEHOLDER}",
         "tool_calls": [
             {"id": "a", "type": "function",
              "function": {"name": "f", "arguments": f'{{"q": "{PLACEHOLDER}"}}'}},
             {"id": "b", "type": "function",
              "function": {"name": "f", "arguments": {"q": [PLACEHOLDER]}}},
             {"id": "c", "type": "function", "function": {"name": "f",
                                                          "arguments": f"raw {PLACEHOLDER}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": PLACEHOLDER},
    ], tools=[{"type": "function", "function": {"name": "f"}}]))
    text = "".join(s.text for s in render(parsed.messages, parsed.options))
    assert PLACEHOLDER not in text
    assert text.count(AS_TEXT) == 8
    _, first, assistant, _ = parsed.messages
    assert first.parts[0] == f"u{AS_TEXT}" and isinstance(first.parts[1], ImagePart)
    assert assistant.reasoning == f"r{AS_TEXT}"
    assert [c.arguments for c in assistant.tool_calls[:2]] == [{"q": AS_TEXT},
                                                                {"q": [AS_TEXT]}]
    assert assistant.tool_calls[2].raw == f"raw {AS_TEXT}"
    assert image_parts(render(parsed.messages, parsed.options)) == (first.parts[1],)
