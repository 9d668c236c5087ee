"""Split backward: B computes input gradients only, W computes weight gradients module by module.

Every *owner* module (a module with trainable parameters of its own) gets a forward hook. During a
stage's forward, the hooks record each owner's output tensor. Then:

- **B** (:func:`backward_input`): one ``torch.autograd.grad`` from the stage output to the stage input
  (``retain_graph=True``). Autograd runs only the input-gradient half of each node (no weight-gradient
  matmul, no ``.grad`` touched); a gradient hook on every recorded owner output keeps
  ``d loss / d output`` as it flows past (no copy). Owner outputs off the path to the input (and every
  owner on the first stage, whose input is token ids) are asked for explicitly.
- **W** (:meth:`WeightGradWork.run`): for each owner, ``torch.autograd.backward(output, grad,
  inputs=own parameters)``. That walks only the owner's own nodes (e.g. the ``addmm`` of a ``Linear``),
  so W costs the weight-gradient work alone instead of re-walking the stage's input-gradient chain.

The per-owner split is exact when each owner's parameters reach the loss only through that owner's
output in one call. When that does not hold (a module called twice in one forward, a parameter shared by
two owners, an output that is neither a tensor nor a flat tuple of tensors, or one modified in place, an owner whose
parameters are used without calling it, as a tied head reads the embedding's weight), the
micro-batch falls back to one whole-stage W (``backward(output, grad, inputs=all parameters)``), which is
always exact.

**Tuples.** A stage's input and output may be a tuple of tensors (:data:`~ds_recycle.engine.p2p.Payload`,
e.g. ``(hidden, attention_mask)``). Only floating-point tensors carry gradients: the gradient of a tuple
is the tuple of the gradients of its floating-point elements, in order (zeros for an element the stage
does not depend on, so both ends always exchange the same tensors); other tensors (masks, ids) get none.
An output element that does not require a gradient is left out of the autograd roots. An owner that
returns a tuple is split per owner too, over its floating-point outputs.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ds_recycle.engine.p2p import Payload

__all__ = ["OwnerCapture", "Captured", "WeightGradWork", "backward_input", "backward_fused", "grad_buffers"]

logger = logging.getLogger(__name__)


@dataclass
class Captured:
    """Owner outputs recorded during one forward."""

    outputs: list[tuple[nn.Module, tuple[torch.Tensor, ...], tuple[int, ...]]] = field(default_factory=list)
    """``(owner, its outputs that require grad, their versions at capture)`` in call order."""
    exact: bool = True
    """False when the per-owner split would be wrong for this forward (see the module docstring)."""
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """Gradient of ``outputs[i]``'s ``j``-th tensor under ``(i, j)``, caught by the hooks during B."""

    def keep(self, key: tuple[int, int], grad: torch.Tensor) -> None:
        self.grads[key] = grad

    def unchanged(self) -> bool:
        """No recorded output was modified in place after its owner returned it."""
        return all(t._version == v for _, tensors, versions in self.outputs for t, v in zip(tensors, versions))


def _owner_outputs(output: object) -> tuple[torch.Tensor, ...] | None:
    """The tensors of an owner's output (a tensor, or a flat tuple/list of tensors and Nones); None otherwise."""
    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, (tuple, list)) and all(t is None or isinstance(t, torch.Tensor) for t in output):
        return tuple(t for t in output if t is not None)
    return None


class OwnerCapture:
    """Forward hooks on every owner module of a stage; :meth:`capture` records one forward."""

    def __init__(self, module: nn.Module) -> None:
        self.owners: list[nn.Module] = []
        self.params: dict[int, list[nn.Parameter]] = {}
        seen: dict[int, nn.Module] = {}
        self.shared = False
        for m in module.modules():
            own = [p for p in m.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            for p in own:
                if id(p) in seen:
                    self.shared = True
                seen[id(p)] = m
            self.owners.append(m)
            self.params[id(m)] = own
            m.register_forward_hook(self._hook)
        self.all_params = [p for m in self.owners for p in self.params[id(m)]]
        self.per_owner = True
        """False: every W is one whole-stage pass (a stage with recomputed segments: one recompute per W)."""
        self._active: Captured | None = None
        if self.shared:
            logger.info("a parameter is shared by two modules; W runs over the whole stage")

    def _hook(self, module: nn.Module, args: object, output: object) -> None:
        cap = self._active
        if cap is None:
            return
        tensors = _owner_outputs(output)
        if tensors is None or any(m is module for m, _, _ in cap.outputs):
            cap.exact = False
            return
        tensors = tuple(t for t in tensors if t.requires_grad)
        if not tensors:
            return
        index = len(cap.outputs)
        for j, tensor in enumerate(tensors):
            tensor.register_hook(functools.partial(cap.keep, (index, j)))
        cap.outputs.append((module, tensors, tuple(t._version for t in tensors)))

    @contextmanager
    def capture(self) -> Iterator[Captured]:
        cap = Captured(exact=not self.shared and self.per_owner)
        self._active = cap
        try:
            yield cap
        finally:
            self._active = None
        if cap.exact and len({id(m) for m, _, _ in cap.outputs}) < len(self.owners):
            # An owner whose forward did not run may still have its parameters in the graph (a TiedLayerSpec head
            # reads the embedding's weight through its forward_fn): only a whole-stage W is sure to reach them.
            cap.exact = False


@dataclass
class WeightGradWork:
    """The W of one micro-batch: ``(tensors, grads, parameters)`` autograd passes, run in order."""

    passes: list[tuple[list[torch.Tensor], list[torch.Tensor], list[nn.Parameter]]]

    def run(self) -> None:
        for tensors, grads, params in self.passes:
            torch.autograd.backward(tensors, grads, inputs=params)
        self.passes = []


def _roots(output: Payload, grad_output: Payload | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Autograd roots of B/W: the stage output's tensors that require grad, and their incoming gradients."""
    if isinstance(output, torch.Tensor):
        if grad_output is None:
            return [output], None
        assert isinstance(grad_output, torch.Tensor), "a tensor output gets one tensor gradient"
        return [output], [grad_output]
    floats = [t for t in output if t.is_floating_point()]
    grads = (grad_output,) if isinstance(grad_output, torch.Tensor) else grad_output
    if grads is None or len(grads) != len(floats):
        raise ValueError(f"a tuple stage output with {len(floats)} floating-point tensors needs as many gradients, "
                         f"got {'none' if grads is None else len(grads)}")
    pairs = [(t, g) for t, g in zip(floats, grads) if t.requires_grad]
    return [t for t, _ in pairs], [g for _, g in pairs]


def _differentiable(stage_input: Payload | None) -> list[torch.Tensor]:
    """The stage input's tensors that want a gradient."""
    if stage_input is None:
        return []
    tensors = [stage_input] if isinstance(stage_input, torch.Tensor) else list(stage_input)
    return [t for t in tensors if t.is_floating_point() and t.requires_grad]


def _input_grad(stage_input: Payload | None, grads: dict[int, torch.Tensor | None]) -> Payload | None:
    """Package the input gradients as the sender expects them (see the module docstring)."""
    if stage_input is None:
        return None
    if isinstance(stage_input, torch.Tensor):
        if not stage_input.requires_grad:
            return None
        grad = grads.get(id(stage_input))
        return torch.zeros_like(stage_input) if grad is None else grad
    out = []
    for t in stage_input:
        if t.is_floating_point():
            grad = grads.get(id(t))
            out.append(torch.zeros_like(t) if grad is None else grad)
    return tuple(out)


def grad_buffers(output: Payload) -> Payload:
    """Empty buffers for the gradient of a stage output (one per floating-point tensor of a tuple)."""
    if isinstance(output, torch.Tensor):
        return torch.empty_like(output)
    return tuple(torch.empty_like(t) for t in output if t.is_floating_point())


def backward_input(output: Payload, grad_output: Payload | None, stage_input: Payload | None,
                   captured: Captured, capture: OwnerCapture) -> tuple[Payload | None, WeightGradWork]:
    """B of one micro-batch: the gradient of ``stage_input`` (None if it needs none) and the pending W.

    ``output`` is the stage output (the scaled loss on the last stage, with ``grad_output`` None); a tuple
    output comes with one gradient per floating-point tensor.
    """
    roots, grad_root = _roots(output, grad_output)
    wanted = _differentiable(stage_input)
    if not roots:  # nothing of the output depends on anything differentiable
        return _input_grad(stage_input, {}), WeightGradWork([])
    whole_stage = WeightGradWork([(roots, grad_root or [torch.ones_like(roots[0])], capture.all_params)])
    owners = captured.outputs
    exact = captured.exact and captured.unchanged()
    if not wanted and not (exact and owners):  # nothing upstream wants a gradient: W does everything
        return _input_grad(stage_input, {}), whole_stage
    captured.grads.clear()
    found: dict[int, torch.Tensor | None] = {}
    if wanted:
        grads = torch.autograd.grad(roots, wanted, grad_root, retain_graph=True, allow_unused=True)
        found = {id(t): g for t, g in zip(wanted, grads)}
    input_grad = _input_grad(stage_input, found)
    if not exact:
        return input_grad, whole_stage
    keys = [(i, j) for i, (_, tensors, _) in enumerate(owners) for j in range(len(tensors))]
    missing = [k for k in keys if k not in captured.grads]
    if missing:  # off the input's path (or no input gradient at all): ask for those outputs explicitly
        asked = torch.autograd.grad(roots, [owners[i][1][j] for i, j in missing], grad_root, retain_graph=True,
                                    allow_unused=True)
        captured.grads.update({k: g for k, g in zip(missing, asked) if g is not None})
    passes = []
    for i, (module, tensors, _) in enumerate(owners):
        caught = [(t, captured.grads[(i, j)]) for j, t in enumerate(tensors) if (i, j) in captured.grads]
        if caught:
            passes.append(([t for t, _ in caught], [g for _, g in caught], capture.params[id(module)]))
    captured.grads = {}
    return input_grad, WeightGradWork(passes)


def backward_fused(output: Payload, grad_output: Payload | None, stage_input: Payload | None,
                   capture: OwnerCapture) -> Payload | None:
    """B and W of one micro-batch in one pass (DeepSpeed's backward); returns the input gradient."""
    roots, grad_root = _roots(output, grad_output)
    wanted = _differentiable(stage_input)
    if roots:
        torch.autograd.backward(roots, grad_root, inputs=[*wanted, *capture.all_params])
    found: dict[int, torch.Tensor | None] = {}
    for t in wanted:
        found[id(t)], t.grad = t.grad, None
    return _input_grad(stage_input, found)
