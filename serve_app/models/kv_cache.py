"""Paged token-slot allocation and the DSpark draft's context KV cache.

Every request owns a list of fixed-size pages; the token at absolute position p of a request
lives in slot `page[p // page_size] * page_size + p % page_size` of a flat pool. The target's latent
cache and the draft's context cache index the same way, so one allocator can serve both: a token
committed at position p occupies the same slot in each.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from serve_app.models.kv_capacity import KVCapacityError


class PagedAllocator:
    """Page tables over a pool of `num_pages * page_size` token slots.

    Pages are reference-counted: a request holds each page of its table, and the prefix cache
    holds the pages it keeps (`hold` / `release`), so a cached prefix's pages can start several
    requests' tables (`add(rid, prefix_pages)`). A page returns to the pool when its last holder
    lets go. It never calls back into a holder: whoever runs a forward asks `shortfall` first
    and has the prefix cache let go of that many pages (model_runner.py)."""

    def __init__(self, capacity_tokens: int, page_size: int = 16) -> None:
        if capacity_tokens < page_size or page_size <= 0:
            raise ValueError(
                f"capacity_tokens={capacity_tokens} must be >= page_size={page_size} > 0"
            )
        self.page_size = page_size
        self.num_pages = capacity_tokens // page_size
        self._free_pages: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._refs = [0] * self.num_pages
        self._pages: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def used_tokens(self) -> int:
        return self.capacity_tokens - self.free_tokens

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._pages

    def length(self, rid: Hashable) -> int:
        return self._lengths[rid]

    def pages(self, rid: Hashable) -> list[int]:
        return list(self._pages[rid])

    def pages_needed(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def add(self, rid: Hashable, prefix_pages: Sequence[int] = ()) -> None:
        """A page table for `rid`, starting with `prefix_pages` (full pages someone already
        holds: a cached prefix), of which it takes a reference each."""
        if rid in self._pages:
            raise KeyError(f"request {rid!r} already has a page table")
        for page in prefix_pages:
            self.hold(page)
        self._pages[rid] = list(prefix_pages)
        self._lengths[rid] = len(prefix_pages) * self.page_size

    def hold(self, page: int) -> None:
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is free: nothing to hold")
        self._refs[page] += 1

    def release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free_pages.append(page)

    def shortfall(self, lengths: Mapping[Hashable, int]) -> int:
        """Pages missing from the free pool for every request to reach its length here."""
        extra = sum(max(0, self.pages_needed(n) - len(self._pages[rid]))
                    for rid, n in lengths.items())
        return max(0, extra - len(self._free_pages))

    def reserve(self, rid: Hashable, length: int) -> None:
        """Make room for positions [0, length) of `rid`; all or nothing."""
        pages = self._pages[rid]
        extra = self.pages_needed(length) - len(pages)
        if extra > len(self._free_pages):
            raise KVCapacityError(
                f"request {rid!r} needs {extra * self.page_size} more KV tokens "
                f"(length {length}); {self.free_tokens} of {self.capacity_tokens} are free"
            )
        for _ in range(max(extra, 0)):
            page = self._free_pages.pop()
            self._refs[page] = 1
            pages.append(page)
        self._lengths[rid] = max(self._lengths[rid], length)

    def truncate(self, rid: Hashable, length: int) -> None:
        """Forget positions >= length and let go of whole pages past it."""
        pages = self._pages[rid]
        keep = self.pages_needed(length)
        while len(pages) > keep:
            self.release(pages.pop())
        self._lengths[rid] = min(self._lengths[rid], length)

    def free(self, rid: Hashable) -> None:
        for page in reversed(self._pages.pop(rid)):
            self.release(page)
        del self._lengths[rid]

    def slots(self, rid: Hashable, start: int, end: int) -> torch.Tensor:
        """Pool slots of positions [start, end) of `rid` (already reserved)."""
        pages, size = self._pages[rid], self.page_size
        if end - start <= size:
            # A decode step's few positions: a list, not the whole page table as a tensor
            # (which grows with the request; this runs for every request every step).
            return torch.tensor([pages[p // size] * size + p % size for p in range(start, end)],
                                dtype=torch.long)
        pos = torch.arange(start, end)
        table = torch.tensor(pages, dtype=torch.long)
        return table[pos // size] * size + pos % size

    def batch_slots(
        self, rids: Sequence[Hashable], lengths: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Lmax] slots of positions [0, length) per request, padded with slot 0, and the
        [B, Lmax] validity mask."""
        lengths = [self._lengths[r] for r in rids] if lengths is None else list(lengths)
        lmax = max(lengths, default=0)
        index = torch.zeros(len(rids), lmax, dtype=torch.long)
        valid = torch.arange(lmax)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
        for b, (rid, n) in enumerate(zip(rids, lengths, strict=True)):
            if n:
                index[b, :n] = self.slots(rid, 0, n)
        return index, valid


