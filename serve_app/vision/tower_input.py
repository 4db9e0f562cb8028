"""The tower's input from `preprocess`'s uint8 patches, normalised exactly as K3's processor
does it; the engine's side of preprocessing (the only part of serve_app/vision that needs
torch)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from .config import MediaConfig


def normalise(patches: np.ndarray | torch.Tensor, media: MediaConfig) -> torch.Tensor:
    """uint8 patches [P, 3, p, p] (as `preprocess` gives them) -> float32 `(x / 255 - mean) / std`, rounded as K3's processor
    rounds it (x / 255 in float64 to float32, then each step in float64 back to float32)."""
    table = _normalise_table(media.image_mean, media.image_std)
    index = torch.as_tensor(patches).long() + torch.arange(3).view(1, 3, 1, 1) * 256
    return table.flatten()[index]


@functools.lru_cache(maxsize=4)
def _normalise_table(mean: tuple[float, float, float], std: tuple[float, float, float]
                     ) -> torch.Tensor:
    """[3, 256]: every uint8 value's normalised float32, per channel."""
    x = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)
    rows = []
    for m, s in zip(mean, std, strict=True):
        y = (x.astype(np.float64) - m).astype(np.float32)
        rows.append((y.astype(np.float64) * (1.0 / s)).astype(np.float32))
    return torch.from_numpy(np.stack(rows))
