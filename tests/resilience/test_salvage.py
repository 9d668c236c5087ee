"""Salvage of an interrupted iteration: the repair schedule and the members' common decision (pure)."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from ds_recycle.engine import instructions as ins
from ds_recycle.engine.nccl_check import check_order, check_waits, in_match_order, p2p_program, timeline
from ds_recycle.engine.position import Position
from ds_recycle.engine.schedule import PlanSchedule, Repair, WorkKind, repair_items, worker_items
from ds_recycle.plan import CostModel, make_plan
from ds_recycle.resilience.salvage import decide
from ds_recycle.runtime.grid import WorkerMap
from tests.engine.test_issue import check_job

ALL = [(d, i) for d in range(2) for i in range(4)]


def _plan(absent: list[tuple[int, int]], schedule: str = "zb-h1", stages: int = 2):
    return make_plan(stages, 2, 4, CostModel.uniform(stages), absent, schedule=schedule)


def test_repair_keeps_finished_weight_gradients_and_runs_unfinished_work_over_its_span() -> None:
    plan = _plan([(1, 0)])
    w_done = {0: frozenset({(0, 0), (0, 1)}), 1: frozenset({(0, 0), (0, 1), (0, 2)})}
    repair = Repair(2, w_done)
    # no stage has stepped: one segment spans every stage; (0, 2) is missing only on stage 0
    assert repair.span((0, 1), 0) is None and repair.span((0, 2), 1) == (0, 0) and repair.span((1, 3), 1) == (0, 1)
    assert not repair.runs((0, 2), 1) and repair.runs((0, 2), 0) and repair.lowest_unfinished_stage((1, 3), 1) == 0
    stage1 = Counter((it.kind, it.mb) for it in repair_items(worker_items(plan, (0, 1), 0), 1, repair))
    assert not any(mb in {(0, 0), (0, 1), (0, 2)} for _, mb in stage1)  # stage 1 finished them
    assert ((True, 0, (0, 2)) in repair.needed_from_logs(ALL)  # its gradient into stage 0 comes from a log
            and (True, 0, (1, 3)) not in repair.needed_from_logs(ALL))
    stage0 = [(it.kind, it.mb) for it in repair_items(worker_items(plan, (0, 0), 0), 0, repair)]
    assert {mb for kind, mb in stage0 if kind is WorkKind.W} == set(ALL) - {(0, 0), (0, 1)}
    assert stage0[-1] == (WorkKind.O, None)
    # with no live log holding that gradient, (0, 2) runs over the whole segment: forwarded again on stage 1 and
    # its B recomputed to bring the gradient down to stage 0, but no second W
    whole = Repair(2, w_done, whole=frozenset({(0, 2)}))
    stage1 = Counter((it.kind, it.mb) for it in repair_items(worker_items(plan, (0, 1), 0), 1, whole))
    assert stage1[(WorkKind.F, (0, 2))] == stage1[(WorkKind.B, (0, 2))] == 1 and not stage1[(WorkKind.W, (0, 2))]
    assert (True, 0, (0, 2)) not in whole.needed_from_logs(ALL)


def _messages(plan, repair: Repair) -> tuple[Counter, Counter]:
    """Every send and every receive of the lowered repair schedules of all workers: (channel, src, dst, mb). Each
    pair's messages must also be received in the order they are sent (they match in posting order), and issued in
    match order, as the engine issues them, the repair has no wait cycle under NCCL's matching."""
    workers = WorkerMap.dense(plan.stages, plan.pipelines, frozenset(plan.failed))
    check_order(p2p_program(plan, 0, workers.rank_of, repair=repair))
    ordered = in_match_order(timeline(plan, 0, workers.rank_of, repair=repair))
    check_order(ordered)
    check_waits(ordered)
    check_job(plan, workers.rank_of, "repair", repair=repair)
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for worker, rank in workers.ranks.items():
        sched = PlanSchedule(plan, worker, workers.rank_of, 0, repair=repair)
        for step in sched.steps():
            for cmd in step:
                mb = tuple(cmd.kwargs.get("micro_batch", ()))
                if isinstance(cmd, (ins.SendActivationTo, ins.SendGradTo)):
                    sends[(type(cmd) is ins.SendGradTo, rank, cmd.kwargs["peer"], mb)] += 1
                elif isinstance(cmd, ins.SendLoggedTo):
                    sends[(cmd.kwargs["grad"], rank, cmd.kwargs["peer"], mb)] += 1
                elif isinstance(cmd, (ins.RecvActivationFrom, ins.RecvGradFrom)):
                    recvs[(type(cmd) is ins.RecvGradFrom, cmd.kwargs["peer"], rank, mb)] += 1
    return sends, recvs


