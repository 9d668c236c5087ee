"""``FailureHandler``: the engine's driver under ``ds-recycle launch``, so a user's own loop survives failures.

``ds_recycle.initialize`` attaches one to the engine when the launcher's store (which outlives every worker)
is there; ``engine.train_batch()``, ``eval_batch``, checkpoints and ``finish`` then run through
:meth:`FailureHandler.run`, the one place a failure is caught. The engine's transfers run on per-epoch gloo
groups whose waits a dead peer cannot hang (:mod:`ds_recycle.resilience.transport`); the watchdog is the one
failure detector (:mod:`ds_recycle.resilience.watchdog`).

On a :class:`~ds_recycle.resilience.errors.PeerFailure` the handler goes through the phases of
:mod:`ds_recycle.resilience.phases` (its :attr:`~FailureHandler.state` names the one it is in): every survivor
reports where it stands and agrees on the live members; builds the next epoch's groups; takes the plan for the
new failure set from a :class:`~ds_recycle.plan.PlanCache` and decides the repair of the interrupted iteration
(:mod:`ds_recycle.resilience.salvage`): stages that stepped it run nothing of it again and serve what their
neighbours need from their boundary logs, the others keep the weight gradients the survivors finished and run
the rest. Nothing is rolled back and nothing is copied on the failure-free path. A restarted worker joins the
members at an iteration boundary (:mod:`ds_recycle.resilience.rejoin`); a lost stage falls back to the
checkpoint (:mod:`ds_recycle.resilience.fallback`).

The handler changes the engine only through its hook surface (:mod:`ds_recycle.engine.driver`). Each step is
an event (:mod:`ds_recycle.events`; ``engine.recycle_events()`` drains them), and the time from the kill to the
first full iteration after it is recorded with its breakdown.
"""
from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.schedule import PipeInstruction

from ds_recycle.config.job import JobConfig
from ds_recycle.engine.engine import RecyclePipelineEngine
from ds_recycle.engine.position import Position
from ds_recycle.engine.state import cpu_state_dict, merge_in_layer_order
from ds_recycle.events import (
    AgreementEvent,
    CheckpointEvent,
    Event,
    FailureEvent,
    FallbackEvent,
    PlanSwitchEvent,
    RecoveredEvent,
    RejoinEvent,
    ResumedEvent,
    RollForwardEvent,
    StageLostEvent,
    parse_event,
)
from ds_recycle.plan import CostModel, PlanCache, StageLostError
from ds_recycle.resilience import checkpoint as ckpt
from ds_recycle.resilience.accelerator import workers_per_gpu
from ds_recycle.resilience.comm import Detector
from ds_recycle.resilience.errors import JobClosed, MembershipError, PeerFailure
from ds_recycle.resilience.fallback import (
    carried_events,
    carry_events,
    fallback_directory,
    hand_over_directory,
    request_restart_all,
)
from ds_recycle.resilience.faults import Phase
from ds_recycle.resilience.heartbeat import Heartbeat
from ds_recycle.resilience.injection import Faults, faults_of, slowdowns_of
from ds_recycle.resilience.nccl import epoch_device
from ds_recycle.resilience.phases import (
    Agreement,
    Epoch,
    HandlerState,
    Job,
    agree,
    detect,
    end_barrier,
    end_start_up,
    hold_failed,
    install,
    regroup,
    rerouted,
    shrink_failed,
)
from ds_recycle.resilience.rejoin import (
    JoinTicket,
    decide_requests,
    file_request,
    read_request,
    stage_sources,
    transfer_stage_state,
    wait_for_ticket,
    write_tickets,
)
from ds_recycle.resilience.repartition import Repartitioner, layer_costs_of, settle_move
from ds_recycle.resilience.replan import Replanner
from ds_recycle.resilience.salvage import Decision, decide
from ds_recycle.resilience.speed import SpeedWatch
from ds_recycle.resilience.store import StoreKeys, connect_store, incarnation
from ds_recycle.resilience.transport import LossRider
from ds_recycle.resilience.watchdog import Watchdog
from ds_recycle.runtime.job_store import request_start_up_restart

