"""The staggered optimizer step: per-stage gradient all-reduce, eager step, post-validated clipping.

Semantics (each stage, each iteration):

1. **Weighted-sum all-reduce.** Every micro-batch's loss was scaled by ``1/M`` in its backward; the
   stage's live replicas SUM their gradients and multiply by ``1/D`` (D = nominal pipelines). The stage
   gradient is then the sum over all ``D x M`` global micro-batches normalized by their count, however the
   micro-batches were spread over replicas. Without absent workers this is exactly DeepSpeed's
   ``allreduce_bucket`` (sum, then ``mul_(1/D)``). The last stage appends its loss sum to the same buffer.
   When a worker of the stage serves several pipelines (re-routing), it keeps one gradient sum *per owner
   pipeline* (:meth:`StaggeredOptimizer.accumulating_for`); the replicas all-reduce a ``[D, N]`` table in
   which each row is non-zero on one rank only (so the all-reduce adds only zeros to it: exact) and add the
   rows in pipeline order. With D = 2 that equals DeepSpeed's all-reduce of the two replicas' sums bit for
   bit (``a + b == b + a``). With D > 2 the all-reduce's own order (gloo's ring, which depends on each
   replica's position in the group) is not the pipeline order, so the table is used with or without
   re-routing (``canonical_order``): the stage gradient is then the same floating-point sum for every
   membership, and a run with failures ends at the failure-free model bit for bit. While every pipeline has
   its own replica (no failure), the same sums come from a reduce-scatter and an all-gather in which each
   replica adds one slice of the rows in pipeline order: the volume of a ring all-reduce. After a failure the
   table is all-reduced whole (D times the volume). ``benchmarks/reduction_order.py`` measures both.
2. **Clipping as DeepSpeed 0.19.8 does it.** DeepSpeed's ``clip_grad_norm_`` sums squared per-parameter
   norms over the pipeline group but counts only parameters of model-parallel rank 0, which for a
   ``PipelineModule`` is the *first stage*; it then averages the norm over the data-parallel group and
   scales every gradient by ``min(1, max_norm / (norm + 1e-6))``. :class:`ClipScope` selects that
   (``FIRST_STAGE``, identical results) or the norm over all stages (``WHOLE_MODEL``).
3. **No step is ever taken twice, nothing is copied.** A stage steps as soon as it holds everything the
   step needs: its reduced gradients and, with clipping on, the clipping norm. With ``FIRST_STAGE`` the first
   stage knows the norm itself; it *broadcasts* it (posted at its step, never waited for on its critical
   path) and steps at once. Every other stage waits for that norm at its own step. The wait costs little:
   the stage's next op (the next iteration's first forward) consumes an activation that the first stage
   computes only after its step, so the norm always arrives before the stage could do anything else, and
   the step itself runs in that window. With ``WHOLE_MODEL`` the per-stage contributions are summed by one
   all-reduce over every live worker, waited for at the step. ``synchronous`` has the same order
   (DeepSpeed's: reduce, norm, clip, step); ``staggered`` differs in *when* each stage steps (as soon as
   its own gradients are reduced and the norm is there), not in *what* it computes.
4. **Failure points.** Until :meth:`StaggeredOptimizer.step` has called ``optimizer.step()``, the stage's
   gradient rows of the iteration are kept as they were before the reduction (the reduced sums live in new
   tensors; :meth:`StaggeredOptimizer.revert` puts the rows back), so a failure anywhere in the reduction,
   the tied-weight sum or the norm exchange leaves a stage that can reduce again. Once stepped, the stage's
   iteration is final: its clipping contribution is kept for two iterations
   (:meth:`StaggeredOptimizer.share_committed_norm` serves it again when peers redo their part).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.pipe import TiedLayerSpec
from torch import nn

from ds_recycle.engine.devices import device_of
from ds_recycle.engine.layer_move import spec_parameters
from ds_recycle.engine.precision import MasterWeightOptimizer
from ds_recycle.engine.transport import Transport

__all__ = ["ClipScope", "StepOutcome", "StaggeredOptimizer", "NormLayout"]

logger = logging.getLogger(__name__)

_EPS = 1e-6  # DeepSpeed's clip_grad_norm_ epsilon

RowKey = tuple[int, int]
"""A gradient row: ``(pipeline, -1)`` for a pipeline's own sum, ``(pipeline, microbatch)`` for one re-routed
micro-batch."""


def _fold(rows: Iterable[torch.Tensor]) -> torch.Tensor:
    """``((r0 + r1) + r2) + ...``: the one fixed order every membership adds the rows in."""
    it = iter(rows)
    total = next(it).clone()
    for row in it:
        total = total + row
    return total


class ClipScope(enum.Enum):
    """Which stages' gradients make up the clipping norm."""

    FIRST_STAGE = "first_stage"
    """DeepSpeed 0.19.8's ``clip_grad_norm_`` on a ``PipelineModule``: only stage 0's parameters count."""
    WHOLE_MODEL = "whole_model"
    """Every stage's parameters count (the textbook global norm)."""


@dataclass(frozen=True)
class StepOutcome:
    """What one finished optimizer step did."""

    iteration: int
    norm: float | None
    """The clipping norm (None when clipping is off)."""
    clipped: bool
    """True when the gradients were scaled."""


@dataclass
class _Pending:
    iteration: int
    work: Any
    contribution: torch.Tensor
    norm: float | None = None
    clipped: bool = False


@dataclass(frozen=True)
class NormLayout:
    """Where each counted parameter of the job's own partition sits in the norm vector, by the stage that holds it
    in that partition (the first stage only with :attr:`ClipScope.FIRST_STAGE`, every stage with ``WHOLE_MODEL``).

    ``offsets[layer]`` is the first entry of that layer's trainable parameters, in ``parameters()`` order; a tied
    module (``TiedLayerSpec``) has one entry by its key, before its stage's layers, as ``PipelineModule`` registers
    its ``tied_modules`` first, counted on the first stage that holds the key (DeepSpeed marks the other copies
    ``ds_pipe_replicated``) and written by the worker holding the key's first layer (tied layers never move). Each
    stage's first replica writes the gradient norms of the counted parameters it holds, and a presence flag, into a
    vector of ``2 * size`` entries that every live worker all-reduces (one writer an entry: exact); a stage's squared
    norm is then ``stack(norms).pow(2).sum()`` over the present entries of its range, in order: the very sum that
    stage computes when it holds its own layers (:meth:`StaggeredOptimizer._stage_sq`), whatever the partition.
    """

    offsets: dict[int | str, int]
    size: int
    tied_first: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each counted tied key's first layer (its holder writes the key's entries)."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Each counted stage's entries, ``[start, stop)``, by stage."""

    @classmethod
    def of_layers(cls, specs: Sequence[Any], counted: int) -> NormLayout:
        """The first-stage layout: layers ``0`` to ``counted - 1`` of a ``PipelineModule``'s layer list."""
        return cls.of_stages(specs, (0, counted))

    @classmethod
    def of_stages(cls, specs: Sequence[Any], parts: Sequence[int]) -> NormLayout:
        """The layout of every stage of partition ``parts`` (``S + 1`` boundaries) of a layer list."""
        offsets: dict[int | str, int] = {}
        tied_first: dict[str, int] = {}
        ranges = []
        size = 0
        for s in range(len(parts) - 1):
            begin = size
            layers = range(parts[s], parts[s + 1])
            for index in layers:
                key = specs[index].key if isinstance(specs[index], TiedLayerSpec) else None
                if key is not None and key not in tied_first:
                    tied_first[key] = index
                    offsets[key] = size
                    size += len(spec_parameters(specs[index]))
            for index in layers:
                if not isinstance(specs[index], TiedLayerSpec):
                    offsets[index] = size
                    size += len(spec_parameters(specs[index]))
            ranges.append((begin, size))
        return cls(offsets, size, tied_first, tuple(ranges))

    def contribution(self, module: Any, writes: bool,
                     grad_of: Callable[[nn.Parameter], torch.Tensor | None] | None = None) -> torch.Tensor:
        """This worker's part of the vector (all zeros unless ``writes``: its stage's first replica); ``grad_of``:
        where a parameter's gradient is (its fp32 master's in bf16; default ``p.grad``)."""
        out = torch.zeros(2 * self.size, device=device_of(module))
        if not writes:
            return out
        start, stop = int(module._local_start), int(module._local_stop)
        held: list[tuple[int, nn.Module]] = [
            (self.offsets[key], module.tied_modules[key]) for key, first in self.tied_first.items()
            if start <= first < stop]
        for local, layer in enumerate(module.forward_funcs):
            index = start + local
            if index in self.offsets and isinstance(layer, nn.Module):
                held.append((self.offsets[index], layer))
        for at, layer in held:
            for k, p in enumerate(q for q in layer.parameters() if q.requires_grad):
                grad = p.grad if grad_of is None else grad_of(p)
                if grad is not None:
                    out[at + k] = grad.detach().float().norm(2.0)
                    out[self.size + at + k] = 1.0
        return out

    def total(self, reduced: torch.Tensor, stage: int | None = None) -> torch.Tensor:
        """The squared norm from the all-reduced vector: of every entry, or of ``stage``'s range."""
        begin, end = (0, self.size) if stage is None else self.ranges[stage]
        norms, present = reduced[begin:end], reduced[self.size + begin:self.size + end]
        kept = norms[present > 0]
        if kept.numel() == 0:
            return reduced.new_zeros(1, dtype=torch.float32)
        return kept.pow(2.0).sum().float().reshape(1)


class StaggeredOptimizer:
    """One stage's gradient reduction and optimizer step (see the module docstring)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int, pipelines: int,
                 transport: Transport | None, dp_ranks: list[int], max_norm: float,
                 scope: ClipScope = ClipScope.FIRST_STAGE, lr_scheduler: Any = None,
                 served: frozenset[int] = frozenset(), stage_rerouted: bool = False,
                 norm_source: int = 0, canonical_order: bool = True,
                 rerouted_pipelines: frozenset[int] = frozenset(), microbatches: int = 1,
                 rank: int | None = None, norm_layout: NormLayout | None = None,
                 norm_params: list[nn.Parameter] | None = None) -> None:
        self.module = module
        self.optimizer = optimizer
        self.stage = stage
        self.pipelines = pipelines
        self.transport = transport
        """How the reduction and the norm exchange travel (:mod:`ds_recycle.engine.transport`); None: a stage
        with one replica and no clipping, which never communicates."""
        self.dp_size = len(dp_ranks)
        self.max_norm = float(max_norm)
        self.scope = scope
        self.lr_scheduler = lr_scheduler
        self.counts = scope is ClipScope.WHOLE_MODEL or stage == 0
        self.rank = dist.get_rank() if rank is None else rank
        """This worker's global rank."""
        self.representative = self.rank == min(dp_ranks)
        self.norm_source = norm_source
        """Global rank that broadcasts the first stage's norm (``FIRST_STAGE``): its first live replica."""
        self._source_work: Any = None
        self._source_tensor: torch.Tensor | None = None
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.device = device_of(module)
        """Where the stage's parameters are: its reductions and norms are computed there."""
        self.master = optimizer if isinstance(optimizer, MasterWeightOptimizer) else None
        """bf16: the fp32 master weights (:mod:`ds_recycle.engine.precision`); None in fp32."""
        self.holders = [self.master.master_of(p) for p in self.params] if self.master is not None else self.params
        """Where the stage's accumulated and reduced gradients live: the fp32 masters in bf16, else the parameters."""
        self._pending: _Pending | None = None
        self._unreduced: dict[RowKey, list[torch.Tensor | None]] | None = None
        """The gradient rows as they were before this iteration's reduction, until the step (see :meth:`revert`)."""
        self._contributions: dict[int, torch.Tensor] = {}
        """This worker's clipping-norm contribution of its last two stepped iterations."""
        self.clipped_steps = 0
        """Steps whose gradients were clipped."""
        self.served = served
        """Owner pipelines of the micro-batches this worker processes."""
        self.stage_rerouted = stage_rerouted
        """True when some replica of this stage serves more than one pipeline (per-pipeline sums needed)."""
        self._bank: dict[RowKey, list[torch.Tensor | None]] = {}
        self.canonical_order = canonical_order
        """With more than 2 pipelines, reduce per-owner-pipeline rows added in pipeline order (the same sum
        whoever is alive) rather than the replicas' sums in the all-reduce's ring order (its rounding changes
        with the membership)."""
        self.rerouted_pipelines = rerouted_pipelines
        """Pipelines whose micro-batches at this stage are processed by workers of other pipelines (its owner
        is absent): each such micro-batch's weight gradient is a row of its own, wherever it is computed."""
        self.microbatches = microbatches
        self.dp_ranks = sorted(dp_ranks)
        self.norm_params = norm_params
        """Stage 0 holding more than its own layers (re-partitioned): the parameters of its own layers, the ones
        DeepSpeed's first-stage norm counts (None: all of the stage's)."""
        self.norm_layout = norm_layout
        """Set while the counted layers of the job's own partition are not where it has them (re-partitioned; with
        ``FIRST_STAGE`` only while some of stage 0's are elsewhere): the norm is then gathered per parameter from
        wherever the layers are (:class:`NormLayout`)."""

    # Communication, through the transport.
    def _net(self) -> Transport:
        if self.transport is None:
            raise RuntimeError(f"stage {self.stage}'s optimizer has no transport but must communicate")
        return self.transport

    def _all_reduce_stage(self, tensor: torch.Tensor) -> None:
        self._net().stage_all_reduce(tensor)

    def _all_to_all_stage(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self._net().stage_all_to_all(output, tensor)

    def _all_gather_stage(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self._net().stage_all_gather(outputs, tensor)

    def _broadcast_norm(self, tensor: torch.Tensor, src: int) -> Any:
        return self._net().post_broadcast(tensor, src)

    def _all_reduce_norm(self, tensor: torch.Tensor) -> Any:
        return self._net().post_all_reduce(tensor)

    def _wait(self, work: Any) -> None:
        self._net().wait(work, "clipping norm exchange")

    def _key(self, pipeline: int, microbatch: int) -> RowKey:
        """The gradient row micro-batch ``(pipeline, microbatch)`` accumulates into."""
        return (pipeline, microbatch) if pipeline in self.rerouted_pipelines else (pipeline, -1)

    @property
    def _banked(self) -> bool:
        """Whether weight gradients go to per-row banks rather than straight into ``p.grad``."""
        return len(self.served) > 1 or bool(self.served & self.rerouted_pipelines)

    def holder(self, param: nn.Parameter) -> nn.Parameter:
        """The tensor whose ``.grad`` holds ``param``'s accumulated gradient (its fp32 master in bf16)."""
        return self.master.master_of(param) if self.master is not None else param

    @contextlib.contextmanager
    def accumulating_for(self, pipeline: int, microbatch: int = -1) -> Iterator[None]:
        """Inside, weight gradients accumulate into their row: the owner pipeline's sum, or, for a micro-batch
        re-routed away from its owner, a row of its own (only when banked, see :meth:`_banked`).

        In bf16 the backward inside leaves the micro-batch's bf16 gradient on the parameters; on exit it is
        widened to fp32 and added to the row (DeepSpeed's high-precision accumulation), and cleared.
        """
        if self.master is not None:
            with self._accumulating_fp32(pipeline, microbatch):
                yield
            return
        if not self._banked:
            yield
            return
        bank = self._bank.setdefault(self._key(pipeline, microbatch), [None] * len(self.params))
        for p, g in zip(self.params, bank):
            p.grad = g
        try:
            yield
        finally:
            for n, p in enumerate(self.params):
                bank[n] = p.grad
                p.grad = None

    @contextlib.contextmanager
    def _accumulating_fp32(self, pipeline: int, microbatch: int) -> Iterator[None]:
        with self.setting_aside() as grads:
            yield
        self.add_to_row((pipeline, microbatch), grads)

    @contextlib.contextmanager
    def setting_aside(self) -> Iterator[list[torch.Tensor | None]]:
        """Inside, a backward's weight gradient stays out of every row: on exit the yielded list holds it, one
        entry per parameter (widened to fp32 in bf16), for :meth:`add_to_row` in its turn
        (:mod:`ds_recycle.engine.row_order`)."""
        kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        grads: list[torch.Tensor | None] = []
        try:
            yield grads
        finally:
            for p, have in zip(self.params, kept):
                g = p.grad
                grads.append(None if g is None else g.detach().float() if self.master is not None else g)
                p.grad = have

    def add_to_row(self, micro_batch: tuple[int, int], grads: list[torch.Tensor | None]) -> None:
        """Add one micro-batch's weight gradient (:meth:`setting_aside`) to its row: the same additions, in the
        same precision, as accumulating it there directly."""
        banked = self._banked
        row = (self._bank.setdefault(self._key(*micro_batch), [None] * len(self.params)) if banked
               else [h.grad for h in self.holders])
        for n, g in enumerate(grads):
            if g is not None:
                have = row[n]
                row[n] = g if have is None else have.add_(g)
        if not banked:
            for h, g in zip(self.holders, row):
                h.grad = g

    def partial_rows(self) -> dict[RowKey, list[torch.Tensor | None]]:
        """The weight gradients accumulated so far in this iteration, per row (not consumed)."""
        if self._unreduced is not None:  # reduced but not stepped: the rows as they were before the reduction
            return {k: list(v) for k, v in self._unreduced.items()}
        if not self._banked:
            return {(d, -1): [p.grad for p in self.holders] for d in self.served}
        return {k: list(grads) for k, grads in self._bank.items()}

    def adopt_rows(self, rows: dict[RowKey, list[torch.Tensor | None]]) -> None:
        """Continue accumulating from ``rows`` (another stepper's :meth:`partial_rows` on the same parameters)."""
        unknown = {d for d, _ in rows} - set(self.served)
        if unknown:
            raise ValueError(f"gradient sums of pipelines {sorted(unknown)} handed to a worker that serves "
                             f"{sorted(self.served)}")
        if not self._banked:
            own = next(iter(rows.values()), None)
            for n, p in enumerate(self.holders):
                p.grad = own[n] if own is not None else None
            return
        self._bank = {self._key(d, i): list(grads) for (d, i), grads in rows.items()}
        for p in self.holders:
            p.grad = None

    def _layout(self) -> list[RowKey]:
        """Rows of the reduction table, in the order they are added: pipeline by pipeline, and within a
        re-routed pipeline micro-batch by micro-batch (the order its owner accumulates them in)."""
        return [(d, i) for d in range(self.pipelines)
                for i in (range(self.microbatches) if d in self.rerouted_pipelines else (-1,))]

    def _rows(self) -> dict[RowKey, list[torch.Tensor]]:
        """This worker's gradient rows."""
        if not self._banked:
            grads = [p.grad.data if p.grad is not None else torch.zeros_like(p) for p in self.holders]
            return {(pipeline, -1): grads for pipeline in self.served} or {(0, -1): grads}
        bank = self._bank  # emptied once the all-reduce succeeded: a failure during it leaves the sums intact
        return {k: [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, self.holders)]
                for k, grads in bank.items()}

    # 1. gradient all-reduce
    def reduce(self, loss_sum: torch.Tensor | None) -> torch.Tensor | None:
        """SUM-all-reduce the stage gradients (and ``loss_sum``) over the live replicas, scale by 1/D.

        Returns the summed loss over the stage's replicas (None when ``loss_sum`` is None). The reduced
        gradients are new tensors: the rows stay as they were until the step (see :meth:`revert`).
        """
        self._unreduced = self.partial_rows()
        if self.stage_rerouted or (self.canonical_order and self.pipelines > 2):
            return self._reduce_rows(loss_sum)
        grads = [p.grad.data if p.grad is not None else torch.zeros_like(p) for p in self.holders]
        parts = grads + ([loss_sum.detach().reshape(1).to(grads[0].dtype)] if loss_sum is not None else [])
        flat = torch.cat([t.reshape(-1) for t in parts])
        if self.dp_size > 1:
            self._all_reduce_stage(flat)
        total_loss = flat[-1].clone() if loss_sum is not None else None
        flat = flat[:flat.numel() - (1 if loss_sum is not None else 0)]
        flat.mul_(1.0 / self.pipelines)
        offset = 0
        for p, g in zip(self.holders, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
        return total_loss

    def revert(self) -> None:
        """Undo a reduction whose step was not taken (a failure came first): the rows as before it."""
        rows, self._unreduced = self._unreduced, None
        if rows is not None:
            self.adopt_rows(rows)

    def _own_row_only(self) -> bool:
        """Every pipeline has its own live replica, which holds only its own row (failure-free, D > 2)."""
        if self._banked or self.rerouted_pipelines or len(self.dp_ranks) != self.pipelines:
            return False
        return self.served == {self.dp_ranks.index(self.rank)}

    def _reduce_own_rows(self, loss_sum: torch.Tensor | None) -> torch.Tensor | None:
        """The canonical sum at the cost of a ring all-reduce: a reduce-scatter then an all-gather, in which the
        replica of rank position ``j`` (pipeline ``j``) adds slice ``j`` of the D rows in pipeline order.

        Same values as :meth:`_reduce_rows` (each element is the same fold), half the table's volume twice over:
        every replica sends and receives ``2 (D - 1) / D`` of its gradients, as a ring all-reduce does.
        """
        grads = [p.grad.data if p.grad is not None else torch.zeros_like(p) for p in self.holders]
        loss = loss_sum.detach().reshape(1).to(grads[0].dtype) if loss_sum is not None else torch.zeros(1, device=self.device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss])
        d, n = self.pipelines, flat.numel()
        chunk = -(-n // d)
        send = torch.zeros(d * chunk, device=self.device)
        send[:n] = flat
        received = torch.empty(d * chunk, device=self.device)
        self._all_to_all_stage(received, send)
        mine = _fold(received.view(d, chunk)[j] for j in range(d))
        gathered = [torch.empty(chunk, device=self.device) for _ in range(d)]
        self._all_gather_stage(gathered, mine)
        total = torch.cat(gathered)[:n]
        total_loss = total[n - 1].clone() if loss_sum is not None else None
        total = total[:n - 1].mul_(1.0 / self.pipelines)
        offset = 0
        for p in self.holders:
            p.grad = total[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return total_loss

    def _reduce_rows(self, loss_sum: torch.Tensor | None) -> torch.Tensor | None:
        if self.dp_size > 1 and self._own_row_only():
            return self._reduce_own_rows(loss_sum)
        rows = self._rows()
        layout = self._layout()
        index = {k: n for n, k in enumerate(layout)}
        numel = sum(p.numel() for p in self.params)
        table = torch.zeros(len(layout), numel + 1, device=self.device)
        for key, grads in rows.items():
            table[index[key], :numel] = torch.cat([g.reshape(-1) for g in grads])
        if loss_sum is not None:
            table[0, numel] = loss_sum.detach().reshape(())
        if self.dp_size > 1:
            self._all_reduce_stage(table)
        self._bank = {}
        flat = _fold(_fold(table[index[(d_, i)]] for d_, i in layout if d_ == d) for d in range(self.pipelines))
        total_loss = flat[numel].clone() if loss_sum is not None else None
        flat = flat[:numel].mul_(1.0 / self.pipelines)
        offset = 0
        for p in self.holders:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return total_loss

    # 2. norm
    def _stage_sq(self) -> torch.Tensor:
        """Squared norm of this stage's (reduced) gradients, as DeepSpeed's ``clip_grad_norm_`` sums it."""
        if self.master is not None:  # bf16 (BF16_Optimizer): the fp32 gradients, tied copies after the first skipped
            norms = [h.grad.detach().float().norm(2.0) for p, h in zip(self.params, self.holders)
                     if h.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
        else:
            counted = self.module.parameters() if self.norm_params is None else self.norm_params
            norms = [p.grad.data.detach().float().norm(2.0) for p in counted if p.grad is not None]
        if not norms:
            return torch.zeros(1, device=self.device)
        return torch.stack(norms).pow(2.0).sum().float().reshape(1)

    def _coefficient(self, total_sq: torch.Tensor) -> tuple[torch.Tensor, float]:
        norm = total_sq.pow(1.0 / 2.0)
        if self.master is not None:  # BF16_Optimizer: max_norm / (norm + eps), the norm of the reduced gradients
            return torch.clamp(torch.tensor([self.max_norm], device=self.device) / (norm + _EPS), max=1.0), float(norm)
        scaled = norm * 1.0 / float(self.pipelines)
        averaged = scaled.clone()
        for _ in range(self.pipelines - 1):  # DeepSpeed's SUM all-reduce of the D identical scaled norms
            averaged = averaged + scaled
        coef = torch.tensor([self.max_norm], device=self.device) / (averaged + _EPS)
        return torch.min(torch.tensor([1.0], device=self.device), coef), float(averaged)

    # 3. step
    def step(self, iteration: int, synchronous: bool) -> None:
        """Step the optimizer for ``iteration`` (gradients already reduced), once the norm is known.

        ``synchronous`` is accepted for the instruction's sake: every step waits for what it needs (see the
        module docstring), so both modes compute the same step.
        """
        if self._pending is not None:
            raise RuntimeError(f"optimizer step of iteration {iteration} before the step of iteration "
                               f"{self._pending.iteration} was finished; FinishOptimizerStep is missing")
        if self.max_norm <= 0.0:
            self.optimizer.step()
            nothing = torch.zeros(1, device=self.device)
            self._stepped(_Pending(iteration, None, nothing), nothing.clone())
            return
        if self.norm_layout is not None:
            self._step_by_layout(iteration, self.norm_layout)
            return
        local_sq = self._stage_sq() if self.counts else torch.zeros(1, device=self.device)
        if self.scope is ClipScope.FIRST_STAGE:
            contribution = local_sq.clone()
            if self._source_work is not None:  # the previous broadcast reached everyone long ago
                self._wait(self._source_work)
            work = self._broadcast_norm(contribution, self.norm_source)
            if self.rank == self.norm_source:
                self._source_work, self._source_tensor, work = work, contribution, None
            kept = local_sq.clone() if self.stage == 0 else contribution
        else:
            contribution = local_sq.clone() if self.representative else torch.zeros(1, device=self.device)
            kept = contribution.clone()
            work = self._all_reduce_norm(contribution)
        pending = _Pending(iteration, work, contribution)
        if self.scope is ClipScope.FIRST_STAGE and self.stage == 0:
            # Every first-stage replica holds the same reduced gradients: the norm is known here already (a
            # replica that is not the source still takes part in the broadcast, waited for at finish()).
            pending.norm, pending.clipped = self._clip_and_step(self._coefficient(local_sq))
        else:
            self._wait(work)
            pending.work = None
            pending.norm, pending.clipped = self._clip_and_step(self._coefficient(contribution))
        self._stepped(pending, kept)

    def _step_by_layout(self, iteration: int, layout: NormLayout) -> None:
        """The step while layers are not where the job's own partition has them: the counted parameters' norms are
        gathered per parameter (:class:`NormLayout`), then summed as each stage sums its own. With ``WHOLE_MODEL``
        each stage's first replica then takes part in the usual all-reduce of the stage sums, so the norm is the
        very number the unmoved job computes. Keeps what it contributed to both exchanges (one vector)."""
        vector = layout.contribution(self.module, self.representative, self.holder_grad)
        kept = vector.clone()
        self._wait(self._all_reduce_norm(vector))
        if self.scope is ClipScope.FIRST_STAGE:
            pending = _Pending(iteration, None, kept)
            pending.norm, pending.clipped = self._clip_and_step(self._coefficient(layout.total(vector)))
            self._stepped(pending, kept)
            return
        local_sq = layout.total(vector, self.stage) if self.representative else torch.zeros(1, device=self.device)
        kept = torch.cat([kept, local_sq])
        self._wait(self._all_reduce_norm(local_sq))
        pending = _Pending(iteration, None, kept)
        pending.norm, pending.clipped = self._clip_and_step(self._coefficient(local_sq))
        self._stepped(pending, kept)

    def holder_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s reduced gradient (on its fp32 master in bf16)."""
        return self.holder(param).grad

    def _stepped(self, pending: _Pending, contribution: torch.Tensor) -> None:
        self._pending = pending
        self._unreduced = None
        self._contributions[pending.iteration] = contribution
        for old in [k for k in self._contributions if k < pending.iteration - 1]:
            del self._contributions[old]

    def share_committed_norm(self, iteration: int) -> None:
        """Take part in ``iteration``'s norm exchange again, with the contribution kept from its step.

        For a worker whose stage had stepped ``iteration`` before a failure, while peers of other stages redo
        their part of it and need the norm (the exchange is collective over every live worker).
        """
        if self.max_norm <= 0.0:
            return
        kept = self._contributions.get(iteration)
        if kept is None:
            raise RuntimeError(f"no clipping-norm contribution of iteration {iteration} here (held: "
                               f"{sorted(self._contributions)})")
        tensor = kept.clone()
        if self.norm_layout is not None and self.scope is ClipScope.WHOLE_MODEL:  # the vector, then the stage sums
            self._wait(self._all_reduce_norm(tensor[:-1].clone()))
            tensor = tensor[-1:].clone()
        if self.scope is ClipScope.FIRST_STAGE and self.norm_layout is None:
            if self._source_work is not None:
                self._wait(self._source_work)
                self._source_work = None
            work = self._broadcast_norm(tensor, self.norm_source)
            if self.rank == self.norm_source:
                self._source_work, self._source_tensor = work, tensor
                return
        else:
            work = self._all_reduce_norm(tensor)
        self._wait(work)

    def kept_contributions(self) -> dict[int, torch.Tensor]:
        """The contributions :meth:`share_committed_norm` serves (handed to a replica brought up to date)."""
        return dict(self._contributions)

    def adopt_contributions(self, kept: dict[int, torch.Tensor]) -> None:
        self._contributions = dict(kept)

    def settle(self) -> None:
        """Complete a step already taken, without waiting for anything (before the groups are replaced)."""
        if self._pending is not None:
            self._pending.work = None
            self.finish()
        self._source_work = None

    def _clip_and_step(self, coef_norm: tuple[torch.Tensor, float]) -> tuple[float, bool]:
        coef, norm = coef_norm
        for p in self.holders if self.master is not None else self.module.parameters():
            if p.grad is not None:
                p.grad.data.mul_(coef)
        self.optimizer.step()
        return norm, bool(coef.item() < 1.0)

    def close(self) -> None:
        """Wait for this rank's last norm broadcast (call when training ends)."""
        if self._source_work is not None:
            self._wait(self._source_work)
            self._source_work = None

    def pending_norm(self) -> float | None:
        """The clipping norm of the step taken but not finished yet (None: none pending, or clipping off)."""
        return None if self._pending is None else self._pending.norm

    def finish(self) -> StepOutcome | None:
        """Complete the pending step: its part in the norm exchange, zero the gradients, step the schedule."""
        pending = self._pending
        if pending is None:
            return None
        if pending.work is not None:  # a first-stage replica's part in the norm broadcast
            self._wait(pending.work)
            pending.work = None
        norm, clipped = pending.norm, pending.clipped
        self.clipped_steps += int(clipped)
        logger.debug("iteration %d: norm %s, clipped %s", pending.iteration, norm, clipped)
        for p in self.module.parameters():
            p.grad = None
        for p in self.holders:
            p.grad = None
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._pending = None
        return StepOutcome(pending.iteration, norm, clipped)
