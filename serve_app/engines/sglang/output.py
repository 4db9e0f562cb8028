"""SGLang's streamed dicts -> the engine interface's RequestOutput deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serve_app.engines.spec_stats import sglang_request_spec
from serve_app.protocol.generation import RequestOutput


class RequestAborted(ValueError):
    """SGLang finished the request with an abort (too long, or refused by the scheduler)."""


@dataclass
class OutputTracker:
    """Turns one request's stream of SGLang dicts into RequestOutput deltas. Handles both
    streaming modes: incremental (each chunk a delta) and cumulative (SGLang's default)."""

    request_id: str
    prompt_tokens: int
    speculative: bool
    incremental: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""

    def update(self, chunk: dict[str, Any]) -> RequestOutput:
        meta = chunk.get("meta_info") or {}
        ids = list(chunk.get("output_ids") or [])
        text = chunk.get("text") or ""
        if self.incremental:
            new_ids, new_text = ids, text
        else:
            new_ids, new_text = ids[len(self.token_ids):], text[len(self.text):]
        self.token_ids += new_ids
        self.text += new_text
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind == "abort":
            raise RequestAborted(f"SGLang aborted request {self.request_id}: "
                                 f"{reason.get('message') if isinstance(reason, dict) else ''}")
        finished = kind is not None
        return RequestOutput(
            request_id=self.request_id,
            token_ids=new_ids,
            text=new_text,
            finished=finished,
            finish_reason=kind,
            prompt_tokens=int(meta.get("prompt_tokens", self.prompt_tokens)),
            completion_tokens=int(meta.get("completion_tokens", len(self.token_ids))),
            spec=sglang_request_spec(meta, self.speculative) if finished else None,
            # SGLang's radix-cache hit for this request (meta_info, tokenizer_manager.py).
            cached_tokens=int(meta.get("cached_tokens") or 0),
        )


