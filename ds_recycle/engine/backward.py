"""Split backward: B computes input gradients only, W computes weight gradients from the nearest known gradients.

Every *owner* module (a module with trainable parameters of its own) gets forward hooks that mark the edges of
its inputs and outputs in the autograd graph. Then:

- **B** (:func:`backward_input`): one ``torch.autograd.grad`` from the stage output to the stage input
  (``retain_graph=True``). Autograd runs only the input-gradient half of each node (no weight-gradient matmul, no
  ``.grad`` touched); a gradient hook on every marked tensor keeps ``d loss / d tensor`` as it flows past (no
  copy). Marked edges off the path to the input (every one on the first stage, whose input is token ids) are asked
  for explicitly when W needs them.
- **W** (:meth:`WeightGradWork.run`): the parameters are grouped by their nearest *dominating* marked edge, the one
  every path from the stage output to them goes through (:mod:`ds_recycle.engine.autograd_graph`, one sweep of the
  micro-batch's graph); one ``torch.autograd.backward(edge, its gradient, inputs=the group)`` per group. That
  walks only the nodes between the edge and the parameters: a ``Linear``'s weight-gradient matmul from its output,
  a layer scale's multiply from the child ``Linear``'s input. Parameters no marked edge dominates (a tied head
  reading the embedding's weight outside the embedding's call, a weight used on two inputs) start at the stage
  output: the *root* pass, which walks the nodes from there down to them.

That is the fused backward's gradient bit for bit for any graph (``tests/engine/test_backward_fuzz.py``): nesting,
a module called twice, parameters shared by two modules or read outside them, frozen parts, custom autograd
Functions, in-place changes after a module returned, a non-reentrant checkpoint inside a layer. Every pass keeps
the graph (``retain_graph=True``); it goes when the W is done.

**What each path costs** (W per micro-batch): a group started at a marked edge costs the nodes between that edge
and its parameters (for a ``Linear``, its weight-gradient matmul; that is all W is); the root pass costs the
nodes from the stage output down to its parameters, so input-gradient work again for a parameter deep in the
stage. The sweep costs one Python visit per autograd edge (``benchmarks/split_paths.py`` measures all three).

**Stages the split cannot run.** A function whose backward calls ``torch.autograd.backward`` itself (a reentrant
checkpoint: ``torch.utils.checkpoint(..., use_reentrant=True)``, DeepSpeed's ``checkpointing.checkpoint``) hides
its parameters from the outer graph and refuses ``torch.autograd.grad``. :func:`backward_input` raises
:class:`SplitUnsupported` before any gradient is accumulated when B meets one, or when some trainable parameters
are out of the graph's reach while a custom autograd Function is in it; the engine then runs that stage's
backward fused from there on (:func:`backward_fused` with ``plain=True``: DeepSpeed's own
``torch.autograd.backward``; W is empty, so the stage's bubbles are not filled).

**Tuples.** A stage's input and output may be a tuple of tensors (:data:`~ds_recycle.engine.p2p.Payload`,
e.g. ``(hidden, attention_mask)``). Only floating-point tensors carry gradients: the gradient of a tuple
is the tuple of the gradients of its floating-point elements, in order (zeros for an element the stage
does not depend on, so both ends always exchange the same tensors); other tensors (masks, ids) get none.
An output element that does not require a gradient is left out of the autograd roots.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ds_recycle.engine.autograd_graph import ROOT, dominators
from ds_recycle.engine.p2p import Payload

__all__ = ["OwnerCapture", "Captured", "Pass", "SplitUnsupported", "WeightGradWork", "backward_input",
           "backward_fused", "grad_buffers"]

logger = logging.getLogger(__name__)


class SplitUnsupported(RuntimeError):
    """This stage's backward cannot be split into B and W (see the module docstring); nothing was accumulated."""


