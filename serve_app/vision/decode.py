"""A client's image bytes -> a Pillow image in RGB or RGBA, or `ImageRejected`.

- Only the formats the policy allows are even parsed (`Image.open(formats=...)`): the bytes
  decide the format, not a declared MIME type, and anything else (SVG, HTML, a PDF) is refused.
- The pixel count is checked from the header before any pixel is decoded, so a small file
  declaring a 100k x 100k canvas costs a header parse.
- Truncated files are refused (Pillow's `LOAD_TRUNCATED_IMAGES` stays False).
- Frame 0 of an animation.
- EXIF orientation is applied. K3's own processor applies none, but a phone photo is stored
  sideways with an orientation tag that every viewer (and the client's user) honours: the model
  should see the picture the user sees, and the prompt's "image WxH" names that picture's size.
  SGLang's image loader makes the same choice (`exif_transpose`).
- Alpha is kept (RGBA, LA, palette or grey/RGB with a transparency key become RGBA), so that
  K3's background rule blends it after the resize; everything else becomes RGB. 16-bit grey is
  scaled to 8 bits (Pillow's own conversion clips it, turning most such images white), CMYK is
  converted by Pillow (which undoes Adobe's inverted CMYK).
- Palette and 1-bit images are converted here, before any resize, so they are resized BICUBIC
  like every other image. K3's processor resizes them in their own mode, where Pillow forces
  NEAREST: the same pixels whenever the image needs no resize (the usual case for such images),
  a smoother image when it does. Keeping the quirk would mean passing palette images on, which
  the `png` contract (RGB or RGBA) does not.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from .config import ImagePolicy
from .errors import ImageRejected

# EXIF orientation tag -> the transpose that shows the picture upright.
_ORIENTATION = 0x0112
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SIXTEEN_BIT_GREY = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def data_url_bytes(url: str, policy: ImagePolicy, param: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageRejected(400, param, "the data URL has no ',' before its data")
    parts = [p.strip().lower() for p in header[len("data:"):].split(";")]
    if not parts[0].startswith("image/"):
        raise ImageRejected(400, param, "a data URL must hold an image: "
                                        "data:image/<format>;base64,<data>")
    if "base64" not in parts[1:]:
        raise ImageRejected(400, param, "an image data URL must be base64-encoded: "
                                        "data:image/<format>;base64,<data>")
    payload = "".join(payload.split())  # line breaks some encoders insert
    if len(payload) // 4 * 3 > policy.max_image_bytes + 2:
        raise _too_many_bytes(param, policy)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRejected(400, param, "the data URL's data is not valid base64") from None
    if len(data) > policy.max_image_bytes:
        raise _too_many_bytes(param, policy)
    return data


def _too_many_bytes(param: str, policy: ImagePolicy) -> ImageRejected:
    return ImageRejected(413, param, f"the image is larger than this server's limit of "
                                     f"{policy.max_image_bytes} bytes")


def decode_image(data: bytes, policy: ImagePolicy, param: str) -> Image.Image:
    """Decode an image's bytes to RGB or RGBA (frame 0, upright)."""
    if len(data) > policy.max_image_bytes:
        raise _too_many_bytes(param, policy)
    allowed = ", ".join(policy.formats)
    try:
        image = Image.open(io.BytesIO(data), formats=list(policy.formats))
    except UnidentifiedImageError:
        raise ImageRejected(400, param, f"the data is not an image in a format this server "
                                        f"takes ({allowed})") from None
    except Image.DecompressionBombError:
        raise _too_many_pixels(param, policy) from None
    except Exception:  # a malformed header: each plugin raises its own kind
        raise ImageRejected(400, param, "the image could not be decoded") from None
    with image:
        width, height = image.size
        if width <= 0 or height <= 0:
            raise ImageRejected(400, param, f"the image is empty ({width}x{height} pixels)")
        if width * height > policy.max_pixels:
            raise _too_many_pixels(param, policy, width, height)
        try:
            image.load()  # frame 0; raises on truncated data
            orientation = _orientation(image)
            pixels = to_rgb_or_rgba(image)
        except Exception:
            raise ImageRejected(400, param, "the image could not be decoded (truncated or "
                                            "corrupt data)") from None
    if orientation in _UPRIGHT:
        pixels = pixels.transpose(_UPRIGHT[orientation])
    return pixels


def _too_many_pixels(param: str, policy: ImagePolicy, width: int = 0, height: int = 0
                     ) -> ImageRejected:
    size = f" ({width}x{height})" if width else ""
    return ImageRejected(400, param, f"the image has more pixels{size} than this server's limit "
                                     f"of {policy.max_pixels}")


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(_ORIENTATION, 1))
    except Exception:  # unreadable EXIF is metadata we can do without, not a bad image
        return 1


def to_rgb_or_rgba(image: Image.Image) -> Image.Image:
    """RGB, or RGBA where the image has transparency (K3's processor's own test: an alpha band,
    or a transparency key in the image's info)."""
    if image.mode in _SIXTEEN_BIT_GREY:
        wide = np.asarray(image).astype(np.int64).clip(0, 65535)
        grey = Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), "L")
        return grey.convert("RGB")
    has_alpha = "A" in image.getbands() or "transparency" in image.info
    if has_alpha:
        return image.copy() if image.mode == "RGBA" else image.convert("RGBA")
    return image.copy() if image.mode == "RGB" else image.convert("RGB")
