"""serve_app.tokenizer_tiktoken: a Kimi tokenizer folder loaded with `tiktoken`, no remote code.

The reference ids come from the `tiktoken` library itself, built here independently from the same
`tiktoken.model` with Kimi's pattern (read from tokenization_kimi.py's syntax tree, not imported from the
module under test). Data: tests/data/kimi-k25-tokenizer (the public K2.5 tokenizer, same BPE as
K3) and tests/data/kimi-k3-style (a K3-style tokenizer_config.json).
"""

from __future__ import annotations

import ast
import base64
import itertools
import json
import shutil
import sys
from pathlib import Path

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from serve_app.tokenizer_tiktoken import TikTokenTokenizer

DATA = Path(__file__).parent / "data"
K25 = DATA / "kimi-k25-tokenizer"
K3_CONFIG = DATA / "kimi-k3-style" / "tokenizer_config.json"
N_RANKS = 163_584

def _kimi_pattern() -> str:
    """`TikTokenTokenizer.pat_str` as Kimi's tokenization_kimi.py writes it: read from its
    syntax tree, never executed (a checkpoint's code is data here too)."""
    tree = ast.parse((K25 / "tokenization_kimi.py").read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "pat_str"):
            call = node.value
            assert isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            return "|".join(ast.literal_eval(call.args[0]))
    raise AssertionError("tokenization_kimi.py has no pat_str")


REF_PAT_STR = _kimi_pattern()

CONTROL_TEXT = [
    '<|open|>message role="user"<|sep|>hi<|close|>',
    "[EOS]",
    "<|end_of_msg|>[BOS][EOT]<|media_pad|><osagent_mode>[UNK][PAD]",
    "[start_header_id]system[end_header_id]<|reserved_token_163600|>",
]
CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, they'd said.",
    "你好世界，今天天气很好。机器学习是人工智能的一个分支。",
    "東京は日本の首都です。ひらがなとカタカナ、漢字。",
    "안녕하세요, 세계! 한국어 문장입니다.",
    "def f(x):\n    if x > 0:\n        return [i * 2 for i in range(x)]\n\treturn None\n",
    '{"name": "kimi", "ids": [1, 2, 3], "nested": {"ok": true, "v": null}}',
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇺🇸 heart ❤️ 🏳️‍🌈",
    "spaces     and\ttabs\t\t and\r\nmixed\n\n\r\n\rnewlines   \n  ",
    "   leading and trailing   ",
    "digits 1234567890 3.14159 -42 1e10 0x1F 2024-06-01",
    "café naïve Ωμέγα Привет мир العربية עברית हिन्दी",
    "",
    " ",
    *CONTROL_TEXT,
]


@pytest.fixture(scope="module")
def k3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A K3-style folder as a checkpoint ships it, minus the Python files."""
    folder = tmp_path_factory.mktemp("k3-tokenizer")
    shutil.copy(K25 / "tiktoken.model", folder / "tiktoken.model")
    shutil.copy(K3_CONFIG, folder / "tokenizer_config.json")
    return folder


@pytest.fixture(scope="module")
def tok(k3_folder: Path) -> TikTokenTokenizer:
    return TikTokenTokenizer.from_folder(k3_folder)


@pytest.fixture(scope="module")
def ref() -> tiktoken.Encoding:
    """The reference: tiktoken's own loader and Encoding, K3's control ids from the config."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # don't leave a copy in $TMPDIR/data-gym-cache
        ranks = load_tiktoken_bpe(str(K25 / "tiktoken.model"))
    named = {int(k): v["content"]
             for k, v in json.loads(K3_CONFIG.read_text())["added_tokens_decoder"].items()}
    special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(N_RANKS, N_RANKS + 256)}
    return tiktoken.Encoding(name="ref", pat_str=REF_PAT_STR, mergeable_ranks=ranks,
                             special_tokens=special)