@dataclass
class Captured:
    """The marked edges of one forward and, after B, their gradients."""

    edges: list[GradientEdge] = field(default_factory=list)
    """Each marked tensor's edge, in the order marked (one entry per edge)."""
    index: dict[tuple[object, int], int] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """Gradient of ``edges[i]`` under ``i``, caught by the hooks during B."""
    closed: bool = False
    """W is planned: later passes over the marked tensors keep nothing."""

    def keep(self, i: int, grad: torch.Tensor) -> None:
        if not self.closed:
            self.grads[i] = grad

    def mark(self, tensor: torch.Tensor) -> None:
        """Mark ``tensor``'s edge (once per edge); its hook fires with this version's gradient even if the tensor
        is changed in place later."""
        if not (tensor.requires_grad and tensor.is_floating_point()):
            return
        edge = get_gradient_edge(tensor)
        key = (edge.node, edge.output_nr)
        if key in self.index:
            return
        self.index[key] = len(self.edges)
        tensor.register_hook(functools.partial(self.keep, len(self.edges)))
        self.edges.append(edge)

    def clear(self) -> None:
        """Drop the edges (they reference the graph, whose hooks reference this object: a cycle)."""
        self.edges, self.index, self.grads = [], {}, {}


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors of a module's argument or result: a tensor, or a flat tuple or list holding some."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list)):
                yield from (t for t in item if isinstance(t, torch.Tensor))


