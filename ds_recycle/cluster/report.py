"""Turn a simulation into a table, a JSON document and per-system summaries.

The table has one row a system: effective throughput (samples/s over the whole run), the effective-time
fraction (over the system's own failure-free rate; Bamboo's without its redundancy), the breakdown of
wall time by phase, and ReCycle's effective throughput over the system's.
"""
from __future__ import annotations

import math
from typing import Any

from ds_recycle.cluster.ledger import Phase
from ds_recycle.cluster.simulator import SimulationResult
from ds_recycle.cluster.systems import SystemKind

__all__ = ["format_table", "to_json", "format_assumptions"]

_SHOWN = (Phase.TRAINING, Phase.DEGRADED, Phase.RECONFIGURING, Phase.RESTARTING,
          Phase.CHECKPOINTING, Phase.WAITING, Phase.LOST)


def _ratio_text(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}x"


def format_table(result: SimulationResult) -> str:
    """The per-system table, with the run's parameters above it."""
    shape, w = result.shape, result.workload
    head = (f"trace {result.trace.source}: {result.trace.removals} removals, "
            f"{result.span_s / 3600:.2f} h simulated in {result.wall_s:.2f} s\n"
            f"job: {w.name}, {shape.stages} stages x {shape.pipelines} pipelines "
            f"({shape.nodes} nodes of {w.hardware.gpus_per_node} GPUs), M={shape.microbatches} "
            f"micro-batches of {w.micro_batch} samples per pipeline\n")
    cols = ["system", "samples/s", "eff.frac"] + [p.value[:7] for p in _SHOWN] + ["recycle/x"]
    rows = [cols]
    has_recycle = SystemKind.RECYCLE in result.systems
    for kind, r in result.systems.items():
        br = r.breakdown()
        ratio = _ratio_text(result.ratio(kind)) if has_recycle else "-"
        rows.append([kind.value, f"{r.effective_rate:.2f}", f"{r.effective_fraction:.3f}"]
                    + [f"{br[p]:.3f}" for p in _SHOWN] + [ratio])
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(widths[i]) if i else cell.ljust(widths[i])
                       for i, cell in enumerate(row)) for row in rows]
    return head + "\n".join(lines)


def format_assumptions(result: SimulationResult) -> str:
    rows = result.assumptions.describe()
    width = max(len(name) for name, _, _ in rows)
    return "\n".join(f"  {name.ljust(width)} = {value:>8}  ({source})" for name, value, source in rows)


def to_json(result: SimulationResult) -> dict[str, Any]:
    """The whole result as plain JSON (segments included, so any figure can be redrawn)."""
    has_recycle = SystemKind.RECYCLE in result.systems
    systems = {}
    for kind, r in result.systems.items():
        ratio = result.ratio(kind) if has_recycle else None
        systems[kind.value] = {
            "effective_samples_per_s": r.effective_rate,
            "effective_time_fraction": r.effective_fraction,
            "reference_samples_per_s": r.reference_rate,
            "breakdown": {p.value: v for p, v in r.breakdown().items()},
            "recycle_over_this": None if ratio is None or math.isinf(ratio) else ratio,
            "segments": [[s.start_s, s.end_s, s.phase.value, s.rate] for s in r.segments],
            "notes": [[t, text] for t, text in r.notes],
        }
    shape = result.shape
    return {
        "format": "ds-recycle-simulation/1",
        "trace": {"source": result.trace.source, "removals": result.trace.removals,
                  "events": [[e.time_s, e.kind.value, e.node] for e in result.trace.events]},
        "job": {"workload": result.workload.name, "stages": shape.stages,
                "pipelines": shape.pipelines, "microbatches": shape.microbatches,
                "micro_batch_samples": result.workload.micro_batch, "recycle_group": shape.group,
                "gpus_per_node": result.workload.hardware.gpus_per_node},
        "span_s": result.span_s,
        "wall_s": result.wall_s,
        "planner": result.planner,
        "assumptions": {name: {"value": value, "source": source}
                        for name, value, source in result.assumptions.describe()},
        "systems": systems,
    }
