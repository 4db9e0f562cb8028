"""A Hugging Face tokenizer folder (`tokenizer.json` + `tokenizer_config.json`) with its chat
template: what the ingress and the demo need to turn messages into token ids and back.

The chat template is Jinja2 (as in `transformers`), rendered to text and then encoded, so
special tokens written by the template become their ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

EMBEDDED_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer"


class ChatTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.config = dict(config)
        template = self.config.get("chat_template")
        if not isinstance(template, str) or not template:
            raise ValueError("tokenizer_config.json has no chat_template")
        # Sandboxed, like transformers: a template is data from a checkpoint, not trusted code.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            undefined=jinja2.StrictUndefined)
        self._template = env.from_string(template)

        def token_id(key: str) -> int:
            name = self.config.get(key)
            tid = tokenizer.token_to_id(name) if isinstance(name, str) else None
            if tid is None:
                raise ValueError(f"tokenizer_config.json: {key}={name!r} is not in the vocabulary")
            return tid

        self.eos_token = str(self.config["eos_token"])
        self.eos_token_id = token_id("eos_token")
        self.mask_token_id = token_id("mask_token")
        self.pad_token_id = token_id("pad_token")
        self.bos_token_id = token_id("bos_token")  # the document separator, <|endoftext|>

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> str:
        bad = [m.get("role") for m in messages
               if m.get("role") not in ("system", "user", "assistant")]
        if bad:
            raise ValueError(f"unknown chat roles {bad}; allowed: system, user, assistant")
        return self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def load_tokenizer(path: str | os.PathLike[str] = EMBEDDED_TOKENIZER) -> ChatTokenizer:
    """Load a tokenizer folder (defaults to the embedded one)."""
    path = Path(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    return ChatTokenizer(tok, config)
