"""The prefix cache: a radix tree over full token pages, as SGLang's radix cache keeps it.

Each node is one page of tokens under its parent. It holds the page (a reference on it in the
PagedAllocator: the target's MLA latents and the DSpark draft's context rows of those tokens
live in the same slots, so a hit skips the draft's work too) and, on the hybrid, at most one
KDA state snapshot: the complete state after the node's last token (a slot of the snapshot
pool). A match walks the prompt's pages; on the hybrid it counts only up to the deepest node
that holds a state (a recurrent state cannot be rebuilt at another position without rerunning
from the previous snapshot). SGLang 0.5.23's UnifiedRadixCache with [FULL, MAMBA] components
(srt/mem_cache/unified_cache/).

Eviction is LRU and never touches what a running request uses: a node is locked while a request
that matched through it runs. KV pages go leaf first (a leaf's snapshot with it); snapshots
have their own LRU and can go from an internal node alone (its KV stays).

It also owns the policy of where a request's prefix is cached (`chunk_end`, `cache_point`,
`finish_point`) and what happens when no checkpoint slot is free (`store`: the least recently
used unlocked checkpoint goes, then one more try; still none, nothing is cached). The engine
calls the same hooks for either family; the target's cache says which it is by offering
`checkpoints` (target.py) or not.

Its counts (pages, checkpoints, pinned tokens) are kept as the tree changes, and eviction takes
from heaps ordered by last use: nothing on the step or admission path walks the tree.

Every insertion and eviction is an event with the router's block hash (the hash chain of
serve_app.routing.prefix_index over page-size blocks), so the router's index follows what the
engine really holds instead of guessing.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app.config import PrefixCacheConfig
from serve_app.models.kv_cache import PagedAllocator
from serve_app.models.target import StateCheckpoints
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
    snapshot: int | None = None  # checkpoint key of the KDA state at this node's end
    locks: int = 0  # running requests that matched through this node
    last_used: int = 0
    state_used: int = 0
    attached: bool = True  # still in the tree (heap entries of removed nodes are skipped)


@dataclass
class Match:
    length: int  # usable cached tokens (whole pages)
    pages: list[int]
    node: Node | None  # the deepest usable node (locked by the caller's request)
    snapshot: int | None  # the KDA state to start from (hybrid), at `length`


class PrefixCache:
    """See the module doc. `states`: the target cache's checkpoints (a hit then needs one);
    None: pages alone are a reusable prefix."""

    def __init__(self, allocator: PagedAllocator, states: StateCheckpoints | None,
                 config: PrefixCacheConfig | None = None) -> None:
        config = config or PrefixCacheConfig(enabled=True)
        self.allocator = allocator
        self.page = allocator.page_size
        self.states = states
        self.prefill_grid = config.snapshot_interval
        self.decode_grid = config.decode_snapshot_interval
        self.root = Node((), None, -1, 0, CHAIN_SEED)
        self._clock = itertools.count(1)
        self._locked: dict[Any, Node | None] = {}
        # Kept as the tree changes (module doc): nodes, nodes holding a checkpoint, nodes a
        # running request pins; and the LRU heaps of (last use, tie-break, node), whose stale
        # entries (used again since, locked, removed) are skipped when popped.
        self.cached_pages = 0
        self.snapshots = 0
        self._pinned_pages = 0
        self._leaves: list[tuple[int, int, Node]] = []
        self._held_states: list[tuple[int, int, Node]] = []
        self._tie = itertools.count()
        # The engine thread changes the tree; the replica's routing_info reads the events and
        # the held blocks from another thread: both under this lock.
        self.lock = threading.RLock()
        self.events: list[dict[str, Any]] = []
        self.event_seq = 0  # events ever published; events[-1] has number event_seq - 1
        self.stats = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "evicted_pages": 0,
                      "evicted_snapshots": 0}

    # --- where a request's prefix is cached (decided on rank 0) -------------------------------

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk [start, end) may end: with checkpoints, at the first grid line
        it crosses (the state is copied where a chunk ends); else where it would."""
        if self.states is None:
            return end
        line = end // self.prefill_grid * self.prefill_grid
        return line if start < line < end else end

    def cache_point(self, start: int, end: int, prompt_len: int) -> int:
        """A request's committed length went from `start` to `end`: the length, in (start, end],
        whose prefix goes into the cache now, or 0. With checkpoints: prefill chunks end on
        the prefill grid, decode steps cross the decode grid (SGLang's
        mamba_track_interval). Without: the whole prompt, once prefilled."""
        if self.states is None:
            return end if start < prompt_len <= end else 0
        if end <= prompt_len:
            return end if end % self.prefill_grid == 0 else 0
        line = end // self.decode_grid * self.decode_grid
        return line if line > max(start, prompt_len) else 0

    def finish_point(self, length: int) -> int:
        """What a finished request of `length` committed tokens donates: without checkpoints,
        all of it (its pages are the prefix); with them, nothing more (its reusable prefixes
        are the checkpoints it took on the way)."""
        return length if self.states is None else 0

    # --- what is cached -----------------------------------------------------------------------

    def nodes(self) -> list[Node]:
        """Every node (a walk: for resyncs and tests, never on the step path)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @property
    def pinned_tokens(self) -> int:
        """Tokens of the cached pages running requests use (not evictable)."""
        return self._pinned_pages * self.page

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
            if n.locks == 0:
                self._pinned_pages += 1
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
        token to compute, and with checkpoints only up to the deepest one holding a state."""
        node, path = self.root, []
        for i in range((len(tokens) - 1) // self.page):
            child = node.children.get(tuple(tokens[i * self.page:(i + 1) * self.page]))
            if child is None:
                break
            path.append(child)
            node = child
        if self.states is not None:  # a recurrent state exists only at checkpoints
            while path and path[-1].snapshot is None:
                path.pop()
        return path

    def unlock(self, rid: Any) -> None:
        node = self._locked.pop(rid, None)
        while node is not None and node is not self.root:
            node.locks -= 1
            if node.locks == 0:
                self._pinned_pages -= 1
                self._evictable(node)
            node = node.parent

    # --- insert -------------------------------------------------------------------------------

    def store(self, rid: Any, tokens: Sequence[int], pages: Sequence[int]) -> bool:
        """Cache the full pages of `tokens`, the first len(tokens) tokens of running request
        `rid` (`pages`: its page table), with a checkpoint of its state there if the target has
        state. The one rule when no checkpoint slot is free, in prefill and decode alike: the
        least recently used unlocked checkpoint makes room; if none can, nothing is cached
        (pages without a state are no usable prefix). False if nothing was cached."""
        snapshot = None
        if self.states is not None:
            snapshot = self.states.checkpoint(rid, len(tokens))
            if snapshot is None and self.evict_snapshot():
                snapshot = self.states.checkpoint(rid, len(tokens))
            if snapshot is None:
                return False
        self.insert(tokens, pages, snapshot)
        return True

    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               snapshot: int | None = None) -> None:
        """Cache the full pages of `tokens` (whose pages they are: a request's table); the tree
        takes a reference on each page it did not have. `snapshot`: a checkpoint of the state
        after the last of these tokens; dropped if the tree does not take it (the node already
        has one, or `tokens` is not page-aligned)."""
        with self.lock:
            left = self._insert(tokens, pages, snapshot)
        if left is not None and self.states is not None:
            self.states.drop_checkpoint(left)

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
                self.cached_pages += 1
                stored.append(block_hash)
            child.last_used = now
            node = child
        if node is not self.root:
            self._evictable(node)
        if stored:
            self._publish("stored", stored)
        if snapshot is None:
            return None
        if node is self.root or len(tokens) % self.page or node.snapshot is not None:
            return snapshot
        node.snapshot, node.state_used = snapshot, now
        self.snapshots += 1
        self._evictable(node)
        return None

    # --- evict --------------------------------------------------------------------------------

    def _evictable(self, node: Node) -> None:
        """`node` may have become an eviction candidate (unlocked, a leaf, a new checkpoint, or
        used again): a heap entry with its current last use."""
        if node.locks:
            return
        if not node.children:
            heapq.heappush(self._leaves, (node.last_used, next(self._tie), node))
        if node.snapshot is not None:
            heapq.heappush(self._held_states, (node.state_used, next(self._tie), node))
        if len(self._leaves) + len(self._held_states) > 4 * self.cached_pages + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries (amortized: only when they outnumber the nodes 4 to 1)."""
        self._leaves = [e for e in self._leaves if self._leaf_entry_valid(e)]
        self._held_states = [e for e in self._held_states if self._state_entry_valid(e)]
        heapq.heapify(self._leaves)
        heapq.heapify(self._held_states)

    @staticmethod
    def _leaf_entry_valid(entry: tuple[int, int, Node]) -> bool:
        used, _, node = entry
        return node.attached and not node.children and not node.locks and node.last_used == used

    @staticmethod
    def _state_entry_valid(entry: tuple[int, int, Node]) -> bool:
        used, _, node = entry
        return (node.attached and node.snapshot is not None and not node.locks
                and node.state_used == used)

    def evict(self, pages: int) -> None:
        """Let go of unlocked leaves, least recently used first, until `pages` more pages are
        free in the pool or nothing is left (a page a running request still holds is not
        freed by letting go of it). The model runner asks before a forward that needs them."""
        with self.lock:
            target = self.allocator.free_tokens + pages * self.page
            while self.allocator.free_tokens < target and self._leaves:
                entry = heapq.heappop(self._leaves)
                if self._leaf_entry_valid(entry):
                    self._remove(entry[2])

    def evict_snapshot(self) -> bool:
        """Drop the least recently used unlocked checkpoint (its node's KV stays); False if
        none."""
        while self._held_states:
            entry = heapq.heappop(self._held_states)
            if self._state_entry_valid(entry):
                self._drop_state(entry[2])
                return True
        return False

    def _drop_state(self, node: Node) -> None:
        if node.snapshot is not None and self.states is not None:
            self.states.drop_checkpoint(node.snapshot)
            self.snapshots -= 1
        node.snapshot = None
        self.stats["evicted_snapshots"] += 1

    def _remove(self, node: Node) -> None:
        if node.snapshot is not None:
            self._drop_state(node)
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        node.attached = False
        self.cached_pages -= 1
        self.allocator.release(node.page)
        self.stats["evicted_pages"] += 1
        self._publish("evicted", [node.block_hash])
        if parent is not self.root:
            self._evictable(parent)

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
