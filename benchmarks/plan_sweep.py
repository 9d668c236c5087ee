"""The sweep of plans the static plan benchmarks share: what the engine's plan cache gives for small shapes.

Shapes 2x2, 2x3, 3x2, 3x3, 4x2, 4x4; M = S and 2S; uniform and random stage costs (seeded); the three schedules;
no failure, every single failed worker and the first 10 pairs. Plans the planner refuses (a stage lost) are left out.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

from ds_recycle.plan import CostModel, Plan, PlanCache
from ds_recycle.plan.errors import PlanError

__all__ = ["SweptPlan", "sweep"]


@dataclass(frozen=True)
class SweptPlan:
    stages: int
    pipelines: int
    microbatches: int
    costs: str
    """``uniform`` or ``random``."""
    schedule: str
    failed: tuple[tuple[int, int], ...]
    plan: Plan

    def describe(self) -> str:
        return (f"{self.stages}x{self.pipelines} M={self.microbatches} {self.costs} {self.schedule} failed "
                f"{list(self.failed)}")


def sweep(schedules: tuple[str, ...] = ("adaptive", "zb-h1", "1f1b")) -> Iterator[SweptPlan]:
    """Every plan of the sweep (see the module docstring), in a fixed order."""
    rng = random.Random(0)
    for stages, pipelines in [(2, 2), (2, 3), (3, 2), (3, 3), (4, 2), (4, 4)]:
        workers = [(p, s) for p in range(pipelines) for s in range(stages)]
        failure_sets = [()] + [(w,) for w in workers] + list(itertools.combinations(workers, 2))[:10]
        for m in (stages, 2 * stages):
            for kind in ("uniform", "random"):
                costs = CostModel.uniform(stages) if kind == "uniform" else CostModel(
                    *(tuple(rng.uniform(lo, hi) for _ in range(stages)) for lo, hi in
                      ((0.5, 2.0), (0.5, 2.0), (0.3, 1.5), (0.0, 1.0))), comm=0.05)
                for schedule in schedules:
                    cache = PlanCache(stages, pipelines, m, costs, schedule=schedule)  # what the engine runs
                    for failed in failure_sets:
                        try:
                            plan = cache.get(failed)
                        except (PlanError, ValueError):
                            continue
                        yield SweptPlan(stages, pipelines, m, kind, schedule, tuple(failed), plan)
