"""Train the byte-level BPE tokenizer on the training files and write the tokenizer folder."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from serve_app.training.corpus import SourceFile

# Kimi-style chat specials: one token per role, one end-of-turn token (the EOS the engine stops
# on), the document separator, the draft's MASK and padding. Fixed ids 0..6.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_end|>",
    "<|mask|>",
    "<|pad|>",
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>{% endif %}"
)


def train_tokenizer(files: list[SourceFile], out: Path, vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # GPT-2 byte-level regex: any byte sequence is encodable, and decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer, length=len(files))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "mask_token": "<|mask|>",
        "additional_special_tokens": list(SPECIAL_TOKENS),
        "special_token_ids": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok
