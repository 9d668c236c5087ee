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
  neighbours only) is skipped.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Protocol

import torch
from deepspeed.runtime.pipe import engine as ds_pipe_engine
from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_recycle.engine import instructions as ins
from ds_recycle.engine.backward import OwnerCapture, WeightGradWork, backward_fused, backward_input
from ds_recycle.engine.optimizer import ClipScope, StaggeredOptimizer, StepOutcome
from ds_recycle.engine.p2p import Channel, PeerChannel
from ds_recycle.engine.schedule import PlanLike, PlanSchedule, Repair, check_plan_for_job
from ds_recycle.runtime.grid import SurvivorGrid

__all__ = ["IterationProgress", "MicroBatchSourceLike", "RecyclePipelineEngine", "rerouted_pipelines",
           "served_pipelines"]

logger = logging.getLogger(__name__)


class MicroBatchSourceLike(Protocol):
    """Exactly-once data: ``micro_batch(iteration, pipeline, index) -> (inputs, labels)``, a pure function."""

    def micro_batch(self, iteration: int, pipeline: int, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class _Slot:
    """One micro-batch in flight on this worker, from its F to its W."""

    mb: ins.MicroBatch
    inputs: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    output: torch.Tensor | None = None
    """Stage output (the scaled loss on the last stage): the root of B."""
    captured: Any = None
    grad_output: torch.Tensor | None = None
    input_grad: torch.Tensor | None = None
    weight_work: WeightGradWork | None = None


@dataclass
class IterationProgress:
    """What this worker has finished of ``iteration`` (the failure handler salvages it after a failure)."""

    iteration: int
    w_done: set[ins.MicroBatch] = field(default_factory=set)
    """Micro-batches whose weight gradient is accumulated (W, or a fused B+W, ran)."""
    loss_counted: set[ins.MicroBatch] = field(default_factory=set)
    """Last stage: micro-batches whose loss is in the iteration's loss sum."""
    stepping: bool = False
    """The stage's gradient all-reduce completed (then the step follows): nothing of it can be salvaged."""


def served_pipelines(plan: PlanLike, worker: tuple[int, int]) -> tuple[frozenset[int], bool]:
    """Owner pipelines of ``worker``'s micro-batches, and whether any replica of its stage serves several."""
    stage = worker[1]
    served: dict[tuple[int, int], set[int]] = {}
    for d in range(plan.pipelines):
        for i in range(plan.microbatches):
            served.setdefault(plan.worker_of(stage, (d, i)), set()).add(d)
    return frozenset(served.get(worker, set())), any(len(v) > 1 for v in served.values())


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

    def __init__(self, *, plan: PlanLike, data: MicroBatchSourceLike, clip_scope: ClipScope = ClipScope.FIRST_STAGE,
                 **deepspeed_kwargs: Any) -> None:
        with _without_pipe_handshake():
            super().__init__(**deepspeed_kwargs)
        if not isinstance(self.grid, SurvivorGrid):
            raise TypeError("RecyclePipelineEngine needs a PipelineModule built on a SurvivorGrid "
                            "(use ds_recycle.initialize)")
        self.workers = self.grid.workers
        self.worker = (self.grid.data_parallel_id, self.stage_id)
        check_plan_for_job(plan, self.num_stages, self.workers.pipelines, self.micro_batches, self.workers.absent())
        self.plan = plan
        self.data = data
        self.synchronous = plan.optimizer == "synchronous"
        self._schedules = [self._make_schedule(k) for k in range(plan.iterations)]
        self.capture = OwnerCapture(self.module)
        served, stage_rerouted = served_pipelines(plan, self.worker)
        self.channel = PeerChannel(self.grid.p2p_group, self.workers.pipelines, self.micro_batches)
        self.stepper = StaggeredOptimizer(
            self.module, self.optimizer, stage=self.stage_id, pipelines=self.workers.pipelines,
            dp_group=self.grid.get_data_parallel_group(), dp_ranks=self.grid.get_data_parallel_group_ranks(),
            norm_group=self.grid.norm_group, max_norm=self.gradient_clipping(), scope=clip_scope,
            lr_scheduler=self.lr_scheduler, served=served, stage_rerouted=stage_rerouted,
            norm_source=min(self.workers.stage_ranks(0)), rerouted_pipelines=rerouted_pipelines(plan, self.stage_id),
            microbatches=self.micro_batches)
        self.reporter_rank = min(self.workers.stage_ranks(self.num_stages - 1))
        self.iteration = 0
        self.slots: dict[int, _Slot] = {}
        self._loss_sum: torch.Tensor | None = None
        self._iteration_loss: torch.Tensor | None = None
        self.last_step: StepOutcome | None = None
        self.progress = IterationProgress(-1)
        self.repair: Repair | None = None
        """When set, the next ``train_batch`` runs only what is left of the interrupted iteration."""
        self.op_seconds: dict[str, list[float]] | None = None
        """When a dict, each executed instruction's wall time is appended under its class name."""

    # ------------------------------------------------------------------ schedule and loop
    def _make_schedule(self, iteration: int) -> PlanSchedule:
        return PlanSchedule(self.plan, self.worker, self.workers.rank_of, iteration, synchronous=self.synchronous)

    def _train_schedule(self) -> PlanSchedule:  # type: ignore[override]
        if self.repair is not None:
            return PlanSchedule(self.plan, self.worker, self.workers.rank_of, self.iteration,
                                synchronous=self.synchronous, repair=self.repair)
        return self._schedules[min(self.iteration, len(self._schedules) - 1)]

    def is_reporter(self) -> bool:
        """True on the one rank that holds the iteration loss (the first live worker of the last stage)."""
        return self.global_rank == self.reporter_rank

    def train_batch(self, data_iter: Any = None) -> torch.Tensor | None:  # type: ignore[override]
        """Run one iteration of the plan; returns the mean loss over the ``D x M`` micro-batches on the reporter.

        Data comes from the engine's ``MicroBatchSource`` (``data_iter`` must be None).
        """
        if data_iter is not None:
            raise ValueError("RecyclePipelineEngine reads micro-batches from its MicroBatchSource; pass no data_iter")
        self.module.train()
        self._iteration_loss = None
        schedule = self._train_schedule()
        if self.repair is None:
            self.progress = IterationProgress(self.iteration)
        self._exec_schedule(schedule)
        self.repair = None
        self.iteration += 1
        return self._iteration_loss

    def eval_batch(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Not supported: DeepSpeed's evaluation schedule talks to same-pipeline neighbours only."""
        raise NotImplementedError("RecyclePipelineEngine does not evaluate: DeepSpeed's eval_batch uses "
                                  "same-pipeline p2p and a WORLD barrier; evaluate with the vanilla engine")

    def finish(self) -> StepOutcome | None:
        """Complete the last optimizer step (post-validation) and outstanding sends; call after training."""
        self._exec_finish_optimizer_step()
        self.channel.wait_sends()
        self.stepper.close()
        return self.last_step

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                handler = self._INSTRUCTION_MAP.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f"{type(self).__name__} has no handler for instruction {cmd!r}; "
                                       "register its exact type in _INSTRUCTION_MAP")
                if self.op_seconds is None:
                    MethodType(handler, self)(**cmd.kwargs)
                    continue
                start = time.perf_counter()
                MethodType(handler, self)(**cmd.kwargs)
                self.op_seconds[cmd.name].append(time.perf_counter() - start)

    def enable_op_timing(self) -> None:
        """Start recording per-instruction wall times in :attr:`op_seconds`."""
        self.op_seconds = defaultdict(list)

    # ------------------------------------------------------------------ IO and compute
    def _slot(self, buffer_id: int, micro_batch: ins.MicroBatch) -> _Slot:
        slot = self.slots.get(buffer_id)
        if slot is None or slot.mb != tuple(micro_batch):
            slot = _Slot(tuple(micro_batch))
            self.slots[buffer_id] = slot
        return slot

    def _exec_load_micro_batch_of(self, buffer_id: int, micro_batch: ins.MicroBatch) -> None:
        slot = self._slot(buffer_id, micro_batch)
        inputs, labels = self.data.micro_batch(self.iteration, micro_batch[0], micro_batch[1])
        if self.is_first_stage():
            slot.inputs = inputs.to(self.device)
        if self.is_last_stage():
            slot.labels = labels.to(self.device)

    def _exec_forward_micro_batch(self, buffer_id: int, micro_batch: ins.MicroBatch) -> None:
        slot = self.slots[buffer_id]
        with self.capture.capture() as captured:
            out = self.module(slot.inputs)
            if self.is_last_stage():
                loss = self.module.loss_fn(out, slot.labels)
                if slot.mb not in self.progress.loss_counted:  # a repaired iteration forwards some again
                    self.progress.loss_counted.add(slot.mb)
                    self._loss_sum = loss.detach() if self._loss_sum is None else self._loss_sum + loss.detach()
                out = loss / self.micro_batches
        slot.output, slot.captured = out, captured

    def _exec_backward_input(self, buffer_id: int, micro_batch: ins.MicroBatch, weights: bool = False) -> None:
        slot = self.slots[buffer_id]
        stage_input = None if self.is_first_stage() else slot.inputs
        if weights:
            with self.stepper.accumulating_for(*micro_batch):
                slot.input_grad = backward_fused(slot.output, slot.grad_output, stage_input, self.capture)
            slot.weight_work = WeightGradWork([])
            self.progress.w_done.add(slot.mb)
        else:
            slot.input_grad, slot.weight_work = backward_input(slot.output, slot.grad_output, stage_input,
                                                               slot.captured, self.capture)
        if slot.captured is not None:  # its outputs carry hooks that reference it: a cycle through the autograd
            slot.captured.outputs.clear()  # graph that Python's GC cannot free (it held each iteration's graph)
        slot.grad_output = slot.output = slot.captured = None

    def drop_slots(self) -> None:
        """Forget every micro-batch in flight (an interrupted iteration), releasing its autograd graph."""
        for slot in self.slots.values():
            if slot.captured is not None:  # the hook cycle would otherwise keep the slice's graph alive
                slot.captured.outputs.clear()
        self.slots = {}

    def _exec_backward_weight(self, buffer_id: int, micro_batch: ins.MicroBatch) -> None:
        slot = self.slots.pop(buffer_id)
        assert slot.weight_work is not None, f"W of {micro_batch} before its B"
        if slot.weight_work.passes:
            with self.stepper.accumulating_for(*micro_batch):
                slot.weight_work.run()
        self.progress.w_done.add(slot.mb)

    # ------------------------------------------------------------------ communication
    def _exec_send_activation_to(self, buffer_id: int, micro_batch: ins.MicroBatch, peer: int) -> None:
        self.channel.send(self.slots[buffer_id].output.detach(), peer, Channel.ACTIVATION, self.iteration,
                          tuple(micro_batch))

    def _exec_recv_activation_from(self, buffer_id: int, micro_batch: ins.MicroBatch, peer: int) -> None:
        slot = self._slot(buffer_id, micro_batch)
        slot.inputs = self.channel.recv_activation(peer, self.iteration, tuple(micro_batch)).requires_grad_(True)

    def _exec_send_grad_to(self, buffer_id: int, micro_batch: ins.MicroBatch, peer: int) -> None:
        slot = self.slots[buffer_id]
        assert slot.input_grad is not None, f"no input gradient for {micro_batch}"
        self.channel.send(slot.input_grad, peer, Channel.GRAD, self.iteration, tuple(micro_batch))
        slot.input_grad = None

    def _exec_recv_grad_from(self, buffer_id: int, micro_batch: ins.MicroBatch, peer: int) -> None:
        slot = self.slots[buffer_id]
        buffer = torch.empty_like(slot.output)
        slot.grad_output = self.channel.recv_like(buffer, peer, Channel.GRAD, self.iteration, tuple(micro_batch))

    def _exec_wait_sends(self) -> None:
        self.channel.wait_sends()

    # ------------------------------------------------------------------ optimizer
    def _exec_staggered_optimizer_step(self, synchronous: bool) -> None:
        loss_sum = self._loss_sum if self.is_last_stage() else None
        if self.is_last_stage() and loss_sum is None:
            loss_sum = torch.zeros(())
        total = self.stepper.reduce(loss_sum)
        self.progress.stepping = True  # the stage's gradients are reduced: from here on the iteration is whole
        self._loss_sum = None
        if total is not None and self.is_reporter():
            self._iteration_loss = total / (self.workers.pipelines * self.micro_batches)
        self.stepper.step(self.iteration, synchronous)
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
    }
