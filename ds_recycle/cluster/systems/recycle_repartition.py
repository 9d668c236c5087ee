"""ReCycle + re-partition: re-route at once, then move layers while a failure lasts (beyond the paper).

The same planner as :class:`~ds_recycle.cluster.systems.recycle.ReCycle`, on per-layer costs
(:meth:`Workload.layers_at`): every failure is re-routed at once, exactly as ReCycle does. Once the membership
has stayed the same for ``Assumptions.repartition_after_iterations`` iterations, the planner compares staying
with every candidate partition (:func:`~ds_recycle.plan.partition.choose_partition`, horizon
``Assumptions.repartition_horizon`` iterations) and, when moving pays, the job pauses for the move's transfer
(neighbours' layers' parameters and optimizer state from live holders at the inter-node bandwidth) and trains
on the new partition. A rejoin changes the membership again: the same rule moves the layers back (the job's own
partition is always a candidate). A checkpoint fallback restarts on the job's own partition.
"""
from __future__ import annotations

from functools import partial

from ds_recycle.cluster.systems.base import SimContext, SystemKind
from ds_recycle.cluster.systems.recycle import ReCycle
from ds_recycle.cluster.timing import StageLostError

__all__ = ["ReCycleRepartition"]


class ReCycleRepartition(ReCycle):
    kind = SystemKind.RECYCLE_REPARTITION

    def __init__(self, ctx: SimContext) -> None:
        self.base = ctx.timer.layers()[1]
        self.parts = self.base
        self._membership = 0
        super().__init__(ctx)

    def _apply_rate(self) -> None:
        if self.stage_lost:
            self.parts = self.base
        try:
            it = self.timer.partition_iteration_s(self._failed(), self.parts)
        except StageLostError as err:
            self._lose_stage(err)
            return
        self.ledger.set_rate(self.timer.samples_per_iteration / it, it)
        self._membership += 1
        wait = self.a.repartition_after_iterations * it
        self.ctx.queue.push(self.ledger.now + wait, partial(self._consider, membership=self._membership))

    def _consider(self, t: float, membership: int) -> None:
        """The membership has lasted: move layers if the planner says it pays."""
        if membership != self._membership or self.stage_lost:
            return
        if self.parts == self.base and not self._failed():
            return
        choice = self.timer.repartition_choice(self._failed(), self.parts, self.a.repartition_horizon)
        if not choice.pays:
            return
        self.note(t, f"re-partition {list(self.parts)} -> {list(choice.partition)} "
                     f"({choice.current_iteration_s:.3f} -> {choice.moved_iteration_s:.3f} s/iteration, "
                     f"move {choice.move_s:.2f} s)")
        self.parts = choice.partition
        self.reconfigure(choice.move_s)
        it = choice.moved_iteration_s
        self.ledger.set_rate(self.timer.samples_per_iteration / it, it)
