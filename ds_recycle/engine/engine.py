"""``RecyclePipelineEngine``: DeepSpeed's ``PipelineEngine`` executing ReCycle plans.

What changes against DeepSpeed's engine (everything else, the module, the optimizer, the config, is
DeepSpeed's):

- ``train_batch`` runs a :class:`~ds_recycle.engine.schedule.PlanSchedule` for this worker instead of the
  hard-coded ``TrainSchedule``, its transfers issued in the job's match order (:mod:`ds_recycle.engine.issue`),
  and returns the iteration's loss on the reporting rank only (no pipeline-wide loss broadcast: the last stage
  folds its loss sum into its gradient all-reduce);
- ``_INSTRUCTION_MAP`` is re-declared: DeepSpeed binds function objects and looks them up by exact type,
  so every ReCycle instruction is registered with its own small ``_exec_*`` handler
  (:mod:`ds_recycle.engine.handlers`);
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
  launch``, through the hook surface of :mod:`ds_recycle.engine.driver` (the engine side:
  :mod:`ds_recycle.engine.failure_surface`; nothing else writes the engine).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any, cast

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import engine as ds_pipe_engine
from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_recycle.engine import ds_checkpoint, surface
from ds_recycle.engine.backward import (
    OwnerCapture,
)
from ds_recycle.engine.boundary_log import BoundaryLog
from ds_recycle.engine.driver import Driver, EngineHooks, LocalDriver
from ds_recycle.engine.failure_surface import FailureSurface
from ds_recycle.engine.handlers import HANDLERS, MicroBatchSourceLike, Slot
from ds_recycle.engine.issue import IssuedSchedule, issued_schedule
from ds_recycle.engine.layer_move import (
    PendingMove,
    held_layers,
    movable_reason,
    pinned_layers,
)
from ds_recycle.engine.op_clock import KINDS, DeviceTimer, OpClock, stage_costs, timed_kind
from ds_recycle.engine.optimizer import ClipScope, NormLayout, StaggeredOptimizer, StepOutcome
from ds_recycle.engine.p2p import PeerChannel
from ds_recycle.engine.position import IterationProgress
from ds_recycle.engine.precision import MasterWeightOptimizer
from ds_recycle.engine.recompute import use_recompute
from ds_recycle.engine.rng import LayerSeeds
from ds_recycle.engine.row_order import RowOrder
from ds_recycle.engine.schedule import PlanLike, Repair, check_plan_for_job, rerouted_microbatches
from ds_recycle.engine.tied import tied_members, tied_weights
from ds_recycle.engine.transport import DistTransport, Transport
from ds_recycle.events import Event
from ds_recycle.plan.costs import CostModel
from ds_recycle.runtime.grid import SurvivorGrid

__all__ = ["MicroBatchSourceLike", "RecyclePipelineEngine", "rerouted_pipelines", "served_pipelines"]

logger = logging.getLogger(__name__)


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


class RecyclePipelineEngine(FailureSurface, PipelineEngine):
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
        self.channel = PeerChannel(self.transport, device=self.device, issued=True)
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
        self.slots: dict[int, Slot] = {}
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
        self._eval_sums = torch.zeros(0, device=self.device)
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

    # ------------------------------------------------------------------ schedule and loop
    def _make_schedule(self, iteration: int) -> IssuedSchedule:
        return issued_schedule(self.plan, self.worker, self.workers.rank_of, iteration, synchronous=self.synchronous)

    def _train_schedule(self) -> IssuedSchedule:
        if self.repair is not None:
            return issued_schedule(self.plan, self.worker, self.workers.rank_of, self.iteration,
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
            return torch.full((), float("nan"), device=self.device)
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
        value = (torch.full((), float("nan"), device=self.device) if loss is None
                 else loss.detach().float().reshape(()).clone())
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
        self._eval_sums = torch.zeros(self.workers.pipelines, device=self.device)
        schedule = issued_schedule(self.plan, self.worker, self.workers.rank_of, step, synchronous=self.synchronous,
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

    def finish(self, keep_final_state: bool = False) -> StepOutcome | None:
        """Complete the last optimizer step (post-validation) and outstanding sends; call after training.

        Parameters read right after the last ``train_batch`` may still see a step that post-validation
        redoes with clipping; after ``finish`` (also run at exit) they are final. ``keep_final_state``: a
        :meth:`gather_final_state` follows; each stage's parameters are kept for it before the members agree
        that training ended, so a member lost afterwards cannot take them away.
        """
        self.driver.finish(keep_final_state)
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
        rows = torch.zeros(self.num_stages, len(KINDS), 2, dtype=torch.float64, device=self.transport.device)
        rows[self.stage_id] = self.clock.as_row()
        self.transport.all_reduce_members(rows, "measured costs")
        return stage_costs(rows)

    def enable_op_timing(self) -> None:
        """Start recording per-instruction times in :attr:`op_seconds`."""
        self.op_seconds = defaultdict(list)

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, **HANDLERS}


for _name in surface.REFUSED:  # DeepSpeed's calls that would be silently wrong here raise at the call
    setattr(RecyclePipelineEngine, _name, surface.refusal(_name))
