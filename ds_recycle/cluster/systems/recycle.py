"""ReCycle: failed workers' micro-batches re-routed to their data-parallel peers.

- Throughput of every failure set comes from the planner (`PipelineTimer.recycle_iteration_s`, a
  `PlanCache` lookup); the global batch never changes.
- A failure costs the iteration in flight plus `reconfigure_s` (detect, agree, re-form groups, look up
  the cached plan); training goes on with the adapted plan.
- A node that comes back (or a spare) copies its stage's state from a live peer (`rejoin_copy_s`,
  while the others train), then rejoins at an iteration boundary (`reconfigure_s`); it takes the
  stage with the most failed workers.
- Optionally (`Assumptions.recycle_rebalance`, beyond the paper): after a failure, a live node moves
  from the stage with the fewest failures to the one with the most (it copies that stage's state from a
  peer, `rejoin_copy_s`, then a re-plan, `reconfigure_s`) as long as the planner says the job gets
  faster; this keeps failures spread over the stages when nodes do not come back.
- When a stage has lost every replica, re-routing is impossible: roll back to the last checkpoint and
  restart once at least one node per stage is available, assigning nodes to stages so that failures are
  spread as evenly as possible.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

from ds_recycle.cluster.systems.base import SimContext, System, SystemKind
from ds_recycle.cluster.timing import StageLostError

__all__ = ["ReCycle"]

Slot = tuple[int, int]  # (pipeline, stage)


class ReCycle(System):
    kind = SystemKind.RECYCLE

    def __init__(self, ctx: SimContext) -> None:
        self.slots: dict[Slot, str | None] = {}
        self.where: dict[str, Slot] = {}
        self.pending: dict[str, Slot] = {}
        self.stage_lost = False
        super().__init__(ctx)

    def reference_rate(self) -> float:
        return self.timer.samples_per_iteration / self.timer.recycle_iteration_s(frozenset())

    # -- state -----------------------------------------------------------------------------------
    def _failed(self) -> frozenset[Slot]:
        return frozenset(slot for slot, node in self.slots.items() if node is None)

    def _assign_balanced(self, nodes: Sequence[str]) -> None:
        """Fill slots so that every stage gets nodes in turn (pipeline-major within a stage)."""
        S, D = self.shape.stages, self.shape.pipelines
        order = [(d, s) for d in range(D) for s in range(S)]
        self.slots = {slot: None for slot in order}
        self.where = {}
        for node, slot in zip(nodes, order):
            self.slots[slot] = node
            self.where[node] = slot
        self.idle = list(nodes[len(order):])

    def _apply_rate(self) -> None:
        try:
            it = self.timer.recycle_iteration_s(self._failed())
        except StageLostError as err:
            self._lose_stage(err)
            return
        self.ledger.set_rate(self.timer.samples_per_iteration / it, it)

    # -- hooks -------------------------------------------------------------------------------------
    def start(self, t: float, nodes: Sequence[str]) -> None:
        self._assign_balanced(list(nodes))
        self._apply_rate()
        self._fill_from_idle(t)

    def on_remove(self, t: float, node: str) -> None:
        if node in self.idle:
            self.idle.remove(node)
            return
        if node in self.pending:
            del self.pending[node]
            return
        slot = self.where.pop(node)
        self.slots[slot] = None
        if self.stage_lost:
            self._try_restart(t)
            return
        self.ledger.lose_inflight()
        self.reconfigure(self.a.reconfigure_s)
        self._apply_rate()
        if not self.stage_lost:
            self._fill_from_idle(t)
            if self.a.recycle_rebalance and not self.pending:
                self._rebalance(t)

    def _rebalance(self, t: float) -> None:
        """Move live nodes towards the most-failed stage while the planner says it pays."""
        moved = 0
        while True:
            counts = self._failures_per_stage()
            worst = max(range(self.shape.stages), key=lambda s: counts[s])
            best = min(range(self.shape.stages), key=lambda s: counts[s])
            if counts[worst] - counts[best] < 2:
                break
            src = next(sl for sl, n in self.slots.items() if n is not None and sl[1] == best)
            dst = next(sl for sl, n in self.slots.items() if n is None and sl[1] == worst)
            now_s = self.timer.recycle_iteration_s(self._failed())
            trial = (self._failed() - {dst}) | {src}
            if self.timer.recycle_iteration_s(frozenset(trial)) >= now_s * (1 - 1e-9):
                break
            node = self.slots[src]
            assert node is not None
            self.slots[src], self.slots[dst] = None, node
            self.where[node] = dst
            moved += 1
        if moved:
            self.note(t, f"re-balance: {moved} node(s) change stage")
            self.reconfigure(self.a.rejoin_copy_s + self.a.reconfigure_s)
            self._apply_rate()

    def on_ready(self, t: float, node: str) -> None:
        self.idle.append(node)
        if self.stage_lost:
            self._try_restart(t)
        else:
            self._fill_from_idle(t)

    # -- rejoin --------------------------------------------------------------------------------------
    def _fill_from_idle(self, t: float) -> None:
        taken = set(self.pending.values())
        while self.idle:
            free = [slot for slot in self._failed() if slot not in taken]
            if not free:
                return
            counts = self._failures_per_stage()
            slot = max(free, key=lambda sl: (counts[sl[1]], -sl[1], -sl[0]))
            node = self.idle.pop(0)
            self.pending[node] = slot
            taken.add(slot)
            self.ctx.queue.push(t + self.a.rejoin_copy_s, partial(self._rejoin, node=node))

    def _failures_per_stage(self) -> list[int]:
        counts = [0] * self.shape.stages
        for _, s in self._failed():
            counts[s] += 1
        return counts

    def _rejoin(self, t: float, node: str) -> None:
        slot = self.pending.pop(node, None)
        if slot is None or self.stage_lost or self.slots.get(slot) is not None:
            if slot is not None:
                self.idle.append(node)
            return
        self.slots[slot] = node
        self.where[node] = slot
        self.note(t, f"{node} rejoins as worker {slot}")
        self.reconfigure(self.a.reconfigure_s)
        self._apply_rate()

    # -- checkpoint fallback ------------------------------------------------------------------------
    def _lose_stage(self, err: StageLostError) -> None:
        self.note(self.ledger.now, f"stage {err.stage} lost every replica: checkpoint fallback")
        self.stage_lost = True
        self.ledger.rollback()
        self.ledger.set_rate(0.0, math.inf)
        for node in list(self.pending):
            self.idle.append(node)
        self.pending.clear()
        self._try_restart(self.ledger.now)

    def _try_restart(self, t: float) -> None:
        live = [n for n in self.where] + self.idle
        self.ledger.rollback()
        if len(live) < self.shape.stages:
            self.ledger.set_rate(0.0, math.inf)
            return
        self.stage_lost = False
        self._assign_balanced(live)
        self.restart()
        self._apply_rate()
