"""Replica dropping: a pipeline with a failed node leaves the job; the survivors go on.

Nodes are bookkept per stage: pipelines = the fewest live nodes of any stage (capped at D), since a
surviving node of a broken pipeline can pair with the live nodes of another broken pipeline (each
holds its stage's state). A failure costs the iteration in flight and `reconfigure_s` (torchft's
quorum); a returning node (or a spare, right after a failure) copies a peer's state (`rejoin_copy_s`) and joins the stage with the fewest
nodes at the next quorum (`reconfigure_s`).

- `SystemKind.DROP` (torchft): each pipeline still runs M micro-batches, so the global batch shrinks to
  P x M micro-batches: the training semantics change (fewer samples per step).
- `SystemKind.RECOVER` (ReCoVer): the lost replicas' quotas are redistributed, each surviving pipeline
  runs ceil(D M / P) micro-batches; the global batch is kept.

When a stage has no live node left, its state exists only in the checkpoint: roll back and restart once
there is one node per stage.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

from ds_recycle.cluster.systems.base import SimContext, System, SystemKind

__all__ = ["ReplicaDrop", "ReplicaRedistribute"]


class ReplicaDrop(System):
    kind = SystemKind.DROP

    def __init__(self, ctx: SimContext) -> None:
        self.by_stage: list[list[str]] = []
        self.pending: dict[str, int] = {}
        self.lost_stage = False
        super().__init__(ctx)

    def reference_rate(self) -> float:
        return self._rate(self.shape.pipelines)[0]

    def _rate(self, pipelines: int) -> tuple[float, float]:
        if pipelines < 1:
            return 0.0, math.inf
        it = self.timer.baseline_iteration_s(self.shape.stages, pipelines, self.shape.microbatches)
        samples = pipelines * self.shape.microbatches * self.timer.workload.micro_batch
        return samples / it, it

    def _apply(self) -> None:
        p = min(self.shape.pipelines, min(len(nodes) for nodes in self.by_stage))
        rate, it = self._rate(p)
        self.ledger.set_rate(rate, it)

    def start(self, t: float, nodes: Sequence[str]) -> None:
        self._distribute(list(nodes))
        self._apply()

    def _distribute(self, nodes: list[str]) -> None:
        S, D = self.shape.stages, self.shape.pipelines
        self.by_stage = [[] for _ in range(S)]
        for i, node in enumerate(nodes[: S * D]):
            self.by_stage[i % S].append(node)
        self.idle = nodes[S * D:]

    def on_remove(self, t: float, node: str) -> None:
        if node in self.idle:
            self.idle.remove(node)
            return
        if self.pending.pop(node, None) is not None:
            return
        stage = next(s for s, nodes in enumerate(self.by_stage) if node in nodes)
        self.by_stage[stage].remove(node)
        if self.lost_stage:
            self._try_restart()
            return
        if not self.by_stage[stage]:
            self.note(t, f"stage {stage} lost every replica: checkpoint fallback")
            self.lost_stage = True
            self.ledger.rollback()
            self._try_restart()
            return
        self.ledger.lose_inflight()
        self.reconfigure(self.a.reconfigure_s)
        self._apply()
        spares, self.idle = self.idle, []
        for spare in spares:
            self._place(t, spare)

    def on_ready(self, t: float, node: str) -> None:
        if self.lost_stage:
            self.idle.append(node)
            self._try_restart()
            return
        self._place(t, node)

    def _place(self, t: float, node: str) -> None:
        """Send `node` to the stage with the fewest nodes (after a state copy), or keep it idle."""
        counts = [len(n) + sum(1 for s in self.pending.values() if s == i)
                  for i, n in enumerate(self.by_stage)]
        stage = min(range(self.shape.stages), key=lambda s: counts[s])
        if counts[stage] >= self.shape.pipelines:
            self.idle.append(node)
            return
        self.pending[node] = stage
        self.ctx.queue.push(t + self.a.rejoin_copy_s, partial(self._join, node=node))

    def _join(self, t: float, node: str) -> None:
        stage = self.pending.pop(node, None)
        if stage is None:
            return
        if self.lost_stage:
            self.idle.append(node)
            return
        self.by_stage[stage].append(node)
        self.reconfigure(self.a.reconfigure_s)
        self._apply()

    def _try_restart(self) -> None:
        live = [n for nodes in self.by_stage for n in nodes] + self.idle + list(self.pending)
        self.pending.clear()
        self.ledger.rollback()
        if len(live) < self.shape.stages:
            self.ledger.set_rate(0.0, math.inf)
            self.by_stage = [[n for n in nodes] for nodes in self.by_stage]
            self.idle = [n for n in live if all(n not in s for s in self.by_stage)]
            return
        self.lost_stage = False
        self._distribute(live)
        self.restart()
        self._apply()


class ReplicaRedistribute(ReplicaDrop):
    kind = SystemKind.RECOVER

    def _rate(self, pipelines: int) -> tuple[float, float]:
        return self.full_batch_rate(self.shape.stages, pipelines)
