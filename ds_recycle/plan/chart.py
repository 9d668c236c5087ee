"""A text timeline of a plan: one row per worker, one column per time quantum.

Upper-case letters are a worker's own micro-batches (F, B, W) and its O; lower-case ones (f, b, w) are
micro-batches re-routed to it from a failed peer; ``.`` is idle time::

    p0s0 | FFFF....BWBWBW.O
"""
from __future__ import annotations

from ds_recycle.plan.ops import OpKind
from ds_recycle.plan.plan import Plan

__all__ = ["timeline"]


def timeline(plan: Plan, width: int = 160) -> str:
    """The plan as text, at most ``width`` columns of time (the quantum grows to fit)."""
    positive = [v for kind in ("F", "B", "W") for v in getattr(plan.costs, kind) if v > 0]
    quantum = min(positive) if positive else 1.0
    quantum = max(quantum, plan.makespan / width)
    columns = max(1, round(plan.makespan / quantum))
    rows = []
    for (p, s) in sorted(plan.workers, key=lambda w: (w[1], w[0])):
        cells = ["."] * columns
        for op in plan.workers[(p, s)]:
            if op.end <= op.start:
                continue  # zero-length ops (an O that costs nothing) take no column
            char = op.kind.value
            if op.kind is not OpKind.O and op.micro[0] != p:
                char = char.lower()
            first = min(columns - 1, int(op.start / quantum + 1e-9))
            last = max(first + 1, min(columns, round(op.end / quantum)))
            for c in range(first, last):
                cells[c] = char
        rows.append(f"p{p}s{s} | {''.join(cells)}")
    rows.append(f"one column = {quantum:.4g} time units; lower case = re-routed work")
    return "\n".join(rows)
