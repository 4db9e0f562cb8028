"""Kimi K3 as the reference engine runs it: MLA latents in the paged KV pool, KDA states in fixed
per-request slots, and a verify window whose KDA state is rolled back at commit.

`PagedK3` puts a K3ForCausalLM behind the engine's target contract (target.py: `new_cache`, and
a forward over right-padded rows of many requests that appends to the cache). Its cache,
`HybridCache` (a TargetCache with StateCheckpoints), holds per request

- the MLA layers' latent entries [kv_lora_rank + qk_rope_head_dim] per token, in pages shared
  with the DSpark draft's context cache (one allocator);
- one slot of the `KDAStatePool`: every KDA layer's conv window and recurrent state,
  constant in context length, taken at admission and given back at finish or abort.

A forward's attention layers read and write these through `PagedStates` (k3.py's LayerStates
seam). A prefill chunk or a plain decode step writes the KDA states in place (the chunk is
always committed whole). A verify window (`verify=True`) leaves the slots untouched and keeps
what commit needs to pick the state after the last accepted position, by one of SGLang's two
strategies (`rollback`):

- "scratch": the state after every window position (`forward_window`); commit copies the
  accepted position's state and conv window into the slot (scatter_mamba_states_after_mtp_verify).
- "replay": the window computed lazily (`forward_logged`: outputs from the chunk form, no
  per-position state); commit forms only the accepted position's state from the slot's state
  and the window's solved corrections (SGLang's --enable-linear-replayssm-spec keeps the inputs
  and replays). Less scratch and less work in the verify; a little more at commit.

`HybridCache.commit(rids, lengths)` (or `truncate` for one request) keeps n tokens per request,
n inside the last verify window (the MLA latents roll back by truncation). `checkpoint` copies
a request's state at its length, or at a position inside its verify window, into a snapshot
slot for the prefix cache, which decides when and what to evict (prefix_cache.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Literal

import torch

from serve_app.models.k3 import K3ForCausalLM
from serve_app.models.k3_blocks import K3MLA
from serve_app.models.kda import (
    KDAState,
    KDAWindowLog,
    KDAWindowStates,
    KimiDeltaAttention,
    replay_layers,
)
from serve_app.models.kv_cache import PagedAllocator, PagedBatch, PagedKVCache
from serve_app.models.kv_capacity import KVCapacityError
from serve_app.models.target import TargetOutput, last_new

Rollback = Literal["scratch", "replay"]


class KDAStatePool:
    """`num_slots` complete KDA states (every KDA layer of this rank's heads): conv [layers,
    slots, K−1, 3P/t] in the weights' dtype and ssm [layers, slots, h/t, D, D] fp32, SGLang's
    MambaPool layout, and per layer a KDAState of views of them (`layers`). A slot is zeroed
    when it is taken (a fresh request). The layers are stacked so that what moves a slot's
    whole state (a commit, a snapshot, a new request) is one operation, not one per layer."""

    def __init__(self, model: K3ForCausalLM, num_slots: int) -> None:
        """Keys (`take`) are request ids, or any hashable (the prefix cache's snapshot ids)."""
        if num_slots <= 0:
            raise ValueError(f"state slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        device = model.model.embed_tokens.weight.device
        kda = {i: layer.self_attn.new_state(num_slots, device)
               for i, layer in enumerate(model.model.layers)
               if isinstance(layer.self_attn, KimiDeltaAttention)}
        self.conv = torch.stack([s.conv for s in kda.values()])
        self.ssm = torch.stack([s.ssm for s in kda.values()])
        self.layers: dict[int, KDAState] = {
            i: KDAState(self.conv[j], self.ssm[j]) for j, i in enumerate(kda)}
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot: dict[Hashable, int] = {}

    @property
    def bytes_per_slot(self) -> int:
        """What one request's state occupies on this rank (conv + recurrent, all KDA layers)."""
        return sum((s.conv[0].nbytes + s.ssm[0].nbytes) for s in self.layers.values())

    @property
    def used(self) -> int:
        return len(self._slot)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._slot

    def slot(self, rid: Hashable) -> int:
        return self._slot[rid]

    def take(self, rid: Hashable) -> int:
        if rid in self._slot:
            raise KeyError(f"request {rid!r} already holds state slot {self._slot[rid]}")
        if not self._free:
            raise KVCapacityError(f"all {self.num_slots} KDA state slots are in use")
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        self._slot[rid] = slot
        return slot

    def give_back(self, rid: Hashable) -> None:
        self._free.append(self._slot.pop(rid))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def copy(self, src: KDAStatePool, src_slot: int, dst_slot: int) -> None:
        """Slot `dst_slot` of this pool becomes slot `src_slot` of `src` (same layout)."""
        self.conv[:, dst_slot] = src.conv[:, src_slot]
        self.ssm[:, dst_slot] = src.ssm[:, src_slot]

    def read(self, layer: int, slots: torch.Tensor) -> KDAState:
        """The states of `slots` [B] at one layer (a copy)."""
        state = self.layers[layer]
        return KDAState(state.conv[slots], state.ssm[slots])

    def write(self, layer: int, slots: torch.Tensor, new: KDAState) -> None:
        state = self.layers[layer]
        state.conv[slots] = new.conv.to(state.conv.dtype)
        state.ssm[slots] = new.ssm

    def write_all(self, slots: torch.Tensor, new: KDAState) -> None:
        """Every layer's states of `slots` [n] at once: new.conv [layers, n, K−1, 3P/t], new.ssm
        [layers, n, h/t, D, D], in `layers`' order."""
        self.conv[:, slots] = new.conv.to(self.conv.dtype)
        self.ssm[:, slots] = new.ssm


class HybridCache:
    """The paged MLA latent cache and the KDA state pool of one rank (see the module doc)."""

    def __init__(self, model: K3ForCausalLM, capacity_tokens: int, page_size: int,
                 allocator: PagedAllocator | None, state_slots: int, rollback: Rollback,
                 snapshot_slots: int = 0) -> None:
        config = model.config
        w = model.model.embed_tokens.weight
        self.mla_index = {layer: i for i, layer in enumerate(config.mla_layers)}
        self.latent = PagedKVCache(len(self.mla_index), {"latent": (config.mla_cache_dim,)},
                                   capacity_tokens, page_size, dtype=w.dtype, device=w.device,
                                   allocator=allocator)
        self.states = KDAStatePool(model, state_slots)
        # The prefix cache's KDA state snapshots (a slot each), taken where it asks (`checkpoint`).
        self.snapshots = KDAStatePool(model, snapshot_slots) if snapshot_slots else None
        self._snapshot_ids = itertools.count()
        self.rollback: Rollback = rollback
        # The last verify forward's KDA windows, per layer, and each of its requests' (row,
        # length before the window): what `truncate` commits from.
        self.windows: dict[int, KDAWindowStates | KDAWindowLog] = {}
        self.window_rows: dict[Hashable, tuple[int, int]] = {}

    @property
    def allocator(self) -> PagedAllocator:
        return self.latent.allocator

    @property
    def device(self) -> torch.device:
        return self.latent.device

    @property
    def state_slots(self) -> int:
        return self.states.num_slots

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self.latent

    def length(self, rid: Hashable) -> int:
        return self.latent.length(rid)

    @property
    def checkpoints(self) -> HybridCache:
        """The KDA state is what tokens alone cannot rebuild: the prefix cache checkpoints it
        here (target.py's StateCheckpoints)."""
        return self

    def add(self, rid: Hashable, cached: int = 0, checkpoint: int | None = None) -> None:
        """A new request: its page table (`cached` leading tokens already in its shared pages)
        and a state slot, zeroed or, after a prefix-cache hit, a copy of `checkpoint` (the
        state at `cached`). Both, or neither."""
        slot = self.states.take(rid)
        try:
            self.latent.add(rid, cached)
        except BaseException:
            self.states.give_back(rid)
            raise
        if checkpoint is not None:
            assert self.snapshots is not None
            self.states.copy(self.snapshots, self.snapshots.slot(checkpoint), slot)

    def checkpoint(self, rid: Hashable, position: int) -> int | None:
        """A snapshot slot with `rid`'s state after `position` tokens: its committed length, or
        a position inside its last verify window (before the window's commit; `replay` starts
        from the slot's pre-window state). Its key, or None if no snapshot slot is free."""
        window = self.window_rows.get(rid)
        length = self.latent.length(rid)
        if window is None and position != length:
            raise ValueError(f"request {rid!r}: no state at {position} tokens outside a verify "
                             f"window (it is at {length})")
        if window is not None and not window[1] < position <= length:
            raise ValueError(f"request {rid!r}: position {position} is outside its verify "
                             f"window ({window[1]}, {length}]")
        if self.snapshots is None or not self.snapshots.free_slots:
            return None
        key = next(self._snapshot_ids)
        target = self.snapshots.take(key)
        slot = self.states.slot(rid)
        if window is None:
            self.snapshots.copy(self.states, slot, target)
            return key
        row, start = window
        dev = self.device
        row_t, step_t, slot_t, target_t = (torch.tensor([v], device=dev)
                                           for v in (row, position - start - 1, slot, target))
        self.snapshots.write_all(target_t, self._states_at(row_t, step_t, slot_t))
        return key

    def drop_checkpoint(self, key: int) -> None:
        assert self.snapshots is not None
        self.snapshots.give_back(key)

    def export(self, rid: Hashable) -> dict[str, torch.Tensor]:
        """A copy of everything this rank holds of `rid` outside a verify window: its MLA
        latents [mla_layers, length, dim] and every KDA layer's conv window and recurrent
        state (`kda.{layer}.conv` [K−1, 3P/t], `kda.{layer}.ssm` [h/t, D, D]). With the tokens,
        it is the whole request: `adopt` on another cache continues it exactly."""
        if rid in self.window_rows:
            raise ValueError(f"request {rid!r} is inside an uncommitted verify window")
        out = {"latent": self.latent.export(rid)["latent"]}
        slot = self.states.slot(rid)
        for layer, state in self.states.layers.items():
            out[f"kda.{layer}.conv"] = state.conv[slot].clone()
            out[f"kda.{layer}.ssm"] = state.ssm[slot].clone()
        return out

    def adopt(self, rid: Hashable, entries: dict[str, torch.Tensor]) -> None:
        """A request arriving with another cache's `export` of it (the same layout: this
        rank's heads). All or nothing."""
        layers = self.states.layers
        expected = {"latent"} | {f"kda.{i}.{p}" for i in layers for p in ("conv", "ssm")}
        if set(entries) != expected:
            raise ValueError(f"hand-over entries {sorted(set(entries) ^ expected)} do not match "
                             "this model's layers")
        for layer, state in layers.items():
            for part, buf in (("conv", state.conv), ("ssm", state.ssm)):
                got = entries[f"kda.{layer}.{part}"]
                if got.shape != buf.shape[1:]:
                    raise ValueError(f"KDA layer {layer} {part} state of shape "
                                     f"{tuple(got.shape)} does not fit this rank's "
                                     f"{tuple(buf.shape[1:])} (a different tensor-parallel "
                                     "split?)")
        slot = self.states.take(rid)
        try:
            self.latent.adopt(rid, {"latent": entries["latent"]})
        except BaseException:
            self.states.give_back(rid)
            raise
        for layer, state in layers.items():
            state.conv[slot] = entries[f"kda.{layer}.conv"].to(state.conv.dtype)
            state.ssm[slot] = entries[f"kda.{layer}.ssm"].to(state.ssm.dtype)

    def free(self, rid: Hashable) -> None:
        self.window_rows.pop(rid, None)
        self.latent.free(rid)
        self.states.give_back(rid)

    def commit(self, rids: Sequence[Hashable], lengths: Sequence[int]) -> None:
        """Keep `lengths[i]` tokens of rids[i]. After a verify window: the KDA state after the
        window's position length − start − 1 goes into the slot (copied, or replayed; every
        request at once); the latents past the length are forgotten. Otherwise the length
        must be what the last forward left (a KDA state cannot go back without its window)."""
        rows, steps, slots = [], [], []
        for rid, length in zip(rids, lengths, strict=True):
            cached = self.latent.length(rid)
            window = self.window_rows.pop(rid, None)
            if window is None:
                if length != cached:
                    raise ValueError(f"request {rid!r}: a KDA state cannot roll back from "
                                     f"{cached} to {length} tokens outside a verify window")
                continue
            row, start = window
            if not start < length <= cached:
                raise ValueError(f"request {rid!r}: commit of {length} tokens is outside its "
                                 f"verify window ({start}, {cached}]")
            rows.append(row)
            steps.append(length - start - 1)
            slots.append(self.states.slot(rid))
        if rows:
            dev = self.device
            row_t, step_t, slot_t = (torch.tensor(v, dtype=torch.long, device=dev)
                                     for v in (rows, steps, slots))
            self.states.write_all(slot_t, self._states_at(row_t, step_t, slot_t))
        for rid, length in zip(rids, lengths, strict=True):
            self.latent.truncate(rid, length)

    def _states_at(self, rows: torch.Tensor, steps: torch.Tensor,
                   slots: torch.Tensor) -> KDAState:
        """Every KDA layer's state ([layers, n, ...], the pool's order) after window position
        steps[i] of the requests at window `rows` (whose committed states are in `slots`): the
        kept one (scratch) or a replay, of all layers at once."""
        windows = [self.windows[layer] for layer in self.states.layers]
        if all(isinstance(w, KDAWindowStates) for w in windows):
            return KDAState(torch.stack([w.conv[rows, steps] for w in windows]),
                            torch.stack([w.ssm[rows, steps] for w in windows]))
        logs = [w for w in windows if isinstance(w, KDAWindowLog)]
        assert len(logs) == len(windows)
        return replay_layers(logs, rows, self.states.ssm[:, slots], steps)

    def truncate(self, rid: Hashable, length: int) -> None:
        """`commit` of one request."""
        self.commit([rid], [length])

    def begin(self, rids: Sequence[Hashable], starts: Sequence[int], verify: bool) -> None:
        """A forward starts: the previous window is dropped (every request of it has been
        committed or freed), and a verify forward records its rows."""
        self.windows = {}
        self.window_rows = (
            {rid: (b, s) for b, (rid, s) in enumerate(zip(rids, starts, strict=True))}
            if verify else {}
        )


class PagedStates:
    """k3.LayerStates over a HybridCache for one forward of right-padded rows."""

    def __init__(self, cache: HybridCache, rids: Sequence[Hashable], counts: list[int],
                 batch: PagedBatch, verify: bool) -> None:
        self.cache, self.counts, self.batch, self.verify = cache, counts, batch, verify
        self.slots = torch.tensor([cache.states.slot(r) for r in rids], dtype=torch.long,
                                  device=cache.device)

    def mla(self, layer: int, attn: K3MLA, x: torch.Tensor) -> torch.Tensor:
        pool = self.cache.latent.buffers["latent"][self.cache.mla_index[layer]]
        return attn.forward_paged(x, self.batch, pool)

    def kda(self, layer: int, attn: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
        state = self.cache.states.read(layer, self.slots)
        if self.verify:
            # Right padding is harmless here: the recurrence is causal, and commit picks a
            # position inside each row's own tokens.
            if self.cache.rollback == "scratch":
                y, self.cache.windows[layer] = attn.forward_window(x, state, self.batch)
            else:
                y, self.cache.windows[layer] = attn.forward_logged(x, state, self.batch)
            return y
        return self.batch.pack(self._extend(layer, attn, self.batch.unpack(x), state))

    def _extend(self, layer: int, attn: KimiDeltaAttention, x: torch.Tensor,
                state: KDAState) -> torch.Tensor:
        pool = self.cache.states
        t = x.shape[1]
        if all(c == t for c in self.counts):
            y, new = attn(x, state, algorithm="recurrent" if t == 1 else "chunked")
            pool.write(layer, self.slots, new)
            return y
        # A ragged extend (prefill chunks of different lengths): the rows of each length
        # together, since the final state of a right-padded row would have run over its padding.
        y = torch.zeros_like(x)
        for c in sorted(set(self.counts) - {0}):
            rows = torch.tensor([b for b, n in enumerate(self.counts) if n == c],
                                device=x.device)
            yc, new = attn(x[rows, :c], state.rows(rows),
                           algorithm="recurrent" if c == 1 else "chunked")
            y[rows, :c] = yc
            pool.write(layer, self.slots[rows], new)
        return y


class PagedK3:
    """A K3ForCausalLM behind the reference engine's target interface (see the module doc)."""

    def __init__(self, model: K3ForCausalLM, state_slots: int, rollback: Rollback = "scratch",
                 planned_slot_bytes: int | None = None, snapshot_slots: int = 0) -> None:
        """`planned_slot_bytes`: what the capacity planner says one request's state takes on
        this rank; a pool that disagrees is refused (one source of truth for its size)."""
        if rollback not in ("scratch", "replay"):
            raise ValueError(f"rollback must be 'scratch' or 'replay', not {rollback!r}")
        self.planned_slot_bytes = planned_slot_bytes
        self.snapshot_slots = snapshot_slots
        self.model = model
        self.config = model.config
        self.state_slots = state_slots
        self.rollback: Rollback = rollback
        self.mla_heads = next(m.num_heads for m in model.modules() if isinstance(m, K3MLA))

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        head = self.model.lm_head
        return self.embed_weight if head is None else head.weight

    def new_cache(self, capacity_tokens: int, page_size: int = 16,
                  allocator: PagedAllocator | None = None) -> HybridCache:
        cache = HybridCache(self.model, capacity_tokens, page_size, allocator,
                            self.state_slots, self.rollback, self.snapshot_slots)
        planned, allocated = self.planned_slot_bytes, cache.states.bytes_per_slot
        if planned is not None and planned != allocated:
            raise ValueError(f"KDA state slot of {allocated} B disagrees with the capacity "
                             f"planner's {planned} B per request for this config.json")
        return cache

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: HybridCache,
        rids: Sequence[Hashable],
        num_new: torch.Tensor,
        capture_layers: Sequence[int] = (),
        verify: bool = False,
        last_only: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Append num_new[b] tokens (row b of input_ids [B, T], right-padded) to each request;
        with `verify`, keep the KDA window for `cache.truncate` to commit from.
        `inputs_embeds` [B, T, H]: the layers' input instead of input_ids' embeddings (an image
        prompt's prefill chunk, its pad positions holding the image's features)."""
        b, t = input_ids.shape
        counts = [int(n) for n in torch.as_tensor(num_new).tolist()]
        if len(rids) != b or len(counts) != b or any(not 0 <= n <= t for n in counts):
            raise ValueError(f"{len(rids)} rids and num_new {counts} for input [{b}, {t}]")
        dev = cache.device
        starts = [cache.length(r) for r in rids]
        # Reserve first: a KVCapacityError leaves the cache untouched and costs no compute.
        slots = cache.latent.reserve_append(rids, counts).to(dev)
        batch = cache.latent.batch(rids, starts, counts, slots, t, self.mla_heads)
        cache.begin(rids, starts, verify)
        states = PagedStates(cache, rids, counts, batch, verify)
        ids = batch.pack(torch.where(batch.valid, input_ids.to(dev), 0))
        layers = list(capture_layers)
        if inputs_embeds is not None:
            inputs_embeds = batch.pack(inputs_embeds.to(dev, self.embed_weight.dtype))
        # The stream is in the batch's layout (packed where rows are padded).
        h, taps = self.model.model.run(ids, states, layers, inputs_embeds)
        cat = batch.unpack(torch.cat([taps[i] for i in layers], dim=-1)) if layers else None
        if last_only:
            return TargetOutput(logits=self.model.logits(last_new(batch.unpack(h), num_new)),
                                taps=cat)
        return TargetOutput(logits=batch.unpack(self.model.logits(h)), taps=cat)
