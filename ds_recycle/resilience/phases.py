"""The phases of a recovery, as functions over frozen values, and the state the handler is in.

One failure, from detection to the first full iteration after it::

    DETECTED    detect(failure)                 -> Detection    the epoch is over (every member learns it)
    AGREEING    agree(detection, position)      -> Agreement    who lives, where each stood, when the kill came
    REGROUPING  regroup(number, members)        -> Epoch        the new epoch's groups, grid and transport
    DECIDING    plan lookup, salvage.decide     -> Decision     what is left of the interrupted iteration
    INSTALLING  install(epoch, plan), resume(...)               the engine runs the new plan from the repair
    RESUMING    the repaired iteration runs; its end is the ``recovered`` event

The handler (:mod:`ds_recycle.resilience.handler`) calls them in that order and holds the one mutable record
of where the job stands (its :class:`HandlerState`, the current :class:`Epoch`). Each function takes what it
needs as arguments (the store, the detector, the engine's hook surface) and returns a frozen value, so each
can be read, and its decision tested, on its own.
"""
from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_recycle.engine.driver import EpochSetup
from ds_recycle.engine.position import Position
from ds_recycle.engine.tied import TiedWeight, tied_members
from ds_recycle.resilience.comm import Detector
from ds_recycle.resilience.errors import PeerFailure
from ds_recycle.resilience.injection import kill_time
from ds_recycle.resilience.membership import agree_members
from ds_recycle.resilience.nccl import NcclEpochComm, ShrunkGroups
from ds_recycle.resilience.regroup import EpochGrid
from ds_recycle.resilience.store import StoreKeys, connect_store
from ds_recycle.resilience.transport import EpochComm, EpochTransport, LossRider
from ds_recycle.resilience.watchdog import Watchdog, run_guarded, watch_members
from ds_recycle.runtime.grid import WorkerMap
from ds_recycle.runtime.job_store import started_key

__all__ = ["Agreement", "Detection", "Epoch", "HandlerState", "Job", "agree", "detect", "end_barrier", "end_start_up",
           "install", "regroup"]

logger = logging.getLogger(__name__)

END_DONE, END_FAILED = "done", "failed"
"""The outcomes of an epoch's end of training (:func:`end_barrier`)."""


class HandlerState(enum.Enum):
    """Where the failure handler is (one at a time; :attr:`FailureHandler.state`)."""

    STARTING = "starting"
    """Building the first epoch's groups."""
    JOINING = "joining"
    """A restarted worker asking the members in, then taking its stage's state."""
    TRAINING = "training"
    """Running iterations: the steady state."""
    ADMITTING = "admitting"
    """At an iteration boundary, letting restarted workers in."""
    DETECTED = "detected"
    """A failure was seen: the epoch is over."""
    AGREEING = "agreeing"
    """Agreeing with the survivors on the members and reporting where this worker stood."""
    REGROUPING = "regrouping"
    """Building the new epoch's groups among the members."""
    DECIDING = "deciding"
    """Taking the plan for the new failure set and deciding the repair of the interrupted iteration."""
    INSTALLING = "installing"
    """Installing the epoch, the plan and the repair in the engine (and rolling a replica forward)."""
    RESUMING = "resuming"
    """Running the repaired iteration; its end is the first full iteration after the failure."""
    FALLING_BACK = "falling_back"
    """A stage is lost: handing over to the checkpoint, then leaving."""
    CLOSED = "closed"
    """Training is over."""


@dataclass(frozen=True)
class Job:
    """What every phase needs to know of the job and of this worker (fixed for the life of the process)."""

    store: dist.Store
    keys: StoreKeys
    rank: int
    generation: int
    """How many times the job fell back to a checkpoint; names this incarnation's groups."""
    timeout_s: float
    watchdog: Watchdog
    workers: WorkerMap
    """Every worker of the job and its rank, live or not (a restarted rank runs the same worker)."""
    stage: int
    tied: tuple[TiedWeight, ...]
    nccl_device: torch.device | None = None
    """The GPU whose NCCL communicators the epochs use (``recycle.transport: "nccl"``); None: gloo groups."""

    def workers_of(self, members: Sequence[int]) -> WorkerMap:
        """The job's workers restricted to ``members``."""
        return WorkerMap(self.workers.stages, self.workers.pipelines,
                         {w: r for w, r in self.workers.ranks.items() if r in members})


