"""The embedded CPU default: a mini Kimi K3 target, its DSpark draft and their tokenizer,
trained on the Python standard library by `python -m serve_app.training all` and shipped in the
wheel.

One place for their paths and for the fixed held-out prompts that the test, the benchmark and
the model cards use.
"""

from __future__ import annotations

import json
from pathlib import Path

from serve_app.tokenizer import HFTokenizer

ASSETS = Path(__file__).parent / "assets"
TARGET = ASSETS / "kimi-k3-mini"
DRAFT = ASSETS / "kimi-k3-mini-dspark"
TOKENIZER = ASSETS / "tokenizer"
HELDOUT_PROMPTS = ASSETS / "heldout_prompts.json"
ASSET_DIRS = (TARGET, DRAFT, TOKENIZER)


def heldout_prompt_texts() -> dict[str, list[str]]:
    """{'completion': [code...], 'chat': [user message...]} from held-out corpus files."""
    data = json.loads(HELDOUT_PROMPTS.read_text())
    return {"completion": list(data["completion"]), "chat": list(data["chat"])}


def heldout_prompt_ids(tokenizer: HFTokenizer, n_completion: int | None = None,
                       n_chat: int | None = None) -> list[list[int]]:
    """Token ids of the held-out prompts: completion prompts as raw text, chat prompts through
    the chat template with the generation prompt."""
    texts = heldout_prompt_texts()
    ids = [tokenizer.encode(t) for t in texts["completion"][:n_completion]]
    ids += [tokenizer.apply_chat_template([{"role": "user", "content": m}])
            for m in texts["chat"][:n_chat]]
    return ids


def asset_bytes() -> int:
    """Bytes of every file of the three shipped folders (the wheel's share)."""
    return sum(f.stat().st_size for d in ASSET_DIRS for f in d.rglob("*") if f.is_file())
