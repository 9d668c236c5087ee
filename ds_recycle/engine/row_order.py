"""A pipeline's own gradient row adds its micro-batches in index order, whatever order the plan runs them in.

A worker that processes all of its own pipeline's micro-batches at its stage keeps one weight-gradient sum for
them (the row ``(pipeline, -1)`` of :class:`~ds_recycle.engine.optimizer.StaggeredOptimizer`). Failure-free, a
worker runs its W (or fused B+W) in micro-batch order ``0, 1, ..., M-1``, so the row is
``((g0 + g1) + g2) + ...``. A failure plan may run a worker's own micro-batches in another order to fit
re-routed work into its bubbles; floating-point addition is not associative, so accumulating in that order
would leave the row, and the model, a rounding away from the failure-free one.

:class:`RowOrder` keeps the failure-free order whatever plan it runs: a weight-gradient accumulation whose
predecessors in its row have not accumulated yet is *held* and run right after the last of them. The planner
places split W in that order (:mod:`ds_recycle.plan.listsched`), so its plans need a hold only where a memory
limit forced one; a plan from elsewhere may need more. A held
split W keeps its autograd graph a little longer and moves its compute later on the same worker (it sends
nothing, so no peer waits on it); a fused B+W runs when the plan says (its input gradient is sent on) with its
weight gradient set aside, and the set-aside gradient is added in its turn. Pipelines whose micro-batches are
re-routed keep a row per micro-batch and are never held.

Only accumulated micro-batches count as done (:attr:`~ds_recycle.engine.position.IterationProgress.w_done`),
so a failure that drops held work has them redone by the repair like any micro-batch whose W had not run.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from ds_recycle.engine.position import MicroBatch

__all__ = ["RowOrder"]

logger = logging.getLogger(__name__)

Accumulate = Callable[[], None]
"""Adds one micro-batch's weight gradient to its row."""


class RowOrder:
    """Runs weight-gradient accumulations of summed rows in micro-batch order (see the module docstring)."""

    def __init__(self, summed: Callable[[int], bool]) -> None:
        self._summed = summed
        """Whether a pipeline's micro-batches at this stage share one row (asked at each use: rows change with
        the plan)."""
        self._held: dict[MicroBatch, Accumulate] = {}

    @property
    def held(self) -> tuple[MicroBatch, ...]:
        """Micro-batches whose accumulation waits for a predecessor."""
        return tuple(sorted(self._held))

    def ready(self, mb: MicroBatch, done: set[MicroBatch]) -> bool:
        """Whether ``mb``'s weight gradient may be added to its row now (every earlier micro-batch of a summed row
        is in ``done``)."""
        pipeline, index = mb
        return not self._summed(pipeline) or all((pipeline, j) in done for j in range(index))

    def submit(self, mb: MicroBatch, accumulate: Accumulate, done: set[MicroBatch]) -> None:
        """Run ``accumulate`` now and add ``mb`` to ``done``, then run the held successors it releases; or hold it
        until its predecessors are done."""
        if mb in self._held or mb in done:
            raise RuntimeError(f"the weight gradient of micro-batch {mb} is accumulated twice in one iteration")
        if not self.ready(mb, done):
            self._held[mb] = accumulate
            return
        accumulate()
        done.add(mb)
        pipeline, index = mb
        while (pipeline, index + 1) in self._held:
            index += 1
            self._held.pop((pipeline, index))()
            done.add((pipeline, index))

    def flush(self, done: set[MicroBatch], where: str) -> None:
        """Before the step: run what is still held, in index order. A valid plan leaves nothing here (every
        predecessor runs on this worker before the step); if one did, its row is summed in another order than
        failure-free, and that is logged."""
        if not self._held:
            return
        logger.warning("%s: weight gradients of %s waited for micro-batches this plan never ran here; added in index "
                       "order without them (the row's rounding may differ from the failure-free run's)",
                       where, list(self.held))
        for mb in self.held:
            self._held.pop(mb)()
            done.add(mb)

    def drop(self) -> None:
        """Forget held work (an interrupted iteration: it is redone by the repair)."""
        self._held.clear()
