"""Property tests over random topologies and failure sets (seeded, so every run checks the same cases)."""
from __future__ import annotations

import random

import pytest

from ds_recycle.plan import CostModel, lower_bound, make_plan, simulate, validate_plan
from ds_recycle.plan.bounds import best_lower_bound, routed_lower_bound
from ds_recycle.plan.validate import check_channels


def _random_case(seed: int) -> tuple:
    rng = random.Random(seed)
    stages, pipelines, microbatches = rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 7)
    costs = CostModel(tuple(rng.uniform(0.5, 2) for _ in range(stages)),
                      tuple(rng.uniform(0.5, 2) for _ in range(stages)),
                      tuple(rng.uniform(0.1, 1.5) for _ in range(stages)),
                      tuple(rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(stages)),
                      rng.choice([0.0, rng.uniform(0, 0.3)]))
    failed = set()
    for _ in range(rng.randint(0, stages * pipelines)):
        p, s = rng.randrange(pipelines), rng.randrange(stages)
        if sum(1 for q in range(pipelines) if (q, s) in failed or q == p) < pipelines:
            failed.add((p, s))
    kwargs = {"iterations": rng.randint(1, 3), "optimizer": rng.choice(["staggered", "synchronous"]),
              "schedule": rng.choice(["1f1b", "zb-h1", "adaptive", "adaptive"]),
              "memory_limit": rng.choice([None, rng.randint(1, 6)])}
    return stages, pipelines, microbatches, costs, sorted(failed), kwargs


@pytest.mark.parametrize("seed", range(60))
def test_random_plans_are_valid_and_above_the_bound(seed: int) -> None:
    stages, pipelines, microbatches, costs, failed, kwargs = _random_case(seed)
    plan = make_plan(stages, pipelines, microbatches, costs, failed, **kwargs)
    validate_plan(plan)
    check_channels(plan)
    bound = lower_bound(stages, pipelines, microbatches, costs, failed, kwargs["iterations"])
    routed = routed_lower_bound(stages, pipelines, microbatches, costs, failed, kwargs["iterations"])
    assert plan.makespan >= routed * (1 - 1e-12) and routed >= bound * (1 - 1e-12)
    tight = best_lower_bound(stages, pipelines, microbatches, costs, failed, kwargs["iterations"],
                             optimizer=kwargs["optimizer"], memory_limit=plan.memory_limit)
    assert plan.makespan >= tight * (1 - 1e-12) and tight >= routed * (1 - 1e-12)
    sim = simulate(plan.workers, costs, optimizer=plan.optimizer, fused_backward=plan.schedule == "1f1b")
    assert sim.makespan == pytest.approx(plan.makespan)
    if plan.memory_limit is not None:
        assert max(sim.peak_memory.values()) <= plan.memory_limit
    owners = {mb for ops in plan.workers.values() for op in ops if op.mb is not None for mb in [op.mb]}
    assert len(owners) == pipelines * microbatches  # every micro-batch of every pipeline is processed


@pytest.mark.parametrize("seed", range(20))
def test_rerouted_load_is_balanced(seed: int) -> None:
    stages, pipelines, microbatches, costs, failed, _ = _random_case(seed)
    plan = make_plan(stages, pipelines, microbatches, costs, failed, variants=1)
    for s in range(stages):
        live = [p for p in range(pipelines) if (p, s) not in plan.failed]
        loads = [sum(1 for op in plan.workers[(p, s)] if op.kind.value == "F") for p in live]
        assert sum(loads) == pipelines * microbatches
        assert max(loads) - min(loads) <= 1
        for p in live:  # a live worker keeps all of its own micro-batches
            assert all(plan.worker_of(s, (p, i)) == (p, s) for i in range(microbatches))
