"""Where one worker stands in training: what it finished of the iteration in flight, and what it keeps of it.

The engine updates an :class:`IterationProgress` as it runs. After a failure the failure handler asks it for
its :class:`Position` (every member reports one, and the members decide the repair from all of them:
:mod:`ds_recycle.resilience.salvage`) and, before the new epoch is installed, for the :class:`KeptWork` that
the repair may continue from.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["IterationProgress", "KeptWork", "LogEntry", "MicroBatch", "Position", "RowKey"]

MicroBatch = tuple[int, int]
RowKey = tuple[int, int]
"""A gradient row: ``(owner pipeline, micro-batch index or -1 for the pipeline's sum)``."""
LogEntry = tuple[int, bool, bool, MicroBatch]
"""``(iteration, is a gradient, this worker received it, micro-batch)``: one boundary-log entry."""


@dataclass
class IterationProgress:
    """What this worker has finished of ``iteration`` (the failure handler salvages it after a failure)."""

    iteration: int
    w_done: set[MicroBatch] = field(default_factory=set)
    """Micro-batches whose weight gradient is accumulated (W, or a fused B+W, ran)."""
    loss_counted: set[MicroBatch] = field(default_factory=set)
    """Last stage: micro-batches whose loss is in the iteration's loss sum."""
    awaiting_norm: bool = False
    """Reduced and tied-weight summed: only the clipping norm was missing for the step."""
    stepped: bool = False
    """The stage's optimizer step of ``iteration`` is taken: from here on the iteration is final on this worker."""


@dataclass(frozen=True)
class Position:
    """One member's position after a failure (what it reports to the others)."""

    stage: int
    stepped: int
    """The last iteration whose optimizer step it took (-1: none)."""
    in_flight: int
    """The iteration its progress record belongs to (the one after ``stepped`` when it had started it)."""
    served: tuple[MicroBatch, ...]
    """Micro-batches its stage ran on it under the old plan, this iteration."""
    w_done: tuple[MicroBatch, ...]
    """Micro-batches of ``in_flight`` whose weight gradient it has accumulated."""
    logs: tuple[LogEntry, ...] = ()
    awaiting: bool = False
    """It holds its stage's reduced (and tied-weight summed) gradients of ``in_flight`` and waited only for the
    clipping norm to step."""
    partition: tuple[int, ...] = ()
    """The layer boundaries it holds (DeepSpeed's ``PipelineModule.parts``)."""
    pending: tuple[int, ...] = ()
    """The partition of a layer move it received and did not install (a failure inside the move); () if none."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Position:
        raw: dict[str, Any] = json.loads(text)
        return cls(raw["stage"], raw["stepped"], raw["in_flight"],
                   tuple((int(d), int(i)) for d, i in raw["served"]),
                   tuple((int(d), int(i)) for d, i in raw["w_done"]),
                   tuple((int(k), bool(g), bool(r), (int(mb[0]), int(mb[1]))) for k, g, r, mb in raw["logs"]),
                   bool(raw["awaiting"]), tuple(int(x) for x in raw["partition"]),
                   tuple(int(x) for x in raw["pending"]))


@dataclass(frozen=True)
class KeptWork:
    """What a worker keeps of the interrupted iteration when the failure stops it (taken before a new epoch is
    installed, handed back to :meth:`~ds_recycle.engine.engine.RecyclePipelineEngine.begin_repair`)."""

    iteration: int
    """The engine's iteration when the failure came."""
    progress: IterationProgress
    loss_sum: torch.Tensor | None
    """Last stage: the sum of the losses counted so far."""
    rows: dict[RowKey, list[torch.Tensor | None]]
    """The weight-gradient rows accumulated so far (empty when only the step was left: the reduced gradients
    stay on the parameters)."""
    completing: bool
    """Only the step was left: the reduced gradients are kept, not the rows."""
