"""A chat answer as OpenAI shapes: the message of a non-streaming response, the deltas of a
stream, and the finish reason, from the committed-token events an engine sends.

Two assemblers behind one interface: plain (a Jinja-template checkpoint: the engine's text is
the content) and XTML (K3: structure parsed from token ids, `xtml_output.py`, so the same
parser serves both engine backends).
"""

from __future__ import annotations

import secrets
from typing import Any, Protocol

from serve_app.chat.xtml_output import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
    XTMLOutputParser,
)
from serve_app.observability.logs import get_logger
from serve_app.protocol.generation import RequestOutput

logger = get_logger("chat")


class ChatOutput(Protocol):
    def feed(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The deltas (OpenAI `choices[].delta` bodies, no role) this event adds."""

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the OpenAI finish reason, once the engine is done."""

    def message(self) -> dict[str, Any]:
        """The whole assistant message (after finish), for a non-streaming response."""


class PlainOutput:
    def __init__(self) -> None:
        self.text = ""

    def feed(self, out: RequestOutput) -> list[dict[str, Any]]:
        self.text += out.text
        return [{"content": out.text}] if out.text else []

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        return [], finish_reason

    def message(self) -> dict[str, Any]:
        return {"role": "assistant", "content": self.text}


def new_call_id() -> str:
    # Opaque and unique within a conversation: the client matches results by it.
    return f"call_{secrets.token_hex(12)}"


class XTMLOutput:
    def __init__(self, parser: XTMLOutputParser, thinking: bool,
                 declared: frozenset[str]) -> None:
        self.parser = parser
        self.thinking = thinking
        self.declared = declared
        self.ids: dict[int, str] = {}

    def feed(self, out: RequestOutput) -> list[dict[str, Any]]:
        return self._deltas(self.parser.feed(out.token_ids))

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        deltas = self._deltas(self.parser.finish())
        if self.parser.dropped_tools:
            logger.info("the model wrote a tools section where no call may be delivered; "
                        "dropped")
        complete = [c for c in self.parser.tool_calls if c.complete]
        # tool_calls only for a natural stop after a complete call; max_tokens keeps "length".
        if finish_reason == "stop" and complete:
            finish_reason = "tool_calls"
        return deltas, finish_reason

    def message(self) -> dict[str, Any]:
        p = self.parser
        message: dict[str, Any] = {"role": "assistant", "content": p.content}
        if self.thinking:
            message["reasoning_content"] = p.reasoning or None
        calls = [{"id": self._id(c.index), "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}}
                 for c in p.tool_calls if c.complete]  # a call cut off by max_tokens is dropped
        if calls:
            message["tool_calls"] = calls
        return message

    def _id(self, index: int) -> str:
        return self.ids.setdefault(index, new_call_id())

    def _deltas(self, events: list[OutputEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []

        def text(key: str, value: str) -> None:
            if out and list(out[-1]) == [key]:  # coalesce a run of one kind into one delta
                out[-1][key] += value
            else:
                out.append({key: value})

        for e in events:
            if isinstance(e, ReasoningDelta) and e.text:
                text("reasoning_content", e.text)
            elif isinstance(e, ContentDelta) and e.text:
                text("content", e.text)
            elif isinstance(e, ToolCallStart):
                if e.name not in self.declared:
                    logger.warning("the model called %r, which the request did not declare",
                                   e.name[:64])
                out.append({"tool_calls": [{"index": e.index, "id": self._id(e.index),
                                            "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ToolCallArguments) and e.fragment:
                out.append({"tool_calls": [{"index": e.index,
                                            "function": {"arguments": e.fragment}}]})
        return out
