"""Runs the target and the proposer on one rank; under tensor parallelism, keeps ranks in step.

Rank 0 decides everything (scheduling, sampling, acceptance). Each operation that touches a
model or a cache is broadcast to the follower ranks first, so every rank runs the same forward
(their all-reduces meet) and keeps identical page tables. Followers never sample.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from serve_app.config import PrefixCacheConfig
from serve_app.engines.reference.handoff import RankShare, reshard
from serve_app.engines.reference.images import PromptImages
from serve_app.engines.reference.prefix_cache import PrefixCache
from serve_app.engines.reference.proposer import Proposer
from serve_app.grammar.matchers import DraftMasks
from serve_app.models.kv_cache import PagedAllocator
from serve_app.models.target import Collectives, Target, TargetCache, WindowedState
from serve_app.protocol.media import ImageInput


class ModelRunner:
    def __init__(
        self,
        target: Target,
        proposer: Proposer | None,
        allocator: PagedAllocator,
        tp_rank: int = 0,
        tp_size: int = 1,
        group: Collectives | None = None,
        prefix_cache: PrefixCacheConfig | None = None,
        images: PromptImages | None = None,
    ) -> None:
        """`prefix_cache`: its settings, or None for no prefix cache. `images`: the target's
        vision tower and the image features of requests in prefill (images.py), or None: this
        runner takes no images."""
        self.target = target
        self.images = images
        self.proposer = proposer
        self.allocator = allocator
        self.cache: TargetCache = target.new_cache(
            allocator.capacity_tokens, allocator.page_size, allocator=allocator
        )
        # Everything of a request that a verify window runs ahead on (target.py).
        self.windowed: list[WindowedState] = [self.cache]
        if proposer is not None:
            self.windowed.append(proposer)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.group = group
        self._taps: torch.Tensor | None = None
        self._tap_rids: list[Hashable] = []
        # The same tree on every rank: every operation that changes it is broadcast.
        self.prefix: PrefixCache | None = None
        if prefix_cache is not None:
            self.prefix = PrefixCache(allocator, self.cache.checkpoints, prefix_cache)

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @property
    def state_slots(self) -> int | None:
        """Per-request state slots of the target's cache (one per running request), or None."""
        return self.cache.state_slots

    # --- the protocol between rank 0 and followers ------------------------------------------

    def _broadcast(self, op: str, *args: Any) -> None:
        if self.tp_size > 1 and self.tp_rank == 0:
            assert self.group is not None
            self.group.broadcast_object((op, args))

    def follow(self) -> None:
        """Followers: execute rank 0's operations until it shuts down."""
        assert self.group is not None
        while True:
            op, args = self.group.broadcast_object(None)
            if op == "shutdown":
                return
            getattr(self, "_" + op)(*args)

    def shutdown(self) -> None:
        self._broadcast("shutdown")

    # --- operations (public = rank 0 entry point, _private = what every rank runs) ----------

    def add(self, rid: Hashable, prompt: Sequence[int] = (),
            images: Sequence[ImageInput] = ()) -> int:
        """A new request; with the prefix cache, its prompt's longest usable cached prefix
        starts its caches (`prompt`: its cache keys, protocol/media.py's `cache_keys`: an
        image's pad run keyed on its pixels). `images`: its images, which every rank's tower
        turns into features at its first prefill chunk. Returns how many prompt tokens are
        cached (to skip in prefill)."""
        if images and self.images is None:
            raise ValueError("images: this engine's model has no vision tower")
        self._broadcast("add", rid, list(prompt), tuple(images))
        return self._add(rid, prompt, images)

    def _add(self, rid: Hashable, prompt: Sequence[int] = (),
             images: Sequence[ImageInput] = ()) -> int:
        if images:
            assert self.images is not None
            self.images.add(rid, images)
        match = self.prefix.match(prompt, rid) if self.prefix is not None and prompt else None
        cached = match.length if match is not None else 0
        self.allocator.add(rid, match.pages if match is not None else ())
        self.cache.add(rid, cached, match.snapshot if match is not None else None)
        if self.proposer is not None:
            self.proposer.add(rid, cached)
        return cached

    def free(self, rid: Hashable, donate: Sequence[int] = ()) -> None:
        """The request is done. `donate`: its first committed tokens, for the prefix cache to
        keep (SGLang's cache_finished_req); nothing for an abort or a failure."""
        self._broadcast("free", rid, list(donate))
        self._free(rid, donate)

    def _free(self, rid: Hashable, donate: Sequence[int] = ()) -> None:
        if self.images is not None:
            self.images.free(rid)
        if rid not in self.allocator:
            if self.prefix is not None:
                self.prefix.unlock(rid)
            return
        if self.prefix is not None:
            if donate:
                self._store_prefixes({rid: list(donate)})
            self.prefix.unlock(rid)
        for state in self.windowed:
            state.free(rid)
        self.allocator.free(rid)

    def _store_prefixes(self, tokens: dict[Hashable, list[int]]) -> None:
        """Each request's `tokens` into the prefix cache, with the pages holding them."""
        assert self.prefix is not None
        if self.proposer is not None:
            # Another request matching these pages reads the draft's rows in them too.
            self.proposer.settle(list(tokens))
        for rid, ids in tokens.items():
            self.prefix.store(rid, ids, self.allocator.pages(rid))

    def export(self, rid: Hashable) -> list[RankShare]:
        """Every rank's copy of what its caches hold of `rid` (committed, outside a verify
        window), in rank order: the target's and the draft's (handoff.py)."""
        self._broadcast("export", rid)
        shares = self._export(rid)
        assert shares is not None
        return shares

    def _export(self, rid: Hashable) -> list[RankShare] | None:
        share: RankShare = {"target": self.cache.export(rid)}
        if self.proposer is not None:
            share["draft"] = self.proposer.export(rid)
        if self.tp_size == 1:
            return [share]
        assert self.group is not None
        return self.group.gather_object(share)

    def adopt(self, rid: Hashable, length: int, shares: Sequence[RankShare]) -> None:
        """`rid` arrives with `length` tokens in its caches, each rank taking its share of
        another engine's `export`, re-split first when that engine ran another tensor-parallel
        size (handoff.reshard; ValueError where the layouts do not allow it). All or nothing."""
        if any(("draft" in share) != (self.proposer is not None) for share in shares):
            raise ValueError("the hand-over and this engine disagree on having a draft")
        shares = reshard(list(shares), self.tp_size, getattr(self.proposer, "kv_heads", None))
        self._broadcast("adopt", rid, length, shares)
        self._adopt(rid, length, shares)

    def _adopt(self, rid: Hashable, length: int, shares: Sequence[RankShare]) -> None:
        share = shares[self.tp_rank]
        self.allocator.add(rid)
        adopted: list[Any] = []
        try:
            # The pages first (target and draft share them; pages only the prefix tree holds
            # make room, as for a forward), then each cache's entries.
            if self.prefix is not None:
                short = self.allocator.shortfall({rid: length})
                if short:
                    self.prefix.evict(short)
            self.allocator.reserve(rid, length)
            self.cache.adopt(rid, share["target"])
            adopted.append(self.cache)
            if self.proposer is not None:
                self.proposer.adopt(rid, share["draft"])
        except BaseException:
            for state in adopted:
                state.free(rid)
            self.allocator.free(rid)
            raise

    def forward(
        self, rows: Sequence[Sequence[int]], rids: Sequence[Hashable], capture: bool,
        verify: bool = False, last_only: bool = False,
    ) -> torch.Tensor:
        """Append `rows[i]` to request rids[i] in the target cache and return logits
        [B, T, V] (float32; [B, 1, V] of each row's last token with `last_only`). With
        `capture`, the proposer's tap rows are kept for `commit`; `verify` marks a speculative
        window, of which `commit` keeps a prefix."""
        self._broadcast("forward", [list(r) for r in rows], list(rids), capture, verify,
                        last_only)
        return self._forward(rows, rids, capture, verify, last_only)

    @torch.no_grad()
    def _forward(
        self, rows: Sequence[Sequence[int]], rids: Sequence[Hashable], capture: bool,
        verify: bool = False, last_only: bool = False,
    ) -> torch.Tensor:
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        num_new = torch.tensor([len(r) for r in rows], dtype=torch.long)
        if self.prefix is not None:
            # Pages only the tree holds make room first (admission counted them reclaimable).
            short = self.allocator.shortfall(
                {rid: self.cache.length(rid) + len(r) for rid, r in zip(rids, rows, strict=True)})
            if short:
                self.prefix.evict(short)
        embeds = None
        if self.images is not None and self.images.any(rids):
            # A prefill chunk of an image prompt: the pad positions take the image's features.
            embeds = F.embedding(ids.to(self.device), self.target.embed_weight)
            self.images.splice(embeds, rids, [self.cache.length(r) for r in rids],
                               num_new.tolist())
        layers = self.proposer.tap_layers if capture and self.proposer is not None else ()
        out = self.target(ids.to(self.device), self.cache, list(rids), num_new.to(self.device),
                          capture_layers=layers, verify=verify, last_only=last_only,
                          inputs_embeds=embeds)
        self._taps = out.taps
        self._tap_rids = list(rids)
        return out.logits

    def commit(self, rids: Sequence[Hashable], lengths: Sequence[int],
               tap_rows: Sequence[int],
               cache_at: dict[Hashable, list[int]] | None = None) -> None:
        """Roll each request's windowed state back to `lengths[i]` tokens, and give the
        proposer the first `tap_rows[i]` rows of that request's taps from the last forward.
        `cache_at` (prefix cache): requests whose prefix goes into the cache now -> its tokens
        (SGLang's cache_unfinished_req), taken before the commit, so a length inside the
        verify window still has its state."""
        self._broadcast("commit", list(rids), list(lengths), list(tap_rows), cache_at)
        self._commit(rids, lengths, tap_rows, cache_at)

    def _commit(self, rids: Sequence[Hashable], lengths: Sequence[int],
                tap_rows: Sequence[int],
                cache_at: dict[Hashable, list[int]] | None = None) -> None:
        if self.proposer is not None and self._taps is not None:
            index = {rid: b for b, rid in enumerate(self._tap_rids)}
            width, rows = self._taps.shape[1], self._taps.unbind(0)
            # A whole row (every row of a plain step) is passed as a view: it shares the
            # forward's tensor with the other requests' rows, which they hold too (a copy per
            # request cost a plain step at 32 requests ~0.5%). A verify window's accepted
            # prefix is copied, so that its rejected rows are not held with it.
            taps = [rows[index[rid]] if n == width else rows[index[rid]][:n].clone()
                    for rid, n in zip(rids, tap_rows, strict=True)]
            self.proposer.append(rids, taps)
        if cache_at and self.prefix is not None:
            self._store_prefixes(cache_at)
        for state in self.windowed:
            state.commit(rids, lengths)
        for rid, n in zip(rids, lengths, strict=True):
            # Pages past the committed length (a rejected verify tail) go back to the pool.
            self.allocator.truncate(rid, n)

    def propose(self, seqs: Sequence[Any]) -> Any:
        """Drafts for `seqs`, each block position of a constrained request masked by its
        grammar (rank 0 alone chooses drafts, so followers never see the masks)."""
        assert self.proposer is not None
        rids = [s.request_id for s in seqs]
        self._broadcast("follow_propose", rids, torch.tensor([s.anchor for s in seqs]))
        grammars = [s.grammar for s in seqs]
        masks = DraftMasks(grammars) if any(g is not None for g in grammars) else None
        return self.proposer.propose(seqs, masks)

    def _follow_propose(self, rids: Sequence[Hashable], anchors: torch.Tensor) -> None:
        assert self.proposer is not None
        self.proposer.follow_propose(rids, anchors)
