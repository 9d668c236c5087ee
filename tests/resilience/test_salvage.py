"""Salvage of an interrupted iteration: the repair schedule and the members' common decision (pure)."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from ds_recycle.engine import instructions as ins
from ds_recycle.engine.schedule import PlanSchedule, Repair, WorkKind, repair_items, worker_items
from ds_recycle.plan import CostModel, make_plan
from ds_recycle.resilience.salvage import Report, decide, redo_point
from ds_recycle.runtime.grid import WorkerMap

ALL = [(d, i) for d in range(2) for i in range(4)]


def _plan(absent: list[tuple[int, int]], schedule: str = "zb-h1", stages: int = 2):
    return make_plan(stages, 2, 4, CostModel.uniform(stages), absent, schedule=schedule)


def test_repair_keeps_finished_weight_gradients_and_forwards_unfinished_work_again() -> None:
    plan = _plan([(1, 0)])
    repair = Repair(2, {0: frozenset({(0, 0), (0, 1)}), 1: frozenset({(0, 0), (0, 1), (0, 2)})})
    assert not repair.unfinished((0, 1)) and repair.unfinished((0, 2))
    assert repair.lowest_unfinished_stage((0, 2)) == 0 and repair.lowest_unfinished_stage((1, 3)) == 0
    stage1 = Counter((it.kind, it.mb) for it in repair_items(worker_items(plan, (0, 1), 0), 1, repair))
    # (0, 2): forwarded again and its B recomputed to bring the gradient down to stage 0, but no second W
    assert stage1[(WorkKind.F, (0, 2))] == stage1[(WorkKind.B, (0, 2))] == 1 and not stage1[(WorkKind.W, (0, 2))]
    assert not any(mb in {(0, 0), (0, 1)} for _, mb in stage1)
    stage0 = [(it.kind, it.mb) for it in repair_items(worker_items(plan, (0, 0), 0), 0, repair)]
    assert {mb for kind, mb in stage0 if kind is WorkKind.W} == set(ALL) - {(0, 0), (0, 1)}
    assert stage0[-1] == (WorkKind.O, None)


def _messages(plan, repair: Repair) -> tuple[Counter, Counter]:
    """Every send and every receive of the lowered repair schedules of all workers: (channel, src, dst, mb)."""
    workers = WorkerMap.dense(plan.stages, plan.pipelines, frozenset(plan.failed))
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for worker, rank in workers.ranks.items():
        sched = PlanSchedule(plan, worker, workers.rank_of, 0, repair=repair)
        for step in sched.steps():
            for cmd in step:
                mb = tuple(cmd.kwargs.get("micro_batch", ()))
                if isinstance(cmd, (ins.SendActivationTo, ins.SendGradTo)):
                    sends[(type(cmd) is ins.SendGradTo, rank, cmd.kwargs["peer"], mb)] += 1
                elif isinstance(cmd, (ins.RecvActivationFrom, ins.RecvGradFrom)):
                    recvs[(type(cmd) is ins.RecvGradFrom, cmd.kwargs["peer"], rank, mb)] += 1
    return sends, recvs


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b", "adaptive"])
@pytest.mark.parametrize("seed", range(6))
def test_repair_schedules_match_every_send_with_a_receive(schedule: str, seed: int) -> None:
    rng = random.Random(seed)
    plan = _plan([(1, 1)] if seed % 2 else [(0, 0)], schedule, stages=3)
    w_done = {s: frozenset(mb for mb in ALL if rng.random() < 0.5) for s in range(3)}
    sends, recvs = _messages(plan, Repair(3, w_done))
    assert sends == recvs and sends
    assert all(n == 1 for n in sends.values())


def _report(stage: int, served: list, w_done: list, latest: int = 5, in_flight: int = 5,
            stepping: bool = False) -> Report:
    return Report(latest - 1, latest, in_flight, stepping, stage, tuple(served), tuple(w_done))


def test_decision_salvages_when_every_member_is_mid_iteration() -> None:
    plan = _plan([(1, 0)])
    workers = WorkerMap.dense(2, 2, frozenset({(1, 0)}))  # ranks: (0,0) 0, (0,1) 1, (1,1) 2
    own0 = [(0, i) for i in range(4)]
    reports = {0: _report(0, own0, [(0, 0)]), 1: _report(1, own0, [(0, 0), (0, 1)]),
               2: _report(1, [(1, i) for i in range(4)], [(1, 0)])}
    decision = decide(reports, plan, workers)
    assert decision.repair is not None and decision.iteration == 5 and decision.why == ""
    assert decision.repair.w_done == {0: {(0, 0)}, 1: {(0, 0), (0, 1), (1, 0)}}
    assert decision.kept_weight_gradients == 4
    assert Report.from_json(reports[2].to_json()) == reports[2]


def test_decision_redoes_when_a_stage_has_reduced_or_work_moves() -> None:
    plan = _plan([(1, 0)])
    workers = WorkerMap.dense(2, 2, frozenset({(1, 0)}))
    own0, own1 = [(0, i) for i in range(4)], [(1, i) for i in range(4)]
    stepped = {0: _report(0, own0, own0), 1: _report(1, own0, own0, stepping=True), 2: _report(1, own1, [])}
    assert "optimizer step" in decide(stepped, plan, workers).why
    behind = {0: _report(0, own0, []), 1: _report(1, own0, [], in_flight=4), 2: _report(1, own1, [])}
    assert "not in iteration 5" in decide(behind, plan, workers).why
    moved = {0: _report(0, own0, []), 1: _report(1, own1, []), 2: _report(1, own1, [])}  # rank 1 held (1, *)
    assert "moves micro-batches" in decide(moved, plan, workers).why
    assert decide(moved, plan, workers).repair is None


def test_redo_point_drops_a_member_without_the_snapshot() -> None:
    # ranks 0, 2 hold iterations 5..7 and 6..8; rank 1 joined at 8; rank 3 joined but holds nothing yet
    redo, members = redo_point({0: (5, 7), 1: (8, 8), 2: (6, 8), 3: (-1, -1)})
    assert (redo, members) == (7, [0, 2])
    assert redo_point({0: (3, 5), 1: (4, 5)}) == (5, [0, 1])
    with pytest.raises(RuntimeError, match="no member holds"):
        redo_point({0: (-1, -1)})
