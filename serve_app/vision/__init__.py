"""Images in requests: from a client's reference (a data URL, or a download the deployment
allows) to a `PreparedImage` that K3's tower takes, preprocessed exactly as K3's own processor
does. Imports only serve_app.protocol.

The names below load their module on first use: the app's config reads `ImagePolicy` and
`MediaConfig` (pydantic only) without importing Pillow, which only the ingress's image work
needs; only `normalise` (the engine's side) imports torch. The function `preprocess` is
imported from its module (`serve_app.vision.preprocess`), whose name it shares."""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "FetchPolicy": "config", "ImagePolicy": "config", "MediaConfig": "config",
    "MediaConfigError": "config", "TransparentBackground": "config",
    "ImageRejected": "errors",
    "PreparedImage": "images", "load_images": "images",
    "prepare_image": "images",
    "Resize": "preprocess", "image_grid": "preprocess", "normalise": "tower_input",
    "resize_for": "preprocess",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
