"""The prefix cache: a radix tree over full token pages, as SGLang's radix cache keeps it.

Each node is one page of tokens under its parent. It holds the page (a reference on it in the
PagedAllocator: the target's MLA latents and the DSpark draft's context rows of those tokens
live in the same slots, so a hit skips the draft's work too) and, on the hybrid, at most one
KDA state snapshot: the complete state after the node's last token (a slot of the snapshot
pool). A match walks the prompt's pages; on the hybrid it counts only up to the deepest node
that holds a state (a recurrent state cannot be rebuilt at another position without rerunning
from the previous snapshot). SGLang 0.5.23's UnifiedRadixCache with [FULL, MAMBA] components
(architecture notes §4).

Eviction is LRU and never touches what a running request uses: a node is locked while a request
that matched through it runs. KV pages go leaf first (a leaf's snapshot with it); snapshots
have their own LRU and can go from an internal node alone (its KV stays).

Every insertion and eviction is an event with the router's block hash (the hash chain of
serve_app.routing.prefix_index over page-size blocks), so the router's index follows what the
engine really holds instead of guessing.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app.models.kv_cache import PagedAllocator
from serve_app.routing.prefix_index import chain_hashes

# The router index's hash-chain seed (serve_app.routing.prefix_index): a node's block hash is
# that index's hash of the same block (tested), so the router can follow these events.
CHAIN_SEED = 0x9E3779B97F4A7C15
MAX_EVENTS = 4096  # kept for the router to read (oldest dropped first; it then resyncs)


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # this page's tokens
    parent: Node | None
    page: int
    depth: int  # tokens from the root to this node's end
    block_hash: int
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    snapshot: int | None = None  # snapshot-pool slot of the KDA state at this node's end
    locks: int = 0  # running requests that matched through this node
    last_used: int = 0
    state_used: int = 0


@dataclass
class Match:
    length: int  # usable cached tokens (whole pages)
    pages: list[int]
    node: Node | None  # the deepest usable node (locked by the caller's request)
    snapshot: int | None  # the KDA state to start from (hybrid), at `length`


class PrefixCache:
    """See the module doc. `hybrid`: hits need a state snapshot; `drop_snapshot(slot)` gives a
    snapshot slot back to its pool."""

    def __init__(self, allocator: PagedAllocator, hybrid: bool,
                 drop_snapshot: Callable[[int], None] | None = None) -> None:
        self.allocator = allocator
        self.page = allocator.page_size
        self.hybrid = hybrid
        self.drop_snapshot = drop_snapshot
        self.root = Node((), None, -1, 0, CHAIN_SEED)
        self._clock = itertools.count(1)
        self._locked: dict[Any, Node | None] = {}
        # The engine thread changes the tree; the replica's routing_info reads the events and
        # the held blocks from another thread: both under this lock.
        self.lock = threading.RLock()
        self.events: list[dict[str, Any]] = []
        self.event_seq = 0  # events ever published; events[-1] has number event_seq - 1
        self.stats = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "evicted_pages": 0,
                      "evicted_snapshots": 0}
        allocator.reclaim = self.evict

    # --- what is cached -----------------------------------------------------------------------

    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @property
    def cached_pages(self) -> int:
        return len(self.nodes())

    @property
    def snapshots(self) -> int:
        return sum(1 for n in self.nodes() if n.snapshot is not None)

    # --- match, lock, unlock ------------------------------------------------------------------

    def match(self, tokens: Sequence[int], rid: Any) -> Match:
        """The longest usable cached prefix of `tokens`, leaving at least one token to compute
        (the last prompt token's logits are needed), locked for request `rid` until `unlock`."""
        self.stats["queries"] += 1
        self.stats["query_tokens"] += len(tokens)
        path = self._usable_path(tokens)
        now = next(self._clock)
        for n in path:
            n.last_used = now
            n.locks += 1
        deepest = path[-1] if path else None
        if deepest is not None and deepest.snapshot is not None:
            deepest.state_used = now
        self._locked[rid] = deepest
        length = len(path) * self.page
        self.stats["hit_tokens"] += length
        return Match(length, [n.page for n in path], deepest,
                     deepest.snapshot if deepest is not None else None)

    def probe(self, tokens: Sequence[int]) -> tuple[int, int]:
        """What `match` would give, without touching anything: (cached tokens, tokens of the
        matched pages no running request pins yet), for admission to count shared pages once."""
        path = self._usable_path(tokens)
        return len(path) * self.page, sum(self.page for n in path if n.locks == 0)

    def _usable_path(self, tokens: Sequence[int]) -> list[Node]:
        """The cached nodes a prompt can start from: its matching full pages, leaving one
        token to compute, and on the hybrid only up to the deepest one holding a state."""
        node, path = self.root, []
        for i in range((len(tokens) - 1) // self.page):
            child = node.children.get(tuple(tokens[i * self.page:(i + 1) * self.page]))
            if child is None:
                break
            path.append(child)
            node = child
        if self.hybrid:  # a recurrent state exists only at snapshots
            while path and path[-1].snapshot is None:
                path.pop()
        return path

    @property
    def pinned_tokens(self) -> int:
        """Tokens of the cached pages running requests use (not evictable)."""
        return sum(self.page for n in self.nodes() if n.locks > 0)

    def unlock(self, rid: Any) -> None:
        node = self._locked.pop(rid, None)
        while node is not None and node is not self.root:
            node.locks -= 1
            node = node.parent

    # --- insert -------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               snapshot: int | None = None) -> None:
        """Cache the full pages of `tokens` (whose pages they are: a request's table); the tree
        takes a reference on each page it did not have. `snapshot`: a snapshot slot holding
        the KDA state after the last of these tokens; given back (`drop_snapshot`) if the tree
        does not take it (the node already has one, or `tokens` is not page-aligned)."""
        with self.lock:
            left = self._insert(tokens, pages, snapshot)
        if left is not None and self.drop_snapshot is not None:
            self.drop_snapshot(left)

    def _insert(self, tokens: Sequence[int], pages: Sequence[int],
                snapshot: int | None) -> int | None:
        full = len(tokens) // self.page
        node, now, stored = self.root, next(self._clock), []
        for i in range(full):
            key = tuple(tokens[i * self.page:(i + 1) * self.page])
            child = node.children.get(key)
            if child is None:
                block_hash = chain_hashes([key], node.block_hash)[0]
                self.allocator.hold(pages[i])
                child = Node(key, node, pages[i], (i + 1) * self.page, block_hash)
                node.children[key] = child
                stored.append(block_hash)
            child.last_used = now
            node = child
        if stored:
            self._publish("stored", stored)
        if snapshot is None:
            return None
        if node is self.root or len(tokens) % self.page or node.snapshot is not None:
            return snapshot
        node.snapshot, node.state_used = snapshot, now
        return None

    # --- evict --------------------------------------------------------------------------------

    def evict(self, pages: int) -> None:
        """Let go of up to `pages` pages' worth of unlocked leaves, least recently used first
        (the allocator's reclaim hook; a page a running request still holds is not freed by
        this, so eviction goes on until enough pages are really free or nothing is left)."""
        with self.lock:
            target = len(self.allocator._free_pages) + pages
            while len(self.allocator._free_pages) < target:
                leaves = [n for n in self.nodes() if not n.children and n.locks == 0]
                if not leaves:
                    return
                self._remove(min(leaves, key=lambda n: n.last_used))

    def evict_snapshot(self) -> bool:
        """Drop the least recently used unlocked snapshot (its node's KV stays); False if none."""
        held = [n for n in self.nodes() if n.snapshot is not None and n.locks == 0]
        if not held:
            return False
        node = min(held, key=lambda n: n.state_used)
        self._drop_state(node)
        return True

    def _drop_state(self, node: Node) -> None:
        if node.snapshot is not None and self.drop_snapshot is not None:
            self.drop_snapshot(node.snapshot)
        node.snapshot = None
        self.stats["evicted_snapshots"] += 1

    def _remove(self, node: Node) -> None:
        if node.snapshot is not None:
            self._drop_state(node)
        assert node.parent is not None
        del node.parent.children[node.key]
        self.allocator.release(node.page)
        self.stats["evicted_pages"] += 1
        self._publish("evicted", [node.block_hash])

    def _publish(self, kind: str, hashes: list[int]) -> None:
        self.events.append({"seq": self.event_seq, "type": kind, "block_hashes": hashes,
                            "page_size": self.page})
        self.event_seq += 1
        if len(self.events) > MAX_EVENTS:
            del self.events[: len(self.events) - MAX_EVENTS]

    def events_since(self, seq: int) -> tuple[int, list[dict[str, Any]], bool]:
        """(the next sequence number, the events numbered >= seq, whether some were lost:
        the reader then rebuilds from `block_hashes_held`)."""
        with self.lock:
            first = self.events[0]["seq"] if self.events else self.event_seq
            return self.event_seq, [e for e in self.events if e["seq"] >= seq], seq < first

    def block_hashes_held(self) -> list[int]:
        with self.lock:
            return [n.block_hash for n in self.nodes()]

