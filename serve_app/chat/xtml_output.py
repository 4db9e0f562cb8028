"""Kimi K3's XTML output, parsed from token ids into reasoning, content and tool calls.

K3 writes structure with four control tokens (`<|open|>`, `<|close|>`, `<|sep|>`,
`<|end_of_msg|>`), each one token id; tag names and attributes are ordinary text between them
(docs/chat-format.md). Structure is decided from the ids alone: text that merely
spells `<|open|>` is text and can never forge a channel or a tool call, and no marker ever
reaches reasoning, content or arguments.

Decisions worth knowing (none of them raises; any id sequence parses):
- Unknown tags, and known tags where they do not belong (`<|open|>think<|sep|>` while already
  thinking, a second `<|open|>response<|sep|>`), are dropped as markers; their inner text stays
  in the channel they sit in.
- Text outside any channel (after `<|close|>think<|sep|>` or `<|close|>response<|sep|>`, between
  calls, inside a call but outside a value) is dropped.
- `<|close|>message<|sep|>` and `<|end_of_msg|>` end the message: everything after is ignored.
- A header (the text between `<|open|>`/`<|close|>` and `<|sep|>`) interrupted by another control
  id is dropped. One longer than HEADER_CAP bytes is not a tag: its bytes, and what follows,
  become text of the current channel (not lost, and the marker itself never shows). A header
  still pending at finish() is dropped: it is a marker cut by max_tokens (`<|open|>resp`).
- A call whose structure breaks (a value not closed before `<|close|>call<|sep|>`, a new call, the
  section or message closing inside it, or the end of generation) stays in `tool_calls` with
  `complete=False` and gets no ToolCallEnd; no closing fragment is invented.
- A call body is either typed arguments or one json block, whichever comes first; an element of
  the other kind (or a second json block) is dropped, so the arguments stay one JSON value.
  An argument without `key` uses ""; one without `type` is a string (as SGL); any type but
  `string` is decoded as JSON at its close (or, when the request's grammar holds it to JSON,
  passed through as it streams). A json block's text is passed through unchecked.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto

HEADER_CAP = 4096  # bytes; real headers are a tag name and a few short attributes

_ATTR = re.compile(r'\s([^\s="]+)="([^"]*)"')


@dataclass(frozen=True)
class XTMLControls:
    """The four control token ids."""

    open: int
    close: int
    sep: int
    end_of_msg: int


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0-based among the calls delivered in this output
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    fragment: str  # the fragments of one call concatenate to its arguments JSON


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


OutputEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArguments | ToolCallEnd


@dataclass(frozen=True)
class ToolCall:
    index: int
    name: str
    arguments: str
    complete: bool  # False: cut off or malformed; the caller decides (finish_reason "length")


class _Ctx(Enum):
    """Where text goes right now."""

    REASONING = auto()  # the think channel the prompt opened
    CONTENT = auto()  # the response channel
    OUTSIDE = auto()  # between channels: stray text is dropped
    TOOLS = auto()  # a tools section, outside any call
    DROPPED_TOOLS = auto()  # a tools section while tools are not allowed: all dropped
    CALL = auto()  # inside a call, outside any value
    ARG_STRING = auto()  # a string argument: streamed as a JSON string
    ARG_VALUE = auto()  # a typed argument: buffered, decoded as JSON at its close
    ARG_JSON = auto()  # a typed argument the request's grammar holds to JSON: streamed as is
    JSON_BLOCK = auto()  # a raw json body: streamed as is
    DONE = auto()  # the message ended: everything is ignored


_IN_CALL = frozenset({_Ctx.CALL, _Ctx.ARG_STRING, _Ctx.ARG_VALUE, _Ctx.ARG_JSON,
                      _Ctx.JSON_BLOCK})


@dataclass
class _Call:
    index: int
    name: str
    fragments: list[str] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    repeated: bool = False  # a key came twice: the summary re-serializes (last wins)
    body: str | None = None  # "args" or "json", fixed by the first body element
    json_text: bool = False  # the json block held non-blank text
    complete: bool = False


def _parse_header(header: str) -> tuple[str, dict[str, str]]:
    """NAME and attributes of a tag header. The name must match exactly; attributes are read
    leniently (junk between them is skipped) and unescaped in the renderer's reverse order."""
    name, _, rest = header.partition(" ")
    attrs = {
        key: value.replace("&quot;", '"').replace("&amp;", "&")
        for key, value in _ATTR.findall(" " + rest)
    }
    return name, attrs


def _reject_constant(name: str) -> float:
    raise ValueError(name)  # NaN/Infinity would make the arguments invalid JSON


def _json_value(text: str) -> str:
    """A typed argument's value text as JSON; a value that does not decode stays a string."""
    try:
        return json.dumps(json.loads(text, parse_constant=_reject_constant), ensure_ascii=False)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return json.dumps(text, ensure_ascii=False)


