"""The engine-neutral types of a generation: token ids and sampling parameters in,
committed-token events out, and the two failures an engine reports. Both backends take and
give these; the engine interface itself is serve_app/engines/interface.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from serve_app.protocol.grammar import GrammarSpec
from serve_app.protocol.media import ImageInput

# Which side of a disaggregated app an engine serves ("both": an aggregated one).
Role = Literal["both", "prefill", "decode"]

# What a torch.Generator accepts as a seed (manual_seed takes [-2^63, 2^64 - 1]).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 (or top_k 1) is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    # The output must match this (response_format, strict tools, tool_choice); None: free.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        """The one check of a request's sampling fields, for every backend: types and
        finiteness too (NaN < 0 is False, a bool is an int), each problem naming its field."""
        problems = []
        if not (_is_number(self.temperature) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            problems.append(f"temperature={self.temperature} must be a finite number >= 0")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be an int >= 0 (0 turns it off)")
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            problems.append(f"max_tokens={self.max_tokens} must be an int > 0")
        if self.seed is not None and not (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            problems.append(f"seed={self.seed} must be an int in [{SEED_MIN}, {SEED_MAX}]")
        if any(not isinstance(x, str) or not x for x in self.stop):
            problems.append("stop strings must be non-empty strings")
        if any(not is_int(t) for t in self.stop_token_ids):
            problems.append("stop_token_ids must be ints")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            problems.append("grammar must be a GrammarSpec")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        """Greedy: top_k 1, or a temperature below 1e-5 (vLLM's epsilon). Dividing logits by a
        smaller temperature (1e-38, a subnormal) leaves nothing but the argmax and overflows
        float32, so those are the argmax by definition rather than by arithmetic."""
        return self.temperature < 1e-5 or self.top_k == 1


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    spec: dict[str, Any] | None = None  # SGLang-named statistics, on the final output
    # Set (with finished=True, finish_reason="error") when the engine aborted this request
    # alone; a short message that is safe to show to the client (the traceback is logged).
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's usage field)
    # A hand-off request's prefill is done: it waits for the engine's `export` (no tokens here).
    prefilled: bool = False
    # grammar_budget close narrowed a committed token's choices so that a constrained answer
    # ended complete before max_tokens (on the final output; the response says so).
    grammar_closed: bool = False


@dataclass
class Prefilled:
    """A prefill replica's answer to `generate` in a disaggregated app: `handoff` is a Ray
    object reference (owned by the prefill replica's process) to what the decode side needs:
    the reference engine's RequestHandoff (the request prefilled and exported), or SGLang's
    bootstrap address and room (SGLangHandoff: its prefill server prefills and sends the
    caches itself once the decode server joins the room). The ingress passes the reference to
    a decode replica, which fetches it itself and streams the answer from its first token."""

    request_id: str
    handoff: Any  # ray.ObjectRef[RequestHandoff]


@dataclass
class Moved:
    """The last item of a stream whose replica is leaving (scaled down, restarted): the
    request goes on elsewhere. `handoff`: the engine's hand-over of the running request
    (the reference engine's RequestHandoff, sent inline: its replica, which would own an
    object-store copy, is about to exit); None for a request that had not started (no
    token out), which simply starts again. The caller's dispatcher sends it to another
    replica and the client's stream goes on (serving/dispatch.py)."""

    request_id: str
    handoff: Any = None


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams())
    # (namespace, actor name) of the ingress that sent it: the target aborts the request if
    # that actor dies (nobody is left to read the tokens).
    caller: tuple[str, str] | None = None
    # The target replica the router's admission stage chose (its Serve unique id), which the
    # deployment's ChosenReplicaRouter reads; None = any replica (Serve's own routing).
    replica: str | None = None
    # Whose request it is (the API key it used, else its address), for the per-client limits
    # of every admission stage it meets.
    client: str = ""
    # The prompt's images in prompt order, their pad runs already in prompt_ids (media.py).
    images: tuple[ImageInput, ...] = ()


class EngineUnavailable(RuntimeError):
    """The engine cannot serve (a rank died, a step hung past the watchdog, or it was shut
    down). Retryable: the ingress answers 503 with Retry-After. The message is shown to
    clients, so it never carries reprs, paths or addresses (those go to the log)."""


class RequestFailed(RuntimeError):
    """One request failed inside the engine (e.g. its sampling or stop checks raised); only
    that request was aborted, the engine and every other request carry on. The message is
    shown to clients: no reprs, paths or addresses."""
