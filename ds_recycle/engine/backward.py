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
two owners, an output that is not a tensor or was modified in place), the micro-batch falls back to one
whole-stage W (``backward(output, grad, inputs=all parameters)``), which is always exact.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["OwnerCapture", "Captured", "WeightGradWork", "backward_input", "backward_fused"]

logger = logging.getLogger(__name__)


@dataclass
class Captured:
    """Owner outputs recorded during one forward."""

    outputs: list[tuple[nn.Module, torch.Tensor, int]] = field(default_factory=list)
    """``(owner, output, output version at capture)`` in call order."""
    exact: bool = True
    """False when the per-owner split would be wrong for this forward (see the module docstring)."""
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """Gradients of ``outputs[i]`` caught by the hooks during B."""

    def keep(self, index: int, grad: torch.Tensor) -> None:
        self.grads[index] = grad


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
        self._active: Captured | None = None
        if self.shared:
            logger.info("a parameter is shared by two modules; W runs over the whole stage")

    def _hook(self, module: nn.Module, args: object, output: object) -> None:
        cap = self._active
        if cap is None:
            return
        if not isinstance(output, torch.Tensor) or any(m is module for m, _, _ in cap.outputs):
            cap.exact = False
            return
        if output.requires_grad:
            output.register_hook(functools.partial(cap.keep, len(cap.outputs)))
            cap.outputs.append((module, output, output._version))

    @contextmanager
    def capture(self) -> Iterator[Captured]:
        cap = Captured(exact=not self.shared)
        self._active = cap
        try:
            yield cap
        finally:
            self._active = None


@dataclass
class WeightGradWork:
    """The W of one micro-batch: ``(tensors, grads, parameters)`` autograd passes, run in order."""

    passes: list[tuple[list[torch.Tensor], list[torch.Tensor], list[nn.Parameter]]]

    def run(self) -> None:
        for tensors, grads, params in self.passes:
            torch.autograd.backward(tensors, grads, inputs=params)
        self.passes = []


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, stage_input: torch.Tensor | None,
                   captured: Captured, capture: OwnerCapture) -> tuple[torch.Tensor | None, WeightGradWork]:
    """B of one micro-batch: the gradient of ``stage_input`` (None if it needs none) and the pending W.

    ``output`` is the stage output (the scaled loss on the last stage, with ``grad_output`` None).
    """
    grad_root = [grad_output] if grad_output is not None else None
    whole_stage = WeightGradWork([([output], grad_root or [torch.ones_like(output)], capture.all_params)])
    want_input = stage_input is not None and stage_input.requires_grad
    owners = captured.outputs
    exact = captured.exact and all(t._version == v for _, t, v in owners)
    if not want_input and not (exact and owners):  # nothing upstream wants a gradient: W does everything
        return None, whole_stage
    captured.grads.clear()
    input_grad = None
    if want_input:
        assert stage_input is not None
        input_grad = torch.autograd.grad([output], [stage_input], grad_root, retain_graph=True)[0]
    if not exact:
        return input_grad, whole_stage
    missing = [i for i in range(len(owners)) if i not in captured.grads]
    if missing:  # off the input's path (or no input gradient at all): ask for those outputs explicitly
        found = torch.autograd.grad([output], [owners[i][1] for i in missing], grad_root, retain_graph=True,
                                    allow_unused=True)
        captured.grads.update({i: g for i, g in zip(missing, found) if g is not None})
    passes = [([tensor], [captured.grads[i]], capture.params[id(module)])
              for i, (module, tensor, _) in enumerate(owners) if i in captured.grads]
    captured.grads = {}
    return input_grad, WeightGradWork(passes)


def backward_fused(output: torch.Tensor, grad_output: torch.Tensor | None, stage_input: torch.Tensor | None,
                   capture: OwnerCapture) -> torch.Tensor | None:
    """B and W of one micro-batch in one pass (DeepSpeed's backward); returns the input gradient."""
    want_input = stage_input is not None and stage_input.requires_grad
    inputs = ([stage_input] if want_input else []) + capture.all_params
    torch.autograd.backward([output], [grad_output] if grad_output is not None else None, inputs=inputs)
    if not want_input:
        return None
    assert stage_input is not None
    grad, stage_input.grad = stage_input.grad, None
    return grad
