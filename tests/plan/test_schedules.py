"""Failure-free and adapted schedules: structure, exact times on hand-checkable cases, quality."""
from __future__ import annotations

import pytest

from ds_recycle.plan import CostModel, lower_bound, make_plan, simulate, validate_plan
from ds_recycle.plan.ops import OpKind
from ds_recycle.plan.validate import check_channels

# (stages, microbatches): even, odd, fewer micro-batches than stages, many micro-batches
GRID = [(2, 2), (3, 5), (4, 8), (4, 3), (5, 12)]


@pytest.mark.parametrize("stages, microbatches", GRID)
def test_1f1b_matches_deepspeed_shape(stages: int, microbatches: int) -> None:
    costs = CostModel.uniform(stages)
    plan = make_plan(stages, 1, microbatches, costs, schedule="1f1b", optimizer="synchronous")
    validate_plan(plan)
    # fused backward, no comm: the classic (M + S - 1) x (F + B + W)
    assert plan.makespan == pytest.approx((microbatches + stages - 1) * 3.0)
    for (_, s), ops in plan.workers.items():
        kinds = "".join(op.kind.value for op in ops)
        warmup = min(stages - s, microbatches)
        assert kinds.startswith("F" * warmup + "B"), kinds          # S - s forwards before the first B
        assert kinds.replace("BW", "") .count("W") == 0, kinds       # every W right after its B
        assert kinds.endswith("O")


@pytest.mark.parametrize("stages, microbatches", [(4, 8), (4, 12), (8, 16)])
def test_zero_bubble_bubble_is_a_third_of_1f1b(stages: int, microbatches: int) -> None:
    costs = CostModel.uniform(stages)
    one = make_plan(stages, 1, microbatches, costs, schedule="1f1b", optimizer="synchronous")
    zb = make_plan(stages, 1, microbatches, costs, schedule="zb-h1", optimizer="synchronous")
    validate_plan(zb)
    assert zb.memory_limit == stages
    busy = 3.0 * microbatches
    ratio = (zb.makespan - busy) / (one.makespan - busy)
    assert ratio <= 0.4, ratio


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "adaptive"])
@pytest.mark.parametrize("optimizer", ["staggered", "synchronous"])
def test_schedules_valid_and_simulate_to_same_times(schedule: str, optimizer: str) -> None:
    costs = CostModel((1.0, 1.2, 0.9), (1.1, 1.3, 1.0), (0.6, 0.7, 0.5), (0.3, 0.4, 0.2), 0.05)
    plan = make_plan(3, 3, 5, costs, [(2, 1)], iterations=2, schedule=schedule, optimizer=optimizer)
    validate_plan(plan)
    check_channels(plan)
    sim = simulate(plan.workers, costs, optimizer=optimizer, fused_backward=schedule == "1f1b")
    assert sim.workers == dict(plan.workers)
    assert plan.makespan >= lower_bound(3, 3, 5, costs, [(2, 1)], 2) - 1e-9


def test_adapted_plan_meets_bound_with_one_failure() -> None:
    """D=2, one failure: the peer's doubled work dominates, and the plan reaches the bound."""
    costs = CostModel.uniform(4, o=0.5, comm=0.05)
    plan = make_plan(4, 2, 8, costs, [(1, 2)], iterations=2)
    assert plan.makespan == pytest.approx(lower_bound(4, 2, 8, costs, [(1, 2)], 2))


def test_memory_limit_respected_and_costs_time() -> None:
    costs = CostModel.uniform(4, comm=0.05)
    free = make_plan(4, 2, 8, costs, [(0, 1)])
    tight = make_plan(4, 2, 8, costs, [(0, 1)], memory_limit=3)
    validate_plan(tight)
    assert max(simulate(tight.workers, costs).peak_memory.values()) <= 3
    assert max(simulate(free.workers, costs).peak_memory.values()) > 3
    assert tight.makespan >= free.makespan


def test_staggered_optimizer_staggers() -> None:
    costs = CostModel.uniform(4, o=0.5, comm=0.05)
    plan = make_plan(4, 2, 8, costs, [(1, 2)], iterations=2)
    o_starts = {s: {op.start for (p, st), ops in plan.workers.items() if st == s
                    for op in ops if op.kind is OpKind.O and op.iteration == 0} for s in range(4)}
    assert all(len(v) == 1 for v in o_starts.values())          # one all-reduce per stage
    assert len({next(iter(v)) for v in o_starts.values()}) > 1   # at different times per stage
    sync = make_plan(4, 2, 8, costs, [(1, 2)], iterations=2, optimizer="synchronous")
    assert sync.makespan >= plan.makespan
