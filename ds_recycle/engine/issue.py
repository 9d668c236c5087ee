"""The engine's schedules with their transfers issued in one global order: :func:`issued_schedule`.

A :class:`~ds_recycle.engine.schedule.PlanSchedule` puts each receive right before the compute that needs it and
each send right after the compute that makes it. Issued that way, NCCL, which matches the messages of a pair in
posting order and completes a group only once each of its operations is matched, can deadlock on a plan with
failed workers (:mod:`ds_recycle.engine.nccl_check`). Here every worker's transfers are issued in the order they
match in a run of the whole job where sends never wait (:func:`~ds_recycle.engine.nccl_check.issue_points`): a
:class:`~ds_recycle.engine.instructions.PostTransfers` before each compute posts the transfers due there, together.
The send and receive instructions stay where they were: a send hands its tensors over, a receive waits for what was
posted. Every worker's stream of transfers then follows one global order, so no batch waits on a batch that waits on
it, whichever plan and failures. gloo runs the same program, so every CPU run exercises the order a GPU run needs.

The global order needs every live worker's lowering; it is computed once per plan iteration, repair and evaluation
pass, and shared by the schedules built from it (:data:`_CACHE`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule

from ds_recycle.engine.instructions import PostTransfers, Transfer
from ds_recycle.engine.nccl_check import (
    Compute,
    check_order,
    check_waits,
    classify,
    dense_ranks,
    issue_points,
    timeline,
)
from ds_recycle.engine.schedule import PlanLike, PlanSchedule, Repair, Worker

__all__ = ["IssuedSchedule", "check_plan", "issued_program", "issued_schedule", "place_posts"]

_Points = dict[int, list[tuple[int, list[Transfer]]]]
_CACHE: dict[tuple[Any, ...], tuple[PlanLike, Repair | None, _Points]] = {}
"""The last few programs, by plan, plan iteration, repair, evaluation and rank numbering (the plan and repair are kept
beside it so that their ids stay theirs)."""
_CACHE_SIZE = 8


def _program(plan: PlanLike, rank_of: Callable[[Worker], int], iteration: int, repair: Repair | None,
             forward_only: bool) -> _Points:
    planned = min(iteration, plan.iterations - 1)
    numbering = tuple(sorted((w, rank_of(w)) for w in plan.workers))
    key = (id(plan), planned, id(repair), forward_only, numbering)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is plan and hit[1] is repair:
        return hit[2]
    points = issue_points(timeline(plan, iteration, rank_of, repair, forward_only))
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (plan, repair, points)
    return points


def place_posts(steps: Sequence[Sequence[PipeInstruction]], me: int,
                points: Sequence[tuple[int, list[Transfer]]]) -> list[list[PipeInstruction]]:
    """``steps`` (rank ``me``'s) with a :class:`PostTransfers` for each of ``points``: the transfers due before
    compute ``n`` go after the sends that hand over tensors before it and before the receives that wait for them
    (between two computes, the lowering puts its sends first); those after the last compute go in a step of their
    own at the end."""
    before: dict[int, list[Transfer]] = {}
    for at, batch in points:
        before.setdefault(at, []).extend(batch)
    where: list[tuple[int, int]] = []  # per compute: where its PostTransfers goes
    first_recv: tuple[int, int] | None = None
    for s, c, item in classify(steps, me):
        if isinstance(item, Compute):
            where.append(first_recv or (s, c))
            first_recv = None
        elif item.kind == "recv":
            first_recv = first_recv or (s, c)
        elif first_recv is not None:
            raise ValueError(f"rank {me}: the {item} comes after a receive and before the compute they border; the "
                             "lowering puts the sends between two computes first")
    out = [list(step) for step in steps]
    for at in sorted(before, reverse=True):  # from the end, so that the positions before stay valid
        post = PostTransfers(transfers=tuple(before[at]))
        if at < len(where):
            s, c = where[at]
            out[s].insert(c, post)
        else:
            out.append([post])
    return out


class IssuedSchedule(PipeSchedule):
    """A :class:`~ds_recycle.engine.schedule.PlanSchedule`'s steps with its transfers posted in the job's match
    order (see the module docstring)."""

    def __init__(self, schedule: PlanSchedule, steps: list[list[PipeInstruction]]) -> None:
        super().__init__(micro_batches=schedule.micro_batches, stages=schedule.stages, stage_id=schedule.stage_id)
        self.schedule = schedule
        self._steps = steps

    def steps(self) -> Iterator[list[PipeInstruction]]:
        yield from self._steps

    def num_pipe_buffers(self) -> int:
        return self.schedule.num_pipe_buffers()


def issued_schedule(plan: PlanLike, worker: Worker, rank_of: Callable[[Worker], int], iteration: int,
                    synchronous: bool = False, repair: Repair | None = None,
                    forward_only: bool = False) -> IssuedSchedule:
    """``worker``'s :class:`~ds_recycle.engine.schedule.PlanSchedule` of ``iteration`` (same arguments), its transfers
    issued in the job's match order."""
    schedule = PlanSchedule(plan, worker, rank_of, iteration, synchronous=synchronous, repair=repair,
                            forward_only=forward_only)
    me = rank_of(worker)
    points = _program(plan, rank_of, iteration, repair, forward_only)[me]
    return IssuedSchedule(schedule, place_posts(list(schedule.steps()), me, points))


def issued_program(plan: PlanLike, iteration: int = 0, rank_of: Callable[[Worker], int] | None = None,
                   repair: Repair | None = None, forward_only: bool = False) -> dict[int, list[list[Transfer]]]:
    """Every live worker's batches of ``iteration`` as the engine posts them (its :class:`PostTransfers`), by rank
    (``rank_of``: the engine's numbering; None: stage-major without holes)."""
    number = rank_of if rank_of is not None else dense_ranks(plan).__getitem__
    return {number(w): [list(cmd.kwargs["transfers"])
                        for step in issued_schedule(plan, w, number, iteration, repair=repair,
                                                    forward_only=forward_only).steps()
                        for cmd in step if isinstance(cmd, PostTransfers)] for w in plan.workers}


def check_plan(plan: PlanLike, rank_of: Callable[[Worker], int] | None = None) -> int:
    """Check every iteration of ``plan`` as the engine issues it: each pair's order and no wait cycle under NCCL's
    matching (:mod:`ds_recycle.engine.nccl_check`); raises :class:`~ds_recycle.engine.nccl_check.NcclPlanError`,
    else returns the number of transfers checked."""
    total = 0
    for iteration in range(plan.iterations):
        program = issued_program(plan, iteration, rank_of)
        check_order(program)
        check_waits(program)
        total += sum(len(batch) for batches in program.values() for batch in batches)
    return total
