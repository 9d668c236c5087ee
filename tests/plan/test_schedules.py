"""Failure-free and adapted schedules: structure, exact times on hand-checkable cases, quality."""
from __future__ import annotations

import pytest

from ds_recycle.plan import CostModel, lower_bound, make_plan, simulate, validate_plan
from ds_recycle.plan.ops import OpKind
from ds_recycle.plan.schedules import failure_free_time, policies_for
from ds_recycle.plan.validate import check_channels

# (stages, microbatches): even, odd, fewer micro-batches than stages, many micro-batches
GRID = [(2, 2), (3, 5), (4, 8), (4, 3), (5, 12)]


@pytest.mark.parametrize("stages, microbatches", GRID)
@pytest.mark.parametrize("uniform", [True, False])
def test_1f1b_matches_deepspeed_shape(stages: int, microbatches: int, uniform: bool) -> None:
    # later stages cheaper, as in GPT profiles: taking whichever of B and F is ready first is not DeepSpeed's order
    costs = CostModel.uniform(stages) if uniform else CostModel(
        [1.0 - 0.5 * s / stages for s in range(stages)], [1.1 - 0.5 * s / stages for s in range(stages)],
        [0.9 - 0.4 * s / stages for s in range(stages)], [0.0] * stages, 0.05)
    plan = make_plan(stages, 1, microbatches, costs, schedule="1f1b", optimizer="synchronous")
    validate_plan(plan)
    if uniform:  # fused backward, no comm: the classic (M + S - 1) x (F + B + W)
        assert plan.makespan == pytest.approx((microbatches + stages - 1) * 3.0)
    for (_, s), ops in plan.workers.items():
        kinds = "".join(op.kind.value for op in ops)
        warmup = min(stages - s, microbatches)
        assert kinds.replace("BW", "") .count("W") == 0, kinds       # every W right after its B
        assert kinds.endswith("O")
        # DeepSpeed's order: S - s forwards, then B and F alternating, then the B's left
        steady = "BF" * (microbatches - warmup) + "B" * warmup
        assert kinds.replace("W", "").removesuffix("O") == "F" * warmup + steady, kinds


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


@pytest.mark.parametrize("schedule, optimizer", [("adaptive", "staggered"), ("1f1b", "synchronous")])
def test_failure_free_pipelines_are_copies_of_one(schedule: str, optimizer: str) -> None:
    costs = CostModel((1.2, 1.0, 1.4), (1.2, 1.0, 1.5), (0.6, 0.6, 0.8), (0.5,) * 3, 0.15)
    plan = make_plan(3, 3, 5, costs, iterations=2, schedule=schedule, optimizer=optimizer)
    one = make_plan(3, 1, 5, costs, iterations=2, schedule=schedule, optimizer=optimizer, variants=len(
        policies_for(schedule, 3, None)), search=0 if schedule != "adaptive" else None)
    validate_plan(plan)
    check_channels(plan)
    assert plan.makespan == pytest.approx(failure_free_time(3, 3, 5, costs, iterations=2, schedule=schedule,
                                                            optimizer=optimizer))
    for (p, s), ops in plan.workers.items():
        assert [(o.kind, o.iteration, o.start, o.end) for o in ops] == \
               [(o.kind, o.iteration, o.start, o.end) for o in plan.workers[(0, s)]]
        assert all(o.mb is None or o.mb[0] == p for o in ops)
    # the same simulated times as a real run of all the pipelines
    assert simulate(plan.workers, costs, optimizer=optimizer,
                    fused_backward=schedule == "1f1b").makespan == pytest.approx(plan.makespan)
    assert one.makespan >= plan.makespan - 1e-9  # sized for 3 pipelines it tries at least as much


def test_first_stage_failure_tries_the_fused_first_stage() -> None:
    # heavier end stages, a first-stage failure: the survivors of stage 0 are the bottleneck (bound 65.8);
    # the plain variants idle there while W pile up (71.4)
    costs = CostModel((1.3, 1, 1, 1, 1.5), (1.3, 1, 1, 1, 1.5), (1, 1, 1, 1, 1.2), (0.5,) * 5, 0.05)
    plan = make_plan(5, 3, 6, costs, [(0, 0)], iterations=2, search=0)
    validate_plan(plan)
    check_channels(plan)
    assert plan.makespan <= 66.4 + 1e-9
    first = [op for p in (1, 2) for op in plan.workers[(p, 0)] if op.kind is not OpKind.O]
    follows = {(a.iteration, a.mb) for a, b in zip(first, first[1:]) if a.kind is OpKind.B and b.kind is OpKind.W
               and (b.iteration, b.mb) == (a.iteration, a.mb)}
    assert len(follows) == len([op for op in first if op.kind is OpKind.B])  # every W right after its B


def test_local_search_never_worse_and_deterministic() -> None:
    costs = CostModel((1.2, 1.0, 1.0, 1.4), (1.2, 1.0, 1.0, 1.5), (0.6,) * 4, (0.5,) * 4, 0.15)
    failed = [(0, 0), (1, 3)]
    plain = make_plan(4, 3, 5, costs, failed, iterations=2, search=0)
    searched = make_plan(4, 3, 5, costs, failed, iterations=2, search=60)
    again = make_plan(4, 3, 5, costs, failed, iterations=2, search=60)
    validate_plan(searched)
    check_channels(searched)
    assert searched.makespan <= plain.makespan + 1e-12
    assert searched.to_json() == again.to_json()
