"""Reading a model's `config.json` into a pydantic model, with one error that names every bad
or missing field (shared by the target and the draft configs)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def validate_fields(cls: type[M], data: dict[str, Any], source: str, kind: str,
                    error: type[ValueError]) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: missing" if err["type"] == "missing" else f"{loc}: {msg}")
        raise error(f"{source}: invalid {kind} config:\n  - " + "\n  - ".join(lines)) from None


def read_config_json(path: str | os.PathLike[str], error: type[ValueError]
                     ) -> tuple[dict[str, Any], str]:
    """(the JSON object, where it came from) of a config.json or a folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no config.json") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object")
    return raw, str(path)


def token_id_problems(vocab_size: int, bos: int | None, pad: int | None,
                      eos: int | list[int] | None) -> list[str]:
    """The special token ids that fall outside the vocabulary, each named."""
    problems = [f"{name}={tok} must be in [0, vocab_size={vocab_size})"
                for name, tok in (("bos_token_id", bos), ("pad_token_id", pad))
                if tok is not None and not 0 <= tok < vocab_size]
    eos_ids = eos if isinstance(eos, list) else [eos]
    bad_eos = [t for t in eos_ids if t is not None and not 0 <= t < vocab_size]
    if bad_eos:
        problems.append(f"eos_token_id {bad_eos} must be in [0, vocab_size={vocab_size})")
    return problems
