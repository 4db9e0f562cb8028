"""serve_app/vision preprocesses images exactly as K3's own processor does: the same resize, pads,
grid and token count, and byte-identical patches and normalised pixel values, against a fixture
written by running the checkpoint's processor (tools/make_vision_fixtures.py) on the synthetic
images of tests/vision_images.py. Plus MediaConfig's reading of preprocessor_config.json."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from vision_images import CASES, synthetic_image

from serve_app.protocol.media import ImageInput
from serve_app.vision import (
    ImagePolicy,
    MediaConfig,
    MediaConfigError,
    image_grid,
    normalise,
    prepare_image,
    resize_for,
)
from serve_app.vision.decode import to_rgb_or_rgba
from serve_app.vision.preprocess import preprocess

DATA = Path(__file__).parent / "data" / "vision"
FIXTURE = json.loads((DATA / "k3_processor.json").read_text())
EXPECTED = {case["name"]: case for case in FIXTURE["cases"]}
MEDIA = MediaConfig.from_folder(DATA)


def _sha256(array: np.ndarray | torch.Tensor) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def test_fixture_covers_every_case() -> None:
    assert set(EXPECTED) == {case.name for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_k3_processor(case) -> None:
    want = EXPECTED[case.name]
    image = synthetic_image(case)
    r = resize_for(image.width, image.height, MEDIA)
    assert (r.width, r.height, r.pad_width, r.pad_height) == (
        want["new_width"], want["new_height"], want["pad_width"], want["pad_height"])
    grid, tokens = image_grid(image.width, image.height, MEDIA)
    assert (list(grid), tokens) == (want["grid_thw"], want["num_tokens"])

    grid, tokens, patches = preprocess(to_rgb_or_rgba(image), MEDIA)
    assert (list(grid), tokens) == (want["grid_thw"], want["num_tokens"])
    assert patches.dtype == np.uint8 and list(patches.shape) == want["patches_shape"]
    assert _sha256(patches) == want["patches_sha256"]
    assert _sha256(normalise(patches, MEDIA)) == want["pixel_values_sha256"]


def test_published_limits_in_numbers() -> None:
    # The reference page's worked examples, independent of the fixture.
    assert (resize_for(3600, 3599, MEDIA).width, resize_for(3600, 3599, MEDIA).height) == (
        3585, 3584)
    assert (resize_for(8366, 100, MEDIA).width, resize_for(8366, 100, MEDIA).height) == (7167, 85)
    assert image_grid(1, 1, MEDIA) == ((1, 2, 2), 1)


def test_prepared_image_end_to_end() -> None:
    """Through PNG bytes, decode and preprocess: the fixture's patches, the upload's size, a
    lossless png, and a digest of the pixels (not of the file's bytes)."""
    case = next(c for c in CASES if c.name == "palette_transparent_61x33")
    image = synthetic_image(case)
    encoded = io.BytesIO()
    image.save(encoded, "PNG", transparency=image.info["transparency"])
    prepared = prepare_image(encoded.getvalue(), ImagePolicy(), MEDIA, "p")
    want = EXPECTED[case.name]
    assert (prepared.width, prepared.height) == (61, 33)
    assert list(prepared.grid_thw) == want["grid_thw"] and prepared.tokens == want["num_tokens"]
    assert _sha256(prepared.patches) == want["patches_sha256"]
    reread = Image.open(io.BytesIO(prepared.png))
    assert reread.mode == "RGBA"
    assert np.array_equal(np.asarray(reread), np.asarray(image.convert("RGBA")))
    # The same pixels in another encoding are the same image.
    other = io.BytesIO()
    image.convert("RGBA").save(other, "PNG", compress_level=9)
    assert prepare_image(other.getvalue(), ImagePolicy(), MEDIA, "p").digest == prepared.digest
    placed = prepared.at(17)
    assert isinstance(placed, ImageInput) and placed.offset == 17
    assert (placed.digest, placed.tokens, placed.png) == (prepared.digest, prepared.tokens,
                                                          prepared.png)


def test_normalise_is_the_formula() -> None:
    patches = torch.arange(256, dtype=torch.uint8).repeat(3, 1).reshape(1, 3, 16, 16)
    expected = (patches.double() / 255 - 0.5) / 0.5
    assert normalise(patches, MEDIA).dtype == torch.float32
    assert torch.allclose(normalise(patches, MEDIA).double(), expected, atol=1e-7)


def _config(tmp_path: Path, **changes: object) -> Path:
    raw = json.loads((DATA / "preprocessor_config.json").read_text())
    raw["media_proc_cfg"].update(changes)
    raw["media_proc_cfg"] = {k: v for k, v in raw["media_proc_cfg"].items() if v != "DROP"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    return tmp_path


def test_media_config_reads_the_folder(tmp_path: Path) -> None:
    assert MEDIA is not None and MEDIA.patch_size == 14 and MEDIA.fill_after_resize
    assert MEDIA.background is not None and MEDIA.background.gray_value == 180
    assert MediaConfig.from_folder(tmp_path) is None  # a text-only checkpoint
    other = MediaConfig.from_folder(_config(tmp_path, in_patch_limit=1024,
                                            transparent_bg_config=None))
    assert other.in_patch_limit == 1024 and other.background is None


def test_media_config_names_every_bad_key(tmp_path: Path) -> None:
    folder = _config(tmp_path, patch_size="DROP", merge_kernel_size=0, image_std=[0.5, 0, 0.5],
                     fixed_output_tokens=64, transparent_bg_fill_stage="sometimes",
                     transparent_bg_config={"pattern": "plaid", "chessboard_gray_value": 300})
    with pytest.raises(MediaConfigError) as error:
        MediaConfig.from_folder(folder)
    text = str(error.value)
    for key in ("patch_size: missing", "merge_kernel_size", "image_std", "fixed_output_tokens",
                "transparent_bg_fill_stage", "transparent_bg_config.pattern",
                "transparent_bg_config.chessboard_gray_value"):
        assert key in text, key
    assert len(error.value.problems) == 7
