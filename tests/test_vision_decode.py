"""Hostile and unusual images from clients: each is refused with an ImageRejected that names
the field (400, or 413 for too many bytes), or decoded to the RGB/RGBA picture a viewer shows."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from fuzz_images import data_url, encoded, png_header_only
from PIL import Image

from serve_app.protocol.openai import ImagePart
from serve_app.vision import ImagePolicy, ImageRejected, MediaConfig, load_images
from serve_app.vision.decode import decode_image

MEDIA = MediaConfig.from_folder(Path(__file__).parent / "data" / "vision")
POLICY = ImagePolicy()
WHERE = "messages[0].content[1]"
PARAM = f"{WHERE}.image_url"


async def _rejected(url: str, policy: ImagePolicy = POLICY) -> ImageRejected:
    with pytest.raises(ImageRejected) as error:
        await load_images([ImagePart(WHERE, url)], policy, MEDIA)
    rejected = error.value
    assert rejected.param == PARAM and rejected.status in (400, 413)
    # Safe for a client: no reprs of bytes or objects, no paths.
    assert not any(s in rejected.message for s in ("b'", "\\x", "<PIL", "/tmp", "object at"))
    return rejected


async def _decoded(url: str, policy: ImagePolicy = POLICY):
    [prepared] = await load_images([ImagePart(WHERE, url)], policy, MEDIA)
    return prepared, Image.open(io.BytesIO(prepared.png))


PHOTO = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8))


async def test_png_and_jpeg_decode() -> None:
    prepared, image = await _decoded(data_url(encoded(PHOTO, "PNG")))
    assert (prepared.width, prepared.height, image.mode) == (64, 48, "RGB")
    assert np.array_equal(np.asarray(image), np.asarray(PHOTO))
    prepared, image = await _decoded(data_url(encoded(PHOTO, "JPEG"), "image/jpeg"))
    assert (prepared.width, prepared.height, image.mode) == (64, 48, "RGB")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
async def test_truncated_files_are_refused(fmt: str) -> None:
    data = encoded(PHOTO, fmt)
    rejected = await _rejected(data_url(data[:len(data) * 2 // 3]))
    assert rejected.status == 400 and "truncated" in rejected.message


async def test_header_bomb_is_refused_from_its_header() -> None:
    # 10^10 pixels declared in 100 bytes: Pillow's own guard and ours both see it at open.
    rejected = await _rejected(data_url(png_header_only(100_000, 100_000)))
    assert rejected.status == 400 and "more pixels" in rejected.message
    # Under Pillow's guard, over the policy's: refused by the policy before any pixel decodes
    # (decoding would fail on the missing data with another message).
    rejected = await _rejected(data_url(png_header_only(8000, 8000)))
    assert "(8000x8000)" in rejected.message and "50000000" in rejected.message
    small = ImagePolicy(max_pixels=1000)
    assert "(64x48)" in (await _rejected(data_url(encoded(PHOTO, "PNG")), small)).message


async def test_declared_type_is_not_trusted_the_bytes_are() -> None:
    _, image = await _decoded(data_url(encoded(PHOTO, "PNG"), "image/jpeg"))
    assert np.array_equal(np.asarray(image), np.asarray(PHOTO))
    # A format the policy does not take is refused whatever the URL declares.
    rejected = await _rejected(data_url(encoded(PHOTO, "JPEG"), "image/png"),
                               ImagePolicy(formats=("PNG",)))
    assert rejected.status == 400 and "(PNG)" in rejected.message
    rejected = await _rejected(data_url(encoded(PHOTO, "TIFF"), "image/png"))
    assert "format" in rejected.message


async def test_svg_and_non_images_are_refused() -> None:
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>'
    assert "format" in (await _rejected(data_url(svg, "image/svg+xml"))).message
    assert "format" in (await _rejected(data_url(b"just some text" * 10))).message
    rejected = await _rejected(data_url(encoded(PHOTO, "PNG"), "text/plain"))
    assert "must hold an image" in rejected.message
    rejected = await _rejected("data:image/png," + "A" * 40)
    assert "base64" in rejected.message
    assert "base64" in (await _rejected("data:image/png;base64,%%%not-base64%%%")).message
    assert "','" in (await _rejected("data:image/png;base64")).message
    assert "data URL" in (await _rejected("file:///etc/passwd")).message


async def test_base64_with_line_breaks_is_taken() -> None:
    wrapped = base64.encodebytes(encoded(PHOTO, "PNG")).decode()  # 76-character lines
    prepared, _ = await _decoded("data:image/png;base64," + wrapped)
    assert prepared.width == 64


async def test_cmyk_jpeg_becomes_rgb() -> None:
    cmyk = Image.new("CMYK", (32, 16), (0, 255, 255, 0))  # red in ink
    _, image = await _decoded(data_url(encoded(cmyk, "JPEG", quality=95), "image/jpeg"))
    assert image.mode == "RGB"
    r, g, b = np.asarray(image).reshape(-1, 3).mean(axis=0)
    assert r > 240 and g < 15 and b < 15


async def test_16_bit_grey_png_is_scaled_not_clipped() -> None:
    levels = np.array([[0, 257 * 64, 32896, 65535]], dtype=np.uint16).repeat(4, axis=0)
    image16 = Image.fromarray(levels)
    assert image16.mode == "I;16"
    _, image = await _decoded(data_url(encoded(image16, "PNG")))
    assert image.mode == "RGB"
    assert np.asarray(image)[0, :, 0].tolist() == [0, 64, 128, 255]


async def test_one_bit_image() -> None:
    bits = Image.fromarray(np.array([[0, 255] * 8] * 4, dtype=np.uint8)).convert("1")
    _, image = await _decoded(data_url(encoded(bits, "PNG")))
    assert image.mode == "RGB" and np.asarray(image)[0, :2, 0].tolist() == [0, 255]


async def test_palette_with_transparency_keeps_alpha() -> None:
    palette = Image.fromarray(np.array([[0, 1, 2, 1]] * 3, dtype=np.uint8), "P")
    palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    _, image = await _decoded(data_url(encoded(palette, "PNG", transparency=1)))
    assert image.mode == "RGBA"
    pixels = np.asarray(image)
    assert pixels[0, 0].tolist() == [255, 0, 0, 255] and pixels[0, 1, 3] == 0
    _, opaque = await _decoded(data_url(encoded(palette, "PNG")))
    assert opaque.mode == "RGB"


async def test_grey_alpha_keeps_alpha() -> None:
    la = Image.fromarray(np.dstack([np.full((4, 4), 200, np.uint8),
                                    np.full((4, 4), 100, np.uint8)]), "LA")
    _, image = await _decoded(data_url(encoded(la, "PNG")))
    assert image.mode == "RGBA" and np.asarray(image)[0, 0].tolist() == [200, 200, 200, 100]


async def test_empty_image_is_refused() -> None:
    rejected = await _rejected(data_url(png_header_only(0, 10)))
    assert rejected.status == 400


async def test_animated_gif_is_frame_zero() -> None:
    frames = [Image.new("RGB", (20, 10), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100,
                  loop=0)
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    _, image = await _decoded(data_url(gif, "image/gif"))
    assert image.size == (20, 10)
    assert np.asarray(image.convert("RGB"))[5, 5].tolist() == [255, 0, 0]


async def test_exif_orientation_is_applied() -> None:
    # Stored 40 wide x 20 high, red left half, blue right; orientation 6: shown rotated 90
    # degrees clockwise, 20 wide x 40 high, red on top.
    stored = np.zeros((20, 40, 3), np.uint8)
    stored[:, :20] = (255, 0, 0)
    stored[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = encoded(Image.fromarray(stored), "JPEG", quality=95, exif=exif.tobytes())
    prepared, image = await _decoded(data_url(jpeg, "image/jpeg"))
    assert (prepared.width, prepared.height) == (20, 40) and image.size == (20, 40)
    pixels = np.asarray(image).astype(int)
    assert pixels[5, 10, 0] > 200 and pixels[5, 10, 2] < 60  # top: red
    assert pixels[35, 10, 2] > 200 and pixels[35, 10, 0] < 60  # bottom: blue


async def test_too_many_images() -> None:
    url = data_url(encoded(PHOTO, "PNG"))
    policy = ImagePolicy(max_images_per_request=2)
    refs = [ImagePart(f"messages[0].content[{i}]", url) for i in range(3)]
    with pytest.raises(ImageRejected) as error:
        await load_images(refs, policy, MEDIA)
    assert error.value.status == 400 and error.value.param == "messages[0].content[2].image_url"
    assert len(await load_images(refs[:2], policy, MEDIA)) == 2


async def test_too_many_bytes_is_413() -> None:
    data = encoded(PHOTO, "PNG")
    tight = ImagePolicy(max_image_bytes=len(data) - 1)
    rejected = await _rejected(data_url(data), tight)
    assert rejected.status == 413 and str(len(data) - 1) in rejected.message
    assert (await _decoded(data_url(data), ImagePolicy(max_image_bytes=len(data))))[0].width == 64
    with pytest.raises(ImageRejected) as error:
        decode_image(data, tight, PARAM)
    assert error.value.status == 413


async def test_images_come_back_in_order_and_the_first_bad_one_is_named() -> None:
    small = Image.new("RGB", (30, 20), (1, 2, 3))
    refs = [ImagePart("a", data_url(encoded(PHOTO, "PNG"))), ImagePart("b", data_url(encoded(small, "PNG")))]
    prepared = await load_images(refs, POLICY, MEDIA)
    assert [(p.width, p.height) for p in prepared] == [(64, 48), (30, 20)]
    bad = [refs[0], ImagePart("b", "data:image/png;base64,AAAA"), ImagePart("c", "ftp://x")]
    with pytest.raises(ImageRejected) as error:
        await load_images(bad, POLICY, MEDIA)
    assert error.value.param == "b.image_url"
