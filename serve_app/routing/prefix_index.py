"""Prompt-prefix index: hash chain over fixed-size token blocks -> replicas that served them.

Block i's hash covers the whole prefix up to block i (it chains the previous hash), so two prompts
share block i's hash only if they share every token before it: a match is always a true prefix,
as in vLLM/SGLang's prefix caches. The index is approximate on purpose (like SGLang's router tree
and Ray's PrefixCacheAffinityRouter): engines evict on their own, so a hit is a hint, not a fact.
Memory is bounded by `max_entries` (block, replica) pairs; the least recently touched block goes
first, which mirrors the engines' LRU radix caches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

_SEED = 0x9E3779B97F4A7C15


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Hash chain over the full blocks of a prompt (a partial last block is not indexed: engines
    cache whole pages only)."""
    out: list[int] = []
    prev = _SEED
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start:start + block_size])))
        out.append(prev)
    return tuple(out)


def chain_hashes(keys: Iterable[object], prev: int = _SEED) -> tuple[int, ...]:
    """The same chain over opaque per-block keys: the simulator names blocks (document, index)
    instead of materialising a million token ids."""
    out: list[int] = []
    for key in keys:
        prev = hash((prev, key))
        out.append(prev)
    return tuple(out)


class PrefixIndex:
    """Block hash -> replicas, with a global bound (`max_entries` (block, replica) pairs: the
    router's memory) and a per-replica bound (`set_replica_limit`: the engine's KV pool in
    blocks, so the index forgets what the engine must have evicted, as SGLang's router evicts its
    per-worker trees by size). Both evict least recently used first."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries={max_entries} must be > 0")
        self.max_entries = max_entries
        self._blocks: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._global: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._limit: dict[str, int] = {}
        self._entries = 0
        self.evicted = 0

    def __len__(self) -> int:
        return self._entries

    def size(self, replica: str) -> int:
        """Blocks indexed for `replica` (SGLang's router routes cold prompts to the smallest tree)."""
        return len(self._lru.get(replica, ()))

    def set_replica_limit(self, replica: str, max_blocks: int) -> None:
        self._limit[replica] = max(1, max_blocks)
        self._evict(replica)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Replica -> number of leading blocks of `hashes` it holds (only replicas with >= 1)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._blocks.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for r in alive:
                matched[r] = i + 1
        return matched

    def insert(self, hashes: Sequence[int], replica: str) -> None:
        lru = self._lru.setdefault(replica, OrderedDict())
        # Touch the chain from its end to its start, so the first blocks are the most recent:
        # LRU then evicts the tails first (a radix cache evicts leaves), never a prefix's root
        # under its still-indexed descendants.
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                self._global.move_to_end((h, replica))
                continue
            lru[h] = None
            self._global[(h, replica)] = None
            self._blocks.setdefault(h, set()).add(replica)
            self._entries += 1
        self._evict(replica)

    def forget(self, hashes: Sequence[int], replica: str) -> None:
        """`replica` no longer holds these blocks (its engine evicted them)."""
        lru = self._lru.get(replica)
        for h in hashes:
            if lru is not None and h in lru:
                del lru[h]
                del self._global[(h, replica)]
                self._drop(h, replica)

    def follow(self, replica: str, events: Sequence[dict], held: Sequence[int] | None = None
               ) -> None:
        """Apply an engine's prefix-cache events (`{"type": "stored" | "evicted",
        "block_hashes": [...]}`, serve_app/engines/reference/prefix_cache.py) so the index holds
        what the replica really caches instead of what the router guessed. `held`: every block
        the engine holds, when its events were lost: the replica's entry is rebuilt from it."""
        if held is not None:
            limit = self._limit.get(replica)
            self.remove_replica(replica)
            if limit is not None:
                self._limit[replica] = limit
            self.insert(list(held), replica)
        for event in events:
            if event["type"] == "stored":
                self.insert(event["block_hashes"], replica)
            elif event["type"] == "evicted":
                self.forget(event["block_hashes"], replica)

    def remove_replica(self, replica: str) -> None:
        for h in self._lru.pop(replica, {}):
            self._drop(h, replica)
            del self._global[(h, replica)]
        self._limit.pop(replica, None)

    def _drop(self, h: int, replica: str) -> None:
        holders = self._blocks.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._blocks[h]
        self._entries -= 1

    def _evict(self, replica: str) -> None:
        lru = self._lru.get(replica)
        limit = self._limit.get(replica)
        while lru and limit is not None and len(lru) > limit:
            h, _ = lru.popitem(last=False)
            del self._global[(h, replica)]
            self._drop(h, replica)
            self.evicted += 1
        while self._entries > self.max_entries:
            (h, r), _ = self._global.popitem(last=False)
            del self._lru[r][h]
            self._drop(h, r)
            self.evicted += 1
