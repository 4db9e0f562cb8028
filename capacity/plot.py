"""Cost vs throughput scatter of a plan, with its Pareto frontier."""

from __future__ import annotations

from pathlib import Path

from capacity.errors import CapacityError
from capacity.planner import PlanResult


def pareto_plot(result: PlanResult, path: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    priced = [r for r in result.rows if r.usd_per_hour is not None]
    if not priced:
        raise CapacityError("nothing to plot: no feasible layout has a price")
    frontier = result.pareto()
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for gpu in sorted({r.layout.gpu for r in priced}):
        rows = [r for r in priced if r.layout.gpu == gpu]
        ax.scatter([r.total_tokens_s for r in rows], [r.usd_per_hour for r in rows], s=14,
                   alpha=0.55, label=gpu)
    ax.plot([r.total_tokens_s for r in frontier], [r.usd_per_hour for r in frontier], "k-",
            lw=1.4, drawstyle="steps-post", label="Pareto frontier")
    ax.scatter([r.total_tokens_s for r in frontier], [r.usd_per_hour for r in frontier],
               s=40, facecolors="none", edgecolors="k")
    for row in frontier[-4:]:
        ax.annotate(row.layout.label(), (row.total_tokens_s, row.usd_per_hour), fontsize=7,
                    xytext=(4, -10), textcoords="offset points")
    what = result.model + (f" + {result.draft}" if result.draft else "")
    oldest = max((r.price.age_days() for r in priced if r.price), default=0)
    ax.set_title(title or f"{what} at {result.context_length:,} tokens of context")
    ax.set_xlabel("output tokens/s per replica set (decode, at full context)")
    ax.set_ylabel("$ per hour (on-demand)")
    ax.text(0.99, 0.01, f"prices up to {oldest} days old", transform=ax.transAxes,
            ha="right", va="bottom", fontsize=7, color="gray")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
