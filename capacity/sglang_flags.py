"""SGLang 0.5.23's server-argument table: its ServerArgs fields (name -> type, default, CLI
flag, choices, help), vendored as `capacity/data/sglang_flags_0_5_23.json` (extracted from the
wheel by `tools/extract_sglang_flags.py`). In the bottom layer, so that the planner's emitted
settings take SGLang's own defaults from it (capacity/sglang_recipe.py), and the app's
argument mapping (CLI spelling) and start-up checks (every argument checked against it) read
the same table."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
FLAGS_FILE = Path(__file__).parent / "data" / "sglang_flags_0_5_23.json"


@functools.cache
def _table() -> dict[str, Any]:
    data = json.loads(FLAGS_FILE.read_text())
    if data["sglang_version"] != SGLANG_VERSION:
        raise RuntimeError(f"{FLAGS_FILE.name} is for SGLang {data['sglang_version']}, "
                           f"expected {SGLANG_VERSION}")
    return data


def sglang_fields() -> dict[str, dict[str, Any]]:
    """SGLang 0.5.23's ServerArgs fields (name -> type, default, flag, choices, help)."""
    return _table()["fields"]


def draft_attention_backends() -> list[str]:
    return _table()["draft_attention_backend_choices"]
