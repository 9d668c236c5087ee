"""Per-iteration snapshots of one stage's training state, so an interrupted iteration can be redone.

At the start of iteration ``k`` (after iteration ``k - 1``'s optimizer step is final, post-validation
included) a worker copies its stage's parameters, optimizer state, learning-rate schedule and step
counters. After a failure the survivors agree on the earliest iteration any of them had not finished and
all restore that iteration's snapshot: a stage that had already stepped is rolled back, one that had not is
untouched, so every stage starts the redo from the same, consistent model.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SnapshotRing", "StageSnapshot"]


@dataclass(frozen=True)
class StageSnapshot:
    """One stage's state at the start of ``iteration``."""

    iteration: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any]
    lr_scheduler: dict[str, Any] | None
    global_steps: int
    global_samples: int

    @classmethod
    def take(cls, engine: Any) -> StageSnapshot:
        sched = engine.lr_scheduler
        return cls(engine.iteration, [p.detach().clone() for p in engine.module.parameters()],
                   copy.deepcopy(engine.optimizer.state_dict()),
                   copy.deepcopy(sched.state_dict()) if sched is not None else None,
                   engine.global_steps, engine.global_samples)

    def restore(self, engine: Any) -> None:
        with torch.no_grad():
            for p, saved in zip(engine.module.parameters(), self.params):
                p.copy_(saved)
                p.grad = None
        engine.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        if self.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(copy.deepcopy(self.lr_scheduler))
        engine.global_steps, engine.global_samples = self.global_steps, self.global_samples
        engine.iteration = self.iteration


class SnapshotRing:
    """The last ``depth`` snapshots, by iteration (survivors are at most one iteration apart; 3 is ample)."""

    def __init__(self, depth: int = 3) -> None:
        self.depth = depth
        self._items: OrderedDict[int, StageSnapshot] = OrderedDict()

    def take(self, engine: Any) -> None:
        self._items[engine.iteration] = StageSnapshot.take(engine)
        while len(self._items) > self.depth:
            self._items.popitem(last=False)

    @property
    def earliest(self) -> int:
        """The earliest iteration whose start state is held (-1: none yet)."""
        return next(iter(self._items)) if self._items else -1

    @property
    def latest(self) -> int:
        """The latest iteration whose start state is held (-1: none yet)."""
        return next(reversed(self._items)) if self._items else -1

    def restore(self, iteration: int, engine: Any) -> None:
        if iteration not in self._items:
            raise RuntimeError(f"cannot redo iteration {iteration}: this rank holds snapshots of iterations "
                               f"{list(self._items)} only")
        self._items[iteration].restore(engine)
        for later in [k for k in self._items if k > iteration]:
            del self._items[later]
