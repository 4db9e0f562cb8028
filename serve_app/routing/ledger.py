"""KV-token ledger: what each replica can hold and what in-flight requests have committed.

A request commits prompt + max_tokens tokens on admission and releases them on completion,
updated in the routing hooks (not from stats polled every 10 s, which would let a burst
overcommit a replica many times over). With `share_prefix` (engines with a prefix cache, e.g.
SGLang's radix cache) blocks already held by another in-flight request on the same replica are
counted once: two questions on one 1M-token document need 1M + two answers, not 2M.

State slots are the second resource: every running request holds one (on the K3 hybrid its KDA
recurrent state, on any engine one of its max-running-requests places), so a replica with KV
room but no free slot cannot start the request either; it would wait inside the engine,
invisibly. A request takes one slot with its tokens and gives it back with them. A replica that
reports no slot bound (`None`: an older engine) is unbounded in slots.

With several ingress replicas this ledger is one ingress's *hint*: its own requests exactly,
the others' as `external` load from the target replica's reports (`set_external`); the target
replica's own ledger (serve_app.routing.reservation) decides.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class _Replica:
    capacity: int
    private: int = 0  # non-shared tokens: partial last block + max_tokens (+ blocks if unshared)
    refs: Counter[int] = field(default_factory=Counter)  # block -> in-flight holders
    block_tokens: int = 0  # len(refs) x block size, kept incrementally
    slots: int | None = None  # state slots (running requests); None = unbounded
    slots_reserved: int = 0  # committed requests, one slot each
    # What the replica holds for other callers (other ingress replicas), from its own
    # authoritative ledger's last report: a hint, counted in `free` and `has_slot`.
    external_tokens: int = 0
    external_slots: int = 0

    @property
    def committed(self) -> int:
        return self.private + self.block_tokens


@dataclass(frozen=True)
class _Commit:
    replica: str
    private: int
    blocks: tuple[int, ...]


class CapacityLedger:
    def __init__(self, block_size: int, share_prefix: bool = True) -> None:
        self.block_size = block_size
        self.share_prefix = share_prefix
        self._replicas: dict[str, _Replica] = {}
        self._commits: dict[str, _Commit] = {}

    # --- replicas -------------------------------------------------------------------------------

    def set_capacity(self, replica: str, kv_tokens_total: int,
                     state_slots_total: int | None = None) -> None:
        """The replica's KV tokens and state slots (None: no slot bound reported). A bound that
        shrinks below what is reserved only stops new commitments; nothing in flight is undone."""
        if replica in self._replicas:
            r = self._replicas[replica]
            r.capacity = kv_tokens_total
            r.slots = state_slots_total
        else:
            self._replicas[replica] = _Replica(kv_tokens_total, slots=state_slots_total)

    def remove_replica(self, replica: str) -> list[str]:
        """Forget a replica; returns the request ids that were committed on it."""
        self._replicas.pop(replica, None)
        gone = [rid for rid, c in self._commits.items() if c.replica == replica]
        for rid in gone:
            del self._commits[rid]
        return gone

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def capacity(self, replica: str) -> int:
        return self._replicas[replica].capacity

    def committed(self, replica: str) -> int:
        return self._replicas[replica].committed

    def free(self, replica: str) -> int:
        r = self._replicas[replica]
        return r.capacity - r.committed - r.external_tokens

    def set_external(self, replica: str, tokens: int, slots: int) -> None:
        """Load the replica holds for other callers (other ingresses), as last reported."""
        r = self._replicas[replica]
        r.external_tokens, r.external_slots = max(0, tokens), max(0, slots)

    def external(self, replica: str) -> tuple[int, int]:
        r = self._replicas[replica]
        return r.external_tokens, r.external_slots

    def slots_total(self, replica: str) -> int | None:
        return self._replicas[replica].slots

    def slots_reserved(self, replica: str) -> int:
        return self._replicas[replica].slots_reserved

    def has_slot(self, replica: str) -> bool:
        r = self._replicas[replica]
        return r.slots is None or r.slots_reserved + r.external_slots < r.slots

    def max_capacity(self) -> int:
        return max((r.capacity for r in self._replicas.values()), default=0)

    # --- requests -------------------------------------------------------------------------------

    def _split(self, prompt_tokens: int, max_tokens: int,
               blocks: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        if not self.share_prefix:
            return prompt_tokens + max_tokens, ()
        return prompt_tokens - len(blocks) * self.block_size + max_tokens, blocks

    def charge(self, replica: str, prompt_tokens: int, max_tokens: int,
               blocks: tuple[int, ...] = ()) -> int:
        """Tokens this request would add to `replica`'s commitment."""
        private, shared = self._split(prompt_tokens, max_tokens, blocks)
        refs = self._replicas[replica].refs
        new_blocks = sum(1 for h in shared if h not in refs)
        return private + new_blocks * self.block_size

    def fits(self, replica: str, prompt_tokens: int, max_tokens: int,
             blocks: tuple[int, ...] = ()) -> bool:
        """Both resources: a free state slot (a request cannot run without one, however much
        KV is free) and the KV tokens."""
        return (self.has_slot(replica)
                and self.charge(replica, prompt_tokens, max_tokens, blocks) <= self.free(replica))

    def commit(self, request_id: str, replica: str, prompt_tokens: int, max_tokens: int,
               blocks: tuple[int, ...] = ()) -> int:
        if request_id in self._commits:
            raise ValueError(f"request {request_id} is already committed")
        tokens = self.charge(replica, prompt_tokens, max_tokens, blocks)
        r = self._replicas[replica]
        if tokens > self.free(replica):
            raise ValueError(f"request {request_id} needs {tokens} KV tokens; replica {replica} "
                             f"has {self.free(replica)} free")
        if not self.has_slot(replica):
            raise ValueError(f"request {request_id} needs a state slot; replica {replica} has "
                             f"all {r.slots} reserved")
        private, shared = self._split(prompt_tokens, max_tokens, blocks)
        r.private += private
        for h in shared:
            if h not in r.refs:
                r.block_tokens += self.block_size
            r.refs[h] += 1
        r.slots_reserved += 1
        self._commits[request_id] = _Commit(replica, private, shared)
        return tokens

    def release(self, request_id: str) -> str | None:
        """Idempotent: the completion hook and an error path may both release."""
        c = self._commits.pop(request_id, None)
        if c is None:
            return None
        r = self._replicas.get(c.replica)
        if r is None:
            return c.replica
        r.private -= c.private
        r.slots_reserved -= 1
        # A shared block stays committed until its last in-flight holder leaves, whoever
        # brought it first.
        for h in c.blocks:
            r.refs[h] -= 1
            if r.refs[h] <= 0:
                del r.refs[h]
                r.block_tokens -= self.block_size
        return c.replica
