"""The engine's schedules with their transfers issued in the job's match order (engine/issue.py): every
``PostTransfers`` posts what was handed over and what is waited for later, and the batches it posts keep each pair's
order and have no wait cycle under NCCL's matching, for every plan of the grid, its evaluation pass and repairs."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from ds_recycle.engine import instructions as ins
from ds_recycle.engine.issue import issued_schedule, place_posts
from ds_recycle.engine.nccl_check import Transfer, check_order, check_waits, dense_ranks
from ds_recycle.engine.schedule import PlanLike, Repair, Worker
from tests.engine.plan_grid import grid
from tests.engine.plans import one_f_one_b

_KIND = {ins.SendActivationTo: ("send", "activation"), ins.SendGradTo: ("send", "grad"),
         ins.RecvActivationFrom: ("recv", "activation"), ins.RecvGradFrom: ("recv", "grad")}


def _message(cmd: ins.PipeInstruction) -> tuple[str, str, int, tuple[int, int]] | None:
    """(send or recv, channel, peer, micro-batch) of a transfer instruction, else None."""
    if isinstance(cmd, ins.SendLoggedTo):
        kind = ("send", "grad" if cmd.kwargs["grad"] else "activation")
    else:
        found = _KIND.get(type(cmd))
        if found is None:
            return None
        kind = found
    mb = cmd.kwargs["micro_batch"]
    return kind[0], kind[1], int(cmd.kwargs["peer"]), (int(mb[0]), int(mb[1]))


def check_issued(steps: Sequence[Sequence[ins.PipeInstruction]], me: int, where: str) -> list[list[Transfer]]:
    """Run rank ``me``'s issued ``steps`` as the channel does: a ``PostTransfers`` send needs its tensors handed over
    by an earlier send instruction, a receive instruction needs an earlier ``PostTransfers`` receive, ``WaitSends``
    needs every handed send posted, and nothing posted is left untaken. Returns the posted batches."""
    handed: set[tuple[str, int, tuple[int, int]]] = set()
    posted: set[tuple[str, int, tuple[int, int]]] = set()
    batches: list[list[Transfer]] = []
    for step in steps:
        for cmd in step:
            if isinstance(cmd, ins.PostTransfers):
                batch = list(cmd.kwargs["transfers"])
                assert batch, where
                for t in batch:
                    key = (t.channel, t.peer, t.mb)
                    if t.kind == "send":
                        assert key in handed, (where, f"{t} posted before it was handed over")
                        handed.remove(key)
                    else:
                        assert key not in posted, (where, t)
                        posted.add(key)
                batches.append(batch)
            elif isinstance(cmd, ins.WaitSends):
                assert not handed, (where, f"handed over and not posted at WaitSends: {handed}")
            else:
                message = _message(cmd)
                if message is None or message[2] == me:  # not a transfer, or a tensor from the worker's own log
                    continue
                kind, channel, peer, mb = message
                if kind == "send":
                    handed.add((channel, peer, mb))
                else:
                    assert (channel, peer, mb) in posted, (where, f"{cmd} waits for a receive nobody posted")
                    posted.remove((channel, peer, mb))
    assert not handed and not posted, (where, handed, posted)
    return batches


def check_job(plan: PlanLike, rank_of: Callable[[Worker], int], where: str, repair: Repair | None = None,
              forward_only: bool = False) -> int:
    """Every live worker's issued schedule passes :func:`check_issued`, and the batches of all of them keep each
    pair's order with no wait cycle under NCCL's matching; returns the number of transfers posted."""
    program: dict[int, list[list[Transfer]]] = {}
    for worker in plan.workers:
        me = rank_of(worker)
        schedule = issued_schedule(plan, worker, rank_of, 0, repair=repair, forward_only=forward_only)
        program[me] = check_issued(list(schedule.steps()), me, f"{where}, rank {me}")
    check_order(program)
    check_waits(program)
    return sum(len(b) for batches in program.values() for b in batches)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "adaptive"])
def test_every_plan_of_the_grid_is_issued_in_an_order_nccl_runs(schedule: str) -> None:
    posted = 0
    for name, plan, _ in grid(schedule):
        ranks = dense_ranks(plan)
        posted += check_job(plan, ranks.__getitem__, name)
        posted += check_job(plan, ranks.__getitem__, f"{name}, evaluation", forward_only=True)
    assert posted > 0


def test_in_1f1b_every_send_is_posted_right_after_its_compute_and_every_receive_before_its_wait() -> None:
    """Stage 0 posts each activation with the receive of the gradient it waits for next (one group, as Megatron's
    send-forward-receive-backward); stage 1 posts each gradient as soon as its B ran, before its W."""
    plan = one_f_one_b(2, 2, 4)
    ranks = dense_ranks(plan)

    def shape(worker: Worker) -> list[list[object]]:
        return [[[str(t) for t in c.kwargs["transfers"]] if isinstance(c, ins.PostTransfers) else type(c).__name__
                 for c in step] for step in issued_schedule(plan, worker, ranks.__getitem__, 0).steps()]

    first, last = shape((0, 0)), shape((0, 1))
    assert first[2:4] == [[["send activation 0.0 -> rank 2"], "LoadMicroBatchOf", "ForwardMicroBatch",
                           "SendActivationTo"],
                          [["recv grad 0.0 <- rank 2", "send activation 0.1 -> rank 2"], "RecvGradFrom",
                           "BackwardInput"]]
    assert last[1:5] == [[["recv activation 0.0 <- rank 0"], "RecvActivationFrom", "LoadMicroBatchOf",
                          "ForwardMicroBatch"],
                         ["BackwardInput", "SendGradTo"],
                         [["send grad 0.0 -> rank 0"], "BackwardWeight"],
                         [["recv activation 0.1 <- rank 0"], "RecvActivationFrom", "LoadMicroBatchOf",
                          "ForwardMicroBatch"]]
    assert first[-1] == last[-1] == ["WaitSends", "StaggeredOptimizerStep"]
    assert issued_schedule(plan, (0, 1), ranks.__getitem__, 0).num_pipe_buffers() == 1


def test_a_send_that_would_follow_a_receive_between_two_computes_is_refused() -> None:
    compute = ins.ForwardMicroBatch(0, micro_batch=(0, 0))
    recv = ins.RecvActivationFrom(0, micro_batch=(0, 1), peer=1)
    send = ins.SendActivationTo(0, micro_batch=(0, 0), peer=1)
    with pytest.raises(ValueError, match="comes after a receive"):
        place_posts([[compute], [recv, send, compute]], 0, [])

