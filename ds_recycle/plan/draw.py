"""A timeline picture of a plan in the style of the pipeline papers' figures (matplotlib, PNG).

Workers are rows (stage by stage, pipelines within a stage), time runs to the right, ops are coloured by
kind (F, B, W, O), work re-routed from a failed worker is hatched, failed workers are rows marked
"failed". Labels ``owner.index`` appear inside ops wide enough to hold them.
"""
from __future__ import annotations

from pathlib import Path

from ds_recycle.plan.ops import OpKind
from ds_recycle.plan.plan import Plan

__all__ = ["draw_plan", "COLOURS"]

COLOURS = {OpKind.F: "#4C72B0", OpKind.B: "#55A868", OpKind.W: "#C7C7C7", OpKind.O: "#C44E52"}


def draw_plan(plan: Plan, path: str | Path, title: str | None = None) -> None:
    """Write the picture of ``plan`` to ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [(p, s) for s in range(plan.stages) for p in range(plan.pipelines)]
    fig_w = min(40.0, max(8.0, plan.makespan * 0.12))
    fig, ax = plt.subplots(figsize=(fig_w, 0.35 * len(rows) + 1.5))
    for y, worker in enumerate(rows):
        if worker in plan.failed:
            ax.axhspan(y - 0.4, y + 0.4, color="#f2dede")
            ax.text(plan.makespan / 2, y, "failed", ha="center", va="center", fontsize=7, color="#a94442")
            continue
        for op in plan.workers[worker]:
            rerouted = op.kind is not OpKind.O and op.micro[0] != worker[0]
            ax.barh(y, op.end - op.start, left=op.start, height=0.8, color=COLOURS[op.kind],
                    edgecolor="black", linewidth=0.3, hatch="///" if rerouted else None)
            if op.mb is not None and op.end - op.start >= plan.makespan / 60:
                ax.text((op.start + op.end) / 2, y, f"{op.mb[0]}.{op.mb[1]}", ha="center", va="center",
                        fontsize=5)
    ax.set_yticks(range(len(rows)), [f"p{p} s{s}" for p, s in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, plan.makespan)
    ax.set_xlabel("time (cost-model units)")
    handles = [Patch(color=c, label=k.value) for k, c in COLOURS.items()]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="re-routed"))
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=5)
    failed = ", ".join(f"{p}:{s}" for p, s in sorted(plan.failed)) or "none"
    ax.set_title(title or f"{plan.schedule}: S={plan.stages} D={plan.pipelines} M={plan.microbatches} "
                          f"K={plan.iterations}, failed {failed}, {plan.time_per_iteration:.4g} per iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
