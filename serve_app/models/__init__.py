"""Plain-PyTorch models and their checkpoint I/O (the bottom layer of the Serve app)."""

from serve_app.models.checkpoint import CheckpointError
from serve_app.models.dspark import DraftOutput, DSparkDraft, load_dspark, save_dspark
from serve_app.models.dspark_config import DSparkConfig, DSparkConfigError
from serve_app.models.kimi import KimiForCausalLM, KimiOutput
from serve_app.models.kimi_config import KimiConfig, KimiConfigError
from serve_app.models.kimi_weights import load_kimi, save_kimi
from serve_app.models.kv_cache import KVCapacityError, PagedAllocator, PagedKVCache

__all__ = [
    "CheckpointError",
    "DSparkConfig",
    "DSparkConfigError",
    "DSparkDraft",
    "DraftOutput",
    "KVCapacityError",
    "KimiConfig",
    "KimiConfigError",
    "KimiForCausalLM",
    "KimiOutput",
    "PagedAllocator",
    "PagedKVCache",
    "load_dspark",
    "load_kimi",
    "save_dspark",
    "save_kimi",
]
