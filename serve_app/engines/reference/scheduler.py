"""Continuous batching with chunked prefill and KV admission.

Each step decodes every running request and spends at most `prefill_chunk_tokens` on prompts, so
a long prompt is prefilled over several steps while the decodes keep moving. No prompt takes more
than `max_prefill_tokens_per_request` of a step: the oldest prefilling request goes first (it is
never starved), then the others with the fewest prompt tokens left, so a short prompt that
arrives behind a long one gets its first token in a step or two instead of after the whole long
prefill. A request is admitted only when its worst case (prompt + max_tokens + one verify
window) fits in the KV tokens not yet promised to others, so a running request never runs out
of cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serve_app.config import prefill_cap
from serve_app.engines.reference.prefix_cache import PrefixCache
from serve_app.engines.reference.sequence import Sequence, Status
from serve_app.models.kv_capacity import KVCapacityError


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int

    @property
    def completes_prompt(self) -> bool:
        return self.end == len(self.seq.prompt_ids)


@dataclass
class StepPlan:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        capacity_tokens: int,
        max_batch_size: int,
        prefill_chunk_tokens: int,
        headroom_tokens: int,
        page_size: int = 1,
        max_prefill_tokens_per_request: int | None = None,
        state_slots: int | None = None,
        prefix: PrefixCache | None = None,
    ) -> None:
        """`max_prefill_tokens_per_request`: a prompt's share of one step's prefill budget;
        None = a quarter of `prefill_chunk_tokens` (at least 1). `state_slots`: the state
        pool's slots (None: no pool; the batch bound alone)."""
        cap = prefill_cap(prefill_chunk_tokens, max_prefill_tokens_per_request)
        self.capacity_tokens = capacity_tokens
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        # One slot per running request: the batch bound (and, for a target with per-request
        # state, its slot pool's size, when that is smaller).
        self.slots_total = max_batch_size if state_slots is None else min(max_batch_size,
                                                                         state_slots)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_prefill_tokens_per_request = cap
        self.headroom_tokens = headroom_tokens
        # The prefix cache (engines/reference/prefix_cache.py): a request's cached pages are
        # counted once, as pages running requests pin, not in each request's reservation.
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted: prefilling or decoding, in arrival order
        self._reserved: dict[str, int] = {}

    @property
    def reserved_tokens(self) -> int:
        return sum(self._reserved.values())

    def worst_case_tokens(self, seq: Sequence) -> int:
        """KV slots a request may come to hold, in whole pages (pages are not shared)."""
        tokens = seq.max_length(self.headroom_tokens)
        return -(-tokens // self.page_size) * self.page_size

    def check_fits(self, seq: Sequence) -> None:
        need = self.worst_case_tokens(seq)
        if need > self.capacity_tokens:
            raise KVCapacityError(
                f"request {seq.request_id} needs {need} KV tokens (prompt "
                f"{len(seq.prompt_ids)} + max_tokens {seq.params.max_tokens} + verify window "
                f"{self.headroom_tokens}) but the engine's KV capacity is {self.capacity_tokens}"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting requests in (FIFO, no overtaking) while their worst case fits."""
        admitted = []
        # A full batch admits nothing: no prefix probe on every step while it stays full.
        while self.waiting and len(self.running) < self.slots_total:
            seq = self.waiting[0]
            need = self.worst_case_tokens(seq)
            newly_pinned = 0
            if self.prefix is not None:
                hit, newly_pinned = self.prefix.probe(seq.prompt_keys)
                need -= hit
            if self._shortfall(need, newly_pinned) is not None:
                break
            self.waiting.popleft()
            self._run(seq, need, Status.PREFILLING)
            admitted.append(seq)
        return admitted

    def adopt(self, seq: Sequence) -> None:
        """A request prefilled elsewhere joins the running batch as decoding, if its worst
        case fits now (a hand-over is never queued: the sender keeps it until a decode engine
        has room). Raises KVCapacityError when it does not."""
        self.check_fits(seq)
        need = self.worst_case_tokens(seq)
        short = self._shortfall(need)
        if short is not None:
            raise KVCapacityError(f"request {seq.request_id} cannot be adopted: {short}")
        self._run(seq, need, Status.DECODING)

    def _shortfall(self, need: int, newly_pinned: int = 0) -> str | None:
        """The one admission rule, for a request prefilled here or adopted: a free slot, and
        its `need` (worst case less its prefix-cache hit) within the KV tokens not yet
        promised to running requests nor pinned by the prefix cache (its own new pins,
        `newly_pinned`, included). None when it fits, else what is short."""
        if len(self.running) >= self.slots_total:
            return f"all {self.slots_total} request slots are in use"
        pinned = (self.prefix.pinned_tokens if self.prefix is not None else 0) + newly_pinned
        free = self.capacity_tokens - self.reserved_tokens - pinned
        if need > free:
            return f"it needs {need} KV tokens; {free} are not promised"
        return None

    def _run(self, seq: Sequence, need: int, status: Status) -> None:
        self._reserved[seq.request_id] = need
        seq.status = status
        self.running.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        plan.decode = [s for s in self.running if s.status is Status.DECODING]
        prefilling = [s for s in self.running if s.status is Status.PREFILLING]
        # The oldest first, then shortest remaining prompt first (stable: ties keep arrival
        # order). `running` is in admission order, and admission is FIFO.
        order = prefilling[:1] + sorted(prefilling[1:],
                                        key=lambda s: len(s.prompt_ids) - s.num_cached)
        budget = self.prefill_chunk_tokens
        for seq in order:
            if budget <= 0:
                break
            start = seq.num_cached
            end = min(len(seq.prompt_ids), start + self.max_prefill_tokens_per_request,
                      start + budget)
            plan.prefill.append(PrefillChunk(seq, start, end))
            budget -= end - start
        # Work-conserving: budget the cap left unused (one long prompt alone, or short ones
        # that finished) goes to the same requests in the same order, so the cap shares a
        # step between prompts without slowing a prompt that has the step to itself.
        for chunk in plan.prefill:
            if budget <= 0:
                break
            extra = min(budget, len(chunk.seq.prompt_ids) - chunk.end)
            chunk.end += extra
            budget -= extra
        if self.prefix is not None:
            # Where the prefix cache copies a state, a chunk stops (the rest goes next step).
            for chunk in plan.prefill:
                chunk.end = self.prefix.chunk_end(chunk.start, chunk.end)
        return plan

    def remove(self, seq: Sequence) -> None:
        self._reserved.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
