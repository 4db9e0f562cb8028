"""Training of the embedded CPU default (tokenizer, mini Kimi target, DSpark draft)."""
