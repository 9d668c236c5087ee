"""Checkpoint-restart, as DeepSpeed under torchrun recovers: any failure stops the whole job.

- Periodic blocking checkpoints (the shared `CheckpointPolicy`).
- A failure rolls back to the last checkpoint (all work since is lost) and restarts the job
  (`restart_s`: launch, group init, checkpoint load).
- Nodes: a spare replaces the failed node at once. Otherwise, under `ShrinkPolicy.SHRINK` the job
  restarts on P = live // S pipelines keeping the global batch (gradient accumulation: ceil(D M / P)
  micro-batches per pipeline), and grows back with a planned restart (save, then restart; no work lost)
  as soon as joined nodes make one more pipeline; under `ShrinkPolicy.WAIT` it stays stopped until D
  pipelines can be formed again.
- Its iteration time is the planner's failure-free plan of the baseline schedule at that shape.
"""
from __future__ import annotations

from collections.abc import Sequence

from ds_recycle.cluster.assumptions import ShrinkPolicy
from ds_recycle.cluster.systems.base import SimContext, System, SystemKind

__all__ = ["CheckpointRestart"]


class CheckpointRestart(System):
    kind = SystemKind.CHECKPOINT

    def __init__(self, ctx: SimContext) -> None:
        self.job: list[str] = []
        self.pipelines = 0
        super().__init__(ctx)

    def reference_rate(self) -> float:
        return self.full_batch_rate(self.shape.stages, self.shape.pipelines)[0]

    def _possible_pipelines(self) -> int:
        p = min(self.shape.pipelines, (len(self.job) + len(self.idle)) // self.shape.stages)
        if self.a.shrink_policy is ShrinkPolicy.WAIT and p < self.shape.pipelines:
            return 0
        return p

    def _form(self) -> None:
        """Take P x S nodes into the job (the rest wait idle) and set the rate."""
        self.pipelines = self._possible_pipelines()
        pool = self.job + self.idle
        need = self.pipelines * self.shape.stages
        self.job, self.idle = pool[:need], pool[need:]
        rate, it = self.full_batch_rate(self.shape.stages, self.pipelines)
        self.ledger.set_rate(rate, it)

    def start(self, t: float, nodes: Sequence[str]) -> None:
        self.idle = list(nodes)
        self._form()

    def on_remove(self, t: float, node: str) -> None:
        if node in self.idle:
            self.idle.remove(node)
            return
        self.job.remove(node)
        self.ledger.rollback()
        if self._possible_pipelines():
            self.restart()
        else:
            self.note(t, "too few nodes: waiting for replacements")
        self._form()

    def on_ready(self, t: float, node: str) -> None:
        self.idle.append(node)
        if self._possible_pipelines() <= self.pipelines:
            return
        if self.pipelines == 0:
            self.ledger.rollback()
            self.restart()
        else:
            self.ledger.checkpoint_now()
            self.restart(extra_s=self.a.checkpoint_cost_s)
        self.note(t, "restart to grow")
        self._form()
