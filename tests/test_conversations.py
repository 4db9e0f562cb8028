"""The training conversations: K3's chat format as the server renders and parses it."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from serve_app.chat.formats import K3Format, chat_format_for
from serve_app.chat.segments import encode_segments
from serve_app.embedded import TOKENIZER, heldout_prompts
from serve_app.protocol.openai import ChatCompletionRequest
from serve_app.tokenizer import load_tokenizer
from serve_app.training.conversations import (
    KINDS,
    Conversation,
    conversations,
    functions,
    per_kind,
)
from serve_app.training.corpus import SourceFile, split_files, stdlib_files
from serve_app.training.evaluate import valid_call, well_formed


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def files() -> tuple[list[SourceFile], list[SourceFile]]:
    train, held = split_files(stdlib_files())
    return train[:40], held


def _plan(tok, request):  # type: ignore[no-untyped-def]
    return chat_format_for(tok).plan(ChatCompletionRequest.model_validate({"model": "m", **request}))


def test_the_embedded_tokenizer_declares_k3s_control_tokens(tok) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(chat_format_for(tok), K3Format)
    assert tok.chat_template is None
    top = tok.vocab_size - 16
    assert {tok.special_ids[n] - top for n in ("[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>",
                                               "<|close|>", "<|sep|>", "[UNK]", "[PAD]")} \
        == {0, 1, 2, 3, 4, 5, 14, 15}
    # A client's text never becomes a marker.
    assert tok.special_ids["<|open|>"] not in tok.encode_text("<|open|>think<|sep|>")


def test_every_answer_is_what_the_parser_reads_and_the_renderer_writes(tok, files) -> None:  # type: ignore[no-untyped-def]
    train, _ = files
    convs = conversations(train, 120, random.Random(1))
    assert {c.kind for c in convs} == set(KINDS)
    for c in convs:
        plan = _plan(tok, c.request)
        prompt, completion = c.tokens()
        assert encode_segments(tok, prompt) == encode_segments(tok, plan.segments)
        ids = encode_segments(tok, completion)
        assert well_formed(tok, plan, ids), c
        # Structure broken: the first <|close|> (the end of the first channel) dropped.
        close = tok.special_ids["<|close|>"]
        assert not well_formed(tok, plan, [t for i, t in enumerate(ids)
                                           if i != ids.index(close)])
        assert not well_formed(tok, plan, ids[:-1])  # the message never ends


def test_calls_and_json_answers_follow_their_schemas(tok, files) -> None:  # type: ignore[no-untyped-def]
    train, _ = files
    rng = random.Random(2)
    convs = per_kind(train, 6, rng)
    for c in convs:
        plan = _plan(tok, c.request)
        calls = c.answer.get("tool_calls", [])
        if c.kind in ("tool_call", "tool_required", "tool_dynamic"):
            assert calls or c.request["messages"][-1]["role"] == "tool"
        if c.request.get("tool_choice") == "required":
            assert calls and all(valid_call(plan, t["function"]["arguments"],
                                            t["function"]["name"]) for t in calls)
        if c.kind == "tool_not_needed":
            assert not calls
        fmt = c.request.get("response_format", {})
        if fmt.get("type") == "json_schema":
            jsonschema.validate(json.loads(c.answer["content"]), fmt["json_schema"]["schema"])


def test_the_heldout_conversations_come_from_heldout_files(files) -> None:  # type: ignore[no-untyped-def]
    train, held = files
    data = heldout_prompts()
    convs = data["conversations"]
    assert [c["kind"] for c in convs[:len(KINDS)]] == list(KINDS)
    # Every conversation is about a held-out file's function (its module or tool name).
    names = {n for f in held for fn in functions(f)
             for n in (fn.module, fn.tool_name)}
    for c in convs:
        conv = Conversation(c["kind"], c["request"], c["answer"])
        text = json.dumps(conv.request)
        assert any(n in text for n in names), c
        conv.tokens()  # renders
    assert not {f.rel for f in held} & {f.rel for f in train}