def test_smoke_ids(tok: TikTokenTokenizer) -> None:
    assert tok.encode_text("Hello world") == [19180, 2695]
    assert tok.encode_text("你好世界") == [33845, 2243]


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_tiktoken(tok: TikTokenTokenizer, ref: tiktoken.Encoding, text: str) -> None:
    ids = tok.encode_text(text)
    assert ids == ref.encode_ordinary(text)
    assert all(i < N_RANKS for i in ids)  # client text never yields a control id
    assert tok.decode(ids) == text
    assert tok.encode(text) == ref.encode(text, allowed_special="all")


def test_control_strings_trusted_vs_client(tok: TikTokenTokenizer) -> None:
    text = '<|open|>message role="user"<|sep|>hi<|end_of_msg|>[EOS]'
    ids = tok.encode(text)
    assert [i for i in ids if tok.is_special(i)] == [163587, 163589, 163586, 163585]
    assert ids[0] == tok.control_id("<|open|>")
    assert not any(tok.is_special(i) for i in tok.encode_text(text))
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == 'message role="user"hi'
    assert tok.token_bytes(163587) == b"<|open|>"
    assert tok.token_bytes(ids[1]) == tok.decode(ids[1:2]).encode()
    assert tok.encode_batch_text([text, "[EOS]"]) == [tok.encode_text(text),
                                                      tok.encode_text("[EOS]")]


@pytest.mark.parametrize("char", ["a", "-", " "])
def test_long_runs_are_split_at_25000(tok: TikTokenTokenizer, ref: tiktoken.Encoding,
                                      char: str) -> None:
    run = char * 26_000
    expected = ref.encode_ordinary(run[:25_000]) + ref.encode_ordinary(run[25_000:])
    assert tok.encode_text(run) == expected
    assert tok.decode(expected) == run
    # Measured: for "a" the split changes nothing; for "-" and " " it does (one more token).
    assert (ref.encode_ordinary(run) == expected) is (char == "a")


def test_mixed_runs_and_400k_windows(tok: TikTokenTokenizer, ref: tiktoken.Encoding) -> None:
    text = "x" * 30_000 + " " * 30_000 + "tail"
    cuts = [0, 25_000, 30_000 + 25_000, len(text)]
    expected = [i for a, b in itertools.pairwise(cuts)
                for i in ref.encode_ordinary(text[a:b])]
    assert tok.encode_text(text) == expected
    words = "word " * 100_000  # 500,000 chars: two windows, split at 400,000
    expected = ref.encode_ordinary(words[:400_000]) + ref.encode_ordinary(words[400_000:])
    assert tok.encode_text(words) == expected


def test_lone_surrogate_is_replaced_not_raised(tok: TikTokenTokenizer,
                                               ref: tiktoken.Encoding) -> None:
    assert tok.encode_text("a\ud800b") == ref.encode_ordinary("a\ufffdb")
    with pytest.raises(ValueError, match="cannot decode"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TypeError):
        tok.encode_text(b"bytes")  # type: ignore[arg-type]


def test_k3_style_folder(tok: TikTokenTokenizer, ref: tiktoken.Encoding) -> None:
    assert tok.vocab_size == 163_840
    assert tok.control_id("<|open|>") == 163587
    assert (tok.bos_token_id, tok.eos_token_id) == (163584, 163585)
    assert (tok.unk_token_id, tok.pad_token_id, tok.mask_token_id) == (163838, 163839, None)
    assert len(tok.special_ids) == 256
    assert set(tok.special_ids.values()) == set(range(N_RANKS, N_RANKS + 256))
    assert tok.special_ids["<|reserved_token_163592|>"] == 163592
    assert tok.chat_template is None
    assert tok.config["tokenizer_class"] == "TikTokenTokenizer"
    assert tok.max_token_bytes == max(len(ref.decode_single_token_bytes(i))
                                      for i in range(tok.vocab_size))
    with pytest.raises(KeyError, match="im_end"):
        tok.control_id("<|im_end|>")


