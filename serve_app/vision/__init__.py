"""Images in requests: from a client's reference (a data URL, or a download the deployment
allows) to a `PreparedImage` that K3's tower takes, preprocessed exactly as K3's own processor
does. Imports only serve_app.protocol."""

from .config import FetchPolicy, ImagePolicy, MediaConfig, MediaConfigError, TransparentBackground
from .errors import ImageRejected
from .images import ImageRef, PreparedImage, load_images, prepare_image
from .preprocess import Resize, image_grid, normalise, preprocess, resize_for

__all__ = [
    "FetchPolicy",
    "ImagePolicy",
    "ImageRef",
    "ImageRejected",
    "MediaConfig",
    "MediaConfigError",
    "PreparedImage",
    "Resize",
    "TransparentBackground",
    "image_grid",
    "load_images",
    "normalise",
    "prepare_image",
    "preprocess",
    "resize_for",
]
