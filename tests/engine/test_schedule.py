"""Plans lowered to DeepSpeed steps: per-stage instruction rules, explicit peers, buffers, and early errors."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from ds_recycle.engine import instructions as ins
from ds_recycle.engine.schedule import PlanNotRunnableError, PlanSchedule, check_plan_for_job
from ds_recycle.plan import CostModel, make_plan
from ds_recycle.runtime.grid import WorkerMap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plans import HandOp, HandPlan, Kind, one_f_one_b  # noqa: E402

# (stages, pipelines, micro-batches, absent): failure-free, absent first/last/middle stage, two absent
CASES = [(2, 2, 4, ()), (3, 2, 5, ()), (2, 2, 4, ((1, 0),)), (2, 2, 4, ((0, 1),)), (3, 2, 3, ((1, 1),)),
         (3, 3, 4, ((0, 0), (2, 2)))]


def _schedules(plan, workers: WorkerMap) -> dict[tuple[int, int], list[list]]:
    return {w: list(PlanSchedule(plan, w, workers.rank_of, 0).steps()) for w in plan.workers}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "adaptive"])
@pytest.mark.parametrize("stages,pipelines,mbs,absent", CASES)
def test_lowering_rules(schedule: str, stages: int, pipelines: int, mbs: int, absent: tuple) -> None:
    plan = make_plan(stages, pipelines, mbs, CostModel.uniform(stages, comm=0.05), absent, schedule=schedule)
    workers = WorkerMap.dense(stages, pipelines, frozenset(absent))
    check_plan_for_job(plan, stages, pipelines, mbs, frozenset(absent))
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for (d, s), steps in _schedules(plan, workers).items():
        flat = [cmd for step in steps for cmd in step]
        kinds = Counter(type(c) for c in flat)
        n = sum(1 for op in plan.workers[(d, s)] if op.kind.value == "F")
        assert kinds[ins.ForwardMicroBatch] == kinds[ins.BackwardInput] == kinds[ins.BackwardWeight] == n
        assert kinds[ins.StaggeredOptimizerStep] == 1 and type(flat[0]) is ins.FinishOptimizerStep
        assert (kinds[ins.RecvActivationFrom], kinds[ins.SendGradTo]) == ((0, 0) if s == 0 else (n, n))
        assert (kinds[ins.SendActivationTo], kinds[ins.RecvGradFrom]) == ((0, 0) if s == stages - 1 else (n, n))
        assert kinds[ins.LoadMicroBatchOf] == (n if s in (0, stages - 1) else 0)
        sched = PlanSchedule(plan, (d, s), workers.rank_of, 0)
        assert all(0 <= c.buffer_id < sched.num_pipe_buffers() for c in flat if "buffer_id" in c.kwargs)
        me = workers.rank_of((d, s))
        for c in flat:
            if isinstance(c, (ins.SendActivationTo, ins.SendGradTo)):
                sends[(type(c) is ins.SendGradTo, me, c.peer, c.micro_batch)] += 1
            elif isinstance(c, (ins.RecvActivationFrom, ins.RecvGradFrom)):
                recvs[(type(c) is ins.RecvGradFrom, c.peer, me, c.micro_batch)] += 1
    assert sends == recvs and max(sends.values()) == 1  # every send has exactly one matching receive


def test_rerouted_peers_cross_pipelines() -> None:
    """Absent (1, 0): stage 0 of pipeline 0 feeds pipeline 1's stage 1 and gets its gradients back."""
    plan = make_plan(2, 2, 2, CostModel.uniform(2), [(1, 0)], schedule="zb-h1")
    workers = WorkerMap.dense(2, 2, frozenset({(1, 0)}))
    assert workers.ranks == {(0, 0): 0, (0, 1): 1, (1, 1): 2}
    flat = [c for step in PlanSchedule(plan, (0, 0), workers.rank_of, 0).steps() for c in step]
    peers = {(type(c).__name__, c.micro_batch, c.peer) for c in flat if hasattr(c, "peer")}
    assert ("SendActivationTo", (1, 0), 2) in peers and ("RecvGradFrom", (1, 1), 2) in peers
    assert ("SendActivationTo", (0, 0), 1) in peers
    loads = [c.micro_batch for c in flat if type(c) is ins.LoadMicroBatchOf]
    assert sorted(loads) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # the peer loads the absent worker's data


def test_deferred_w_buffers_count_peak() -> None:
    plan = one_f_one_b(2, 1, 4, defer_w=True)
    workers = WorkerMap.dense(2, 1)
    assert PlanSchedule(plan, (0, 1), workers.rank_of, 0).num_pipe_buffers() == 4
    assert PlanSchedule(plan, (0, 0), workers.rank_of, 0).num_pipe_buffers() == 4
    assert PlanSchedule(one_f_one_b(2, 1, 4), (0, 0), workers.rank_of, 0).num_pipe_buffers() == 2


def test_plan_for_another_job_is_rejected() -> None:
    plan = make_plan(2, 2, 4, CostModel.uniform(2), [(1, 0)])
    with pytest.raises(PlanNotRunnableError, match="micro-batches = \\(2, 2, 4\\), the job is \\(2, 2, 8\\)"):
        check_plan_for_job(plan, 2, 2, 8, frozenset({(1, 0)}))
    with pytest.raises(PlanNotRunnableError, match="assumes failed workers \\[\\(1, 0\\)\\].*absent workers \\[\\]"):
        check_plan_for_job(plan, 2, 2, 4, frozenset())


@pytest.mark.parametrize("ops,message", [
    ([("B", (0, 0)), ("F", (0, 0)), ("W", (0, 0)), ("O", None)], "F, then B, then W"),
    ([("F", (0, 0)), ("B", (0, 0)), ("O", None), ("W", (0, 0))], "must be the last op"),
    ([("F", (0, 0)), ("B", (0, 0)), ("O", None)], "lack B or W"),
    ([("F", (0, 5)), ("B", (0, 5)), ("W", (0, 5)), ("O", None)], "outside 1 pipelines x 1 micro-batches"),
])
def test_broken_op_orders_are_rejected(ops: list, message: str) -> None:
    plan = HandPlan(1, 1, 1, frozenset(), {(0, 0): tuple(HandOp(Kind(k), 0, mb) for k, mb in ops)},
                    {(0, (0, 0)): (0, 0)})
    with pytest.raises(PlanNotRunnableError, match=message):
        check_plan_for_job(plan, 1, 1, 1, frozenset())


def test_worker_map_with_holes() -> None:
    workers = WorkerMap.dense(3, 2, frozenset({(1, 1)}))
    assert workers.world_size == 5 and workers.stage_ranks(1) == [2] and workers.absent() == {(1, 1)}
    with pytest.raises(KeyError, match="absent"):
        workers.rank_of((1, 1))
    with pytest.raises(ValueError, match="every worker of stage 0"):
        WorkerMap.dense(2, 2, frozenset({(0, 0), (1, 0)}))
