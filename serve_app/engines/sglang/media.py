"""A K3 image prompt in the form SGLang 0.5.23's K3 processor takes it.

The ingress renders images already expanded (serve_app/protocol/media.py): each image is
`<|media_begin|>image WxH<|media_content|>` + N x `<|media_pad|>` + `<|media_end|>` in
`prompt_ids`, its pad run at `offset`. SGLang's K3 processor wants the template's form instead,
one `<|media_pad|>` per image and nothing around it, and expands that itself (cited from the
0.5.23 wheel, `sglang/srt/`):

- managers/tokenizer_manager.py:1118-1119, 1178-1182, 1202-1208: with `input_ids` given they
  are kept, and handed to the processor as its prompt (K3 sets `prefer_tokenized_input`,
  multimodal/processors/kimi_k3.py:383).
- kimi_k3.py:742-751: the number of `<|media_pad|>` ids in those ids must equal
  `len(image_data)` ("Kimi image placeholders must map one-to-one to image data"), so an
  expanded run of N pads is refused.
- kimi_k3.py:81-127 (`_expand_k3_image_prompt_token_ids`, reached from `compose_request`
  :625-636, `_prepare_input_ids` :191-205 and `prepare_deferred` :306-308 alike): each pad
  becomes `encode("<|media_begin|>image {w}x{h}<|media_content|>")` + `num_tokens` pads +
  `encode("<|media_end|>")`, `encode` with `allowed_special="all"` (:72-78); (w, h) is the size
  of the image as SGLang loaded it (`_get_image_dimensions`), `num_tokens` its NaViT count.
- tokenizer_manager.py:1225-1226: the processor's ids replace the request's; they are the ids
  the scheduler prefills and counts (`meta_info.prompt_tokens`).

So each image's whole segment, `<|media_begin|>` to `<|media_end|>`, is collapsed to one pad
(`collapse_image_prompt`); SGLang's expansion of the result is the prompt the ingress rendered,
token for token, provided its W x H and token count are the ones the ingress computed. The
engine checks that with SGLang's own expansion function before it sends a request
(`SGLangEngine._sglang_request`), the tests with a copy of it.

`image_data` is each image's `png` as raw bytes: `load_image` opens bytes with PIL
(utils/common.py:2159-2160, 2127-2131; a PNG never takes the nvJPEG path), keeping RGBA (K3
loads with `discard_alpha_channel=False`, kimi_k3.py:686-695), and the preprocessing cache
and the image's radix-cache identity hash exactly those bytes (multimodal/cache/identity.py:
163-165), so the same image resent is the same cache entry. SGLang's loader applies no EXIF
orientation (base_processor.py:1032-1043): the PNG carries the orientation applied already.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.protocol.media import ImageInput

# K3's media control tokens (tokenizer_config.json's added tokens; the ids come from the
# served tokenizer, `K3MediaIds.from_encode`).
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = (
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class K3MediaIds:
    begin: int
    content: int
    end: int
    pad: int

    @classmethod
    def from_encode(cls, encode: object) -> K3MediaIds:
        """From a trusted encoder (control-token strings -> their ids)."""
        ids = []
        for token in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD):
            got = list(encode(token))  # type: ignore[operator]
            if len(got) != 1:
                raise ValueError(f"{token} is not one token of the served tokenizer: {got}")
            ids.append(int(got[0]))
        return cls(*ids)


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk (ValueError if `png` is not a PNG)."""
    if len(png) < 24 or not png.startswith(_PNG_SIGNATURE) or png[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def collapse_image_prompt(prompt_ids: Sequence[int], images: Sequence[ImageInput],
                          ids: K3MediaIds) -> list[int]:
    """`prompt_ids` with each image's segment (`<|media_begin|>` ... `<|media_end|>`, around
    its pad run) replaced by one `<|media_pad|>`, the form SGLang's K3 processor expands
    (module doc). ValueError when the ids around a pad run are not K3's framing, or a pad id
    stands outside every image's run (SGLang would count it as one more image)."""
    out: list[int] = []
    cursor = 0
    for i, image in enumerate(images):
        start, stop = image.offset, image.offset + image.tokens
        if stop >= len(prompt_ids) or start < 1:
            raise ValueError(f"images[{i}]: pad run [{start}, {stop}) has no framing around it")
        if any(t != ids.pad for t in prompt_ids[start:stop]):
            raise ValueError(f"images[{i}]: [{start}, {stop}) is not a run of <|media_pad|>")
        if prompt_ids[start - 1] != ids.content or prompt_ids[stop] != ids.end:
            raise ValueError(f"images[{i}]: its pad run is not between <|media_content|> and "
                             "<|media_end|>")
        try:
            begin = max(j for j in range(cursor, start - 1) if prompt_ids[j] == ids.begin)
        except ValueError:
            raise ValueError(f"images[{i}]: no <|media_begin|> before its pad run") from None
        out.extend(prompt_ids[cursor:begin])
        out.append(ids.pad)
        cursor = stop + 1
    out.extend(prompt_ids[cursor:])
    if out.count(ids.pad) != len(images):
        raise ValueError(f"the prompt holds {out.count(ids.pad) - len(images)} <|media_pad|> "
                         "id(s) outside its images' pad runs")
    return out


def image_data(images: Sequence[ImageInput]) -> list[bytes]:
    """SGLang's `image_data`: each image's PNG, whose size must be the W x H its prompt names
    (SGLang writes the framing from the size it loads, kimi_k3.py:116-121)."""
    out = []
    for i, image in enumerate(images):
        size = png_size(image.png)
        if size != (image.width, image.height):
            raise ValueError(f"images[{i}]: its PNG is {size[0]}x{size[1]}, its prompt names "
                             f"{image.width}x{image.height}")
        out.append(bytes(image.png))
    return out
