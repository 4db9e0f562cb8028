"""A tensor-parallel group's collectives, as the reference engine and its models use them: an
in-place sum (`all_reduce`), rank 0's object on every rank (`broadcast_object`, the runner's
step protocol) and every rank's object at rank 0 (`gather_object`, a hand-over's shares).

Two implementations:

- `TorchGroup`: torch.distributed (NCCL on CUDA, gloo across hosts).
- `HostGroup`: ranks on one host, on CPU: each round every rank writes its part into its slot of
  a shared-memory file and signals every peer with one byte through a FIFO of its own per
  (sender, receiver) pair; the sum is taken from the slots in rank order, so every rank holds
  the same bits (gloo's for two ranks: float addition commutes). `bench/collectives.py` on the
  2-core CI machine: an all-reduce of 64 floats 1,055 us over gloo's loopback TCP, 51 us here;
  a TP-2 engine's decode 21.8 ms per token over gloo, 6.3 ms here (docs/hybrid-engine.md).

Slots alternate between two sets by round parity: a rank writes round k + 2's slot only after
every peer's round k + 1 signal, sent once that peer had read round k. A peer that dies closes
its FIFOs: the next read returns end-of-file, the next write EPIPE, and the collective raises
`PeerLost` instead of waiting forever.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from serve_app.models.target import Collectives


class TorchGroup:
    """A torch.distributed process group (None: the default one)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # broadcast and gather name their root by its global rank.
        self._root = dist.get_global_rank(group, 0) if group is not None else 0

    def all_reduce(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.group)

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._root, group=self.group)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any] | None:
        gathered: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=self._root, group=self.group)
        return gathered

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        pass


class PeerLost(RuntimeError):
    """A rank of the group is gone (its process exited or was killed)."""


class NotOneHost(RuntimeError):
    """The ranks do not share a filesystem to meet in (HostGroup cannot be set up)."""


_HEADER = 16  # a slot's payload length (int64; -1: sent through the torch group instead)