def _sources(plan, workers: WorkerMap, repair: Repair, rng: random.Random) -> dict:
    """A holder for every tensor ``repair`` needs from a log: its sender, or its receiver itself, at random."""
    sources = {}
    for grad, stage, mb in repair.needed_from_logs(ALL):
        sender = plan.worker_of(stage + 1 if grad else stage - 1, mb)
        sources[(grad, stage, mb)] = workers.rank_of(sender if rng.random() < 0.5 else plan.worker_of(stage, mb))
    return sources


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b", "adaptive"])
@pytest.mark.parametrize("seed", range(6))
def test_repair_schedules_match_every_send_with_a_receive(schedule: str, seed: int) -> None:
    rng = random.Random(seed)
    plan = _plan([(1, 1)] if seed % 2 else [(0, 0)], schedule, stages=3)
    workers = WorkerMap.dense(3, 2, frozenset(plan.failed))
    w_done = {s: frozenset(mb for mb in ALL if rng.random() < 0.5) for s in range(3)}
    whole = frozenset(mb for mb in ALL if rng.random() < 0.3)
    base = Repair(3, w_done, whole=whole)
    sends, recvs = _messages(plan, Repair(3, w_done, sources=_sources(plan, workers, base, rng), whole=whole))
    local = {(g, src, dst, mb) for (g, src, dst, mb) in recvs if src == dst}
    assert sends == recvs - Counter(local) and sends
    assert all(n == 1 for n in recvs.values())
    everywhere = Repair(3, w_done, whole=frozenset(ALL))  # every span its whole segment: nothing from logs
    assert not everywhere.needed_from_logs(ALL)
    sends, recvs = _messages(plan, everywhere)
    assert sends == recvs and all(n == 1 for n in sends.values())


def _report(stage: int, served: list, w_done: list, stepped: int = 4, in_flight: int = 5,
            logs: tuple = (), awaiting: bool = False) -> Position:
    return Position(stage, stepped, in_flight, tuple(served), tuple(w_done), logs, awaiting)


def test_decision_keeps_finished_work_when_every_member_is_mid_iteration() -> None:
    plan = _plan([(1, 0)])
    workers = WorkerMap.dense(2, 2, frozenset({(1, 0)}))  # ranks: (0,0) 0, (0,1) 1, (1,1) 2
    own0 = [(0, i) for i in range(4)]
    reports = {0: _report(0, own0, [(0, 0)]), 1: _report(1, own0, [(0, 0), (0, 1)]),
               2: _report(1, [(1, i) for i in range(4)], [(1, 0)])}
    decision = decide(reports, plan, workers)
    assert decision.iteration == 5 and not decision.unrecoverable and not decision.committed
    assert decision.repair.w_done == {0: {(0, 0)}, 1: {(0, 0), (0, 1), (1, 0)}}
    assert decision.kept_weight_gradients == 4 and not decision.roll_forward and not decision.dropped
    assert Position.from_json(reports[2].to_json()) == reports[2]


def test_decision_drops_a_stage_whose_work_moves_and_a_member_at_the_boundary_keeps_nothing() -> None:
    plan = _plan([(1, 0)])
    workers = WorkerMap.dense(2, 2, frozenset({(1, 0)}))
    own0, own1 = [(0, i) for i in range(4)], [(1, i) for i in range(4)]
    moved = {0: _report(0, own0, [(0, 0)]), 1: _report(1, own1, [(1, 0)]), 2: _report(1, own1, [])}
    decision = decide(moved, plan, workers)  # rank 1 held (1, *), which the new plan gives rank 2
    assert decision.dropped == {1} and decision.repair.w_done == {0: {(0, 0)}}
    behind = {0: _report(0, own0, [(0, 1)], in_flight=4), 1: _report(1, own0, []), 2: _report(1, own1, [])}
    assert decide(behind, plan, workers).repair.w_done.get(0, frozenset()) == frozenset()
    off = decide({0: _report(0, own0, [(0, 0)]), 1: _report(1, own0, []), 2: _report(1, own1, [])}, plan, workers,
                 salvage=False)
    assert off.dropped == {0, 1}


def _log(k: int, grad: bool, received: bool, mbs: list) -> tuple:
    return tuple((k, grad, received, mb) for mb in mbs)


def test_a_committed_stage_serves_its_logs_instead_of_being_rolled_back() -> None:
    """Stage 1 had stepped iteration 5 when worker (1, 0) of stage 0 died: stage 0 redoes its part of 5 with the
    output gradients stage 1 logged; nothing of stage 1 runs again."""
    plan = _plan([(1, 0)])
    workers = WorkerMap.dense(2, 2, frozenset({(1, 0)}))  # ranks: (0,0) 0, (0,1) 1, (1,1) 2
    own0, own1 = [(0, i) for i in range(4)], [(1, i) for i in range(4)]
    reports = {0: _report(0, own0, own0[:2], logs=_log(5, True, True, own0)),
               1: _report(1, own0, own0, stepped=5, in_flight=6, logs=_log(5, True, False, own0)),
               2: _report(1, own1, own1, stepped=5, in_flight=6, logs=_log(5, True, False, own1))}
    decision = decide(reports, plan, workers)
    assert decision.iteration == 5 and decision.committed == {1} and not decision.unrecoverable
    assert decision.repair.w_done == {0: set(own0[:2])}
    # what stage 0 still needs: the gradients of the micro-batches it has not finished, from their holders
    assert set(decision.repair.sources) == {(True, 0, mb) for mb in own0[2:] + own1}
    assert all(decision.repair.sources[(True, 0, mb)] == 0 for mb in own0[2:])  # rank 0 received them itself
    assert all(decision.repair.sources[(True, 0, mb)] == 2 for mb in own1)  # sent by rank 2, receiver died
    stage1 = PlanSchedule(plan, (0, 1), workers.rank_of, 5, repair=decision.repair)
    kinds = [type(cmd) for step in stage1.steps() for cmd in step]
    assert ins.StaggeredOptimizerStep not in kinds and ins.ForwardMicroBatch not in kinds


