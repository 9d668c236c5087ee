"""``ResilientRunner``: the failure handler a :class:`RecyclePipelineEngine` owns under ``ds-recycle launch``.

``ds_recycle.initialize`` attaches one to the engine when the launcher's store (which outlives every
worker) is there, and ``engine.train_batch()`` runs through it, so a user's own training loop survives
failures with nothing added. The engine's transfers and collectives run on per-epoch gloo groups with
bounded waits (:mod:`ds_recycle.resilience.transport`). On a
:class:`~ds_recycle.resilience.comm.PeerFailure` every survivor:

1. reports where it stands (the last step it took, what it finished of the iteration in flight, what its
   boundary log holds) and agrees on the live members (store, first writer wins);
2. builds the next epoch's groups among the members and rebuilds the grid the engine reads;
3. takes the plan for the new failure set from a :class:`~ds_recycle.plan.PlanCache`;
4. repairs the interrupted iteration: stages that stepped it run nothing of it again and serve what their
   neighbours need from their boundary logs; the others keep the weight gradients the survivors finished
   and run the rest as a repair schedule (:mod:`ds_recycle.resilience.salvage`). Nothing is rolled back and
   nothing is copied on the failure-free path.

A restarted worker joins the members at an iteration boundary (:mod:`ds_recycle.resilience.rejoin`).

Each step is an event (``kind``, ``time_s``, details; ``engine.recycle_events()`` drains them), and the
time from the kill to the first full iteration after it is recorded with its breakdown.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ds_recycle.config.job import JobConfig
from ds_recycle.engine import instructions as ins
from ds_recycle.engine.boundary_log import BoundaryLog, Role
from ds_recycle.engine.engine import IterationProgress, RecyclePipelineEngine, rerouted_pipelines, served_pipelines
from ds_recycle.engine.p2p import Channel
from ds_recycle.engine.schedule import rerouted_microbatches
from ds_recycle.engine.state import cpu_state_dict, merge_in_layer_order
from ds_recycle.engine.tied import tied_members
from ds_recycle.plan import CostModel, PlanCache, StageLostError
from ds_recycle.resilience import checkpoint as ckpt
from ds_recycle.resilience.comm import EpochGroup, PeerFailure
from ds_recycle.resilience.fallback import (
    carried_events,
    carry_events,
    fallback_directory,
    hand_over_directory,
    request_restart_all,
)
from ds_recycle.resilience.faults import JOIN_PHASES, FaultInjector, FaultSpec, Phase
from ds_recycle.resilience.heartbeat import Heartbeat, Liveness
from ds_recycle.resilience.membership import MembershipError, agree_members
from ds_recycle.resilience.regroup import EpochGrid
from ds_recycle.resilience.rejoin import (
    JobClosed,
    JoinTicket,
    decide_requests,
    file_request,
    read_request,
    stage_sources,
    transfer_stage_state,
    wait_for_ticket,
    write_tickets,
)
from ds_recycle.resilience.salvage import Decision, Report, decide
from ds_recycle.resilience.store import StoreKeys, connect_store, incarnation
from ds_recycle.resilience.transport import BoundedChannel, BoundedOptimizer, EpochComm
from ds_recycle.resilience.watchdog import Watchdog, run_guarded, watch_members
from ds_recycle.runtime.grid import WorkerMap

__all__ = ["ResilientRunner", "faults_of"]

logger = logging.getLogger(__name__)

_PHASES: dict[type, Phase] = {
    ins.ForwardMicroBatch: Phase.FORWARD, ins.BackwardInput: Phase.BACKWARD_INPUT,
    ins.BackwardWeight: Phase.BACKWARD_WEIGHT, ins.SendActivationTo: Phase.SEND, ins.SendGradTo: Phase.SEND,
    ins.RecvActivationFrom: Phase.RECEIVE, ins.RecvGradFrom: Phase.RECEIVE,
    ins.StaggeredOptimizerStep: Phase.ALL_REDUCE,
}


def faults_of(cfg: JobConfig) -> list[FaultSpec]:
    """The config's ``recycle.faults`` as fault specs."""
    return [FaultSpec(f.worker[0], f.worker[1], f.iteration, Phase(f.phase)) for f in cfg.recycle.faults]


