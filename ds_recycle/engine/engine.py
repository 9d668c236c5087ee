"""``RecyclePipelineEngine``: DeepSpeed's ``PipelineEngine`` executing ReCycle plans.

What changes against DeepSpeed's engine (everything else, the module, the optimizer, the config, is
DeepSpeed's):

- ``train_batch`` runs a :class:`~ds_recycle.engine.schedule.PlanSchedule` for this worker instead of the
  hard-coded ``TrainSchedule``, and returns the iteration's loss on the reporting rank only (no
  pipeline-wide loss broadcast: the last stage folds its loss sum into its gradient all-reduce);
- ``_INSTRUCTION_MAP`` is re-declared: DeepSpeed binds function objects and looks them up by exact type,
  so every ReCycle instruction is registered here with its own small ``_exec_*`` handler;
- micro-batch state lives in a per-slot record (inputs, labels, stage output, received gradient, pending
  W), not in DeepSpeed's single ``self.loss`` / ``self.grad_layer`` slots;
- the forward calls the module directly (no DeepSpeed output hooks); the last stage scales each loss by
  ``1/M`` itself, as DeepSpeed's ``backward`` does;
- transfers go to explicit global ranks (:mod:`ds_recycle.engine.p2p`), so a stage can feed and be fed by
  another pipeline's workers; DeepSpeed's start-up handshake through ``pipe.p2p`` (same-pipeline
  neighbours only) is skipped;
- every communication goes through one :class:`~ds_recycle.engine.transport.Transport`, and the entry points
  (``train_batch``, ``eval_batch``, checkpoints, ``finish``, ``close``) run through a
  :class:`~ds_recycle.engine.driver.Driver`: both are replaced by the failure handler under ``ds-recycle
  launch``, through the hook surface of :mod:`ds_recycle.engine.driver` (nothing else writes the engine).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from types import MethodType
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import engine as ds_pipe_engine
from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_recycle.engine import ds_checkpoint, surface
from ds_recycle.engine import instructions as ins
from ds_recycle.engine.backward import (
    OwnerCapture,
    SplitUnsupported,
    WeightGradWork,
    backward_fused,
    backward_input,
    grad_buffers,
)
from ds_recycle.engine.boundary_log import BoundaryLog, Role
from ds_recycle.engine.driver import Driver, EngineHooks, EpochSetup, LocalDriver
from ds_recycle.engine.layer_move import (
    PendingMove,
    Transfer,
    held_layers,
    install_layers,
    movable_reason,
    pinned_layers,
    receive_layers,
)
from ds_recycle.engine.op_clock import KINDS, DeviceTimer, OpClock, stage_costs, timed_kind
from ds_recycle.engine.optimizer import ClipScope, NormLayout, StaggeredOptimizer, StepOutcome
from ds_recycle.engine.p2p import Channel, Payload, PeerChannel, check_payload
from ds_recycle.engine.position import IterationProgress, KeptWork, Position
from ds_recycle.engine.precision import MasterWeightOptimizer
from ds_recycle.engine.recompute import use_recompute
from ds_recycle.engine.rng import LayerSeeds, micro_batch_rng
from ds_recycle.engine.row_order import RowOrder
from ds_recycle.engine.schedule import PlanLike, PlanSchedule, Repair, check_plan_for_job, rerouted_microbatches
from ds_recycle.engine.stage_state import StageState
from ds_recycle.engine.tied import reduce_tied, tied_members, tied_weights
from ds_recycle.engine.transport import DistTransport, Transport
from ds_recycle.events import Event
from ds_recycle.plan.costs import CostModel
from ds_recycle.runtime.grid import SurvivorGrid

__all__ = ["MicroBatchSourceLike", "RecyclePipelineEngine", "rerouted_pipelines", "served_pipelines"]

logger = logging.getLogger(__name__)


class MicroBatchSourceLike(Protocol):
    """Exactly-once data: ``micro_batch(iteration, pipeline, index) -> (inputs, labels)``, a pure function."""

    def micro_batch(self, iteration: int, pipeline: int, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class _Slot:
    """One micro-batch in flight on this worker, from its F to its W."""

    mb: ins.MicroBatch
    inputs: Payload | None = None
    """Stage input: a tensor or a tuple of tensors (its floating-point ones require grad when received)."""
    labels: torch.Tensor | None = None
    output: Payload | None = None
    """Stage output (the scaled loss on the last stage): the root of B."""
    captured: Any = None
    grad_output: Payload | None = None
    """Gradient of ``output``: a tensor, or one tensor per floating-point element of a tuple output."""
    input_grad: Payload | None = None
    """Gradient of ``inputs``, in the same form as ``grad_output``."""
    weight_work: WeightGradWork | None = None
    """What W runs; None once the weight gradient went to the row order (a fused B+W submits it itself)."""


def served_pipelines(plan: PlanLike, worker: tuple[int, int]) -> tuple[frozenset[int], bool]:
    """Owner pipelines of ``worker``'s micro-batches, and whether any replica of its stage serves several."""
    stage = worker[1]
    served: dict[tuple[int, int], set[int]] = {}
    for d in range(plan.pipelines):
        for i in range(plan.microbatches):
            served.setdefault(plan.worker_of(stage, (d, i)), set()).add(d)
    return frozenset(served.get(worker, set())), any(len(v) > 1 for v in served.values())


