"""From a ReCycle plan to DeepSpeed steps: :class:`PlanSchedule`, a ``PipeSchedule`` subclass.

A plan (:class:`ds_recycle.plan.Plan`) lists, for every live worker ``(pipeline, stage)``, its F, B, W and O
operations in execution order. Lowering one worker's ops of one iteration (a pure function of integers):

=====  ==========================================================================================
F mb   ``LoadMicroBatchOf`` (first/last stage), ``RecvActivationFrom(peer)`` (not first stage),
       ``ForwardMicroBatch``, ``SendActivationTo(peer)`` (not last stage)
B mb   ``RecvGradFrom(peer)`` (not last stage), ``BackwardInput``, ``SendGradTo(peer)`` (not first stage)
W mb   ``BackwardWeight``

When a W directly follows the B of the same micro-batch and nothing waits for the split (the first stage,
which sends no gradient, or a ``1f1b`` plan, whose W is DeepSpeed's fused backward), the B is lowered as
``BackwardInput(..., weights=True)``: one fused backward pass, and the W only releases the buffer.
O      ``WaitSends``, then ``StaggeredOptimizerStep`` (a stage steps once its receivers hold what it sent)
=====  ==========================================================================================

and every iteration starts with ``FinishOptimizerStep`` (the previous step's post-validation). Peers are
global ranks: F of ``mb`` at stage ``s`` receives from the rank of ``plan.worker_of(s - 1, mb)``, which
belongs to another pipeline when ``mb`` was re-routed. Buffer slots are allocated at F and freed at W, so
``num_pipe_buffers()`` is the worker's peak number of micro-batches in flight.

``check_plan_for_job`` rejects, with a clear error, a plan that cannot run on this job before any process
communicates.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule

from ds_recycle.engine.instructions import (
    BackwardInput,
    BackwardWeight,
    CompleteOptimizerStep,
    FinishOptimizerStep,
    ForwardMicroBatch,
    LoadMicroBatchOf,
    MicroBatch,
    RecvActivationFrom,
    RecvGradFrom,
    SendActivationTo,
    SendGradTo,
    SendLoggedTo,
    ShareCommittedNorm,
    StaggeredOptimizerStep,
    WaitSends,
)

__all__ = ["WorkKind", "WorkItem", "LogSource", "PlanLike", "PlanNotRunnableError", "PlanSchedule", "Repair",
           "rerouted_microbatches",
           "worker_items",
           "lower_worker_items", "repair_items", "check_plan_for_job"]

Worker = tuple[int, int]


class WorkKind(enum.Enum):
    """The four kinds of plan operations (the plan format's ``kind``)."""

    F = "F"
    """Forward of one micro-batch through the stage."""
    B = "B"
    """Input-gradient backward of one micro-batch."""
    W = "W"
    """Weight-gradient backward of one micro-batch."""
    O = "O"  # noqa: E741 - the plan format's name
    """Gradient all-reduce over the stage's live replicas plus the optimizer step."""


@dataclass(frozen=True)
class WorkItem:
    """One plan operation as the engine needs it: what, which micro-batch (None for O)."""

    kind: WorkKind
    mb: MicroBatch | None

    def __str__(self) -> str:
        return self.kind.value if self.mb is None else f"{self.kind.value}{self.mb[0]}.{self.mb[1]}"


class PlanLike(Protocol):
    """What the engine reads from a planner's ``Plan`` (see ``ds_recycle.plan``)."""

    @property
    def stages(self) -> int: ...
    @property
    def pipelines(self) -> int: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def iterations(self) -> int: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def failed(self) -> frozenset[Worker]: ...
    @property
    def workers(self) -> Mapping[Worker, Sequence[Any]]: ...

    def worker_of(self, stage: int, mb: tuple[int, int]) -> Worker: ...


class PlanNotRunnableError(ValueError):
    """The plan does not fit this job (shape, absent workers, ops); raised before any communication."""


def worker_items(plan: PlanLike, worker: Worker, plan_iteration: int) -> list[WorkItem]:
    """This worker's operations of one planned iteration, in execution order."""
    if worker not in plan.workers:
        raise PlanNotRunnableError(f"the plan has no ops for worker (pipeline {worker[0]}, stage {worker[1]}); "
                                   f"its failed set is {sorted(plan.failed)}: make the plan for this job's absent workers")
    items = []
    for op in plan.workers[worker]:
        if op.iteration != plan_iteration:
            continue
        kind = WorkKind(op.kind.value if isinstance(op.kind, enum.Enum) else op.kind)
        items.append(WorkItem(kind, None if op.mb is None else (int(op.mb[0]), int(op.mb[1]))))
    return items


def _check_items(items: Sequence[WorkItem], worker: Worker, microbatches: int, pipelines: int) -> None:
    where = f"worker (pipeline {worker[0]}, stage {worker[1]})"
    done: dict[MicroBatch, list[WorkKind]] = {}
    for n, item in enumerate(items):
        if item.kind is WorkKind.O:
            if n != len(items) - 1:
                raise PlanNotRunnableError(f"{where}: O is op {n} of {len(items)}, but it must be the last op "
                                           f"of an iteration ({' '.join(map(str, items))})")
            continue
        mb = item.mb
        if mb is None or not (0 <= mb[0] < pipelines and 0 <= mb[1] < microbatches):
            raise PlanNotRunnableError(f"{where}: op {item} names a micro-batch outside {pipelines} pipelines x "
                                       f"{microbatches} micro-batches")
        seen = done.setdefault(mb, [])
        expected = [WorkKind.F, WorkKind.B, WorkKind.W][len(seen)] if len(seen) < 3 else None
        if item.kind is not expected:
            raise PlanNotRunnableError(f"{where}: op {n} ({item}) comes after {[k.value for k in seen]} of the same "
                                       "micro-batch; each micro-batch needs F, then B, then W, once each")
        seen.append(item.kind)
    if not items or items[-1].kind is not WorkKind.O:
        raise PlanNotRunnableError(f"{where}: the iteration does not end with O ({' '.join(map(str, items))})")
    unfinished = [mb for mb, kinds in done.items() if len(kinds) != 3]
    if unfinished:
        raise PlanNotRunnableError(f"{where}: micro-batches {unfinished} lack B or W in the iteration")


class _Slots:
    """Lowest-free-slot allocation of buffers between a micro-batch's F and its W."""

    def __init__(self) -> None:
        self.of: dict[MicroBatch, int] = {}
        self.peak = 0

    def take(self, mb: MicroBatch) -> int:
        used = set(self.of.values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.of[mb] = slot
        self.peak = max(self.peak, len(self.of))
        return slot

    def release(self, mb: MicroBatch) -> int:
        return self.of.pop(mb)


def lower_worker_items(items: Sequence[WorkItem], stage: int, stages: int,
                       peer: Callable[[int, MicroBatch], int], synchronous: bool,
                       fuse_adjacent_bw: bool = False,
                       sends_grad: Callable[[MicroBatch], bool] | None = None,
                       sends_activation: Callable[[MicroBatch], bool] | None = None,
                       ) -> tuple[list[list[PipeInstruction]], int]:
    """Lower one iteration of a worker's ops to DeepSpeed steps; returns ``(steps, buffers needed)``.

    ``peer(stage, mb)`` is the global rank that runs ``mb`` at ``stage``. ``fuse_adjacent_bw``: run a B
    that the same micro-batch's W directly follows as one fused backward (always done on the first stage).
    ``sends_grad(mb)``: whether the B of ``mb`` sends its input gradient upstream (default: on every stage but
    the first; a repair leaves it out where the upstream stage has no B to run). ``sends_activation(mb)``: whether
    the F of ``mb`` sends its output downstream (default: on every stage but the last; a repair leaves it out
    where the next stage runs nothing of ``mb``).
    """
    first, last = stage == 0, stage == stages - 1
    fuse = fuse_adjacent_bw or first
    slots = _Slots()
    steps: list[list[PipeInstruction]] = [[FinishOptimizerStep()]]
    for n, item in enumerate(items):
        if item.kind is WorkKind.O:
            steps.append([WaitSends(), StaggeredOptimizerStep(synchronous=synchronous)])
            continue
        mb = item.mb
        assert mb is not None
        if item.kind is WorkKind.F:
            buf = slots.take(mb)
            cmds: list[PipeInstruction] = []
            if not first:
                cmds.append(RecvActivationFrom(buf, micro_batch=mb, peer=peer(stage - 1, mb)))
            if first or last:
                cmds.append(LoadMicroBatchOf(buf, micro_batch=mb))
            cmds.append(ForwardMicroBatch(buf, micro_batch=mb))
            if not last and (sends_activation is None or sends_activation(mb)):
                cmds.append(SendActivationTo(buf, micro_batch=mb, peer=peer(stage + 1, mb)))
        elif item.kind is WorkKind.B:
            buf = slots.of[mb]
            cmds = [] if last else [RecvGradFrom(buf, micro_batch=mb, peer=peer(stage + 1, mb))]
            nxt = items[n + 1] if n + 1 < len(items) else None
            weights = fuse and nxt is not None and nxt.kind is WorkKind.W and nxt.mb == mb
            cmds.append(BackwardInput(buf, micro_batch=mb, weights=weights))
            if not first and (sends_grad is None or sends_grad(mb)):
                cmds.append(SendGradTo(buf, micro_batch=mb, peer=peer(stage - 1, mb)))
        else:
            cmds = [BackwardWeight(slots.release(mb), micro_batch=mb)]
        steps.append(cmds)
    return steps, max(slots.peak, 1)


LogSource = tuple[bool, int, MicroBatch]
"""A tensor a repair takes from a boundary log: ``(is the output gradient, receiving stage, micro-batch)``
(False: the activation into that stage)."""


@dataclass(frozen=True)
class Repair:
    """What is left of an interrupted iteration, for every stage (see :func:`repair_items`).

    ``committed`` stages stepped the iteration before the failure: they run none of it again. The other
    stages form *segments* (maximal runs of stages that have not stepped). ``w_done[s]`` holds the
    micro-batches whose weight gradient stage ``s`` has already accumulated (by a worker still alive); a
    micro-batch missing from some stage's ``w_done`` runs again over its *span*: from the lowest to the highest
    stage of its segment that misses it (its activations there died with the old groups). Its F and B run at
    every stage of the span, its W only where missing. What the span needs from beyond it (the activation into
    its first stage, the output gradient into its last) comes from a boundary log, whether that neighbour is
    committed or finished the micro-batch without stepping: ``sources`` names the live rank that holds each.
    A micro-batch in ``whole`` (a tensor its span would need is held by no live worker) runs over its whole
    segment instead: forwarded from the segment's first stage, its B from its lowest missing stage up.
    """

    stages: int
    w_done: Mapping[int, frozenset[MicroBatch]]
    committed: frozenset[int] = frozenset()
    sources: Mapping[LogSource, int] = field(default_factory=dict)
    completing: frozenset[int] = frozenset()
    """Ranks of committed stages that hold their stage's reduced gradients and still have to step (they waited
    only for the clipping norm): they step in the repair (:class:`CompleteOptimizerStep`)."""
    whole: frozenset[MicroBatch] = frozenset()

    @property
    def steps_anywhere(self) -> bool:
        """Whether some worker steps in the repair (then every worker takes part in the norm exchange)."""
        return len(self.committed) < self.stages or bool(self.completing)

    def segment(self, stage: int) -> tuple[int, int]:
        """The first and last stage of ``stage``'s segment (``stage`` must not be committed)."""
        lo = hi = stage
        while lo - 1 >= 0 and lo - 1 not in self.committed:
            lo -= 1
        while hi + 1 < self.stages and hi + 1 not in self.committed:
            hi += 1
        return lo, hi

    def _missing(self, mb: MicroBatch, lo: int, hi: int) -> list[int]:
        return [s for s in range(lo, hi + 1) if mb not in self.w_done.get(s, frozenset())]

    def span(self, mb: MicroBatch, stage: int) -> tuple[int, int] | None:
        """The first and last stage that run ``mb`` again in ``stage``'s segment (None: it is finished there)."""
        lo, hi = self.segment(stage)
        missing = self._missing(mb, lo, hi)
        if not missing:
            return None
        return (lo, hi) if mb in self.whole else (missing[0], missing[-1])

    def runs(self, mb: MicroBatch, stage: int) -> bool:
        """Whether ``stage`` (not committed) runs anything of ``mb`` again."""
        span = self.span(mb, stage)
        return span is not None and span[0] <= stage <= span[1]

    def lowest_unfinished_stage(self, mb: MicroBatch, stage: int) -> int:
        """The lowest stage of ``stage``'s segment still missing ``mb``: B runs from there up."""
        return min(self._missing(mb, *self.segment(stage)))

    def needed_from_logs(self, microbatches: Sequence[MicroBatch]) -> list[LogSource]:
        """Every tensor a span needs from beyond it, in a fixed order."""
        needed: list[LogSource] = []
        for lo in range(self.stages):
            if lo in self.committed or (lo > 0 and lo - 1 not in self.committed):
                continue  # not the first stage of a segment
            for mb in microbatches:
                span = self.span(mb, lo)
                if span is None:
                    continue
                if span[0] > 0:
                    needed.append((False, span[0], mb))
                if span[1] < self.stages - 1:
                    needed.append((True, span[1], mb))
        return needed


def repair_items(items: Sequence[WorkItem], stage: int, repair: Repair) -> list[WorkItem]:
    """This worker's ops of the interrupted iteration that are still to do, in the plan's order."""
    if stage in repair.committed:
        return []
    done = repair.w_done.get(stage, frozenset())
    kept = []
    for item in items:
        if item.kind is WorkKind.O:
            kept.append(item)
            continue
        mb = item.mb
        assert mb is not None
        if not repair.runs(mb, stage):
            continue
        if (item.kind is WorkKind.F or (item.kind is WorkKind.B and stage >= repair.lowest_unfinished_stage(mb, stage))
                or (item.kind is WorkKind.W and mb not in done)):
            kept.append(item)
    return kept


def _served_from_log(plan: PlanLike, worker: Worker, rank_of: Callable[[Worker], int],
                     repair: Repair) -> list[PipeInstruction]:
    """The log sends this worker posts first in a repair: each tensor it holds that another rank needs."""
    me = rank_of(worker)
    cmds: list[PipeInstruction] = []
    for (grad, stage, mb), holder in sorted(repair.sources.items()):
        receiver = rank_of(plan.worker_of(stage, mb))
        if holder == me and receiver != me:
            cmds.append(SendLoggedTo(micro_batch=mb, peer=receiver, grad=grad, received=worker[1] == stage))
    return cmds


def check_plan_for_job(plan: PlanLike, stages: int, pipelines: int, microbatches: int,
                       absent: frozenset[Worker]) -> None:
    """Raise :class:`PlanNotRunnableError` when ``plan`` was made for another job shape or failure set."""
    want = (stages, pipelines, microbatches)
    got = (plan.stages, plan.pipelines, plan.microbatches)
    if got != want:
        raise PlanNotRunnableError(f"the plan is for stages, pipelines, micro-batches = {got}, the job is {want}: "
                                   "make the plan with the job's recycle.stages, recycle.pipelines and "
                                   "gradient_accumulation_steps")
    if frozenset(plan.failed) != absent:
        raise PlanNotRunnableError(f"the plan assumes failed workers {sorted(plan.failed)}, the job has absent "
                                   f"workers {sorted(absent)}: make the plan for recycle.assume_failed")
    for worker in plan.workers:
        for k in range(plan.iterations):
            _check_items(worker_items(plan, worker, k), worker, microbatches, pipelines)
    for s in range(stages):
        for d in range(pipelines):
            for i in range(microbatches):
                runner = plan.worker_of(s, (d, i))
                if runner in absent or runner not in plan.workers:
                    raise PlanNotRunnableError(f"the plan runs micro-batch ({d}, {i}) at stage {s} on worker "
                                               f"{runner}, which is absent")


def _lowered(plan: PlanLike, worker: Worker, rank_of: Callable[[Worker], int], iteration: int, synchronous: bool,
             repair: Repair | None, forward_only: bool) -> tuple[list[list[PipeInstruction]], int]:
    """``worker``'s steps of ``iteration`` and the buffers they need, a repair's log sends not yet placed."""
    items = worker_items(plan, worker, min(iteration, plan.iterations - 1))
    _check_items(items, worker, plan.microbatches, plan.pipelines)
    sends_grad: Callable[[MicroBatch], bool] | None = None
    sends_activation: Callable[[MicroBatch], bool] | None = None
    stage = worker[1]

    def peer(at: int, mb: MicroBatch) -> int:
        if repair is not None and not (at not in repair.committed and repair.runs(mb, at)):
            return repair.sources[(at > stage, stage, mb)]  # a neighbour that runs nothing of mb: its log
        return rank_of(plan.worker_of(at, mb))

    if repair is not None:  # the rest of an interrupted iteration: a subsequence of a checked one
        items = repair_items(items, stage, repair)
        sends_grad = lambda mb: stage > repair.lowest_unfinished_stage(mb, stage)  # noqa: E731
        sends_activation = lambda mb: stage + 1 not in repair.committed and repair.runs(mb, stage + 1)  # noqa: E731
    if forward_only:  # evaluation: the plan's forwards, in its order and routing
        items = [item for item in items if item.kind is WorkKind.F]
    fuse = getattr(plan, "schedule", None) == "1f1b"
    return lower_worker_items(items, stage, plan.stages, peer, synchronous, fuse, sends_grad, sends_activation)


_Message = tuple[bool, MicroBatch]
"""A boundary message as its receiver names it: (is an output gradient, micro-batch)."""


def _received_from(steps: Sequence[Sequence[PipeInstruction]], sender: int) -> list[_Message]:
    """The messages ``steps`` receive from rank ``sender``, in order."""
    return [(isinstance(cmd, RecvGradFrom), tuple(cmd.kwargs["micro_batch"])) for step in steps for cmd in step
            if isinstance(cmd, (RecvActivationFrom, RecvGradFrom)) and cmd.kwargs["peer"] == sender]


def _sent_to(steps: Sequence[Sequence[PipeInstruction]], receiver: int) -> list[_Message]:
    """The messages ``steps`` send rank ``receiver``, in order (log sends included)."""
    return [(isinstance(cmd, SendGradTo) or (isinstance(cmd, SendLoggedTo) and cmd.kwargs["grad"]),
             tuple(cmd.kwargs["micro_batch"])) for step in steps for cmd in step
            if isinstance(cmd, (SendActivationTo, SendGradTo, SendLoggedTo)) and cmd.kwargs["peer"] == receiver]


def _place_served(steps: list[list[PipeInstruction]], served: Sequence[PipeInstruction], me: int,
                  receives: Callable[[int], list[_Message]]) -> None:
    """Put this worker's log sends (``served``) into its ``steps`` so that each receiver gets every message from
    it in the order it receives them (messages match per pair in posting order): a log send goes right after the
    send of the message its receiver takes just before it, or first (a step of its own after the first) when it
    takes none before it. ``receives(rank)``: that rank's receives from this worker, in order."""
    first: list[PipeInstruction] = []
    after: dict[tuple[int, _Message], list[PipeInstruction]] = {}
    by_receiver: dict[int, dict[_Message, PipeInstruction]] = {}
    for cmd in served:
        by_receiver.setdefault(cmd.kwargs["peer"], {})[(cmd.kwargs["grad"], tuple(cmd.kwargs["micro_batch"]))] = cmd
    wanted = {receiver: receives(receiver) for receiver in by_receiver}
    for receiver, logged in by_receiver.items():
        previous: _Message | None = None
        for message in wanted[receiver]:
            cmd = logged.get(message)
            if cmd is None:
                previous = message
            elif previous is None:
                first.append(cmd)
            else:
                after.setdefault((receiver, previous), []).append(cmd)
    for step in steps:
        k = 0
        while k < len(step):
            cmd = step[k]
            k += 1
            if isinstance(cmd, (SendActivationTo, SendGradTo)):
                key = (cmd.kwargs["peer"], (isinstance(cmd, SendGradTo), tuple(cmd.kwargs["micro_batch"])))
                for extra in after.pop(key, []):
                    step.insert(k, extra)
                    k += 1
    if first:
        steps.insert(1, first)
    for receiver, want in wanted.items():
        sent = _sent_to(steps, receiver)
        if sent != want:
            raise PlanNotRunnableError(f"repair: rank {me} would send rank {receiver} {sent} but it receives {want} "
                                       "from it in that order")


class PlanSchedule(PipeSchedule):
    """DeepSpeed ``PipeSchedule`` that executes one worker's ops of one iteration of a plan.

    ``steps()`` yields one list of instructions per plan op (a step is atomic, as in DeepSpeed).
    Training iteration ``k`` runs the plan's iteration ``min(k, plan.iterations - 1)``. ``forward_only``
    keeps the F ops (evaluation: every micro-batch forwarded once per stage, routed as the plan routes it).
    In a ``repair`` a worker that holds logged boundary tensors others need sends each where its receiver's order
    of receives from this worker puts it (:func:`_place_served`).
    """

    def __init__(self, plan: PlanLike, worker: Worker, rank_of: Callable[[Worker], int], iteration: int,
                 synchronous: bool = False, repair: Repair | None = None, forward_only: bool = False) -> None:
        super().__init__(micro_batches=plan.microbatches, stages=plan.stages, stage_id=worker[1])
        self.plan = plan
        self.worker = worker
        self.iteration = iteration
        stage = worker[1]
        self._steps, self._buffers = _lowered(plan, worker, rank_of, iteration, synchronous, repair, forward_only)
        if repair is not None:
            me = rank_of(worker)
            served = _served_from_log(plan, worker, rank_of, repair)
            if served:
                by_rank = {rank_of(w): w for w in plan.workers}

                def receives(rank: int) -> list[_Message]:
                    theirs, _ = _lowered(plan, by_rank[rank], rank_of, iteration, synchronous, repair, forward_only)
                    return _received_from(theirs, me)
                _place_served(self._steps, served, me, receives)
            if stage in repair.committed:  # nothing of the iteration to compute again: serve, then the norm
                self._steps.append([WaitSends()])
                if me in repair.completing:
                    self._steps.append([CompleteOptimizerStep()])
                elif repair.steps_anywhere:
                    self._steps.append([ShareCommittedNorm()])

    def steps(self) -> Iterator[list[PipeInstruction]]:
        yield from self._steps

    def num_pipe_buffers(self) -> int:
        return self._buffers


def rerouted_microbatches(plan: PlanLike) -> int:
    """(stage, micro-batch) pairs of one iteration processed by a worker of another pipeline."""
    return sum(plan.worker_of(s, (d, i))[0] != d for s in range(plan.stages) for d in range(plan.pipelines)
               for i in range(plan.microbatches))
