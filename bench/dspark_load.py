"""Load a full-size DSpark checkpoint and time one draft step on CPU.

Writes a random BF16 checkpoint with the published Kimi-K3-DSpark config (2.25B parameters,
about 4.5 GB) into a temp folder, then, each in a fresh process:
  - loads it (memory-mapped, strict) and reports load time and peak RSS / file size;
  - times one draft step (append the committed rows of one verify, then draft a 7-token
    block with the Markov and confidence heads) at context 1k and 8k.

The 8k context is placed in the draft cache as random K/V rather than by running `fc` over
8k rows of target taps (about 4 TFLOP on CPU): a step's cost does not depend on the values.

    python bench/dspark_load.py [--json out.json] [--repeats 5]
    python bench/dspark_load.py --config serve_app/assets/kimi-k3-mini-dspark/config.json \
        --contexts 64 --repeats 1          # the same steps on the mini draft's shapes (tests)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "serve_app/assets/kimi-k3-dspark-config.json"


def _rss_bytes() -> int:
    # /proc/self/status VmRSS is the current resident set; ru_maxrss the peak (KiB on Linux).
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def write_checkpoint(folder: Path, config_path: Path = CONFIG) -> None:
    import torch

    from serve_app.models.checkpoint import save_tensors
    from serve_app.models.dspark import expected_tensors
    from serve_app.models.dspark_config import DSparkConfig

    config = DSparkConfig.from_file(config_path)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, spec in expected_tensors(config).items():
        t = torch.empty(spec.shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        tensors[name] = t
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config_path.read_text())
    save_tensors(folder, tensors)


def measure_load(folder: Path) -> dict[str, float]:
    import torch  # noqa: F401  (imported before the baseline so it is not counted)

    from serve_app.models.dspark import load_dspark

    base_rss = _rss_bytes()
    base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    draft = load_dspark(folder)
    load_s = time.perf_counter() - t0
    # Touch every weight once, as the first forward would.
    # max() reads every page without a temporary copy.
    total = sum(float(p.max()) for p in draft.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {
        "load_s": load_s,
        "file_bytes": size,
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": max(base_rss, base_peak),
        "peak_rss_over_file": (peak - max(base_rss, base_peak)) / size,
        "checksum": total,
    }


def measure_step(folder: Path, contexts: list[int], repeats: int) -> dict[str, dict[str, float]]:
    import torch

    from serve_app.models.dspark import load_dspark

    torch.manual_seed(0)
    draft = load_dspark(folder)
    cfg = draft.config
    # Stand-ins for the target's embedding and lm_head (the draft borrows the target's).
    embed = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16).normal_(0, 0.02)
    lm_head = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16).normal_(0, 0.02)
    tap_dim = len(cfg.target_layer_ids) * cfg.target_hidden_size
    accepted = 3
    results: dict[str, dict[str, float]] = {}
    for ctx in contexts:
        cache = draft.new_cache(capacity_tokens=ctx + 64)
        cache.add("r")
        slots = cache.reserve_append(["r"], [ctx])
        for buf in cache.buffers.values():
            buf[:, slots] = torch.randn(buf.shape[0], ctx, *buf.shape[2:], dtype=buf.dtype)
        rows = torch.randn(accepted + 1, tap_dim, dtype=torch.bfloat16)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            draft.append_context(cache, ["r"], [rows])
            out = draft.draft(cache, ["r"], torch.tensor([17]), embed, lm_head)
            elapsed = time.perf_counter() - t0
            cache.truncate("r", ctx)
            if i:  # the first step warms up allocator and kernels
                times.append(elapsed)
        assert out.tokens.shape == (1, cfg.block_size)
        results[str(ctx)] = {"median_s": statistics.median(times), "min_s": min(times),
                             "max_s": max(times)}
    return results


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True,
                         text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--config", type=Path, default=CONFIG,
                        help="the DSpark config.json to write (default the published one)")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        what, folder = args._child
        if what == "write":
            write_checkpoint(Path(folder), args.config)
            print(json.dumps({}))
        elif what == "load":
            print(json.dumps(measure_load(Path(folder))))
        else:
            contexts = [int(c) for c in args.contexts.split(",")]
            print(json.dumps(measure_step(Path(folder), contexts, args.repeats)))
        return

    with tempfile.TemporaryDirectory(prefix="dspark-bench-") as tmp:
        folder = Path(tmp) / "Kimi-K3-DSpark-random"
        t0 = time.perf_counter()
        _child(["--_child", "write", str(folder), "--config", str(args.config.resolve())])
        write_s = time.perf_counter() - t0
        load = _child(["--_child", "load", str(folder)])
        step = _child(["--_child", "step", str(folder), "--repeats", str(args.repeats),
                       "--contexts", args.contexts])
    result = {"write_s": write_s, "load": load, "draft_step": step, "repeats": args.repeats}
    if args.config.resolve() == CONFIG:
        print("DSpark full-size checkpoint (published config, random BF16 weights), CPU")
    else:
        result["config"] = str(args.config)
        print(f"DSpark checkpoint ({args.config}, random BF16 weights), CPU")
    print(f"{'metric':<34}{'value':>14}")
    print(f"{'file size (GB)':<34}{load['file_bytes'] / 1e9:>14.3f}")
    print(f"{'write (s)':<34}{write_s:>14.1f}")
    print(f"{'load (s)':<34}{load['load_s']:>14.3f}")
    print(f"{'peak RSS over baseline (GB)':<34}"
          f"{(load['peak_rss_bytes'] - load['baseline_rss_bytes']) / 1e9:>14.3f}")
    print(f"{'peak RSS / file size (goal <= 1.2)':<34}{load['peak_rss_over_file']:>14.3f}")
    for ctx, r in step.items():
        print(f"{'draft step @ ctx ' + ctx + ' median (ms)':<34}{r['median_s'] * 1e3:>14.1f}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
