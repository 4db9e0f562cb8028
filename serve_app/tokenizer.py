"""Tokenizer folders, in the two forms checkpoints ship, behind one interface.

- Hugging Face: `tokenizer.json` + `tokenizer_config.json` (the embedded default);
- Kimi's tiktoken BPE: `tiktoken.model` + `tokenizer_config.json` naming the control tokens
  (K3 and K2.5 checkpoints: `tokenizer_tiktoken.py`). Their Python tokenizer code is never
  imported, whatever `auto_map` says.

Both keep client text apart from control tokens: `encode_text` reads special-token strings
as ordinary text (a user who types `<|im_end|>` gets those characters, not a forged turn);
`encode` is for trusted text (a renderer's own markers, training data). How a conversation
becomes ids is the chat format's business (`serve_app/chat/`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as HFTokenizerModel

from serve_app.tokenizer_tiktoken import TikTokenTokenizer

EMBEDDED_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer"
# A message's end in K3's chat format: generation stops there, like at EOS.
END_OF_MESSAGE = "<|end_of_msg|>"


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int
    max_token_bytes: int
    special_ids: dict[str, int]
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


def stop_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Where generation ends: EOS, and the end of a message where the format has one."""
    end = tokenizer.special_ids.get(END_OF_MESSAGE)
    return [tokenizer.eos_token_id] + ([end] if end is not None else [])


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (as `tokenizers`' ByteLevel): printable bytes stand for
    themselves, the rest are shifted past 255."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable},
            **{chr(256 + i): b for i, b in enumerate(shifted)}}


_BYTE_OF = _byte_level_alphabet()


class HFTokenizer:
    def __init__(self, tokenizer: HFTokenizerModel, config: Mapping[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.config = dict(config)
        template = self.config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) and template \
            else None

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
        self._plain = HFTokenizerModel.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self.special_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()
                            if t.special}
        self._special_set = frozenset(self.special_ids.values())
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

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_set

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (byte-level BPE vocabularies, as Kimi's converted
        tokenizer.json; other pieces by their decoded text)."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if token_id in self._special_set or any(c not in _BYTE_OF for c in piece):
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return bytes(_BYTE_OF[c] for c in piece)


def load_tokenizer(path: str | os.PathLike[str] = EMBEDDED_TOKENIZER) -> Tokenizer:
    """Load a tokenizer folder (defaults to the embedded one), in whichever form it is."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        tok = HFTokenizerModel.from_file(str(path / "tokenizer.json"))
        config = json.loads((path / "tokenizer_config.json").read_text())
        return HFTokenizer(tok, config)
    if (path / "tiktoken.model").is_file():
        return TikTokenTokenizer.from_folder(path)
    raise ValueError(f"tokenizer folder {path}: neither tokenizer.json (Hugging Face) nor "
                     "tiktoken.model (Kimi's BPE) is there")
