"""The contract between the reference engine and a target model: what the engine calls, what it
gets back, and what a target's cache does for a request. Both targets implement it (K3's
`PagedK3` + `HybridCache` in k3_paged.py, the K2-layout `KimiForCausalLM` + `PagedKVCache`),
and tests/test_target_contract.py checks them against it, so the engine, scheduler and model
runner never ask which family they run.

A request's engine state is of two kinds:

- **pages** (the MLA latents, the draft's context rows): a `PagedAllocator` owns them; the
  prefix cache shares full pages between requests.
- **per-request state a token list cannot rebuild** (K3's KDA conv windows and recurrent states):
  one slot per running request (`state_slots`), and copies of it at chosen positions
  (`StateCheckpoints`), which the prefix cache keeps beside its pages. A cache without such
  state has `state_slots = None` and `checkpoints = None`.

Everything of a request that a speculative window can run ahead on rolls back through one
protocol, `WindowedState.commit(rids, lengths)`: the target cache, the proposer, and any later
per-request state (a grammar matcher) alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from serve_app.models.kv_cache import PagedAllocator


class Collectives(Protocol):
    """A tensor-parallel group's collectives (implementations: engines/reference/
    collectives.py, torch.distributed's or shared memory between ranks on one host)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum `x` over the group, in place."""

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable), returned on every rank."""

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` in rank order at rank 0; None elsewhere."""

    def barrier(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TPContext:
    """Where this replica of the modules sits in its tensor-parallel group (`group` None:
    torch.distributed's default group)."""

    rank: int = 0
    size: int = 1
    group: Collectives | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.group is not None:
                self.group.all_reduce(x)
            else:
                dist.all_reduce(x)
        return x


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, vocab] float32 ([B, 1, vocab] with last_only)
    taps: torch.Tensor | None  # [B, T, len(capture_layers) * hidden], or None if none requested


def last_new(h: torch.Tensor, num_new: torch.Tensor) -> torch.Tensor:
    """Each row's last new position of h [B, T, ...] -> [B, 1, ...] (a row with no new token
    gives its position 0, whose logits nobody reads)."""
    rows = torch.arange(h.shape[0], device=h.device)
    return h[rows, (num_new.to(h.device) - 1).clamp(min=0)].unsqueeze(1)


class TargetConfig(Protocol):
    """What the engine reads of a target's config.json."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | list[int] | None: ...

    @property
    def max_position_embeddings(self) -> int: ...


@runtime_checkable
class WindowedState(Protocol):
    """Per-request state that a verify window runs ahead on."""

    def commit(self, rids: Sequence[Hashable], lengths: Sequence[int]) -> None:
        """Keep `lengths[i]` tokens of rids[i]: after a verify window, a length inside it (the
        accepted prefix); otherwise the length the last forward left."""

    def free(self, rid: Hashable) -> None: ...


@runtime_checkable
class StateCheckpoints(Protocol):
    """Copies of a request's per-request state at a position, for the prefix cache to start
    later requests from. Slots are few: `checkpoint` returns None when none is free, and the
    prefix cache decides what to evict (prefix_cache.py: one rule for prefill and decode)."""

    def checkpoint(self, rid: Hashable, position: int) -> int | None:
        """A copy of `rid`'s state after its first `position` tokens (its committed length, or
        a position inside its last verify window before that window is committed): the
        checkpoint's key, or None when every checkpoint slot is taken."""

    def drop_checkpoint(self, key: int) -> None: ...


@runtime_checkable
class TargetCache(WindowedState, Protocol):
    """A target's cache for the requests of one rank."""

    @property
    def device(self) -> torch.device: ...

    @property
    def state_slots(self) -> int | None:
        """Per-request state slots (one per running request), or None: no such state."""

    @property
    def checkpoints(self) -> StateCheckpoints | None:
        """Where the prefix cache takes state copies from; None: pages alone are a prefix."""

    def add(self, rid: Hashable, cached: int = 0, checkpoint: int | None = None) -> None:
        """A new request whose first `cached` tokens are in its (shared) pages already, and
        whose state starts from `checkpoint` (a prefix-cache hit) or from nothing."""

    def length(self, rid: Hashable) -> int: ...

    def __contains__(self, rid: Hashable) -> bool: ...

    def export(self, rid: Hashable) -> dict[str, torch.Tensor]:
        """A copy of everything this rank holds of `rid` (committed, outside a verify window),
        as named tensors: with the request's tokens, what another cache of the same layout
        needs to continue it exactly (`adopt`; prefill/decode disaggregation)."""

    def adopt(self, rid: Hashable, entries: dict[str, torch.Tensor]) -> None:
        """A request arriving with another cache's `export` of it; all or nothing."""


@runtime_checkable
class Target(Protocol):
    """A target model on one rank, as the engine runs it."""

    @property
    def config(self) -> TargetConfig: ...

    @property
    def embed_weight(self) -> torch.Tensor:
        """The embedding the DSpark draft shares."""

    @property
    def lm_head_weight(self) -> torch.Tensor: ...

    def new_cache(self, capacity_tokens: int, page_size: int = 16,
                  allocator: PagedAllocator | None = None) -> TargetCache: ...

    def __call__(self, input_ids: torch.Tensor, cache: TargetCache, rids: Sequence[Hashable],
                 num_new: torch.Tensor, capture_layers: Sequence[int] = (),
                 verify: bool = False, last_only: bool = False,
                 inputs_embeds: torch.Tensor | None = None) -> TargetOutput:
        """Append num_new[b] tokens (row b of input_ids [B, T], right-padded) to each request
        in `cache` and return their logits; `verify` marks a speculative window, of which the
        next `cache.commit` keeps a prefix. `inputs_embeds` [B, T, hidden], when given, is the
        layers' input in place of input_ids' embeddings (an image prompt's prefill: its pad
        positions hold the image's features, engines/reference/images.py). With `last_only`, the logits of each row's last new
        token alone (`last_new`): a prefill chunk samples from nothing else, and every
        position's would cost [T, vocab] (an 8,192-token chunk of a 163,840-token vocabulary:
        5 GiB in fp32). A KVCapacityError leaves the cache untouched."""
