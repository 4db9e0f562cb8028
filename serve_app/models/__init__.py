"""Plain-PyTorch models and their checkpoint I/O (the bottom layer of the Serve app)."""

from serve_app.models.checkpoint import CheckpointError
from serve_app.models.dspark import DraftOutput, DSparkDraft, load_dspark, save_dspark
from serve_app.models.dspark_config import DSparkConfig, DSparkConfigError
from serve_app.models.kv_cache import KVCapacityError, PagedAllocator, PagedKVCache

__all__ = [
    "CheckpointError",
    "DSparkConfig",
    "DSparkConfigError",
    "DSparkDraft",
    "DraftOutput",
    "KVCapacityError",
    "PagedAllocator",
    "PagedKVCache",
    "load_dspark",
    "save_dspark",
]
