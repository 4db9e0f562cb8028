"""Images end to end through the real reference engine: the K3-format pair (random mini K3 at
K3's vocabulary and media ids, with a random mini MoonViT-V2 tower) served over HTTP, asked
through the official openai client.

- one and two images, streamed and not, speculation on at every batch size: the greedy answer
  is token-identical to the same app with speculation off, and `prompt_tokens` is the
  renderer's count (images expanded) less K3's 3-token stub;
- the image is in the answer: the same text with another image answers from other features;
- the prefix cache keys image positions on pixels: the same text with a different image shares
  nothing from the image on (`cached_tokens` stops before its pad run), the same image resent
  hits past it, and the warm answer equals the cold one.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from app_configs import tiny_app
from PIL import Image, ImageDraw
from test_k3_chat_serve import expected_image_prompt
from tiny_models import delete_apps, shared_serve, write_k3_format_pair

from serve_app.config import AppConfig

pytestmark = pytest.mark.ray_cluster("shared")

MODEL = "kimi-k3-format"
GREEDY = {"temperature": 0.0, "max_tokens": 12}


def picture(width: int, height: int, seed: int) -> str:
    """A PNG data URL with shapes that differ by `seed` (features differ, not just a tint)."""
    image = Image.new("RGB", (width, height), (seed * 53 % 256, 90, 200 - seed * 17 % 200))
    draw = ImageDraw.Draw(image)
    for k in range(3):
        x, y = (seed * 37 + k * 29) % width, (seed * 23 + k * 41) % height
        draw.ellipse((x, y, x + width // 3, y + height // 3), fill=(255 - k * 60, seed * 40 % 256,
                                                                     k * 90))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_k3_format_pair(tmp_path_factory.mktemp("k3v"))["target"]


def _config(folder: Path, speculation: bool) -> dict[str, Any]:
    paths = {"target": folder, "draft": folder.parent / "draft"}
    return json.loads(AppConfig.model_validate(tiny_app(
        paths, MODEL, parallelism={"tp": 1}, api={"parameter_policy": "k3"},
        engine={"reference": {"prefix_cache": {"enabled": True},
                              "speculation": {"enabled": speculation, "max_batch_size": None}}},
        ingress={"default_max_tokens": 16, "max_tokens_limit": 256},
        router={"policy": "ray_default"})).model_dump_json())


@pytest.fixture(scope="module")
def clients(folder: Path) -> Iterator[dict[str, openai.OpenAI]]:
    from ray import serve

    from serve_app.app import build_app

    port = shared_serve()["http"]
    try:
        for name, spec in (("spec", True), ("plain", False)):
            serve.run(build_app(AppConfig.model_validate(_config(folder, spec))),
                      name=name, route_prefix=f"/{name}")
        yield {name: openai.OpenAI(base_url=f"http://127.0.0.1:{port}/{name}/v1",
                                   api_key="unused", max_retries=0, timeout=120)
               for name in ("spec", "plain")}
    finally:
        delete_apps()


def answer(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool,
           **body: Any) -> tuple[str, Any]:
    """(content + reasoning, usage) of one chat, streamed or not."""
    args = {"model": MODEL, "messages": messages, **GREEDY, **body}
    if not stream:
        r = client.chat.completions.create(**args)
        m = r.choices[0].message
        return (getattr(m, "reasoning_content", None) or "") + (m.content or ""), r.usage
    out, usage = "", None
    for chunk in client.chat.completions.create(**args, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            out += (getattr(c.delta, "reasoning_content", None) or "") + (c.delta.content or "")
    return out, usage


ONE = chat(text("what is in the picture?"), image(picture(100, 60, 1)))
TWO = chat(text("compare"), image(picture(100, 60, 2)), text("with"), image(picture(60, 130, 3)))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("messages", [ONE, TWO], ids=["one image", "two images"])
def test_greedy_answers_with_images_are_identical_with_speculation_on_and_off(
        clients: dict[str, openai.OpenAI], folder: Path, messages: list[dict[str, Any]],
        stream: bool) -> None:
    spec, spec_usage = answer(clients["spec"], messages, stream)
    plain, plain_usage = answer(clients["plain"], messages, stream)
    assert spec == plain and spec
    ids, images = expected_image_prompt(folder, {"model": MODEL, "messages": messages})
    assert len(images) == len(messages[0]["content"]) // 2
    assert spec_usage.prompt_tokens == plain_usage.prompt_tokens == len(ids) - 3
    assert spec_usage.completion_tokens == plain_usage.completion_tokens > 0


def test_the_answer_depends_on_the_image(clients: dict[str, openai.OpenAI]) -> None:
    """Same text, another picture: the tower's features reach the model (a server that ran the
    pads as text would answer both the same)."""
    answers = {answer(clients["plain"], chat(text("describe"), image(picture(112, 112, s))),
                      False, max_tokens=8)[0] for s in range(4)}
    assert len(answers) > 1


def test_the_prefix_cache_keys_image_positions_on_pixels(
        clients: dict[str, openai.OpenAI], folder: Path) -> None:
    client = clients["plain"]
    tail = text(" and then a long question after the picture, so that the cached prefix runs "
                "well past its pad run " * 3)
    first = chat(text("look:"), image(picture(112, 112, 11)), tail)
    other = chat(text("look:"), image(picture(112, 112, 12)), tail)
    _, images = expected_image_prompt(folder, {"model": MODEL, "messages": first})
    start, end = images[0].offset, images[0].offset + images[0].tokens
    cold, _ = answer(client, first, False)
    # Same text, different pixels: nothing from the image's first position on is shared.
    _, usage = answer(client, other, False)
    assert usage.prompt_tokens_details.cached_tokens <= start
    # The same image resent: its positions and the text after them come from the cache.
    warm, usage = answer(client, first, False)
    assert usage.prompt_tokens_details.cached_tokens >= end
    assert warm == cold
