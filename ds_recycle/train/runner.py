"""The seam between the training loop and an engine.

The loop (:mod:`ds_recycle.train.loop`) knows nothing of pipelines: it asks a :class:`Runner` for
one iteration at a time, and the one live rank for which :meth:`Runner.is_reporter` is true writes
the metrics. :class:`ds_recycle.train.vanilla.VanillaRunner` drives DeepSpeed's stock
``PipelineEngine``; ``ds_recycle.train.recycle.EngineRunner`` drives ds_recycle's, through ``ds_recycle.initialize``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ds_recycle.events import Event
from ds_recycle.plan.costs import CostModel

__all__ = ["CostReport", "IterationResult", "Runner"]


@dataclass(frozen=True)
class IterationResult:
    """What one training iteration reports."""

    loss: float | None
    """Mean loss over the global batch; ``None`` on ranks that do not know it."""
    live_workers: int
    """Workers alive during the iteration."""
    rerouted_microbatches: int
    """Micro-batches processed, at some stage, by a worker of another pipeline."""
    events: tuple[Event, ...] = field(default_factory=tuple)
    """Failures, agreements, plan switches, rejoins... that happened in this iteration (:mod:`ds_recycle.events`)."""


@dataclass(frozen=True)
class CostReport:
    """The costs a job measured, and how the plan it runs fares under them."""

    costs: CostModel
    """Per stage, seconds (:mod:`ds_recycle.engine.op_clock`)."""
    planned_s: float
    """The plan's time per iteration under :attr:`costs` (the planner's simulator)."""
    measured_s: float | None
    """The median wall time per iteration this worker measured (None: none complete yet)."""


class Runner(Protocol):
    """One engine, driven one iteration at a time."""

    def train_iteration(self, iteration: int) -> IterationResult:
        """Train on the global batch of ``iteration`` (its data is a pure function of the number)."""
        ...

    @property
    def generation(self) -> int:
        """How many times the job fell back to its checkpoint (0 without failure handling)."""
        ...

    def is_reporter(self) -> bool:
        """True on exactly one live rank: the one that knows the loss and writes metrics."""
        ...

    def finish(self, keep_final_state: bool) -> tuple[Event, ...]:
        """Training is over: the last step made final on every rank; the events meanwhile (a member lost at the end).
        ``keep_final_state``: :meth:`gather_final_state` follows."""
        ...

    def gather_final_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters by name, all stages, on the reporter (``None`` elsewhere)."""
        ...

    def save_checkpoint(self, directory: str, next_iteration: int) -> None:
        """Save a checkpoint from which training resumes at ``next_iteration`` (every rank calls it)."""
        ...

    def load_checkpoint(self, directory: str) -> int | None:
        """Load the latest checkpoint in ``directory``; the iteration to resume at, or ``None`` if there is none."""
        ...

    def measured_costs(self) -> CostReport | None:
        """The costs the job measured (every rank calls it at the same point); None where nothing is measured."""
        ...

    def close(self) -> None:
        """Release process groups (called once, at the end)."""
        ...
