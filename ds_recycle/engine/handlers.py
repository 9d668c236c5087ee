"""The handlers of ReCycle's instructions: what :class:`~ds_recycle.engine.engine.RecyclePipelineEngine` runs for
each instruction of its plan's schedule (:mod:`ds_recycle.engine.instructions`), one small method each.

:class:`InstructionHandlers` is mixed into the engine; DeepSpeed's ``PipelineEngine`` dispatches on the exact type of
each instruction through ``_INSTRUCTION_MAP``, which takes :data:`HANDLERS` (a subclass of the engine that overrides a
handler registers its own function under the same type). The state the handlers read and write is the engine's and
is declared below: a micro-batch in flight is a :class:`Slot`, from its F to its W, keyed by its buffer id.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

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
from ds_recycle.engine.driver import EngineHooks
from ds_recycle.engine.optimizer import StaggeredOptimizer, StepOutcome
from ds_recycle.engine.p2p import Channel, Payload, PeerChannel, check_payload
from ds_recycle.engine.position import IterationProgress
from ds_recycle.engine.rng import LayerSeeds, micro_batch_rng
from ds_recycle.engine.row_order import RowOrder
from ds_recycle.engine.tied import TiedWeight, reduce_tied
from ds_recycle.engine.transport import Transport
from ds_recycle.runtime.grid import WorkerMap

__all__ = ["HANDLERS", "InstructionHandlers", "MicroBatchSourceLike", "Slot"]

logger = logging.getLogger(__name__)


class MicroBatchSourceLike(Protocol):
    """Exactly-once data: ``micro_batch(iteration, pipeline, index) -> (inputs, labels)``, a pure function."""

    def micro_batch(self, iteration: int, pipeline: int, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Slot:
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


class InstructionHandlers:
    """The ``_exec_*`` handlers of the ReCycle instructions (mixed into the engine, which sets this state)."""

    # the engine's state the handlers use (set by RecyclePipelineEngine.__init__ and its epoch changes)
    module: Any
    device: torch.device
    stage_id: int
    global_rank: int
    micro_batches: int
    iteration: int
    slots: dict[int, Slot]
    data: MicroBatchSourceLike
    batch_fn: Callable[[Any], Any] | None
    capture: OwnerCapture
    layer_seeds: LayerSeeds | None
    rng_seed: int
    progress: IterationProgress
    row_order: RowOrder
    stepper: StaggeredOptimizer
    channel: PeerChannel
    transport: Transport
    boundary_log: BoundaryLog | None
    workers: WorkerMap
    tied: list[TiedWeight]
    hooks: EngineHooks | None
    last_step: StepOutcome | None
    global_steps: int
    global_samples: int
    _loss_sum: torch.Tensor | None
    _losses: dict[int, torch.Tensor]
    _evaluating: int | None
    _eval_data: MicroBatchSourceLike | None
    _eval_sums: torch.Tensor
    # DeepSpeed's PipelineEngine's
    is_first_stage: Callable[[], bool]
    is_last_stage: Callable[[], bool]
    train_batch_size: Callable[[], int]

    # ------------------------------------------------------------------ IO and compute
    def _slot(self, buffer_id: int, micro_batch: ins.MicroBatch) -> Slot:
        slot = self.slots.get(buffer_id)
        if slot is None or slot.mb != tuple(micro_batch):
            slot = Slot((micro_batch[0], micro_batch[1]))
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
    def _exec_post_transfers(self, transfers: tuple[ins.Transfer, ...]) -> None:
        self.channel.post(transfers, self.iteration, self._grad_like)

    def _grad_like(self, mb: ins.MicroBatch) -> Payload:
        """Empty buffers for the output gradient of ``mb`` (its forward ran on this worker)."""
        for slot in self.slots.values():
            if slot.mb == tuple(mb) and slot.output is not None:
                return grad_buffers(slot.output)
        raise RuntimeError(f"iteration {self.iteration}: the output gradient of micro-batch {mb[0]}.{mb[1]} is posted "
                           "before its forward ran on this worker (the schedule's transfers are out of order)")

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
            received = _detached(self.boundary_log.get(self.iteration, Channel.ACTIVATION, Role.RECEIVED, mb,
                                                       self.device))
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
            slot.grad_output = self.boundary_log.get(self.iteration, Channel.GRAD, Role.RECEIVED, mb, self.device)
        else:
            output = slot.output
            slot.grad_output = self.channel.recv_like(lambda: grad_buffers(output), peer, Channel.GRAD, self.iteration,
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
            loss_sum = torch.zeros((), device=self.device)
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


HANDLERS: dict[type[Any], Callable[..., None]] = {
    ins.LoadMicroBatchOf: InstructionHandlers._exec_load_micro_batch_of,
    ins.ForwardMicroBatch: InstructionHandlers._exec_forward_micro_batch,
    ins.BackwardInput: InstructionHandlers._exec_backward_input,
    ins.BackwardWeight: InstructionHandlers._exec_backward_weight,
    ins.PostTransfers: InstructionHandlers._exec_post_transfers,
    ins.SendActivationTo: InstructionHandlers._exec_send_activation_to,
    ins.RecvActivationFrom: InstructionHandlers._exec_recv_activation_from,
    ins.SendGradTo: InstructionHandlers._exec_send_grad_to,
    ins.RecvGradFrom: InstructionHandlers._exec_recv_grad_from,
    ins.WaitSends: InstructionHandlers._exec_wait_sends,
    ins.StaggeredOptimizerStep: InstructionHandlers._exec_staggered_optimizer_step,
    ins.FinishOptimizerStep: InstructionHandlers._exec_finish_optimizer_step,
    ins.SendLoggedTo: InstructionHandlers._exec_send_logged_to,
    ins.ShareCommittedNorm: InstructionHandlers._exec_share_committed_norm,
    ins.CompleteOptimizerStep: InstructionHandlers._exec_complete_optimizer_step,
}
"""Each ReCycle instruction type and its handler (the engine's ``_INSTRUCTION_MAP`` adds them to DeepSpeed's)."""
