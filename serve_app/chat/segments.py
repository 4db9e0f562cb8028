"""A rendered prompt as segments: the one place a conversation becomes token ids.

A renderer (the K3 XTML renderer, or a checkpoint's Jinja template) emits segments; each is
encoded on its own and the ids are concatenated. A *control* segment is the renderer's own
text and may hold special tokens (an XTML marker is exactly one control token); a *text*
segment is encoded as plain text, so a client who types `<|open|>` gets those characters,
never the marker. Encoding segments separately also keeps BPE merges from crossing a
boundary, which is how the reference tokenizers encode a chat (never render-then-encode).

An *image* segment stands where a renderer puts an image part. Encoding expands it to K3's
image prompt (SGLang 0.5.23 `srt/multimodal/processors/kimi_k3.py`,
`_expand_k3_image_prompt_token_ids`): `<|media_begin|>image WxH<|media_content|>` (the
upload's own size, as ordinary text between the control tokens), the image's `tokens` x
`<|media_pad|>`, `<|media_end|>`; each image's pad run starts at the offset recorded for it.
The media tokens are the tokenizer's, looked up by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from serve_app.protocol.openai import ImagePart

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = (
    "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END)


@dataclass(frozen=True)
class Segment:
    text: str
    control: bool = False
    image: ImagePart | None = None  # an image segment: the part it renders (text is empty)


class SizedImage(Protocol):
    """What an image prompt needs of its image (vision.PreparedImage has it)."""

    @property
    def width(self) -> int: ...
    @property
    def height(self) -> int: ...
    @property
    def tokens(self) -> int: ...


class SegmentEncoder(Protocol):
    def encode(self, text: str) -> list[int]:
        """Trusted text: special-token strings become their ids."""

    def encode_text(self, text: str) -> list[int]:
        """Client text: special-token strings stay text."""


def control(text: str) -> Segment:
    return Segment(text, control=True)


def text(value: str) -> Segment:
    return Segment(value)


def image(part: ImagePart) -> Segment:
    return Segment("", control=True, image=part)


def image_parts(segments: Iterable[Segment]) -> tuple[ImagePart, ...]:
    """The image parts of a rendered prompt, in prompt order (a renderer may reorder
    messages: K3's tool results follow their calls)."""
    return tuple(s.image for s in segments if s.image is not None)


def encode_prompt(tokenizer: SegmentEncoder, segments: Iterable[Segment],
                  images: Sequence[SizedImage] = ()) -> tuple[list[int], list[int]]:
    """(ids, the offset of each image's pad run): the i-th image segment is `images[i]`."""
    ids: list[int] = []
    offsets: list[int] = []
    for seg in segments:
        if seg.image is not None:
            if len(offsets) == len(images):
                raise ValueError("the prompt has more image segments than images")
            im = images[len(offsets)]
            ids += tokenizer.encode(f"{MEDIA_BEGIN}image {im.width}x{im.height}{MEDIA_CONTENT}")
            offsets.append(len(ids))
            ids += tokenizer.encode(MEDIA_PAD) * im.tokens
            ids += tokenizer.encode(MEDIA_END)
        elif seg.text:
            ids += tokenizer.encode(seg.text) if seg.control else tokenizer.encode_text(seg.text)
    if len(offsets) != len(images):
        raise ValueError(f"{len(images)} images for {len(offsets)} image segments")
    return ids, offsets


def encode_segments(tokenizer: SegmentEncoder, segments: Iterable[Segment]) -> list[int]:
    """A prompt without images."""
    return encode_prompt(tokenizer, segments)[0]


def has_media_tokens(special_ids: dict[str, int]) -> bool:
    """The tokenizer can write an image prompt (K3's four media tokens are its own)."""
    return all(name in special_ids for name in MEDIA_TOKENS)


def text_bytes(segments: Sequence[Segment]) -> int:
    """UTF-8 size of the client text: what bounds the token count before tokenizing."""
    return sum(len(s.text.encode("utf-8")) for s in segments if not s.control)
