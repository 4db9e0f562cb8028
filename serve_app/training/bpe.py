"""Train the byte-level BPE tokenizer on the training files and write the tokenizer folder:
K3's control tokens, no chat template (the chat format is K3's XTML, chat/xtml_render.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from serve_app.training.corpus import SourceFile

# Kimi K3's control tokens, laid out as a K3 checkpoint's `tokenizer_config.json` declares
# them: a block at the top of the vocabulary (K3: 256 ids from 163,584; here 16 from
# vocab_size - 16), the named ones in K3's order and at K3's offsets in the block ([BOS] +0,
# [EOS] +1, <|end_of_msg|> +2, the XTML markers +3..+5, the header ids, [EOT] +9), [UNK] and
# [PAD] last; the DSpark draft's MASK is a reserved token, as in K3's draft. K3's four image
# prompt tokens (its ids 163602-163605, +18..+21 in its block) take the spare ids +8 and
# +10..+12 here: the block has 16 ids, not 256, and they were reserved names no text encodes to.
CONTROL_TOKENS = 16
_NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>",
          5: "<|sep|>", 6: "[start_header_id]", 7: "[end_header_id]", 8: "<|media_begin|>",
          9: "[EOT]", 10: "<|media_content|>", 11: "<|media_end|>", 12: "<|media_pad|>",
          14: "[UNK]", 15: "[PAD]"}
MASK_OFFSET = 13


def control_tokens(vocab_size: int) -> dict[int, str]:
    """id -> content of the control block of a `vocab_size` vocabulary."""
    base = vocab_size - CONTROL_TOKENS
    return {base + i: _NAMED.get(i, f"<|reserved_token_{base + i}|>")
            for i in range(CONTROL_TOKENS)}


def train_tokenizer(files: list[SourceFile], out: Path, vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE of vocab_size - 16 tokens on the files, then K3's control block."""
    tok = Tokenizer(models.BPE())
    # GPT-2 byte-level regex: any byte sequence is encodable, and decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - CONTROL_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer, length=len(files))
    if tok.get_vocab_size() != vocab_size - CONTROL_TOKENS:
        raise ValueError(f"the corpus yields {tok.get_vocab_size()} BPE tokens, not "
                         f"{vocab_size - CONTROL_TOKENS}: too small for this vocabulary")
    controls = control_tokens(vocab_size)
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False)
                            for c in controls.values()])
    assert all(tok.token_to_id(c) == i for i, c in controls.items())
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    mask = controls[vocab_size - CONTROL_TOKENS + MASK_OFFSET]
    config = {
        "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for i, c in controls.items()},
        "additional_special_tokens": ["<|end_of_msg|>"],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "mask_token": mask,  # not in K3's file: its draft's config.json names the MASK id
        "model_max_length": 4096,
        "pad_token": "[PAD]",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok
