"""The ReCycle instruction set: DeepSpeed pipe instructions that name a micro-batch and a peer.

Every instruction subclasses DeepSpeed's own classes, so ``repr`` and the ``**kwargs`` flow to the
engine's handler work as in DeepSpeed (``handler(engine, **cmd.kwargs)``). DeepSpeed's engine dispatches
on the *exact* type, so each class here is registered explicitly in
:attr:`ds_recycle.engine.engine.RecyclePipelineEngine._INSTRUCTION_MAP`.

Common keyword arguments:

- ``buffer_id``: the slot that holds the micro-batch's tensors on this worker, from its F to its W
  (:class:`~ds_recycle.engine.schedule.PlanSchedule` allocates slots; their count is the worker's peak
  number of micro-batches in flight);
- ``micro_batch``: ``(owner pipeline, index)`` of the global micro-batch;
- ``peer``: the *global rank* of the worker on the other end of a transfer, which may belong to
  another pipeline when work is re-routed around an absent worker.

Communication never blocks on the sender, and is issued in one global order. The engine lowers each worker's ops
with :class:`PostTransfers` before its computes: every send and receive of the worker is posted in the order the
transfers of the whole job match (:mod:`ds_recycle.engine.issue`), together with those that travel beside it (one
NCCL group). A send instruction hands its tensors to the channel; a receive instruction waits (bounded by the p2p
group's timeout) for a receive posted earlier; :class:`WaitSends` completes the sends. Any per-worker op order
that the planner's simulator runs without deadlock is therefore deadlock-free here, under gloo's matching and
NCCL's alike.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepspeed.runtime.pipe.schedule import (
    BufferOpInstruction,
    ForwardPass,
    LoadMicroBatch,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)

__all__ = ["MicroBatch", "LoadMicroBatchOf", "ForwardMicroBatch", "BackwardInput", "BackwardWeight",
           "SendActivationTo", "RecvActivationFrom", "SendGradTo", "RecvGradFrom", "WaitSends",
           "StaggeredOptimizerStep", "FinishOptimizerStep", "SendLoggedTo", "ShareCommittedNorm",
           "CompleteOptimizerStep", "PostTransfers", "Transfer", "RECYCLE_INSTRUCTIONS"]

MicroBatch = tuple[int, int]
"""A global micro-batch: ``(owner pipeline, index within the pipeline)``."""


# IO
class LoadMicroBatchOf(LoadMicroBatch):
    """Roughly: ``inputs, labels = source.micro_batch(iteration, *micro_batch)`` into ``buffer_id``.

    The first stage keeps the inputs, the last stage the labels (a single-stage worker both). The micro-batch
    may belong to another pipeline (the worker serves an absent peer). Pairs with nothing; never blocks.
    """


# Compute
class ForwardMicroBatch(ForwardPass):
    """Roughly: ``outputs[buffer_id] = stage(inputs[buffer_id])``; on the last stage also the loss.

    Must follow :class:`LoadMicroBatchOf` (first stage) or :class:`RecvActivationFrom`. Local; never blocks.
    """


class BackwardInput(BufferOpInstruction):
    """Roughly: ``inputs[buffer_id].grad = d loss / d inputs`` (B), keeping what W needs.

    Computes only input gradients (and the gradients at each parameterized module's output, which W
    consumes); no parameter ``.grad`` is touched. Needs the output gradient (:class:`RecvGradFrom`) except
    on the last stage. Local; never blocks. With ``weights=True`` (the next op is this micro-batch's W) it
    runs one fused backward that also accumulates the weight gradients, and the W only frees the buffer.
    """


class BackwardWeight(BufferOpInstruction):
    """Roughly: ``param.grad += d loss / d param`` for the micro-batch (W), then frees the buffer.

    Runs one autograd pass per parameterized module over that module's own nodes, from the output gradients
    B kept. Must come after the same micro-batch's :class:`BackwardInput`. Local; never blocks.
    """


# Communication
@dataclass(frozen=True)
class Transfer:
    """One point-to-point operation of a worker: ``kind`` (``"send"`` or ``"recv"``) of ``channel``
    (``"activation"`` or ``"grad"``) for micro-batch ``mb`` with global rank ``peer``."""

    kind: str
    peer: int
    channel: str
    mb: MicroBatch

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        return f"{self.kind} {self.channel} {self.mb[0]}.{self.mb[1]} {arrow} rank {self.peer}"


class PostTransfers(PipeInstruction):
    """Roughly: post ``transfers`` (a tuple of :class:`Transfer`) together, in order: one NCCL group.

    A send posts the tensors its :class:`SendActivationTo`, :class:`SendGradTo` or :class:`SendLoggedTo` handed
    over in an earlier step; a receive posts the buffers that a later :class:`RecvActivationFrom` or
    :class:`RecvGradFrom` waits for. Placed before a compute (or at the end of the iteration) by
    :mod:`ds_recycle.engine.issue`, so that every worker posts its transfers in the order they match. Never blocks,
    but for the first activation from a peer: its shapes come in a header, which it waits for.
    """


class SendActivationTo(SendActivation):
    """Roughly: ``isend(outputs[buffer_id], peer)``; the peer runs the next stage of ``micro_batch``.

    Pairs with the peer's :class:`RecvActivationFrom` of the same micro-batch. Hands the tensors over; a
    :class:`PostTransfers` posts them and :class:`WaitSends` completes them.
    """


class RecvActivationFrom(RecvActivation):
    """Roughly: ``inputs[buffer_id] = recv(peer)`` (the previous stage's output for ``micro_batch``).

    Pairs with the peer's :class:`SendActivationTo`. Blocks until the tensor arrives (bounded by the p2p
    group's timeout) into the buffers an earlier :class:`PostTransfers` posted.
    """


class SendGradTo(SendGrad):
    """Roughly: ``isend(inputs[buffer_id].grad, peer)``, to the worker that ran the previous stage.

    Follows :class:`BackwardInput`; pairs with the peer's :class:`RecvGradFrom`. Hands the tensors over, as
    :class:`SendActivationTo`.
    """


class RecvGradFrom(RecvGrad):
    """Roughly: ``grad_output[buffer_id] = recv(peer)`` from the worker that ran the next stage.

    Pairs with the peer's :class:`SendGradTo`. Blocks (bounded). The received tensor is owned by the buffer,
    so W can run long after.
    """


class WaitSends(PipeInstruction):
    """Roughly: wait until every posted send of this worker has been received (bounded).

    Issued right before the iteration's :class:`StaggeredOptimizerStep`: a stage steps only once everything
    it sent in the iteration is held by its receivers (see :mod:`ds_recycle.engine.boundary_log`).
    """


class SendLoggedTo(PipeInstruction):
    """Roughly: ``isend(boundary_log[iteration, micro_batch], peer)``: a tensor sent or received earlier.

    Only in the repair of an interrupted iteration: a worker whose neighbouring stage has stepped already (and
    so cannot compute it again) gets the activation (``grad=False``) or output gradient (``grad=True``) of
    ``micro_batch`` from whoever holds it: the worker that sent it (``received=False``) or the one that
    received it (``received=True``). Pairs with the peer's :class:`RecvActivationFrom` or
    :class:`RecvGradFrom`; hands the tensors over, as :class:`SendActivationTo`.
    """


# Optimizer
class StaggeredOptimizerStep(PipeInstruction):
    """Roughly: all-reduce this stage's gradients over its live replicas, then step (O).

    Synchronizes only the live replicas of this stage. Gradients are summed, then scaled by ``1/D`` (the
    nominal pipeline count): each stage's gradient is the sum over all ``D x M`` global micro-batches,
    normalized by their count, whoever processed them. The last stage also sums its losses there. With
    clipping on, the step waits for the clipping norm (which the first stage posts at its own step); each
    stage steps as soon as its gradients and the norm are there, not at a pipeline-wide barrier.
    """


class FinishOptimizerStep(PipeInstruction):
    """Roughly: complete the previous step: zero the gradients, step the learning-rate schedule.

    Issued before the first op of an iteration (and when training ends). A first-stage replica that is not
    the norm's source also waits for its part in the norm broadcast here. A no-op when nothing is pending.
    """


class ShareCommittedNorm(PipeInstruction):
    """Roughly: take part in the iteration's clipping-norm exchange with the contribution kept from its step.

    Only in the repair of an interrupted iteration, on a worker whose stage had stepped it already, while
    other stages redo their part (the exchange is collective over every live worker). Blocks (bounded).
    """


class CompleteOptimizerStep(PipeInstruction):
    """Roughly: the step of an iteration whose gradients this stage had already reduced when a failure came.

    Only in the repair of an interrupted iteration, on a worker that had its stage's reduced (and tied-weight
    summed) gradients and waited only for the clipping norm: it takes part in the norm exchange, clips and
    steps, with no reduction. Blocks (bounded).
    """


RECYCLE_INSTRUCTIONS: tuple[type[PipeInstruction], ...] = (
    LoadMicroBatchOf, ForwardMicroBatch, BackwardInput, BackwardWeight, SendActivationTo, RecvActivationFrom,
    SendGradTo, RecvGradFrom, WaitSends, StaggeredOptimizerStep, FinishOptimizerStep, SendLoggedTo,
    ShareCommittedNorm, CompleteOptimizerStep, PostTransfers)
"""The closed set the engine executes (besides DeepSpeed's own)."""
