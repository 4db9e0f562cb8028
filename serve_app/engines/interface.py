"""The engine interface: every call the target replica (serve_app/serving/target.py) makes on
an engine, whatever the backend (the reference engine, SGLang).

Required calls are abstract. Optional capabilities are explicit, as in Ray Serve LLM's
`LLMEngine`: a backend says what it supports (`supports_handoff`, `supports_migration`), the base class answers for
one that does not (`prefill` / `adopt` raise `Unsupported`; `prefix_events` is None), and the
server asks the declaration, never `hasattr`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Protocol

from serve_app.protocol.generation import GenerateRequest, RequestOutput, SamplingParams


class Unsupported(NotImplementedError):
    """The engine does not have this optional capability (its `supports_*` says so)."""


class Handoff(Protocol):
    """What a prefill engine's `prefill` gives a decode engine's `adopt`: the reference
    engine's RequestHandoff (the request and its caches), or SGLang's SGLangHandoff (where its
    prefill server waits for the decode server). Both carry the request itself, which the
    decode replica reserves before adopting."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class Engine(ABC):
    """One engine = one target replica, whatever the backend."""

    # Prefill/decode disaggregation: `prefill` on a prefill replica, `adopt` on a decode one.
    supports_handoff: ClassVar[bool] = False
    # Running requests move off a leaving replica: `evacuate` here, `adopt` on another.
    supports_migration: ClassVar[bool] = False

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream committed tokens; the last event has finished=True and the spec stats (or
        is a `Moved`, after `evacuate`).
        Raises ValueError for a request the engine can never serve (it is not queued).
        Closing the stream early aborts the request and frees what it holds."""

    @abstractmethod
    async def health(self, timeout_s: float) -> None:
        """Run a real 1-token generation through every rank; raise EngineUnavailable if it
        fails or times out."""

    @abstractmethod
    def problem(self) -> str | None:
        """Why the engine cannot serve right now (loop dead, a step past the watchdog, a
        recorded failure), or None. Cheap: no generation."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for /metrics and operators: running, waiting, finished, the speculative
        totals (SGLang's names), and the backend's own."""

    @abstractmethod
    def capacity(self) -> dict[str, int]:
        """KV tokens: kv_tokens_total, kv_tokens_free (and used/reserved/evictable where
        known); state slots, one per running request: state_slots_total, state_slots_used (and
        free/reserved where known). Without state_slots_total the router treats slots as
        unbounded."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop: every open stream ends with EngineUnavailable, the ranks are let go."""

    # --- optional: disaggregation (supports_handoff) and migration (supports_migration) ------

    async def prefill(self, request: GenerateRequest) -> Handoff | RequestOutput:
        """Prefill only (a prefill replica): the request's hand-over to a decode engine, or
        its final output when it ended on its first token."""
        raise Unsupported(f"{type(self).__name__} cannot hand a request over")

    def adopt(self, handoff: Handoff) -> AsyncIterator[RequestOutput]:
        """Decode a request another engine prefilled (or ran and `evacuate`d), streaming
        what its client has not been sent yet."""
        raise Unsupported(f"{type(self).__name__} cannot adopt a request")

    async def evacuate(self) -> int:
        """Its replica is leaving (scaled down, restarted): every client request leaves its
        `generate` / `adopt` stream with a `Moved` (its hand-over, or nothing for one that
        has not started), for its caller to continue elsewhere; returns how many. Without
        the capability the replica's requests finish where they are, within the drain
        timeout."""
        raise Unsupported(f"{type(self).__name__} cannot move its requests")

    # --- optional: the prefix cache's events, which the router's prefix index follows ----------

    def prefix_events(self, since: int) -> dict[str, Any] | None:
        """The prefix cache's events from `since` on: {next, events, held (every block it
        holds, only when events were lost)}; None: the engine keeps no prefix cache that the
        router can follow."""
        return None
