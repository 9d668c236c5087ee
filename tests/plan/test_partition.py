"""Re-partitioning: the balanced partition, the whole-layer bound, the move's cost, the choice, rule 8."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from ds_recycle.plan import Plan, PlanError, PlanValidationError, make_plan, validate_document, validate_plan
from ds_recycle.plan.partition import (
    LayerCosts,
    allowed,
    balanced_partition,
    check_partition,
    choose_partition,
    even_partition,
    granularity_bound,
    layer_moves,
    move_seconds,
    partitioned_plan,
)


def _heaviest(costs: LayerCosts, parts: tuple[int, ...], live: list[int]) -> float:
    return max(sum(costs.work(i) for i in range(parts[s], parts[s + 1])) / live[s] for s in range(len(live)))


def test_balanced_partition_is_the_exact_minimum() -> None:
    """Brute force over every cut of 9 uneven layers into 3 stages, with fewer replicas on one stage."""
    costs = LayerCosts([1, 3, 2, 2, 5, 1, 1, 4, 2], [1] * 9, [0.5] * 9, [0] * 9, [1] * 9)
    live = [4, 3, 4]
    best = balanced_partition(costs, 3, live)
    brute = min(_heaviest(costs, (0, a, b, 9), live) for a, b in itertools.combinations(range(1, 9), 2))
    assert _heaviest(costs, best, live) == pytest.approx(brute)
    assert check_partition(best, 9, 3) == best


@pytest.mark.parametrize("pinned", [{0: 0, 8: 2}, {3: 0}, {4: 1, 5: 1}, {2: 0, 6: 2}, {1: 0, 2: 1, 3: 2}])
def test_pinned_layers_stay_and_the_rest_is_still_the_exact_minimum(pinned: dict[int, int]) -> None:
    """Brute force again, over the cuts that keep every pinned layer (a tied module) on its stage."""
    costs = LayerCosts([1, 3, 2, 2, 5, 1, 1, 4, 2], [1] * 9, [0.5] * 9, [0] * 9, [1] * 9)
    live = [4, 3, 4]
    best = balanced_partition(costs, 3, live, pinned)
    assert allowed(best, pinned)
    cuts = [(0, a, b, 9) for a, b in itertools.combinations(range(1, 9), 2) if allowed((0, a, b, 9), pinned)]
    assert _heaviest(costs, best, live) == pytest.approx(min(_heaviest(costs, c, live) for c in cuts))
    choice = choose_partition(costs, 3, 4, 6, [(0, 1)], (0, 3, 6, 9) if allowed((0, 3, 6, 9), pinned) else cuts[0],
                              pinned=pinned)
    assert allowed(choice.partition, pinned)


def test_pinned_layers_that_cannot_stay_are_an_error() -> None:
    costs = LayerCosts.uniform(6)
    with pytest.raises(PlanError, match="pinned layers"):
        balanced_partition(costs, 3, [2, 2, 2], {1: 2})  # layer 1 on stage 2 leaves stages 1 and 2 too little
    with pytest.raises(PlanError, match="moves a pinned layer"):
        choose_partition(costs, 3, 2, 4, [], (0, 2, 4, 6), pinned={2: 0})


def test_stage_with_fewer_replicas_keeps_fewer_layers() -> None:
    costs = LayerCosts.uniform(64)
    parts = balanced_partition(costs, 4, [4, 3, 4, 4])
    sizes = [parts[s + 1] - parts[s] for s in range(4)]
    assert sizes[1] < 16 and all(n > 16 for i, n in enumerate(sizes) if i != 1)
    assert balanced_partition(costs, 4, [4] * 4) == even_partition(64, 4) == (0, 16, 32, 48, 64)


def test_granularity_bound() -> None:
    """4 x 4, 16 layers a stage, one worker gone: 13 layers on its stage (each survivor 13 x 4/3 = 17.33),
    17 on the others: 16 / 17.33 = 0.923, below (S D - 1) / (S D) = 0.9375."""
    costs = LayerCosts.uniform(64)
    bound = granularity_bound(costs, 4, 4, [(0, 1)])
    assert bound == pytest.approx(16 / (13 * 4 / 3))
    assert bound < 15 / 16
    assert granularity_bound(LayerCosts.uniform(64 * 12), 4, 4, [(0, 1)]) == pytest.approx(15 / 16, abs=0.01)


def test_moves_and_their_time() -> None:
    costs = LayerCosts.uniform(8, state_bytes=100.0, bandwidth=50.0)
    before, after = (0, 4, 8), (0, 5, 8)
    assert [(m.layer, m.source, m.target) for m in layer_moves(before, after)] == [(4, 1, 0)]
    assert move_seconds(costs, before, after) == pytest.approx(2.0)
    assert move_seconds(costs, before, before) == 0.0
    # stages receive at once: the slowest receiver decides
    assert move_seconds(costs, (0, 2, 4, 6, 8), (0, 3, 4, 5, 8)) == pytest.approx(2.0)


def test_choose_partition_moves_when_it_pays_and_is_planned() -> None:
    costs = LayerCosts.uniform(64, f=1 / 16, b=1 / 16, w=1 / 16, state_bytes=1.0, bandwidth=100.0)
    base = even_partition(64, 4)
    choice = choose_partition(costs, 4, 4, 8, [(0, 1)], base, horizon=20, climb=0)
    assert choice.pays and choice.partition != base
    assert choice.moved_iteration_s < choice.current_iteration_s
    stay = make_plan(4, 4, 8, costs.stage_costs(base), [(0, 1)]).time_per_iteration
    moved = make_plan(4, 4, 8, costs.stage_costs(choice.partition), [(0, 1)]).time_per_iteration
    assert (choice.current_iteration_s, choice.moved_iteration_s) == (stay, moved)
    ff = make_plan(4, 4, 8, costs.stage_costs(base)).time_per_iteration
    assert ff / moved >= 0.88 > ff / stay  # the 4 x 4, M = 8 target, planned
    assert "move" in choice.describe()
    # a move whose transfer outweighs what it saves over the horizon does not pay
    slow_link = dataclasses.replace(costs, bandwidth=1e-6)
    assert not choose_partition(slow_link, 4, 4, 8, [(0, 1)], base, horizon=20, climb=0).pays
    # failure-free on the job's own partition: nothing to gain
    assert not choose_partition(costs, 4, 4, 8, [], base).pays
    # back from a re-partition once the worker rejoined
    back = choose_partition(costs, 4, 4, 8, [], choice.partition)
    assert back.pays and back.partition == base


def test_partition_errors_name_the_fix() -> None:
    with pytest.raises(PlanError, match="S \\+ 1 = 3"):
        check_partition((0, 4), 8, 2)
    with pytest.raises(PlanError, match="stage 1 holds no layer"):
        check_partition((0, 4, 4, 8), 8, 3)
    with pytest.raises(PlanError, match="has 8 layers"):
        check_partition((0, 4, 7), 8, 2)
    with pytest.raises(PlanError, match="W has 2 layers"):
        LayerCosts([1, 1, 1], [1, 1, 1], [1, 1], [0, 0, 0], [0, 0, 0])
    with pytest.raises(PlanError, match="bandwidth"):
        LayerCosts.uniform(4, bandwidth=0.0)
    with pytest.raises(PlanError, match="horizon"):
        choose_partition(LayerCosts.uniform(4), 2, 2, 2, [], (0, 2, 4), horizon=-1)


def test_plan_carries_its_partition_and_rule_8_checks_it() -> None:
    costs = LayerCosts.uniform(12, f=1.0, b=1.0, w=0.5, o=0.1)
    plan = partitioned_plan(costs, (0, 5, 9, 12), 3, 2, 4, [(0, 1)])
    validate_plan(plan, costs)
    doc = plan.to_json()
    assert doc["partition"] == [0, 5, 9, 12]
    again = validate_document(doc, costs)
    assert again.partition == (0, 5, 9, 12) and again.relabel([1, 0]).partition == (0, 5, 9, 12)
    assert "partition" not in make_plan(3, 2, 4, costs.stage_costs((0, 4, 8, 12))).to_json()
    wrong = dataclasses.replace(plan, partition=(0, 4, 9, 12))
    with pytest.raises(PlanValidationError, match="rule 8: costs.F\\[0\\]"):
        validate_plan(wrong, costs)
    with pytest.raises(PlanValidationError, match="rule 8: .*has 12 layers"):
        validate_plan(dataclasses.replace(plan, partition=(0, 5, 9, 11)), costs)
    with pytest.raises(PlanError, match="plan partition"):
        Plan.from_json({**doc, "partition": [0, 5, 5, 12]})
    validate_plan(wrong)  # without the layers, rule 8 is not checked
    assert math.isfinite(plan.time_per_iteration)


def test_a_slow_worker_counts_as_part_of_one_and_its_stage_keeps_fewer_layers() -> None:
    """4 x 4, 16 layers a stage, worker (1, 1) twice as slow: stage 1 has 3.5 workers' capacity; the chosen
    partition gives it fewer layers, and the plan (with the worker slow) beats staying."""
    costs = LayerCosts.uniform(64, f=1 / 16, b=1 / 16, w=1 / 16, state_bytes=1.0, bandwidth=100.0)
    base = even_partition(64, 4)
    parts = balanced_partition(costs, 4, [4.0, 3.5, 4.0, 4.0])
    assert parts[2] - parts[1] < 16 and parts != base
    choice = choose_partition(costs, 4, 4, 8, [], base, horizon=20, slow={(1, 1): 2.0})
    assert choice.pays and choice.partition[2] - choice.partition[1] < 16
    slow_costs = costs.stage_costs(base).with_slow({(1, 1): 2.0})
    assert choice.current_iteration_s == make_plan(4, 4, 8, slow_costs).time_per_iteration
    assert choice.moved_iteration_s < choice.current_iteration_s
    first = choose_partition(costs, 4, 4, 8, [], base, horizon=20, slow={(1, 1): 2.0}, climb=0)
    assert choice.moved_iteration_s < first.moved_iteration_s and choice.candidates > first.candidates
    assert granularity_bound(costs, 4, 4, [], slow={(1, 1): 2.0}) > granularity_bound(costs, 4, 4, [(1, 1)])