@dataclass(frozen=True)
class Detection:
    """The end of an epoch, as this worker saw it."""

    epoch: int
    """The epoch that ended."""
    members: tuple[int, ...]
    """Its members."""
    detected_at: float
    reason: str


@dataclass(frozen=True)
class Agreement:
    """The survivors' common view after a failure."""

    epoch: int
    """The new epoch."""
    members: tuple[int, ...]
    lost: tuple[int, ...]
    positions: Mapping[int, Position]
    """Where each member stood (:mod:`ds_recycle.resilience.salvage` decides from them)."""
    killed_at: float | None
    """When the earliest injected kill among the lost came (None: not injected)."""
    agreed_at: float


@dataclass(frozen=True)
class Epoch:
    """One membership epoch of this worker: its members, groups, grid and transport."""

    number: int
    members: tuple[int, ...]
    workers: WorkerMap
    comm: EpochComm
    grid: EpochGrid
    transport: EpochTransport


def detect(failure: PeerFailure, detector: Detector, epoch: int, members: Sequence[int]) -> Detection:
    """The epoch ended: why, in the failure's own words and the detector's finding when they lack it (a wait may
    have seen only the group that another member's watchdog broke)."""
    text = str(failure)
    reason = detector.reason() if detector.tripped() else ""
    if reason and reason not in text:
        text = f"{text}; watchdog: {reason}"
    return Detection(epoch, tuple(members), time.time(), text)


def agree(job: Job, detection: Detection, position: Position) -> Agreement:
    """Report ``position``, agree on the members of the next epoch, read every member's position.

    Raises :class:`~ds_recycle.resilience.errors.MembershipError` when the others fenced this worker out.
    """
    epoch = detection.epoch + 1
    # Members already waiting at the end of training of the failed epoch learn of the recovery from the store (no
    # group of theirs is involved there): the end, not decided yet, has failed.
    job.store.compare_set(job.keys.end_outcome(detection.epoch), "", END_FAILED)
    job.store.set(job.keys.report(epoch, job.rank), position.to_json())
    members = agree_members(job.store, epoch, job.rank, detection.members, job.watchdog.dead,
                            timeout_s=job.timeout_s, keys=job.keys)
    agreed = time.time()
    positions = {q: Position.from_json(job.store.get(job.keys.report(epoch, q))) for q in members}
    lost = tuple(sorted(set(detection.members) - set(members)))
    kills = [t for t in (kill_time(job.store, job.keys, q) for q in lost) if t is not None]
    return Agreement(epoch, tuple(members), lost, positions, min(kills) if kills else None, agreed)


def hold_failed(epoch: Epoch, shrink: bool) -> None:
    """The epoch failed: retire it (NCCL: abort its communicators), or keep it for :func:`shrink_failed` where
    ``shrink`` (``recycle.nccl_shrink``) asks for it and its communicators can be shrunk."""
    if shrink and isinstance(epoch.comm, NcclEpochComm):
        epoch.comm.hold()
    else:
        epoch.comm.retire()