__all__ = ["FailureHandler"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _FailureCheck:
    """The production hooks: before each instruction, the watchdog's flag (a busy survivor learns of a failure
    at its next instruction, not at its next wait)."""

    def __init__(self, detector: Detector) -> None:
        self.detector = detector

    def before_instruction(self, instruction: PipeInstruction) -> None:
        if self.detector.failed():
            raise PeerFailure("a member exited (seen between instructions)")

    def before_step(self) -> None:
        return None


@dataclass(frozen=True)
class _Recovery:
    """A recovery under way: its phase times, until the first full iteration after it ends."""

    killed_at: float | None
    detected_at: float
    agreement_s: float
    regroup_s: float
    plan_lookup_s: float
    restore_s: float
    restored_at: float
    decision: Decision
    rolled_forward_bytes: int
    shrunk_groups: tuple[str, ...]

    def event(self, now: float) -> RecoveredEvent:
        d = self.decision
        start = self.killed_at or self.detected_at
        return RecoveredEvent(
            failure_to_full_iteration_s=now - start, killed_at=self.killed_at, detected_at=self.detected_at,
            detection_s=self.detected_at - self.killed_at if self.killed_at is not None else None,
            agreement_s=self.agreement_s, regroup_s=self.regroup_s, plan_lookup_s=self.plan_lookup_s,
            restore_s=self.restore_s, redo_s=now - self.restored_at, repair_iteration=d.iteration,
            committed_stages=tuple(sorted(d.committed)), dropped_stages=tuple(sorted(d.dropped)),
            kept_weight_gradients=d.kept_weight_gradients, tensors_from_logs=d.from_logs,
            rolled_forward_bytes=self.rolled_forward_bytes, completed_steps=len(d.repair.completing),
            shrunk_groups=self.shrunk_groups)


class FailureHandler:
    """The failure handler of one engine (see the module docstring)."""

    def __init__(self, engine: RecyclePipelineEngine, cfg: JobConfig, rejoining: bool = False) -> None:
        rc = cfg.recycle
        self.cfg, self.engine = cfg, engine
        self.state = HandlerState.STARTING
        """The phase the handler is in (:class:`~ds_recycle.resilience.phases.HandlerState`)."""
        store = connect_store(timeout_s=rc.failure_timeout_s)
        generation = int(store.add(ckpt.GENERATION_KEY, 0))
        keys = StoreKeys(root=f"ds_recycle/gen{generation}") if generation else StoreKeys()
        rank = engine.global_rank
        self.heartbeat = Heartbeat(lambda: connect_store(timeout_s=rc.failure_timeout_s), rank, keys=keys).start()
        watchdog = Watchdog(lambda: connect_store(timeout_s=rc.failure_timeout_s), rank, rc.heartbeat_stale_s,
                            keys=keys, caller_store=store).start()
        self.job = Job(store, keys, rank, generation, rc.failure_timeout_s, watchdog, engine.workers, engine.stage_id,
                       tuple(engine.tied), epoch_device(rc.transport, engine.device, workers_per_gpu()))
        costs = CostModel.from_file(rc.costs_file) if rc.costs_file else CostModel.uniform(rc.stages)
        self.plans = PlanCache(rc.stages, rc.pipelines, cfg.micro_batches, costs, schedule=rc.schedule,
                               optimizer=rc.optimizer_step, memory_limit=rc.memory_limit)
        slow = rc.fail_slow
        speed = SpeedWatch(slow) if slow.enabled else None

        def cache(measured: CostModel) -> PlanCache:
            return PlanCache(rc.stages, rc.pipelines, cfg.micro_batches, measured, schedule=rc.schedule,
                             optimizer=rc.optimizer_step, memory_limit=rc.memory_limit)
        self.replanner = Replanner(self.plans, speed, rc.measure_costs and not rc.costs_file, cache)
        """Plan switches from the job's measurements (:mod:`ds_recycle.resilience.replan`)."""
        self.repartitioner = Repartitioner(
            rc.repartition, layer_costs_of(engine.module._layer_specs, engine.base_parts, costs, rc.repartition),
            engine.base_parts, cfg.micro_batches, {"optimizer": rc.optimizer_step, "memory_limit": rc.memory_limit},
            store, keys.root, self._check_alive, self._in_move)
        """Layers moved between stages while a failure lasts (:mod:`ds_recycle.resilience.repartition`)."""
        self.round = 0
        """The latest agreement round (membership epoch): one per failure handled."""
        self.members: tuple[int, ...] = tuple(sorted(engine.workers.ranks.values()))
        """The agreed live members (joiners included once admitted)."""
        self.epoch: Epoch
        """The epoch installed in the engine."""
        self.events: list[Event] = []
        self._recovery: _Recovery | None = None
        self._target = 0
        """Iterations the training loop has asked for: a recovery brings training back to it."""
        self._finished = False
        self._final_epoch: int | None = None
        """The epoch whose members wrote the final parameters into the store (:meth:`gather_final_state`)."""
        self.rider = LossRider(lambda: int(store.add(keys.join_requests, 0)))
        """The job's count of join requests, riding on each loss broadcast."""
        self.joins_decided = 0
        """Join requests decided so far (the members agree on this count at iteration boundaries)."""
        self._join_checked: int | None = None
        self.joined_at: int | None = None
        """The iteration at which this process joined the running job (None: it started with the job)."""
        self.fallback_directory: str | None = None
        """The checkpoint directory a lost stage falls back to: the training loop sets it, and otherwise the first
        ``engine.save_checkpoint`` names it; None: no fallback."""
        self.named_by_engine = False
        """The fallback directory holds ``engine.save_checkpoint``'s checkpoints (DeepSpeed's layout)."""
        life = int(os.environ.get("DS_RECYCLE_RESTART_COUNT", "0"))
        self.faults = Faults(faults_of(cfg), engine.worker, life, store, keys, rank, engine, slowdowns_of(cfg))
        check = _FailureCheck(watchdog)
        engine.keep_boundary_log(on_host=cfg.recycle.boundary_log == "pinned_host")
        engine.attach_hooks(self.faults.hooks(check) if self.faults.armed else check)
        engine.attach_driver(self)
        if rejoining:
            self._join()
        else:
            self._install(self._found(), engine.plan)
        self.state = HandlerState.TRAINING

    def _found(self) -> Epoch:
        """The first epoch, among every rank; then the start-up is over (:func:`~ds_recycle.resilience.phases.end_start_up`).

        A member lost before that cannot be recovered from here (others may still be blocked in DeepSpeed's group
        building, which nothing guards): every rank starts again as the next generation, which the launchers carry
        out; this one leaves as lost and is started again with the others."""
        job = self.job
        try:
            epoch = regroup(job, 0, self.members, "", self.rider)
            end_start_up(job, len(self.members))
        except PeerFailure as e:
            logger.error("a member was lost during the start-up (%s): every rank starts again; leaving as lost "
                         "(exit %d)", e, ckpt.LOST_EXIT_CODE)
            request_start_up_restart(job.store, job.generation)
            self._exit(ckpt.LOST_EXIT_CODE)
        return epoch

    # ------------------------------------------------------------------ the engine's driver
    def train_batch(self) -> torch.Tensor:
        """One iteration, through any failures: its mean loss on every live rank (``engine.train_batch``)."""
        self._target = self.engine.iteration + 1
        self.run(lambda: None, "training")
        return self.engine.loss

    def run(self, action: Callable[[], T], what: str) -> T:
        """Bring training to the iteration the loop asked for, then ``action()``; a failure on the way is recovered
        from and both are run again. The one place a failure is caught."""
        while True:
            try:
                while self.engine.iteration < self._target:
                    self._iteration()
                return action()
            except PeerFailure as failure:
                logger.info("%s interrupted: %s", what, failure)
                self._recover_from(failure)

    def _recover_from(self, failure: PeerFailure) -> None:
        """Recover; a member that dies during the recovery (agreeing, building the groups) starts the next round."""
        while True:
            try:
                self._recover(failure)
                return
            except PeerFailure as again:
                logger.info("recovery interrupted: %s", again)
                failure = again

    def _iteration(self) -> None:
        if self.faults.armed:
            self.faults.fire(Phase.IDLE)
        self.engine.finish_step()
        if self.job.watchdog.failed():
            raise PeerFailure("a member exited (seen at the iteration boundary)")
        self._admit_joiners()
        for event in self.replanner.at_boundary(self.engine):
            self._event(event)
        for event in self.repartitioner.at_boundary(self.engine, self.round, self.members):
            self._event(event)
        self.engine.run_iteration()
        self._note_recovered()

    def _in_move(self, point: str) -> None:
        """A layer move reached ``point`` (``received``, ``agreed``): where faults can be aimed."""
        self.faults.fire(Phase.LAYER_MOVE if point == "received" else Phase.LAYER_MOVED)

    def _settle_move(self, positions: Mapping[int, Position]) -> None:
        """A failure inside a layer move: complete it here if some survivor installed it, else drop it."""
        try:
            action = settle_move(positions, self.job.rank)
        except RuntimeError as e:
            self._fall_back(e)
        if action == "complete":
            self.engine.complete_move()
            logger.warning("layer move to %s completed in the recovery (another member had installed it)",
                           list(self.engine.partition))
        elif action == "drop":
            self.engine.drop_move()
            logger.warning("layer move dropped in the recovery (no member had installed it): staying on %s",
                           list(self.engine.partition))

    def _check_alive(self) -> None:
        if self.job.watchdog.failed():
            raise PeerFailure("a member exited (seen while waiting at an iteration boundary)")

    def drain_events(self) -> list[Event]:
        """The events (failure, agreement, plan switch, recovery, rejoin, ...) since the last call."""
        events, self.events = self.events, []
        return events

    def _event(self, event: Event) -> None:
        self.events.append(event)
        logger.warning("event %s", json.dumps(event.to_dict()))

    def _install(self, epoch: Epoch, plan: Any, reporter: int | None = None) -> None:
        old = getattr(self, "epoch", None)
        self.epoch = epoch
        if old is not None and old.comm is not epoch.comm:  # (after a failure it was retired already)
            old.comm.retire()
        self.rider.value = None  # a new epoch: the count comes with its first loss broadcast
        self.replanner.reset()  # every member of the new epoch starts from the configured costs, alike
        install(self.engine, epoch, plan, reporter)

    # ------------------------------------------------------------------ recovery
    def _recover(self, failure: PeerFailure) -> None:
        """The phases of :mod:`ds_recycle.resilience.phases`, from the failure to the repaired iteration's start."""
        job, eng = self.job, self.engine
        self.state = HandlerState.DETECTED
        detection = detect(failure, job.watchdog, self.round, self.members)
        if hasattr(self, "epoch"):  # NCCL: every survivor aborts the failed epoch's communicators first (or keeps
            hold_failed(self.epoch, self.cfg.recycle.nccl_shrink)  # them to shrink once it knows who is lost)
        self._join_checked = None  # every member checks for joiners again at the boundary it repairs
        self.round += 1
        eng.settle_step()  # a step already taken is complete here, with nothing left to wait for
        self.state = HandlerState.AGREEING
        try:
            agreement = agree(job, detection, eng.position())
        except MembershipError as e:  # fenced out by the others: leave, a restart can join again
            logger.error("%s; leaving as lost (exit %d)", e, ckpt.LOST_EXIT_CODE)
            self._exit(ckpt.LOST_EXIT_CODE)
        shrunk = shrink_failed(job, getattr(self, "epoch", None), agreement, self.cfg.recycle.nccl_shrink)
        self._event(FailureEvent(lost_ranks=agreement.lost, lost_workers=tuple(
            job.workers.worker_of_rank(q) for q in agreement.lost), reason=detection.reason, epoch=agreement.epoch))
        self.members = agreement.members
        self._settle_move(agreement.positions)
        self.state = HandlerState.REGROUPING
        epoch = regroup(job, agreement.epoch, agreement.members, "", self.rider, shrunk=shrunk)
        regrouped = time.time()
        self.state = HandlerState.DECIDING
        try:
            plan = self.plans.get(epoch.workers.absent())
        except StageLostError as e:
            self._fall_back(e)
        planned = time.time()
        # A plan that moved a slow worker's own micro-batches to its peers keeps that pipeline's gradients in rows
        # per micro-batch, which the new plan (normal speeds) sums in one row: its partial sums are redone, not kept.
        offloaded = bool(getattr(getattr(eng.plan, "costs", None), "slow", ()))
        decision = decide(agreement.positions, plan, epoch.workers, salvage=self.cfg.recycle.salvage and not offloaded,
                          tied_stages=[frozenset(t.stages) for t in job.tied])
        self._event(AgreementEvent(members=agreement.members, epoch=agreement.epoch,
                                   repair_iteration=decision.iteration,
                                   committed_stages=tuple(sorted(decision.committed))))
        if decision.unrecoverable:
            self._fall_back(RuntimeError(f"iteration {decision.iteration} cannot be repaired: "
                                         f"{decision.unrecoverable}"))
        self.state = HandlerState.INSTALLING
        kept = eng.keep_work(completing=job.rank in decision.repair.completing)
        self._install(epoch, plan)
        self._event(PlanSwitchEvent(absent=tuple(sorted(epoch.workers.absent())), rerouted=rerouted(plan)))
        moved = self._roll_forward(decision, agreement)
        eng.begin_repair(kept, decision.repair, decision.iteration, committed=eng.stage_id in decision.committed,
                         dropped=eng.stage_id in decision.dropped)
        restored = time.time()
        killed_at = agreement.killed_at if agreement.killed_at is not None else (
            self._recovery.killed_at if self._recovery is not None else None)
        self._recovery = _Recovery(killed_at, detection.detected_at, agreement.agreed_at - detection.detected_at,
                                   regrouped - agreement.agreed_at, planned - regrouped, restored - planned, restored,
                                   decision, moved, epoch.comm.shrunk_roles)
        self.state = HandlerState.RESUMING
        logger.warning("recovered from the loss of ranks %s: members %s, repairing iteration %d (stages %s had "
                       "stepped it)", list(agreement.lost), list(agreement.members), decision.iteration,
                       sorted(decision.committed))

    def _roll_forward(self, decision: Decision, agreement: Agreement) -> int:
        """Replicas of a committed stage that had not taken the step get the state of one that had (rare)."""
        stage, rank = self.engine.stage_id, self.job.rank
        src = decision.roll_forward.get(stage)
        if src is None:
            return 0
        behind = agreement.positions[rank].stepped < decision.iteration and rank not in decision.repair.completing
        moved = transfer_stage_state(self.epoch.comm, src, rank, self.engine, load=behind, carry_progress=True)
        self._event(RollForwardEvent(stage=stage, source=src, iteration=decision.iteration, state_bytes=moved))
        return moved

    def _note_recovered(self) -> None:
        """After an iteration: if it was the first full one after a failure, record the recovery."""
        rec, self._recovery = self._recovery, None
        if rec is not None:
            self._event(rec.event(time.time()))
            self.state = HandlerState.TRAINING

    def _fall_back(self, error: Exception) -> NoReturn:
        """Re-routing or repair is impossible (a stage lost, a tensor no live worker holds): restart the whole job
        from the latest checkpoint (never returns)."""
        self.state = HandlerState.FALLING_BACK
        job = self.job
        if self.fallback_directory is None:
            self._event(StageLostEvent(reason=str(error)))
            logger.error("cannot re-route (%s) and there is no checkpoint to fall back to (no --checkpoint-dir): "
                         "this worker leaves as lost (exit %d)", error, ckpt.LOST_EXIT_CODE)
            self._exit(ckpt.LOST_EXIT_CODE)
        self._event(FallbackEvent(reason=str(error), generation=job.generation + 1, directory=self.fallback_directory))
        logger.error("cannot re-route (%s): falling back to the latest checkpoint in %s; this worker leaves as lost "
                     "(exit %d) and the launcher starts every rank again", error, self.fallback_directory,
                     ckpt.LOST_EXIT_CODE)
        carry_events(job.store, job.generation + 1, job.rank == min(self.members), [e.to_dict() for e in self.events])
        if self.named_by_engine:  # the restarted script may not load it itself: ds_recycle.initialize will
            hand_over_directory(job.store, job.generation + 1, self.fallback_directory)
        job.store.compare_set(ckpt.GENERATION_KEY, str(job.generation), str(job.generation + 1))
        request_restart_all(job.store, job.generation + 1)
        self._exit(ckpt.LOST_EXIT_CODE)

    # ------------------------------------------------------------------ rejoin
    def _admit_joiners(self) -> None:
        """At an iteration boundary: let in the restarted workers whose join requests the members agree on.

        Not while an interrupted iteration is being repaired (every member has the repair): its schedule is
        fixed for the members that made it; joiners come in at the next boundary.
        """
        job, eng = self.job, self.engine
        boundary = eng.iteration
        if self._join_checked == boundary or eng.repair is not None or self.rider.value is None:
            return  # (no count yet in this epoch: the next iteration's loss broadcast brings one)
        self._join_checked = boundary
        upto = self.rider.value  # the same on every member: it came with the last iteration's loss
        if upto <= self.joins_decided:
            return
        self.state = HandlerState.ADMITTING
        started = time.time()
        accepted = decide_requests(job.store, job.keys, upto, self.joins_decided, self.members,
                                   sorted(job.workers.ranks.values()))
        joining = sorted(accepted.values())
        previous, after = list(self.members), self.joins_decided
        self.joins_decided = upto
        members = tuple(sorted(previous + joining))
        if job.rank == min(previous):
            write_tickets(job.store, job.keys, upto, after, accepted, self.round, members, boundary, eng.reporter_rank)
        if joining:
            back = self.repartitioner.restore(eng, self.plans.get(eng.workers.absent()))
            if back is not None:  # the joiner's module holds the job's own partition
                self._event(back)
            # Joins do not count as agreement rounds: a failure in the middle of one sends every member to the same
            # next round, whether it had finished the join or not. Their groups carry the join count.
            self.members = members
            known = {q: read_request(job.store, job.keys, n)[1] for n, q in accepted.items()}
            epoch = regroup(job, self.round, members, f"j{upto}", self.rider, known)
            connected = time.time()
            self._install(epoch, self.plans.get(epoch.workers.absent()))
            sources = stage_sources(previous, joining, lambda q: job.workers.worker_of_rank(q)[1])
            moved = 0
            if eng.stage_id in sources:
                moved = transfer_stage_state(epoch.comm, sources[eng.stage_id], job.rank, eng, load=False)
            self._event(RejoinEvent(ranks=tuple(joining), workers=tuple(job.workers.worker_of_rank(q) for q in joining),
                                    iteration=boundary, members=members, join_s=time.time() - started,
                                    regroup_s=connected - started, state_bytes=moved))
            self._event(PlanSwitchEvent(absent=tuple(sorted(epoch.workers.absent())), rerouted=rerouted(eng.plan)))
            logger.warning("ranks %s joined at iteration %d: members %s", joining, boundary, list(members))
        self.state = HandlerState.TRAINING

    def _join(self) -> None:
        """This process replaces a lost worker: ask the members in, take the stage's state, start at a boundary."""
        self.state = HandlerState.JOINING
        job = self.job
        started = time.time()
        number = file_request(job.store, job.keys, job.rank, incarnation(job.store, job.keys, job.rank))
        self.faults.fire_join(Phase.JOIN_REQUEST)
        try:
            ticket = wait_for_ticket(job.store, job.keys, number, job.timeout_s, self._fell_back)
        except JobClosed as e:
            self._leave_unjoined(str(e))
        if not ticket.accepted:
            self._leave_unjoined(f"join request {number} {ticket.reason}")
        try:
            self._enter(ticket, started)
        except PeerFailure as e:  # a member died while this one joined: the others will regroup without it
            logger.error("join failed: %s; leaving as lost (exit %d)", e, ckpt.LOST_EXIT_CODE)
            self._exit(ckpt.LOST_EXIT_CODE)

    def _enter(self, ticket: JoinTicket, started: float) -> None:
        job, eng = self.job, self.engine
        self.round, self.members, self.joins_decided = ticket.epoch, tuple(ticket.members), ticket.admitted_upto
        self.faults.fire_join(Phase.JOIN_GROUPS)
        epoch = regroup(job, self.round, self.members, f"j{ticket.admitted_upto}", self.rider)
        self._install(epoch, self.plans.get(epoch.workers.absent()), reporter=ticket.reporter)
        previous = [q for q in ticket.members if q not in ticket.joining]
        src = stage_sources(previous, ticket.joining, lambda q: job.workers.worker_of_rank(q)[1])[eng.stage_id]
        self.faults.fire_join(Phase.JOIN_TRANSFER)
        moved = transfer_stage_state(epoch.comm, src, job.rank, eng, load=True)
        if eng.iteration != ticket.iteration:
            raise RuntimeError(f"state from rank {src} is at iteration {eng.iteration}, "
                               f"the ticket says {ticket.iteration}")
        self._join_checked = self.joined_at = self._target = self.faults.joined_at = ticket.iteration
        self._event(RejoinEvent(ranks=(job.rank,), workers=(eng.worker,), iteration=ticket.iteration,
                                members=self.members, join_s=time.time() - started, state_bytes=moved))
        logger.warning("joined the running job at iteration %d (epoch %d, members %s, %d bytes of state from "
                       "rank %d)", ticket.iteration, self.round, list(self.members), moved, src)

    def _fell_back(self) -> str | None:
        if int(self.job.store.add(ckpt.GENERATION_KEY, 0)) != self.job.generation:
            return "the job fell back to its checkpoint"
        return None

    def _leave_unjoined(self, why: str) -> NoReturn:
        """Leave without having joined: finished if training is over, lost otherwise (a restart may follow)."""
        closed = self.job.store.check([self.job.keys.join_closed]) and self._fell_back() is None
        code = 0 if closed else ckpt.LOST_EXIT_CODE
        logger.warning("not joining: %s; leaving (exit %d)", why, code)
        self._exit(code)

    def _exit(self, code: int) -> NoReturn:
        self.heartbeat.stop()
        self.job.watchdog.stop()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str, next_iteration: int, write: Callable[[], None] | None = None,
                        latest: Callable[[], None] | None = None, named_by_engine: bool = False) -> None:
        """Each stage's first live replica writes its state; ``latest`` is written once all are complete.

        ``write``/``latest``: the writers (default: ds_recycle's own layout, :mod:`ds_recycle.resilience.checkpoint`).
        ``named_by_engine``: ``engine.save_checkpoint`` calls it (a lost stage then falls back to these files).
        """
        if self.joined_at is not None and next_iteration <= self.joined_at:
            return  # a joiner's loop catching up: the members saved this one before they let it in
        if named_by_engine and self.fallback_directory is None:
            self.fallback_directory, self.named_by_engine = directory, True
        eng, rank = self.engine, self.job.rank

        def save() -> None:
            eng.finish_step()  # the saved step must be final (post-validation)
            back = self.repartitioner.restore(eng, self.plans.get(eng.workers.absent()), again=True)
            if back is not None:  # the files are the job's own partition's, as DeepSpeed's loader needs
                self._event(back)
            if rank == self.epoch.workers.stage_ranks(eng.stage_id)[0]:
                write() if write is not None else ckpt.save_stage(eng, directory, next_iteration)
            self.epoch.transport.barrier("checkpoint barrier")
            if rank == min(self.members):
                latest() if latest is not None else ckpt.write_latest(directory, next_iteration)
            self._event(CheckpointEvent(next_iteration=next_iteration, directory=directory))
        self.run(save, "checkpoint")

    @property
    def generation(self) -> int:
        """How many times the job fell back to a checkpoint."""
        return self.job.generation

    def resume_directory(self) -> str | None:
        """After a fallback (generation > 0): the checkpoint directory the job fell back to (None otherwise)."""
        return fallback_directory(self.job.store, self.job.generation)

    def load_checkpoint(self, directory: str) -> int | None:
        """Resume from ds_recycle's own layout in ``directory``; the iteration training goes on at."""
        if self.joined_at is not None:  # state came from a live replica, newer than any checkpoint
            self.engine.resume_calls_at(self.joined_at)  # the loop resumes where the job is: no calls to catch up
            return self.joined_at
        start = ckpt.load_stage(self.engine, directory)
        self.resumed_at(start, directory)
        return start

    def resumed_at(self, start: int | None, directory: str) -> None:
        """A resume from ``directory``: training goes on at iteration ``start`` (None: no checkpoint was there).

        The events carried over a fallback are put back in front, so the metrics keep one record.
        """
        if start is not None:
            self._target = start
            self.engine.resume_calls_at(start)
        carried = [parse_event(e) for e in carried_events(self.job.store, self.job.generation)]
        self.events = carried + self.events
        self._event(ResumedEvent(iteration=start or 0, generation=self.job.generation, directory=directory,
                                 checkpoint_found=start is not None))

    # ------------------------------------------------------------------ end of training
    def finish(self, keep_final_state: bool = False) -> None:
        """Training is over: the last step is final on every member (recovering from failures on the way).

        The members agree on it through the store (:func:`~ds_recycle.resilience.phases.end_barrier`), so a member
        that dies once all have arrived leaves the others done, and one that dies before makes every survivor
        recover and finish again. ``keep_final_state``: each stage's first member also writes its final
        parameters to the store before it arrives, so they are there whoever dies afterwards.
        """
        if self._finished:
            return
        self.job.store.set(self.job.keys.join_closed, "1")  # a restarted worker has nothing to join any more

        def done() -> None:
            self.faults.fire(Phase.END_OF_TRAINING)
            self.engine.finish_local()
            epoch = self.epoch
            if keep_final_state:
                self._write_final_stage(epoch)
            end_barrier(self.job, epoch.number, len(epoch.members))
        self.run(done, "end of training")
        self._finished = True
        self.faults.fire(Phase.ENDED)
        st, log = self.engine.stepper, self.engine.boundary_log
        logger.info("optimizer steps: %d, clipped %d; boundary log peak %d bytes", self.engine.global_steps,
                    st.clipped_steps, log.peak_bytes if log is not None else 0)

    def _write_final_stage(self, epoch: Epoch) -> None:
        stage = self.engine.stage_id
        if self.job.rank == epoch.workers.stage_ranks(stage)[0]:
            buf = io.BytesIO()
            torch.save(cpu_state_dict(self.engine.module), buf)
            key = self.job.keys.final_stage(epoch.number, stage)
            self.job.store.set(key, buf.getvalue())  # type: ignore[arg-type]  # the store takes bytes too
        self._final_epoch = epoch.number

    def gather_final_state(self) -> dict[str, torch.Tensor] | None:
        """Every stage's parameters on the reporter, through the store (valid whatever groups died)."""
        if not self._finished:
            self.finish(keep_final_state=True)
        elif self._final_epoch is None:  # finished earlier: the stages write now
            self._write_final_stage(self.epoch)
        if self.job.rank != self.engine.reporter_rank:
            return None
        assert self._final_epoch is not None
        keys, epoch = self.job.keys, self._final_epoch
        return merge_in_layer_order(torch.load(io.BytesIO(self.job.store.get(keys.final_stage(epoch, s))),
                                               weights_only=True) for s in range(self.epoch.workers.stages))

    def close(self) -> None:
        """Release the job's groups. No collective of the epoch runs after the end of training: a member that dies
        now cannot fail the others, which leave as they would have."""
        self.finish()
        self.state = HandlerState.CLOSED
        self.epoch.comm.retire()  # NCCL: its communicators aborted, which needs no peer (a destroy would)
        if self.round == 0 and self.joined_at is None:
            self.heartbeat.stop()
            self.job.watchdog.stop()
            if dist.is_initialized():
                try:
                    dist.barrier()
                except RuntimeError as e:  # a member died after the end of training: the work is done
                    logger.warning("a member left after the end of training (%s): leaving without tearing down "
                                   "the groups", e)
                    self._exit(0)
                dist.destroy_process_group()
            return
        # The WORLD group still references a dead peer (or is detached): tearing it down could abort; leave.
        self._exit(0)
