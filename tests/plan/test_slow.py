"""Fail-slow in the planner: per-worker speed factors in the cost model, offloaded micro-batches, honest times."""
from __future__ import annotations

import dataclasses

import pytest

from ds_recycle.plan import CostModel, Plan, make_plan, simulate, validate_plan
from ds_recycle.plan.errors import PlanError, PlanValidationError
from ds_recycle.plan.routing import route

UNIFORM = CostModel.uniform(4, 1.0, 1.0, 1.0)


def _offloaded(plan: Plan, worker: tuple[int, int]) -> int:
    p, s = worker
    return sum(plan.worker_of(s, (p, i)) != worker for i in range(plan.microbatches))


def test_factor_scales_every_op_of_that_worker_only() -> None:
    costs = UNIFORM.with_slow({(1, 2): 2.0, (0, 0): 1.0})
    assert costs.slow == ((1, 2, 2.0),)  # factors of 1 are left out
    assert costs.duration("W", (1, 2)) == 2.0 and costs.duration("W", (0, 2)) == 1.0
    assert CostModel.from_json(costs.to_json()) == costs
    assert "slow" not in UNIFORM.to_json()  # the format of plans without slow workers is unchanged


@pytest.mark.parametrize("slow, fix", [(((0, 9, 2.0),), "outside the 4 stages"), (((0, 1, 0.0),), "factor > 0"),
                                       (((0, 1, 2.0), (0, 1, 3.0)), "names a worker twice")])
def test_bad_slow_entries_are_refused(slow: tuple[tuple[int, int, float], ...], fix: str) -> None:
    with pytest.raises(PlanError, match=fix):
        dataclasses.replace(UNIFORM, slow=slow)


def test_offloaded_micro_batches_are_the_last_ones_and_go_to_fast_peers() -> None:
    table = route(2, 3, 4, [], {(1, 0): 2})
    assert [table[0][(1, i)] for i in range(4)] == [1, 1, 0, 2]
    assert all(table[1][(p, i)] == p for p in range(3) for i in range(4))
    with pytest.raises(ValueError, match="give 0..4"):
        route(2, 3, 4, [], {(1, 0): 5})


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_slow_worker_plan_offloads_and_beats_keeping_everything(factor: float) -> None:
    costs = UNIFORM.with_slow({(1, 2): factor})
    plan = make_plan(4, 4, 8, costs)
    validate_plan(plan)  # rule 2 checks each op against its worker's factor
    k = _offloaded(plan, (1, 2))
    assert 1 <= k < 8, k  # it keeps at least one micro-batch
    free = make_plan(4, 4, 8, UNIFORM)
    unaware = simulate(free.workers, costs).makespan  # the failure-free plan run with the slow worker in it
    assert plan.makespan < unaware
    assert simulate(plan.workers, costs).makespan == pytest.approx(plan.makespan)  # planner and simulator agree
    assert free.makespan < plan.makespan < 1.2 * free.makespan


def test_validator_names_the_factor_of_a_wrong_duration() -> None:
    plan = make_plan(2, 2, 2, CostModel.uniform(2).with_slow({(0, 1): 2.0}))
    honest = Plan.from_json(plan.to_json())
    validate_plan(honest)
    lying = Plan.from_json({**plan.to_json(), "costs": CostModel.uniform(2).to_json()})
    with pytest.raises(PlanValidationError, match="costs.F") as err:
        validate_plan(lying)
    assert err.value.rule == 2
    with pytest.raises(PlanValidationError, match="slow factor 3.0"):
        validate_plan(Plan.from_json({**plan.to_json(), "costs": CostModel.uniform(2).with_slow({(0, 1): 3.0})
                                      .to_json()}))


def test_two_slow_workers_in_different_stages_both_offload() -> None:
    """Each count starts at its own stage's optimum: from zero, each worker's choice would tie (the other slow
    worker dominates the plan) and both would keep everything."""
    costs = UNIFORM.with_slow({(1, 1): 2.0, (2, 2): 2.0})
    plan = make_plan(4, 4, 8, costs)
    validate_plan(plan)
    assert _offloaded(plan, (1, 1)) >= 1 and _offloaded(plan, (2, 2)) >= 1
    free = make_plan(4, 4, 8, UNIFORM)
    assert plan.makespan < 1.25 * free.makespan < simulate(free.workers, costs).makespan
