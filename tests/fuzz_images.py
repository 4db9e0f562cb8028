"""Hostile images, built byte by byte (no files): what tests/test_fuzz_images.py sends to a
served K3 and what tests/test_vision_decode.py hands to the decoder.

Each case is (name, data URL or bytes, what the server must answer): `None` = served (a valid
image in an unusual mode, which must decode, not fail), else the status (400, or 413 for an
image over the byte limit)."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from dataclasses import dataclass

from PIL import Image


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def png_header_only(width: int, height: int, bit_depth: int = 8, color_type: int = 2) -> bytes:
    """A PNG whose header claims width x height, with one tiny IDAT: a decompression bomb's
    shape (the decoder must refuse it from the header) or a 0-pixel image."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr)
            + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + png_chunk(b"IEND", b""))


def encoded(image: Image.Image, fmt: str, **save: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def gradient(size: tuple[int, int] = (40, 30), mode: str = "RGB") -> Image.Image:
    w, h = size
    image = Image.new("RGB", size)
    image.putdata([(x * 255 // max(1, w - 1), y * 255 // max(1, h - 1), 128)
                   for y in range(h) for x in range(w)])
    return image.convert(mode) if mode != "RGB" else image


def animated_gif() -> bytes:
    frames = [Image.new("P", (20, 20), i) for i in (1, 2, 3)]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50,
                   loop=0)


def sixteen_bit_png() -> bytes:
    image = Image.new("I;16", (24, 24))
    image.putdata([i * 113 for i in range(24 * 24)])
    return encoded(image, "PNG")


def palette_with_transparency() -> bytes:
    image = Image.new("P", (24, 24), 0)
    image.putpalette([255, 0, 0, 0, 255, 0] + [0] * (256 * 3 - 6))
    image.paste(1, (0, 0, 12, 24))
    return encoded(image, "PNG", transparency=0)


SVG = (b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10">'
       b'<rect width="10" height="10" fill="red"/></svg>')


@dataclass(frozen=True)
class HostileImage:
    name: str
    url: str
    status: int | None  # None: a valid image that must be served


def hostile_images() -> list[HostileImage]:
    png = encoded(gradient(), "PNG")
    jpeg = encoded(gradient(), "JPEG", quality=90)
    return [
        HostileImage("truncated PNG", data_url(png[: len(png) // 2]), 400),
        HostileImage("truncated JPEG", data_url(jpeg[: len(jpeg) // 2], "image/jpeg"), 400),
        HostileImage("100k x 100k PNG bomb", data_url(png_header_only(100_000, 100_000)), 400),
        HostileImage("0-pixel PNG", data_url(png_header_only(0, 10)), 400),
        HostileImage("SVG", data_url(SVG, "image/svg+xml"), 400),
        HostileImage("text as an image", data_url(b"hello, world", "image/png"), 400),
        HostileImage("a non-image MIME type", data_url(png, "text/html"), 400),
        HostileImage("bad base64", "data:image/png;base64,@@@@not base64@@@@", 400),
        HostileImage("not a data URL", "file:///etc/passwd", 400),
        HostileImage("PNG labelled JPEG", data_url(png, "image/jpeg"), None),
        HostileImage("CMYK JPEG", data_url(encoded(gradient(mode="CMYK"), "JPEG"),
                                           "image/jpeg"), None),
        HostileImage("16-bit PNG", data_url(sixteen_bit_png()), None),
        HostileImage("palette PNG with transparency", data_url(palette_with_transparency()),
                     None),
        HostileImage("1-bit PNG", data_url(encoded(gradient(mode="1"), "PNG")), None),
        HostileImage("animated GIF", data_url(animated_gif(), "image/gif"), None),
    ]
