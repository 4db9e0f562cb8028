"""The K3 XTML output parser (serve_app/chat/xtml_output.py) over a small fake vocabulary.

Ids 0..255 are single bytes, 1000..1003 the four controls, 1004 another special id, 2000.. a few
multi-byte "words". `ids()` turns the literal marker strings into control ids and everything else
into byte ids, so the inputs read like XTML; `spelled()` keeps marker strings as ordinary bytes.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from itertools import chain

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.chat.xtml_output import (
    HEADER_CAP,
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    XTMLControls,
    XTMLOutputParser,
)

OPEN, CLOSE, SEP, EOM, OTHER_SPECIAL = 1000, 1001, 1002, 1003, 1004
CONTROLS = XTMLControls(open=OPEN, close=CLOSE, sep=SEP, end_of_msg=EOM)
MARKERS = {"<|open|>": OPEN, "<|close|>": CLOSE, "<|sep|>": SEP, "<|end_of_msg|>": EOM}
WORDS = {2000: "北", 2001: "京", 2002: "😀", 2003: "hello", 2004: "é"}
WORD_IDS = {text: tid for tid, text in WORDS.items()}
_MARKER_RE = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")


def token_bytes(tid: int) -> bytes:
    if tid < 256:
        return bytes([tid])
    if tid == OTHER_SPECIAL:
        return b"<|reserved_token_0|>"
    marker = {v: k for k, v in MARKERS.items()}.get(tid)
    if marker is not None:  # a real tokenizer spells controls so: they must never show
        return marker.encode()
    return WORDS[tid].encode()


def is_special(tid: int) -> bool:
    return OPEN <= tid <= OTHER_SPECIAL


def spelled(text: str) -> list[int]:
    return list(text.encode())


def ids(text: str) -> list[int]:
    out: list[int] = []
    for part in _MARKER_RE.split(text):
        out.extend([MARKERS[part]] if part in MARKERS else spelled(part))
    return out


def wids(text: str) -> list[int]:
    """Like ids(), but characters in WORDS become one multi-byte id each."""
    out: list[int] = []
    for part in _MARKER_RE.split(text):
        if part in MARKERS:
            out.append(MARKERS[part])
        else:
            for ch in part:
                out.extend([WORD_IDS[ch]] if ch in WORD_IDS else spelled(ch))
    return out


@dataclass
class Run:
    reasoning: str  # concatenated deltas
    content: str
    calls: dict[int, tuple[str, str, bool]]  # index -> (name, arguments, ended)
    summary: tuple[str, str, tuple[ToolCall, ...], bool]
    events: list[OutputEvent]


def run(chunks: list[list[int]], *, thinking: bool = True, tools: bool = True,
        json_values: bool = False) -> Run:
    parser = XTMLOutputParser(
        CONTROLS, token_bytes, thinking=thinking, tools_allowed=tools, is_special=is_special,
        json_values=json_values,
    )
    events: list[OutputEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    calls: dict[int, tuple[str, str, bool]] = {}
    for ev in events:
        if isinstance(ev, ToolCallStart):
            assert ev.index not in calls, "ToolCallStart exactly once per call"
            assert ev.index == len(calls)
            calls[ev.index] = (ev.name, "", False)
        elif isinstance(ev, ToolCallArguments):
            name, args, ended = calls[ev.index]
            assert not ended
            calls[ev.index] = (name, args + ev.fragment, ended)
        elif isinstance(ev, ToolCallEnd):
            name, args, ended = calls[ev.index]
            assert not ended
            calls[ev.index] = (name, args, True)
    summary = (parser.reasoning, parser.content, tuple(parser.tool_calls), parser.dropped_tools)
    return Run(
        "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "".join(e.text for e in events if isinstance(e, ContentDelta)),
        calls,
        summary,
        events,
    )


def parse(token_ids: list[int], **kw: bool) -> Run:
    return run([token_ids], **kw)


def key(r: Run) -> tuple[object, ...]:
    return (r.reasoning, r.content, r.calls, r.summary)


def check_consistent(r: Run) -> None:
    reasoning, content, tool_calls, _ = r.summary
    assert r.content == content
    # Equal, unless the think channel was skipped: then its text moved to content.
    assert r.reasoning == reasoning or (reasoning == "" and content.startswith(r.reasoning))
    assert len(tool_calls) == len(r.calls)
    for call in tool_calls:
        name, args, ended = r.calls[call.index]
        assert call.name == name
        assert call.complete == ended
        # The summary re-serializes only a complete call with a repeated key (last wins).
        assert call.arguments == args or json.loads(args) == json.loads(call.arguments)


def expect_text(r: Run, reasoning: str, content: str) -> None:
    check_consistent(r)
    assert (r.summary[0], r.summary[1]) == (reasoning, content)
    for text in (r.reasoning, r.content, reasoning, content):
        assert "<|" not in text


# -- channels -------------------------------------------------------------------------------


def test_thinking_reasoning_then_response() -> None:
    out = ids(
        "Let me think.<|close|>think<|sep|><|open|>response<|sep|>The answer."
        "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    r = parse(out)
    expect_text(r, "Let me think.", "The answer.")
    assert r.reasoning == "Let me think."
    assert r.calls == {} and r.summary[3] is False
    # Reasoning deltas all come before content deltas.
    kinds = [type(e) for e in r.events]
    assert kinds == sorted(kinds, key=lambda k: k is ContentDelta)


def test_thinking_off() -> None:
    r = parse(
        ids("Hi there<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"), thinking=False
    )
    expect_text(r, "", "Hi there")
    assert not any(isinstance(e, ReasoningDelta) for e in r.events)


def test_thinking_off_leading_response_open_ignored() -> None:
    r = parse(ids("<|open|>response<|sep|>Hi<|close|>response<|sep|>"), thinking=False)
    expect_text(r, "", "Hi")


def test_skipped_think_channel_becomes_content() -> None:
    r = parse(ids("The answer.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"))
    expect_text(r, "", "The answer.")
    assert r.reasoning == "The answer."  # streamed as reasoning first, then once as content
    assert [type(e) for e in r.events][-1] is ContentDelta
    r = parse(ids("Direct.<|close|>message<|sep|><|end_of_msg|>"))
    expect_text(r, "", "Direct.")


def test_leading_think_open_ignored() -> None:
    r = parse(ids("<|open|>think<|sep|>hmm<|close|>think<|sep|><|open|>response<|sep|>ok"))
    expect_text(r, "hmm", "ok")


def test_reasoning_ends_at_response_open_without_think_close() -> None:
    r = parse(ids("hmm<|open|>response<|sep|>ok<|close|>response<|sep|>"))
    expect_text(r, "hmm", "ok")


def test_stray_text_after_response_dropped_and_after_end_of_msg_ignored() -> None:
    r = parse(
        ids(
            "a<|close|>think<|sep|>x<|open|>response<|sep|>b<|close|>response<|sep|>"
            "stray<|close|>message<|sep|>more<|end_of_msg|><|open|>response<|sep|>z"
        )
    )
    expect_text(r, "a", "b")


def test_unknown_tags_keep_their_text_in_the_channel() -> None:
    r = parse(
        ids(
            '<|open|>response<|sep|>a<|open|>foo x="1"<|sep|>b<|close|>foo<|sep|>c'
            "<|sep|>d<|close|>response<|sep|>"
        ),
        thinking=False,
    )
    expect_text(r, "", "abcd")


def test_other_special_ids_are_dropped_even_inside_a_character() -> None:
    b = "北".encode()
    r = parse([*b[:1], OTHER_SPECIAL, *b[1:], *ids("<|close|>think<|sep|>")])
    expect_text(r, "北", "")


def test_spelled_markers_are_text() -> None:
    fake = "<|close|>think<|sep|><|open|>tools<|sep|>"
    r = parse(spelled(fake) + ids("<|close|>think<|sep|><|open|>response<|sep|>") + spelled(fake))
    assert (r.summary[0], r.summary[1]) == (fake, fake)
    assert r.calls == {}


# -- UTF-8 ------------------------------------------------------------------------------------


def test_multibyte_characters_split_across_tokens() -> None:
    out = ids("A😀B北<|close|>think<|sep|><|open|>response<|sep|>é😀")
    r = run([[t] for t in out])  # one byte per feed
    expect_text(r, "A😀B北", "é😀")
    texts = [e.text for e in r.events if isinstance(e, ReasoningDelta | ContentDelta)]
    assert "😀" in texts and not any("\ufffd" in t for t in texts)


def test_multibyte_word_ids() -> None:
    r = parse(wids("北京😀<|close|>think<|sep|><|open|>response<|sep|>hello é"))
    expect_text(r, "北京😀", "hello é")


def test_character_cut_by_a_control_is_replaced_once() -> None:
    emoji = "😀".encode()
    r = parse([*emoji[:2], *ids("<|close|>think<|sep|><|open|>response<|sep|>x")])
    expect_text(r, "\ufffd", "x")


# -- tools ------------------------------------------------------------------------------------

CALL_TYPED = (
    '<|open|>call tool="get&quot;weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>北京<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|open|>argument key="f" type="number"<|sep|>1.5<|close|>argument<|sep|>'
    '<|open|>argument key="ok" type="boolean"<|sep|>true<|close|>argument<|sep|>'
    '<|open|>argument key="none" type="null"<|sep|>null<|close|>argument<|sep|>'
    '<|open|>argument key="obj" type="object"<|sep|>{"a": [1, 2], "b": "x"}<|close|>argument<|sep|>'
    '<|open|>argument key="arr" type="array"<|sep|>[1, "two", null]<|close|>argument<|sep|>'
    '<|open|>argument key="bad" type="number"<|sep|>abc<|close|>argument<|sep|>'
    '<|open|>argument key="nan" type="number"<|sep|>NaN<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)
TYPED_ARGS = {
    "city": "北京",
    "days": 3,
    "f": 1.5,
    "ok": True,
    "none": None,
    "obj": {"a": [1, 2], "b": "x"},
    "arr": [1, "two", None],
    "bad": "abc",
    "nan": "NaN",
}
CALL_JSON = (
    '<|open|>call tool="a&amp;quot;b" index="2"<|sep|>'
    '<|open|>json type="object"<|sep|>{"q": "x<y", "n": [1]}<|close|>json<|sep|>'
    "<|close|>call<|sep|>"
)
CALL_EMPTY = '<|open|>call tool="ping" index="3"<|sep|><|close|>call<|sep|>'


def tools_output(*calls: str, response: str = "Checking.") -> str:
    return (
        f"plan<|close|>think<|sep|><|open|>response<|sep|>{response}<|close|>response<|sep|>"
        f"<|open|>tools<|sep|>{''.join(calls)}<|close|>tools<|sep|>"
        "<|close|>message<|sep|><|end_of_msg|>"
    )


def test_tool_calls_typed_json_block_and_empty() -> None:
    r = parse(ids(tools_output(CALL_TYPED, CALL_JSON, CALL_EMPTY)))
    expect_text(r, "plan", "Checking.")
    calls = r.summary[2]
    assert [(c.index, c.name, c.complete) for c in calls] == [
        (0, 'get"weather', True),
        (1, "a&quot;b", True),
        (2, "ping", True),
    ]
    assert json.loads(calls[0].arguments) == TYPED_ARGS
    assert calls[1].arguments == '{"q": "x<y", "n": [1]}'
    assert calls[2].arguments == "{}"
    for call in calls:
        assert r.calls[call.index] == (call.name, call.arguments, True)
    assert sum(isinstance(e, ToolCallStart) for e in r.events) == 3


def test_typed_values_a_grammar_holds_to_json_stream_as_written() -> None:
    """json_values (a tool grammar holds every typed value to JSON): a value streams a
    fragment per token instead of whole at its close, and the call's arguments are the same
    JSON, in every chunking."""
    held_call = CALL_TYPED.split('<|open|>argument key="bad"')[0] + "<|close|>call<|sep|>"
    out = ids(tools_output(held_call))
    streamed = run([[t] for t in out], json_values=True)
    buffered = run([[t] for t in out])
    expected = {k: v for k, v in TYPED_ARGS.items() if k not in ("bad", "nan")}
    for r in (streamed, buffered):
        check_consistent(r)
        assert json.loads(r.summary[2][0].arguments) == expected and r.summary[2][0].complete
    obj = '{"a": [1, 2], "b": "x"}'
    fragments = [e.fragment for e in streamed.events if isinstance(e, ToolCallArguments)]
    assert obj not in fragments and len(obj) <= len(fragments) - len(
        [e for e in buffered.events if isinstance(e, ToolCallArguments)])
    assert obj in [e.fragment for e in buffered.events if isinstance(e, ToolCallArguments)]
    assert key(run([out], json_values=True)) == key(streamed)


def test_two_calls_indices_and_streamed_fragments() -> None:
    r = run([[t] for t in ids(tools_output(CALL_EMPTY, CALL_TYPED, response=""))])
    assert [c.index for c in r.summary[2]] == [0, 1]
    assert r.summary[2][1].arguments == r.calls[1][1]
    frags = [e.fragment for e in r.events if isinstance(e, ToolCallArguments) and e.index == 1]
    assert len(frags) > 10  # streamed, not one blob
    assert r.summary[1] == ""


def test_string_values_with_json_specials_and_spelled_markers() -> None:
    value = 'say "hi" \\ back\\slash\nnew\tline </x> <|close|>argument<|sep|> end'
    out = (
        ids(
            'x<|open|>tools<|sep|><|open|>call tool="echo"<|sep|>'
            '<|open|>argument key="text" type="string"<|sep|>'
        )
        + spelled(value)
        + ids(
            '<|close|>argument<|sep|><|open|>argument key="k&quot;"<|sep|>v'
            "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
        )
    )
    for chunks in ([out], [[t] for t in out]):
        r = run(chunks)
        (call,) = r.summary[2]
        assert json.loads(call.arguments) == {"text": value, 'k"': "v"}
        assert call.arguments == r.calls[0][1]


def test_repeated_key_last_wins_in_summary() -> None:
    body = (
        '<|open|>call tool="f"<|sep|>'
        '<|open|>argument key="a" type="number"<|sep|>1<|close|>argument<|sep|>'
        '<|open|>argument key="a" type="number"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|>"
    )
    r = parse(ids(tools_output(body)))
    (call,) = r.summary[2]
    assert call.arguments == '{"a": 2}'
    assert r.calls[0][1] == '{"a": 1, "a": 2}'
    assert json.loads(r.calls[0][1]) == {"a": 2}


def test_tools_not_allowed_drops_the_section() -> None:
    r = parse(ids(tools_output(CALL_TYPED, CALL_JSON)), tools=False)
    expect_text(r, "plan", "Checking.")
    assert r.calls == {} and r.summary[2] == () and r.summary[3] is True
    assert not any(isinstance(e, ToolCallStart | ToolCallArguments) for e in r.events)


def test_think_straight_to_tools() -> None:
    r = parse(ids(f"plan<|open|>tools<|sep|>{CALL_EMPTY}<|close|>tools<|sep|>"))
    expect_text(r, "plan", "")
    assert r.summary[2] == (ToolCall(0, "ping", "{}", True),)


def test_unterminated_section_at_stop_string() -> None:
    # The engine stopped on <|close|>tools<|sep|> (trimmed): the message close never comes.
    r = parse(
        ids(f"a<|open|>response<|sep|>b<|close|>response<|sep|><|open|>tools<|sep|>{CALL_JSON}")
    )
    assert r.summary[2][0].complete is True


def test_cut_off_mid_call_is_incomplete() -> None:
    out = ids(
        '<|open|>tools<|sep|><|open|>call tool="f"<|sep|>'
        '<|open|>argument key="a" type="string"<|sep|>par'
    )
    r = parse(out)
    check_consistent(r)
    (call,) = r.summary[2]
    assert (call.name, call.arguments, call.complete) == ("f", '{"a": "par', False)
    assert not any(isinstance(e, ToolCallEnd) for e in r.events)
    typed = ids(
        '<|open|>tools<|sep|><|open|>call tool="f"<|sep|>'
        '<|open|>argument key="n" type="number"<|sep|>12'
    )
    assert parse(typed).summary[2] == (ToolCall(0, "f", '{"n": ', False),)


def test_malformed_call_structure_is_incomplete_not_invented() -> None:
    out = ids(
        '<|open|>tools<|sep|><|open|>call tool="f"<|sep|>'
        '<|open|>argument key="a"<|sep|>x<|close|>call<|sep|>'  # argument never closed
        f"{CALL_EMPTY}<|close|>tools<|sep|>"
    )
    r = parse(out)
    check_consistent(r)
    assert [(c.name, c.complete) for c in r.summary[2]] == [("f", False), ("ping", True)]


@pytest.mark.parametrize("tail", ["<|open|>resp", "<|open|>", "<|close|>think", "<|close|>"])
def test_cut_off_mid_header_leaks_nothing(tail: str) -> None:
    r = parse(ids("reason<|close|>think<|sep|><|open|>response<|sep|>answer" + tail))
    expect_text(r, "reason", "answer")
    r = parse(ids("reason" + tail))
    expect_text(r, "reason", "")


def test_oversized_header_becomes_text() -> None:
    long = "a" * (HEADER_CAP + 10)
    r = run([[t] for t in ids(f"<|open|>response<|sep|>x<|open|>{long}<|sep|>y")], thinking=False)
    expect_text(r, "", f"x{long}y")
    r = parse(
        ids("x<|open|>") + [ord("b")] * 10_000 + ids("<|close|>response<|sep|>"), thinking=False
    )
    expect_text(r, "", "x" + "b" * 10_000)


# -- chunking invariance and random input -------------------------------------------------------

SAMPLES = [
    ids(tools_output(CALL_TYPED, CALL_JSON, CALL_EMPTY)),
    wids("北京😀<|close|>think<|sep|><|open|>response<|sep|>hello é😀<|close|>response<|sep|>"),
    ids("skip 😀<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"),
    ids(
        'x<|open|>tools<|sep|><|open|>call tool="f"<|sep|>'
        '<|open|>argument key="a" type="object"<|sep|>{"k": "😀"}<|close|>argument<|sep|>'
        '<|open|>argument key="s"<|sep|>q"\\😀'
    ),
]


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
@pytest.mark.parametrize("thinking", [True, False])
def test_every_chunking_gives_the_same_result(sample: int, thinking: bool) -> None:
    out = SAMPLES[sample]
    whole = run([out], thinking=thinking)
    check_consistent(whole)
    assert key(run([[t] for t in out], thinking=thinking)) == key(whole)
    for i in range(len(out) + 1):
        assert key(run([out[:i], out[i:]], thinking=thinking)) == key(whole), i


_PIECES = [
    ids(p)
    for p in (
        "<|open|>",
        "<|close|>",
        "<|sep|>",
        "<|end_of_msg|>",
        "think",
        "response",
        "tools",
        "message",
        "call",
        "argument",
        "json",
        ' tool="f&quot;"',
        ' key="k"',
        ' key="j"',
        ' type="string"',
        ' type="number"',
        ' type="object"',
        ' type="boolean"',
        "1",
        "{}",
        '{"a": 1}',
        '"',
        "\\",
        "\n",
        " ",
        "ab",
        "<|close|>think<|sep|>",
        "<|open|>response<|sep|>",
        "<|close|>response<|sep|>",
        "<|open|>tools<|sep|>",
        '<|open|>call tool="f"<|sep|>',
        "<|close|>call<|sep|>",
        '<|open|>argument key="k" type="string"<|sep|>',
        '<|open|>json type="object"<|sep|>',
        '<|open|>argument key="n" type="number"<|sep|>',
        "<|close|>argument<|sep|>",
        "<|close|>json<|sep|>",
        "<|close|>tools<|sep|>",
        # Whole elements, so random sequences often hold complete calls.
        '<|open|>tools<|sep|><|open|>call tool="f"<|sep|>',
        '<|open|>argument key="s" type="string"<|sep|>v"\\\n<|close|>argument<|sep|>',
        '<|open|>argument key="o" type="object"<|sep|>{"a": [1]}<|close|>argument<|sep|>',
        '<|open|>argument key="s" type="number"<|sep|>x<|close|>argument<|sep|>',
        '<|open|>json type="object"<|sep|>{"j": 1}<|close|>json<|sep|>',
        CALL_TYPED,
        CALL_JSON,
        CALL_EMPTY,
    )
] + [[OTHER_SPECIAL], [2000], [2002], [2004], list("😀".encode()), list("é".encode())[:1]]

token_lists = st.lists(st.sampled_from(_PIECES), max_size=40).map(lambda ps: [*chain(*ps)])


def check_random(out: list[int], cuts: list[int], *, thinking: bool, tools: bool) -> Run:
    whole = run([out], thinking=thinking, tools=tools)
    check_consistent(whole)
    # No input byte spells "<|" (only control ids and the other special would): none may show.
    texts = [whole.reasoning, whole.content, *(c.arguments for c in whole.summary[2])]
    assert not any("<|" in t or "reserved" in t for t in texts)
    if not tools:
        assert whole.calls == {}
    cuts = sorted(cuts)
    chunks = [out[a:b] for a, b in zip([0, *cuts], [*cuts, len(out)], strict=True)]
    assert key(run(chunks, thinking=thinking, tools=tools)) == key(whole)
    assert key(run([[t] for t in out], thinking=thinking, tools=tools)) == key(whole)
    return whole


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(out=token_lists, thinking=st.booleans(), tools=st.booleans(), data=st.data())
def test_random_structure_never_raises_and_is_consistent(
    out: list[int], thinking: bool, tools: bool, data: st.DataObject
) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(out)), max_size=4))
    check_random(out, cuts, thinking=thinking, tools=tools)


def test_seeded_random_structure_reaches_complete_calls() -> None:
    # Hypothesis favours short inputs; uniform draws of up to 40 pieces also reach deep states.
    rng = random.Random(20240601)
    complete = incomplete = 0
    for i in range(300):
        out = [t for p in rng.choices(_PIECES, k=rng.randint(0, 40)) for t in p]
        cuts = [rng.randint(0, len(out)) for _ in range(3)]
        whole = check_random(out, cuts, thinking=i % 2 == 0, tools=i % 3 != 0)
        complete += sum(c.complete for c in whole.summary[2])
        incomplete += sum(not c.complete for c in whole.summary[2])
    assert complete > 20 and incomplete > 20  # the sampler does exercise both


@settings(max_examples=200, deadline=None)
@given(
    out=st.lists(
        st.sampled_from([*range(256), OPEN, CLOSE, SEP, EOM, OTHER_SPECIAL, 2000, 2002]),
        max_size=200,
    ),
    thinking=st.booleans(),
)
def test_random_ids_never_raise(out: list[int], thinking: bool) -> None:
    whole = run([out], thinking=thinking)
    check_consistent(whole)
    assert key(run([[t] for t in out], thinking=thinking)) == key(whole)
