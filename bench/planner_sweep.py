"""Time the full planner sweep: every GPU x layout x weight format x KV dtype x context.

Prints a table and a JSON line. The goal is under one second for the whole sweep; this script
reports the time, it does not assert it.

    .venv/bin/python bench/planner_sweep.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Run from a checkout without installing: the repository root holds the capacity package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capacity import (
    KvDtype,
    WeightFormat,
    describe_model,
    load_gpus,
    load_prices,
    plan,
)

CONTEXTS = (8_192, 131_072, 1_048_576)


def sweep() -> tuple[int, int, dict[int, int]]:
    k3 = describe_model("kimi-k3")
    draft = describe_model("kimi-k3-dspark")
    gpus = load_gpus()
    prices = load_prices()
    evaluated = feasible = 0
    per_context: dict[int, int] = {}
    for context in CONTEXTS:
        result = plan(k3, gpus, prices, context, draft,
                      weight_formats=[None, *WeightFormat], kv_dtypes=list(KvDtype))
        evaluated += result.evaluated
        feasible += len(result.rows)
        per_context[context] = len(result.rows)
    return evaluated, feasible, per_context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times = []
    for _ in range(args.repeats):
        # Each repeat starts cold: descriptors are rebuilt inside sweep(), and every memo in the
        # planner's modules is emptied here.
        from capacity import memory, model, planner, tables, timing

        for module in (memory, model, planner, tables, timing):
            for memo in vars(module).values():
                if callable(getattr(memo, "cache_clear", None)):
                    memo.cache_clear()
        start = time.perf_counter()
        evaluated, feasible, per_context = sweep()
        times.append(time.perf_counter() - start)
    best = min(times)
    print(f"{'GPUs':>6} {'formats':>8} {'KV':>4} {'contexts':>9} {'layouts':>9} {'feasible':>9} "
          f"{'best s':>8} {'us/layout':>10}")
    print(f"{len(load_gpus()):>6} {len(WeightFormat) + 1:>8} {len(KvDtype):>4} {len(CONTEXTS):>9} "
          f"{evaluated:>9} {feasible:>9} {best:>8.3f} {best / evaluated * 1e6:>10.1f}")
    print(json.dumps({
        "bench": "planner_sweep", "layouts_evaluated": evaluated, "feasible": feasible,
        "feasible_per_context": per_context, "seconds_best": round(best, 4),
        "seconds_all": [round(t, 4) for t in times], "goal_seconds": 1.0,
        "within_goal": best < 1.0,
    }))


if __name__ == "__main__":
    main()
