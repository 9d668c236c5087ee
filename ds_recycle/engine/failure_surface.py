"""The engine's surface for the failure handler (:mod:`ds_recycle.engine.driver`): membership epochs, plan switches,
layer moves, where a worker stands after a failure, the repair of an interrupted iteration, and a stage's state sent
to a replica. Nothing but the failure handler calls these; a job without failure handling never does.

:class:`FailureSurface` is mixed into :class:`~ds_recycle.engine.engine.RecyclePipelineEngine`; it builds on the
instruction handlers (:mod:`ds_recycle.engine.handlers`: the slots in flight, the last step) and declares the rest of
the engine state it reads and writes.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_recycle.engine.backward import OwnerCapture
from ds_recycle.engine.boundary_log import BoundaryLog, Role
from ds_recycle.engine.driver import Driver, EngineHooks, EpochSetup
from ds_recycle.engine.handlers import InstructionHandlers
from ds_recycle.engine.issue import IssuedSchedule
from ds_recycle.engine.layer_move import PendingMove, Transfer, held_layers, install_layers, receive_layers
from ds_recycle.engine.optimizer import StaggeredOptimizer
from ds_recycle.engine.p2p import Channel, PeerChannel
from ds_recycle.engine.position import IterationProgress, KeptWork, Position
from ds_recycle.engine.rng import LayerSeeds
from ds_recycle.engine.schedule import PlanLike, Repair, check_plan_for_job
from ds_recycle.engine.stage_state import StageState

__all__ = ["FailureSurface"]


class FailureSurface(InstructionHandlers):
    """What the failure handler drives on the engine (see the module docstring)."""

    # the engine's state used here beyond the handlers' (set by RecyclePipelineEngine.__init__)
    driver: Driver
    plan: PlanLike
    grid: Any
    mpu: Any
    optimizer: Any
    worker: tuple[int, int]
    num_stages: int
    base_parts: tuple[int, ...]
    layers_fixed: str | None
    pending_move: PendingMove | None
    reporter_rank: int
    repair: Repair | None
    loss: torch.Tensor
    agg_train_loss: torch.Tensor
    _schedules: list[IssuedSchedule]
    _retired: list[tuple[PeerChannel, StaggeredOptimizer]]
    _calls: int
    # the engine's methods
    _make_schedule: Callable[[int], IssuedSchedule]
    _make_stepper: Callable[[], StaggeredOptimizer]

    @property
    def partition(self) -> tuple[int, ...]:
        """The layer boundaries of every stage now (DeepSpeed's ``PipelineModule.parts``, as ints)."""
        return tuple(int(x) for x in self.module.parts)

    def attach_driver(self, driver: Driver) -> None:
        """Run the entry points through ``driver`` (the failure handler) from now on."""
        self.driver = driver

    def attach_hooks(self, hooks: EngineHooks | None) -> None:
        """Run ``hooks`` before each instruction and each optimizer step (None: no checks)."""
        self.hooks = hooks

    def keep_boundary_log(self, on_host: bool = False) -> None:
        """Keep the tensors sent and received at this stage's boundaries from now on (a repair may need them);
        ``on_host``: as copies in pinned host memory (:class:`~ds_recycle.engine.boundary_log.BoundaryLog`)."""
        if self.boundary_log is None:
            self.boundary_log = BoundaryLog(on_host)

    def finish_step(self) -> None:
        """Complete the last optimizer step (post-validation), as every iteration's first instruction does."""
        self._exec_finish_optimizer_step()

    def resume_calls_at(self, calls: int) -> None:
        """The training loop's ``train_batch`` calls so far are ``calls`` (a resume or a join: the loop's first
        ``calls`` calls return at once)."""
        self._calls = calls

    def install_epoch(self, setup: EpochSetup) -> None:
        """Run on a new membership epoch: its workers, plan, grid and transport.

        The micro-batches in flight are dropped (an interrupted iteration is resumed by :meth:`begin_repair`);
        the optimizer's counters and kept norm contributions carry over.
        """
        old = self.stepper
        self._retired.append((self.channel, old))
        self.workers, self.plan, self.transport = setup.workers, setup.plan, setup.transport
        self.grid = self.mpu = self.module._grid = setup.grid
        self._schedules = [self._make_schedule(k) for k in range(self.plan.iterations)]
        self.channel = PeerChannel(self.transport, device=self.device, issued=True)
        self.stepper = self._make_stepper()
        self.stepper.clipped_steps = old.clipped_steps
        self.stepper.adopt_contributions(old.kept_contributions())
        if setup.reporter is not None:
            self.reporter_rank = setup.reporter
        last = self.workers.stage_ranks(self.workers.stages - 1)
        if self.reporter_rank not in last:  # the metrics stay with one rank for as long as it lives
            self.reporter_rank = min(last)
        self.drop_slots()
        self._loss_sum = None

    def switch_plan(self, plan: PlanLike) -> None:
        """Run ``plan`` from the next iteration on, with the same members and groups (a re-plan for a worker's
        speed). Call at an iteration boundary, with the last step finished: no micro-batch is in flight and the
        gradient rows are empty."""
        check_plan_for_job(plan, self.num_stages, self.workers.pipelines, self.micro_batches, self.workers.absent())
        if self.slots or self.row_order.held:
            raise RuntimeError(f"switch_plan in the middle of iteration {self.iteration}: call it between iterations")
        old = self.stepper
        self.plan = plan
        self._schedules = [self._make_schedule(k) for k in range(plan.iterations)]
        self.stepper = self._make_stepper()
        self.stepper.clipped_steps = old.clipped_steps
        self.stepper.adopt_contributions(old.kept_contributions())

    def seed_per_layer(self) -> None:
        """Draw each layer's randomness from its own per-micro-batch stream (:class:`LayerSeeds`), so that moving
        it to another stage does not change its dropout masks. Set before training when layers may move."""
        self.layer_seeds = LayerSeeds(self.rng_seed, self.device)
        self.layer_seeds.attach(held_layers(self.module))

    def repartition(self, plan: PlanLike, between: Callable[[str], None] | None = None) -> list[Transfer]:
        """Move layers to ``plan``'s partition and run ``plan`` from the next iteration on (every live worker calls
        it at the same iteration boundary; it finishes the last step first; :mod:`ds_recycle.engine.layer_move`).
        Returns the layer transfers.

        The transfers, then a barrier, then each worker installs its layers. A failure between the barrier's end on
        one member and on another (a peer lost inside it) can leave some survivors moved and others not: the ones
        not moved keep what they received (:attr:`pending_move`, reported in :meth:`position`) and the recovery
        completes or drops it (:meth:`complete_move`, :meth:`drop_move`). ``between(point)`` is called with
        ``"received"`` before the barrier and ``"agreed"`` after it (fault injection)."""
        parts = getattr(plan, "partition", None)
        if parts is None:
            parts = self.base_parts
        if self.layers_fixed is not None:
            raise RuntimeError(f"layers cannot move between stages in this job: {self.layers_fixed}")
        if self.slots or self.row_order.held:
            raise RuntimeError(f"repartition in the middle of iteration {self.iteration}: call it between iterations")
        self.finish_step()  # the last step is final before its parameters move
        if len(parts) != self.num_stages + 1 or parts[-1] != len(self.module._layer_specs):
            raise ValueError(f"partition {list(parts)}: give {self.num_stages + 1} boundaries from 0 to "
                             f"{len(self.module._layer_specs)}")
        self.pending_move = receive_layers(self.module, self.optimizer, parts, self.workers, self.global_rank,
                                           self.transport)
        moved = self.pending_move.transfers
        if between is not None:
            between("received")
        self.transport.barrier("layer move")  # every transfer done everywhere: all members change together
        if between is not None:
            between("agreed")
        self.complete_move()
        self.switch_plan(plan)
        return moved

    def complete_move(self) -> None:
        """Install the layers of :attr:`pending_move` (received, not installed yet)."""
        pending, self.pending_move = self.pending_move, None
        if pending is None:
            raise RuntimeError("no layer move to complete on this worker")
        install_layers(self.module, self.optimizer, self.stage_id, pending)
        self.capture.close()
        per_owner = self.capture.per_owner
        self.capture = OwnerCapture(self.module)
        self.capture.per_owner = per_owner
        if self.layer_seeds is not None:
            self.layer_seeds.attach(held_layers(self.module))

    def drop_move(self) -> None:
        """Forget :attr:`pending_move`: the members stay on the partition they hold."""
        self.pending_move = None

    def position(self) -> Position:
        """Where this worker stands (reported to the other members after a failure)."""
        prog = self.progress
        stepped = prog.iteration if prog.iteration == self.iteration and prog.stepped else self.iteration - 1
        served = tuple((d, i) for d in range(self.plan.pipelines) for i in range(self.plan.microbatches)
                       if self.plan.worker_of(self.stage_id, (d, i)) == self.worker)
        log = self.boundary_log
        held = () if log is None else tuple(
            (k, channel is Channel.GRAD, role is Role.RECEIVED, mb)
            for k in (stepped, stepped + 1) for channel, role, mb in log.held(k))
        in_flight = prog.iteration if not prog.stepped else prog.iteration + 1
        awaiting = prog.awaiting_norm and not prog.stepped and prog.iteration == self.iteration
        return Position(self.stage_id, stepped, in_flight, served,
                        tuple(sorted(prog.w_done)) if not prog.stepped else (), held, awaiting, self.partition,
                        () if self.pending_move is None else self.pending_move.parts)

    def keep_work(self, completing: bool) -> KeptWork:
        """What this worker keeps of the interrupted iteration (before a new epoch replaces its groups).

        ``completing``: only the step was left (the reduced gradients stay); otherwise a reduction whose step was
        not taken is undone and the rows are kept.
        """
        rows: dict[Any, Any] = {}
        if not completing:
            self.stepper.revert()
            rows = self.stepper.partial_rows()
        return KeptWork(self.iteration, self.progress, self._loss_sum, rows, completing)

    def settle_step(self) -> None:
        """Complete a step already taken, waiting for nothing (the epoch's groups are about to be replaced)."""
        self.stepper.settle()

    def begin_repair(self, kept: KeptWork, repair: Repair, iteration: int, committed: bool, dropped: bool) -> None:
        """Go back to ``iteration`` (the interrupted one) and run only what ``repair`` leaves of it next.

        ``kept`` is what this worker kept (:meth:`keep_work`); ``committed``: its stage stepped the iteration
        before the failure; ``dropped``: its stage's partial sums are dropped (it redoes its part from the start).
        """
        if self.boundary_log is not None:
            self.boundary_log.discard_from(iteration + 1)  # work of the next iteration, begun by committed stages
        rows, loss_sum, progress = kept.rows, kept.loss_sum, kept.progress
        if kept.completing:  # serves logs, then steps with the reduced gradients it holds (no rows to adopt)
            progress = IterationProgress(iteration, awaiting_norm=True)
        else:
            if committed:  # stepped it: only serves logs (and the norm) in its repair
                rows, loss_sum, progress = {}, None, IterationProgress(iteration, stepped=True)
            elif dropped or progress.iteration != iteration:  # nothing of it kept on this stage
                rows, loss_sum, progress = {}, None, IterationProgress(iteration)
            self.stepper.adopt_rows(rows)
        self._loss_sum, self.progress, self.repair = loss_sum, progress, repair
        if kept.iteration < iteration:  # it stepped the one before but was still waiting for its loss
            # nobody sends it again
            self.loss = self.agg_train_loss = torch.full((), float("nan"), device=self.device)
        self.iteration = iteration

    def stage_state(self, carry_progress: bool = False) -> StageState:
        """This stage's state to send to another replica (``carry_progress``: also the kept norm contributions
        and losses, for a replica brought forward to a step it missed)."""
        st = self.stepper
        if carry_progress:
            return StageState.of(self, clipped_steps=st.clipped_steps, contributions=st.kept_contributions(),
                                 losses=dict(self._losses))
        return StageState.of(self, clipped_steps=st.clipped_steps)

    def load_stage_state(self, state: StageState) -> None:
        """Take another replica's :meth:`stage_state`."""
        state.restore(self)
        if state.clipped_steps is not None:
            self.stepper.clipped_steps = state.clipped_steps
        if state.contributions is not None:
            self.stepper.adopt_contributions(state.contributions)
        if state.losses is not None:
            self._losses.update(state.losses)

