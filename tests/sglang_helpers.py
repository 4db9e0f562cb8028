"""Shared by the SGLang backend tests: the generated deployment files and their configs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from serve_app.config import AppConfig

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden"


def generator() -> ModuleType:
    """deployments/generate.py (a script, not a package module)."""
    name = "deployments_generate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "deployments" / "generate.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def serve_files() -> list[str]:
    return [v.file for v in generator().VARIANTS]


def load_serve(rel: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / rel).read_text())


def app_config(rel: str, **overrides: dict[str, Any]) -> AppConfig:
    """The AppConfig a Serve file's builder receives, with sections merged over it."""
    args = load_serve(rel)["applications"][0]["args"]
    for key, value in overrides.items():
        section = dict(args.get(key, {}))
        for k, v in value.items():
            if isinstance(v, dict) and isinstance(section.get(k), dict):
                section[k] = {**section[k], **v}
            else:
                section[k] = v
        args[key] = section
    return AppConfig.model_validate(args)
