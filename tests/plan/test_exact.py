"""The exact planners: CP-SAT proves small instances optimal, never does worse than the greedy, respects every
rule; the lower bounds never exceed a proven optimum; HiGHS answers the same questions more slowly."""
from __future__ import annotations

import pytest

from ds_recycle.plan import CostModel, lower_bound, make_plan, validate_plan
from ds_recycle.plan.bounds import best_lower_bound, critical_path_bound
from ds_recycle.plan.cpsat import time_scale
from ds_recycle.plan.errors import PlanError
from ds_recycle.plan.exact import solve_exact
from ds_recycle.plan.simulator import peak_memory

COSTS_2 = CostModel((1.0,) * 2, (1.5,) * 2, (0.5,) * 2, (0.2,) * 2, 0.1)
COSTS_3 = CostModel((1.0,) * 3, (1.5,) * 3, (0.5,) * 3, (0.2,) * 3, 0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages, pipelines, microbatches, failed, memory_limit, iterations, optimizer", [
    (2, 2, 2, [(0, 1)], None, 1, "staggered"),
    (2, 2, 3, [(1, 0)], 2, 1, "staggered"),      # HiGHS could not prove this one in 20 s
    (3, 2, 2, [(1, 1)], 2, 1, "staggered"),
    (3, 1, 3, [], 2, 2, "staggered"),
    (2, 3, 3, [(0, 0)], None, 1, "synchronous"),  # the orphans' routing is the solver's choice
])
def test_cpsat_proves_small_instances(stages, pipelines, microbatches, failed, memory_limit, iterations,
                                      optimizer) -> None:
    costs = COSTS_3 if stages == 3 else COSTS_2
    kw = {"iterations": iterations, "optimizer": optimizer, "memory_limit": memory_limit}
    greedy = make_plan(stages, pipelines, microbatches, costs, failed, search=0, **kw)
    result = solve_exact(stages, pipelines, microbatches, costs, failed, time_limit=20, greedy=greedy, **kw)
    validate_plan(result.plan)
    assert result.optimal, result.status
    assert result.plan.makespan <= greedy.makespan + 1e-9 and result.heuristic_makespan == greedy.makespan
    assert result.dual_bound == result.plan.makespan and result.remaining_gap == 0.0
    bound = best_lower_bound(stages, pipelines, microbatches, costs, failed, iterations, optimizer=optimizer,
                             memory_limit=memory_limit)
    assert lower_bound(stages, pipelines, microbatches, costs, failed, iterations) <= bound
    assert bound <= result.plan.makespan + 1e-9  # the bounds are valid: never above a proven optimum
    if memory_limit is not None:
        assert max(peak_memory(ops) for ops in result.plan.workers.values()) <= memory_limit


def test_cpsat_beats_the_greedy_where_it_can() -> None:
    # first-stage failure, three pipelines: the greedy (without its local search) is 1.4% above the optimum
    costs = CostModel((1.3, 1.0, 1.5), (1.3, 1.0, 1.5), (1.0, 1.0, 1.2), (0.5,) * 3, 0.05)
    greedy = make_plan(3, 3, 3, costs, [(0, 0)], search=0)
    result = solve_exact(3, 3, 3, costs, [(0, 0)], time_limit=20, greedy=greedy)
    validate_plan(result.plan)
    assert result.plan.makespan < greedy.makespan - 1e-9
    assert result.gap > 0


@pytest.mark.timeout(120)
def test_highs_agrees_on_a_small_instance() -> None:
    cp = solve_exact(2, 2, 2, COSTS_2, [(0, 1)], time_limit=20)
    highs = solve_exact(2, 2, 2, COSTS_2, [(0, 1)], time_limit=1, solver="highs")  # proves it in ~12 s
    validate_plan(highs.plan)
    assert highs.solver == "highs" and cp.optimal
    assert highs.plan.makespan >= cp.plan.makespan - 1e-9   # nobody beats a proven optimum
    assert highs.dual_bound <= cp.plan.makespan + 1e-9


def test_greedy_at_the_bound_is_optimal_without_solving() -> None:
    costs = CostModel.uniform(3, o=0.5, comm=0.05)
    result = solve_exact(3, 2, 4, costs, [(1, 1)], time_limit=1)
    assert result.optimal and result.gap == 0.0 and result.status == "greedy at the bound"
    assert result.plan.makespan == lower_bound(3, 2, 4, costs, [(1, 1)])


def test_unknown_solver_is_named() -> None:
    with pytest.raises(PlanError, match="solver = 'gurobi'"):
        solve_exact(2, 1, 2, COSTS_2, solver="gurobi")


def test_time_scale() -> None:
    assert time_scale(CostModel.uniform(2, 1, 2, 1, 0, 0)) == (1, False)
    assert time_scale(COSTS_2) == (10, False)
    assert time_scale(CostModel.uniform(2, 1.05, 1, 0.7, 0.5, 0.15)) == (100, False)
    assert time_scale(CostModel.uniform(2, 1 / 3)) == (10_000, True)


def test_critical_path_bound_hand_checked() -> None:
    # S=3, one failure at stage 0 of D=2, M=2: stage 0's survivor runs n=4 micro-batches per iteration;
    # F+tail = 1 + 2*(1+1+2*0.5) = 7; all its work 4*3 = 12; first B at 7, then 4*(B+W) = 8: 15 per iteration
    costs = CostModel.uniform(3, 1, 1, 1, 0, 0.5)
    assert critical_path_bound(3, 2, 2, costs, [(0, 0)], 1) == pytest.approx(15.0)
    assert critical_path_bound(3, 2, 2, costs, [(0, 0)], 2) == pytest.approx(30.0)
    # with at most 2 held: F+tail + (4-2)*F + 4*(B+W) = 7 + 2 + 8 = 17
    assert critical_path_bound(3, 2, 2, costs, [(0, 0)], 1, memory_limit=2) == pytest.approx(17.0)
    # synchronous: K * max_s(head_s + span_s) + (K-1) * O_0 + max O (O = 0 here)
    assert critical_path_bound(3, 2, 2, costs, [(0, 0)], 2, optimizer="synchronous") == pytest.approx(30.0)
