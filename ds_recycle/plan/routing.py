"""Who runs which micro-batch at which stage: a failed worker's micro-batches go to its live peers.

Live workers keep their own micro-batches. The orphans of each stage (micro-batches of pipelines whose
worker at that stage failed) are sorted by (index, owner) and dealt round-robin over the stage's live
workers, starting at a different peer on each stage, so every live worker of a stage ends with
``floor`` or ``ceil`` of ``D*M / (D - f_s)`` micro-batches and the extra ones are spread over the iteration.

A slow worker (fail-slow) may *offload* ``k`` of its own micro-batches: its last ``k`` (by index) become orphans
too, and orphans go only to workers that offload nothing (to every live worker of the stage if all offload).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from ds_recycle.plan.bounds import failures_per_stage
from ds_recycle.plan.ops import MicroBatch, Worker

__all__ = ["Routing", "route"]

Routing = list[dict[MicroBatch, int]]
"""``routing[stage][mb]`` is the pipeline of the live worker that runs ``mb`` at ``stage``."""


def route(stages: int, pipelines: int, microbatches: int, failed: Iterable[Worker],
          offload: Mapping[Worker, int] | None = None) -> Routing:
    """The assignment of every micro-batch to a live worker at every stage (``offload``: see the module docstring)."""
    failed = frozenset((p, s) for p, s in failed)
    offload = dict(offload or {})
    failures_per_stage(failed, stages, pipelines)
    for (p, s), k in offload.items():
        if (p, s) in failed or not 0 <= k <= microbatches:
            raise ValueError(f"offload {k} micro-batches of worker {(p, s)}: give 0..{microbatches} for a live worker")
    table: Routing = []
    for s in range(stages):
        live = [p for p in range(pipelines) if (p, s) not in failed]
        kept = {p: microbatches - offload.get((p, s), 0) for p in live}
        stage_map = {(p, i): p for p in live for i in range(kept[p])}
        orphans = sorted(((p, i) for p in range(pipelines) for i in range(kept.get(p, 0), microbatches)),
                         key=lambda mb: (mb[1], mb[0]))
        takers = [p for p in live if not offload.get((p, s), 0)] or live
        offset = s % len(takers)
        for n, mb in enumerate(orphans):
            stage_map[mb] = takers[(n + offset) % len(takers)]
        table.append(stage_map)
    return table