class OwnerCapture:
    """Forward hooks on every owner module of a stage; :meth:`capture` records one forward."""

    def __init__(self, module: nn.Module) -> None:
        self.owners: list[nn.Module] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        unique: dict[int, nn.Parameter] = {}
        for m in module.modules():
            own = [p for p in m.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            unique.update((id(p), p) for p in own)
            self._handles += [m.register_forward_pre_hook(self._before), m.register_forward_hook(self._after)]
            self.owners.append(m)
        self.all_params = list(unique.values())
        self.per_owner = True
        """False: every W is one pass from the stage output (a stage with recomputed segments: one recompute per W)."""
        self.fused = False
        """True once the split met a stage it cannot run (:class:`SplitUnsupported`): B does the whole backward."""
        self._active: Captured | None = None

    def close(self) -> None:
        """Remove the hooks (the stage's modules changed: a new capture takes over)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if self._active is not None:
            for tensor in _tensors(args):
                self._active.mark(tensor)

    def _after(self, module: nn.Module, args: object, output: object) -> None:
        if self._active is not None:
            for tensor in _tensors(output):
                self._active.mark(tensor)

    @contextmanager
    def capture(self) -> Iterator[Captured]:
        cap = Captured()
        self._active = cap
        try:
            yield cap
        finally:
            self._active = None


class Pass(NamedTuple):
    """One W autograd pass."""

    roots: list[torch.Tensor] | list[GradientEdge]
    grads: list[torch.Tensor]
    params: list[nn.Parameter]
    """The parameters it accumulates into."""
    from_root: bool
    """From the stage output (the root pass) rather than from a marked edge."""


@dataclass
class WeightGradWork:
    """The W of one micro-batch: autograd passes, run in order."""

    passes: list[Pass]

    def run(self) -> None:
        for p in self.passes:  # passes may walk the same nodes (a parent's parameter behind its child's)
            torch.autograd.backward(p.roots, p.grads, inputs=p.params, retain_graph=True)
        self.passes = []

    def kinds(self) -> tuple[int, int]:
        """``(passes from marked edges, parameters in the root pass)``."""
        return (sum(not p.from_root for p in self.passes),
                sum(len(p.params) for p in self.passes if p.from_root))


def _roots(output: Payload, grad_output: Payload | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Autograd roots of B/W: the stage output's tensors that require grad, and their incoming gradients."""
    if isinstance(output, torch.Tensor):
        if not output.requires_grad:  # a stage of frozen layers fed by token ids: nothing to differentiate
            return [], None
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
    output comes with one gradient per floating-point tensor. Raises :class:`SplitUnsupported` (nothing
    accumulated, the graph kept) for a stage the split cannot run.
    """
    roots, grad_root = _roots(output, grad_output)
    wanted = _differentiable(stage_input)
    if not roots:  # nothing of the output depends on anything differentiable
        return _input_grad(stage_input, {}), WeightGradWork([])
    seeds = grad_root or [torch.ones_like(roots[0])]
    captured.grads.clear()
    found: dict[int, torch.Tensor | None] = {}
    if wanted:
        grads = _grad(roots, wanted, grad_root)
        found = {id(t): g for t, g in zip(wanted, grads)}
    input_grad = _input_grad(stage_input, found)
    if not capture.per_owner:
        passes = [Pass(list(roots), seeds, capture.all_params, from_root=True)]
    else:
        passes = _plan_weight_passes(roots, grad_root, seeds, captured, capture)
    captured.closed = True
    captured.clear()
    return input_grad, WeightGradWork(passes)


def _grad(roots: list[torch.Tensor], inputs: list[torch.Tensor] | list[GradientEdge],
          grad_root: list[torch.Tensor] | None) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad`` keeping the graph; a function that refuses it raises :class:`SplitUnsupported`."""
    try:
        return torch.autograd.grad(roots, inputs, grad_root, retain_graph=True, allow_unused=True)
    except RuntimeError as error:
        if ".grad()" not in str(error):  # torch's and DeepSpeed's reentrant checkpoints say so
            raise
        raise SplitUnsupported(f"a function in this stage's graph refuses torch.autograd.grad ({error})") from error


def _plan_weight_passes(roots: list[torch.Tensor], grad_root: list[torch.Tensor] | None, seeds: list[torch.Tensor],
                        captured: Captured, capture: OwnerCapture) -> list[Pass]:
    """One pass per nearest dominating marked edge (its parameters), one from the stage output for the rest."""
    params = capture.all_params
    found = dominators([get_gradient_edge(r) for r in roots], captured.edges,
                       [get_gradient_edge(p).node for p in params])
    if found.functions and None in found.start:
        raise SplitUnsupported("a custom autograd Function runs in this stage and some of its trainable parameters "
                               "are out of the graph's reach (a reentrant checkpoint hides them)")
    groups: dict[int, list[nn.Parameter]] = {}
    for p, start in zip(params, found.start):
        if start is not None:
            groups.setdefault(start, []).append(p)
    missing = [i for i in groups if i != ROOT and i not in captured.grads]
    if missing:  # off the input's path (or no input gradient at all): ask for those edges explicitly
        asked = _grad(roots, [captured.edges[i] for i in missing], grad_root)
        captured.grads.update({i: g for i, g in zip(missing, asked) if g is not None})
    passes = [Pass([captured.edges[i]], [captured.grads[i]], group, from_root=False)
              for i, group in groups.items() if i != ROOT and i in captured.grads]
    if ROOT in groups:
        passes.append(Pass(list(roots), seeds, groups[ROOT], from_root=True))
    return passes


def backward_fused(output: Payload, grad_output: Payload | None, stage_input: Payload | None,
                   capture: OwnerCapture, plain: bool = False) -> Payload | None:
    """B and W of one micro-batch in one pass (DeepSpeed's backward); returns the input gradient.

    ``plain``: ``torch.autograd.backward`` without ``inputs=``, as DeepSpeed calls it, for a stage whose graph
    holds a reentrant function (:class:`SplitUnsupported`); it accumulates into every leaf that requires a grad.
    """
    roots, grad_root = _roots(output, grad_output)
    wanted = _differentiable(stage_input)
    if roots:
        torch.autograd.backward(roots, grad_root, inputs=None if plain else [*wanted, *capture.all_params])
    found: dict[int, torch.Tensor | None] = {}
    for t in wanted:
        found[id(t)], t.grad = t.grad, None
    return _input_grad(stage_input, found)
