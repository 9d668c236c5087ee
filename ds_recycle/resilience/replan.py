"""Re-planning from what the job measures: a slow worker's speed, and the stages' own costs.

At every iteration boundary of a membership epoch (none before a repaired iteration) each member posts one row
of its measurements, all-reduced over the members: its *pace* (seconds of F, B and W per micro-batch in its last
iteration, :meth:`~ds_recycle.engine.op_clock.OpClock.pace`) and its op clock's medians per kind
(:meth:`~ds_recycle.engine.op_clock.OpClock.as_row`). Every member writes only its own row, so the sum is the
table of every member's row, the same on every member; it is read at the next boundary (posted asynchronously,
it costs no wait). Every member then makes the same decisions from the same table and switches to the same plan
at the same boundary: no agreement round is needed.

- **Speed** (:mod:`ds_recycle.resilience.speed`): a worker found slow, or normal again, gets a plan that assumes
  its factor (:meth:`~ds_recycle.plan.PlanCache.get` with ``slow``).
- **Costs**: without ``recycle.costs_file``, once the medians cover ``window`` iterations of the epoch the
  members build the stages' :class:`~ds_recycle.plan.CostModel` from them (rounded to two significant digits, so
  that noise does not make new plans) and switch to a plan made for it when that plan is at least
  ``MEASURED_GAIN`` faster, under the measured costs, than the one running. Once per epoch.

A new epoch (a failure, a rejoin) starts over from the configured costs and normal speeds on every member alike
(:meth:`Replanner.reset`): a joiner, which has measured nothing, makes the same plans as the members.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ds_recycle.engine.op_clock import KINDS, stage_costs
from ds_recycle.events import Event, PlanSwitchEvent, SlowWorkerEvent
from ds_recycle.plan import CostModel, PlanCache, simulate
from ds_recycle.resilience.phases import rerouted
from ds_recycle.resilience.speed import SpeedVerdict, SpeedWatch

__all__ = ["MEASURED_GAIN", "Replanner"]

MEASURED_GAIN = 0.03
"""A plan from measured costs replaces the running one when it is at least this much shorter (a fraction)."""

_ROW = 1 + 2 * len(KINDS)


def _two_digits(value: float) -> float:
    if value <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(value)) - 1)
    return round(value / scale) * scale


def rounded(costs: CostModel) -> CostModel:
    """``costs`` with every duration rounded to two significant digits."""
    def digits(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(_two_digits(v) for v in values)
    return CostModel(digits(costs.F), digits(costs.B), digits(costs.W), digits(costs.O), comm=costs.comm)


class Replanner:
    """The measurement exchange and the plan switches it decides (see the module docstring)."""

    def __init__(self, plans: PlanCache, speed: SpeedWatch | None, measure_costs: bool,
                 new_cache: Callable[[CostModel], PlanCache]) -> None:
        self.configured = plans
        """The plans of the configured costs (a costs file, or uniform): each epoch starts with them."""
        self.plans = plans
        """The plans the epoch uses now (the measured costs' once switched)."""
        self.speed = speed
        self.measure_costs = measure_costs
        self._new_cache = new_cache
        self._posted: tuple[torch.Tensor, Any] | None = None
        self._checks = 0
        self._measured_tried = False

    def reset(self) -> None:
        """A new epoch: configured costs, normal speeds, nothing posted."""
        self.plans = self.configured
        if self.speed is not None:
            self.speed.reset()
        self._posted = None
        self._checks = 0
        self._measured_tried = False

    @property
    def active(self) -> bool:
        return self.speed is not None or self.measure_costs

    def at_boundary(self, engine: Any) -> list[Event]:
        """Read the table posted at the last boundary, switch plans if it says so, post this boundary's row.
        Returns the events of the switches made."""
        if not self.active or engine.repair is not None:
            return []
        events: list[Event] = []
        workers = engine.workers
        if self._posted is not None:
            table, work = self._posted
            engine.transport.wait(work, "worker measurements")
            self._checks += 1
            events = self._decide(engine, table)
        row = torch.zeros(workers.stages * workers.pipelines, _ROW, dtype=torch.float64,
                          device=engine.transport.device)
        mine = engine.stage_id * workers.pipelines + engine.worker[0]
        row[mine, 0] = engine.clock.pace()
        row[mine, 1:] = engine.clock.as_row().reshape(-1)
        self._posted = (row, engine.transport.post_all_reduce(row))
        return events

    def _decide(self, engine: Any, table: torch.Tensor) -> list[Event]:
        workers = engine.workers
        pipelines = workers.pipelines
        live = sorted(workers.ranks)
        verdicts: list[SpeedVerdict] = []
        if self.speed is not None:
            verdicts = self.speed.observe({w: float(table[w[1] * pipelines + w[0], 0]) for w in live})
        measured = self._measured_costs(engine, table)
        if measured is None and not verdicts:
            return []
        slow = self.speed.assumed(live) if self.speed is not None else {}
        if measured is not None:
            self.plans = measured
        plan = self.plans.get(workers.absent(), slow)
        events: list[Event] = [SlowWorkerEvent(worker=v.worker, rank=workers.ranks[v.worker], factor=v.factor,
                                               previous=v.previous, ratio=round(v.ratio, 4),
                                               iteration=engine.iteration) for v in verdicts]
        engine.switch_plan(plan)
        events.append(PlanSwitchEvent(absent=tuple(sorted(workers.absent())), rerouted=rerouted(plan),
                                      slow=plan.costs.slow, iteration=engine.iteration,
                                      measured=self.plans is not self.configured))
        return events

    def _measured_costs(self, engine: Any, table: torch.Tensor) -> PlanCache | None:
        """The plan cache of the measured costs when it is time to try them and they pay; else None."""
        window = self.speed.settings.window if self.speed is not None else 7
        if not self.measure_costs or self._measured_tried or self._checks < window:
            return None
        self._measured_tried = True
        workers = engine.workers
        per_stage = table[:, 1:].reshape(workers.stages, workers.pipelines, len(KINDS), 2).sum(dim=1)
        costs = stage_costs(per_stage)
        if costs is None:
            return None
        costs = rounded(costs)
        cache = self._new_cache(costs)
        slow = self.speed.assumed(sorted(workers.ranks)) if self.speed is not None else {}
        candidate = cache.get(workers.absent(), slow)
        running = simulate(engine.plan.workers, costs.with_slow(slow)).makespan
        return cache if candidate.makespan < (1.0 - MEASURED_GAIN) * running else None
