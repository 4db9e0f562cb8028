"""What the reference engine tells its observer (tracing and metrics: telemetry.py), on the
engine thread: the hooks, and the copy of its state after each step. The observer reads these
and never reaches back into the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from serve_app.engines.reference.sequence import Sequence


class EngineObserver(Protocol):
    """Hooks for tracing and metrics, called on the engine thread. Times are time.time_ns()."""

    def on_queued(self, seq: Sequence, at_ns: int) -> None: ...

    def on_admitted(self, seq: Sequence, at_ns: int) -> None: ...

    def on_prefill_chunk(self, seq: Sequence, start: int, end: int, start_ns: int,
                         end_ns: int) -> None: ...

    def on_decode_step(self, seq: Sequence, drafted: int, accepted: int, committed: int,
                       start_ns: int, end_ns: int, speculative: bool) -> None:
        """One decode step; with speculation, one verify of `drafted` drafts."""

    def on_finished(self, seq: Sequence, at_ns: int) -> None: ...

    def on_step(self, report: StepReport) -> None:
        """After every step: what the engine reports of itself then (a copy)."""


@dataclass(frozen=True)
class StepReport:
    """The engine's state after a step, handed to the observer: telemetry reads this copy and
    never reaches back into the engine."""

    waiting: int
    running: int
    capacity: dict[str, int]  # EngineCore.capacity()
    prefix_cache: dict[str, Any]  # EngineCore.prefix_cache_stats(); empty without one
    grammar: dict[str, Any]  # EngineCore.grammar_stats(); empty without a compiler
    spec_accept_rate: float | None  # None until a draft was proposed
