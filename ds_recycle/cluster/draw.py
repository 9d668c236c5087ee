"""Pictures in the style of the papers' figures (matplotlib, Agg backend, PNG files).

- `draw_timeline`: throughput over time, one line a system, trace removals and additions marked as
  vertical ticks (as in Oobleck's and ReCycle's throughput-over-time figures); each point is the useful
  samples per second of a short window, so work later thrown away counts zero.
- `draw_frequency`: effective throughput against failure frequency (one point a synthetic trace), one
  line a system (as Oobleck's "throughput vs failure frequency" figure).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ds_recycle.cluster.ledger import Phase
from ds_recycle.cluster.simulator import SimulationResult
from ds_recycle.cluster.systems import SystemKind
from ds_recycle.cluster.trace import EventKind

__all__ = ["draw_timeline", "draw_frequency", "binned_rate", "COLORS"]

COLORS: dict[SystemKind, str] = {
    SystemKind.RECYCLE: "#d62728", SystemKind.RECYCLE_REPARTITION: "#8c564b", SystemKind.OOBLECK: "#1f77b4",
    SystemKind.BAMBOO: "#2ca02c",
    SystemKind.CHECKPOINT: "#7f7f7f", SystemKind.DROP: "#9467bd", SystemKind.RECOVER: "#ff7f0e",
}


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def binned_rate(result: SimulationResult, kind: SystemKind, bins: int = 240) -> tuple[list[float], list[float]]:
    """(bin centres in hours, useful samples/s averaged over each bin): lost work counts zero, pauses
    (checkpoints included) lower the bin's average as they lower the effective throughput."""
    width = result.span_s / bins
    useful = [0.0] * bins
    for seg in result.systems[kind].segments:
        if seg.phase not in (Phase.TRAINING, Phase.DEGRADED):
            continue
        first, last = int(seg.start_s // width), min(int(seg.end_s // width), bins - 1)
        for b in range(first, last + 1):
            overlap = min(seg.end_s, (b + 1) * width) - max(seg.start_s, b * width)
            if overlap > 0:
                useful[b] += seg.rate * overlap
    return [(b + 0.5) * width / 3600 for b in range(bins)], [u / width for u in useful]


def draw_timeline(result: SimulationResult, path: str | os.PathLike[str], bins: int = 240) -> None:
    """Throughput over time of every simulated system (averaged over `bins` windows), events marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.2))
    for e in result.trace.events:
        if 0 < e.time_s <= result.span_s:
            ax.axvline(e.time_s / 3600, color="k" if e.kind is EventKind.REMOVE else "g",
                       alpha=0.12, lw=0.8)
    for kind, r in result.systems.items():
        xs, ys = binned_rate(result, kind, bins)
        ax.plot(xs, ys, color=COLORS[kind], lw=1.3, drawstyle="steps-mid",
                label=f"{kind.value} ({r.effective_rate:.1f}/s effective)")
    ax.set_xlabel("time (hours)   [grey: node removed, green: node added]")
    ax.set_ylabel(f"useful samples/s (window {result.span_s / bins / 60:.1f} min)")
    ax.set_title(f"{result.workload.name}, {result.shape.stages}x{result.shape.pipelines} nodes, "
                 f"{os.path.basename(result.trace.source)}")
    ax.set_xlim(0, result.span_s / 3600)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_frequency(points: Mapping[SystemKind, Sequence[tuple[float, float]]], title: str,
                   path: str | os.PathLike[str]) -> None:
    """Effective throughput (y) against failures per hour (x, log scale), one line a system."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, pts in points.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=COLORS[kind],
                label=kind.value)
    ax.set_xscale("log")
    ax.set_xlabel("failures per hour")
    ax.set_ylabel("effective throughput (samples/s)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