def shrink_failed(job: Job, epoch: Epoch | None, agreement: Agreement, shrink: bool) -> ShrunkGroups | None:
    """The members agreed on who is lost: the failed ``epoch``'s NCCL communicators without them, for the next epoch
    to take, where ``shrink`` (``recycle.nccl_shrink``) asks for it; the epoch is retired in any case (None: this
    member had none, its first groups never built).

    Every member answers two questions through the store: does it still have its epoch (only if all do does any
    start a shrink, which is collective: :meth:`~ds_recycle.resilience.nccl.NcclEpochComm.shrink`), and did every
    shrink work (only if all did are the shrunk communicators kept, so that the next epoch takes them on all members
    or on none). A member lost meanwhile makes the answer no; the regroup that follows meets the loss."""
    if job.nccl_device is None or not shrink:
        if epoch is not None:
            epoch.comm.retire()
        return None

    def gone(missing: Sequence[int]) -> str | None:  # the watchdog watches the failed epoch still: ask it by member
        dead = [q for q in missing if job.watchdog.dead(q)]
        return f"rank(s) {dead} lost since the agreement" if dead else None

    def all_say_yes(question: str, yes: bool) -> bool:
        try:
            return all_say(job, question, agreement.epoch, agreement.members, yes, gone)
        except PeerFailure as e:
            logger.warning("epoch %d: %s; its communicators are built, not shrunk", agreement.epoch, e)
            return False
    if epoch is None or not isinstance(epoch.comm, NcclEpochComm):
        all_say_yes("kept", False)
        all_say_yes("done", False)
        return None
    shrunk = epoch.comm.shrink(agreement.lost, lambda kept: all_say_yes("kept", kept))
    if all_say_yes("done", shrunk is not None):
        return shrunk
    if shrunk is not None:
        logger.warning("epoch %d: not every member shrank the failed epoch's communicators; building new ones",
                       agreement.epoch)
        shrunk.discard()
    return None


def all_say(job: Job, question: str, number: int, members: Sequence[int], yes: bool,
            gone: Callable[[Sequence[int]], str | None], poll_s: float = 0.001) -> bool:
    """Answer ``question`` (about shrinking into epoch ``number``) with ``yes`` and wait for every member's answer:
    whether all said yes. Raises :class:`~ds_recycle.resilience.errors.PeerFailure` when ``gone`` names a reason
    (given the members yet to answer) or the answers do not come within the job's timeout."""
    store, keys = job.store, job.keys
    store.set(keys.shrink_vote(question, number, job.rank), "1" if yes else "0")
    answers = {q: keys.shrink_vote(question, number, q) for q in members}
    deadline = time.monotonic() + job.timeout_s
    while not store.check(list(answers.values())):
        why = gone([q for q, key in answers.items() if not store.check([key])])
        if why is not None:
            raise PeerFailure(f"shrinking into epoch {number} ({question}): {why}")
        if time.monotonic() > deadline:
            raise PeerFailure(f"shrinking into epoch {number} ({question}): not every member answered within "
                              f"{job.timeout_s} s")
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, 0.05)
    return all(store.get(key) == b"1" for key in answers.values())


def regroup(job: Job, number: int, members: Sequence[int], tag: str, rider: LossRider,
            known: dict[int, int] | None = None, shrunk: ShrunkGroups | None = None) -> Epoch:
    """Build epoch ``number``'s groups among ``members`` (every member calls it with the same arguments).

    The watchdog watches the members from now on (``known``: restart counts of joiners, from their requests) and
    breaks the groups if one dies; a member that dies while the groups connect is a
    :class:`~ds_recycle.resilience.errors.PeerFailure`. ``shrunk``: NCCL communicators shrunk from the failed epoch
    that every member took (:func:`shrink_failed`), used for the groups they fit.
    """
    workers = job.workers_of(members)
    stage_members = workers.stage_ranks(job.stage)
    watch_members(job.watchdog, job.store, job.keys, members, known)
    holders = {t.name: tied_members(t, workers.stage_ranks) for t in job.tied}
    # Its own store client: a connection abandoned while it waits for a dead member must not block this one.
    store = connect_store(timeout_s=job.timeout_s)
    label = f"g{job.generation}{tag}"
    device = job.nccl_device

    def build() -> EpochComm:
        if device is None:
            return EpochComm.build(store, number, list(members), stage_members, job.rank, job.timeout_s, job.watchdog,
                                   label, holders)
        return NcclEpochComm.build_nccl(store, number, list(members), stage_members, job.rank, job.timeout_s,
                                        job.watchdog, device, label, holders, shrunk=shrunk)
    try:
        comm = run_guarded(build, job.watchdog, job.timeout_s, f"building epoch {number}{tag}")
    except RuntimeError as e:  # a member died while the groups were being connected
        if shrunk is not None:  # what the build did not take
            shrunk.discard()
        raise PeerFailure(f"building the groups of epoch {number}: {e}") from e
    # Waits block in gloo from here on: a trip of the watch breaks every group of the epoch (NCCL's waits poll it).
    job.watchdog.guard(comm.groups)
    grid = EpochGrid(workers, job.rank, comm)
    return Epoch(number, tuple(sorted(members)), workers, comm, grid, EpochTransport(comm, job.rank, rider))


