"""What a tensor-parallel collective costs on CPU: gloo against the ranks' shared memory
(serve_app/engines/reference/collectives.py), side by side in one run, and what that makes of a
TP-2 engine's decode.

Variants (--world spawned ranks on this machine, one torch thread each):
  gloo:          torch.distributed's gloo (loopback TCP): builder.init_tensor_parallel with
                 host_memory=False, as across hosts;
  shared memory: collectives.HostGroup, what init_tensor_parallel picks when every rank is on
                 one host.

Per variant and operation (an all-reduce of 64 floats, one a decode step's hidden state size,
and of 1M floats, a long prefill chunk's; the runner's step broadcast, a small tuple), the median
over --rounds of --ops operations: wall time per operation and rank 0's CPU time per operation.
Then an engine at TP 2 (the tiny test pair, greedy, --requests one at a time, --tokens each):
wall time and rank 0's CPU per generated token.

    python bench/collectives.py [--world 2] [--ops 2000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

VARIANTS = {"gloo": False, "shared memory": True}


def _ops(rank: int, world: int, port: int, host_memory: bool, n: int, rounds: int,
         out: Any) -> None:
    import torch

    from serve_app.engines.reference.builder import init_tensor_parallel, release_tensor_parallel

    torch.set_num_threads(1)
    group = init_tensor_parallel(f"tcp://127.0.0.1:{port}", rank, world, "gloo",
                                 host_memory=host_memory)
    step = ("forward", ([0, 1], torch.tensor([[5, 6, 7, 8]]), [17, 18]), )
    operations = {
        "all_reduce 64 floats": lambda: group.all_reduce(torch.ones(64)),
        "all_reduce 1M floats": lambda: group.all_reduce(torch.ones(1 << 20)),
        "step broadcast": lambda: group.broadcast_object(step if rank == 0 else None),
    }
    results = {}
    for name, op in operations.items():
        count = n if "1M" not in name else max(1, n // 50)
        wall, cpu = [], []
        for _ in range(rounds):
            group.barrier()
            w, c = time.perf_counter(), time.process_time()
            for _ in range(count):
                op()
            wall.append((time.perf_counter() - w) / count)
            cpu.append((time.process_time() - c) / count)
        results[name] = {"wall_us": 1e6 * statistics.median(wall),
                         "cpu_us": 1e6 * statistics.median(cpu)}
    if rank == 0:
        out.put(results)
    operations.clear()  # their closures hold the group
    release_tensor_parallel()


def _decode_job(engine: Any, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    from serve_app.protocol.generation import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts[:1], params)  # warm
    w, c = time.perf_counter(), time.process_time()
    done = sum(len(engine.generate([p], params)[0].token_ids) for p in prompts)
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    return {"tokens": done, "wall_s": wall, "rank0_cpu_s": cpu}


def _decode(host_memory: bool, requests: int, tokens: int) -> dict[str, Any]:
    from spec_helpers import random_prompts, run_tensor_parallel
    from tiny_models import write_tiny_pair

    from serve_app.config import ReferenceEngineConfig

    pair = write_tiny_pair(Path(tempfile.mkdtemp()))
    result = run_tensor_parallel(pair, ReferenceEngineConfig(kv_capacity_tokens=4096), 2,
                                 _decode_job, (random_prompts(requests, 32, seed=1), tokens),
                                 host_memory=host_memory)
    n = result["tokens"]
    return {"ms_per_token": 1e3 * result["wall_s"] / n,
            "rank0_cpu_ms_per_token": 1e3 * result["rank0_cpu_s"] / n, "tokens": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from serve_app.netutil import free_port

    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {"world": args.world, "cpus": os.cpu_count(), "variants": {}}
    for variant, host_memory in VARIANTS.items():
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_ops, args=(r, args.world, port, host_memory, args.ops,
                                                 args.rounds, out)) for r in range(args.world)]
        for proc in procs:
            proc.start()
        ops = out.get(timeout=600)
        for proc in procs:
            proc.join(timeout=60)
        results["variants"][variant] = {"ops": ops,
                                        "decode_tp2": _decode(host_memory, args.requests,
                                                              args.tokens)}
    names = list(results["variants"]["gloo"]["ops"])
    print(f"{'TP ' + str(args.world) + ', per operation':34s}" + "".join(
        f"{v + ' wall':>24s}{v + ' rank-0 CPU':>26s}" for v in VARIANTS))
    for name in names:
        print(f"{name + ' (us)':34s}" + "".join(
            f"{results['variants'][v]['ops'][name]['wall_us']:24.1f}"
            f"{results['variants'][v]['ops'][name]['cpu_us']:26.1f}" for v in VARIANTS))
    print(f"{'TP-2 decode, per token (ms)':34s}" + "".join(
        f"{results['variants'][v]['decode_tp2']['ms_per_token']:24.2f}"
        f"{results['variants'][v]['decode_tp2']['rank0_cpu_ms_per_token']:26.2f}"
        for v in VARIANTS))
    g, s = (results["variants"][v]["decode_tp2"]["ms_per_token"] for v in VARIANTS)
    results["decode_speedup"] = g / s
    print(f"TP-2 decode: shared memory {g / s:.2f}x gloo's tokens per second")
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
