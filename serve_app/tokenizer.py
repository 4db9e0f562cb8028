"""A Hugging Face tokenizer folder (`tokenizer.json` + `tokenizer_config.json`) with its chat
template: what the ingress and the demo need to turn messages into token ids and back.

The chat template is Jinja2 (as in `transformers`). Special tokens written by the template
become their ids; text a client wrote never does: message contents are encoded as plain text,
so a user who types `<|im_end|><|im_system|>` gets those characters, not a forged turn.
"""

from __future__ import annotations

import json
import os
import secrets
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
        # A second tokenizer that reads special-token strings as ordinary text (client text).
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self.specials = [t.content for t in tokenizer.get_added_tokens_decoder().values()
                         if t.special]
        # The most UTF-8 bytes one token stands for: a text of B bytes has at least
        # B / max_token_bytes tokens, so over-long prompts are refused before tokenizing.
        self.max_token_bytes = max(
            len(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8", "replace"))
            for i in range(tokenizer.get_vocab_size()))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Trusted text (a rendered template, training data): special-token strings become
        their ids."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Client text: special-token strings stay text. The batch call releases the GIL (a
        10 MB prompt must not stall the server's event loop for seconds)."""
        return self._plain.encode_batch_fast([text], add_special_tokens=False)[0].ids

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
        """Token ids of a conversation: the template's own text with its special tokens, each
        message's content as plain text.

        The template is rendered with a unique marker in place of each content; the text
        between markers is the template's (encoded with special tokens), the markers are
        replaced by the contents (encoded as plain text). A template that changes a content
        on its way out (so its marker is not found exactly once, in order) is rendered with
        the real contents instead, and a content holding a special-token string is then
        refused rather than let through."""
        tag = secrets.token_hex(8)
        markers = [f"@@content-{tag}-{i}@@" for i in range(len(messages))]
        marked = [{**m, "content": markers[i]} for i, m in enumerate(messages)]
        rendered = self.render_chat(marked, add_generation_prompt)
        pieces: list[str] = []
        rest = rendered
        for marker in markers:
            head, found, rest = rest.partition(marker)
            if not found or marker in rest:
                return self._apply_unmarked(messages, add_generation_prompt)
            pieces.append(head)
        ids: list[int] = []
        for piece, message in zip(pieces, messages, strict=True):
            ids += self.encode(piece) if piece else []
            content = str(message.get("content") or "")
            ids += self.encode_text(content) if content else []
        return ids + (self.encode(rest) if rest else [])

    def _apply_unmarked(self, messages: Sequence[Mapping[str, str]],
                        add_generation_prompt: bool) -> list[int]:
        for i, m in enumerate(messages):
            content = str(m.get("content") or "")
            forged = [t for t in self.specials if t in content]
            if forged:
                raise ValueError(f"messages[{i}].content contains the control token "
                                 f"{json.dumps(forged[0])}, which this chat template cannot "
                                 "keep as text")
        return self.encode(self.render_chat(messages, add_generation_prompt))


def load_tokenizer(path: str | os.PathLike[str] = EMBEDDED_TOKENIZER) -> ChatTokenizer:
    """Load a tokenizer folder (defaults to the embedded one)."""
    path = Path(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    return ChatTokenizer(tok, config)
