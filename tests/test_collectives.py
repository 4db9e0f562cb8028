"""The reference engine's shared-memory collectives (serve_app/engines/reference/collectives.py)
against torch.distributed's gloo, in spawned rank processes: the same sums to the bit, objects
that fit a slot and objects that do not, and a dead peer raised as PeerLost, not waited on."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from spec_helpers import rank_processes

SLOT = 4096  # bytes: small, so that sums and objects span several rounds or fall back


def _ranks(target: Any, world: int, answers: int = 1) -> tuple[list[Any], list[int | None]]:
    """`target(rank, world, port, out)` in `world` rank processes: the first `answers` things
    they put on `out`, and their exit codes."""
    from serve_app.netutil import free_port

    ctx = rank_processes()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    got = [out.get(timeout=120) for _ in range(answers)]
    for proc in procs:
        proc.join(timeout=60)
    return got, [proc.exitcode for proc in procs]


def _join(rank: int, world: int, port: int) -> Any:
    import torch.distributed as dist

    from serve_app.engines.reference.collectives import HostGroup, TorchGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    base = TorchGroup()
    return base, HostGroup(base, slot_bytes=SLOT)


def _leave(host: Any) -> None:
    import torch.distributed as dist

    host.close()
    dist.barrier()
    dist.destroy_process_group()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two sums of the same addends in another order: float32 within torch.testing's default
    tolerance; bf16 (addends 0.5 x N(0, 1), three of them: partial sums under 4 in magnitude,
    where a bf16 step is 2^-6 at most) within the two roundings' half steps, 2^-6."""
    tolerance = {"rtol": 0.0, "atol": 2.0 ** -6} if a.dtype == torch.bfloat16 else {}
    try:
        torch.testing.assert_close(a, b, **tolerance)
    except AssertionError:
        return False
    return True


def _agree(rank: int, world: int, port: int, out: Any) -> None:
    base, host = _join(rank, world, port)
    gen = torch.Generator().manual_seed(rank)
    ours, gloos = [], []
    # float32 and bf16, one round and several (10,000 floats > a 4 kB slot), a strided view
    for dtype, n in ((torch.float32, 7), (torch.float32, 10_000), (torch.bfloat16, 3_000)):
        x = (0.5 * torch.randn(n, generator=gen)).to(dtype)
        mine, theirs = x.clone(), x.clone()
        host.all_reduce(mine)
        base.all_reduce(theirs)
        ours.append(mine)
        gloos.append(theirs)
    wide = torch.randn(64, 8, generator=gen)
    reference = wide[:, 3].clone()
    host.all_reduce(wide[:, 3])
    base.all_reduce(reference)
    ours.append(wide[:, 3].clone())
    gloos.append(reference)
    every_rank = base.gather_object(ours)
    results = None if every_rank is None else (
        all(torch.equal(a, b) for theirs in every_rank for a, b in zip(ours, theirs, strict=True)),
        [bool(torch.equal(a, b)) for a, b in zip(ours, gloos, strict=True)],
        all(_close(a, b) for a, b in zip(ours, gloos, strict=True)))
    small = host.broadcast_object(("forward", [1, 2], torch.tensor([rank])) if rank == 0 else None)
    big = host.broadcast_object(list(range(5_000)) if rank == 0 else None)  # > a slot: gloo
    gathered = host.gather_object({"rank": rank, "pad": "x" * (10_000 if rank == 1 else 1)})
    host.barrier()
    if rank == 0:
        out.put((results, small[0], small[1], int(small[2]), big == list(range(5_000)),
                 [g["rank"] for g in gathered]))
    else:
        assert gathered is None
    _leave(host)


@pytest.mark.parametrize("world", [2, 3])
def test_host_collectives_agree_with_gloo(world: int) -> None:
    [(results, op, args, root, big, gathered)], codes = _ranks(_agree, world)
    assert codes == [0] * world
    same_on_every_rank, equal_to_gloo, close_to_gloo = results
    assert same_on_every_rank
    if world == 2:
        assert equal_to_gloo == [True] * 4  # two addends commute: gloo's bits
    else:  # gloo's ring adds in another order per chunk: the last bits may differ
        assert close_to_gloo
    assert (op, args, root, big, gathered) == ("forward", [1, 2], 0, True, list(range(world)))


def _lose_a_peer(rank: int, world: int, port: int, out: Any) -> None:
    from serve_app.engines.reference.collectives import PeerLost

    _, host = _join(rank, world, port)
    host.all_reduce(torch.ones(4))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        host.all_reduce(torch.ones(4))
        out.put("returned")
    except PeerLost as exc:
        out.put(str(exc))


def test_a_dead_peer_is_raised_not_waited_on() -> None:
    answers, codes = _ranks(_lose_a_peer, 2)
    assert answers == ["tensor-parallel rank 1 is gone"]
    assert codes == [0, -signal.SIGKILL]
    leftovers = [p for p in os.listdir("/dev/shm") if p.startswith("kimi-tp-")] \
        if os.path.isdir("/dev/shm") else []
    assert leftovers == []  # rank 0 removed the names once both had them open


def _apart(rank: int, world: int, port: int, out: Any) -> None:
    """Rank 1 cannot see rank 0's folder (containers on one kernel): both stay on gloo."""
    import pathlib

    import torch.distributed as dist

    from serve_app.engines.reference.collectives import TorchGroup, host_collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    if rank == 1:
        pathlib.Path.is_dir = lambda self: False  # type: ignore[method-assign]
    group = host_collectives(TorchGroup())
    x = torch.ones(3)
    group.all_reduce(x)
    out.put((rank, type(group).__name__, x.tolist()))
    dist.barrier()
    dist.destroy_process_group()


def test_ranks_that_share_no_folder_stay_on_gloo() -> None:
    answers, codes = _ranks(_apart, 2, answers=2)
    assert codes == [0, 0]
    assert sorted(answers) == [(0, "TorchGroup", [2.0] * 3), (1, "TorchGroup", [2.0] * 3)]
