"""A rendered prompt as segments: the one place a conversation becomes token ids.

A renderer (the K3 XTML renderer, or a checkpoint's Jinja template) emits segments; each is
encoded on its own and the ids are concatenated. A *control* segment is the renderer's own
text and may hold special tokens (an XTML marker is exactly one control token); a *text*
segment is encoded as plain text, so a client who types `<|open|>` gets those characters,
never the marker. Encoding segments separately also keeps BPE merges from crossing a
boundary, which is how the reference tokenizers encode a chat (never render-then-encode).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Segment:
    text: str
    control: bool = False


class SegmentEncoder(Protocol):
    def encode(self, text: str) -> list[int]:
        """Trusted text: special-token strings become their ids."""

    def encode_text(self, text: str) -> list[int]:
        """Client text: special-token strings stay text."""


def control(text: str) -> Segment:
    return Segment(text, control=True)


def text(value: str) -> Segment:
    return Segment(value)


def encode_segments(tokenizer: SegmentEncoder, segments: Iterable[Segment]) -> list[int]:
    ids: list[int] = []
    for seg in segments:
        if seg.text:
            ids += tokenizer.encode(seg.text) if seg.control else tokenizer.encode_text(seg.text)
    return ids


def text_bytes(segments: Sequence[Segment]) -> int:
    """UTF-8 size of the client text: what bounds the token count before tokenizing."""
    return sum(len(s.text.encode("utf-8")) for s in segments if not s.control)
