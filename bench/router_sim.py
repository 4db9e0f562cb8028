"""Router simulator comparison: round-robin, power-of-two (Ray Serve's default), SGLang's
cache-aware and this project's kv_aware router, on K3 + DSpark, 2 x 8 H200 replicas (costs from
the capacity planner), at several arrival rates of a long-context mix.

    python bench/router_sim.py                      # 3 rates, table + JSON + docs/img/router_*.png
    python bench/router_sim.py --rates 0.5 1 --duration 300 --replicas 4 --trace my.jsonl
    python bench/router_sim.py --sweep              # kv_aware threshold variants (defaults' basis)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router_simulator import (  # bench/router_simulator.py, beside this script
    SLO,
    FleetSpec,
    WorkloadSpec,
    load_trace,
    run_policies,
)

from serve_app.routing.policy import POLICIES, RouterSettings

ORDER = ["round_robin", "power_of_two", "cache_aware", "kv_aware"]
COLUMNS = [("policy", "policy", "{}"), ("rate", "req/s", "{:g}"),
           ("goodput_rps", "goodput", "{:.3f}"), ("slo_attainment", "SLO%", "{:.0%}"),
           ("short_ttft_p50_s", "short p50", "{:.2f}"), ("short_ttft_p99_s", "short p99", "{:.1f}"),
           ("long_ttft_p50_s", "long p50", "{:.1f}"), ("long_ttft_p99_s", "long p99", "{:.1f}"),
           ("short_tpot_p50_ms", "TPOT ms", "{:.1f}"), ("prefix_hit_rate", "hit", "{:.0%}"),
           ("kv_utilisation", "KV", "{:.0%}"), ("queue_wait_p99_s", "wait p99", "{:.1f}"),
           ("rejected_429", "429", "{}"), ("rejected_400", "400", "{}"),
           ("timeout_503", "503", "{}"), ("unfinished", "unfin", "{}")]


def table(rows: list[dict[str, Any]]) -> str:
    head = [c[1] for c in COLUMNS]
    body = [[fmt.format(r[k]) for k, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for rate in sorted({r["rate"] for r in rows}):
        at = {r["policy"]: r for r in rows if r["rate"] == rate}
        if "kv_aware" not in at:
            continue
        base = [r for p, r in at.items() if p != "kv_aware"]
        best_good = max(r["goodput_rps"] for r in base)
        best_p99 = min(r["short_ttft_p99_s"] for r in base)
        out.append({"rate": rate, "best_baseline_goodput": best_good,
                    "goodput_ratio": at["kv_aware"]["goodput_rps"] / max(1e-9, best_good),
                    "best_baseline_short_p99_ttft_s": best_p99,
                    "short_p99_ttft_ratio": at["kv_aware"]["short_ttft_p99_s"] / best_p99})
    return out


def plots(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    groups = {
        "router_goodput.png": [("goodput_rps", "goodput (req/s meeting TTFT+TPOT SLOs)"),
                               ("slo_attainment", "share of requests meeting SLOs")],
        "router_ttft.png": [("short_ttft_p50_s", "short p50 TTFT (s)"),
                            ("short_ttft_p99_s", "short p99 TTFT (s)"),
                            ("long_ttft_p50_s", "long p50 TTFT (s)"),
                            ("long_ttft_p99_s", "long p99 TTFT (s)")],
        "router_cache_kv.png": [("prefix_hit_rate", "prefix-cache hit rate (prompt tokens)"),
                                ("kv_utilisation", "KV utilisation (time average)")],
        "router_queue.png": [("queue_wait_p99_s", "p99 wait before KV admission (s)"),
                             ("rejected_429", "429 rejections"),
                             ("timeout_503", "503 timeouts"), ("unfinished", "unfinished")],
    }
    for name, metrics in groups.items():
        fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4))
        for ax, (key, label) in zip(axes, metrics, strict=True):
            for policy in ORDER:
                pts = sorted((r["rate"], r[key]) for r in rows if r["policy"] == policy)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_title(label, fontsize=9)
            if "ttft" in key:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle("K3 + DSpark, 2x8 H200 per replica (capacity-planner costs)", fontsize=10)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    ap.add_argument("--duration", type=float, default=900.0, help="arrival window (s)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--max-running", type=int, default=FleetSpec.max_running,
                    help="state slots per replica (SGLang --max-running-requests; KDA states)")
    ap.add_argument("--policies", nargs="+", default=ORDER, choices=list(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", type=Path, help="JSONL trace instead of the generator")
    ap.add_argument("--json", type=Path, default=Path("docs/img/router_sim.json"))
    ap.add_argument("--img-dir", type=Path, default=Path("docs/img"))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="kv_aware threshold variants at the "
                    "middle rate instead of the policy comparison")
    args = ap.parse_args(argv)

    fleet = FleetSpec(replicas=args.replicas, max_running=args.max_running)
    workload = WorkloadSpec(duration_s=args.duration, seed=args.seed)
    settings = RouterSettings(share_prefix=True)  # SGLang engines: radix prefix cache
    slo = SLO()
    trace = load_trace(args.trace, settings.block_size) if args.trace else None
    started = time.perf_counter()
    if args.sweep:
        rate = sorted(args.rates)[len(args.rates) // 2]
        variants = {
            "default": {},
            "balance_abs 8k": {"balance_abs_tokens": 8192},
            "balance_abs 512k": {"balance_abs_tokens": 524_288},
            "cache_threshold 0.2": {"cache_threshold": 0.2},
            "cache_threshold 0.8": {"cache_threshold": 0.8},
            "long fraction 0.25": {"long_prefill_replica_fraction": 0.25},
            "long fraction 0.75": {"long_prefill_replica_fraction": 0.75},
            "long fraction 1.0": {"long_prefill_replica_fraction": 1.0},
            "2 long prefills/replica": {"max_long_prefills_per_replica": 2},
            "aging 30 s": {"aging_s": 30.0},
        }
        rows = []
        for label, change in variants.items():
            r, _ = run_policies(["kv_aware"], [rate], fleet, workload,
                                RouterSettings(**settings.model_dump() | change), slo, trace)
            r[0]["policy"] = label
            rows.append(r[0])
        print(table(rows))
        print(json.dumps({"sweep_rate": rate, "rows": rows}, indent=1))
        return 0
    rows, cost = run_policies(args.policies, args.rates, fleet, workload, settings, slo, trace)
    rows.sort(key=lambda r: (r["rate"], ORDER.index(r["policy"])))
    summary = ratios(rows)
    print(f"fleet: {args.replicas} x ({fleet.model} + {fleet.draft} on {fleet.nodes}x"
          f"{fleet.gpus_per_node} {fleet.gpu}, KV {fleet.kv_dtype}): {cost.kv_tokens:,} KV tokens "
          f"and {fleet.max_running} state slots per replica; prefill of 1M tokens "
          f"{cost.prefill_s(1 << 20):.0f} s")
    print(f"SLOs: {asdict(slo)}; {time.perf_counter() - started:.0f} s wall\n")
    print(table(rows))
    print()
    for s in summary:
        print(f"rate {s['rate']:g}: kv_aware goodput {s['goodput_ratio']:.2f}x the best baseline "
              f"(goal >= 1.5x); short p99 TTFT {s['short_p99_ttft_ratio']:.3f}x (goal <= 0.5x)")
    result = {"fleet": asdict(fleet), "kv_tokens_per_replica": cost.kv_tokens,
              "workload": asdict(workload), "slo": asdict(slo), "settings": settings.model_dump(),
              "rows": rows, "vs_best_baseline": summary}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"\nJSON: {args.json}")
    if not args.no_plots:
        for path in plots(rows, args.img_dir):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