def end_start_up(job: Job, members: int, poll_s: float = 0.002) -> None:
    """The first epoch is built on this rank: wait (bounded, watched) until it is on all ``members``, then mark the
    generation's start-up over (``ds_recycle/gen<g>/started``, :mod:`ds_recycle.runtime.job_store`).

    No member trains before every member has counted itself, so a rank lost once any member trains is always lost
    after the mark, and recovered from by the failure handlers; one lost before it makes every rank start again.
    Raises :class:`~ds_recycle.resilience.errors.PeerFailure` when a member dies or the wait runs out.
    """
    key = job.keys.started_count
    job.store.add(key, 1)
    deadline = time.monotonic() + job.timeout_s
    while int(job.store.add(key, 0)) < members:
        if job.watchdog.failed():
            raise PeerFailure(f"a member was lost during the start-up: {job.watchdog.reason()}")
        if time.monotonic() > deadline:
            raise PeerFailure(f"the start-up's last members did not count themselves within {job.timeout_s} s")
        time.sleep(poll_s)
    job.store.set(started_key(job.generation), "1")


def end_barrier(job: Job, epoch: int, members: int, max_poll_s: float = 0.05) -> None:
    """Training is over on this rank: arrive at epoch ``epoch``'s end of training and wait for how it ends.

    The outcome is decided once, in the store, by the first ``compare_set`` of its key: ``done`` by the last of the
    ``members`` to arrive, ``failed`` by a member whose watchdog trips (or whose wait runs out) first. Every member
    reads that one outcome, unlike the completion of a collective, which one member can see while another sees the
    collective fail: a member that dies after the last arrival cannot keep the others in training, and one that
    dies before it sends every survivor into the same recovery. Raises
    :class:`~ds_recycle.resilience.errors.PeerFailure` on ``failed``.
    """
    store, keys = job.store, job.keys
    outcome = keys.end_outcome(epoch)
    if int(store.add(keys.end_count(epoch), 1)) >= members:
        store.compare_set(outcome, "", END_DONE)
    deadline, poll_s = time.monotonic() + job.timeout_s, 0.001
    while not store.check([outcome]):
        if job.watchdog.failed() or time.monotonic() > deadline:
            store.compare_set(outcome, "", END_FAILED)
            break
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, max_poll_s)
    if store.get(outcome).decode() != END_DONE:
        cause = job.watchdog.reason() if job.watchdog.failed() else f"not every member arrived within {job.timeout_s} s"
        raise PeerFailure(f"end of training in epoch {epoch}: {cause}")


def install(engine: Any, epoch: Epoch, plan: Any, reporter: int | None = None) -> None:
    """The engine runs ``plan`` on ``epoch`` from its next instruction on (``reporter``: the rank the members
    agreed writes the metrics; None: the engine's own stays)."""
    engine.install_epoch(EpochSetup(epoch.workers, plan, epoch.grid, epoch.transport, reporter))


def rerouted(plan: Any) -> int:
    """(stage, micro-batch) pairs of an iteration that ``plan`` runs on a worker of another pipeline."""
    return sum(plan.worker_of(s, (d, i))[0] != d for s in range(plan.stages)
               for d in range(plan.pipelines) for i in range(plan.microbatches))
