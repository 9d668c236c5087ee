"""The static NCCL check of plans (engine/nccl_check.py): per-pair message order and NCCL's wait model."""
from __future__ import annotations

import pytest

from ds_recycle.engine.issue import check_plan
from ds_recycle.engine.nccl_check import (
    Compute,
    NcclPlanError,
    Transfer,
    check_order,
    check_waits,
    in_match_order,
    issue_points,
    match_order,
    p2p_program,
    timeline,
)
from ds_recycle.plan import CostModel, make_plan
from tests.engine.plan_grid import grid


def _send(peer: int, i: int, channel: str = "activation") -> Transfer:
    return Transfer("send", peer, channel, (0, i))


def _recv(peer: int, i: int, channel: str = "activation") -> Transfer:
    return Transfer("recv", peer, channel, (0, i))


def test_head_to_head_sends_deadlock_and_a_group_does_not() -> None:
    # each sends first and receives in a later batch (compute between): neither send can be matched
    crossed = {0: [[_send(1, 0)], [_recv(1, 1, "grad")]], 1: [[Transfer("send", 0, "grad", (0, 1))], [_recv(0, 0)]]}
    with pytest.raises(NcclPlanError, match="deadlocks.*rank 0 in batch 0: send activation 0.0 -> rank 1"):
        check_waits(crossed)
    grouped = {0: [[_send(1, 0), _recv(1, 1, "grad")]], 1: [[Transfer("send", 0, "grad", (0, 1)), _recv(0, 0)]]}
    check_waits(grouped)  # one batch each: both complete together


def test_in_match_order_the_crossed_sends_travel_with_the_receives_they_wait_for() -> None:
    """Each rank computes, sends, computes, then receives: issued so, the sends deadlock. In match order both
    receives can match at time 2 (F and B take a unit), and the lower rank's goes first: rank 0 posts its send with
    the receive that matches before it, in one batch; rank 1 sends as soon as its compute ran."""
    f, b = Compute("ForwardMicroBatch"), Compute("BackwardInput")
    lines = {0: [f, _send(1, 0), f, _recv(1, 1, "grad"), b], 1: [b, Transfer("send", 0, "grad", (0, 1)), f,
                                                                 _recv(0, 0), f]}
    with pytest.raises(NcclPlanError, match="deadlocks"):
        check_waits({rank: [[t] for t in items if isinstance(t, Transfer)] for rank, items in lines.items()})
    assert match_order(lines) == {0: [3, 1], 1: [1, 3]}
    program = in_match_order(lines)
    assert program == {0: [[_recv(1, 1, "grad"), _send(1, 0)]],
                       1: [[Transfer("send", 0, "grad", (0, 1))], [_recv(0, 0)]]}
    assert issue_points(lines)[1] == [(1, [Transfer("send", 0, "grad", (0, 1))]), (2, [_recv(0, 0)])]
    check_waits(program)


def test_a_plan_that_deadlocks_even_with_buffered_sends_is_named() -> None:
    lines = {0: [_recv(1, 0), _send(1, 1)], 1: [_recv(0, 1), _send(0, 0)]}
    with pytest.raises(NcclPlanError, match="even with sends that never wait: rank 0 at recv activation 0.0"):
        match_order(lines)


def test_messages_out_of_order_between_a_pair_are_named() -> None:
    with pytest.raises(NcclPlanError, match="first differ at message 0: sent \\('activation', \\(0, 1\\)\\)"):
        check_order({0: [[_send(1, 1)], [_send(1, 0)]], 1: [[_recv(0, 0)], [_recv(0, 1)]]})


def test_a_failure_free_pipeline_passes_and_its_batches_are_the_steps_joints() -> None:
    plan = make_plan(2, 1, 4, CostModel.uniform(2), schedule="1f1b")
    program = p2p_program(plan)
    assert check_plan(plan) == sum(len(b) for batches in program.values() for b in batches) == 2 * 2 * 4
    # stage 1 in 1F1B: receive an activation, compute F and B, send the gradient with the next receive
    assert [[str(op) for op in batch] for batch in program[1]][:2] == [
        ["recv activation 0.0 <- rank 0"], ["send grad 0.0 -> rank 0", "recv activation 0.1 <- rank 0"]]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "adaptive"])
def test_every_plan_of_the_grid_keeps_each_pairs_order(schedule: str) -> None:
    """Every plan the engine would run (the plan cache: shapes 2x2..4x2, M = S and 2S, no, one and two failed
    workers) sends each pair's messages in the order the receiver takes them: FIFO matching delivers the right
    tensor without tags. Failure-free 1F1B and ZB-H1 plans also have no wait cycle under NCCL's blocking p2p as
    lowered (receives before their compute, sends after), and every plan has none issued in match order."""
    plans = grid(schedule)
    for _, plan, failed in plans:
        program = p2p_program(plan)
        check_order(program)
        if not failed and schedule != "adaptive":
            check_waits(program)
        ordered = in_match_order(timeline(plan))
        check_order(ordered)
        check_waits(ordered)
    assert len(plans) == sum(2 * (1 + s * d + 4) for s, d in [(2, 2), (2, 3), (3, 2), (4, 2)])
