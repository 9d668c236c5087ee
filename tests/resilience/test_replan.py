"""The re-planning decisions every member makes from the measurements table (ds_recycle.resilience.replan).

The table is given directly (what the all-reduce of every member's row returns); the engine is a recorder of the
plan it is switched to. The exchange itself runs in the multi-process tests (tests/resilience/test_fail_slow.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ds_recycle.engine.op_clock import KINDS
from ds_recycle.events import PlanSwitchEvent, SlowWorkerEvent
from ds_recycle.plan import CostModel, PlanCache
from ds_recycle.resilience.replan import Replanner, rounded
from ds_recycle.resilience.speed import SpeedWatch
from ds_recycle.runtime.grid import WorkerMap

S, D, M = 2, 3, 4


@dataclass
class _Engine:
    plan: Any
    workers: WorkerMap = field(default_factory=lambda: WorkerMap.dense(S, D))
    iteration: int = 10
    switched: list[Any] = field(default_factory=list)

    def switch_plan(self, plan: Any) -> None:
        self.switched.append(plan)
        self.plan = plan


def _cache(costs: CostModel) -> PlanCache:
    return PlanCache(S, D, M, costs)


def _table(stage_costs: list[tuple[float, float, float, float]], slow: dict[tuple[int, int], float],
           absent: frozenset[tuple[int, int]] = frozenset()) -> torch.Tensor:
    """Every member's row: pace, then (median, count) per kind of KINDS."""
    table = torch.zeros(S * D, 1 + 2 * len(KINDS), dtype=torch.float64)
    for s in range(S):
        for d in range(D):
            f, b, w, o = stage_costs[s]
            factor = slow.get((d, s), 1.0)
            row = table[s * D + d]
            if (d, s) in absent:
                continue
            row[0] = (f + b + w) * factor
            for k, value in zip(("F", "B", "W", "O"), (f, b, w, o)):
                i = 1 + 2 * KINDS.index(k)
                row[i], row[i + 1] = value * factor, 1.0
    return table


def test_a_slow_worker_gets_a_plan_that_assumes_it_and_the_events_say_so() -> None:
    plans = _cache(CostModel.uniform(S))
    engine = _Engine(plans.get([]))
    replan = Replanner(plans, SpeedWatch(), measure_costs=False, new_cache=_cache)
    table = _table([(1.0, 1.0, 1.0, 0.0)] * S, {(1, 1): 3.0})
    events = []
    for _ in range(10):
        events += replan._decide(engine, table)
    kinds = [type(e) for e in events]
    assert kinds == [SlowWorkerEvent, PlanSwitchEvent], events
    slow, switch = events
    assert isinstance(slow, SlowWorkerEvent) and slow.worker == (1, 1) and slow.rank == 4 and slow.factor == 3.0
    assert isinstance(switch, PlanSwitchEvent) and switch.slow == ((1, 1, 3.0),) and not switch.measured
    assert engine.plan.costs.slow == ((1, 1, 3.0),) and switch.rerouted > 0
    replan.reset()
    assert replan.speed is not None and replan.speed.factors == {}


def test_measured_costs_replace_uniform_ones_once_per_epoch_when_they_pay() -> None:
    """Worker (1, 0) absent: under the measured costs the uniform costs' plan takes 40.0, the measured costs' 38.1."""
    plans = _cache(CostModel.uniform(S))
    engine = _Engine(plans.get([(1, 0)]), WorkerMap.dense(S, D, {(1, 0)}))
    replan = Replanner(plans, SpeedWatch(), measure_costs=True, new_cache=_cache)
    lopsided = _table([(1.0, 1.1, 0.9, 0.1), (3.0, 3.3, 2.7, 0.1)], {}, frozenset({(1, 0)}))  # last stage 3x
    events = [e for _ in range(6) for e in replan._decide(engine, lopsided)]
    assert events == []  # fewer checks than the detector's window: not yet
    replan._checks = 7
    (switch,) = replan._decide(engine, lopsided)
    assert isinstance(switch, PlanSwitchEvent) and switch.measured and switch.slow == () and switch.absent == ((1, 0),)
    assert engine.plan.costs == rounded(engine.plan.costs) and engine.plan.costs.F == (1.0, 3.0)
    replan._checks = 20
    assert replan._decide(engine, lopsided) == []  # once per epoch
    replan.reset()
    assert replan.plans is plans


def test_measured_costs_that_do_not_pay_keep_the_plan() -> None:
    plans = _cache(CostModel.uniform(S))
    engine = _Engine(plans.get([]))
    replan = Replanner(plans, None, measure_costs=True, new_cache=_cache)
    replan._checks = 7
    assert replan._decide(engine, _table([(1.0, 1.0, 1.0, 0.0)] * S, {})) == []
    assert engine.switched == [] and replan.plans is plans


def test_two_significant_digits() -> None:
    costs = rounded(CostModel((0.012345, 1.26), (0.0, 98.7), (3.14159, 0.5), (0.0, 0.0), comm=0.3))
    assert costs.F == (0.012, 1.3) and costs.B == (0.0, 99.0) and costs.W == (3.1, 0.5)
