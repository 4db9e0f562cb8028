"""Deterministic synthetic images for the vision tests and tools/make_vision_fixtures.py: the
fixture records what K3's processor makes of each case, the tests rebuild the same image from
its case and compare. PCG64 (numpy's default_rng) streams are stable across numpy versions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class Case:
    name: str
    mode: str  # the synthetic image's own mode: RGB, RGBA, L, LA, P, P+t (palette, transparent)
    width: int
    height: int
    seed: int


# Sizes: tiny, unpadded, at and around the patch limits (in_patch_limit 65536 = 256 x 256
# patches, 512 patches on a side), extreme aspect ratios, and each transparency kind.
CASES: tuple[Case, ...] = (
    Case("rgb_1x1", "RGB", 1, 1, 1),
    Case("rgb_27x29", "RGB", 27, 29, 2),
    Case("rgb_28x28", "RGB", 28, 28, 3),
    Case("rgb_640x480", "RGB", 640, 480, 4),
    Case("rgb_3584_square_at_limit", "RGB", 3584, 3584, 5),
    Case("rgb_3597_square_pads_past_limit", "RGB", 3597, 3597, 6),
    Case("rgb_3598_square_over_limit", "RGB", 3598, 3598, 18),
    Case("rgb_3600x3599", "RGB", 3600, 3599, 7),
    Case("rgb_8366x100", "RGB", 8366, 100, 8),
    Case("rgb_100x8366", "RGB", 100, 8366, 9),
    Case("rgb_7168x14_one_side_at_limit", "RGB", 7168, 14, 10),
    Case("rgb_15x4000", "RGB", 15, 4000, 11),
    Case("rgba_300x200", "RGBA", 300, 200, 12),
    Case("rgba_4600x3100_resized", "RGBA", 4600, 3100, 13),
    Case("la_9000x200_resized", "LA", 9000, 200, 14),
    Case("l_8000x600_resized", "L", 8000, 600, 15),
    Case("palette_50x40", "P", 50, 40, 16),
    Case("palette_transparent_61x33", "P+t", 61, 33, 17),
)


def synthetic_image(case: Case) -> Image.Image:
    """Noise over gradients (so a resize has edges and smooth parts to get right); alpha that
    runs from transparent to opaque with noise; palettes of 16 colours."""
    rng = np.random.default_rng(case.seed)
    h, w = case.height, case.width
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :]
    noise = rng.integers(0, 64, size=(h, w, 3), dtype=np.int64).astype(np.float32)
    rgb = np.stack([0.75 * x + 0 * y, 0.75 * y + 0 * x, 0.4 * (x + y) / 2 + 0 * x],
                   axis=2) + noise
    rgb = rgb.clip(0, 255).astype(np.uint8)
    alpha = ((x + y) / 2 + rng.integers(-40, 40, size=(h, w))).clip(0, 255).astype(np.uint8)
    if case.mode == "RGB":
        return Image.fromarray(rgb, "RGB")
    if case.mode == "RGBA":
        return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    if case.mode == "L":
        return Image.fromarray(rgb[:, :, 0], "L")
    if case.mode == "LA":
        return Image.fromarray(np.dstack([rgb[:, :, 1], alpha]), "LA")
    if case.mode in ("P", "P+t"):
        index = rng.integers(0, 16, size=(h, w), dtype=np.int64).astype(np.uint8)
        image = Image.fromarray(index, "P")
        image.putpalette(rng.integers(0, 256, size=16 * 3, dtype=np.int64).astype(np.uint8)
                         .tobytes())
        if case.mode == "P+t":
            image.info["transparency"] = bytes([0, 128, 255] + [255] * 13)
        return image
    raise ValueError(case.mode)
