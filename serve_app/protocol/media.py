"""An image in a prompt, as it crosses from the ingress to an engine.

The ingress decodes and preprocesses each image (serve_app/vision/) and renders its prompt
(`<|media_begin|>image WxH<|media_content|>` + `tokens` x `<|media_pad|>` + `<|media_end|>`);
the image's pad run starts at `offset` in the prompt ids. The reference engine runs its tower
on `patches` and splices the features over that run; SGLang re-reads `png` with its own K3
processor. Every cache and index that keys on prompt tokens keys on `cache_keys` instead, so
the pad run of an image is keyed on its pixels: the same text with another image shares
nothing past the image, and the same image resent shares it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Image keys are negative, so no key is ever a real token id (those are >= 0).
_KEY_SPAN = 1 << 62


@dataclass(frozen=True)
class ImageInput:
    digest: str  # sha256 hex of the decoded image (mode, size and pixels): the cache key
    width: int  # the upload's size, as the prompt names it ("image WxH")
    height: int
    grid_thw: tuple[int, int, int]  # patches (t, h, w) after K3's resize and pad
    offset: int  # where its pad run starts in the prompt ids
    tokens: int  # the pad run's length: (h / 2) * (w / 2)
    patches: Any  # numpy uint8 [h * w, 3, 14, 14], row-major grid order, not normalised
    png: bytes  # the decoded image (orientation applied, frame 0) re-encoded losslessly

    @property
    def key(self) -> int:
        return -1 - int(self.digest[:16], 16) % _KEY_SPAN


def cache_keys(prompt_ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
    """`prompt_ids` with every image's pad run replaced by that image's key."""
    keys = list(prompt_ids)
    for image in images:
        keys[image.offset:image.offset + image.tokens] = [image.key] * image.tokens
    return keys


def check_images(prompt_len: int, images: Sequence[ImageInput]) -> None:
    """Pad runs lie inside the prompt, in order, and do not overlap (ValueError if not)."""
    end = 0
    for i, image in enumerate(images):
        if image.tokens <= 0 or image.offset < end or image.offset + image.tokens > prompt_len:
            raise ValueError(f"images[{i}]: its pad run [{image.offset}, "
                             f"{image.offset + image.tokens}) is not inside the prompt after "
                             "the previous image's")
        end = image.offset + image.tokens
