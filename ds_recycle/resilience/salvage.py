"""The repair of the interrupted iteration: keep what the survivors finished, never roll a stage back.

After a failure each member reports (through the store) where it stands (a
:class:`~ds_recycle.engine.position.Position`): the last
iteration whose optimizer step it took, what it has finished of the iteration in flight, and what its
boundary log holds (:mod:`ds_recycle.engine.boundary_log`). Every member then computes the same decision
from the same reports (:func:`decide`). Let ``k`` be the earliest iteration some member has not stepped:

- every member has stepped ``k - 1`` (a stage never runs ahead of another by more than one step), so no
  state is ever restored from a copy;
- a stage some member has stepped ``k`` on is *committed*: it runs nothing of ``k`` again. A replica of it
  that had not taken the step yet but holds the stage's reduced gradients and waited only for the clipping
  norm takes its step in the repair (``completing``); one that the failure caught earlier in the reduction is
  brought forward: a committed replica broadcasts its stage state to it once (``roll_forward``), the only
  state that ever moves, in a window of milliseconds. A stage whose every replica waited only for the norm is
  committed the same way;
- the other stages finish ``k``: weight gradients already accumulated stay (a reduction that was under way
  is undone: its rows were kept), and the rest runs as a :class:`~ds_recycle.engine.schedule.Repair` of the
  new plan. What they need from a committed neighbour (it cannot compute it again) comes from a boundary log
  of a live member: the neighbour that sent it, or the worker that received it;
- if the new plan moves a survivor's micro-batches of a stage that has not stepped to another survivor, that
  stage's partial sums are dropped and its part of ``k`` is done again from the start (its parameters have
  not moved, so nothing needs restoring).

No gradient is lost, doubled or half-applied: a weight gradient is accumulated once per (stage,
micro-batch), in the same per-pipeline order as in a failure-free run, and every stage steps each iteration
once. What cannot be repaired (a tensor needed from a log whose sender and receiver both died; a weight tied
across a committed and an uncommitted stage) is named in :attr:`Decision.unrecoverable`: the job then falls
back to its checkpoint.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ds_recycle.engine.position import MicroBatch, Position
from ds_recycle.engine.schedule import LogSource, PlanLike, Repair
from ds_recycle.runtime.grid import WorkerMap

__all__ = ["Decision", "decide"]


@dataclass(frozen=True)
class Decision:
    """What the members do with the interrupted iteration ``iteration``."""

    iteration: int
    members: tuple[int, ...]
    repair: Repair
    roll_forward: Mapping[int, int] = field(default_factory=dict)
    """Committed stage -> the replica that sends its state to the replicas that had not stepped."""
    dropped: frozenset[int] = frozenset()
    """Stages whose partial sums are dropped (the new plan moves their micro-batches between survivors)."""
    unrecoverable: str = ""
    """Why the iteration cannot be repaired (empty: it can)."""

    @property
    def committed(self) -> frozenset[int]:
        return self.repair.committed

    @property
    def kept_weight_gradients(self) -> int:
        return sum(len(v) for v in self.repair.w_done.values())

    @property
    def from_logs(self) -> int:
        return len(self.repair.sources)


def decide(reports: Mapping[int, Position], new_plan: PlanLike, workers: WorkerMap, salvage: bool = True,
           tied_stages: Sequence[frozenset[int]] = ()) -> Decision:
    """The members' common decision; ``reports`` and ``workers`` cover exactly the agreed members, ``new_plan``
    is the plan for their failure set. ``salvage=False`` (``recycle.salvage``) drops every partial sum of the
    stages that have not stepped. ``tied_stages``: for each weight tied across stages, the stages that hold it."""
    k = min(r.stepped for r in reports.values()) + 1
    ahead = {q: r.stepped for q, r in reports.items() if r.stepped > k}
    if ahead:
        raise RuntimeError(f"members {sorted(ahead)} stepped iterations {sorted(set(ahead.values()))}, beyond "
                           f"{k}, while others have not stepped {k - 1}: their reports are inconsistent")
    members = tuple(sorted(reports))
    by_stage: dict[int, list[int]] = {}
    for q, r in reports.items():
        by_stage.setdefault(r.stage, []).append(q)
    committed: set[int] = set()
    completing: set[int] = set()
    roll_forward: dict[int, int] = {}
    for s, ranks in sorted(by_stage.items()):
        stepped = [q for q in ranks if reports[q].stepped == k]
        awaiting = [q for q in ranks if reports[q].stepped < k and reports[q].awaiting and reports[q].in_flight == k]
        if stepped:  # replicas that waited only for the norm step now; any other one gets the stage's state
            committed.add(s)
            completing.update(awaiting)
            if len(stepped) + len(awaiting) < len(ranks):
                roll_forward[s] = min(stepped)
        elif len(awaiting) == len(ranks):  # every replica holds the reduced gradients: finish the step
            committed.add(s)
            completing.update(awaiting)
    dropped = set()
    w_done: dict[int, frozenset[MicroBatch]] = {}
    for q, r in reports.items():
        if r.stage in committed or r.in_flight != k:
            continue
        worker = workers.worker_of_rank(q)
        if not salvage or any(new_plan.worker_of(r.stage, mb) != worker for mb in r.served):
            dropped.add(r.stage)
        w_done[r.stage] = w_done.get(r.stage, frozenset()) | frozenset(r.w_done)
    for s in dropped:
        w_done.pop(s, None)
    unrecoverable = ""
    for stages in tied_stages:
        if stages & committed and stages - committed:
            unrecoverable = (f"a weight tied across stages {sorted(stages)} was stepped on stages "
                             f"{sorted(stages & committed)} but not on {sorted(stages - committed)}")
    mbs = [(d, i) for d in range(new_plan.pipelines) for i in range(new_plan.microbatches)]
    whole: set[MicroBatch] = set()
    while True:  # a span that needs a tensor no live worker holds runs over its whole segment instead
        base = Repair(new_plan.stages, w_done, frozenset(committed), whole=frozenset(whole))
        sources: dict[LogSource, int] = {}
        lost: list[LogSource] = []
        for need in base.needed_from_logs(mbs):
            holder = _holder(need, k, reports, new_plan, workers)
            if holder is None:
                lost.append(need)
            else:
                sources[need] = holder
        widen = {mb for grad, stage, mb in lost if (stage + 1 if grad else stage - 1) not in committed}
        if not widen - whole:
            break
        whole |= widen
    for grad, stage, mb in lost:
        unrecoverable = unrecoverable or (
            f"the {'gradient' if grad else 'activation'} of micro-batch {mb} into stage {stage} of iteration "
            f"{k} is held by no live worker (its sender and its receiver both failed)")
    repair = Repair(new_plan.stages, w_done, frozenset(committed), sources, frozenset(completing), frozenset(whole))
    return Decision(k, members, repair, roll_forward, frozenset(dropped), unrecoverable)


def _holder(need: LogSource, k: int, reports: Mapping[int, Position], new_plan: PlanLike,
            workers: WorkerMap) -> int | None:
    """The live rank to take ``need`` from: the new receiver itself if it holds it, else the sender, else any
    other receiver (lowest rank first)."""
    grad, stage, mb = need
    sender_stage = stage + 1 if grad else stage - 1
    receiver = workers.rank_of(new_plan.worker_of(stage, mb))
    senders = [q for q, r in reports.items() if r.stage == sender_stage and (k, grad, False, mb) in r.logs]
    receivers = [q for q, r in reports.items() if r.stage == stage and (k, grad, True, mb) in r.logs]
    if receiver in receivers:
        return receiver
    if senders:
        return min(senders)
    return min(receivers) if receivers else None
