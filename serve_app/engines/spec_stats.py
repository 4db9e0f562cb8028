"""Speculative-decoding statistics: the one definition both backends use.

Named and defined as SGLang defines them: `spec_accept_length` = completion tokens (the
prefill-sampled first one included) per verify step, `spec_accept_rate` = accepted drafts /
proposed drafts, `spec_correct_drafts_histogram[i]` = verify steps that accepted exactly i drafts
(the bonus token excluded). The reference engine records each verify step; the SGLang backend
reads the same counts from SGLang's per-request `meta_info`. A leaf module: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# What the two ratios read when there is nothing to divide by.
NO_VERIFY_ACCEPT_LENGTH = 1.0
NO_PROPOSAL_ACCEPT_RATE = 0.0


@dataclass
class SpecStats:
    """Speculative counts of one request, or summed over many (`merge`)."""

    verify_ct: int = 0
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    # histogram[i] = verify steps that accepted exactly i drafts (bonus excluded)
    correct_drafts_histogram: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        """One verify step of `proposed` drafts, `accepted` of them kept."""
        self.verify_ct += 1
        self.proposed_drafts += proposed
        self.accepted_drafts += accepted
        self._add_histogram([0] * accepted + [1])

    def merge(self, other: SpecStats) -> None:
        self.verify_ct += other.verify_ct
        self.proposed_drafts += other.proposed_drafts
        self.accepted_drafts += other.accepted_drafts
        self._add_histogram(other.correct_drafts_histogram)

    def _add_histogram(self, counts: list[int]) -> None:
        hist = self.correct_drafts_histogram
        for i, n in enumerate(counts):
            while len(hist) <= i:
                hist.append(0)
            hist[i] += n

    def accept_length(self, completion_tokens: int) -> float:
        return completion_tokens / self.verify_ct if self.verify_ct else NO_VERIFY_ACCEPT_LENGTH

    @property
    def accept_rate(self) -> float:
        return (self.accepted_drafts / self.proposed_drafts
                if self.proposed_drafts else NO_PROPOSAL_ACCEPT_RATE)

    def as_dict(self, completion_tokens: int, *, accept_length: float | None = None,
                accept_rate: float | None = None) -> dict[str, Any]:
        """Under SGLang's names (RequestOutput.spec, the engines' stats()). `accept_length` /
        `accept_rate`: an engine's own per-request values (SGLang's meta_info), reported as
        given rather than recomputed from the counts."""
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": (self.accept_length(completion_tokens)
                                   if accept_length is None else accept_length),
            "spec_accept_rate": self.accept_rate if accept_rate is None else accept_rate,
            "spec_correct_drafts_histogram": list(self.correct_drafts_histogram),
            "spec_proposed_drafts": self.proposed_drafts,
            "spec_accepted_drafts": self.accepted_drafts,
        }

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> SpecStats:
        """The counts of an `as_dict` result (a finished RequestOutput.spec)."""
        return cls(int(spec["spec_verify_ct"]), int(spec["spec_proposed_drafts"]),
                   int(spec["spec_accepted_drafts"]),
                   list(spec["spec_correct_drafts_histogram"]))

    @classmethod
    def from_sglang_meta(cls, meta: Mapping[str, Any]) -> SpecStats:
        """The counts in one SGLang request's `meta_info` (its own names)."""
        return cls(int(meta.get("spec_verify_ct", 0)), int(meta.get("spec_num_proposed_drafts", 0)),
                   int(meta.get("spec_num_correct_drafts", 0)),
                   list(meta.get("spec_correct_drafts_histogram") or []))


def sglang_request_spec(meta: Mapping[str, Any], speculative: bool) -> dict[str, Any] | None:
    """SGLang's per-request `meta_info` statistics under the names the reference backend uses;
    the two ratios are SGLang's own. SGLang leaves them out when no verify step ran (e.g. a
    1-token answer): then the empty statistics, or None without speculation."""
    if "spec_verify_ct" not in meta:
        return SpecStats().as_dict(0) if speculative else None
    return SpecStats.from_sglang_meta(meta).as_dict(
        0,
        accept_length=float(meta.get("spec_accept_length", NO_VERIFY_ACCEPT_LENGTH)),
        accept_rate=float(meta.get("spec_accept_rate", NO_PROPOSAL_ACCEPT_RATE)),
    )


@dataclass
class EngineTotals:
    """A replica's totals over its finished requests."""

    requests_finished: int = 0
    requests_failed: int = 0  # aborted alone by a fault in their own processing
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    spec_completion_tokens: int = 0  # completion tokens of the requests in `spec`

    def add_finished(self, prompt_tokens: int, completion_tokens: int,
                     spec: SpecStats | None) -> None:
        """One finished request; `spec`: its statistics when it ran speculatively."""
        self.requests_finished += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if spec is not None:
            self.spec.merge(spec)
            self.spec_completion_tokens += completion_tokens

    def spec_dict(self) -> dict[str, Any]:
        return self.spec.as_dict(self.spec_completion_tokens)

    def stats(self, running: int, speculative: bool) -> dict[str, Any]:
        """An engine's `stats()`, the same keys for both backends (each adds its own)."""
        stats: dict[str, Any] = {
            "requests_finished": self.requests_finished,
            "requests_failed": self.requests_failed,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "running": running,
            "speculative": speculative,
        }
        if speculative:
            stats |= self.spec_dict()
        return stats
