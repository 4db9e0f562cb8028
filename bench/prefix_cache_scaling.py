"""What the prefix cache costs the engine's step and admission paths as it fills: 10 to 10,000
cached nodes (documents of 10 pages, each with a state checkpoint at its end, as on K3).

Two variants in one run, on the same trees:

  kept   the prefix cache as it is (serve_app/engines/reference/prefix_cache.py): counts kept
         as the tree changes, eviction from LRU heaps
  walk   the same tree with the counts and the eviction choice found by walking it (what the
         cache did before: a baseline kept here, not in the product)

Per node count, the median over repeats (microseconds) of:

  admit   Scheduler.admit's prefix work for one request: probe a 10-page prompt that hits a
          cached document, then read the pinned tokens
  stats   what the engine's telemetry reads every step: pages, checkpoints, pinned tokens
  evict   eviction of one page (the LRU unlocked leaf) and of one checkpoint (the LRU
          unlocked one), then a new document stored in their place (evicting what it needs)

    python bench/prefix_cache_scaling.py [--repeats 200] [--nodes 10 100 1000 10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve_app.config import PrefixCacheConfig  # noqa: E402
from serve_app.engines.reference.prefix_cache import Node, PrefixCache  # noqa: E402
from serve_app.models.kv_cache import PagedAllocator  # noqa: E402

PAGE = 16
DOC_PAGES = 10
NODES = (10, 100, 1_000, 10_000)


class Checkpoints:
    """A StateCheckpoints with unlimited slots (the bench measures the tree, not the copies)."""

    def __init__(self) -> None:
        self.next = 0

    def checkpoint(self, rid: Any, position: int) -> int:
        self.next += 1
        return self.next

    def drop_checkpoint(self, key: int) -> None:
        pass


class WalkingPrefixCache(PrefixCache):
    """The baseline: every count and every eviction choice from a walk of the tree."""

    @property  # type: ignore[override]
    def cached_pages(self) -> int:
        return len(self.nodes())

    @cached_pages.setter
    def cached_pages(self, value: int) -> None:
        pass

    @property  # type: ignore[override]
    def snapshots(self) -> int:
        return sum(1 for n in self.nodes() if n.snapshot is not None)

    @snapshots.setter
    def snapshots(self, value: int) -> None:
        pass

    @property
    def pinned_tokens(self) -> int:
        return sum(self.page for n in self.nodes() if n.locks > 0)

    def _evictable(self, node: Node) -> None:
        pass  # no heaps

    def evict(self, pages: int) -> None:
        target = self.allocator.free_tokens + pages * self.page
        while self.allocator.free_tokens < target:
            leaves = [n for n in self.nodes() if not n.children and n.locks == 0]
            if not leaves:
                return
            self._remove(min(leaves, key=lambda n: n.last_used))

    def evict_snapshot(self) -> bool:
        held = [n for n in self.nodes() if n.snapshot is not None and n.locks == 0]
        if not held:
            return False
        self._drop_state(min(held, key=lambda n: n.state_used))
        return True


def document(i: int) -> list[int]:
    """Document i's tokens: its own first page, so documents share no prefix."""
    return [i * 7919 + j for j in range(DOC_PAGES * PAGE)]


def filled(kind: type[PrefixCache], nodes: int) -> tuple[PrefixCache, PagedAllocator, int]:
    docs = max(1, nodes // DOC_PAGES)
    allocator = PagedAllocator((nodes + 4 * DOC_PAGES) * PAGE, PAGE)
    cache = kind(allocator, Checkpoints(), PrefixCacheConfig(enabled=True))
    for i in range(docs):
        store(cache, allocator, i)
    return cache, allocator, docs


def store(cache: PrefixCache, allocator: PagedAllocator, i: int) -> None:
    """Document i prefilled by a request that then finishes (its pages stay in the tree)."""
    rid = ("doc", i)
    allocator.add(rid)
    cache.evict(allocator.shortfall({rid: DOC_PAGES * PAGE}))  # as the model runner does
    allocator.reserve(rid, DOC_PAGES * PAGE)
    cache.store(rid, document(i), allocator.pages(rid))
    allocator.free(rid)


def timed(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1e3


def measure(kind: type[PrefixCache], nodes: int, repeats: int) -> dict[str, float]:
    cache, allocator, docs = filled(kind, nodes)
    hit = [*document(docs // 2), 1, 2, 3]
    admit = timed(lambda: (cache.probe(hit), cache.pinned_tokens), repeats)
    stats = timed(lambda: (cache.cached_pages, cache.snapshots, cache.pinned_tokens), repeats)
    fresh = iter(range(docs, docs + 10 * repeats))

    def evict_and_store() -> None:
        cache.evict(1)
        cache.evict_snapshot()
        store(cache, allocator, next(fresh))

    # At most a few repeats for the walking baseline at 10,000 nodes (each is a tree walk).
    evict = timed(evict_and_store, max(5, repeats // 10))
    assert cache.cached_pages <= nodes + 4 * DOC_PAGES, "the tree outgrew its pages"
    return {"admit_us": admit, "stats_us": stats, "evict_us": evict}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--nodes", type=int, nargs="+", default=list(NODES),
                        help="cached node counts, ascending")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for nodes in args.nodes:
        # Interleaved per size, so this machine's drift falls on both variants alike.
        for name, kind in (("kept", PrefixCache), ("walk", WalkingPrefixCache)):
            rows.append({"variant": name, "nodes": nodes, **measure(kind, nodes, args.repeats)})
    print(f"{'variant':8} {'nodes':>7} {'admit us':>10} {'stats us':>10} {'evict us':>10}")
    for r in rows:
        print(f"{r['variant']:8} {r['nodes']:>7} {r['admit_us']:>10.1f} {r['stats_us']:>10.1f} "
              f"{r['evict_us']:>10.1f}")
    kept = {r["nodes"]: r for r in rows if r["variant"] == "kept"}
    low, high = args.nodes[0], args.nodes[-1]
    growth = {k: kept[high][k] / kept[low][k] for k in ("admit_us", "stats_us", "evict_us")}
    print(f"kept, {high:,} nodes over {low:,}: "
          + ", ".join(f"{k} x{v:.2f}" for k, v in growth.items()))
    line = {"bench": "prefix_cache_scaling", "rows": rows, f"kept_growth_{low}_to_{high}": growth}
    print(json.dumps(line))
    if args.json:
        args.json.write_text(json.dumps(line, indent=2))


if __name__ == "__main__":
    main()