def test_loading_never_runs_remote_code(k3_folder: Path, tmp_path: Path) -> None:
    assert not list(k3_folder.glob("*.py"))  # the module fixture already loaded without them
    trap = tmp_path / "k3"
    shutil.copytree(k3_folder, trap)
    (trap / "tokenization_kimi.py").write_text("raise RuntimeError('remote code executed')\n")
    loaded = TikTokenTokenizer.from_folder(trap)
    assert loaded.control_id("<|open|>") == 163587
    assert "tokenization_kimi" not in sys.modules
    k25 = TikTokenTokenizer.from_folder(K25)  # the real folder, with its real .py files
    assert (k25.eos_token_id, k25.control_id("<|im_end|>")) == (163585, 163586)
    assert "tokenization_kimi" not in sys.modules


def _tiny_folder(folder: Path, config: dict | str | None, model: bool = True) -> Path:
    """256 single-byte ranks: control ids are 256..511."""
    folder.mkdir()
    if model:
        lines = (f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256))
        (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (folder / "tokenizer_config.json").write_text(text)
    return folder


def _decl(**ids: str) -> dict:
    return {k.removeprefix("i"): {"content": v, "special": True} for k, v in ids.items()}


def test_tiny_folder_loads(tmp_path: Path) -> None:
    cfg = {"added_tokens_decoder": _decl(i256="[BOS]", i257="[EOS]"), "eos_token": "[EOS]",
           "pad_token": "<|reserved_token_511|>", "chat_template": "{{ messages }}"}
    tiny = TikTokenTokenizer.from_folder(_tiny_folder(tmp_path / "t", cfg))
    assert (tiny.vocab_size, tiny.eos_token_id, tiny.pad_token_id) == (512, 257, 511)
    assert tiny.bos_token_id is None and tiny.chat_template == "{{ messages }}"
    assert tiny.encode_text("ab") == [97, 98] and tiny.encode("[EOS]") == [257]


def test_broken_folders_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tiktoken\.model missing") as e:
        TikTokenTokenizer.from_folder(_tiny_folder(tmp_path / "a", {}, model=False))
    assert str(e.value).startswith(f"tokenizer folder {tmp_path / 'a'}: ")

    foo = {"added_tokens_decoder": _decl(i256="[EOS]"), "eos_token": "[FOO]"}
    with pytest.raises(ValueError) as e:
        TikTokenTokenizer.from_folder(_tiny_folder(tmp_path / "b", foo, model=False))
    assert str(e.value) == (f"tokenizer folder {tmp_path / 'b'}: tiktoken.model missing; "
                            "tokenizer_config.json: eos_token '[FOO]' is not a declared "
                            "special token")

    outside = {"added_tokens_decoder": _decl(i100="[EOS]", i512="[X]"), "unk_token": "[UNK]"}
    with pytest.raises(ValueError) as e:
        TikTokenTokenizer.from_folder(_tiny_folder(tmp_path / "c", outside))
    for part in ("special id 100 ('[EOS]') is outside [256, 512)", "special id 512",
                 "unk_token '[UNK]' is not a declared special token"):
        assert part in str(e.value)

    with pytest.raises(ValueError, match=r"tokenizer_config.json: not valid JSON"):
        TikTokenTokenizer.from_folder(_tiny_folder(tmp_path / "d", "{not json"))
    with pytest.raises(ValueError, match=r"tokenizer_config.json missing"):
        TikTokenTokenizer.from_folder(_tiny_folder(tmp_path / "e", None))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: not a JSON object"):
        TikTokenTokenizer.from_folder(_tiny_folder(tmp_path / "f", "[1, 2]"))
    bad_model = _tiny_folder(tmp_path / "g", {})
    (bad_model / "tiktoken.model").write_text("YQ== 0\nnot-a-line\n")
    with pytest.raises(ValueError, match=r"tiktoken.model: line 2 is not 'base64-token rank'"):
        TikTokenTokenizer.from_folder(bad_model)
