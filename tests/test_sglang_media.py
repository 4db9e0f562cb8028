"""K3 image requests through the SGLang backend, on CPU (sglang is never imported): the ids we
send survive SGLang 0.5.23's K3 expansion unchanged, the PNGs are its image_data, and SGLang's
image pad sentinels in its KV events land on the router's blocks as `cache_keys` keys them."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import io
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from sglang_source import sglang_file

from serve_app.engines.sglang import engine as engine_module
from serve_app.engines.sglang.args import image_args, server_args_cli
from serve_app.engines.sglang.checks import image_problems
from serve_app.engines.sglang.kv_events import (
    MM_PAD_SHIFT_VALUE,
    ImageSentinels,
    KVEventTranslator,
    learn_sentinels,
)
from serve_app.engines.sglang.media import (
    K3MediaIds,
    collapse_image_prompt,
    image_data,
    png_size,
)
from serve_app.protocol.generation import GenerateRequest, SamplingParams
from serve_app.protocol.media import ImageInput, cache_keys
from serve_app.routing.prefix_index import block_hashes
from serve_app.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import write_k3_style_tokenizer

# SGLang's package source, where it is unpacked (never in CI; the same variable as
# test_k3_names.py): the copy below is checked against it.


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(write_k3_style_tokenizer(tmp_path_factory.mktemp("k3tok")))


@pytest.fixture(scope="module")
def ids(tok: Any) -> K3MediaIds:
    return K3MediaIds.from_encode(tok.encode)


# --- SGLang 0.5.23's K3 expansion, copied ----------------------------------------------------
# multimodal/processors/kimi_k3.py:72-78 (`_encode_k3_special_tokens`) and :81-127
# (`_expand_k3_image_prompt_token_ids`), the logic kept, torch's return replaced by a list.


def sglang_encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, allowed_special="all"))
    except TypeError:
        return list(tokenizer.encode(text))


def sglang_expand(input_ids: list[int], image_token_id: int, counts: list[int],
                  sizes: list[tuple[int, int]], tokenizer: Any) -> list[int]:
    if len(counts) != len(sizes):
        raise ValueError("Expected one original size for each K3 image.")
    if input_ids.count(image_token_id) != len(counts):
        raise ValueError("placeholder count")
    out: list[int] = []
    index = 0
    for token in input_ids:
        if token != image_token_id:
            out.append(token)
            continue
        width, height = sizes[index]
        out += sglang_encode(tokenizer, f"<|media_begin|>image {width}x{height}<|media_content|>")
        out += [image_token_id] * counts[index]
        out += sglang_encode(tokenizer, "<|media_end|>")
        index += 1
    return out


def _sglang_source_functions() -> dict[str, Any]:
    """The two functions exec'd from SGLang's own kimi_k3.py (skipped where it is absent)."""
    path = sglang_file("srt/multimodal/processors/kimi_k3.py")
    tree = ast.parse(path.read_text())
    wanted = {"_encode_k3_special_tokens", "_expand_k3_image_prompt_token_ids"}
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted
    namespace: dict[str, Any] = {"np": np, "torch": torch, "List": list, "Union": Any}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


# --- the ingress's rendering (serve_app/protocol/media.py's contract) -------------------------


def png(width: int, height: int, colour: tuple[int, int, int], mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def rendered(tok: Any, ids: K3MediaIds, parts: list[Any]) -> tuple[list[int], list[ImageInput]]:
    """Text parts and (width, height, tokens, colour) image parts rendered as the ingress does:
    `<|media_begin|>` + the text "image WxH" + `<|media_content|>` + N pads + `<|media_end|>`."""
    prompt: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, str):
            prompt += tok.encode_text(part)
            continue
        width, height, tokens, colour = part
        prompt += [ids.begin, *tok.encode_text(f"image {width}x{height}"), ids.content]
        data = png(width, height, colour)
        images.append(ImageInput(hashlib.sha256(data).hexdigest(), width, height,
                                 (1, 2, 2 * tokens), len(prompt), tokens, None, data))
        prompt += [ids.pad] * tokens + [ids.end]
    return prompt, images


ONE = ["Describe ", (640, 480, 6, (255, 0, 0)), " in a word."]
TWO = ["Compare ", (33, 1000, 4, (0, 0, 255)), " with", (1000, 33, 5, (0, 255, 0)), "."]


@pytest.mark.parametrize("parts", [ONE, TWO], ids=["one image", "two images"])
def test_sglang_expansion_of_what_we_send_is_the_rendered_prompt(tok: Any, ids: K3MediaIds,
                                                                 parts: list[Any]) -> None:
    prompt, images = rendered(tok, ids, parts)
    sent = collapse_image_prompt(prompt, images, ids)
    assert sent.count(ids.pad) == len(images)  # kimi_k3.py:742-751's one-to-one rule
    assert ids.begin not in sent and ids.end not in sent
    counts = [i.tokens for i in images]
    sizes = [(i.width, i.height) for i in images]
    assert sglang_expand(sent, ids.pad, counts, sizes, tok) == prompt
    # What SGLang would prefill (and report as prompt_tokens) is what the ingress counted.
    assert len(sglang_expand(sent, ids.pad, counts, sizes, tok)) == len(prompt)
    # The expanded prompt as we send it would be refused: N pads for one image.
    with pytest.raises(ValueError):
        sglang_expand(prompt, ids.pad, counts, sizes, tok)


@pytest.mark.parametrize("parts", [ONE, TWO], ids=["one image", "two images"])
def test_the_copy_is_sglangs_own_function(tok: Any, ids: K3MediaIds, parts: list[Any]) -> None:
    own = _sglang_source_functions()["_expand_k3_image_prompt_token_ids"]
    prompt, images = rendered(tok, ids, parts)
    sent = collapse_image_prompt(prompt, images, ids)
    counts = [i.tokens for i in images]
    sizes = [(i.width, i.height) for i in images]
    got = own(sent, ids.pad, counts, sizes, tok).flatten().tolist()
    assert got == sglang_expand(sent, ids.pad, counts, sizes, tok) == prompt


def test_collapse_refuses_what_sglang_would_misread(tok: Any, ids: K3MediaIds) -> None:
    prompt, images = rendered(tok, ids, ONE)
    stray = [*prompt[:2], ids.pad, *prompt[2:]]  # a pad id outside every image's run
    moved = [ImageInput(i.digest, i.width, i.height, i.grid_thw, i.offset + 1, i.tokens,
                        None, i.png) for i in images]
    with pytest.raises(ValueError, match="outside"):
        collapse_image_prompt(stray, moved, ids)
    unframed = list(prompt)
    unframed[images[0].offset - 1] = tok.encode_text("x")[0]
    with pytest.raises(ValueError, match="media_content"):
        collapse_image_prompt(unframed, images, ids)
    short = ImageInput(images[0].digest, 640, 480, (1, 2, 12), images[0].offset, 7, None,
                       images[0].png)  # a run longer than the pads there
    with pytest.raises(ValueError):
        collapse_image_prompt(prompt, [short], ids)


def test_image_data_is_the_pngs_whose_size_the_prompt_names(tok: Any, ids: K3MediaIds) -> None:
    _, images = rendered(tok, ids, TWO)
    assert image_data(images) == [i.png for i in images]
    assert png_size(png(7, 3, (0, 0, 0), "RGBA")) == (7, 3)
    lying = ImageInput("0" * 64, 640, 481, (1, 2, 2), 0, 1, None, png(640, 480, (1, 2, 3)))
    with pytest.raises(ValueError, match="640x480"):
        image_data([lying])
    with pytest.raises(ValueError, match="not a PNG"):
        png_size(b"\xff\xd8\xff\xe0 a jpeg")


def test_sglang_inputs(tok: Any, ids: K3MediaIds) -> None:
    prompt, images = rendered(tok, ids, TWO)

    def expand(collapsed: list[int], imgs: Any) -> list[int]:
        return sglang_expand(collapsed, ids.pad, [i.tokens for i in imgs],
                             [(i.width, i.height) for i in imgs], tok)

    assert engine_module.sglang_inputs([1, 2, 3], (), None) == {"input_ids": [1, 2, 3]}
    got = engine_module.sglang_inputs(prompt, images, ids, expand)
    assert got == {"input_ids": collapse_image_prompt(prompt, images, ids),
                   "image_data": [i.png for i in images]}
    with pytest.raises(ValueError, match="no K3 image processor"):
        engine_module.sglang_inputs(prompt, images, None)

    def other_count(collapsed: list[int], imgs: Any) -> list[int]:  # SGLang's NaViT disagrees
        return sglang_expand(collapsed, ids.pad, [i.tokens + 1 for i in imgs],
                             [(i.width, i.height) for i in imgs], tok)

    with pytest.raises(ValueError, match="other ids"):
        engine_module.sglang_inputs(prompt, images, ids, other_count)


# --- SGLang's pad sentinels -> the router's blocks --------------------------------------------
# managers/schedule_batch.py:167-172, 268-276 (`_compute_pad_values`), 441-444
# (`padding_sequence`): four 62-bit sentinels above MM_PAD_SHIFT_VALUE from an identity
# digest, cycled over the pad run; mm_utils.py:313-352 writes them over the pads.


def sglang_pad_values(identity: bytes) -> tuple[int, ...]:
    digest = hashlib.sha256(b"sglang-mm-wide-pad-v1" + identity).digest()
    return tuple(MM_PAD_SHIFT_VALUE + (int.from_bytes(digest[i:i + 8], "big") & ((1 << 62) - 1))
                 for i in range(0, 32, 8))


def sglang_item(image: ImageInput) -> SimpleNamespace:
    """An SGLang MultimodalDataItem as its K3 processor returns it (identity set)."""
    # SGLang's identity hashes its own digest of the bytes and its processor fingerprint.
    identity = hashlib.sha256(b"sglang:" + image.png).digest()
    values = sglang_pad_values(identity)
    return SimpleNamespace(modality="Modality.IMAGE", pad_values=values, pad_value=values[0],
                           offsets=[(image.offset, image.offset + image.tokens - 1)])


def sglang_radix_ids(prompt: list[int], images: list[ImageInput]) -> list[int]:
    ids = list(prompt)
    for image in images:
        values = sglang_item(image).pad_values
        run = [values[k % len(values)] for k in range(image.tokens)]
        ids[image.offset:image.offset + image.tokens] = run
    return ids


def stored_events(radix_ids: list[int], page: int) -> list[dict[str, Any]]:
    """SGLang's BlockStored events of one radix node holding `radix_ids` (mem_cache/events.py:
    240-270: one event per page, chained by parent hash)."""
    events, parent = [], None
    for start in range(0, len(radix_ids), page):
        chunk = radix_ids[start:start + page]
        h = int.from_bytes(hashlib.sha256(repr((parent, chunk)).encode()).digest()[:8], "big")
        events.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                       "token_ids": chunk, "block_size": len(chunk), "medium": "GPU"})
        parent = h
    return events


def router_blocks(prompt: list[int], images: list[ImageInput], learn: bool,
                  block_size: int = 4, page: int = 2) -> list[int]:
    translator = KVEventTranslator(block_size)
    if learn:
        assert learn_sentinels(translator.images, [sglang_item(i) for i in images],
                               images) == len(images)
    translator.apply(stored_events(sglang_radix_ids(prompt, images), page))
    return [h for e in translator.events for h in e["block_hashes"]]


def test_events_hash_as_the_router_keys_the_request(tok: Any, ids: K3MediaIds) -> None:
    prompt, images = rendered(tok, ids, TWO)
    assert router_blocks(prompt, images, learn=True) == list(
        block_hashes(cache_keys(prompt, images), 4))


@pytest.mark.parametrize("learn", [True, False], ids=["learned", "unlearned"])
def test_same_text_other_image_other_blocks_same_image_same_blocks(
        tok: Any, ids: K3MediaIds, learn: bool) -> None:
    red, red_images = rendered(tok, ids, ONE)
    blue, blue_images = rendered(tok, ids, [ONE[0], (640, 480, 6, (0, 0, 255)), ONE[2]])
    assert red == blue  # the same ids: only the pixels differ
    first = router_blocks(red, red_images, learn)
    other = router_blocks(blue, blue_images, learn)
    again = router_blocks(red, rendered(tok, ids, ONE)[1], learn)
    before = red_images[0].offset // 4  # the blocks wholly before the image
    assert first[:before] == other[:before]
    assert all(a != b for a, b in zip(first[before:], other[before:], strict=True))
    assert again == first
    if not learn:  # an unlearned sentinel is no image key and no text id
        assert not set(first[before:]) & set(block_hashes(cache_keys(red, red_images), 4))


def test_learn_sentinels_guesses_nothing(tok: Any, ids: K3MediaIds) -> None:
    _, images = rendered(tok, ids, TWO)
    registry = ImageSentinels()
    assert learn_sentinels(registry, [sglang_item(images[0])], images) == 0
    unset = SimpleNamespace(modality="Modality.IMAGE", pad_values=None, pad_value=None)
    assert learn_sentinels(registry, [unset, sglang_item(images[1])], images) == 1
    assert registry.key(sglang_item(images[1]).pad_values[2]) == images[1].key
    assert registry.key(163605) == 163605  # text ids pass
    bounded = ImageSentinels(max_images=1)
    for image in images:
        bounded.learn(sglang_item(image).pad_values, image.key)
    assert bounded.key(sglang_item(images[0]).pad_value) != images[0].key


# --- the engine with a stand-in SGLang -------------------------------------------------------


class StandInProcessor:
    """SGLang's K3 processor's part in one request: its output items (tokenizer_manager.py:
    1202-1208 calls it with the request object)."""

    async def process_mm_data_async(self, image_data: Any, input_text: Any, request_obj: Any,
                                    **_: Any) -> Any:
        images = request_obj.images
        return SimpleNamespace(input_ids=None, mm_items=[sglang_item(i) for i in images])


class StandInEngine:
    def __init__(self, processor: StandInProcessor, prompt_len: int) -> None:
        self.tokenizer_manager = SimpleNamespace(mm_processor=processor,
                                                 abort_request=lambda rid: None)
        self._scheduler_init_result = SimpleNamespace(scheduler_infos=[
            {"max_total_num_tokens": 4096, "max_req_input_len": 4000,
             "max_running_requests": 8}])
        self.sent: dict[str, Any] = {}
        self.prompt_len = prompt_len
        self.images: tuple[ImageInput, ...] = ()

    async def async_generate(self, **kwargs: Any) -> Any:
        self.sent = kwargs
        request_obj = SimpleNamespace(rid=kwargs["rid"], images=self.images)
        await self.tokenizer_manager.mm_processor.process_mm_data_async(
            image_data=kwargs.get("image_data"), input_text=kwargs["input_ids"],
            request_obj=request_obj)

        async def stream() -> Any:
            yield {"output_ids": [7], "text": "red", "meta_info": {
                "finish_reason": {"type": "stop"}, "prompt_tokens": self.prompt_len,
                "completion_tokens": 1}}
        return stream()


def test_engine_sends_sglangs_form_and_learns_the_sentinels(
        tok: Any, ids: K3MediaIds, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt, images = rendered(tok, ids, TWO)

    def expand(collapsed: list[int], imgs: Any) -> list[int]:
        return sglang_expand(collapsed, ids.pad, [i.tokens for i in imgs],
                             [(i.width, i.height) for i in imgs], tok)

    monkeypatch.setattr(engine_module, "_k3_media", lambda engine: (ids, expand))
    monkeypatch.setattr(engine_module.SGLangEngine, "_resolve_slots", _no_resolve)
    stand_in = StandInEngine(StandInProcessor(), len(prompt))
    stand_in.images = tuple(images)
    kv = SimpleNamespace(translator=KVEventTranslator(4), running=True, stop=lambda: None)
    config = SimpleNamespace()
    engine = engine_module.SGLangEngine(stand_in, config, {"max_running_requests": 8}, kv)
    request = GenerateRequest("r1", prompt, SamplingParams(max_tokens=1), images=tuple(images))

    async def run() -> list[Any]:
        return [out async for out in engine.generate(request)]

    outs = asyncio.run(run())
    assert stand_in.sent["input_ids"] == collapse_image_prompt(prompt, images, ids)
    assert stand_in.sent["image_data"] == [i.png for i in images]
    assert outs[-1].prompt_tokens == len(prompt)
    for image in images:
        assert kv.translator.images.key(sglang_item(image).pad_values[1]) == image.key
    assert engine._learning == {}


async def _no_resolve(self: Any) -> None:
    return None


# --- arguments and start-up checks ----------------------------------------------------------


def test_image_args_and_checks() -> None:
    config = SimpleNamespace(images=SimpleNamespace(max_images_per_request=8))
    args = image_args(config)
    assert args == {"limit_mm_data_per_request": {"image": 8}}
    assert server_args_cli(args) == ["--limit-mm-data-per-request", '{"image":8}']
    assert image_problems(args) == []
    broken = image_problems({**args, "language_model_only": True, "enable_multimodal": False,
                             "mm_process_config": {"image": {"max_pixels": 1}}})
    assert len(broken) == 3
    assert any("language_model_only" in p for p in broken)
    # A deployment that takes no images may run SGLang without its tower.
    assert image_problems({"limit_mm_data_per_request": {"image": 0},
                           "language_model_only": True}) == []
