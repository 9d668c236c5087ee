"""One stage's training state, moved whole between replicas: to a restarted worker that joins, or to a replica
that a failure caught between its stage's gradient reduction and its step (see
:mod:`ds_recycle.resilience.salvage`). Taken only when it is sent, never kept: failure-free training copies
nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StageState"]


@dataclass(frozen=True)
class StageState:
    """A stage's parameters, optimizer state, learning-rate schedule and counters at ``iteration``.

    ``clipped_steps`` and, for a replica brought forward to a step it missed, the clipping-norm contributions
    and losses of the last stepped iterations (None: not carried) ride along.
    """

    iteration: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any]
    lr_scheduler: dict[str, Any] | None
    global_steps: int
    global_samples: int
    clipped_steps: int | None = None
    contributions: dict[int, torch.Tensor] | None = None
    losses: dict[int, torch.Tensor] | None = None

    @classmethod
    def of(cls, engine: Any, **extra: Any) -> StageState:
        """The engine's state as it is (references: serialize it before the engine moves on)."""
        sched = engine.lr_scheduler
        return cls(engine.iteration, [p.detach() for p in engine.module.parameters()], engine.optimizer.state_dict(),
                   sched.state_dict() if sched is not None else None, engine.global_steps, engine.global_samples,
                   **extra)

    def restore(self, engine: Any) -> None:
        """Parameters, optimizer and schedule state, counters and iteration into ``engine`` (the extras are the
        engine's to adopt)."""
        with torch.no_grad():
            for p, saved in zip(engine.module.parameters(), self.params):
                p.copy_(saved)
                p.grad = None
        engine.optimizer.load_state_dict(self.optimizer)
        if self.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(self.lr_scheduler)
        engine.global_steps, engine.global_samples = self.global_steps, self.global_samples
        engine.iteration = self.iteration