def _timing_event() -> Any:
    """A timing event for the current stream of this worker's accelerator (the :class:`OpClock` of a GPU job)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().Event(enable_timing=True)


def _detached(payload: Payload) -> Payload:
    return payload.detach() if isinstance(payload, torch.Tensor) else tuple(t.detach() for t in payload)


def _to_device(value: Any, device: torch.device) -> Any:
    """A tensor, or a tuple or list of them, moved to ``device`` (anything else as it is)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _nothing() -> None:
    """An accumulation already done (its weight gradient went straight into its row)."""


def rerouted_pipelines(plan: PlanLike, stage: int) -> frozenset[int]:
    """Pipelines some of whose micro-batches ``stage`` processes on a worker of another pipeline."""
    return frozenset(d for d in range(plan.pipelines) for i in range(plan.microbatches)
                     if plan.worker_of(stage, (d, i))[0] != d)


@contextlib.contextmanager
def _without_pipe_handshake() -> Iterator[None]:
    """Skip ``PipelineEngine.__init__``'s warm-up send to the same-pipeline neighbour (absent with holes)."""
    p2p = ds_pipe_engine.p2p
    send, recv = p2p.send, p2p.recv
    p2p.send = p2p.recv = lambda *args, **kwargs: None
    try:
        yield
    finally:
        p2p.send, p2p.recv = send, recv


class RecyclePipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` that runs this worker's part of a ReCycle plan each iteration."""

    grid: Any
    """The grid of the members (a :class:`~ds_recycle.runtime.grid.SurvivorGrid`; replaced per epoch)."""

    def __init__(self, *, plan: PlanLike, data: MicroBatchSourceLike, clip_scope: ClipScope = ClipScope.FIRST_STAGE,
                 **deepspeed_kwargs: Any) -> None:
        with _without_pipe_handshake():
            super().__init__(**deepspeed_kwargs)
        if not isinstance(self.grid, SurvivorGrid):
            raise TypeError("RecyclePipelineEngine needs a PipelineModule built on a SurvivorGrid "
                            "(use ds_recycle.initialize)")
        use_recompute(self.module)  # again: DeepSpeed's __init__ applies the config's activation_checkpoint_interval
        self.workers = self.grid.workers
        self.worker = (self.grid.data_parallel_id, self.stage_id)
        check_plan_for_job(plan, self.num_stages, self.workers.pipelines, self.micro_batches, self.workers.absent())
        self.plan = plan
        self.data = data
        self.synchronous = plan.optimizer == "synchronous"
        self._schedules = [self._make_schedule(k) for k in range(plan.iterations)]
        if self.bfloat16_enabled():  # DeepSpeed's BF16_Optimizer clips by the norm over every stage
            clip_scope = ClipScope.WHOLE_MODEL
        self.capture = OwnerCapture(self.module)
        if self.module.activation_checkpoint_interval > 0:  # recomputed segments (ds_recycle.engine.recompute)
            self.capture.per_owner = False
        self.clip_scope = clip_scope
        self.base_parts: tuple[int, ...] = self.partition
        """The layer boundaries the job was built with (DeepSpeed's ``PipelineModule.parts``)."""
        self.layers_fixed: str | None = movable_reason(self.module)
        """Why this job's layers cannot move between stages (None: they can; :meth:`repartition`)."""
        self.pending_move: PendingMove | None = None
        """A layer move received and not installed (:meth:`repartition`); None almost always."""
        self.pinned_layers: dict[int, int] = pinned_layers(self.module, self.base_parts)
        """Layers that stay on their stage when the others move (``TiedLayerSpec``): ``layer -> stage``."""
        self._layout_cache: NormLayout | None = None
        self.layer_seeds: LayerSeeds | None = None
        """Per-layer random streams (:meth:`seed_per_layer`), or None: one stream per stage."""
        self.tied = tied_weights(self.module)
        """Parameters this stage shares with other stages (``TiedLayerSpec``; :mod:`ds_recycle.engine.tied`)."""
        self.transport: Transport = DistTransport.of_grid(self.grid, self._tied_groups())
        """Every transfer and collective of the engine (:mod:`ds_recycle.engine.transport`)."""
        self.channel = PeerChannel(self.transport)
        self.stepper = self._make_stepper()
        self.row_order = RowOrder(lambda pipeline: pipeline not in self.stepper.rerouted_pipelines)
        """Own rows add their weight gradients in micro-batch order (:mod:`ds_recycle.engine.row_order`)."""
        self.reporter_rank = min(self.workers.stage_ranks(self.num_stages - 1))
        self.driver: Driver = LocalDriver(self)
        """Runs the entry points: directly, or through the failure handler (:mod:`ds_recycle.engine.driver`)."""
        self.hooks: EngineHooks | None = None
        """Checks before each instruction and each step (:meth:`attach_hooks`)."""
        self._retired: list[tuple[PeerChannel, StaggeredOptimizer]] = []
        """Channels and optimizers of past epochs: kept referenced (a peer may still be blocked in their groups)."""
        self.iteration = 0
        self._rerouted_cache: tuple[PlanLike, int] | None = None
        self.slots: dict[int, _Slot] = {}
        self._loss_sum: torch.Tensor | None = None
        self._iteration_loss: torch.Tensor | None = None
        self._losses: dict[int, torch.Tensor] = {}
        """Last stage: the mean loss of its last two stepped iterations (whichever replica reports it)."""
        self.boundary_log: BoundaryLog | None = None
        """The tensors sent and received at this stage's boundaries (kept under ``ds-recycle launch``, where a
        failure's repair may need them; :mod:`ds_recycle.engine.boundary_log`)."""
        self.last_step: StepOutcome | None = None
        self.progress = IterationProgress(-1)
        self.repair: Repair | None = None
        """When set, the next ``train_batch`` runs only what is left of the interrupted iteration."""
        self.op_seconds: dict[str, list[float]] | None = None
        """When a dict, each executed instruction's time (:attr:`timer`) is appended under its class name."""
        self.clock = OpClock(events=None if self.device.type == "cpu" else _timing_event)
        """This worker's F, B, W, O and receive times (:mod:`ds_recycle.engine.op_clock`)."""
        self.timer = DeviceTimer()
        """Times instructions on the thread that builds the engine and trains: wall time less run-queue waits."""
        self.throttle = 1.0
        """Fault injection of a slow accelerator (``recycle.faults`` with ``slow``): each timed compute instruction
        is followed by ``throttle - 1`` times its own duration of sleep (CPU devices, where instructions are timed)."""
        self._calls = 0
        self.rng_seed = 0
        """Base of the per-micro-batch RNG seeds (``recycle.rng_seed``; :mod:`ds_recycle.engine.rng`)."""
        self._data_iter: Any = None
        self._eval_iter: Any = None
        self._eval_step = 0
        self._eval_data: MicroBatchSourceLike | None = None
        self._eval_sums = torch.zeros(0)
        self._evaluating: int | None = None
        """The eval step being run by :meth:`eval_batch`, or None while training."""
        self._closed = False
        """``train_batch`` calls so far (a worker that joined at iteration k returns its first k calls at once)."""
        self.job_config: Any = None
        """The resolved job config (:class:`~ds_recycle.config.job.JobConfig`), set by ``ds_recycle.initialize``."""

    def _configure_bf16_optimizer(self, optimizer: Any) -> Any:
        """bf16: the optimizer steps fp32 master weights, whole on every replica (:mod:`ds_recycle.engine.precision`).

        Replaces DeepSpeed's ``BF16_Optimizer``, which partitions the masters over the data-parallel replicas.
        """
        if optimizer is None:
            raise ValueError("bf16 needs an optimizer: pass optimizer= or add an \"optimizer\" block to the config")
        return MasterWeightOptimizer(optimizer, [p for p in self.module.parameters() if p.requires_grad])

    def _tied_groups(self) -> Any:
        """One ``torch.distributed`` group per tied weight, over its holders; ``name -> group``."""
        groups: dict[str, Any] = {}
        for t in self.tied:
            if t.name not in groups:  # created in the same order by every holder (use_local_synchronization)
                groups[t.name] = dist.new_group(ranks=tied_members(t, self.workers.stage_ranks),
                                                timeout=getattr(self.grid, "timeout", None),
                                                use_local_synchronization=True)
        return groups.__getitem__

    def _make_stepper(self) -> StaggeredOptimizer:
        """The stage's optimizer for the current workers, plan and transport."""
        served, stage_rerouted = served_pipelines(self.plan, self.worker)
        return StaggeredOptimizer(
            self.module, self.optimizer, stage=self.stage_id, pipelines=self.workers.pipelines,
            transport=self.transport, dp_ranks=self.workers.stage_ranks(self.stage_id),
            max_norm=self.gradient_clipping(), scope=self.clip_scope, lr_scheduler=self.lr_scheduler, served=served,
            stage_rerouted=stage_rerouted, norm_source=min(self.workers.stage_ranks(0)),
            rerouted_pipelines=rerouted_pipelines(self.plan, self.stage_id), microbatches=self.micro_batches,
            rank=self.global_rank, norm_layout=self._norm_layout(), norm_params=self._first_stage_params())

    def _first_stage_params(self) -> list[Any] | None:
        """On stage 0 holding more than its own layers: the parameters of its own (the first-stage norm's)."""
        if self.stage_id != 0 or self.partition[1] <= self.base_parts[1]:
            return None
        extra = {id(p) for i, f in held_layers(self.module).items()
                 if i >= self.base_parts[1] and isinstance(f, torch.nn.Module) for p in f.parameters()}
        return [p for p in self.module.parameters() if id(p) not in extra]  # its tied modules first, as built

    @property
    def partition(self) -> tuple[int, ...]:
        """The layer boundaries of every stage now (DeepSpeed's ``PipelineModule.parts``, as ints)."""
        return tuple(int(x) for x in self.module.parts)

    def _norm_layout(self) -> NormLayout | None:
        """The clipping norm's layout while counted layers are not where the job's own partition has them: with
        the first-stage norm, while some of stage 0's own layers are on other stages (else stage 0 holds them all and
        computes the norm alone, :meth:`_first_stage_params`); with the whole model's, while re-partitioned."""
        if self.clip_scope is ClipScope.FIRST_STAGE:
            if self.partition[1] >= self.base_parts[1]:
                return None
        elif self.partition == self.base_parts:
            return None
        if self._layout_cache is None:  # it depends on the job's own partition only
            specs = self.module._layer_specs
            self._layout_cache = (NormLayout.of_layers(specs, self.base_parts[1])
                                        if self.clip_scope is ClipScope.FIRST_STAGE
                                        else NormLayout.of_stages(specs, self.base_parts))
        return self._layout_cache

    # ------------------------------------------------------------------ the hook surface (engine.driver)
    def attach_driver(self, driver: Driver) -> None:
        """Run the entry points through ``driver`` (the failure handler) from now on."""
        self.driver = driver

    def attach_hooks(self, hooks: EngineHooks | None) -> None:
        """Run ``hooks`` before each instruction and each optimizer step (None: no checks)."""
        self.hooks = hooks

    def keep_boundary_log(self) -> None:
        """Keep the tensors sent and received at this stage's boundaries from now on (a repair may need them)."""
        if self.boundary_log is None:
            self.boundary_log = BoundaryLog()

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
        self.channel = PeerChannel(self.transport)
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
            self.loss = self.agg_train_loss = torch.full((), float("nan"))  # nobody sends it again
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

    # ------------------------------------------------------------------ schedule and loop
    def _make_schedule(self, iteration: int) -> PlanSchedule:
        return PlanSchedule(self.plan, self.worker, self.workers.rank_of, iteration, synchronous=self.synchronous)

    def _train_schedule(self) -> PlanSchedule:
        if self.repair is not None:
            return PlanSchedule(self.plan, self.worker, self.workers.rank_of, self.iteration,
                                synchronous=self.synchronous, repair=self.repair)
        return self._schedules[min(self.iteration, len(self._schedules) - 1)]

    def is_reporter(self) -> bool:
        """True on the one rank that holds the iteration loss (the first live worker of the last stage)."""
        return self.global_rank == self.reporter_rank

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """Train on one global batch; returns its mean loss (over ``D x M`` micro-batches) on every live rank.

        As DeepSpeed's ``train_batch``. Under ``ds-recycle launch`` the engine's failure handler keeps it
        going through worker failures: a call returns once the iteration is complete, whoever computed it.
        ``data_iter`` (optional) replaces the data source: it must be addressable (see
        :meth:`ds_recycle.data.addressable.DeepSpeedOrder.from_data_iter`), because a peer may have to load another
        pipeline's micro-batches.
        """
        if data_iter is not None:
            self.data = self._addressable(data_iter)
        self._calls += 1
        if self._calls <= self.iteration:  # a restarted worker that joined at a later iteration: its loop catches up
            return torch.full((), float("nan"))
        return self.driver.train_batch()

    def run_iteration(self) -> torch.Tensor | None:
        """Run this worker's part of one iteration of the plan, then share its loss (see :meth:`_share_loss`).

        Returns the mean loss on the reporter, None elsewhere (``self.loss`` holds it on every rank). The loss
        broadcast belongs to the iteration: when a failure interrupts it, the iteration is redone with it.
        """
        self.module.train()
        self._iteration_loss = None
        started, repairing = time.perf_counter(), self.repair is not None
        schedule = self._train_schedule()
        if self.repair is None:
            self.progress = IterationProgress(self.iteration)
            if self.boundary_log is not None:
                self.boundary_log.begin(self.iteration)
        self._exec_schedule(schedule)
        self._iteration_loss = self._losses.get(self.iteration) if self.is_reporter() else None
        self._share_loss()
        # a repaired iteration's time includes the recovery: its instructions count
        self.clock.end_iteration(None if repairing else time.perf_counter() - started)
        self.repair = None
        self.iteration += 1
        return self._iteration_loss

    def _share_loss(self) -> torch.Tensor:
        """The last iteration's loss, from the reporter to every rank (DeepSpeed returns it everywhere).

        The reporter posts it and goes on (its send completes by the next iteration's end); the others wait
        for it. A loss nobody holds (a failure took its reporter right after the iteration) is NaN.
        """
        loss = self._iteration_loss
        value = torch.full((), float("nan")) if loss is None else loss.detach().float().reshape(()).clone()
        self.transport.share_loss(value, self.reporter_rank)
        self.loss = self.agg_train_loss = value
        return value

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """As DeepSpeed: ``fn`` post-processes each loaded micro-batch (Megatron-DeepSpeed's data path). It runs
        wherever the micro-batch runs: on a peer that loads a failed worker's micro-batch too."""
        self.batch_fn = fn

    def set_dataiterator(self, iterator: Any) -> None:
        """As DeepSpeed: train on ``iterator`` from the next ``train_batch`` (it must be addressable, as for
        ``train_batch(data_iter=...)``: a peer may have to load another pipeline's micro-batches). As in
        DeepSpeed, only the first and the last stage load data; the others ignore it."""
        if self.is_first_stage() or self.is_last_stage():
            self.data = self._addressable(iterator)

    def set_dataloader(self, loader: Any) -> None:
        """As DeepSpeed: train on ``loader`` (see :meth:`set_dataiterator`)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data = self._addressable(iter(loader))

    def was_step_applied(self) -> bool:
        """As DeepSpeed: whether the last ``train_batch`` stepped the optimizer. Every step is applied (no loss
        scaling, hence no skipped step), so True once one ran."""
        return self.global_steps > 0

    def get_global_grad_norm(self) -> float | None:
        """As DeepSpeed: the gradient norm of the last step (the clipping norm; None with clipping off)."""
        pending = self.stepper.pending_norm()
        return pending if pending is not None or self.last_step is None else self.last_step.norm

    def _addressable(self, data_iter: Any) -> MicroBatchSourceLike:
        """``data_iter`` as an addressable source (built once per iterator object: loops pass the same one)."""
        if data_iter is self._data_iter:
            return self.data
        from ds_recycle.data.addressable import as_addressable

        self._data_iter = data_iter
        return cast(MicroBatchSourceLike, as_addressable(data_iter, self.micro_batches, step=self.iteration,
                                                         data_parallel_size=self.workers.pipelines,
                                                         data_parallel_rank=self.worker[0]))

    def eval_batch(self, data_iter: Any, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None,
                   ) -> torch.Tensor:
        """Forward ``M`` micro-batches of every pipeline; their mean loss on every rank, as DeepSpeed returns it.

        Each pipeline reads its micro-batches from ``data_iter`` as in DeepSpeed (which must be addressable:
        a DataLoader with a DistributedSampler, or an object with ``micro_batch(step, pipeline, index)``,
        ``step`` counting this iterator's evaluations); a failed worker's micro-batches are forwarded by its
        peers, routed as the current plan routes training. Every live rank gets the mean over all ``D x M``.
        """
        if return_logits or not compute_loss or reduce_output != "avg" or num_micro_batches not in (None,
                                                                                                    self.micro_batches):
            raise ValueError("RecyclePipelineEngine.eval_batch returns the mean loss over the pipeline's "
                             "gradient_accumulation_steps micro-batches (return_logits=False, compute_loss=True, "
                             "reduce_output='avg', num_micro_batches=None)")
        if data_iter is not self._eval_iter:
            from ds_recycle.data.addressable import as_addressable

            self._eval_iter, self._eval_step = data_iter, 0
            self._eval_data = cast(MicroBatchSourceLike, as_addressable(
                data_iter, self.micro_batches, data_parallel_size=self.workers.pipelines,
                data_parallel_rank=self.worker[0]))
        step, self._eval_step = self._eval_step, self._eval_step + 1
        return self.driver.run(lambda: self.run_evaluation(step), "evaluation")

    def run_evaluation(self, step: int) -> torch.Tensor:
        """One evaluation pass at eval step ``step``; every rank returns the mean loss over all pipelines."""
        self._exec_finish_optimizer_step()  # evaluate the parameters of a final step
        self.module.eval()
        self._eval_sums = torch.zeros(self.workers.pipelines)
        schedule = PlanSchedule(self.plan, self.worker, self.workers.rank_of, step, synchronous=self.synchronous,
                                forward_only=True)
        evaluating, self._evaluating = self._evaluating, step
        try:
            with torch.no_grad():
                self._exec_schedule(schedule)
            self.channel.wait_sends()
        finally:
            self._evaluating = evaluating
            self.drop_slots()
            self.module.train()
        sums = self._eval_sums
        self.transport.all_reduce_members(sums, "evaluation loss")
        return sums.sum() / (self.workers.pipelines * self.micro_batches)

    def finish(self) -> StepOutcome | None:
        """Complete the last optimizer step (post-validation) and outstanding sends; call after training.

        Parameters read right after the last ``train_batch`` may still see a step that post-validation
        redoes with clipping; after ``finish`` (also run at exit) they are final.
        """
        self.driver.finish()
        return self.last_step

    def finish_local(self) -> StepOutcome | None:
        """:meth:`finish` on this worker alone (no failure handling)."""
        self._exec_finish_optimizer_step()
        self.channel.wait_sends()
        self.transport.flush()
        self.stepper.close()
        return self.last_step

    # ------------------------------------------------------------------ what a training loop reads
    def recycle_events(self) -> list[Event]:
        """Failures, agreements, plan switches, recoveries, rejoins, checkpoints since the last call
        (:mod:`ds_recycle.events`)."""
        return self.driver.drain_events()

    @property
    def live_workers(self) -> int:
        """Workers alive in the job now."""
        return self.workers.world_size

    @property
    def rerouted_microbatches(self) -> int:
        """(stage, micro-batch) pairs of an iteration processed by a worker of another pipeline, in the current plan.

        Computed once per plan (the failure handler replaces ``self.plan`` when the membership changes)."""
        cached = self._rerouted_cache
        if cached is None or cached[0] is not self.plan:
            cached = self._rerouted_cache = (self.plan, rerouted_microbatches(self.plan))
        return cached[1]

    def gather_final_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's final parameters by name (all stages) on the reporter; None on other ranks."""
        return self.driver.gather_final_state()

    # ------------------------------------------------------------------ checkpoints (DeepSpeed's layout)
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_checkpoint``, in its layout (:mod:`ds_recycle.engine.ds_checkpoint`); every rank calls it.

        Each stage's first live replica writes; ``latest`` follows once every stage is complete. The files
        load in vanilla DeepSpeed, and carry the data position (the next iteration).
        """
        if exclude_frozen_parameters:
            raise ValueError("exclude_frozen_parameters is not supported by RecyclePipelineEngine.save_checkpoint")
        if self._calls < self.iteration:  # a resumed loop catching up: the job saved its state at this step already
            return True
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        client = dict(client_state or {})

        def write() -> None:
            ds_checkpoint.write_stage(self, save_dir, tag, client)

        def latest() -> None:
            if save_latest:
                ds_checkpoint.write_latest(save_dir, tag)
        self.driver.save_checkpoint(save_dir, self.iteration, write, latest, named_by_engine=True)
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, dict[str, Any]]:
        """DeepSpeed's ``load_checkpoint`` (its layout): ``(path, client_state)``, or ``(None, {})`` with none.

        Training continues at the saved iteration, with the same data stream (unlike DeepSpeed's own resume,
        which restarts its loader). A worker that joined a running job keeps the live state it received.
        """
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn is not supported by RecyclePipelineEngine.load_checkpoint")
        if self.driver.joined_at is not None:
            self._calls = self.iteration  # this worker's state came from a live replica, newer than any checkpoint
            return None, {}
        only_module = load_module_only
        path, client = ds_checkpoint.read_stage(self, load_dir, None if tag is None else str(tag),
                                                load_optimizer_states=load_optimizer_states and not only_module,
                                                load_lr_scheduler_states=load_lr_scheduler_states and not only_module,
                                                strict=load_module_strict)
        if path is not None:
            self._calls = self.iteration
            self.driver.resumed_at(self.iteration, load_dir)
        return path, client

    def close(self) -> None:
        """End of training: the last step is final, the job's groups are released (every rank calls it once)."""
        if self._closed:
            return
        self._closed = True
        self.driver.close()
        self.timer.close()

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        hooks = self.hooks
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                handler = self._INSTRUCTION_MAP.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f"{type(self).__name__} has no handler for instruction {cmd!r}; "
                                       "register its exact type in _INSTRUCTION_MAP")
                if hooks is not None:
                    hooks.before_instruction(cmd)
                kind = self._timed_kind(cmd)
                if self.op_seconds is None and kind is None:
                    MethodType(handler, self)(**cmd.kwargs)
                    continue
                start = self.timer.now()
                mark = self.clock.begin() if kind is not None else None
                MethodType(handler, self)(**cmd.kwargs)
                seconds = max(0.0, self.timer.now() - start)
                if self.throttle != 1.0 and kind is not None:  # an injected slow accelerator
                    time.sleep(seconds * (self.throttle - 1.0))
                    seconds *= self.throttle
                if self.op_seconds is not None:
                    self.op_seconds[cmd.name].append(seconds)
                if kind is not None:
                    self.clock.end(kind, mark, seconds)

    def _timed_kind(self, cmd: Any) -> str | None:
        """The cost kind :attr:`clock` files a training instruction under (None: not timed)."""
        if self._evaluating is not None:
            return None
        return timed_kind(cmd, self._weights_pending, self.global_rank)

    def _weights_pending(self, buffer_id: int) -> bool:
        """Whether the micro-batch in ``buffer_id`` still has weight-gradient work (its W is a real W)."""
        slot = self.slots.get(buffer_id)
        return slot is not None and slot.weight_work is not None and bool(slot.weight_work.passes)

    def measured_costs(self) -> CostModel | None:
        """The costs per stage this job measured (every member's :attr:`clock`, summed over the members: a
        collective, every member calls it at the same point); None until every stage has timed a forward."""
        return self.driver.run(self._gather_costs, "measuring costs")

    def _gather_costs(self) -> CostModel | None:
        rows = torch.zeros(self.num_stages, len(KINDS), 2, dtype=torch.float64)
        rows[self.stage_id] = self.clock.as_row()
        self.transport.all_reduce_members(rows, "measured costs")
        return stage_costs(rows)

    def enable_op_timing(self) -> None:
        """Start recording per-instruction times in :attr:`op_seconds`."""
        self.op_seconds = defaultdict(list)

    # ------------------------------------------------------------------ IO and compute
    def _slot(self, buffer_id: int, micro_batch: ins.MicroBatch) -> _Slot:
        slot = self.slots.get(buffer_id)
        if slot is None or slot.mb != tuple(micro_batch):
            slot = _Slot((micro_batch[0], micro_batch[1]))
            self.slots[buffer_id] = slot
        return slot

    def _exec_load_micro_batch_of(self, buffer_id: int, micro_batch: ins.MicroBatch) -> None:
        slot = self._slot(buffer_id, micro_batch)
        if self._evaluating is None:
            batch = self.data.micro_batch(self.iteration, micro_batch[0], micro_batch[1])
        else:
            assert self._eval_data is not None, "eval_batch sets its data source before it runs"
            batch = self._eval_data.micro_batch(self._evaluating, micro_batch[0], micro_batch[1])
        if self.batch_fn is not None:  # as DeepSpeed's _next_batch
            batch = self.batch_fn(batch)
        if self.is_first_stage():  # as DeepSpeed: the first stage feeds batch[0], the last one's loss reads batch[1]
            slot.inputs = _to_device(batch[0], self.device)
        if self.is_last_stage():
            slot.labels = _to_device(batch[1], self.device)

    def _exec_forward_micro_batch(self, buffer_id: int, micro_batch: ins.MicroBatch) -> None:
        slot = self.slots[buffer_id]
        mb = slot.mb
        seeds = self.layer_seeds.micro_batch(self.iteration, mb[0], mb[1]) if self.layer_seeds is not None \
            else contextlib.nullcontext()
        with self.capture.capture() as captured, micro_batch_rng(self.rng_seed, self.iteration, mb[0], mb[1],
                                                                 self.stage_id), seeds:
            out = self.module(slot.inputs)
            if not self.is_last_stage():
                check_payload(out, f"the output of stage {self.stage_id} (layers {self.module._local_start}-"
                                   f"{self.module._local_stop - 1})")
            if self.is_last_stage():
                loss_fn = self.module.loss_fn
                loss = out if loss_fn is None else loss_fn(out, slot.labels)  # no loss_fn: the output is the loss
                if self._evaluating is not None:
                    self._eval_sums[mb[0]] += loss.detach().float().reshape(())
                    slot.output = None
                    return
                if slot.mb not in self.progress.loss_counted:  # a repaired iteration forwards some again
                    self.progress.loss_counted.add(slot.mb)
                    value = loss.detach().float()  # summed in fp32 (a bf16 loss too)
                    self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
                out = loss / self.micro_batches
        slot.output, slot.captured = out, captured

    def _exec_backward_input(self, buffer_id: int, micro_batch: ins.MicroBatch, weights: bool = False) -> None:
        slot = self.slots[buffer_id]
        assert slot.output is not None, f"B of {micro_batch} before its F"
        stage_input = None if self.is_first_stage() else slot.inputs
        if not (weights or self.capture.fused):
            try:
                slot.input_grad, slot.weight_work = backward_input(slot.output, slot.grad_output, stage_input,
                                                                   slot.captured, self.capture)
            except SplitUnsupported as why:
                logger.warning("stage %d runs its backward fused from now on (W empty, its bubbles unfilled): %s",
                               self.stage_id, why)
                self.capture.fused = True
        if weights or self.capture.fused:
            accumulate: Callable[[], None] = _nothing
            if self.row_order.ready(slot.mb, self.progress.w_done):
                with self.stepper.accumulating_for(*slot.mb):
                    slot.input_grad = backward_fused(slot.output, slot.grad_output, stage_input, self.capture,
                                                     plain=self.capture.fused)
            else:  # its weight gradient waits for its turn in the row (ds_recycle.engine.row_order)
                with self.stepper.setting_aside() as aside:
                    slot.input_grad = backward_fused(slot.output, slot.grad_output, stage_input, self.capture,
                                                     plain=self.capture.fused)
                accumulate = partial(self.stepper.add_to_row, slot.mb, aside)
            slot.weight_work = None
            self.row_order.submit(slot.mb, accumulate, self.progress.w_done)
        if slot.captured is not None:  # its outputs carry hooks that reference it: a cycle through the autograd
            slot.captured.clear()  # graph that Python's GC cannot free (it held each iteration's graph)
        slot.grad_output = slot.output = slot.captured = None

    def drop_slots(self) -> None:
        """Forget every micro-batch in flight (an interrupted iteration), releasing its autograd graph."""
        for slot in self.slots.values():
            if slot.captured is not None:  # the hook cycle would otherwise keep the slice's graph alive
                slot.captured.clear()
        self.slots = {}
        self.row_order.drop()

    def _exec_backward_weight(self, buffer_id: int, micro_batch: ins.MicroBatch) -> None:
        slot = self.slots.pop(buffer_id)
        work = slot.weight_work
        if work is None:  # its B ran fused and submitted the weight gradient
            assert slot.output is None, f"W of {micro_batch} before its B"
            return

        def accumulate() -> None:
            if work.passes:
                with self.stepper.accumulating_for(*slot.mb):
                    work.run()
        self.row_order.submit(slot.mb, accumulate, self.progress.w_done)

    # ------------------------------------------------------------------ communication
    def _exec_send_activation_to(self, buffer_id: int, micro_batch: ins.MicroBatch, peer: int) -> None:
        output = self.slots[buffer_id].output
        assert output is not None, f"no stage output for {micro_batch}"
        mb = (micro_batch[0], micro_batch[1])
        detached = _detached(output)
        self.channel.send(detached, peer, Channel.ACTIVATION, self.iteration, mb)
        if self.boundary_log is not None:
            self.boundary_log.record(self.iteration, Channel.ACTIVATION, Role.SENT, mb, detached, peer)

    def _exec_recv_activation_from(self, buffer_id: int, micro_batch: ins.MicroBatch, peer: int) -> None:
        slot = self._slot(buffer_id, micro_batch)
        mb = (micro_batch[0], micro_batch[1])
        if peer == self.global_rank:  # a repair: this worker received it before the failure
            assert self.boundary_log is not None
            received = _detached(self.boundary_log.get(self.iteration, Channel.ACTIVATION, Role.RECEIVED, mb))
        else:
            received = self.channel.recv_activation(peer, self.iteration, mb)
        if self.boundary_log is not None:
            self.boundary_log.record(self.iteration, Channel.ACTIVATION, Role.RECEIVED, mb, received, peer)
        for tensor in (received,) if isinstance(received, torch.Tensor) else received:
            if tensor.is_floating_point():  # as DeepSpeed: every floating-point input gets a gradient
                tensor.requires_grad_(True)
        slot.inputs = received

    def _exec_send_grad_to(self, buffer_id: int, micro_batch: ins.MicroBatch, peer: int) -> None:
        slot = self.slots[buffer_id]
        assert slot.input_grad is not None, f"no input gradient for {micro_batch}"
        mb = (micro_batch[0], micro_batch[1])
        self.channel.send(slot.input_grad, peer, Channel.GRAD, self.iteration, mb)
        if self.boundary_log is not None:
            self.boundary_log.record(self.iteration, Channel.GRAD, Role.SENT, mb, slot.input_grad, peer)
        slot.input_grad = None

    def _exec_recv_grad_from(self, buffer_id: int, micro_batch: ins.MicroBatch, peer: int) -> None:
        slot = self.slots[buffer_id]
        assert slot.output is not None, f"gradient for {micro_batch} before its F"
        mb = (micro_batch[0], micro_batch[1])
        if peer == self.global_rank:  # a repair: this worker received it before the failure
            assert self.boundary_log is not None
            slot.grad_output = self.boundary_log.get(self.iteration, Channel.GRAD, Role.RECEIVED, mb)
        else:
            slot.grad_output = self.channel.recv_like(grad_buffers(slot.output), peer, Channel.GRAD, self.iteration,
                                                      mb)
        if self.boundary_log is not None:
            self.boundary_log.record(self.iteration, Channel.GRAD, Role.RECEIVED, mb, slot.grad_output, peer)

    def _exec_send_logged_to(self, micro_batch: ins.MicroBatch, peer: int, grad: bool, received: bool) -> None:
        assert self.boundary_log is not None, "a repair that serves boundary logs needs the log"
        mb = (micro_batch[0], micro_batch[1])
        channel = Channel.GRAD if grad else Channel.ACTIVATION
        payload = self.boundary_log.get(self.iteration, channel, Role.RECEIVED if received else Role.SENT, mb)
        self.channel.send(_detached(payload), peer, channel, self.iteration, mb)

    def _exec_share_committed_norm(self) -> None:
        self.stepper.share_committed_norm(self.iteration)

    def _exec_wait_sends(self) -> None:
        self.channel.wait_sends()

    # ------------------------------------------------------------------ optimizer
    def _exec_staggered_optimizer_step(self, synchronous: bool) -> None:
        self.row_order.flush(self.progress.w_done, f"stage {self.stage_id}, iteration {self.iteration}")
        loss_sum = self._loss_sum if self.is_last_stage() else None
        if self.is_last_stage() and loss_sum is None:
            loss_sum = torch.zeros(())
        total = self.stepper.reduce(loss_sum)  # the rows are kept as they were until the step
        if self.tied:  # one gradient for every copy of a weight tied across stages
            reduce_tied(self.tied, self.global_rank == self.workers.stage_ranks(self.stage_id)[0],
                        self.transport.tied_all_reduce, holder=self.stepper.holder)
        if total is not None:
            self._losses[self.iteration] = total / (self.workers.pipelines * self.micro_batches)
            self._losses.pop(self.iteration - 2, None)
        self.progress.awaiting_norm = True
        self._exec_complete_optimizer_step(synchronous)

    def _exec_complete_optimizer_step(self, synchronous: bool = False) -> None:
        if self.hooks is not None:
            self.hooks.before_step()
        self.stepper.step(self.iteration, synchronous)
        self.progress.stepped = True
        if self.boundary_log is not None:
            self.boundary_log.stepped(self.iteration)
        self._loss_sum = None
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _exec_finish_optimizer_step(self) -> None:
        outcome = self.stepper.finish()
        if outcome is not None:
            self.last_step = outcome

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ins.LoadMicroBatchOf: _exec_load_micro_batch_of,
        ins.ForwardMicroBatch: _exec_forward_micro_batch,
        ins.BackwardInput: _exec_backward_input,
        ins.BackwardWeight: _exec_backward_weight,
        ins.SendActivationTo: _exec_send_activation_to,
        ins.RecvActivationFrom: _exec_recv_activation_from,
        ins.SendGradTo: _exec_send_grad_to,
        ins.RecvGradFrom: _exec_recv_grad_from,
        ins.WaitSends: _exec_wait_sends,
        ins.StaggeredOptimizerStep: _exec_staggered_optimizer_step,
        ins.FinishOptimizerStep: _exec_finish_optimizer_step,
        ins.SendLoggedTo: _exec_send_logged_to,
        ins.ShareCommittedNorm: _exec_share_committed_norm,
        ins.CompleteOptimizerStep: _exec_complete_optimizer_step,
    }


for _name in surface.REFUSED:  # DeepSpeed's calls that would be silently wrong here raise at the call
    setattr(RecyclePipelineEngine, _name, surface.refusal(_name))
