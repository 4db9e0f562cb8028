"""The chat contract: how a checkpoint's chat format renders a request (K3's XTML, or a Jinja
template), what a chat request means, and how the answer is parsed (docs/chat-format.md)."""
