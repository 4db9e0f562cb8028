"""The target replica's own, authoritative reservation ledger (docs/router.md, "Several
ingress replicas"). Pure Python, no Ray.

Every ingress replica runs its own admission stage, and each one's ledger is only a *hint*
of what a target replica holds: it sees its own requests at once and the other ingresses'
only through the replica's reports. The replica is the one place that sees every request it
accepts, so it keeps the ledger that decides. A `generate` call carries its `Reservation`
(the facts the ingress's admission stage computed: prompt tokens, max_tokens, prefix blocks)
and is reserved here before any engine work; if it does not fit, the call is refused at once
with `ReplicaFull`, which carries this ledger's numbers so the ingress can correct its hint.
The reservation is released exactly once when the request ends on the replica, however it
ends.

The accounting is `CapacityLedger`'s, with the same settings the ingress uses (block size,
`share_prefix`), so hint and authority compute the same charge for the same request.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serve_app.routing.ledger import CapacityLedger
from serve_app.routing.prefix_index import block_hashes


@dataclass(frozen=True)
class Reservation:
    """What one request reserves on the replica it is sent to, as its ingress computed it
    (worst case: prompt + max_tokens KV tokens, prefix blocks shared once; one state slot)."""

    prompt_tokens: int
    max_tokens: int
    blocks: tuple[int, ...] = ()


class ReplicaFull(Exception):
    """The replica's authoritative ledger cannot hold the request now: refused before any
    engine work. `info` is the ledger's report at that moment (`ReplicaLedger.report`, plus
    `replica`): the ingress corrects its hint from it and queues the request again."""

    def __init__(self, info: dict[str, Any]) -> None:
        super().__init__(info)
        self.info = info

    def __str__(self) -> str:
        i = self.info
        return (f"replica {i.get('replica')} is full: {i.get('kv_tokens_committed')}/"
                f"{i.get('kv_tokens_total')} KV tokens committed, "
                f"{i.get('state_slots_reserved')}/{i.get('state_slots_total')} state slots "
                "reserved")


class ReplicaLedger:
    """Reservations of the requests one target replica has accepted, from every caller.
    Thread-safe (Serve may run sync methods such as `routing_info` on another thread).

    Besides the totals it keeps each caller's share (a second ledger per caller, the same
    accounting), so that an ingress can tell its own requests from the others' in a report."""

    def __init__(self, block_size: int, share_prefix: bool, kv_tokens_total: int,
                 state_slots_total: int | None) -> None:
        self.block_size = block_size
        self.share_prefix = share_prefix
        self._lock = threading.Lock()
        self._total = self._ledger(kv_tokens_total, state_slots_total)
        self._callers: dict[str, CapacityLedger] = {}
        self._caller_of: dict[str, str] = {}
        self._kv_total, self._slots_total = kv_tokens_total, state_slots_total
        self.seq = 0  # bumped on every change: a report older than one already seen is stale
        self.refused = 0
        self.accepted = 0
        self.refused_by: Counter[str] = Counter()

    def _ledger(self, kv: int, slots: int | None) -> CapacityLedger:
        ledger = CapacityLedger(self.block_size, self.share_prefix)
        ledger.set_capacity("self", kv, slots)
        return ledger

    def set_capacity(self, kv_tokens_total: int, state_slots_total: int | None) -> None:
        with self._lock:
            if (kv_tokens_total, state_slots_total) == (self._kv_total, self._slots_total):
                return
            self._kv_total, self._slots_total = kv_tokens_total, state_slots_total
            self._total.set_capacity("self", kv_tokens_total, state_slots_total)
            for ledger in self._callers.values():
                ledger.set_capacity("self", kv_tokens_total, state_slots_total)
            self.seq += 1

    def reservation_for(self, prompt_ids: Sequence[int], max_tokens: int) -> Reservation:
        """The reservation of a call that carries none (a direct handle call): the same facts,
        computed here."""
        blocks = block_hashes(prompt_ids, self.block_size) if self.share_prefix else ()
        return Reservation(len(prompt_ids), max_tokens, blocks)

    def reserve(self, request_id: str, caller: str, r: Reservation) -> None:
        """Commit the request, or raise ReplicaFull (nothing changed). Atomic."""
        with self._lock:
            if not self._total.fits("self", r.prompt_tokens, r.max_tokens, r.blocks):
                self.refused += 1
                self.refused_by[caller] += 1
                raise ReplicaFull(self._report(caller))
            self._total.commit(request_id, "self", r.prompt_tokens, r.max_tokens, r.blocks)
            mine = self._callers.get(caller)
            if mine is None:
                mine = self._callers[caller] = self._ledger(self._kv_total, None)
            mine.commit(request_id, "self", r.prompt_tokens, r.max_tokens, r.blocks)
            self._caller_of[request_id] = caller
            self.accepted += 1
            self.seq += 1

    def release(self, request_id: str) -> bool:
        """Idempotent: True the first time, for a request that was reserved."""
        with self._lock:
            caller = self._caller_of.pop(request_id, None)
            if caller is None:
                return False
            self._total.release(request_id)
            mine = self._callers[caller]
            mine.release(request_id)
            if mine.slots_reserved("self") == 0:
                del self._callers[caller]
            self.seq += 1
            return True

    def report(self, caller: str | None = None) -> dict[str, Any]:
        with self._lock:
            return self._report(caller)

    def _report(self, caller: str | None) -> dict[str, Any]:
        t = self._total
        return {
            "kv_tokens_total": self._kv_total,
            "kv_tokens_committed": t.committed("self"),
            "state_slots_total": self._slots_total,
            "state_slots_reserved": t.slots_reserved("self"),
            "seq": self.seq,
            "accepted": self.accepted,
            "refused": self.refused,
            # Each caller's own share (its requests alone, the same accounting): what an
            # ingress subtracts to see the other ingresses' load.
            "callers": {c: {"kv_tokens_committed": lg.committed("self"),
                            "state_slots_reserved": lg.slots_reserved("self")}
                        for c, lg in self._callers.items()},
            "requests": dict(self._caller_of),
            **({"caller": caller} if caller is not None else {}),
        }
