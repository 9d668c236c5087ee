"""Chrome trace export: the JSON ``traceEvents`` format (open in chrome://tracing or Perfetto).

One process per pipeline, one thread per stage; each op is a complete event (``ph: "X"``) whose ``ts``
and ``dur`` are in microseconds: one cost-model unit is ``unit_us`` microseconds (default 1000: costs read
as milliseconds).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ds_recycle.plan.ops import OpKind
from ds_recycle.plan.plan import Plan

__all__ = ["chrome_trace", "write_chrome_trace"]


def chrome_trace(plan: Plan, unit_us: float = 1000.0) -> dict[str, Any]:
    """The trace document of ``plan``."""
    events: list[dict[str, Any]] = []
    for p in range(plan.pipelines):
        events.append({"name": "process_name", "ph": "M", "pid": p, "args": {"name": f"pipeline {p}"}})
        for s in range(plan.stages):
            label = f"stage {s}" + (" (failed)" if (p, s) in plan.failed else "")
            events.append({"name": "thread_name", "ph": "M", "pid": p, "tid": s, "args": {"name": label}})
    for (p, s), ops in sorted(plan.workers.items()):
        for op in ops:
            rerouted = op.kind is not OpKind.O and op.micro[0] != p
            args: dict[str, Any] = {"iteration": op.iteration, "rerouted": rerouted}
            if op.mb is not None:
                args["owner"], args["index"] = op.mb
            events.append({"name": str(op), "cat": op.kind.value + (",rerouted" if rerouted else ""),
                           "ph": "X", "ts": op.start * unit_us, "dur": (op.end - op.start) * unit_us,
                           "pid": p, "tid": s, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(plan: Plan, path: str | Path, unit_us: float = 1000.0) -> None:
    """Write :func:`chrome_trace` to ``path``."""
    Path(path).write_text(json.dumps(chrome_trace(plan, unit_us)), encoding="utf-8")
