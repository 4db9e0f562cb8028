"""Which family a target checkpoint is, from its config.json alone (no torch, no weights)."""

from __future__ import annotations

import os

from serve_app.models.config_files import read_config_json
from serve_app.models.k3_config import K3Config
from serve_app.models.kimi_config import KimiConfig, KimiConfigError

# config.json model types of the hybrid (KDA + MLA) family: K3's wrapper, or its bare text model.
HYBRID_MODEL_TYPES = ("kimi_k3", "kimi_linear")


def is_hybrid(folder: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint folder holds a Kimi K3-layout target. An unreadable config.json is
    not hybrid: the K2-layout loader then names what is wrong with it."""
    try:
        raw, _ = read_config_json(folder, KimiConfigError)
    except KimiConfigError:
        return False
    return raw.get("model_type") in HYBRID_MODEL_TYPES


def load_target_config(folder: str | os.PathLike[str]) -> KimiConfig | K3Config:
    """The target's config, by its family: K3's hybrid layout, or K2's (DeepseekV3) one."""
    return K3Config.from_file(folder) if is_hybrid(folder) else KimiConfig.from_file(folder)
