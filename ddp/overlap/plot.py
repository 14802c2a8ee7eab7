"""Timeline picture of one step: backward compute on top, one lane per bucket (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp.overlap.timeline import StepTimeline


def plot_timeline(timeline: StepTimeline | dict[str, Any], path: str | Path, *, title: str = "") -> Path:
    """PNG timeline: a backward-compute lane on top, one lane per bucket below it.

    Each bucket bar runs from "gradients ready" to "all-reduce done"; the part inside the compute window is
    green (hidden), the part after it red (exposed). Accepts a `StepTimeline` or its `to_dict()`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = timeline.to_dict() if isinstance(timeline, StepTimeline) else timeline
    bwd_lo, bwd_hi = data["backward_ms"]
    buckets = data["buckets"]
    lanes = len(buckets) + 1
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.45 * lanes))
    ax.barh(0, bwd_hi - bwd_lo, left=bwd_lo, color="#4477aa", height=0.6)
    for lane, b in enumerate(buckets, start=1):
        lo, hi = b["ready_ms"], b["done_ms"]
        hidden_hi = max(lo, min(hi, bwd_hi))
        ax.barh(lane, hidden_hi - lo, left=lo, color="#44aa66", height=0.6)
        ax.barh(lane, hi - hidden_hi, left=hidden_hi, color="#cc4444", height=0.6)
    labels = ["backward compute"] + [
        f"bucket {b['index']}: {len(b['params'])} params, {b['bytes'] / 2**20:.2f} MiB" for b in buckets
    ]
    ax.set_yticks(range(lanes), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since backward start")
    pct = data["overlap"]["percent"]
    headline = f"overlap {pct:.0f}%" if pct is not None else "no communication"
    ax.set_title(
        f"{title + ' - ' if title else ''}step {data['step']}: {headline}, "
        f"exposed all-reduce {1e3 * data['overlap']['exposed_s']:.1f} ms",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [
        Patch(color="#4477aa", label="backward compute (start .. last gradient ready)"),
        Patch(color="#44aa66", label="all-reduce hidden behind backward"),
        Patch(color="#cc4444", label="all-reduce exposed"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
