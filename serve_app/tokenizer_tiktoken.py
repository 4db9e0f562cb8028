"""A Kimi tokenizer folder (`tiktoken.model` + `tokenizer_config.json`) loaded with the `tiktoken`
library, without the checkpoint's Python code (`tokenization_kimi.py`, named by `auto_map`), which
is never imported: a checkpoint is data, not trusted code.

The BPE ranks come from `tiktoken.model`; the 256 ids after them are control tokens, named by
`added_tokens_decoder` (unnamed ones are `<|reserved_token_N|>`, as in Kimi's own code). Pattern
and long-input chunking are copied from Kimi's tokenizer so the ids are the same as its ids.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import tiktoken

# Kimi's pre-tokenization regex (`TikTokenTokenizer.pat_str` in tokenization_kimi.py).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_CONTROL_IDS = 256
MAX_ENCODE_CHARS = 400_000  # tiktoken can panic on longer inputs
MAX_RUN_CHARS = 25_000  # ... and is quadratic on long runs (openai/tiktoken#195)
_NAMED = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")


def split_runs(s: str, max_run: int = MAX_RUN_CHARS) -> Iterator[str]:
    """Split `s` so no piece has more than `max_run` consecutive whitespace or non-whitespace
    characters (Kimi's `_split_whitespaces_or_nonwhitespaces`, which decides where its ids break).
    """
    run, run_is_space, start = 0, s[:1].isspace(), 0
    for i, ch in enumerate(s):
        if ch.isspace() != run_is_space:
            run, run_is_space = 1, not run_is_space
        else:
            run += 1
            if run > max_run:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


def chunks(text: str) -> Iterator[str]:
    """The pieces Kimi's tokenizer encodes separately: 400k-char windows, then split_runs."""
    for i in range(0, len(text), MAX_ENCODE_CHARS):
        yield from split_runs(text[i:i + MAX_ENCODE_CHARS])


def _read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file ("base64-token rank" per line), the format
    `tiktoken.load.load_tiktoken_bpe` reads. Read here because that function keeps a copy of every
    file under $TMPDIR/data-gym-cache keyed by path and serves the copy afterwards (a checkpoint
    replaced in place would keep its old vocabulary), and treats a path with "://" as a URL."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"line {n} is not 'base64-token rank'") from e
    if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def _special_ids(config: Any, n_ranks: int | None, problems: list[str]) -> dict[str, int]:
    """Content -> id for the control ids (all 256 when `n_ranks` is known, else the declared
    ones); every problem found in the config is added to `problems`."""
    where = "tokenizer_config.json"
    if not isinstance(config, dict):
        problems.append(f"{where}: not a JSON object")
        return {}
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        problems.append(f"{where}: added_tokens_decoder is not an object")
        decoder = {}
    declared: dict[int, str] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (key.isascii() and key.isdigit()) or not isinstance(content, str) or not content:
            problems.append(f"{where}: added_tokens_decoder[{key!r}] is not id -> {{content}}")
        elif n_ranks is not None and not n_ranks <= int(key) < n_ranks + NUM_CONTROL_IDS:
            problems.append(f"{where}: special id {key} ({content!r}) is outside "
                            f"[{n_ranks}, {n_ranks + NUM_CONTROL_IDS})")
        elif content in declared.values():
            problems.append(f"{where}: {content!r} is declared twice")
        else:
            declared[int(key)] = content
    ids = range(n_ranks, n_ranks + NUM_CONTROL_IDS) if n_ranks is not None else sorted(declared)
    special = {declared.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
    reserved = re.compile(r"<\|reserved_token_\d+\|>")
    for name in _NAMED:
        content = _content(config.get(name))
        if content is None or (n_ranks is None and reserved.fullmatch(str(content))):
            continue  # not configured, or a reserved name: resolvable only once n_ranks is known
        if not isinstance(content, str) or content not in special:
            problems.append(f"{where}: {name} {content!r} is not a declared special token")
    return special


def _content(value: Any) -> Any:
    """A named token's string; HF configs may also write it as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class TikTokenTokenizer:
    """Kimi's tokenizer: tiktoken BPE plus 256 control ids, from a checkpoint's folder."""

    def __init__(self, ranks: dict[bytes, int], special_ids: dict[str, int],
                 config: dict[str, Any], name: str) -> None:
        """Use from_folder; this takes already-validated parts."""
        self.special_ids: dict[str, int] = dict(special_ids)
        self._encoding = tiktoken.Encoding(name=name, pat_str=KIMI_PAT_STR,
                                           mergeable_ranks=ranks, special_tokens=self.special_ids)
        self.config = config
        self.vocab_size: int = len(ranks) + NUM_CONTROL_IDS
        self._special_set = frozenset(self.special_ids.values())

        def token_id(key: str) -> int | None:
            content = _content(config.get(key))
            return None if content is None else self.special_ids[content]

        self.bos_token_id, self.eos_token_id = token_id("bos_token"), token_id("eos_token")
        self.pad_token_id, self.unk_token_id = token_id("pad_token"), token_id("unk_token")
        self.mask_token_id = token_id("mask_token")
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        # A text of B bytes has at least B / max_token_bytes tokens: lets the server refuse an
        # over-long prompt before tokenizing it.
        self.max_token_bytes: int = max(
            max(map(len, ranks)), *(len(s.encode()) for s in self.special_ids))

    @classmethod
    def from_folder(cls, path: str | Path) -> TikTokenTokenizer:
        """Load `tiktoken.model` and `tokenizer_config.json` from `path`; one ValueError names
        every problem, so a broken checkpoint is fixed in one pass. Never reads `auto_map`."""
        folder = Path(path)
        problems: list[str] = []
        ranks: dict[bytes, int] | None = None
        config: Any = None
        special: dict[str, int] = {}
        model = folder / "tiktoken.model"
        if not model.is_file():
            problems.append("tiktoken.model missing")
        else:
            try:
                ranks = _read_ranks(model)
            except (OSError, ValueError) as e:
                problems.append(f"tiktoken.model: {e}")
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            problems.append("tokenizer_config.json missing")
        except (OSError, ValueError) as e:
            problems.append(f"tokenizer_config.json: not valid JSON ({e})")
        else:
            special = _special_ids(config, None if ranks is None else len(ranks), problems)
        if problems or ranks is None:
            raise ValueError(f"tokenizer folder {folder}: " + "; ".join(problems))
        return cls(ranks, special, config, name=str(model))

    def _encode(self, text: str, trusted: bool) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"expected str, got {type(text).__name__}")
        ids: list[int] = []
        try:
            for piece in chunks(text):
                ids += (self._encoding.encode(piece, allowed_special="all") if trusted
                        else self._encoding.encode_ordinary(piece))
        except Exception as e:  # tiktoken's own errors: one type for the server to map to 400
            raise ValueError(f"cannot tokenize text: {e}") from e
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Client text: control-token strings stay ordinary text, so a user can't forge a turn.
        Lone surrogates become U+FFFD (as tiktoken, and so Kimi's tokenizer, does)."""
        return self._encode(text, trusted=False)

    def encode(self, text: str) -> list[int]:
        """Trusted text (the server's own template): control-token strings become their ids."""
        return self._encode(text, trusted=True)

    def encode_batch_text(self, texts: list[str]) -> list[list[int]]:
        return [self.encode_text(t) for t in texts]

    def control_id(self, token: str) -> int:
        try:
            return self.special_ids[token]
        except KeyError:
            raise KeyError(f"{token!r} is not a special token of this tokenizer") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_set

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one id (a control token: its content in UTF-8); for streaming output."""
        return self._encoding.decode_single_token_bytes(token_id)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """UTF-8 with errors="replace"; an id outside the vocabulary is a ValueError."""
        ids = [i for i in ids if not (skip_special_tokens and i in self._special_set)]
        try:
            return self._encoding.decode(ids, errors="replace")
        except (KeyError, OverflowError, TypeError) as e:
            raise ValueError(f"cannot decode ids: {e}") from e
