"""The planner's failure-free 1F1B is DeepSpeed's ``TrainSchedule``, op for op, whatever the stage costs.

The planner times vanilla DeepSpeed with its 1F1B plan (benchmarks compare against it), and the engine runs
that plan for ``schedule: "1f1b"``; both hold only if the plan's order of forwards and backwards on every
stage is the one DeepSpeed's schedule issues.
"""
from __future__ import annotations

import pytest
from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

from ds_recycle.plan import CostModel, make_plan

pytestmark = pytest.mark.timeout(60)


def _deepspeed_order(stages: int, microbatches: int, stage: int) -> str:
    sched = TrainSchedule(micro_batches=microbatches, stages=stages, stage_id=stage)
    kinds = {ForwardPass: "F", BackwardPass: "B"}
    return "".join(kinds[type(cmd)] for step in sched.steps() for cmd in step if type(cmd) in kinds)


def _costs(stages: int, uniform: bool) -> CostModel:
    if uniform:
        return CostModel.uniform(stages)
    # the 8-stage GPT-3 2.7B profile's shape: three heavy stages, four lighter ones, a light last one
    weight = [1.0 if s < 3 * stages // 8 else 0.8 if s < stages - 1 else 0.5 for s in range(stages)]
    return CostModel([2.0 * w for w in weight], [2.2 * w for w in weight], [1.8 * w for w in weight],
                     [0.0] * stages, 0.01)


@pytest.mark.parametrize("stages", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("uniform", [True, False])
def test_failure_free_1f1b_is_deepspeeds_train_schedule(stages: int, uniform: bool) -> None:
    for microbatches in (1, stages - 1 or 1, stages, 2 * stages + 1):
        plan = make_plan(stages, 2, microbatches, _costs(stages, uniform), schedule="1f1b", optimizer="synchronous")
        for (p, s), ops in plan.workers.items():
            mine = [op for op in ops if op.kind.value in "FB"]
            assert "".join(op.kind.value for op in mine) == _deepspeed_order(stages, microbatches, s), (p, s)
            for kind in "FB":  # each kind in micro-batch order, as DeepSpeed's buffers take them
                assert [op.mb[1] for op in mine if op.kind.value == kind and op.mb] == list(range(microbatches))