class ResilientRunner:
    """The failure handler of one engine (see the module docstring)."""

    def __init__(self, engine: RecyclePipelineEngine, cfg: JobConfig, rejoining: bool = False) -> None:
        rc = cfg.recycle
        self.cfg = cfg
        self.engine = engine
        self.workers, self.plan = engine.workers, engine.plan
        self.rerouted = rerouted_microbatches(engine.plan)
        self._finished = False
        self._loss_work: Any = None
        self._loss_message: tuple[torch.Tensor, torch.Tensor] = (torch.zeros(2), torch.zeros(()))
        self._join_count: int | None = None
        """Join requests filed so far, as the last loss broadcast of this epoch told every member (None: none yet)."""
        self.rank = engine.global_rank
        self.store = connect_store(timeout_s=rc.failure_timeout_s)
        self.generation = int(self.store.add(ckpt.GENERATION_KEY, 0))
        """How many times the job fell back to a checkpoint; names this incarnation's store keys."""
        self.keys = StoreKeys(root=f"ds_recycle/gen{self.generation}") if self.generation else StoreKeys()
        self.heartbeat = Heartbeat(lambda: connect_store(timeout_s=rc.failure_timeout_s), self.rank,
                                   keys=self.keys).start()
        self.watchdog = Watchdog(lambda: connect_store(timeout_s=rc.failure_timeout_s), self.rank,
                                 rc.heartbeat_stale_s, keys=self.keys).start()
        self.liveness = Liveness(self.store, rc.heartbeat_stale_s, keys=self.keys, watchdog=self.watchdog)
        costs = CostModel.from_file(rc.costs_file) if rc.costs_file else CostModel.uniform(rc.stages)
        self.plans = PlanCache(rc.stages, rc.pipelines, cfg.micro_batches, costs, schedule=rc.schedule,
                               optimizer=rc.optimizer_step, memory_limit=rc.memory_limit)
        self.epoch = 0
        self.members = sorted(self.workers.ranks.values())
        self.engine.boundary_log = BoundaryLog()
        self.retired: list[Any] = []
        """Groups and channels of past epochs: kept referenced, never destroyed (peers may be blocked in them)."""
        self.events: list[dict[str, Any]] = []
        self._recovery: dict[str, Any] | None = None
        self._target = 0
        life = int(os.environ.get("DS_RECYCLE_RESTART_COUNT", "0"))
        # Faults fire in a worker's first life only: a restarted worker must not die again at the same spot.
        # Faults of a join phase fire in the life their iteration names (a joiner's admission).
        self.injector = FaultInjector([] if life else faults_of(cfg), *self.engine.worker)
        self.join_injector = FaultInjector([f for f in faults_of(cfg) if f.phase in JOIN_PHASES and f.iteration == life],
                                           *self.engine.worker)
        self.job_workers = self.workers
        """Every worker of the job and its rank, live or not (a restarted rank runs the same worker)."""
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
        if rejoining:
            self._join()
        else:
            self._install(self._build_comm(""), self.workers, self.plan)
        self.engine.loss_transport = (self._broadcast_loss, self._wait_loss)
        self._wrap_handlers()

    # ------------------------------------------------------------------ groups and engine state
    def _build_comm(self, tag: str, known: dict[int, int] | None = None) -> EpochComm:
        """The epoch's groups; ``known``: restart counts of members whose process is known (joiners)."""
        stage_members = self.workers.stage_ranks(self.engine.stage_id)
        incarnations = watch_members(self.watchdog, self.store, self.keys, self.members, known)
        self.liveness.incarnations = dict(incarnations)  # a member dying while connecting is found dead
        # Its own store client: a connection abandoned while it waits for a dead member must not block this one.
        store = connect_store(timeout_s=self.cfg.recycle.failure_timeout_s)
        try:
            comm = run_guarded(lambda: EpochComm.build(store, self.epoch, self.members, stage_members, self.rank,
                                                       self.cfg.recycle.failure_timeout_s, f"g{self.generation}{tag}"),
                               self.watchdog, self.cfg.recycle.failure_timeout_s, f"building epoch {self.epoch}{tag}")
        except RuntimeError as e:  # a member died while the groups were being connected
            raise PeerFailure(f"building the groups of epoch {self.epoch}: {e}") from e
        self._tied_groups = self._build_tied(f"e{self.epoch}g{self.generation}{tag}", store)
        # Waits block in gloo from here on: a trip of the watch breaks every group of the epoch.
        self.watchdog.guard([comm.p2p, comm.norm, comm.stage, *self._tied_groups.values()])
        comm.probe.incarnations, comm.probe.watchdog = dict(incarnations), self.watchdog
        return comm

    def _build_tied(self, prefix: str, store: Any) -> dict[str, EpochGroup]:
        """This epoch's groups over the live holders of each weight tied across stages (built by every holder)."""
        groups: dict[str, EpochGroup] = {}
        for t in self.engine.tied:
            if t.name not in groups:
                try:
                    groups[t.name] = EpochGroup(store, f"{prefix}/{t.name}", tied_members(t, self.workers.stage_ranks),
                                                self.rank, self.cfg.recycle.failure_timeout_s)
                except RuntimeError as e:
                    raise PeerFailure(f"building the tied-weight group {t.name}: {e}") from e
        return groups

    def _install(self, comm: EpochComm, workers: WorkerMap, plan: Any) -> None:
        """Point the engine at ``comm``'s groups, ``workers`` and ``plan`` (every cached reference)."""
        eng = self.engine
        self.retired.append((eng.channel, eng.stepper))
        self.comm, self.workers, self.plan = comm, workers, plan
        grid = EpochGrid(workers, self.rank, comm)
        eng.grid = eng.mpu = eng.module._grid = grid
        eng.workers, eng.plan = workers, plan
        groups = self._tied_groups
        eng.tied_transport = lambda name, tensor: comm.wait(groups[name].all_reduce_sum(tensor), "tied gradients")
        eng._schedules = [eng._make_schedule(k) for k in range(plan.iterations)]
        eng.channel = BoundedChannel(comm, workers.pipelines, eng.micro_batches)
        served, rerouted = served_pipelines(plan, eng.worker)
        old = eng.stepper
        eng.stepper = BoundedOptimizer(
            eng.module, eng.optimizer, stage=eng.stage_id, pipelines=workers.pipelines, dp_group=None,
            dp_ranks=workers.stage_ranks(eng.stage_id), norm_group=None, max_norm=old.max_norm, scope=old.scope,
            lr_scheduler=eng.lr_scheduler, served=served, stage_rerouted=rerouted,
            norm_source=min(workers.stage_ranks(0)), rerouted_pipelines=rerouted_pipelines(plan, eng.stage_id),
            microbatches=eng.micro_batches).attach(comm, self._at_step)
        eng.stepper.clipped_steps = old.clipped_steps
        eng.stepper.adopt_contributions(old.kept_contributions())
        last = workers.stage_ranks(workers.stages - 1)
        if eng.reporter_rank not in last:  # the metrics stay with one rank for as long as it lives
            eng.reporter_rank = min(last)
        eng.drop_slots()
        eng._loss_sum = None
        self._join_count = None  # a new epoch: the count comes with its first loss broadcast
        self.rerouted = sum(plan.worker_of(s, (d, i))[0] != d for s in range(plan.stages)
                            for d in range(plan.pipelines) for i in range(plan.microbatches))

    # ------------------------------------------------------------------ fault injection
    def _fire_join(self, phase: Phase) -> None:
        if any(f.phase is phase for f in self.join_injector.pending):
            self.store.set(self._fault_key(self.rank), repr(time.time()))
            self.join_injector.reached(self.join_injector.pending[0].iteration, phase)

    def _fire(self, phase: Phase) -> None:
        if phase is Phase.FORWARD and self.joined_at is not None and self.engine.iteration == self.joined_at:
            self._fire_join(Phase.JOIN_FIRST_ITERATION)
        it = self.engine.iteration
        if any(f.iteration == it and f.phase is phase for f in self.injector.pending):
            self.store.set(self._fault_key(self.rank), repr(time.time()))
            self.injector.reached(it, phase)

    def _fault_key(self, rank: int) -> str:
        return f"{self.keys.root}/fault/{rank}"

    def _at_step(self) -> None:
        self._fire(Phase.OPTIMIZER_STEP)

    def _wrap_handlers(self) -> None:
        """Before every instruction: look at the watchdog's flag for a member's failure, and fire due faults."""
        table = dict(self.engine._INSTRUCTION_MAP)
        for kind, handler in table.items():
            table[kind] = self._wrapped(handler, _PHASES.get(kind))
        self.engine._INSTRUCTION_MAP = table  # instance attribute: _exec_schedule looks it up on self

    def _wrapped(self, handler: Any, phase: Phase | None) -> Any:
        # No fault aimed at this worker: the failure check only, no fault-phase lookups per instruction.
        fires = phase if phase is not None and (self.injector.pending or self.join_injector.pending) else None

        def run(engine: Any, **kwargs: Any) -> Any:
            # A survivor busy computing learns of a failure at its next instruction, not at its next wait.
            if self.comm.probe.failed():
                raise PeerFailure("a member exited (seen between instructions)")
            if fires is not None:
                self._fire(fires)
                if fires is Phase.BACKWARD_WEIGHT and self._is_last_w(kwargs["micro_batch"]):
                    self._fire(Phase.LAST_BACKWARD_WEIGHT)
            return handler(engine, **kwargs)
        return run

    def _is_last_w(self, mb: Any) -> bool:
        """Whether ``mb``'s W is this worker's last of the iteration (looked at only while such a fault waits)."""
        it = self.engine.iteration
        if not any(f.iteration == it and f.phase is Phase.LAST_BACKWARD_WEIGHT for f in self.injector.pending):
            return False
        ws = [cmd.kwargs["micro_batch"] for step in self.engine._train_schedule().steps() for cmd in step
              if isinstance(cmd, ins.BackwardWeight)]
        return bool(ws) and tuple(ws[-1]) == tuple(mb)

    # ------------------------------------------------------------------ training
    def train_batch(self) -> torch.Tensor:
        """One iteration, through any failures: its mean loss on every live rank (``engine.train_batch``)."""
        self._target = self.engine.iteration + 1

        self._with_recovery(lambda: self._advance(self._target))
        return self.engine.loss

    def _broadcast_loss(self, tensor: torch.Tensor, src: int) -> Any:
        """The loss from ``src`` to every member, with the job's count of join requests riding along (so that
        every member sees the same count at the next boundary without a collective of its own)."""
        previous, self._loss_work = self._loss_work, None
        if previous is not None and previous[0] is self.comm:  # one of a past epoch was retired with its groups
            self.comm.wait(previous[1], "loss broadcast")
        message = torch.zeros(2, dtype=torch.float64)
        if self.rank == src:
            message[0] = tensor.double()
            message[1] = float(self.store.add(self.keys.join_requests, 0))
            self._join_count = int(message[1])
        work = self.comm.norm.broadcast(message, src)
        if self.rank == src:
            self._loss_work = (self.comm, work)
        self._loss_message = (message, tensor)
        return work

    def _wait_loss(self, work: Any) -> None:
        self.comm.wait(work, "loss broadcast")
        message, tensor = self._loss_message
        tensor.copy_(message[0].to(tensor.dtype))
        self._join_count = int(message[1])

    def evaluate(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run()`` (an evaluation pass) through failures: recover, bring training back to where it was, run again."""
        self._target = self.engine.iteration
        return self._with_recovery(run)

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` over every member, in place (bounded; a failure raises :class:`PeerFailure`)."""
        self.comm.wait(self.comm.norm.all_reduce_sum(tensor), what)

    def drain_events(self) -> list[dict[str, Any]]:
        """The events (failure, agreement, plan switch, recovery, rejoin, ...) since the last call."""
        events, self.events = self.events, []
        return events

    def _advance(self, target: int) -> Any:
        """Run engine iterations until ``target`` iterations are done, recovering from failures on the way."""
        loss = None
        while self.engine.iteration < target:
            try:
                self._fire(Phase.IDLE)
                self.engine._exec_finish_optimizer_step()
                if self.comm.probe.failed():
                    raise PeerFailure("a member exited (seen at the iteration boundary)")
                self._admit_joiners()
                loss = self.engine.run_iteration()
                self._note_recovered()
            except PeerFailure as failure:
                self._recover(failure)
        return loss

    def _reason(self, failure: PeerFailure) -> str:
        """Why the epoch ended: the failure's own words, and the watchdog's finding when they lack it (a wait may
        have seen only the group that another member's watchdog broke)."""
        declared, text = self.watchdog.declared, str(failure)
        return f"{text}; watchdog: {declared.reason}" if declared is not None and declared.reason not in text else text

    def _note_recovered(self) -> None:
        rec, self._recovery = self._recovery, None
        if rec is None:
            return
        now = time.time()
        rec["redo_s"] = now - rec.pop("_restored_at")
        start = rec.get("killed_at") or rec["detected_at"]
        self._event("recovered", failure_to_full_iteration_s=now - start, **rec)

    def _event(self, kind: str, **details: Any) -> None:
        event = {"kind": kind, "time_s": time.time(), **details}
        self.events.append(event)
        logger.warning("event %s", event)

    # ------------------------------------------------------------------ recovery
    def _recover(self, failure: PeerFailure) -> None:
        detected = time.time()
        rc = self.cfg.recycle
        eng = self.engine
        self._join_checked = None  # every member checks for joiners again at the boundary it repairs
        self.epoch += 1
        eng.stepper.settle()  # a step already taken is complete here, with nothing left to wait for
        report_key = f"{self.keys.root}/epoch/{self.epoch}/report/"
        self.store.set(report_key + str(self.rank), self._report().to_json())
        try:
            members = agree_members(self.store, self.epoch, self.rank, self.members, self.liveness,
                                    timeout_s=rc.failure_timeout_s, keys=self.keys)
        except MembershipError as e:  # fenced out by the others: leave, a restart can join again
            logger.error("%s; leaving as lost (exit %d)", e, ckpt.LOST_EXIT_CODE)
            self._exit(ckpt.LOST_EXIT_CODE)
        agreed = time.time()
        reports = {q: Report.from_json(self.store.get(report_key + str(q))) for q in members}
        dead = sorted(set(self.members) - set(members))
        killed = [float(self.store.get(self._fault_key(q))) for q in dead if self.store.check([self._fault_key(q)])]
        self._event("failure", lost_ranks=dead, lost_workers=[list(self.workers.worker_of_rank(q)) for q in dead],
                    reason=self._reason(failure), epoch=self.epoch)
        workers = self._workers_of(members)
        self.members = members
        self.workers = workers
        comm = self._build_comm("")
        regrouped = time.time()
        try:
            plan = self.plans.get(workers.absent())
        except StageLostError as e:
            self._fall_back(e)
        planned = time.time()
        tied = [frozenset(t.stages) for t in eng.tied]
        decision = decide(reports, plan, workers, salvage=rc.salvage, tied_stages=tied)
        k = decision.iteration
        self._event("agreement", members=members, epoch=self.epoch, repair_iteration=k,
                    committed_stages=sorted(decision.committed))
        if decision.unrecoverable:
            self._fall_back(RuntimeError(f"iteration {k} cannot be repaired: {decision.unrecoverable}"))
        completing = self.rank in decision.repair.completing  # it holds the reduced gradients: only the step is left
        rows: dict[Any, Any] = {}
        if not completing:
            eng.stepper.revert()  # a reduction whose step was not taken is undone (its rows were kept)
            rows = eng.stepper.partial_rows()
        loss_sum, progress, was_at = eng._loss_sum, eng.progress, eng.iteration
        self._install(comm, workers, plan)
        self._event("plan_switch", absent=sorted(list(w) for w in workers.absent()), rerouted=self.rerouted)
        moved = self._roll_forward(decision, reports)
        assert eng.boundary_log is not None
        eng.boundary_log.discard_from(k + 1)  # work of the next iteration, begun by committed stages, is redone
        if completing:  # serves logs, then steps with the reduced gradients it holds (no rows to adopt)
            progress = IterationProgress(k, awaiting_norm=True)
        else:
            if eng.stage_id in decision.committed:  # stepped k: only serve logs (and the norm) in its repair
                rows, loss_sum, progress = {}, None, IterationProgress(k, stepped=True)
            elif eng.stage_id in decision.dropped or progress.iteration != k:  # nothing of k kept on this stage
                rows, loss_sum, progress = {}, None, IterationProgress(k)
            eng.stepper.adopt_rows(rows)
        eng._loss_sum, eng.progress, eng.repair = loss_sum, progress, decision.repair
        if was_at < k:  # it stepped k - 1 but was still waiting for that iteration's loss: nobody re-sends it
            eng.loss = eng.agg_train_loss = torch.full((), float("nan"))
        eng.iteration = k
        restored = time.time()
        prev = self._recovery or {}
        self._recovery = {"killed_at": min(killed) if killed else prev.get("killed_at"), "detected_at": detected,
                          "detection_s": detected - min(killed) if killed else None, "agreement_s": agreed - detected,
                          "regroup_s": regrouped - agreed, "plan_lookup_s": planned - regrouped,
                          "restore_s": restored - planned, "repair_iteration": k, "_restored_at": restored,
                          "committed_stages": sorted(decision.committed), "dropped_stages": sorted(decision.dropped),
                          "kept_weight_gradients": decision.kept_weight_gradients,
                          "tensors_from_logs": decision.from_logs, "rolled_forward_bytes": moved,
                          "completed_steps": len(decision.repair.completing)}
        logger.warning("recovered from the loss of ranks %s: members %s, repairing iteration %d (stages %s had "
                       "stepped it)", dead, members, k, sorted(decision.committed))

    def _roll_forward(self, decision: Decision, reports: dict[int, Report]) -> int:
        """Replicas of a committed stage that had not taken the step get the state of one that had (rare)."""
        stage = self.engine.stage_id
        src = decision.roll_forward.get(stage)
        if src is None:
            return 0
        behind = reports[self.rank].stepped < decision.iteration and self.rank not in decision.repair.completing
        st = self.engine.stepper
        extra = ({**self._stepper_state(), "contributions": st.kept_contributions(),
                  "losses": dict(self.engine._losses)} if self.rank == src else None)
        moved, got = transfer_stage_state(self.comm, src, self.rank, self.engine, load=behind, extra=extra)
        if behind:
            st.clipped_steps = got["clipped_steps"]
            st.adopt_contributions(got["contributions"])
            self.engine._losses.update(got["losses"])
        self._event("roll_forward", stage=stage, source=src, iteration=decision.iteration, state_bytes=moved)
        return moved

    def _fall_back(self, error: Exception) -> NoReturn:
        """Re-routing or repair is impossible (a stage lost, a tensor no live worker holds): restart the whole job
        from the latest checkpoint (never returns)."""
        if self.fallback_directory is None:
            self._event("stage_lost", reason=str(error))
            logger.error("cannot re-route (%s) and there is no checkpoint to fall back to (no --checkpoint-dir): "
                         "this worker leaves as lost (exit %d)", error, ckpt.LOST_EXIT_CODE)
            self._exit(ckpt.LOST_EXIT_CODE)
        self._event("fallback", reason=str(error), generation=self.generation + 1,
                    directory=self.fallback_directory)
        logger.error("cannot re-route (%s): falling back to the latest checkpoint in %s; this worker leaves as lost "
                     "(exit %d) and the launcher starts every rank again", error, self.fallback_directory,
                     ckpt.LOST_EXIT_CODE)
        carry_events(self.store, self.generation + 1, self.rank == min(self.members), self.events)
        if self.named_by_engine:  # the restarted script may not load it itself: ds_recycle.initialize will
            hand_over_directory(self.store, self.generation + 1, self.fallback_directory)
        self.store.compare_set(ckpt.GENERATION_KEY, str(self.generation), str(self.generation + 1))
        request_restart_all(self.store, self.generation + 1)
        self._exit(ckpt.LOST_EXIT_CODE)

    # ------------------------------------------------------------------ rejoin
    def _workers_of(self, members: list[int]) -> WorkerMap:
        return WorkerMap(self.job_workers.stages, self.job_workers.pipelines,
                         {w: r for w, r in self.job_workers.ranks.items() if r in members})

    def _report(self) -> Report:
        """Where this member stands (see :mod:`ds_recycle.resilience.salvage`)."""
        eng, prog = self.engine, self.engine.progress
        stepped = prog.iteration if prog.iteration == eng.iteration and prog.stepped else eng.iteration - 1
        served = tuple((d, i) for d in range(self.plan.pipelines) for i in range(self.plan.microbatches)
                       if self.plan.worker_of(eng.stage_id, (d, i)) == eng.worker)
        log = eng.boundary_log
        held = () if log is None else tuple(
            (k, channel is Channel.GRAD, role is Role.RECEIVED, mb)
            for k in (stepped, stepped + 1) for channel, role, mb in log.held(k))
        in_flight = prog.iteration if not prog.stepped else prog.iteration + 1
        awaiting = prog.awaiting_norm and not prog.stepped and prog.iteration == eng.iteration
        return Report(eng.stage_id, stepped, in_flight, served, tuple(sorted(prog.w_done)) if not prog.stepped else (),
                      held, awaiting)

    def _stepper_state(self) -> dict[str, Any]:
        st = self.engine.stepper
        return {"clipped_steps": st.clipped_steps}

    def _admit_joiners(self) -> None:
        """At an iteration boundary: let in the restarted workers whose join requests the members agree on.

        Not while an interrupted iteration is being repaired (every member has the repair): its schedule is
        fixed for the members that made it; joiners come in at the next boundary.
        """
        boundary = self.engine.iteration
        if self._join_checked == boundary or self.engine.repair is not None or self._join_count is None:
            return  # (no count yet in this epoch: the next iteration's loss broadcast brings one)
        self._join_checked = boundary
        upto = self._join_count  # the same on every member: it came with the last iteration's loss
        if upto <= self.joins_decided:
            return
        started = time.time()
        accepted = decide_requests(self.store, self.keys, upto, self.joins_decided, self.members,
                                   sorted(self.job_workers.ranks.values()))
        joining = sorted(accepted.values())
        previous, after = list(self.members), self.joins_decided
        self.joins_decided = upto
        members = sorted(previous + joining)
        if self.rank == min(previous):
            write_tickets(self.store, self.keys, upto, after, accepted, self.epoch, members, boundary,
                          self.engine.reporter_rank)
        if not joining:
            return
        # Joins do not count as agreement rounds (``epoch``): a failure in the middle of one sends every member
        # to the same next round, whether it had finished the join or not. Their groups carry the join count.
        self.members, self.workers = members, self._workers_of(members)
        comm = self._build_comm(f"j{upto}", {q: read_request(self.store, self.keys, n)[1] for n, q in accepted.items()})
        connected = time.time()
        self._install(comm, self.workers, self.plans.get(self.workers.absent()))
        sources = stage_sources(previous, joining, lambda q: self.job_workers.worker_of_rank(q)[1])
        moved = 0
        if self.engine.stage_id in sources:
            moved, _ = transfer_stage_state(comm, sources[self.engine.stage_id], self.rank, self.engine, load=False,
                                            extra=self._stepper_state())
        self._event("rejoin", ranks=joining, workers=[list(self.job_workers.worker_of_rank(q)) for q in joining],
                    iteration=boundary, members=members, regroup_s=connected - started,
                    join_s=time.time() - started, state_bytes=moved)
        self._event("plan_switch", absent=sorted(list(w) for w in self.workers.absent()), rerouted=self.rerouted)
        logger.warning("ranks %s joined at iteration %d: members %s", joining, boundary, members)

    def _join(self) -> None:
        """This process replaces a lost worker: ask the members in, take the stage's state, start at a boundary."""
        started = time.time()
        number = file_request(self.store, self.keys, self.rank, incarnation(self.store, self.keys, self.rank))
        self._fire_join(Phase.JOIN_REQUEST)
        rc = self.cfg.recycle
        try:
            ticket = wait_for_ticket(self.store, self.keys, number, rc.failure_timeout_s, self._fell_back)
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
        self.epoch, self.members, self.joins_decided = ticket.epoch, list(ticket.members), ticket.admitted_upto
        self.workers = self._workers_of(self.members)
        self.engine.reporter_rank = ticket.reporter
        self._fire_join(Phase.JOIN_GROUPS)
        comm = self._build_comm(f"j{ticket.admitted_upto}")
        self._install(comm, self.workers, self.plans.get(self.workers.absent()))
        previous = [q for q in ticket.members if q not in ticket.joining]
        src = stage_sources(previous, ticket.joining, lambda q: self.job_workers.worker_of_rank(q)[1])[
            self.engine.stage_id]
        self._fire_join(Phase.JOIN_TRANSFER)
        moved, extra = transfer_stage_state(comm, src, self.rank, self.engine, load=True)
        if self.engine.iteration != ticket.iteration:
            raise RuntimeError(f"state from rank {src} is at iteration {self.engine.iteration}, "
                               f"the ticket says {ticket.iteration}")
        st = self.engine.stepper
        st.clipped_steps = extra["clipped_steps"]
        self._join_checked = self.joined_at = self._target = ticket.iteration
        self._event("rejoin", ranks=[self.rank], workers=[list(self.engine.worker)], iteration=ticket.iteration,
                    members=self.members, join_s=time.time() - started, state_bytes=moved)
        logger.warning("joined the running job at iteration %d (epoch %d, members %s, %d bytes of state from "
                       "rank %d)", ticket.iteration, self.epoch, self.members, moved, src)

    def _fell_back(self) -> str | None:
        if int(self.store.add(ckpt.GENERATION_KEY, 0)) != self.generation:
            return "the job fell back to its checkpoint"
        return None

    def _leave_unjoined(self, why: str) -> NoReturn:
        """Leave without having joined: finished if training is over, lost otherwise (a restart may follow)."""
        closed = self.store.check([self.keys.join_closed]) and self._fell_back() is None
        code = 0 if closed else ckpt.LOST_EXIT_CODE
        logger.warning("not joining: %s; leaving (exit %d)", why, code)
        self._exit(code)

    def _exit(self, code: int) -> NoReturn:
        self.heartbeat.stop()
        self.watchdog.stop()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # ------------------------------------------------------------------ checkpoints
    def _with_recovery(self, what: Any) -> Any:
        """Run ``what()``; on a failure recover, catch up to the loop's iteration and run it again."""
        while True:
            try:
                return what()
            except PeerFailure as failure:
                self._recover(failure)
                self._advance(self._target)

    def save_checkpoint(self, directory: str, next_iteration: int, write: Callable[[], None] | None = None,
                        latest: Callable[[], None] | None = None) -> None:
        """Each stage's first live replica writes its state; ``latest`` is written once all are complete.

        ``write``/``latest``: the writers (default: ds_recycle's own layout, :mod:`ds_recycle.resilience.checkpoint`).
        """
        def save() -> None:
            self.engine._exec_finish_optimizer_step()  # the saved step must be final (post-validation)
            if self.rank == self.workers.stage_ranks(self.engine.stage_id)[0]:
                write() if write is not None else ckpt.save_stage(self.engine, directory, next_iteration)
            self.comm.wait(self.comm.norm.all_reduce_sum(torch.zeros(1)), "checkpoint barrier")
            if self.rank == min(self.members):
                latest() if latest is not None else ckpt.write_latest(directory, next_iteration)
            self._event("checkpoint", next_iteration=next_iteration, directory=directory)
        self._with_recovery(save)

    def resume_directory(self) -> str | None:
        """After a fallback (generation > 0): the checkpoint directory the job fell back to (None otherwise)."""
        return fallback_directory(self.store, self.generation)

    def load_checkpoint(self, directory: str) -> int | None:
        if self.joined_at is not None:  # state came from a live replica, newer than any checkpoint
            self.engine._calls = self.joined_at  # the loop resumes where the job is: no calls to catch up
            return self.joined_at
        start = ckpt.load_stage(self.engine, directory)
        self.resumed_at(start, directory)
        return start

    def resumed_at(self, start: int | None, directory: str) -> None:
        """A resume from ``directory``: training goes on at iteration ``start`` (None: no checkpoint was there).

        The events carried over a fallback are put back in front, so the metrics keep one record.
        """
        if start is not None:
            self._target = self.engine._calls = start
        self.events = carried_events(self.store, self.generation) + self.events
        self._event("resumed", iteration=start or 0, generation=self.generation, directory=directory,
                    checkpoint_found=start is not None)

    # ------------------------------------------------------------------ end of training
    def finish(self) -> None:
        """Training is over: the last step is final on every member (recovering from failures on the way)."""
        self.store.set(self.keys.join_closed, "1")  # training is over: a restarted worker has nothing to join
        while not self._finished:
            try:
                self.engine.finish_local()
                if self._loss_work is not None and self._loss_work[0] is self.comm:
                    self.comm.wait(self._loss_work[1], "loss broadcast")
                self._loss_work = None
                self.comm.wait(self.comm.norm.all_reduce_sum(torch.zeros(1)), "end-of-training barrier")
                self._finished = True
                st = self.engine.stepper
                log = self.engine.boundary_log
                logger.info("optimizer steps: %d, clipped %d; boundary log peak %d bytes", self.engine.global_steps,
                            st.clipped_steps, log.peak_bytes if log is not None else 0)
            except PeerFailure as failure:
                self._recover(failure)
                self._advance(self._target)

    def gather_final_state(self) -> dict[str, torch.Tensor] | None:
        """Every stage's parameters on the reporter, through the store (valid whatever groups died)."""
        self.finish()
        stage = self.engine.stage_id
        key = f"{self.keys.root}/final/{self.epoch}/stage/"
        if self.rank == self.workers.stage_ranks(stage)[0]:
            buf = io.BytesIO()
            torch.save(cpu_state_dict(self.engine.module), buf)
            self.store.set(key + str(stage), buf.getvalue())  # type: ignore[arg-type]  # the store takes bytes too
        if self.rank != self.engine.reporter_rank:
            return None
        return merge_in_layer_order(torch.load(io.BytesIO(self.store.get(key + str(s))), weights_only=True)
                                    for s in range(self.workers.stages))

    def is_reporter(self) -> bool:
        return self.rank == self.engine.reporter_rank

    def close(self) -> None:
        self.finish()
        self.comm.wait(self.comm.norm.all_reduce_sum(torch.zeros(1)), "closing barrier")
        if self.epoch == 0 and self.joined_at is None:
            self.heartbeat.stop()
            self.watchdog.stop()
            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
            return
        # The WORLD group still references a dead peer (or is detached): tearing it down could abort; leave.
        self._exit(0)
