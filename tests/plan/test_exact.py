"""The exact MILP planner never does worse than the greedy, and its plans are valid."""
from __future__ import annotations

import pytest

from ds_recycle.plan import CostModel, lower_bound, validate_plan
from ds_recycle.plan.exact import solve_exact


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages, pipelines, microbatches, failed, memory_limit", [
    (2, 2, 2, [(0, 1)], None),     # the solver hits its time limit: the greedy plan is kept
    (2, 1, 3, [], 2),
    (3, 2, 2, [(1, 1)], 2),
    (2, 2, 2, [], None),
])
def test_exact_never_worse(stages, pipelines, microbatches, failed, memory_limit) -> None:
    costs = CostModel((1.0,) * stages, (1.5,) * stages, (0.5,) * stages, (0.2,) * stages, 0.1)
    result = solve_exact(stages, pipelines, microbatches, costs, failed, memory_limit=memory_limit,
                         time_limit=4)
    validate_plan(result.plan)
    assert result.plan.makespan <= result.heuristic_makespan + 1e-9
    assert result.plan.makespan >= lower_bound(stages, pipelines, microbatches, costs, failed) - 1e-9
    assert result.dual_bound <= result.plan.makespan + 1e-9
    assert result.gap >= -1e-12


def test_greedy_at_the_bound_is_optimal_without_solving() -> None:
    costs = CostModel.uniform(3, o=0.5, comm=0.05)
    result = solve_exact(3, 2, 4, costs, [(1, 1)], time_limit=1)
    assert result.optimal and result.gap == 0.0
    assert result.plan.makespan == lower_bound(3, 2, 4, costs, [(1, 1)])
