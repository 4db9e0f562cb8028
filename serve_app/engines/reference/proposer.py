"""Draft proposers behind one interface: the DSpark draft, or anything a test plugs in.

A proposer sees the target's taps for every committed token (`append`) and proposes gamma
tokens per request after its anchor (`propose`). It may hold taps back until it next drafts
for the request (`settle` writes them; the runner settles a request before its pages are shared
through the prefix cache). It is windowed state (target.py): `commit` keeps a prefix of what it
holds, like the target's cache. On tensor-parallel followers only the part with collectives
runs (`follow_propose`); drafts are chosen on rank 0.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from serve_app.engines.reference.sequence import Sequence
from serve_app.models.dspark import DraftMask, DraftOutput, DSparkDraft
from serve_app.models.kv_cache import PagedAllocator, PagedKVCache

# The most tokens of taps a request holds back before they are written anyway: a request the
# budget never drafts for keeps no more than this many rows in memory twice (the embedded
# pair's taps: 3 KB a token), and one that finishes first never has them written.
HOLD_TOKENS = 1024


class Proposer(Protocol):
    gamma: int
    tap_layers: tuple[int, ...]  # target layers whose outputs `commit` needs

    def add(self, rid: Hashable, cached: int = 0) -> None:
        """A new request whose first `cached` tokens' context is already in its shared pages
        (a prefix-cache hit)."""

    def free(self, rid: Hashable) -> None: ...

    def append(self, rids: Seq[Hashable], taps: Seq[torch.Tensor | None]) -> None:
        """Rows of the target's committed tokens, in order, per request: the proposer may
        keep them as they are (the runner passes no more of a forward's taps than the
        request's rows)."""

    def settle(self, rids: Seq[Hashable]) -> None:
        """Whatever `append` held back of `rids` is in their pages from now on."""

    def commit(self, rids: Seq[Hashable], lengths: Seq[int]) -> None:
        """Keep `lengths[i]` tokens of rids[i] (target.py's WindowedState)."""

    def propose(self, seqs: Seq[Sequence], masks: DraftMask | None = None) -> DraftOutput:
        """gamma drafts per request; `masks` (constrained requests): the tokens each block
        position may take, given the tokens drafted before it (models/dspark.py)."""

    def follow_propose(self, rids: Seq[Hashable], anchors: torch.Tensor) -> None: ...

    def export(self, rid: Hashable) -> dict[str, torch.Tensor]:
        """A copy of what this proposer holds of `rid` (a hand-over to another engine)."""

    def adopt(self, rid: Hashable, entries: dict[str, torch.Tensor]) -> None:
        """`rid` arriving with another proposer's `export` of it (its pages are reserved)."""


class DSparkProposer:
    """The DSpark draft on the same ranks as the target, sharing its embedding and lm_head and
    its KV page tables (a committed token sits in the same slot in both caches)."""

    def __init__(
        self,
        draft: DSparkDraft,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        allocator: PagedAllocator,
    ) -> None:
        self.draft = draft
        self.gamma = draft.config.block_size
        self.tap_layers = tuple(draft.config.target_layer_ids)
        # The configured KV heads of its context cache (all ranks'): a hand-over re-splits
        # the cache by them (handoff.reshard).
        self.kv_heads = draft.config.num_key_value_heads
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.cache: PagedKVCache = draft.new_cache(
            allocator.capacity_tokens, allocator.page_size, allocator=allocator
        )
        # Taps of committed tokens not yet in the context cache, per request, in order. The
        # context rows are written when the request is next drafted for (or its pages are
        # exported or shared), so a step the verify budget decodes plainly only keeps its
        # taps: writing every request's row every step cost a plain step at 16 requests 2-3%.
        self.held: dict[Hashable, list[torch.Tensor]] = {}
        self.held_tokens: dict[Hashable, int] = {}

    def add(self, rid: Hashable, cached: int = 0) -> None:
        self.cache.add(rid, cached)

    def free(self, rid: Hashable) -> None:
        self.held.pop(rid, None)
        self.held_tokens.pop(rid, None)
        if rid in self.cache:
            self.cache.free(rid)

    def export(self, rid: Hashable) -> dict[str, torch.Tensor]:
        # The context rows (k/v of every draft layer) of the committed tokens.
        self.settle([rid])
        return self.cache.export(rid)

    def adopt(self, rid: Hashable, entries: dict[str, torch.Tensor]) -> None:
        self.cache.adopt(rid, entries)

    def append(self, rids: Seq[Hashable], taps: Seq[torch.Tensor | None]) -> None:
        rows = [t for t in taps if t is not None]
        assert len(rows) == len(rids), "DSpark needs the target's taps for every commit"
        full = []
        for rid, row in zip(rids, rows, strict=True):
            self.held.setdefault(rid, []).append(row)
            self.held_tokens[rid] = self.held_tokens.get(rid, 0) + len(row)
            if self.held_tokens[rid] >= HOLD_TOKENS:
                full.append(rid)
        self.settle(full)

    def settle(self, rids: Seq[Hashable]) -> None:
        """One batched projection of every held-back row of `rids`."""
        ready = [rid for rid in dict.fromkeys(rids) if rid in self.held]
        if ready:
            rows = [torch.cat(self.held.pop(rid)) for rid in ready]
            for rid in ready:
                del self.held_tokens[rid]
            self.draft.append_context(self.cache, ready, rows)

    def commit(self, rids: Seq[Hashable], lengths: Seq[int]) -> None:
        # The draft caches context rows of committed tokens only (`append`), so none of its
        # state runs ahead of a commit and this truncation keeps everything; it rolls back
        # through the same protocol as the target's cache all the same.
        self.cache.commit(rids, lengths)

    def propose(self, seqs: Seq[Sequence], masks: DraftMask | None = None) -> DraftOutput:
        rids = [s.request_id for s in seqs]
        self.settle(rids)
        anchors = torch.tensor([s.anchor for s in seqs])
        temps = torch.tensor([0.0 if s.params.greedy else s.params.temperature for s in seqs])
        return self.draft.draft(self.cache, rids, anchors, self.embed_tokens, self.lm_head,
                                temps, [s.generator for s in seqs], masks)

    @torch.no_grad()
    def follow_propose(self, rids: Seq[Hashable], anchors: torch.Tensor) -> None:
        self.settle(rids)
        self.draft.block_hidden(self.cache, rids, anchors, self.embed_tokens)
