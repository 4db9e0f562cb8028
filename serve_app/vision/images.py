"""From the image references in a request to `PreparedImage`s: bytes (a data URL, or a download
when the policy allows), decoded (decode.py), preprocessed as K3's processor does
(preprocess.py), digested and re-encoded for the engines."""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from ..protocol.media import ImageInput
from ..protocol.openai import ImagePart
from .config import ImagePolicy, MediaConfig
from .decode import data_url_bytes, decode_image
from .errors import ImageRejected
from .fetch import fetch_image
from .preprocess import preprocess


@dataclass(frozen=True)
class PreparedImage:
    """An image ready for a prompt: an `ImageInput` without its place in the prompt."""

    digest: str  # sha256 hex of (mode, size, pixels) of the decoded image
    width: int  # the decoded (upright) image's size: the prompt's "image WxH"
    height: int
    grid_thw: tuple[int, int, int]
    tokens: int
    patches: Any  # numpy uint8 [h * w, 3, p, p]
    png: bytes  # the decoded image, lossless

    def at(self, offset: int) -> ImageInput:
        return ImageInput(self.digest, self.width, self.height, self.grid_thw, offset,
                          self.tokens, self.patches, self.png)


def digest_of(image: Image.Image) -> str:
    h = hashlib.sha256(f"{image.mode} {image.width}x{image.height}\n".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def prepare_image(data: bytes, policy: ImagePolicy, media: MediaConfig,
                  param: str) -> PreparedImage:
    """Decode and preprocess one image's bytes (CPU-bound: run it off the event loop)."""
    image = decode_image(data, policy, param)
    grid_thw, tokens, patches = preprocess(image, media)
    png = io.BytesIO()
    # Level 1: a few times faster than the default on photos; lossless either way.
    image.save(png, format="PNG", compress_level=1)
    return PreparedImage(digest_of(image), image.width, image.height, grid_thw, tokens, patches,
                         png.getvalue())


async def load_images(refs: Sequence[ImagePart], policy: ImagePolicy,
                      media: MediaConfig) -> list[PreparedImage]:
    """The request's images, in order. Raises `ImageRejected` naming the first bad ref's field
    (by position, whichever finished first)."""
    if len(refs) > policy.max_images_per_request:
        raise ImageRejected(400, refs[policy.max_images_per_request].param,
                            f"a request may carry at most {policy.max_images_per_request} "
                            f"images; this one has {len(refs)}")
    results = await asyncio.gather(*(_load(ref, policy, media) for ref in refs),
                                   return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)  # type: ignore[arg-type]


async def _load(ref: ImagePart, policy: ImagePolicy, media: MediaConfig) -> PreparedImage:
    scheme = ref.url[:8].lower()
    if scheme.startswith("data:"):
        data = data_url_bytes(ref.url, policy, ref.param)
    elif scheme.startswith(("http://", "https://")):
        data = await fetch_image(ref.url, policy, ref.param)
    else:
        raise ImageRejected(400, ref.param, "an image URL must be a data URL "
                                            "(data:image/<format>;base64,<data>) or http(s)")
    return await asyncio.to_thread(prepare_image, data, policy, media, ref.param)