def test_a_replica_caught_between_reduction_and_step_is_rolled_forward_and_lost_tensors_are_named() -> None:
    plan = _plan([(1, 0)])
    workers = WorkerMap.dense(2, 2, frozenset({(1, 0)}))
    own0, own1 = [(0, i) for i in range(4)], [(1, i) for i in range(4)]
    reports = {0: _report(0, own0, own0, logs=_log(5, True, True, own0)),
               1: _report(1, own0, own0, stepped=5, in_flight=6, logs=_log(5, True, False, own0)),
               2: _report(1, own1, own1, logs=_log(5, True, False, own1))}
    decision = decide(reports, plan, workers)
    assert decision.roll_forward == {1: 1} and decision.committed == {1}
    lost = dict(reports)
    lost[2] = _report(1, own1, own1)  # its log is gone: the gradients for the dead worker's micro-batches too
    assert "held by no live worker" in decide(lost, plan, workers).unrecoverable
    assert "tied" in decide(reports, plan, workers, tied_stages=[frozenset({0, 1})]).unrecoverable
    waiting = dict(reports)
    waiting[2] = _report(1, own1, own1, logs=_log(5, True, False, own1), awaiting=True)
    finishing = decide(waiting, plan, workers)  # it had the reduced gradients: it steps, no state moves
    assert not finishing.roll_forward and finishing.repair.completing == {2}
    both = {0: reports[0], 1: _report(1, own0, own0, logs=_log(5, True, False, own0), awaiting=True),
            2: waiting[2]}
    assert decide(both, plan, workers).committed == {1} and decide(both, plan, workers).repair.completing == {1, 2}
    one = {0: reports[0], 1: both[1], 2: reports[2]}  # one replica caught earlier: the stage reduces again
    assert not decide(one, plan, workers).committed
    with pytest.raises(RuntimeError, match="inconsistent"):
        decide({0: _report(0, own0, [], stepped=3), 1: _report(1, own0, [], stepped=5)}, plan, workers)


@pytest.mark.parametrize("seed", range(8))
def test_repairs_with_committed_stages_match_every_send_with_a_receive(seed: int) -> None:
    rng = random.Random(seed)
    plan = _plan([(1, 1)] if seed % 2 else [(0, 0)], "adaptive", stages=4)
    workers = WorkerMap.dense(4, 2, frozenset(plan.failed))
    committed = frozenset(s for s in range(4) if rng.random() < 0.4) - {rng.randrange(4)}
    w_done = {s: frozenset(mb for mb in ALL if rng.random() < 0.5) for s in range(4) if s not in committed}
    sources = _sources(plan, workers, Repair(4, w_done, committed), rng)
    sends, recvs = _messages(plan, Repair(4, w_done, committed, sources))
    local = {(g, src, dst, mb) for (g, src, dst, mb) in recvs if src == dst}
    assert sends == recvs - Counter(local)
    assert all(n == 1 for n in recvs.values())


def test_a_finished_neighbour_that_has_not_stepped_serves_its_log_or_the_span_widens() -> None:
    """Worker (1, 0) died in a W of iteration 5; stage 1 had finished every micro-batch but not stepped. Stage 0
    redoes the dead worker's micro-batches with the gradients stage 1 logged: stage 1 runs none of them again.
    Without those logs they run over the whole segment, as before logs were used inside it."""
    plan = _plan([(1, 0)])
    workers = WorkerMap.dense(2, 2, frozenset({(1, 0)}))  # ranks: (0,0) 0, (0,1) 1, (1,1) 2
    own0, own1 = [(0, i) for i in range(4)], [(1, i) for i in range(4)]
    reports = {0: _report(0, own0, own0, logs=_log(5, True, True, own0)),
               1: _report(1, own0, own0, logs=_log(5, True, False, own0)),
               2: _report(1, own1, own1, logs=_log(5, True, False, own1))}
    decision = decide(reports, plan, workers)
    assert not decision.committed and not decision.unrecoverable and not decision.repair.whole
    assert decision.repair.sources == {(True, 0, mb): 2 for mb in own1}
    for worker in [(0, 1), (1, 1)]:
        sched = PlanSchedule(plan, worker, workers.rank_of, 5, repair=decision.repair)
        kinds = [type(cmd) for step in sched.steps() for cmd in step]
        assert ins.ForwardMicroBatch not in kinds and ins.BackwardInput not in kinds
    forgotten = {**reports, 2: _report(1, own1, own1)}
    widened = decide(forgotten, plan, workers)
    assert not widened.unrecoverable and widened.repair.whole == set(own1) and not widened.repair.sources