class XTMLOutputParser:
    """Feed generated ids in any chunking; get stream events; after finish(), a summary
    (`reasoning`, `content`, `tool_calls`, `dropped_tools`). O(total tokens)."""

    def __init__(
        self,
        controls: XTMLControls,
        token_bytes: Callable[[int], bytes],
        *,
        thinking: bool,
        tools_allowed: bool,
        is_special: Callable[[int], bool] | None = None,
        json_values: bool = False,
    ) -> None:
        """`json_values`: the request's grammar holds every typed argument value to JSON (a
        tool grammar, either engine), so values stream as they are written; otherwise each is
        buffered to its close, where one that is not JSON becomes a string (an agent waits
        for a long typed value whole: vllm #50604)."""
        self._controls = controls
        self._json_values = json_values
        self._control_ids = frozenset(
            (controls.open, controls.close, controls.sep, controls.end_of_msg)
        )
        self._token_bytes = token_bytes
        self._is_special = is_special
        self._tools_allowed = tools_allowed
        # The prompt ends inside think (thinking) or response (not): that is where output starts.
        self._ctx = _Ctx.REASONING if thinking else _Ctx.CONTENT
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = bytearray()  # text bytes not yet decoded
        self._header: bytearray | None = None  # collecting a tag header
        self._header_opens = False  # the header began with <|open|> (else <|close|>)
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[_Call] = []
        self._call: _Call | None = None
        self._value: list[str] = []  # the typed argument being buffered
        self._events: list[OutputEvent] = []
        self._finished = False
        self.dropped_tools = False

    # -- summary --------------------------------------------------------------------------

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def tool_calls(self) -> list[ToolCall]:
        calls = []
        for call in self._calls:
            arguments = "".join(call.fragments)
            if call.repeated and call.complete:
                # The stream carried both copies of the key; re-serialize so the last one wins
                # (json.loads keeps the last). Our own fragments always decode.
                with contextlib.suppress(ValueError, RecursionError):
                    arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
            calls.append(ToolCall(call.index, call.name, arguments, call.complete))
        return calls

    # -- input ----------------------------------------------------------------------------

    def feed(self, token_ids: Sequence[int]) -> list[OutputEvent]:
        if self._finished:
            return []
        controls = self._controls
        for tid in token_ids:
            if self._ctx is _Ctx.DONE:
                break
            if tid in self._control_ids:
                # Text never runs across a control id: flush it (a split character is cut here).
                self._flush_text(final=True)
                if tid == controls.sep:
                    if self._header is not None:  # a <|sep|> with no header is dropped
                        header, self._header = self._header, None
                        self._on_tag(self._header_opens, header.decode("utf-8", "replace"))
                elif tid == controls.end_of_msg:
                    self._header = None
                    self._call = None
                    self._ctx = _Ctx.DONE
                else:  # open/close; a header it interrupts is dropped
                    self._header = bytearray()
                    self._header_opens = tid == controls.open
            elif self._is_special is not None and self._is_special(tid):
                continue  # other special ids are not text
            elif self._header is not None:
                self._header += self._token_bytes(tid)
                if len(self._header) > HEADER_CAP:  # not a tag: release it as text
                    self._pending += self._header
                    self._header = None
            else:
                self._pending += self._token_bytes(tid)
        self._flush_text(final=False)
        return self._take_events()

    def finish(self) -> list[OutputEvent]:
        """End of generation: flush text, drop a partial header; a call still open stays
        incomplete."""
        if self._finished:
            return []
        if self._ctx is not _Ctx.DONE:
            self._flush_text(final=True)
        self._header = None
        self._call = None
        self._ctx = _Ctx.DONE
        self._finished = True
        return self._take_events()

    # -- internals ------------------------------------------------------------------------

    def _take_events(self) -> list[OutputEvent]:
        events, self._events = self._events, []
        return events

    def _flush_text(self, *, final: bool) -> None:
        # One incremental decoder across tokens, so a character split over tokens (or feeds)
        # comes out once, whole.
        if not self._pending and not final:
            return
        text = self._decoder.decode(bytes(self._pending), final)
        self._pending.clear()
        if text:
            self._on_text(text)

    def _on_text(self, text: str) -> None:
        ctx = self._ctx
        if ctx is _Ctx.REASONING:
            self._reasoning.append(text)
            self._events.append(ReasoningDelta(text))
        elif ctx is _Ctx.CONTENT:
            self._content.append(text)
            self._events.append(ContentDelta(text))
        elif ctx is _Ctx.ARG_STRING:
            # JSON escapes per character, so escaped chunks concatenate to the escaped whole.
            self._fragment(json.dumps(text, ensure_ascii=False)[1:-1])
        elif ctx is _Ctx.ARG_VALUE:
            self._value.append(text)
        elif ctx is _Ctx.ARG_JSON:
            self._fragment(text)
        elif ctx is _Ctx.JSON_BLOCK:
            assert self._call is not None
            self._call.json_text = self._call.json_text or not text.isspace()
            self._fragment(text)
        # Anywhere else the text is outside a channel or in a dropped section: not output.

    def _fragment(self, fragment: str) -> None:
        assert self._call is not None
        self._call.fragments.append(fragment)
        self._events.append(ToolCallArguments(self._call.index, fragment))

    def _on_tag(self, opens: bool, header: str) -> None:
        name, attrs = _parse_header(header)
        ctx = self._ctx
        if ctx in _IN_CALL:
            if not self._on_call_tag(opens, name, attrs):
                return
            ctx = self._ctx  # the call was abandoned: handle the tag in the section
        if not opens and name == "message":
            if ctx is _Ctx.REASONING:
                self._skip_think()
            self._ctx = _Ctx.DONE
        elif ctx is _Ctx.REASONING:
            if not opens and name == "think":
                self._ctx = _Ctx.OUTSIDE
            elif not opens and name == "response":
                self._skip_think()
                self._ctx = _Ctx.OUTSIDE
            elif opens and name in ("response", "tools"):
                self._open_channel(name)
        elif ctx is _Ctx.CONTENT:
            if not opens and name == "response":
                self._ctx = _Ctx.OUTSIDE
            elif opens and name == "tools":
                self._open_channel(name)
        elif ctx is _Ctx.OUTSIDE:
            if opens and name in ("response", "tools"):
                self._open_channel(name)
        elif ctx in (_Ctx.TOOLS, _Ctx.DROPPED_TOOLS):
            if not opens and name == "tools":
                self._ctx = _Ctx.OUTSIDE
            elif opens and name == "call" and ctx is _Ctx.TOOLS:
                call = _Call(len(self._calls), attrs.get("tool", ""))
                self._calls.append(call)
                self._call = call
                self._ctx = _Ctx.CALL
                self._events.append(ToolCallStart(call.index, call.name))

    def _open_channel(self, name: str) -> None:
        if name == "response":
            self._ctx = _Ctx.CONTENT
        elif self._tools_allowed:
            self._ctx = _Ctx.TOOLS
        else:
            # Never expose raw XTML (sglang #39583): the section is parsed only to find its end.
            self._ctx = _Ctx.DROPPED_TOOLS
            self.dropped_tools = True

    def _skip_think(self) -> None:
        # The model answered without a think channel (seen on ~1M-token prompts): the
        # reasoning text was the answer. The stream already sent it as reasoning deltas; we send
        # it again, whole, as one content delta, so the answer in content is complete and
        # non-empty (clients and KVV check content), and the summary reports it as content only.
        text = "".join(self._reasoning)
        self._reasoning = []
        if text:
            self._content.append(text)
            self._events.append(ContentDelta(text))

    def _on_call_tag(self, opens: bool, name: str, attrs: dict[str, str]) -> bool:
        """A tag inside a call. True when it ended (abandoned) the call and the section must
        handle it too."""
        call = self._call
        assert call is not None
        ctx = self._ctx
        if (opens and name == "call") or (not opens and name in ("tools", "message")):
            self._call = None  # malformed: the call stays incomplete
            self._ctx = _Ctx.TOOLS
            return True
        if not opens and name == "call":
            if ctx is _Ctx.CALL:
                if call.body == "args":
                    self._fragment("}")
                elif not call.json_text:
                    self._fragment("{}")  # no body, or a blank json block
                call.complete = True
                self._events.append(ToolCallEnd(call.index))
            self._call = None  # a value left open: incomplete
            self._ctx = _Ctx.TOOLS
        elif ctx is _Ctx.CALL and opens and name == "argument" and call.body != "json":
            key = attrs.get("key", "")
            call.repeated = call.repeated or key in call.keys
            call.keys.add(key)
            prefix = ("{" if call.body is None else ", ") + json.dumps(key, ensure_ascii=False)
            call.body = "args"
            if attrs.get("type", "string") == "string":
                self._fragment(prefix + ': "')
                self._ctx = _Ctx.ARG_STRING
            else:
                self._fragment(prefix + ": ")
                self._value = []
                self._ctx = _Ctx.ARG_JSON if self._json_values else _Ctx.ARG_VALUE
        elif ctx is _Ctx.CALL and opens and name == "json" and call.body is None:
            call.body = "json"
            self._ctx = _Ctx.JSON_BLOCK
        elif not opens and name == "argument" and ctx is _Ctx.ARG_STRING:
            self._fragment('"')
            self._ctx = _Ctx.CALL
        elif not opens and name == "argument" and ctx is _Ctx.ARG_VALUE:
            self._fragment(_json_value("".join(self._value)))
            self._value = []
            self._ctx = _Ctx.CALL
        elif not opens and (name, ctx) in (("argument", _Ctx.ARG_JSON), ("json", _Ctx.JSON_BLOCK)):
            self._ctx = _Ctx.CALL
        return False
