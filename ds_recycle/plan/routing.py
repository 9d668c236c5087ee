"""Who runs which micro-batch at which stage: a failed worker's micro-batches go to its live peers.

Live workers keep their own micro-batches. The orphans of each stage (micro-batches of pipelines whose
worker at that stage failed) are sorted by (index, owner) and dealt round-robin over the stage's live
workers, starting at a different peer on each stage, so every live worker of a stage ends with
``floor`` or ``ceil`` of ``D*M / (D - f_s)`` micro-batches and the extra ones are spread over the iteration.
"""
from __future__ import annotations

from collections.abc import Iterable

from ds_recycle.plan.bounds import failures_per_stage
from ds_recycle.plan.ops import MicroBatch, Worker

__all__ = ["Routing", "route"]

Routing = list[dict[MicroBatch, int]]
"""``routing[stage][mb]`` is the pipeline of the live worker that runs ``mb`` at ``stage``."""


def route(stages: int, pipelines: int, microbatches: int, failed: Iterable[Worker]) -> Routing:
    """The assignment of every micro-batch to a live worker at every stage."""
    failed = frozenset((p, s) for p, s in failed)
    failures_per_stage(failed, stages, pipelines)
    table: Routing = []
    for s in range(stages):
        live = [p for p in range(pipelines) if (p, s) not in failed]
        stage_map = {(p, i): p for p in live for i in range(microbatches)}
        orphans = sorted(((p, i) for p in range(pipelines) if (p, s) in failed for i in range(microbatches)),
                         key=lambda mb: (mb[1], mb[0]))
        offset = s % len(live)
        for n, mb in enumerate(orphans):
            stage_map[mb] = live[(n + offset) % len(live)]
        table.append(stage_map)
    return table