@dataclass
class PagedBatch:
    """What a paged attention layer needs about a batch of right-padded new rows, computed once
    per forward (every layer of the model reads the same one).

    Where rows are padded the model keeps its residual stream packed, the real tokens only in
    row-major order, [1, N, ...] (a 16-request verify whose windows average 5 tokens runs 80
    positions, not 128): `pack` and `unpack` move a tensor between that layout and the rows'
    [B, T, ...]. Without padding both layouts are the rows' and both are the identity."""

    valid: torch.Tensor  # [B, T] bool: real (not padding) new tokens
    slots: torch.Tensor  # [N_valid] cache slots of the valid new tokens, row-major order
    context_index: torch.Tensor  # [B, Lc] cache slots of already-cached tokens (padded)
    # [B, 1, heads * T, Lc + T] bool: key visible to query; rows head-major, as MLA folds its
    # queries (layers.MLAProjections.attend)
    mask: torch.Tensor
    packed: tuple[torch.Tensor, torch.Tensor] | None  # valid.nonzero() if a row is padded

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> the stream's layout."""
        return x if self.packed is None else x[self.packed][None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """The stream's layout -> [B, T, ...], zeros at the padding (a pad's output is never
        read: every block is causal, and only real tokens are committed)."""
        if self.packed is None:
            return x
        out = x.new_zeros((*self.valid.shape, *x.shape[2:]))
        out[self.packed] = x[0]
        return out


class PagedKVCache:
    """Per-layer cache entries of committed tokens, in named buffers of shape
    [num_layers, slots, *entry_shape]: `k`/`v` for the draft's context rows, `latent` for the
    target's MLA latent + rope key.

    A request's cached length may lag its allocator length when the allocator is shared with
    another cache that runs ahead (the target verifies tokens the draft never caches).
    """

    def __init__(
        self,
        num_layers: int,
        entry_shapes: Mapping[str, tuple[int, ...]],
        capacity_tokens: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        allocator: PagedAllocator | None = None,
    ) -> None:
        self._owns_allocator = allocator is None
        self.allocator = allocator or PagedAllocator(capacity_tokens, page_size)
        slots = self.allocator.capacity_tokens
        self.buffers = {
            name: torch.zeros((num_layers, slots, *shape), dtype=dtype, device=device)
            for name, shape in entry_shapes.items()
        }
        self._lengths: dict[Hashable, int] = {}

    @property
    def device(self) -> torch.device:
        return next(iter(self.buffers.values())).device

    # No per-request state beyond the pages (target.py's TargetCache): a prefix of pages is a
    # prefix of the cache.
    state_slots: None = None
    checkpoints: None = None

    def add(self, rid: Hashable, cached: int = 0, checkpoint: None = None) -> None:
        """A new request; `cached` leading tokens are already in its (shared) pages."""
        if checkpoint is not None:
            raise ValueError("a paged KV cache keeps no state checkpoints")
        if rid not in self.allocator:
            self.allocator.add(rid)
        self._lengths[rid] = cached

    def free(self, rid: Hashable) -> None:
        self._lengths.pop(rid)
        if self._owns_allocator:
            self.allocator.free(rid)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._lengths

    def length(self, rid: Hashable) -> int:
        return self._lengths[rid]

    def truncate(self, rid: Hashable, length: int) -> None:
        """Roll back to `length` cached tokens."""
        self._lengths[rid] = min(self._lengths[rid], length)
        if self._owns_allocator:
            self.allocator.truncate(rid, length)

    def commit(self, rids: Sequence[Hashable], lengths: Sequence[int]) -> None:
        """Keep `lengths[i]` tokens of each request (after a verify: its accepted prefix)."""
        for rid, length in zip(rids, lengths, strict=True):
            self.truncate(rid, length)

    def export(self, rid: Hashable) -> dict[str, torch.Tensor]:
        """A copy of `rid`'s cached entries, per buffer [num_layers, length, *entry_shape]: what
        another cache of the same layout needs to continue it (`adopt`)."""
        slots = self.allocator.slots(rid, 0, self._lengths[rid]).to(self.device)
        return {name: buf[:, slots].clone() for name, buf in self.buffers.items()}

    def adopt(self, rid: Hashable, entries: Mapping[str, torch.Tensor]) -> None:
        """A request arriving with its entries (another cache's `export`), as if its tokens had
        been appended here. All or nothing: on KVCapacityError the request is not added."""
        if set(entries) != set(self.buffers):
            raise ValueError(f"entries {sorted(entries)} do not match this cache's buffers "
                             f"{sorted(self.buffers)}")
        length = next(iter(entries.values())).shape[1]
        for name, buf in self.buffers.items():
            if entries[name].shape != (buf.shape[0], length, *buf.shape[2:]):
                raise ValueError(f"{name} entries of shape {tuple(entries[name].shape)} do not "
                                 f"fit this cache's {tuple(buf.shape[:1] + buf.shape[2:])} "
                                 f"layout")
        self.add(rid)
        try:
            slots = self.reserve_append([rid], [length])
        except BaseException:
            self.free(rid)
            raise
        for name, buf in self.buffers.items():
            buf[:, slots] = entries[name].to(device=buf.device, dtype=buf.dtype)

    def reserve_append(self, rids: Sequence[Hashable], counts: Sequence[int]) -> torch.Tensor:
        """Reserve room for `counts[i]` new entries after each request's cached tokens; returns
        their flat slots (concatenated in request order) and advances the lengths. All or
        nothing: on KVCapacityError no length has moved."""
        starts = [self._lengths[r] for r in rids]
        for rid, start, n in zip(rids, starts, counts, strict=True):
            self.allocator.reserve(rid, start + n)
        slots = [self.allocator.slots(r, s, s + n) for r, s, n in zip(rids, starts, counts, strict=True)]
        for rid, start, n in zip(rids, starts, counts, strict=True):
            self._lengths[rid] = start + n
        return torch.cat(slots).to(self.device) if slots else torch.zeros(0, dtype=torch.long)

    def context(self, rids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Lmax] slots of every cached entry per request and the validity mask."""
        index, valid = self.allocator.batch_slots(rids, [self._lengths[r] for r in rids])
        return index.to(self.device), valid.to(self.device)

    def batch(self, rids: Sequence[Hashable], starts: Sequence[int], counts: Sequence[int],
              slots: torch.Tensor, t: int, heads: int) -> PagedBatch:
        """The PagedBatch of rows of `counts[b]` new tokens after `starts[b]` cached ones, whose
        slots `reserve_append` gave."""
        dev = slots.device
        context_index, context_valid = self.allocator.batch_slots(rids, starts)
        count = torch.tensor(list(counts), dtype=torch.long, device=dev)
        steps = torch.arange(t, device=dev)
        # Causal over the new tokens. Rows are right-padded, so causality alone hides padded keys
        # from every valid query, and a padded query still sees itself (no empty row, no NaN).
        new_mask = (steps[None, :] <= steps[:, None]).expand(len(starts), -1, -1)  # [B, T, T]
        ctx_mask = context_valid.to(dev)[:, None, :].expand(-1, t, -1)
        mask = torch.cat([ctx_mask, new_mask], dim=-1)[:, None].repeat(1, 1, heads, 1)
        valid = steps[None, :] < count[:, None]
        packed = valid.nonzero(as_tuple=True) if sum(counts) < len(counts) * t else None
        return PagedBatch(valid=valid, slots=slots, context_index=context_index.to(dev),
                          mask=mask, packed=packed)
