"""The embedded CPU default: a mini Kimi K3 target, its DSpark draft and their tokenizer,
trained on the Python standard library by `python -m serve_app.training all` and shipped in the
wheel.

One place for their paths and for the fixed held-out prompts that the test, the benchmark and
the model cards use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serve_app.chat.segments import encode_segments
from serve_app.tokenizer import Tokenizer

ASSETS = Path(__file__).parent / "assets"
TARGET = ASSETS / "kimi-k3-mini"
DRAFT = ASSETS / "kimi-k3-mini-dspark"
TOKENIZER = ASSETS / "tokenizer"
HELDOUT_PROMPTS = ASSETS / "heldout_prompts.json"
ASSET_DIRS = (TARGET, DRAFT, TOKENIZER)


def heldout_prompts() -> dict[str, list]:
    """{'completion': [code...], 'conversations': [{kind, request, answer}...]} from held-out
    corpus files (`python -m serve_app.training heldout` writes them)."""
    data = json.loads(HELDOUT_PROMPTS.read_text())
    return {"completion": list(data["completion"]), "conversations": list(data["conversations"])}


def chat_prompt_ids(tokenizer: Tokenizer, request: dict[str, Any]) -> list[int]:
    """A chat request's prompt ids as the ingress makes them (its chat format's plan)."""
    from serve_app.chat.formats import chat_format_for
    from serve_app.protocol.openai import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": "embedded", **request})
    return encode_segments(tokenizer, chat_format_for(tokenizer).plan(body).segments)


def heldout_prompt_ids(tokenizer: Tokenizer, n_completion: int | None = None,
                       n_chat: int | None = None) -> list[list[int]]:
    """Token ids of the held-out prompts: completion prompts as raw text, then the held-out
    conversations' requests as the ingress renders them (ending with the generation prompt)."""
    prompts = heldout_prompts()
    ids = [tokenizer.encode_text(t) for t in prompts["completion"][:n_completion]]
    ids += [chat_prompt_ids(tokenizer, c["request"]) for c in prompts["conversations"][:n_chat]]
    return ids


def asset_bytes() -> int:
    """Bytes of every file of the three shipped folders (the wheel's share)."""
    return sum(f.stat().st_size for d in ASSET_DIRS for f in d.rglob("*") if f.is_file())
