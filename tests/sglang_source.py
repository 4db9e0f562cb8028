"""The SGLang 0.5.23 source the source-reading tests check this project against: SGLANG_SRC,
by default where `pip download --no-deps sglang==0.5.23 -d /tmp/pkgs` and unzipping the wheel
into /tmp/pkgs/sg put it. Neither SGLang nor its dependencies are installed; a test whose file
is absent skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SGLANG_SRC = Path(os.environ.get("SGLANG_SRC", "/tmp/pkgs/sg/sglang"))


def sglang_file(relative: str) -> Path:
    """`SGLANG_SRC / relative`, or skip the test where it is not there."""
    path = SGLANG_SRC / relative
    if not path.is_file():
        pytest.skip(f"SGLang 0.5.23 source not at {SGLANG_SRC} (set SGLANG_SRC)")
    return path
