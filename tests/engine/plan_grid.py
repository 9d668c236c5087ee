"""The planner's plans the engine would run, for the tests of how they run over NCCL's matching."""
from __future__ import annotations

import itertools
from typing import Any

from ds_recycle.plan import CostModel, PlanCache

Failed = tuple[tuple[int, int], ...]


def grid(schedule: str = "adaptive", pairs: int = 4) -> list[tuple[str, Any, Failed]]:
    """The planner's plans the engine would run, as the failure handler's plan cache makes them: shapes 2x2, 2x3, 3x2
    and 4x2, M = S and 2S, no failed worker, each one, and the first ``pairs`` pairs in different stages:
    ``(name, plan, failed)``."""
    plans = []
    for stages, pipelines in [(2, 2), (2, 3), (3, 2), (4, 2)]:
        workers = [(p, s) for p in range(pipelines) for s in range(stages)]
        failure_sets: list[Failed] = [()] + [(w,) for w in workers] + [
            pair for pair in itertools.combinations(workers, 2) if pair[0][1] != pair[1][1]][:pairs]
        for m in (stages, 2 * stages):
            cache = PlanCache(stages, pipelines, m, CostModel.uniform(stages), schedule=schedule)
            plans.extend((f"{schedule} {stages}x{pipelines} M={m} failed {list(f)}", cache.get(f), f)
                         for f in failure_sets)
    return plans
