"""A checkpoint's Jinja chat template (as `transformers` renders it) to segments.

For checkpoints that ship one in `tokenizer_config.json` (the embedded default today; not K3,
which renders in Python). Sandboxed, like transformers: a template is data from a
checkpoint, not trusted code.

The template is rendered with a unique marker in place of each message's content; the text
between markers is the template's (a control segment: its special tokens become ids), the
markers become the contents (text segments: never special). A template that changes a
content on its way out (so its marker is not found exactly once, in order) is rendered with
the real contents instead, and a content holding a special-token string is then refused
rather than let through.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serve_app.chat.segments import Segment, control, encode_segments, text
from serve_app.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")


class JinjaChat:
    def __init__(self, template: str, specials: Sequence[str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            undefined=jinja2.StrictUndefined)
        self._template = env.from_string(template)
        self.specials = list(specials)

    def render(self, messages: Sequence[Mapping[str, str]],
               add_generation_prompt: bool = True) -> str:
        """The template's text for a conversation (contents inline: for display and tests)."""
        bad = [m.get("role") for m in messages if m.get("role") not in ROLES]
        if bad:
            raise ValueError(f"unknown chat roles {json.dumps(bad)}; allowed: "
                             f"{', '.join(ROLES)}")
        return self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt)

    def segments(self, messages: Sequence[Mapping[str, str]],
                 add_generation_prompt: bool = True) -> list[Segment]:
        tag = secrets.token_hex(8)
        markers = [f"@@content-{tag}-{i}@@" for i in range(len(messages))]
        marked = [{**m, "content": markers[i]} for i, m in enumerate(messages)]
        rest = self.render(marked, add_generation_prompt)
        out: list[Segment] = []
        for marker, message in zip(markers, messages, strict=True):
            head, found, rest = rest.partition(marker)
            if not found or marker in rest:
                return self._unmarked(messages, add_generation_prompt)
            out += [control(head), text(str(message.get("content") or ""))]
        return [*out, control(rest)]

    def _unmarked(self, messages: Sequence[Mapping[str, str]],
                  add_generation_prompt: bool) -> list[Segment]:
        for i, m in enumerate(messages):
            content = str(m.get("content") or "")
            forged = [t for t in self.specials if t in content]
            if forged:
                raise ValueError(f"messages[{i}].content contains the control token "
                                 f"{json.dumps(forged[0])}, which this chat template cannot "
                                 "keep as text")
        return [control(self.render(messages, add_generation_prompt))]


def template_chat(tokenizer: Tokenizer) -> JinjaChat:
    """The tokenizer folder's own Jinja template (ValueError when it ships none)."""
    if tokenizer.chat_template is None:
        raise ValueError("tokenizer_config.json has no chat_template")
    return JinjaChat(tokenizer.chat_template, list(tokenizer.special_ids))


def render_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]],
                add_generation_prompt: bool = True) -> str:
    """The template's text of a plain conversation, contents inline (the training corpus,
    tests)."""
    return template_chat(tokenizer).render(messages, add_generation_prompt)


def apply_chat_template(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]],
                        add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a plain conversation through the folder's Jinja template (the training
    corpus, tests and benches; the server goes through its chat format)."""
    return encode_segments(tokenizer, template_chat(tokenizer).segments(
        messages, add_generation_prompt))