class HostGroup:
    """Collectives for ranks on one host through shared memory (module docstring). Set up and,
    for objects larger than a slot, carried by `base`."""

    SLOT_BYTES = 4 << 20

    def __init__(self, base: TorchGroup, slot_bytes: int = SLOT_BYTES) -> None:
        self.base, self.rank, self.size = base, base.rank, base.size
        self.slot_bytes = slot_bytes
        self._stride = _HEADER + slot_bytes
        self._round = 0
        self._inbox: dict[int, int] = {}
        self._outbox: dict[int, int] = {}
        nbytes = 2 * self.size * self._stride
        folder = tempfile.mkdtemp(prefix="kimi-tp-", dir=_memory_folder(nbytes)) \
            if self.rank == 0 else None
        path = Path(base.broadcast_object(folder))
        try:
            # One host, but maybe not one filesystem (containers on one kernel): every rank
            # must see the folder.
            seen = base.gather_object(path.is_dir())
            if not base.broadcast_object(seen is not None and all(seen)):
                raise NotOneHost(f"{path} is not visible from every rank")
            if self.rank == 0:
                with open(path / "slots", "wb") as f:
                    f.truncate(nbytes)
                for src in range(self.size):
                    for dst in range(self.size):
                        if src != dst:
                            os.mkfifo(path / f"{src}-{dst}")
            base.barrier()
            self._slots = torch.from_file(str(path / "slots"), shared=True, size=nbytes,
                                          dtype=torch.uint8)
            # Read ends first (a FIFO's write end opens only once it has a reader), without
            # blocking; then the write ends; then reads block.
            peers = [r for r in range(self.size) if r != self.rank]
            self._inbox = {src: os.open(path / f"{src}-{self.rank}", os.O_RDONLY | os.O_NONBLOCK)
                           for src in peers}
            base.barrier()
            self._outbox = {dst: os.open(path / f"{self.rank}-{dst}", os.O_WRONLY)
                            for dst in peers}
            for fd in self._inbox.values():
                os.set_blocking(fd, True)
            base.barrier()
        except BaseException:
            self.close()
            raise
        finally:
            if self.rank == 0:  # every rank has it open (or failed): the names can go
                shutil.rmtree(path, ignore_errors=True)

    # --- one round -------------------------------------------------------------------------

    def _slot(self, parity: int, rank: int) -> torch.Tensor:
        start = (parity * self.size + rank) * self._stride
        return self._slots[start:start + self._stride]

    def _exchange(self) -> None:
        """Tell every peer this rank's slot is written, then wait until each has said so."""
        try:
            for fd in self._outbox.values():
                os.write(fd, b"\x01")
        except BrokenPipeError:
            raise PeerLost("a tensor-parallel rank is gone (its FIFO has no reader)") from None
        for src, fd in self._inbox.items():
            if not os.read(fd, 1):
                raise PeerLost(f"tensor-parallel rank {src} is gone")

    def _next_parity(self) -> int:
        parity = self._round % 2
        self._round += 1
        return parity

    # --- collectives ------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> None:
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        per_round = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per_round):
            part = flat[start:start + per_round]
            parity = self._next_parity()
            slots = [self._slot(parity, r)[_HEADER:_HEADER + part.numel() * part.element_size()]
                     .view(part.dtype) for r in range(self.size)]
            slots[self.rank].copy_(part)
            self._exchange()
            part.copy_(slots[0])
            for slot in slots[1:]:
                part.add_(slot)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view(x.shape))

    def _put(self, slot: torch.Tensor, obj: Any) -> None:
        """Pickle `obj` into `slot`, or mark it (length -1) as too large for one."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        fits = len(data) <= self.slot_bytes
        slot[:8].view(torch.int64)[0] = len(data) if fits else -1
        if fits:
            slot[_HEADER:_HEADER + len(data)].copy_(torch.frombuffer(bytearray(data),
                                                                     dtype=torch.uint8))

    @staticmethod
    def _length(slot: torch.Tensor) -> int:
        return int(slot[:8].view(torch.int64)[0])

    @classmethod
    def _get(cls, slot: torch.Tensor) -> Any:
        return pickle.loads(slot[_HEADER:_HEADER + cls._length(slot)].numpy().tobytes())

    def broadcast_object(self, obj: Any) -> Any:
        parity = self._next_parity()
        root = self._slot(parity, 0)
        if self.rank == 0:
            self._put(root, obj)
        self._exchange()
        if self._length(root) < 0:  # larger than a slot: the torch group carries it
            return self.base.broadcast_object(obj if self.rank == 0 else None)
        return obj if self.rank == 0 else self._get(root)

    def gather_object(self, obj: Any) -> list[Any] | None:
        parity = self._next_parity()
        self._put(self._slot(parity, self.rank), obj)
        self._exchange()
        if any(self._length(self._slot(parity, r)) < 0 for r in range(self.size)):
            return self.base.gather_object(obj)
        if self.rank != 0:
            return None
        return [obj if r == 0 else self._get(self._slot(parity, r)) for r in range(self.size)]

    def barrier(self) -> None:
        self._next_parity()
        self._exchange()

    def close(self) -> None:
        for fd in [*self._inbox.values(), *self._outbox.values()]:
            os.close(fd)
        self._inbox, self._outbox = {}, {}


def host_collectives(base: TorchGroup) -> Collectives:
    """`HostGroup` over `base` when every rank runs on this host (the same kernel boot) and sees
    the folder rank 0 makes for it, else `base`."""
    hosts = base.gather_object((socket.gethostname(), _boot_id()))
    if not base.broadcast_object(hosts is not None and len(set(hosts)) == 1):
        return base
    try:
        return HostGroup(base)
    except NotOneHost:  # raised on every rank alike
        return base


def _memory_folder(nbytes: int) -> str | None:
    """/dev/shm when it has room for the slots twice over: a tmpfs is not written back to a
    disk, but writing past a full one kills the process (SIGBUS), and containers often mount a
    64 MB one. Else None: the temporary folder (a file on disk, shared through the page cache
    all the same)."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stats.f_bavail * stats.f_frsize >= 2 * nbytes else None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
