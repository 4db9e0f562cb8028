"""The image features of the requests in prefill, on one rank.

A request's images reach every rank with its `add` (model_runner.py broadcasts them: the tower
is replicated, so every rank runs it on the same pixels and holds the same features, and no
feature tensor crosses ranks). At the request's first prefill chunk, every image whose pad run
is not already covered by its prefix-cache hit goes through the tower in one packed call; each
prefill chunk then splices the rows of its positions that fall in an image's pad run
[offset, offset + tokens) into the embeddings (a chunk may cut an image, a prefix-cache hit may
cover the start of one). Once the prefill has passed the last pad run the features are dropped:
decode, verify and a hand-over never need them (what follows attends to the caches).

The features live here, beside the caches of the same rank, rather than on the request's
Sequence: rank 0 alone has Sequences, and the followers splice the same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from serve_app.models.moonvit import ROPE_MAX_SIDE
from serve_app.protocol.media import ImageInput

# uint8 patches [P, 3, 14, 14] -> the tower's normalised float input (K3's media_proc_cfg).
Normalise = Callable[[np.ndarray], torch.Tensor]


class VisionEncoder(Protocol):
    """The target's vision tower and projector (models/moonvit.py's K3Vision)."""

    def __call__(self, pixel_values: torch.Tensor,
                 grid_thws: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """Normalised patches [P, 3, 14, 14] of images packed in order -> their features
        [sum of t*h*w/4, text hidden size], in the same order."""


@dataclass
class _Pending:
    images: tuple[ImageInput, ...]
    features: list[torch.Tensor | None] | None = None  # per image; None: covered by the cache

    @property
    def end(self) -> int:
        """The position after the last pad run."""
        return max(i.offset + i.tokens for i in self.images)


class PromptImages:
    """Requests with images still to prefill -> their images and, once computed, features."""

    def __init__(self, tower: VisionEncoder, normalise: Normalise, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.tower, self.normalise, self.device, self.dtype = tower, normalise, device, dtype
        self._pending: dict[Hashable, _Pending] = {}
        self.tower_calls = 0  # packed tower calls made (a test checks: one per request)

    def add(self, rid: Hashable, images: Sequence[ImageInput]) -> None:
        if images:
            self._pending[rid] = _Pending(tuple(images))

    def free(self, rid: Hashable) -> None:
        self._pending.pop(rid, None)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._pending

    def any(self, rids: Sequence[Hashable]) -> bool:
        return any(r in self._pending for r in rids)

    def splice(self, embeds: torch.Tensor, rids: Sequence[Hashable], starts: Sequence[int],
               counts: Sequence[int]) -> None:
        """Write into `embeds` [B, T, H] (row b holds positions starts[b] .. + counts[b] of
        rids[b]) the features of every image position it covers; then drop the features of
        requests whose prefill has passed their last image."""
        for b, rid in enumerate(rids):
            pending = self._pending.get(rid)
            if pending is None:
                continue
            start, end = starts[b], starts[b] + counts[b]
            if pending.features is None:
                pending.features = self._encode(pending.images, start)
            for image, feats in zip(pending.images, pending.features, strict=True):
                lo, hi = max(start, image.offset), min(end, image.offset + image.tokens)
                if lo >= hi:
                    continue
                assert feats is not None, "an image covered by the prefix cache was needed"
                embeds[b, lo - start:hi - start] = feats[lo - image.offset:hi - image.offset]
            if end >= pending.end:
                del self._pending[rid]

    @torch.no_grad()
    def _encode(self, images: Sequence[ImageInput], start: int) -> list[torch.Tensor | None]:
        """Features of the images whose pad run reaches past `start` (the first position this
        request computes), all in one packed tower call."""
        needed = [i for i, image in enumerate(images) if image.offset + image.tokens > start]
        out: list[torch.Tensor | None] = [None] * len(images)
        if not needed:
            return out
        pixels = torch.cat([self.normalise(images[i].patches) for i in needed])
        grids = [tuple(images[i].grid_thw) for i in needed]
        feats = self.tower(pixels.to(self.device, self.dtype), grids).to(self.dtype)  # type: ignore[arg-type]
        self.tower_calls += 1
        sizes = [images[i].tokens for i in needed]
        if feats.shape[0] != sum(sizes):
            raise ValueError(f"the vision tower gave {feats.shape[0]} feature rows for images "
                             f"of {sum(sizes)} pad tokens")
        for i, part in zip(needed, feats.split(sizes), strict=True):
            out[i] = part
        return out


def check_image_shapes(images: Sequence[ImageInput]) -> None:
    """Each image is one the tower takes (a still image within its grid bound) and its
    patches agree with its grid and its pad run (K3's 2x2 merge: a pad token per 4 patches);
    ValueError naming the image otherwise: checked at admission, so that a bad image is
    refused rather than failing the batch's forward."""
    for i, image in enumerate(images):
        t, h, w = image.grid_thw
        if t != 1 or not 0 < h <= ROPE_MAX_SIDE or not 0 < w <= ROPE_MAX_SIDE:
            raise ValueError(f"images[{i}]: grid {image.grid_thw} is not a still image of at "
                             f"most {ROPE_MAX_SIDE} patches a side (the tower's bound)")
        patches = image.patches
        if not isinstance(patches, np.ndarray) or patches.dtype != np.uint8 or \
                tuple(patches.shape) != (t * h * w, 3, 14, 14):
            shape = tuple(patches.shape) if isinstance(patches, np.ndarray) else type(patches)
            raise ValueError(f"images[{i}]: patches {shape} are not uint8 "
                             f"[{t * h * w}, 3, 14, 14] for grid {image.grid_thw}")
        if h % 2 or w % 2 or image.tokens * 4 != t * h * w:
            raise ValueError(f"images[{i}]: {image.tokens} pad tokens do not match grid "
                             f"{image.grid_thw} (a token per 2x2 patches)")
